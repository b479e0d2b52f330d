//! One job thread: keep `iodepth` bios in flight against a device, reap
//! completions, record latency, and (with `verify`) check the data.
//!
//! This is fio's `do_io`/`do_verify` loop with blkstack's core API as the
//! I/O engine. Each of the `iodepth` slots owns a page-aligned buffer and,
//! after its first use, a bio that is re-armed for every I/O
//! ([`Bio::rearm_at`]): the hot path allocates nothing. The clock is read
//! once at submission (stored as `start_ns`) and once at completion (in
//! `end_io`), and the difference goes into an HdrHistogram. Both reads are
//! of the TSC where the kernel trusts it ([`CycleClock`], fio's
//! `clocksource=cpu`): at two reads per I/O, a system call per read would
//! be a large share of an in-process null I/O (figures in
//! docs/BENCHMARKS.md).
//!
//! Completions may arrive inline inside `submit` (null, memory) or later on
//! another thread (mq workers). Either way `end_io` only queues the bio on
//! the job's [`CompletionQueue`]; the job loop picks it up, so nothing is
//! ever resubmitted from inside `end_io` and the submitter's stack never
//! grows with the queue depth. How the loop waits for the queue is the
//! job's `wait=` mode: block on a condition variable (`interrupt`), spin
//! then yield (`poll`), or sleep `hybrid_sleep_pct` of the estimated
//! completion time after the oldest submission and then poll (`hybrid`,
//! io_uring's hybrid polling; upstream sleeps 50 % of the minimum, we
//! default to 90 %: see `JobSpec::hybrid_sleep_pct`).
//!
//! Trims go out as discards and fio's `fsync`/`fdatasync`/`end_fsync` as
//! empty flushes (a block device's fsync is a cache flush). Before each
//! I/O the loop asks the job's [`Controls`] whether it may go now (rate,
//! thinktime, flow, `number_ios`, steady state) and how deep the queue may
//! be (`latency_target`).

use crate::buffers::BufferFiller;
use crate::completion::{stop_requested, CompletionQueue, DoneList, JobProgress};
use crate::controls::{Controls, Gate};
use crate::geometry::Geometry;
use crate::offsets::{IoGen, Req};
use crate::spec::{Ddir, JobSpec, VerifyMode};
use crate::stats::{DepthStats, DirStats};
use crate::verify::WriteLog;
use blkstack_core::clock::{now_ns, sleep_until_ns, CycleClock};
use blkstack_core::{AlignedBuf, Bio, BioFlags, DeviceRef, EndIo, Op};
use std::sync::atomic::Ordering;
use std::sync::Arc;

mod verify;
mod wait;

struct Slot {
    buf: AlignedBuf,
    /// The bio this slot reuses, present while it is idle.
    bio: Option<Bio>,
    busy: bool,
    dir: Ddir,
    /// An empty flush (fsync), counted in no direction.
    flush: bool,
    offset: u64,
    len: u64,
    /// Write number (verify mode).
    seq: u64,
    start_ns: u64,
}

/// What the pump loop is doing.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The job's I/O; `record` is false during ramp_time.
    Work { record: bool },
    /// Reading back what was written.
    Verify,
}

/// Spins of the completion-queue check before a poller yields the CPU.
const POLL_SPINS: u32 = 256;
/// Verify failures described in the result (the count is always exact).
const MAX_FAILURE_TEXTS: usize = 10;

/// Everything one job thread needs.
pub(crate) struct ThreadSetup {
    pub spec: JobSpec,
    pub device: DeviceRef,
    pub device_name: String,
    pub geometry: Geometry,
    pub groupid: u32,
    /// fio's thread number (seeds the random generators).
    pub thread_number: u32,
    pub progress: Arc<JobProgress>,
    /// Threads of the `wait_for` job: start once they are all done.
    pub wait_for: Vec<Arc<JobProgress>>,
}

/// One job thread's engine. Its state is grouped by the file that works
/// on it: the slots and the device here, the wait for completions in
/// [`wait`], the verify side in [`verify`]; `stats` and `ctl` are what the
/// job thread (`job.rs`) reads and resets around the phases.
pub(crate) struct Engine {
    dev: DeviceRef,
    cq: Arc<CompletionQueue>,
    sink: Arc<dyn EndIo>,
    slots: Vec<Slot>,
    free: Vec<usize>,
    /// Bios issued since the last flush (the kernel's plug).
    plug: Vec<Bio>,
    drained: DoneList,
    clock: &'static CycleClock,
    inflight: u32,
    depth: u32,
    gen: IoGen,
    stop_on_error: bool,
    unit: u64,
    device_name: String,
    filler: BufferFiller,
    /// The rest of a trim split at the device's largest request.
    trim_rest: Option<Req>,
    progress: Arc<JobProgress>,
    waiter: wait::Waiter,
    verify: verify::VerifyState,
    sampler: Sampler,
    /// What the job measured (reset after the ramp).
    pub(crate) stats: JobStats,
    pub(crate) ctl: Controls,
}

/// The job's figures per direction, and how it ended.
#[derive(Default)]
pub(crate) struct JobStats {
    pub(crate) read: DirStats,
    pub(crate) write: DirStats,
    pub(crate) trim: DirStats,
    pub(crate) depths: DepthStats,
    /// The first error's errno (0: none).
    pub(crate) first_error: i32,
    /// An error stopped the job (`continue_on_error` off, `verify_fatal`).
    pub(crate) failed: bool,
}

/// Periodic bandwidth/IOPS samples: when the next is due, and the
/// counters at the previous one: `[read, write, trim]` as `(bytes, ios)`.
struct Sampler {
    due_ns: u64,
    prev_ns: u64,
    prev: [(u64, u64); 3],
    /// The directions the job does.
    dirs: [bool; 3],
}

impl Engine {
    pub fn new(setup: &ThreadSetup) -> anyhow::Result<Engine> {
        let spec = &setup.spec;
        let g = &setup.geometry;
        let depth = spec.iodepth.max(1);
        let clock = CycleClock::get();
        let cq = Arc::new(CompletionQueue::new(depth as usize, clock));
        let sink: Arc<dyn EndIo> = cq.clone();
        let slots = (0..depth)
            .map(|_| Slot {
                buf: AlignedBuf::new(g.max_bs as usize),
                bio: None,
                busy: false,
                dir: Ddir::Read,
                flush: false,
                offset: 0,
                len: 0,
                seq: 0,
                start_ns: 0,
            })
            .collect();
        let verify = spec.verify != VerifyMode::None;
        let region_units = (g.end - g.start) / g.unit;
        let mut filler = BufferFiller::new(
            &spec.buffers,
            spec.randseed ^ setup.thread_number as u64,
            region_units,
        );
        let mut slots: Vec<Slot> = slots;
        if !verify && spec.rw.writes() {
            // fio fills write buffers once at start (refill_buffers: per write).
            for s in &mut slots {
                filler.fill(s.buf.as_mut_slice());
            }
        }
        let log = if verify && spec.rw.writes() {
            Some(WriteLog::new(g.start, g.end - g.start, g.unit)?)
        } else {
            None
        };
        Ok(Engine {
            dev: setup.device.clone(),
            cq,
            sink,
            slots,
            free: (0..depth as usize).rev().collect(),
            plug: Vec::with_capacity(depth as usize),
            drained: DoneList::with_capacity(depth as usize),
            clock,
            inflight: 0,
            depth,
            gen: IoGen::new(spec, g, setup.thread_number).with_zones(
                spec,
                &setup.device_name,
                g.dev_size,
            ),
            stop_on_error: !spec.continue_on_error,
            unit: g.unit,
            device_name: setup.device_name.clone(),
            ctl: Controls::new(spec, setup.thread_number, clock.now_ns(), depth),
            filler,
            trim_rest: None,
            progress: setup.progress.clone(),
            waiter: wait::Waiter::new(spec, &setup.device),
            verify: verify::VerifyState::new(spec, log),
            sampler: Sampler {
                due_ns: u64::MAX,
                prev_ns: 0,
                prev: [(0, 0); 3],
                dirs: [spec.rw.reads(), spec.rw.writes(), spec.rw.trims()],
            },
            stats: JobStats::default(),
        })
    }

    /// I/Os in flight.
    pub(crate) fn inflight(&self) -> u32 {
        self.inflight
    }

    /// The verify counters, taken: (units with a bad check, units
    /// checked, the first failures described).
    pub(crate) fn take_verify_outcome(&mut self) -> (u64, u64, Vec<String>) {
        (
            self.verify.errors,
            self.verify.checked,
            std::mem::take(&mut self.verify.failures),
        )
    }

    /// A trim larger than the device's largest request goes out in pieces
    /// (the kernel splits a discard at `max_discard_sectors`).
    fn split_trim(&mut self, r: Req) -> Req {
        let max = self.dev.max_io_bytes();
        if r.dir != Ddir::Trim || r.len <= max {
            return r;
        }
        self.trim_rest = Some(Req {
            offset: r.offset + max,
            len: r.len - max,
            ..r
        });
        Req { len: max, ..r }
    }

    /// Does a write to `off..off+len` overlap a write in flight? (verify
    /// mode only: two overlapping writes in flight leave the device holding
    /// either, and the check could not know which.)
    fn overlaps_inflight_write(&self, off: u64, len: u64) -> bool {
        self.slots.iter().any(|s| {
            s.busy
                && s.dir != Ddir::Read
                && !s.flush
                && s.offset < off + len
                && off < s.offset + s.len
        })
    }

    /// The next request of the work phase, or `None` to stop issuing for
    /// now (`bytes_left` exhausted or an overlap could not be avoided).
    fn next_work_req(&mut self, bytes_left: u64) -> Option<Req> {
        if bytes_left == 0 {
            return None;
        }
        if let Some(r) = self.trim_rest.take() {
            return Some(self.split_trim(r));
        }
        for _ in 0..8 {
            let r = self.gen.next()?;
            if r.dir != Ddir::Read
                && self.verify.log.is_some()
                && self.overlaps_inflight_write(r.offset, r.len)
            {
                continue;
            }
            return Some(self.split_trim(r));
        }
        None
    }

    fn issue(&mut self, slot_idx: usize, req: Req) {
        let seq = match (&mut self.verify.log, req.dir) {
            (Some(log), Ddir::Write) => log.next_seq(),
            _ => 0,
        };
        let slot = &mut self.slots[slot_idx];
        if seq != 0 {
            let unit = self.unit as usize;
            let data = &mut slot.buf.as_mut_slice()[..req.len as usize];
            for (i, u) in data.chunks_mut(unit).enumerate() {
                self.verify
                    .verifier
                    .fill(u, req.offset + (i * unit) as u64, seq);
            }
        } else if req.dir == Ddir::Write {
            let data = &mut slot.buf.as_mut_slice()[..req.len as usize];
            if self.filler.per_write() {
                self.filler.fill(data);
            }
            self.filler.scramble(data, req.offset);
        }
        let op = match req.dir {
            Ddir::Read => Op::Read,
            Ddir::Write => Op::Write,
            Ddir::Trim => Op::Discard,
        };
        self.submit_slot(slot_idx, op, req.offset, req.len);
        let slot = &mut self.slots[slot_idx];
        slot.dir = req.dir;
        slot.flush = false;
        slot.seq = seq;
    }

    /// Issue an empty flush (fio's fsync/fdatasync on a block device).
    fn issue_flush(&mut self, slot_idx: usize) {
        self.submit_slot(slot_idx, Op::Flush, 0, 0);
        let slot = &mut self.slots[slot_idx];
        slot.dir = Ddir::Write;
        slot.flush = true;
        slot.seq = 0;
    }

    /// Arm the slot's bio for `op` and put it on the plug.
    fn submit_slot(&mut self, slot_idx: usize, op: Op, offset: u64, len: u64) {
        let slot = &mut self.slots[slot_idx];
        let buf = if op.has_data() {
            // SAFETY: the slot's buffer lives as long as the engine, and the
            // engine does not touch it until this bio comes back through the
            // completion queue (the slot is marked busy until then).
            unsafe { slot.buf.io_buf(0, len as usize) }
        } else {
            blkstack_core::IoBuf::empty()
        };
        let start_ns = self.clock.now_ns();
        let mut bio = match slot.bio.take() {
            Some(mut b) => {
                b.rearm_at(self.sink.clone(), op, offset, len, buf, start_ns);
                b
            }
            None => {
                let mut b = Bio::new(op, offset, len, buf, self.sink.clone(), slot_idx as u64);
                b.start_ns = start_ns;
                b
            }
        };
        if self.waiter.dev_polls {
            bio.flags.insert(BioFlags::POLLED);
        }
        slot.busy = true;
        slot.offset = offset;
        slot.len = len;
        slot.start_ns = bio.start_ns;
        self.inflight += 1;
        self.stats.depths.depth[DepthStats::depth_bucket(self.inflight)] += 1;
        self.plug.push(bio);
    }

    /// Submit what the refill loop issued: one bio alone, several with one
    /// `submit_batch` (the kernel's `blk_finish_plug`), so each layer pays
    /// its per-submission costs once per refill.
    fn flush_plug(&mut self) {
        let n = self.plug.len();
        if n == 0 {
            return;
        }
        self.stats.depths.submit[DepthStats::batch_bucket(n as u32)] += 1;
        if n == 1 {
            if let Some(bio) = self.plug.pop() {
                self.dev.submit(bio);
            }
        } else {
            self.dev.submit_batch(&mut self.plug);
        }
        debug_assert!(self.plug.is_empty());
    }

    /// Handle everything in `drained`. Returns the latest completion time.
    fn process_completions(&mut self, phase: Phase) -> u64 {
        let mut last_ns = 0;
        let n = self.drained.len() as u32;
        self.stats.depths.complete[DepthStats::batch_bucket(n)] += 1;
        let mut drained = std::mem::replace(&mut self.drained, DoneList::with_capacity(0));
        for (bio, (status, done_ns)) in drained.bios.drain(..).zip(drained.meta.drain(..)) {
            let idx = bio.cookie as usize;
            let lat = done_ns.saturating_sub(bio.start_ns);
            last_ns = last_ns.max(done_ns);
            self.waiter.observe(lat);
            let (dir, flush, offset, len, seq) = {
                let s = &mut self.slots[idx];
                s.bio = Some(bio);
                s.busy = false;
                (s.dir, s.flush, s.offset, s.len, s.seq)
            };
            self.free.push(idx);
            self.inflight -= 1;
            if !status.is_ok() {
                self.io_failed(dir, offset, len, status.errno());
                continue;
            }
            if flush {
                continue;
            }
            if phase != (Phase::Work { record: false }) {
                let d = self.dir_stats(dir);
                d.io_bytes += len;
                d.total_ios += 1;
                d.clat.record(lat);
                if phase != Phase::Verify {
                    self.ctl.completed(dir, len, offset, lat, done_ns);
                }
            }
            match (phase, dir) {
                (Phase::Work { .. }, Ddir::Write) => {
                    if let Some(log) = &mut self.verify.log {
                        log.written(offset, len, seq);
                        if self.verify.backlog_every > 0 {
                            self.verify.backlog.push((offset, len));
                        }
                    }
                }
                (Phase::Work { .. }, Ddir::Trim) => {
                    // A trimmed block may read back as anything.
                    if let Some(log) = &mut self.verify.log {
                        log.written(offset, len, 0);
                    }
                }
                (Phase::Work { .. }, Ddir::Read) if self.verify.reads_in_work => {
                    self.check_read(idx, offset, len, false)
                }
                (Phase::Verify, Ddir::Read) => self.check_read(idx, offset, len, true),
                _ => {}
            }
        }
        self.drained = drained;
        last_ns
    }

    fn dir_stats(&mut self, dir: Ddir) -> &mut DirStats {
        match dir {
            Ddir::Read => &mut self.stats.read,
            Ddir::Write => &mut self.stats.write,
            Ddir::Trim => &mut self.stats.trim,
        }
    }

    /// A request failed with `errno`.
    fn io_failed(&mut self, dir: Ddir, offset: u64, len: u64, errno: i32) {
        self.dir_stats(dir).errors += 1;
        if dir != Ddir::Read {
            // What a failed write left behind is unknown: stop expecting
            // anything there (fio drops it from io_hist).
            if let Some(log) = &mut self.verify.log {
                if len > 0 {
                    log.written(offset, len, 0);
                }
            }
        }
        if self.stats.first_error == 0 {
            self.stats.first_error = errno;
        }
        if self.stop_on_error {
            self.stats.failed = true;
        }
    }

    pub fn publish_progress(&self) {
        let p = &self.progress;
        p.read_ios
            .store(self.stats.read.total_ios, Ordering::Relaxed);
        p.write_ios
            .store(self.stats.write.total_ios, Ordering::Relaxed);
        p.read_bytes
            .store(self.stats.read.io_bytes, Ordering::Relaxed);
        p.write_bytes
            .store(self.stats.write.io_bytes, Ordering::Relaxed);
        p.ios.store(
            self.stats.read.total_ios + self.stats.write.total_ios,
            Ordering::Relaxed,
        );
        p.bytes.store(
            self.stats.read.io_bytes + self.stats.write.io_bytes,
            Ordering::Relaxed,
        );
    }

    /// Start periodic bandwidth/IOPS sampling from `now`.
    pub fn start_sampling(&mut self, now: u64) {
        self.sampler.prev_ns = now;
        self.sampler.due_ns = now + crate::stats::SAMPLE_INTERVAL_NS;
        self.sampler.prev = [(0, 0); 3];
        self.ctl.restart(now);
    }

    /// Close a sample interval at `now` (a completion time: no clock read).
    fn take_sample(&mut self, now: u64) {
        let spent_ms = (now - self.sampler.prev_ns) / 1_000_000;
        if spent_ms == 0 {
            return;
        }
        for (i, dir) in [
            &mut self.stats.read,
            &mut self.stats.write,
            &mut self.stats.trim,
        ]
        .into_iter()
        .enumerate()
        {
            if !self.sampler.dirs[i] {
                continue;
            }
            let (pb, pi) = self.sampler.prev[i];
            let bw_kib = (dir.io_bytes - pb) * 1000 / spent_ms / 1024;
            let iops = (dir.total_ios - pi) * 1000 / spent_ms;
            dir.bw_samples.push(bw_kib);
            dir.iops_samples.push(iops);
            self.sampler.prev[i] = (dir.io_bytes, dir.total_ios);
        }
        self.sampler.prev_ns = now;
        self.sampler.due_ns = now + crate::stats::SAMPLE_INTERVAL_NS;
    }

    /// Run the work phase until `deadline_ns` or `io_limit` bytes.
    /// Returns when nothing is in flight.
    pub fn pump_work(&mut self, record: bool, deadline_ns: u64, io_limit: u64) {
        let phase = Phase::Work { record };
        let mut issued: u64 = 0;
        let mut stop = false;
        // A request the controls held back (rate, thinktime, flow).
        let mut held: Option<Req> = None;
        loop {
            let mut not_before = 0u64;
            let depth = self.ctl.depth(self.depth);
            while !stop && !self.stats.failed && self.inflight < depth && !self.backlog_due() {
                if self.ctl.sync_owed {
                    self.ctl.sync_owed = false;
                    let slot = self.free.pop().expect("a free slot below iodepth");
                    self.issue_flush(slot);
                    continue;
                }
                let req = match held.take() {
                    Some(r) => r,
                    None => match self.next_work_req(io_limit.saturating_sub(issued)) {
                        Some(r) => r,
                        None => {
                            if issued >= io_limit || self.inflight == 0 {
                                stop = true;
                            }
                            break;
                        }
                    },
                };
                let now = self.clock.now_ns();
                match self.ctl.gate(req.dir, now) {
                    Gate::Go => {}
                    Gate::Until(t) => {
                        (held, not_before) = (Some(req), t);
                        break;
                    }
                    Gate::Flow(d) => {
                        (held, not_before) = (Some(req), now + (d.as_nanos() as u64).max(10_000));
                        break;
                    }
                    Gate::Done => {
                        stop = true;
                        break;
                    }
                }
                // The last I/O may be clipped to the limit, as fio does. The
                // remainder is a multiple of the logical block size (every
                // block size is), and of the verify unit in verify mode.
                let req = Req {
                    len: req.len.min(io_limit - issued),
                    ..req
                };
                issued = issued.saturating_add(req.len);
                self.ctl.issued(req.dir, req.len, now);
                let slot = self.free.pop().expect("a free slot below iodepth");
                self.issue(slot, req);
            }
            self.flush_plug();
            if self.inflight == 0 {
                if self.backlog_due() && !self.stats.failed {
                    self.pump_backlog();
                    continue;
                }
                if stop || self.stats.failed || not_before == 0 || stop_requested() {
                    break;
                }
                if not_before >= deadline_ns {
                    break;
                }
                self.pace_wait(not_before);
                continue;
            }
            self.wait_for_completions();
            let last = self.process_completions(phase);
            if record {
                self.publish_progress();
                if last >= self.sampler.due_ns {
                    self.take_sample(last);
                }
                if self.ctl.steady_tick(last, self.totals()) {
                    stop = true;
                }
            }
            if last >= deadline_ns || stop_requested() {
                stop = true;
            }
        }
    }

    /// `(ios, bytes, latency sum ns, latency samples)` over every direction.
    fn totals(&self) -> (u64, u64, u64, u64) {
        [&self.stats.read, &self.stats.write, &self.stats.trim]
            .iter()
            .fold((0, 0, 0, 0), |t, d| {
                let lat_sum = (d.clat.mean() * d.clat.samples as f64) as u64;
                (
                    t.0 + d.total_ios,
                    t.1 + d.io_bytes,
                    t.2 + lat_sum,
                    t.3 + d.clat.samples,
                )
            })
    }

    /// Nothing in flight and the next I/O is not due before `t` (cycle
    /// clock): spin `thinktime_spin`, then sleep the rest.
    fn pace_wait(&mut self, t: u64) {
        let now = self.clock.now_ns();
        let spin_end = now.saturating_add(self.ctl.spin_ns()).min(t);
        let mut spins = 0u64;
        while self.clock.now_ns() < spin_end && spins < 100_000_000 {
            std::hint::spin_loop();
            spins += 1;
        }
        let now = self.clock.now_ns();
        if t > now {
            sleep_until_ns(now_ns() + (t - now));
        }
    }

    /// fio's `end_fsync`: one flush once the job's writes are done.
    pub fn final_flush(&mut self) {
        let slot = self.free.pop().expect("nothing in flight at the end");
        self.issue_flush(slot);
        self.flush_plug();
        while self.inflight > 0 {
            self.wait_for_completions();
            self.process_completions(Phase::Verify);
        }
    }
}
