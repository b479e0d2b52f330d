//! The job loop's verify side: checking what reads bring back, fio's
//! verify phase after the writes, and `verify_backlog` (read back and
//! check every N written blocks while the job runs, fio's
//! `verify_backlog`), and `trim_percentage`'s trims of verified blocks.

use super::{Engine, Phase, MAX_FAILURE_TEXTS};
use crate::completion::stop_requested;
use crate::offsets::Req;
use crate::spec::{Ddir, JobSpec, VerifyMode};
use crate::verify::WriteLog;
use crate::verify_algo::Verifier;

/// The verify side's state: the log of what was written, the backlog of
/// writes to read back, and what the checks found.
pub(super) struct VerifyState {
    /// What each written unit should hold (verify with writes only).
    pub(super) log: Option<WriteLog>,
    /// A read-only verify job checks what its reads bring back.
    pub(super) reads_in_work: bool,
    /// `verify_fatal`: the first bad unit stops the job.
    pub(super) fatal: bool,
    pub(super) verifier: Verifier,
    /// `verify_backlog`: writes completed since the last read-back.
    pub(super) backlog: Vec<(u64, u64)>,
    pub(super) backlog_every: u64,
    /// Percent of written units trimmed instead of read back in the
    /// verify phase (fio `trim_percentage`).
    pub(super) trim_pct: u32,
    pub(super) rng_state: u64,
    pub(super) errors: u64,
    pub(super) checked: u64,
    pub(super) failures: Vec<String>,
}

impl VerifyState {
    pub(super) fn new(spec: &JobSpec, log: Option<WriteLog>) -> VerifyState {
        let verify = spec.verify != VerifyMode::None;
        VerifyState {
            log,
            reads_in_work: verify && !spec.rw.writes(),
            fatal: spec.verify_fatal,
            verifier: Verifier::new(spec.verify, &spec.verify_pattern),
            backlog: Vec::new(),
            backlog_every: if verify { spec.verify_backlog } else { 0 },
            trim_pct: spec.trim_percentage,
            rng_state: spec.randseed | 1,
            errors: 0,
            checked: 0,
            failures: Vec::new(),
        }
    }
}

impl Engine {
    /// Has `verify_backlog` writes' worth completed since the last check?
    pub(super) fn backlog_due(&self) -> bool {
        self.verify.backlog_every > 0
            && self.verify.backlog.len() as u64 >= self.verify.backlog_every
    }

    /// Read back and check the writes of the backlog (nothing else is in
    /// flight: the work loop drained first, so the log is the truth).
    pub(super) fn pump_backlog(&mut self) {
        let list = std::mem::take(&mut self.verify.backlog);
        let log = self.verify.log.as_ref();
        // Skip what a later trim or failed write made unknown.
        let mut rest: Vec<(u64, u64)> = list
            .into_iter()
            .rev()
            .filter(|&(off, _)| log.is_some_and(|l| l.seq_at(l.index(off)) != 0))
            .collect();
        loop {
            while !self.stats.failed && self.inflight < self.depth {
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
    pub(super) fn check_read(&mut self, idx: usize, offset: u64, len: u64, against_log: bool) {
        let unit = self.unit as usize;
        let data = &self.slots[idx].buf.as_slice()[..len as usize];
        for (i, u) in data.chunks(unit).enumerate() {
            let off = offset + (i * unit) as u64;
            let want = match (&self.verify.log, against_log) {
                (Some(log), true) => Some(log.seq_at(log.index(off))),
                _ => None,
            };
            self.verify.checked += 1;
            if let Err(f) = self.verify.verifier.check(u, off, want) {
                self.verify.errors += 1;
                if self.verify.failures.len() < MAX_FAILURE_TEXTS {
                    self.verify
                        .failures
                        .push(f.describe(&self.device_name, off, unit));
                }
                if self.stats.first_error == 0 {
                    self.stats.first_error = libc::EILSEQ;
                }
                if self.verify.fatal {
                    self.stats.failed = true;
                }
            }
        }
    }

    /// The next read-back of the verify phase, or with `trim_percentage`
    /// a trim of that run instead (which the log then forgets).
    fn next_verify_req(&mut self, cursor: &mut usize, max_units: usize) -> Option<Req> {
        let (offset, len) = self.verify.log.as_ref()?.next_run(cursor, max_units)?;
        if self.verify.trim_pct > 0 {
            // xorshift: cheap and reproducible.
            self.verify.rng_state ^= self.verify.rng_state << 13;
            self.verify.rng_state ^= self.verify.rng_state >> 7;
            self.verify.rng_state ^= self.verify.rng_state << 17;
            if (self.verify.rng_state % 100) < self.verify.trim_pct as u64 {
                if let Some(log) = &mut self.verify.log {
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
    pub(crate) fn pump_verify(&mut self) {
        if self.verify.log.is_none() {
            return;
        }
        let max_units = (self.slots[0].buf.len() as u64 / self.unit).max(1) as usize;
        let mut cursor = 0usize;
        let mut exhausted = false;
        loop {
            if stop_requested() {
                exhausted = true;
            }
            while !exhausted && !self.stats.failed && self.inflight < self.depth {
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
