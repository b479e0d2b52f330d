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
//! `clocksource=cpu`): at two reads per I/O, `clock_gettime` was a tenth of
//! an in-process null I/O.
//!
//! Completions may arrive inline inside `submit` (null, memory) or later on
//! another thread (mq workers). Either way `end_io` only queues the bio on
//! the job's [`CompletionQueue`]; the job loop picks it up, so nothing is
//! ever resubmitted from inside `end_io` and the submitter's stack never
//! grows with the queue depth. How the loop waits for the queue is the
//! job's `wait=` mode: block on a condition variable (`interrupt`), spin
//! then yield (`poll`), or sleep `hybrid_sleep_pct` of the estimated
//! completion time after the oldest submission and then poll (`hybrid`,
//! seed 002; upstream sleeps 50 % of the minimum, we default to 90 %:
//! see `JobSpec::hybrid_sleep_pct`).

use crate::offsets::IoGen;
use crate::spec::{HybridEstimator, JobSpec, VerifyMode, WaitMode};
use crate::stats::{DepthStats, DirStats, JobResult};
use crate::verify::{check_unit, fill_unit, WriteLog};
use blkstack_core::clock::{now_ns, sleep_until_ns, CycleClock};
use blkstack_core::{AlignedBuf, Bio, BioFlags, DeviceRef, EndIo, Op, Status};
use parking_lot::{Condvar, Mutex};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Completed bios waiting for the job loop, with their status and
/// completion time in a parallel list: a bio is 128 bytes and moves with
/// inline stores, a bio plus its metadata would not (see
/// `blkstack_core::bio::INLINE_FRAMES`).
pub(crate) struct DoneList {
    bios: Vec<Bio>,
    meta: Vec<(Status, u64)>,
}

impl DoneList {
    fn with_capacity(depth: usize) -> DoneList {
        DoneList {
            bios: Vec::with_capacity(depth),
            meta: Vec::with_capacity(depth),
        }
    }

    #[inline]
    fn push(&mut self, bio: Bio, status: Status, done_ns: u64) {
        self.bios.push(bio);
        self.meta.push((status, done_ns));
    }

    fn len(&self) -> usize {
        self.bios.len()
    }

    fn is_empty(&self) -> bool {
        self.bios.is_empty()
    }

    /// Move everything here into `out`: a swap when `out` is empty (both
    /// keep their capacity), else an append (never past the depth both
    /// were made for, since at most `depth` bios are in flight).
    fn move_into(&mut self, out: &mut DoneList) {
        if out.is_empty() {
            std::mem::swap(self, out);
        } else {
            out.bios.append(&mut self.bios);
            out.meta.append(&mut self.meta);
        }
    }
}

struct CqInner {
    items: DoneList,
    /// The job thread is blocked in `wait_take` and needs a wake-up.
    waiter: bool,
}

/// Where a job's bios come back: the owner frame of every bio it submits.
///
/// A device that completes inline (null `irqmode=0`, memory) calls
/// `end_io` on the job thread itself, inside `submit`: those completions go
/// to a list only that thread touches, with no lock (fio's null engine
/// completes the same way, in its own thread). Completions from any other
/// thread take the lock and may wake the job thread.
pub(crate) struct CompletionQueue {
    inner: Mutex<CqInner>,
    /// Mirrors `items.len()` so that pollers can spin without the lock.
    ready: AtomicU64,
    cv: Condvar,
    /// Completions that ran on the job thread. Touched only by the thread
    /// whose marker is `job_thread`.
    local: UnsafeCell<DoneList>,
    job_thread: usize,
    clock: &'static CycleClock,
}

// SAFETY: `local` is only accessed by the thread identified by
// `job_thread` (checked on every access); everything else is a lock or an
// atomic.
unsafe impl Sync for CompletionQueue {}

/// An address unique to the calling thread among live threads.
#[inline]
fn thread_marker() -> usize {
    thread_local! {
        static MARKER: u8 = const { 0 };
    }
    MARKER.with(|m| m as *const u8 as usize)
}

impl CompletionQueue {
    /// A queue for `depth` bios, owned by the calling (job) thread.
    fn new(depth: usize, clock: &'static CycleClock) -> CompletionQueue {
        CompletionQueue {
            inner: Mutex::new(CqInner {
                // At most `depth` bios are in flight, so this never grows.
                items: DoneList::with_capacity(depth),
                waiter: false,
            }),
            ready: AtomicU64::new(0),
            cv: Condvar::new(),
            local: UnsafeCell::new(DoneList::with_capacity(depth)),
            job_thread: thread_marker(),
            clock,
        }
    }

    /// The job thread's own completions, moved into `out`.
    fn take_local(&self, out: &mut DoneList) {
        assert_eq!(thread_marker(), self.job_thread, "not the job thread");
        // SAFETY: only the job thread gets here (asserted), and it is not
        // inside `end_io` (which would be inside a `submit` call).
        unsafe { (*self.local.get()).move_into(out) }
    }

    /// Move whatever has completed into `out` (which has the same capacity,
    /// so swapping keeps both allocations). Returns how many are in `out`.
    fn try_take(&self, out: &mut DoneList) -> usize {
        self.take_local(out);
        if self.ready.load(Ordering::Acquire) != 0 {
            let mut g = self.inner.lock();
            g.items.move_into(out);
            self.ready.store(0, Ordering::Relaxed);
        }
        out.len()
    }

    /// Block until something completed, then take it.
    fn wait_take(&self, out: &mut DoneList) -> usize {
        self.take_local(out);
        if !out.is_empty() {
            return self.try_take(out);
        }
        let mut g = self.inner.lock();
        while g.items.is_empty() {
            g.waiter = true;
            self.cv.wait(&mut g);
        }
        g.waiter = false;
        g.items.move_into(out);
        self.ready.store(0, Ordering::Relaxed);
        out.len()
    }

    #[inline]
    fn has_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire) != 0
    }
}

impl EndIo for CompletionQueue {
    #[inline]
    fn end_io(&self, bio: Bio, status: Status, _private: u64) {
        let done_ns = self.clock.now_ns();
        if thread_marker() == self.job_thread {
            // SAFETY: we are the job thread (the only one touching
            // `local`), called from inside its `submit`, while it holds no
            // reference into `local`.
            unsafe { (*self.local.get()).push(bio, status, done_ns) };
            return;
        }
        let mut g = self.inner.lock();
        g.items.push(bio, status, done_ns);
        self.ready.store(g.items.len() as u64, Ordering::Release);
        let wake = g.waiter;
        drop(g);
        if wake {
            self.cv.notify_one();
        }
    }
}

/// Set by [`request_stop`]: every running job stops issuing, drains what is
/// in flight and reports (fio's behaviour on Ctrl-C).
static STOP_REQUESTED: AtomicBool = AtomicBool::new(false);

/// Ask every running job to stop early and report what it did so far.
/// Async-signal-safe (one atomic store), so a SIGINT handler may call it.
pub fn request_stop() {
    STOP_REQUESTED.store(true, Ordering::Relaxed);
}

/// Forget an earlier [`request_stop`] (called when a run starts).
pub(crate) fn clear_stop() {
    STOP_REQUESTED.store(false, Ordering::Relaxed);
}

fn stop_requested() -> bool {
    STOP_REQUESTED.load(Ordering::Relaxed)
}

/// Live counters a progress display reads while the job runs.
#[derive(Default)]
pub struct JobProgress {
    pub ios: AtomicU64,
    pub bytes: AtomicU64,
    pub read_ios: AtomicU64,
    pub write_ios: AtomicU64,
    /// The job has finished (all phases).
    pub done: AtomicBool,
    /// 0 = ramp, 1 = I/O, 2 = verify.
    pub phase: AtomicU64,
}

/// Where a job runs, resolved against its device before any thread starts,
/// so that geometry mistakes are reported up front.
#[derive(Clone, Debug)]
pub struct Geometry {
    /// First byte of the job's region.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
    pub dev_size: u64,
    /// Verify unit: the smallest block size.
    pub unit: u64,
    pub max_bs: u64,
    /// Bytes of I/O to do when not time based.
    pub io_limit: u64,
}

impl Geometry {
    /// The region of clone `clone_index` (0-based) of `spec` on `dev`.
    pub fn resolve(
        spec: &JobSpec,
        dev: &DeviceRef,
        dev_name: &str,
        clone_index: u32,
    ) -> anyhow::Result<Geometry> {
        use anyhow::bail;
        let dev_size = dev.size();
        let lbs = dev.logical_block_size().max(1) as u64;
        let min_bs = spec.bs.min();
        let max_bs = spec.bs.max();
        for &(b, _) in &spec.bs.split {
            if !b.is_multiple_of(lbs) {
                bail!(
                    "job '{}': block size {b} is not a multiple of {dev_name}'s logical block size {lbs}",
                    spec.name
                );
            }
            if b > dev.max_io_bytes() {
                bail!(
                    "job '{}': block size {b} exceeds {dev_name}'s largest request ({} bytes)",
                    spec.name,
                    dev.max_io_bytes()
                );
            }
            if spec.verify != VerifyMode::None && !b.is_multiple_of(min_bs) {
                bail!(
                    "job '{}': with verify, every block size must be a multiple of the smallest ({min_bs}); {b} is not",
                    spec.name
                );
            }
        }
        if spec.verify != VerifyMode::None && (min_bs as usize) < crate::verify::HEADER_LEN {
            bail!(
                "job '{}': verify needs blocks of at least {} bytes",
                spec.name,
                crate::verify::HEADER_LEN
            );
        }
        let mut start = spec.offset.resolve(dev_size);
        if matches!(spec.offset, crate::spec::SizeSpec::Percent(_)) {
            // fio aligns percentage offsets down to the block size.
            start -= start % min_bs;
        }
        // fio's offset_increment: clone k starts k increments further.
        let incr = spec.offset_increment.resolve(dev_size);
        start = start.saturating_add(incr.saturating_mul(clone_index as u64));
        if !start.is_multiple_of(lbs) {
            bail!(
                "job '{}': offset {start} is not a multiple of {dev_name}'s logical block size {lbs}",
                spec.name
            );
        }
        if start >= dev_size {
            bail!(
                "job '{}': offset {start} is at or past the end of {dev_name} ({dev_size} bytes)",
                spec.name
            );
        }
        let size = match spec.size {
            Some(s) => s.resolve(dev_size),
            None => dev_size - start,
        };
        if start.checked_add(size).is_none_or(|e| e > dev_size) {
            bail!(
                "job '{}': offset {start} + size {size} is past the end of {dev_name} ({dev_size} bytes)",
                spec.name
            );
        }
        // Whole blocks only, as fio trims a region to the block size.
        let size = size - size % min_bs;
        if size < max_bs {
            bail!(
                "job '{}': region of {size} bytes is smaller than the block size {max_bs}",
                spec.name
            );
        }
        let end = start + size;
        // Whole blocks here too, so the last (clipped) I/O stays aligned.
        let io_limit = spec.io_limit(size, dev_size);
        let io_limit = (io_limit - io_limit % min_bs).max(min_bs);
        Ok(Geometry {
            start,
            end,
            dev_size,
            unit: min_bs,
            max_bs,
            io_limit,
        })
    }
}

/// One I/O the generator asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Req {
    pub write: bool,
    pub offset: u64,
    pub len: u64,
}

struct Slot {
    buf: AlignedBuf,
    /// The bio this slot reuses, present while it is idle.
    bio: Option<Bio>,
    busy: bool,
    write: bool,
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
}

struct Engine {
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
    wait: WaitMode,
    gen: IoGen,
    log: Option<WriteLog>,
    verify_reads_in_work: bool,
    stop_on_error: bool,
    verify_fatal: bool,
    unit: u64,
    device_name: String,
    read: DirStats,
    write: DirStats,
    depths: DepthStats,
    first_error: i32,
    failed: bool,
    verify_errors: u64,
    verify_checked: u64,
    verify_failures: Vec<String>,
    min_lat_ns: u64,
    /// Moving average of completion times (`hybrid_estimator=ewma`).
    ewma_lat_ns: u64,
    /// `wait=poll|hybrid` on a device that polls (`Device::polls`): bios
    /// go out `POLLED`, and the wait loop calls `Device::poll`, which
    /// completes them once due (io_uring IOPOLL: the submitter reaps its
    /// own I/O; nothing wakes it from another thread).
    dev_polls: bool,
    hybrid_sleep_pct: u64,
    hybrid_estimator: HybridEstimator,
    progress: Arc<JobProgress>,
    /// When the next bandwidth/IOPS sample is due, and the counters at the
    /// previous one: `[read, write]` as `(bytes, ios)`.
    sample_due_ns: u64,
    sample_prev_ns: u64,
    sample_prev: [(u64, u64); 2],
    sample_dirs: [bool; 2],
}

impl Engine {
    fn new(setup: &ThreadSetup) -> anyhow::Result<Engine> {
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
                write: false,
                offset: 0,
                len: 0,
                seq: 0,
                start_ns: 0,
            })
            .collect();
        let verify = spec.verify != VerifyMode::None;
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
            wait: spec.wait,
            gen: IoGen::new(spec, g, setup.thread_number),
            log,
            verify_reads_in_work: verify && !spec.rw.writes(),
            stop_on_error: !spec.continue_on_error,
            verify_fatal: spec.verify_fatal,
            unit: g.unit,
            device_name: setup.device_name.clone(),
            read: DirStats::default(),
            write: DirStats::default(),
            depths: DepthStats::default(),
            first_error: 0,
            failed: false,
            verify_errors: 0,
            verify_checked: 0,
            verify_failures: Vec::new(),
            min_lat_ns: u64::MAX,
            ewma_lat_ns: 0,
            dev_polls: spec.wait != WaitMode::Interrupt && setup.device.polls(),
            hybrid_sleep_pct: spec.hybrid_sleep_pct.clamp(1, 100) as u64,
            hybrid_estimator: spec.hybrid_estimator,
            progress: setup.progress.clone(),
            sample_due_ns: u64::MAX,
            sample_prev_ns: 0,
            sample_prev: [(0, 0); 2],
            sample_dirs: [spec.rw.reads(), spec.rw.writes()],
        })
    }

    /// Does a write to `off..off+len` overlap a write in flight? (verify
    /// mode only: two overlapping writes in flight leave the device holding
    /// either, and the check could not know which.)
    fn overlaps_inflight_write(&self, off: u64, len: u64) -> bool {
        self.slots
            .iter()
            .any(|s| s.busy && s.write && s.offset < off + len && off < s.offset + s.len)
    }

    /// The next request of the work phase, or `None` to stop issuing for
    /// now (`bytes_left` exhausted or an overlap could not be avoided).
    fn next_work_req(&mut self, bytes_left: u64) -> Option<Req> {
        if bytes_left == 0 {
            return None;
        }
        for _ in 0..8 {
            let r = self.gen.next();
            if r.write && self.log.is_some() && self.overlaps_inflight_write(r.offset, r.len) {
                continue;
            }
            return Some(r);
        }
        None
    }

    fn issue(&mut self, slot_idx: usize, req: Req) {
        let seq = match (&mut self.log, req.write) {
            (Some(log), true) => log.next_seq(),
            _ => 0,
        };
        let slot = &mut self.slots[slot_idx];
        if seq != 0 {
            let unit = self.unit as usize;
            let data = &mut slot.buf.as_mut_slice()[..req.len as usize];
            for (i, u) in data.chunks_mut(unit).enumerate() {
                fill_unit(u, req.offset + (i * unit) as u64, seq);
            }
        }
        // SAFETY: the slot's buffer lives as long as the engine, and the
        // engine does not touch it until this bio comes back through the
        // completion queue (the slot is marked busy until then).
        let buf = unsafe { slot.buf.io_buf(0, req.len as usize) };
        let op = if req.write { Op::Write } else { Op::Read };
        let start_ns = self.clock.now_ns();
        let mut bio = match slot.bio.take() {
            Some(mut b) => {
                b.rearm_at(self.sink.clone(), op, req.offset, req.len, buf, start_ns);
                b
            }
            None => {
                let mut b = Bio::new(
                    op,
                    req.offset,
                    req.len,
                    buf,
                    self.sink.clone(),
                    slot_idx as u64,
                );
                b.start_ns = start_ns;
                b
            }
        };
        if self.dev_polls {
            bio.flags.insert(BioFlags::POLLED);
        }
        slot.busy = true;
        slot.write = req.write;
        slot.offset = req.offset;
        slot.len = req.len;
        slot.seq = seq;
        slot.start_ns = bio.start_ns;
        self.inflight += 1;
        self.depths.depth[DepthStats::depth_bucket(self.inflight)] += 1;
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
        self.depths.submit[DepthStats::batch_bucket(n as u32)] += 1;
        if n == 1 {
            if let Some(bio) = self.plug.pop() {
                self.dev.submit(bio);
            }
        } else {
            self.dev.submit_batch(&mut self.plug);
        }
        debug_assert!(self.plug.is_empty());
    }

    /// Wait for at least one completion according to the wait mode.
    fn wait_for_completions(&mut self) -> usize {
        let n = self.cq.try_take(&mut self.drained);
        if n > 0 {
            return n;
        }
        match self.wait {
            WaitMode::Interrupt => self.cq.wait_take(&mut self.drained),
            WaitMode::Poll => self.poll_take(),
            WaitMode::Hybrid => {
                if self.min_lat_ns != u64::MAX {
                    let oldest = self
                        .slots
                        .iter()
                        .filter(|s| s.busy)
                        .map(|s| s.start_ns)
                        .min()
                        .unwrap_or(0);
                    let estimate = match self.hybrid_estimator {
                        HybridEstimator::Min => self.min_lat_ns,
                        HybridEstimator::Ewma => self.ewma_lat_ns.max(1),
                    };
                    let wake = oldest.saturating_add(estimate * self.hybrid_sleep_pct / 100);
                    // Sleeping for less than a few µs costs more than it saves.
                    let now = self.clock.now_ns();
                    if wake > now + 2_000 && !self.cq.has_ready() {
                        // Stamps are on the cycle clock; sleep on now_ns.
                        sleep_until_ns(now_ns() + (wake - now));
                    }
                }
                self.poll_take()
            }
        }
    }

    /// Spin on the queue, yielding the CPU after a bounded number of spins
    /// (on a small machine the completing thread may need this CPU). On a
    /// polling device each round first polls it.
    fn poll_take(&mut self) -> usize {
        let mut spins = 0u32;
        loop {
            // What the poll completes for this job lands on this thread's
            // local list, which `has_ready` (other threads' list) does not
            // show.
            if self.dev_polls && self.dev.poll() > 0 {
                let n = self.cq.try_take(&mut self.drained);
                if n > 0 {
                    return n;
                }
            }
            if self.cq.has_ready() {
                let n = self.cq.try_take(&mut self.drained);
                if n > 0 {
                    return n;
                }
            }
            if spins < POLL_SPINS {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Handle everything in `drained`. Returns the latest completion time.
    fn process_completions(&mut self, phase: Phase) -> u64 {
        let mut last_ns = 0;
        let n = self.drained.len() as u32;
        self.depths.complete[DepthStats::batch_bucket(n)] += 1;
        let mut drained = std::mem::replace(&mut self.drained, DoneList::with_capacity(0));
        for (bio, (status, done_ns)) in drained.bios.drain(..).zip(drained.meta.drain(..)) {
            let idx = bio.cookie as usize;
            let lat = done_ns.saturating_sub(bio.start_ns);
            last_ns = last_ns.max(done_ns);
            self.min_lat_ns = self.min_lat_ns.min(lat.max(1));
            self.ewma_lat_ns = if self.ewma_lat_ns == 0 {
                lat.max(1)
            } else {
                self.ewma_lat_ns - self.ewma_lat_ns / 8 + lat.max(1) / 8
            };
            let (write, offset, len, seq) = {
                let s = &mut self.slots[idx];
                s.bio = Some(bio);
                s.busy = false;
                (s.write, s.offset, s.len, s.seq)
            };
            self.free.push(idx);
            self.inflight -= 1;
            let dir = if write {
                &mut self.write
            } else {
                &mut self.read
            };
            if !status.is_ok() {
                dir.errors += 1;
                if write {
                    // What a failed write left behind is unknown: stop
                    // expecting anything there (fio drops it from io_hist).
                    if let Some(log) = &mut self.log {
                        log.written(offset, len, 0);
                    }
                }
                if self.first_error == 0 {
                    self.first_error = status.errno();
                }
                if self.stop_on_error {
                    self.failed = true;
                }
                continue;
            }
            if phase != (Phase::Work { record: false }) {
                dir.io_bytes += len;
                dir.total_ios += 1;
                dir.clat.record(lat);
            }
            match phase {
                Phase::Work { .. } => {
                    if write {
                        if let Some(log) = &mut self.log {
                            log.written(offset, len, seq);
                        }
                    } else if self.verify_reads_in_work {
                        self.check_read(idx, offset, len, false);
                    }
                }
                Phase::Verify => self.check_read(idx, offset, len, true),
            }
        }
        self.drained = drained;
        last_ns
    }

    /// Verify the units a completed read brought back.
    fn check_read(&mut self, idx: usize, offset: u64, len: u64, against_log: bool) {
        let unit = self.unit as usize;
        let data = &self.slots[idx].buf.as_slice()[..len as usize];
        for (i, u) in data.chunks(unit).enumerate() {
            let off = offset + (i * unit) as u64;
            let want = match (&self.log, against_log) {
                (Some(log), true) => Some(log.seq_at(log.index(off))),
                _ => None,
            };
            self.verify_checked += 1;
            if let Err(f) = check_unit(u, off, want) {
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

    fn publish_progress(&self) {
        let p = &self.progress;
        p.read_ios.store(self.read.total_ios, Ordering::Relaxed);
        p.write_ios.store(self.write.total_ios, Ordering::Relaxed);
        p.ios.store(
            self.read.total_ios + self.write.total_ios,
            Ordering::Relaxed,
        );
        p.bytes
            .store(self.read.io_bytes + self.write.io_bytes, Ordering::Relaxed);
    }

    /// Start periodic bandwidth/IOPS sampling from `now`.
    fn start_sampling(&mut self, now: u64) {
        self.sample_prev_ns = now;
        self.sample_due_ns = now + crate::stats::SAMPLE_INTERVAL_NS;
        self.sample_prev = [(0, 0); 2];
    }

    /// Close a sample interval at `now` (a completion time: no clock read).
    fn take_sample(&mut self, now: u64) {
        let spent_ms = (now - self.sample_prev_ns) / 1_000_000;
        if spent_ms == 0 {
            return;
        }
        for (i, dir) in [&mut self.read, &mut self.write].into_iter().enumerate() {
            if !self.sample_dirs[i] {
                continue;
            }
            let (pb, pi) = self.sample_prev[i];
            let bw_kib = (dir.io_bytes - pb) * 1000 / spent_ms / 1024;
            let iops = (dir.total_ios - pi) * 1000 / spent_ms;
            dir.bw_samples.push(bw_kib);
            dir.iops_samples.push(iops);
            self.sample_prev[i] = (dir.io_bytes, dir.total_ios);
        }
        self.sample_prev_ns = now;
        self.sample_due_ns = now + crate::stats::SAMPLE_INTERVAL_NS;
    }

    /// Run the work phase until `deadline_ns` or `io_limit` bytes.
    /// Returns when nothing is in flight.
    fn pump_work(&mut self, record: bool, deadline_ns: u64, io_limit: u64) {
        let phase = Phase::Work { record };
        let mut issued: u64 = 0;
        let mut stop = false;
        loop {
            while !stop && !self.failed && self.inflight < self.depth {
                let Some(req) = self.next_work_req(io_limit.saturating_sub(issued)) else {
                    if issued >= io_limit || self.inflight == 0 {
                        stop = true;
                    }
                    break;
                };
                // The last I/O may be clipped to the limit, as fio does. The
                // remainder is a multiple of the logical block size (every
                // block size is), and of the verify unit in verify mode.
                let req = Req {
                    len: req.len.min(io_limit - issued),
                    ..req
                };
                issued = issued.saturating_add(req.len);
                let slot = self.free.pop().expect("a free slot below iodepth");
                self.issue(slot, req);
            }
            self.flush_plug();
            if self.inflight == 0 {
                break;
            }
            self.wait_for_completions();
            let last = self.process_completions(phase);
            if record {
                self.publish_progress();
                if last >= self.sample_due_ns {
                    self.take_sample(last);
                }
            }
            if last >= deadline_ns || stop_requested() {
                stop = true;
            }
        }
    }

    /// Read back every written unit and check it.
    fn pump_verify(&mut self) {
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
                let run = self
                    .log
                    .as_ref()
                    .and_then(|l| l.next_run(&mut cursor, max_units));
                let Some((offset, len)) = run else {
                    exhausted = true;
                    break;
                };
                let slot = self.free.pop().expect("a free slot below iodepth");
                self.issue(
                    slot,
                    Req {
                        write: false,
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
            self.publish_progress();
        }
    }
}

/// Context switches (voluntary + involuntary), major and minor faults of
/// the calling thread: the rest of fio's `cpu` line.
fn thread_rusage_counts() -> [u64; 3] {
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    [
        (ru.ru_nvcsw + ru.ru_nivcsw) as u64,
        ru.ru_majflt as u64,
        ru.ru_minflt as u64,
    ]
}

/// Run one job thread to the end: ramp, work, verify.
pub(crate) fn run_thread(setup: ThreadSetup) -> anyhow::Result<JobResult> {
    let spec = &setup.spec;
    if spec.wait == WaitMode::Hybrid {
        // Hybrid sleeps are short; the default 50 µs slack would swamp them.
        blkstack_core::timing::prepare_precise_thread();
    }
    let mut eng = Engine::new(&setup)?;
    let cpu0 = blkstack_core::cpu::thread_cpu();
    let ru0 = thread_rusage_counts();
    let t0 = now_ns();
    let mut result = JobResult::new(&spec.name, setup.groupid, spec, &setup.device_name);

    if !spec.ramp_time.is_zero() {
        setup.progress.phase.store(0, Ordering::Relaxed);
        let ramp_end = t0.saturating_add(spec.ramp_time.as_nanos() as u64);
        eng.pump_work(false, ramp_end, u64::MAX);
        // The verify log survives the ramp: those writes are on the device.
        eng.read = DirStats::default();
        eng.write = DirStats::default();
        eng.depths = DepthStats::default();
    }

    setup.progress.phase.store(1, Ordering::Relaxed);
    let work_start = now_ns();
    eng.start_sampling(work_start);
    let deadline = match spec.runtime {
        Some(r) => work_start.saturating_add(r.as_nanos().min(u64::MAX as u128) as u64),
        None => u64::MAX,
    };
    let io_limit = if spec.time_based {
        u64::MAX
    } else {
        setup.geometry.io_limit
    };
    eng.pump_work(true, deadline, io_limit);
    let work_end = now_ns();
    let work_ns = work_end - work_start;
    if eng.read.total_ios + eng.read.errors > 0 {
        eng.read.runtime_ns = work_ns;
    }
    if eng.write.total_ios + eng.write.errors > 0 {
        eng.write.runtime_ns = work_ns;
    }

    let mut verify_ns = 0;
    if spec.verify != VerifyMode::None
        && spec.do_verify
        && spec.rw.writes()
        && !eng.failed
        && !stop_requested()
    {
        setup.progress.phase.store(2, Ordering::Relaxed);
        let v0 = now_ns();
        let reads_before = eng.read.total_ios;
        eng.pump_verify();
        verify_ns = now_ns() - v0;
        if eng.read.total_ios > reads_before {
            // fio counts the verify phase as read time.
            eng.read.runtime_ns += verify_ns;
        }
    }
    let end = now_ns();
    let cpu = blkstack_core::cpu::thread_cpu().since(cpu0);
    eng.publish_progress();
    setup.progress.done.store(true, Ordering::Release);

    result.error = eng.first_error;
    result.read = std::mem::take(&mut eng.read);
    result.write = std::mem::take(&mut eng.write);
    result.depths = std::mem::take(&mut eng.depths);
    result.usr_cpu_ns = cpu.user_ns;
    result.sys_cpu_ns = cpu.sys_ns;
    let ru1 = thread_rusage_counts();
    result.ctx = ru1[0].saturating_sub(ru0[0]);
    result.majf = ru1[1].saturating_sub(ru0[1]);
    result.minf = ru1[2].saturating_sub(ru0[2]);
    result.runtime_ns = work_ns + verify_ns;
    result.elapsed_ns = end - t0;
    result.verify_errors = eng.verify_errors;
    result.verify_checked = eng.verify_checked;
    result.verify_failures = std::mem::take(&mut eng.verify_failures);
    debug_assert_eq!(eng.inflight, 0);
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkstack_core::IoBuf;

    fn bio(owner: &Arc<CompletionQueue>, cookie: u64) -> Bio {
        let owner: Arc<dyn EndIo> = owner.clone();
        Bio::new(Op::Flush, 0, 0, IoBuf::empty(), owner, cookie)
    }

    /// Completions on the job thread (lock-free list) and on other threads
    /// (locked list) both arrive, each once, with their status, and taking
    /// them never grows a list past the depth.
    #[test]
    fn completion_queue_takes_job_thread_and_foreign_completions() {
        const DEPTH: usize = 8;
        let cq = Arc::new(CompletionQueue::new(DEPTH, CycleClock::get()));
        let mut out = DoneList::with_capacity(DEPTH);
        // Three inline, then three from another thread.
        for i in 0..3 {
            bio(&cq, i).complete(Status::Ok);
        }
        let foreign: Vec<Bio> = (3..6).map(|i| bio(&cq, i)).collect();
        std::thread::spawn(move || {
            for b in foreign {
                b.complete(Status::IoError);
            }
        })
        .join()
        .unwrap();
        assert!(cq.has_ready(), "foreign completions signal pollers");
        assert_eq!(cq.try_take(&mut out), 6);
        let mut seen: Vec<(u64, Status)> = out
            .bios
            .iter()
            .zip(&out.meta)
            .map(|(b, &(s, _))| (b.cookie, s))
            .collect();
        seen.sort_by_key(|x| x.0);
        let want: Vec<(u64, Status)> = (0..6)
            .map(|i| (i, if i < 3 { Status::Ok } else { Status::IoError }))
            .collect();
        assert_eq!(seen, want);
        assert!(out.bios.capacity() <= DEPTH && out.meta.capacity() <= DEPTH);
        out.bios.clear();
        out.meta.clear();
        assert_eq!(cq.try_take(&mut out), 0);
        // Blocking take returns at once when the job thread's own list has
        // something.
        bio(&cq, 9).complete(Status::Ok);
        assert_eq!(cq.wait_take(&mut out), 1);
        assert_eq!(out.bios[0].cookie, 9);
    }

    #[test]
    #[should_panic(expected = "not the job thread")]
    fn only_the_job_thread_takes() {
        let cq = Arc::new(CompletionQueue::new(4, CycleClock::get()));
        let cq2 = cq.clone();
        let r = std::thread::spawn(move || {
            let mut out = DoneList::with_capacity(4);
            cq2.try_take(&mut out);
        })
        .join();
        if let Err(e) = r {
            std::panic::resume_unwind(e);
        }
    }
}
