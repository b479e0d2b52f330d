//! The io_uring engine of the `file` device: one ring, its preallocated
//! slots and the completion thread that reaps CQEs, as the loop driver's
//! direct-I/O path (`lo_rw_aio`) submits a bio's pages to the backing file
//! and completes the bio from the I/O's completion.
//!
//! Submitters (any thread) push an SQE under a mutex and enter the kernel
//! at once; one completion thread waits for CQEs (`submit_and_wait(1)`)
//! and completes bios. Slots are preallocated (`queue_depth` of them) and
//! an SQE's `user_data` is its slot index, so nothing is allocated per
//! I/O. Bios that find every slot busy wait in a backlog the completion
//! thread drains as slots free up (it must never block on a slot itself:
//! upper layers resubmit from `end_io`). A bio with PREFLUSH takes two
//! SQEs (fsync, then its own operation); a short read or write is resumed
//! where it stopped.
//!
//! The completion thread of an interrupt-driven ring sleeps in the kernel
//! (`io_uring_enter` waiting for one CQE) even when nothing is in flight,
//! so a submission wakes nobody but the kernel: a request at queue depth
//! one costs one sleep and one wake of that thread, not a second pair for
//! parking it and unparking it (two futex calls and a context switch). A
//! stop wakes it with a NOP. A polled ring's thread still parks when idle:
//! waiting for a CQE on an IOPOLL ring with nothing in flight returns at
//! once, and would spin.
//!
//! A submitter that takes several requests in a row may hold the ring's
//! `io_uring_enter` back with a plug ([`blkstack_core::plug`], as the
//! kernel's `blk_start_plug`): its SQEs are queued and entered once, all
//! together, when its plug closes.
//!
//! A submitter with an event loop may claim the interrupt-driven ring's
//! completions ([`blkstack_core::Reaper`], as qemu's block/io_uring.c
//! hands its ring fd to its AioContext): it waits for the ring's
//! descriptor to poll readable (a CQE is posted) and reaps on its own
//! thread, so a request is submitted and completed there, with no wake of
//! the completion thread. While a claim lives that thread parks with a
//! timeout (`reap_backstop_ms=`, [`BACKSTOP`] by default) and reaps only what nobody has reaped for a
//! whole tick; CQ readers take the `cq` lock. After [`IDLE_TICKS`] ticks in
//! a row with nothing in flight it parks without a timeout, so a claimed
//! but idle device (a VM that does no I/O) costs no wake-ups; the next
//! submission unparks it (one wake per idle period, not per request: at
//! any queue depth a busy device never reaches that many idle ticks).

use super::backing::{ensure_bounce, Files, Route};
use super::join_unless_self;
use super::refusal::PollRefusal;
use blkstack_core::{AlignedBuf, Bio, BioFlags, Op, Status};
use io_uring::{opcode, squeue, types, IoUring};
use parking_lot::{Mutex, MutexGuard};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

/// The interrupt-driven ring a polled ring falls back to, and the
/// refusal it records (`Arc` so the polled ring can name both).
pub(super) type Fallback = (Arc<RingShared>, Arc<PollRefusal>);

/// The kernel's `IORING_SETUP_CQSIZE` (include/uapi/linux/io_uring.h).
const SETUP_CQSIZE: u32 = 1 << 3;

/// `user_data` of the NOP that wakes the completion thread at a stop (no
/// slot has this index).
const WAKE: u64 = u64::MAX;

/// While a claimant reaps, how often the completion thread looks for
/// CQEs nobody reaped since its last look (a claimant busy elsewhere or
/// stalled): the longest such a CQE waits is two of these. The table's
/// `reap_backstop_ms=` sets it.
pub(super) const BACKSTOP: Duration =
    Duration::from_millis(super::options::DEFAULT_REAP_BACKSTOP_MS);

/// Backstop ticks in a row that found nothing in flight before the
/// completion thread parks until the next submission.
pub(super) const IDLE_TICKS: u32 = 5;

/// CQEs copied out of the ring per turn of the `cq` lock.
const REAP_CHUNK: usize = 32;

/// Which SQE a slot's bio is waiting for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stage {
    /// The fsync a PREFLUSH bio needs before its own operation.
    PreFlush,
    Main,
}

struct Slot {
    bio: Option<Bio>,
    stage: Stage,
    route: Route,
    /// Bytes of a read/write already transferred (short transfers resume).
    done: u64,
    bounce: Option<AlignedBuf>,
}

struct FreeList {
    free: Vec<u32>,
    /// Bios that arrived while every slot was busy.
    backlog: VecDeque<Bio>,
}

/// The kernel's `struct io_uring_params` (include/uapi/linux/io_uring.h),
/// to set up rings with flags the io-uring crate's builder has no setter
/// for (`IORING_SETUP_HYBRID_IOPOLL`).
#[repr(C)]
#[derive(Default)]
struct RawParams {
    sq_entries: u32,
    cq_entries: u32,
    flags: u32,
    sq_thread_cpu: u32,
    sq_thread_idle: u32,
    features: u32,
    wq_fd: u32,
    resv: [u32; 3],
    sq_off: [u64; 5],
    cq_off: [u64; 5],
}

const _: () = assert!(std::mem::size_of::<RawParams>() == 120);
const _: () =
    assert!(std::mem::size_of::<RawParams>() == std::mem::size_of::<io_uring::Parameters>());

/// `io_uring_setup(entries, {flags})` and wrap the result.
pub(super) fn setup_ring(entries: u32, flags: u32) -> std::io::Result<IoUring> {
    let mut p = RawParams {
        flags: flags | SETUP_CQSIZE,
        cq_entries: entries * 2,
        ..Default::default()
    };
    // SAFETY: io_uring_setup reads and fills a correctly laid-out params struct.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_io_uring_setup,
            entries as libc::c_long,
            &mut p as *mut RawParams,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `Parameters` is a transparent wrapper of `io_uring_params`
    // (sizes checked above), filled in by the kernel for this very fd, and
    // the fd is a fresh ring we hand over.
    unsafe {
        let params: io_uring::Parameters = std::mem::transmute(p);
        IoUring::from_fd(fd as RawFd, params).inspect_err(|_| {
            libc::close(fd as RawFd);
        })
    }
}

pub(super) struct RingShared {
    /// This ring, for a plug to flush it ([`blkstack_core::plug`]).
    me: std::sync::Weak<RingShared>,
    name: String,
    ring: IoUring,
    /// Serializes access to the submission queue (submitters are many).
    sq: Mutex<()>,
    slots: Box<[Mutex<Slot>]>,
    free: Mutex<FreeList>,
    /// SQEs submitted and not yet reaped.
    inflight: AtomicU32,
    /// Serializes completion queue readers (the completion thread and
    /// claimants; see [`blkstack_core::Reaper`]).
    cq: Mutex<()>,
    /// Live claims on this ring's completions.
    reapers: AtomicU32,
    /// Reaps that found CQEs (the backstop's sign of progress).
    reaps: AtomicU64,
    /// The backstop parked without a timeout (nothing in flight for
    /// [`IDLE_TICKS`] ticks): the next submission takes the flag and
    /// unparks it. Paired with `inflight` in SeqCst on both sides, so
    /// either the submitter sees the flag or the thread sees the I/O.
    pub(super) idle_parked: AtomicBool,
    /// Backstop ticks taken (tests check an idle claim takes none).
    pub(super) backstop_ticks: AtomicU64,
    pub(super) files: Arc<Files>,
    /// Set for a polled ring: where refused I/O goes, and the shared flag
    /// that says polling was refused.
    fallback: Option<Fallback>,
    stop: AtomicBool,
    thread: OnceLock<std::thread::Thread>,
    /// The backstop's tick ([`BACKSTOP`] unless the table sets it).
    pub(super) backstop: Duration,
}

impl RingShared {
    pub(super) fn new(
        name: String,
        ring: IoUring,
        depth: u32,
        files: Arc<Files>,
        fallback: Option<Fallback>,
    ) -> RingShared {
        let slots = (0..depth)
            .map(|_| {
                Mutex::new(Slot {
                    bio: None,
                    stage: Stage::Main,
                    route: Route::Buffered,
                    done: 0,
                    bounce: None,
                })
            })
            .collect();
        RingShared {
            me: std::sync::Weak::new(),
            name,
            ring,
            sq: Mutex::new(()),
            slots,
            free: Mutex::new(FreeList {
                free: (0..depth).rev().collect(),
                backlog: VecDeque::with_capacity(depth as usize),
            }),
            inflight: AtomicU32::new(0),
            cq: Mutex::new(()),
            reapers: AtomicU32::new(0),
            reaps: AtomicU64::new(0),
            idle_parked: AtomicBool::new(false),
            backstop_ticks: AtomicU64::new(0),
            files,
            fallback,
            stop: AtomicBool::new(false),
            thread: OnceLock::new(),
            backstop: BACKSTOP,
        }
    }

    fn is_polled(&self) -> bool {
        self.fallback.is_some()
    }

    /// Wake a completion thread that waits for a CQE with nothing in
    /// flight (a stop): a NOP whose CQE it reaps and ignores.
    fn wake_waiter(&self) {
        let nop = opcode::Nop::new().build().user_data(WAKE);
        {
            let _g = self.sq.lock();
            // SAFETY: the `sq` mutex makes this the only submission queue
            // handle alive; a NOP carries no buffer.
            let mut sq = unsafe { self.ring.submission_shared() };
            // SAFETY: as above.
            if unsafe { sq.push(&nop) }.is_err() {
                // A full queue: the SQEs in it wake the thread anyway.
                return;
            }
            sq.sync();
        }
        let _ = self.ring.submit();
    }

    pub(super) fn submit(&self, bio: Bio) {
        let idx = {
            let mut f = self.free.lock();
            match f.free.pop() {
                Some(i) => i,
                None => {
                    f.backlog.push_back(bio);
                    return;
                }
            }
        };
        self.start(idx, bio);
    }

    /// Put `bio` in slot `idx` and issue its first SQE.
    fn start(&self, idx: u32, bio: Bio) {
        let mut slot = self.slots[idx as usize].lock();
        slot.stage = if bio.flags.contains(BioFlags::PREFLUSH) && bio.op != Op::Flush {
            Stage::PreFlush
        } else {
            Stage::Main
        };
        slot.done = 0;
        slot.route = if bio.op.has_data() {
            self.files.route(&bio)
        } else {
            Route::Buffered
        };
        if bio.op.has_data() {
            self.files.count_route(slot.route);
        }
        if slot.route == Route::Bounce {
            let len = bio.len as usize;
            let b = ensure_bounce(&mut slot.bounce, len);
            if bio.op == Op::Write {
                b.as_mut_slice()[..len].copy_from_slice(bio.data());
            }
        }
        slot.bio = Some(bio);
        let sqe = self.build_sqe(idx, &slot);
        drop(slot);
        self.push(sqe);
    }

    fn build_sqe(&self, idx: u32, slot: &Slot) -> squeue::Entry {
        let bio = slot.bio.as_ref().expect("a slot being issued holds a bio");
        let files = &self.files;
        let buffered = types::Fd(files.buffered.as_raw_fd());
        let sqe = if slot.stage == Stage::PreFlush {
            opcode::Fsync::new(buffered).build()
        } else {
            match bio.op {
                Op::Read | Op::Write => {
                    let fd = types::Fd(files.fd_for(slot.route));
                    let base = match (&slot.bounce, slot.route) {
                        (Some(b), Route::Bounce) => b.as_slice().as_ptr() as *mut u8,
                        _ => bio.buf.as_ptr(),
                    };
                    // SAFETY: done < len, in bounds of the buffer.
                    let ptr = unsafe { base.add(slot.done as usize) };
                    let len = (bio.len - slot.done) as u32;
                    let off = bio.offset + slot.done;
                    if bio.op == Op::Read {
                        opcode::Read::new(fd, ptr, len).offset(off).build()
                    } else {
                        let flags = if bio.flags.contains(BioFlags::FUA) {
                            libc::RWF_DSYNC
                        } else {
                            0
                        };
                        opcode::Write::new(fd, ptr, len)
                            .offset(off)
                            .rw_flags(flags)
                            .build()
                    }
                }
                Op::Flush => opcode::Fsync::new(buffered).build(),
                Op::Discard => opcode::Fallocate::new(buffered, bio.len)
                    .offset(bio.offset)
                    .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                    .build(),
                Op::WriteZeroes => opcode::Fallocate::new(buffered, bio.len)
                    .offset(bio.offset)
                    .mode(files.zero_mode(bio.flags))
                    .build(),
            }
        };
        sqe.user_data(idx as u64)
    }

    /// Queue one SQE and enter the kernel right away.
    fn push(&self, sqe: squeue::Entry) {
        let was = self.inflight.fetch_add(1, Ordering::SeqCst);
        let idle = self.idle_parked.load(Ordering::SeqCst)
            && self.idle_parked.swap(false, Ordering::SeqCst);
        if (was == 0 && self.is_polled()) || idle {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
        {
            let _g = self.sq.lock();
            // SAFETY: the `sq` mutex makes this the only submission queue
            // handle alive.
            let mut sq = unsafe { self.ring.submission_shared() };
            // Each slot has at most one SQE outstanding and there are no
            // more slots than SQ entries, so the queue has room.
            // SAFETY: the SQE's buffer (bio memory or the slot's bounce
            // buffer) stays valid until its CQE is reaped.
            while unsafe { sq.push(&sqe) }.is_err() {
                drop(sq);
                let _ = self.ring.submit();
                // SAFETY: as above.
                sq = unsafe { self.ring.submission_shared() };
            }
            sq.sync();
        }
        // A plug on this thread enters once for all its SQEs.
        let key = self as *const RingShared as usize;
        let me = || {
            self.me
                .upgrade()
                .map(|r| r as Arc<dyn blkstack_core::plug::Flush>)
        };
        if blkstack_core::plug::defer(key, me) {
            return;
        }
        self.enter();
    }

    /// Enter the kernel with the SQEs queued.
    fn enter(&self) {
        loop {
            match self.ring.submit() {
                Ok(_) => break,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                    ) =>
                {
                    // The completion thread's next enter submits it too.
                    if e.raw_os_error() != Some(libc::EINTR) {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(ring = %self.name, error = %e, "file: io_uring_enter failed");
                    break;
                }
            }
        }
    }

    /// The completion thread: reap CQEs, finish or continue their bios.
    fn run_completions(self: Arc<Self>) {
        // The reap count at the backstop's last look, and whether CQEs
        // were waiting then.
        let mut last: Option<u64> = None;
        // Backstop ticks in a row that found nothing in flight, and the
        // reap count the last of them saw.
        let (mut idle, mut seen) = (0u32, 0u64);
        loop {
            let stopping = self.stop.load(Ordering::Acquire);
            if self.inflight.load(Ordering::Acquire) == 0 {
                if stopping {
                    break;
                }
                if self.is_polled() {
                    std::thread::park();
                    continue;
                }
            }
            if !stopping && self.reapers.load(Ordering::Acquire) > 0 {
                let parked = idle == IDLE_TICKS;
                (idle, seen) = self.backstop_idle(idle, seen);
                if parked {
                    // A new period of I/O: the last look is stale.
                    last = None;
                }
                if idle < IDLE_TICKS {
                    last = self.backstop(last);
                }
                continue;
            }
            idle = 0;
            last = None;
            if let Err(e) = self.ring.submit_and_wait(1) {
                if !matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                ) {
                    tracing::warn!(
                        ring = %self.name,
                        error = %e,
                        "file: waiting for completions failed"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            self.reap_ready();
        }
    }

    /// One tick of the backstop while a claimant reaps: sleep a tick (a
    /// dropped claim or a stop wakes it early), then reap only if CQEs
    /// were waiting at the last tick too and nobody has reaped since.
    /// Returns what this tick saw, for the next.
    fn backstop(&self, last: Option<u64>) -> Option<u64> {
        self.backstop_ticks.fetch_add(1, Ordering::Relaxed);
        std::thread::park_timeout(self.backstop);
        if self.reapers.load(Ordering::Acquire) == 0 {
            return None;
        }
        let reaps = self.reaps.load(Ordering::Acquire);
        if last == Some(reaps) && self.cq_pending() {
            self.reap_ready();
            return None;
        }
        self.cq_pending().then_some(reaps)
    }

    /// Count a backstop tick that finds nothing in flight and no reap
    /// since the last one; at [`IDLE_TICKS`] of them in a row, park until
    /// a submission, a dropped claim or a stop unparks. Returns the new
    /// count and the reap count it saw (any I/O resets the count).
    fn backstop_idle(&self, idle: u32, seen: u64) -> (u32, u64) {
        let reaps = self.reaps.load(Ordering::Acquire);
        if self.inflight.load(Ordering::SeqCst) != 0 || reaps != seen {
            return (0, reaps);
        }
        if idle < IDLE_TICKS {
            return (idle + 1, reaps);
        }
        self.idle_parked.store(true, Ordering::SeqCst);
        // A submission between the flag and this load unparks us (or we
        // see its I/O here): no wake is lost.
        if self.inflight.load(Ordering::SeqCst) == 0 && self.reapers.load(Ordering::Acquire) > 0 {
            std::thread::park();
        }
        self.idle_parked.store(false, Ordering::SeqCst);
        if self.inflight.load(Ordering::SeqCst) != 0 {
            return (0, reaps);
        }
        (idle, reaps)
    }

    /// Whether CQEs wait in the ring.
    fn cq_pending(&self) -> bool {
        let _g = self.cq.lock();
        // SAFETY: the `cq` mutex makes this the only completion queue
        // reader; dropping it without consuming moves nothing.
        let cq = unsafe { self.ring.completion_shared() };
        !cq.is_empty()
    }

    /// Complete every CQE the ring holds now, on the calling thread, in
    /// one completion batch (a completer above with per-batch work, an
    /// NBD connection's send or a virtqueue's call, does it once); how
    /// many bios it finished or continued.
    pub(super) fn reap_ready(&self) -> usize {
        let _batch = blkstack_core::comp_batch::CompletionBatch::start();
        let mut done = 0;
        loop {
            let mut buf = [(0u64, 0i32); REAP_CHUNK];
            let got = {
                let _g = self.cq.lock();
                // SAFETY: the `cq` mutex makes this the only completion
                // queue reader; the CQEs are copied out before the head
                // moves past them (when `cq` drops).
                let cq = unsafe { self.ring.completion_shared() };
                let mut n = 0;
                for (slot, c) in buf.iter_mut().zip(cq) {
                    *slot = (c.user_data(), c.result());
                    n += 1;
                }
                n
            };
            if got == 0 {
                return done;
            }
            self.reaps.fetch_add(1, Ordering::AcqRel);
            for &(idx, res) in &buf[..got] {
                if idx == WAKE {
                    continue;
                }
                self.inflight.fetch_sub(1, Ordering::AcqRel);
                self.on_cqe(idx as u32, res);
                done += 1;
            }
        }
    }

    /// Claim this ring's completions for the caller's thread (see
    /// [`blkstack_core::Reaper`]). Not for a polled ring: its CQEs are
    /// only found by polling, never by its descriptor.
    pub(super) fn claim(self: &Arc<Self>) -> Box<dyn blkstack_core::Reaper> {
        if self.reapers.fetch_add(1, Ordering::AcqRel) == 0 {
            // The completion thread waits in the ring: wake it, so that it
            // stands aside before the claimant's first completion.
            self.wake_waiter();
        }
        Box::new(Claim(self.clone()))
    }

    fn on_cqe(&self, idx: u32, res: i32) {
        let mut guard = self.slots[idx as usize].lock();
        // A plain reference, so that fields borrow separately.
        let slot: &mut Slot = &mut guard;
        let Some(bio) = slot.bio.as_ref() else {
            debug_assert!(false, "CQE for an idle slot {idx}");
            return;
        };
        if slot.stage == Stage::PreFlush {
            if res < 0 {
                drop(guard);
                return self.finish(idx, Status::from_errno(res));
            }
            slot.stage = Stage::Main;
            let sqe = self.build_sqe(idx, slot);
            drop(guard);
            return self.push(sqe);
        }
        let status = |res: i32| {
            if res < 0 {
                Status::from_errno(res)
            } else {
                Status::Ok
            }
        };
        match bio.op {
            Op::Read | Op::Write => self.on_read_write_cqe(idx, guard, res),
            Op::Discard | Op::WriteZeroes => {
                // Possibly slow (writing zeroes): rare, and only when the
                // filesystem lacks ZERO_RANGE.
                let st = self.files.after_fallocate(bio, status(res));
                drop(guard);
                self.finish(idx, st)
            }
            Op::Flush => {
                drop(guard);
                self.finish(idx, status(res))
            }
        }
    }

    /// A read/write CQE: finish the bio, continue a short transfer, retry
    /// EAGAIN, or (on a polled ring) move a refused bio to the interrupt
    /// ring.
    fn on_read_write_cqe(&self, idx: u32, mut guard: MutexGuard<'_, Slot>, res: i32) {
        if res == -libc::EOPNOTSUPP {
            if let Some((normal, refusal)) = &self.fallback {
                let bio = guard.bio.take().expect("on_cqe checked the slot");
                drop(guard);
                return self.resubmit_refused(idx, bio, normal, refusal);
            }
        }
        let slot: &mut Slot = &mut guard;
        let bio = slot.bio.as_ref().expect("on_cqe checked the slot");
        if res == -libc::EAGAIN || res == -libc::EINTR {
            let sqe = self.build_sqe(idx, slot);
            drop(guard);
            return self.push(sqe);
        }
        if res < 0 {
            drop(guard);
            return self.finish(idx, Status::from_errno(res));
        }
        let len = bio.len;
        if res == 0 && slot.done < len {
            if bio.op == Op::Write {
                drop(guard);
                return self.finish(idx, Status::IoError);
            }
            // A read past the end of a file someone shortened reads
            // zeroes, as the loop driver does.
            let done = slot.done as usize;
            match (slot.route, &mut slot.bounce) {
                (Route::Bounce, Some(b)) => b.as_mut_slice()[done..len as usize].fill(0),
                _ => bio.data_mut()[done..].fill(0),
            }
            slot.done = len;
        } else {
            slot.done += res as u64;
        }
        if slot.done < len {
            let sqe = self.build_sqe(idx, slot);
            drop(guard);
            return self.push(sqe);
        }
        if bio.op == Op::Read && slot.route == Route::Bounce {
            if let Some(b) = &slot.bounce {
                bio.data_mut()
                    .copy_from_slice(&b.as_slice()[..len as usize]);
            }
        }
        if self.is_polled() {
            self.files.stats.polled.fetch_add(1, Ordering::Relaxed);
        }
        drop(guard);
        self.finish(idx, Status::Ok)
    }

    /// Complete the slot's bio and reuse the slot for a waiting one.
    fn finish(&self, idx: u32, status: Status) {
        let bio = self.slots[idx as usize]
            .lock()
            .bio
            .take()
            .expect("finishing a slot that holds a bio");
        if !status.is_ok() {
            self.files.stats.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.release(idx);
        bio.complete(status);
    }

    /// Give slot `idx` to the oldest waiting bio, or back to the free list.
    pub(super) fn release(&self, idx: u32) {
        let next = {
            let mut f = self.free.lock();
            match f.backlog.pop_front() {
                Some(b) => Some(b),
                None => {
                    f.free.push(idx);
                    None
                }
            }
        };
        if let Some(b) = next {
            self.start(idx, b);
        }
    }
}

/// A ring and its completion thread.
pub(super) struct Ring {
    pub(super) shared: Arc<RingShared>,
    thread: Option<JoinHandle<()>>,
}

impl Ring {
    pub(super) fn spawn(shared: RingShared) -> std::io::Result<Ring> {
        let shared = Arc::new_cyclic(|me| RingShared {
            me: me.clone(),
            ..shared
        });
        let s2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("file-cq-{}", shared.name))
            .spawn(move || s2.run_completions())?;
        let _ = shared.thread.set(thread.thread().clone());
        Ok(Ring {
            shared,
            thread: Some(thread),
        })
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if !self.shared.is_polled() {
            self.shared.wake_waiter();
        }
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            join_unless_self(t);
        }
    }
}

impl blkstack_core::plug::Flush for RingShared {
    fn flush(&self) {
        self.enter();
    }
}

/// One claim on a ring's completions; dropping it hands them back to the
/// completion thread (woken so that it waits in the ring again at once).
struct Claim(Arc<RingShared>);

impl blkstack_core::Reaper for Claim {
    fn fd(&self) -> RawFd {
        self.0.ring.as_raw_fd()
    }

    fn reap(&self) -> usize {
        self.0.reap_ready()
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.0.reapers.fetch_sub(1, Ordering::AcqRel);
        if let Some(t) = self.0.thread.get() {
            t.unpark();
        }
    }
}
