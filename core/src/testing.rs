//! Shared test helpers (cargo feature `testing`, enabled by the other
//! crates in their `[dev-dependencies]`): one completion recorder instead
//! of one per test file, and what the no-allocation tests share (a
//! counting global allocator and a free list of reusable bios).

use crate::bio::{AlignedBuf, Bio, EndIo, Op};
use crate::clock::now_ns;
use crate::status::Status;
use parking_lot::{Condvar, Mutex};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One completion a [`CompletionRecorder`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completed {
    /// The `private` value of the frame (the cookie given to `Bio::new`:
    /// a tag, an index, an offset, whatever the test chose).
    pub cookie: u64,
    /// The bio's offset as it came back (restored to what its owner
    /// submitted).
    pub offset: u64,
    /// How the bio ended.
    pub status: Status,
    /// When it completed, on [`now_ns`].
    pub at_ns: u64,
}

/// An [`EndIo`] owner that records every completion and lets a test wait
/// for a number of them.
#[derive(Default)]
pub struct CompletionRecorder {
    done: Mutex<Vec<Completed>>,
    cv: Condvar,
}

impl CompletionRecorder {
    /// An empty recorder, shared so it can own bios and be waited on.
    pub fn new() -> Arc<CompletionRecorder> {
        Arc::new(CompletionRecorder::default())
    }

    /// Wait until at least `n` completions arrived; `None` if they did not
    /// within `timeout`.
    pub fn try_wait(&self, n: usize, timeout: Duration) -> Option<Vec<Completed>> {
        let until = Instant::now() + timeout;
        let mut g = self.done.lock();
        while g.len() < n {
            if self.cv.wait_until(&mut g, until).timed_out() && g.len() < n {
                return None;
            }
        }
        Some(g.clone())
    }

    /// Wait until at least `n` completions arrived and return all seen so
    /// far; panics, naming how many came, if they do not within `timeout`.
    pub fn wait(&self, n: usize, timeout: Duration) -> Vec<Completed> {
        match self.try_wait(n, timeout) {
            Some(v) => v,
            None => panic!(
                "only {} of {n} completions arrived within {timeout:?}",
                self.count()
            ),
        }
    }

    /// Completions so far.
    pub fn count(&self) -> usize {
        self.done.lock().len()
    }

    /// Every completion so far, in completion order.
    pub fn completions(&self) -> Vec<Completed> {
        self.done.lock().clone()
    }

    /// The statuses so far, in completion order.
    pub fn statuses(&self) -> Vec<Status> {
        self.done.lock().iter().map(|c| c.status).collect()
    }

    /// Forget what was recorded.
    pub fn clear(&self) {
        self.done.lock().clear();
    }
}

impl EndIo for CompletionRecorder {
    fn end_io(&self, bio: Bio, status: Status, cookie: u64) {
        let c = Completed {
            cookie,
            offset: bio.offset,
            status,
            at_ns: now_ns(),
        };
        drop(bio);
        self.done.lock().push(c);
        self.cv.notify_all();
    }
}

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

/// A global allocator that counts allocations (and reallocations), for a
/// test binary that installs it with `#[global_allocator]` and checks a
/// hot path allocates nothing. The count is process-wide.
///
/// Between [`CountingAlloc::trace_start`] and [`CountingAlloc::trace_take`]
/// it also keeps the backtraces of the first few allocations, so a test
/// that finds one can say where it came from (an allocation that shows up
/// only on a slow machine cannot be found by rerunning on a fast one).
pub struct CountingAlloc;

/// How many allocations' backtraces a trace keeps.
const TRACE_MAX: usize = 4;
static TRACING: AtomicBool = AtomicBool::new(false);
static TRACES: Mutex<Vec<std::backtrace::Backtrace>> = Mutex::new(Vec::new());
/// Backtraces being captured right now, on any thread.
static CAPTURING: AtomicUsize = AtomicUsize::new(0);

std::thread_local! {
    /// Set while this thread records a backtrace: what that allocates is
    /// the tracer's own, neither counted nor traced.
    static IN_TRACE: Cell<bool> = const { Cell::new(false) };
}

impl CountingAlloc {
    /// Allocations so far in this process.
    pub fn count() -> u64 {
        ALLOCATIONS.load(Relaxed)
    }

    /// Keep the backtraces of the next allocations (any thread's).
    pub fn trace_start() {
        TRACES.lock().clear();
        TRACING.store(true, Relaxed);
    }

    /// Stop tracing; the backtraces kept since [`Self::trace_start`],
    /// once those being captured on other threads are in (bounded).
    pub fn trace_take() -> Vec<String> {
        TRACING.store(false, SeqCst);
        let t0 = Instant::now();
        while CAPTURING.load(SeqCst) > 0 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let traces = std::mem::take(&mut *TRACES.lock());
        traces.iter().map(|t| t.to_string()).collect()
    }

    fn counted() -> bool {
        let own = IN_TRACE.try_with(|t| t.get()).unwrap_or(true);
        if own {
            return false;
        }
        ALLOCATIONS.fetch_add(1, Relaxed);
        CAPTURING.fetch_add(1, SeqCst);
        if TRACING.load(SeqCst) {
            IN_TRACE.with(|t| t.set(true));
            let bt = std::backtrace::Backtrace::force_capture();
            let mut traces = TRACES.lock();
            if traces.len() < TRACE_MAX {
                traces.push(bt);
            }
            drop(traces);
            IN_TRACE.with(|t| t.set(false));
        }
        CAPTURING.fetch_sub(1, SeqCst);
        true
    }
}

// SAFETY: forwards to the system allocator; only counts (and, while a
// trace runs, records backtraces with the counting turned off for the
// recording thread, so it never recurses into itself).
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        Self::counted();
        // SAFETY: the caller's layout is passed on unchanged.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `System` with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        Self::counted();
        // SAFETY: `p` came from `System` with layout `l`.
        unsafe { System.realloc(p, l, n) }
    }
}

/// An [`EndIo`] owner that keeps completed bios for reuse: a submitter
/// takes one, rearms and submits it, and gets it back on completion.
pub struct BioFreeList {
    free: Mutex<Vec<Bio>>,
    cv: Condvar,
}

impl BioFreeList {
    /// An empty list with room for `capacity` bios (it never grows past
    /// what was submitted through it).
    pub fn new(capacity: usize) -> Arc<BioFreeList> {
        Arc::new(BioFreeList {
            free: Mutex::new(Vec::with_capacity(capacity)),
            cv: Condvar::new(),
        })
    }

    /// Put `n` reads of `len` bytes on the list, each over its own range
    /// of `mem` (bio `i` at `i * len`, cookie `i`).
    ///
    /// # Safety
    /// The caller must keep `mem` alive, and not touch it, until every
    /// bio is back on the list for the last time.
    pub unsafe fn prime(self: &Arc<Self>, mem: &AlignedBuf, n: usize, len: usize) {
        let owner: Arc<dyn EndIo> = self.clone();
        for i in 0..n {
            // SAFETY: the caller keeps `mem` alive and untouched.
            let io = unsafe { mem.io_buf(i * len, len) };
            Bio::new(Op::Read, 0, len as u64, io, owner.clone(), i as u64).complete(Status::Ok);
        }
    }

    /// Take a free bio; while none is, call `reap` (a poll that may end
    /// some) if given, else sleep until one comes back.
    pub fn take(&self, mut reap: Option<&mut dyn FnMut()>) -> Bio {
        let mut f = self.free.lock();
        loop {
            if let Some(bio) = f.pop() {
                return bio;
            }
            match reap.as_mut() {
                Some(reap) => {
                    drop(f);
                    reap();
                    f = self.free.lock();
                }
                None => self.cv.wait(&mut f),
            }
        }
    }

    /// Bios on the list now.
    pub fn len(&self) -> usize {
        self.free.lock().len()
    }

    /// Whether every bio is out (submitted and not yet back).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl EndIo for BioFreeList {
    fn end_io(&self, bio: Bio, _status: Status, _cookie: u64) {
        self.free.lock().push(bio);
        self.cv.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bio::IoBuf;

    #[test]
    fn records_each_completion_once_and_waits_for_n() {
        let rec = CompletionRecorder::new();
        let r2 = rec.clone();
        let t = std::thread::spawn(move || {
            for i in 0..3u64 {
                let bio = Bio::new(Op::Flush, i * 4096, 0, IoBuf::empty(), r2.clone(), i);
                bio.complete(if i == 1 { Status::IoError } else { Status::Ok });
            }
        });
        let got = rec.wait(3, Duration::from_secs(10));
        t.join().expect("completer");
        assert_eq!(got.len(), 3);
        assert_eq!(
            got.iter().map(|c| (c.cookie, c.offset)).collect::<Vec<_>>(),
            [(0, 0), (1, 4096), (2, 8192)]
        );
        assert_eq!(rec.statuses(), [Status::Ok, Status::IoError, Status::Ok]);
        assert!(got.windows(2).all(|w| w[0].at_ns <= w[1].at_ns));
        assert!(rec.try_wait(4, Duration::from_millis(20)).is_none());
        rec.clear();
        assert_eq!(rec.count(), 0);
    }

    #[test]
    fn a_free_list_hands_back_what_completed() {
        let list = BioFreeList::new(2);
        Bio::new(Op::Flush, 0, 0, IoBuf::empty(), list.clone(), 1).complete(Status::Ok);
        assert_eq!(list.len(), 1);
        let bio = list.take(None);
        assert!(list.is_empty());
        // With a reaper, an empty list calls it until a bio is back.
        let mut held = Some(bio);
        let mut calls = 0;
        let owner: Arc<dyn EndIo> = list.clone();
        let mut reap = || {
            calls += 1;
            if let Some(mut b) = held.take() {
                b.rearm(owner.clone(), Op::Flush, 0, 0, IoBuf::empty());
                b.complete(Status::Ok);
            }
        };
        let again = list.take(Some(&mut reap));
        assert_eq!(calls, 1);
        drop(again);
    }
}
