//! The job thread's completion queue: where `end_io` leaves finished bios
//! for the job loop, whichever thread completed them.
//!
//! Completions may arrive inline inside `submit` (null, memory) or later on
//! another thread (mq workers). Either way `end_io` only queues the bio
//! here; the job loop picks it up, so nothing is ever resubmitted from
//! inside `end_io` and the submitter's stack never grows with the queue
//! depth (the kernel's rule that a bio's end_io must not recurse into
//! submission). Completions on the job thread go to a list only that
//! thread touches; others go to a locked list and wake the job thread
//! when it blocks (`wait=interrupt`).

use blkstack_core::clock::CycleClock;
use blkstack_core::{Bio, EndIo, Status};
use parking_lot::{Condvar, Mutex};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Completed bios waiting for the job loop, with their status and
/// completion time in a parallel list: a bio is 128 bytes and moves with
/// inline stores, a bio plus its metadata would not (see
/// `blkstack_core::bio::INLINE_FRAMES`).
pub(crate) struct DoneList {
    pub(crate) bios: Vec<Bio>,
    pub(crate) meta: Vec<(Status, u64)>,
}

impl DoneList {
    pub(crate) fn with_capacity(depth: usize) -> DoneList {
        DoneList {
            bios: Vec::with_capacity(depth),
            meta: Vec::with_capacity(depth),
        }
    }

    #[inline]
    pub(crate) fn push(&mut self, bio: Bio, status: Status, done_ns: u64) {
        self.bios.push(bio);
        self.meta.push((status, done_ns));
    }

    pub(crate) fn len(&self) -> usize {
        self.bios.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.bios.is_empty()
    }

    /// Move everything here into `out`: a swap when `out` is empty (both
    /// keep their capacity), else an append (never past the depth both
    /// were made for, since at most `depth` bios are in flight).
    pub(crate) fn move_into(&mut self, out: &mut DoneList) {
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
    pub(crate) fn new(depth: usize, clock: &'static CycleClock) -> CompletionQueue {
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
    pub(crate) fn try_take(&self, out: &mut DoneList) -> usize {
        self.take_local(out);
        if self.ready.load(Ordering::Acquire) != 0 {
            let mut g = self.inner.lock();
            g.items.move_into(out);
            self.ready.store(0, Ordering::Relaxed);
        }
        out.len()
    }

    /// Block until something completed, then take it.
    pub(crate) fn wait_take(&self, out: &mut DoneList) -> usize {
        self.wait_take_within(out, None)
    }

    /// Block until something completed or `limit` passed, then take what
    /// there is.
    pub(crate) fn wait_take_for(&self, out: &mut DoneList, limit: Duration) -> usize {
        self.wait_take_within(out, Some(limit))
    }

    fn wait_take_within(&self, out: &mut DoneList, limit: Option<Duration>) -> usize {
        self.take_local(out);
        if !out.is_empty() {
            return self.try_take(out);
        }
        let mut g = self.inner.lock();
        let deadline = limit.map(|l| std::time::Instant::now() + l);
        while g.items.is_empty() {
            g.waiter = true;
            match deadline {
                None => self.cv.wait(&mut g),
                Some(d) => {
                    if self.cv.wait_until(&mut g, d).timed_out() {
                        break;
                    }
                }
            }
        }
        g.waiter = false;
        g.items.move_into(out);
        self.ready.store(0, Ordering::Relaxed);
        out.len()
    }

    /// Whether anything completed, on this thread or another. Job thread
    /// only.
    pub(crate) fn has_any(&self) -> bool {
        assert_eq!(thread_marker(), self.job_thread, "not the job thread");
        // SAFETY: the job thread reads its own list's length while no
        // `end_io` runs on it (this is not called from inside one).
        let local = unsafe { !(*self.local.get()).is_empty() };
        local || self.has_ready()
    }

    #[inline]
    pub(crate) fn has_ready(&self) -> bool {
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

/// Set by a job with `exitall` when it ends: the other jobs of its
/// stonewall segment stop (fio's default `exit_what=group`).
static SEGMENT_STOP: AtomicBool = AtomicBool::new(false);

pub(crate) fn request_segment_stop() {
    SEGMENT_STOP.store(true, Ordering::Relaxed);
}

/// Called as each stonewall segment starts.
pub(crate) fn clear_segment_stop() {
    SEGMENT_STOP.store(false, Ordering::Relaxed);
}

pub(crate) fn stop_requested() -> bool {
    STOP_REQUESTED.load(Ordering::Relaxed) || SEGMENT_STOP.load(Ordering::Relaxed)
}

/// Live counters a progress display reads while the job runs.
#[derive(Default)]
pub struct JobProgress {
    pub ios: AtomicU64,
    pub bytes: AtomicU64,
    pub read_ios: AtomicU64,
    pub write_ios: AtomicU64,
    pub read_bytes: AtomicU64,
    pub write_bytes: AtomicU64,
    /// The job has finished (all phases).
    pub done: AtomicBool,
    /// 0 = ramp, 1 = I/O, 2 = verify.
    pub phase: AtomicU64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkstack_core::IoBuf;
    use blkstack_core::Op;
    use std::sync::Arc;

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
