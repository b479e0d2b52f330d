//! The job loop's verify side: checking what reads bring back, fio's
//! verify phase after the writes, and `verify_backlog` (read back and
//! check every N written blocks while the job runs, fio's
//! `verify_backlog`), and `trim_percentage`'s trims of verified blocks.

use crate::completion::stop_requested;
use crate::engine::{Engine, Phase, MAX_FAILURE_TEXTS};
use crate::offsets::Req;
use crate::spec::Ddir;

impl Engine {
    /// Has `verify_backlog` writes' worth completed since the last check?
    pub(crate) fn backlog_due(&self) -> bool {
        self.backlog_every > 0 && self.backlog.len() as u64 >= self.backlog_every
    }

    /// Read back and check the writes of the backlog (nothing else is in
    /// flight: the work loop drained first, so the log is the truth).
    pub(crate) fn pump_backlog(&mut self) {
        let list = std::mem::take(&mut self.backlog);
        let log = self.log.as_ref();
        // Skip what a later trim or failed write made unknown.
        let mut rest: Vec<(u64, u64)> = list
            .into_iter()
            .rev()
            .filter(|&(off, _)| log.is_some_and(|l| l.seq_at(l.index(off)) != 0))
            .collect();
        loop {
            while !self.failed && self.inflight < self.depth {
                let Some((offset, len)) = rest.pop() else {
                    break;
                };
                let slot = self.free.pop().expect("a free slot below iodepth");
                self.issue(
                    slot,
                    Req {
                        dir: Ddir::Read,
                        offset,
                        len,
                    },
                );
            }
            self.flush_plug();
            if self.inflight == 0 {
                break;
            }
            self.wait_for_completions();
            self.process_completions(Phase::Verify);
        }
    }

    /// Verify the units a completed read brought back.
    pub(crate) fn check_read(&mut self, idx: usize, offset: u64, len: u64, against_log: bool) {
        let unit = self.unit as usize;
        let data = &self.slots[idx].buf.as_slice()[..len as usize];
        for (i, u) in data.chunks(unit).enumerate() {
            let off = offset + (i * unit) as u64;
            let want = match (&self.log, against_log) {
                (Some(log), true) => Some(log.seq_at(log.index(off))),
                _ => None,
            };
            self.verify_checked += 1;
            if let Err(f) = self.verifier.check(u, off, want) {
                self.verify_errors += 1;
                if self.verify_failures.len() < MAX_FAILURE_TEXTS {
                    self.verify_failures
                        .push(f.describe(&self.device_name, off, unit));
                }
                if self.first_error == 0 {
                    self.first_error = libc::EILSEQ;
                }
                if self.verify_fatal {
                    self.failed = true;
                }
            }
        }
    }

    /// The next read-back of the verify phase, or with `trim_percentage`
    /// a trim of that run instead (which the log then forgets).
    fn next_verify_req(&mut self, cursor: &mut usize, max_units: usize) -> Option<Req> {
        let (offset, len) = self.log.as_ref()?.next_run(cursor, max_units)?;
        if self.trim_pct > 0 {
            // xorshift: cheap and reproducible.
            self.rng_state ^= self.rng_state << 13;
            self.rng_state ^= self.rng_state >> 7;
            self.rng_state ^= self.rng_state << 17;
            if (self.rng_state % 100) < self.trim_pct as u64 {
                if let Some(log) = &mut self.log {
                    log.written(offset, len, 0);
                }
                return Some(Req {
                    dir: Ddir::Trim,
                    offset,
                    len,
                });
            }
        }
        Some(Req {
            dir: Ddir::Read,
            offset,
            len,
        })
    }

    /// Read back every written unit and check it.
    pub fn pump_verify(&mut self) {
        if self.log.is_none() {
            return;
        }
        let max_units = (self.slots[0].buf.len() as u64 / self.unit).max(1) as usize;
        let mut cursor = 0usize;
        let mut exhausted = false;
        loop {
            if stop_requested() {
                exhausted = true;
            }
            while !exhausted && !self.failed && self.inflight < self.depth {
                let Some(req) = self.next_verify_req(&mut cursor, max_units) else {
                    exhausted = true;
                    break;
                };
                let slot = self.free.pop().expect("a free slot below iodepth");
                self.issue(slot, req);
            }
            self.flush_plug();
            if self.inflight == 0 {
                break;
            }
            self.wait_for_completions();
            self.process_completions(Phase::Verify);
            self.publish_progress();
        }
    }
}
