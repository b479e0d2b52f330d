//! The synchronisation primitives the engine's lock-free parts are built
//! on, switched to `loom`'s model-checked versions under `--cfg loom`.
//!
//! Only the sbitmap queue (tags and their wait queues) is compiled under
//! loom: that is where a lost wakeup would hide, and keeping the shim this
//! small keeps the model fast enough to explore 2-3 threads exhaustively.

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicU32, AtomicU64};
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicU32, AtomicU64};
#[cfg(loom)]
pub(crate) use loom::sync::Arc;

/// A plain mutex with the same face under both builds.
pub(crate) struct Lock<T> {
    #[cfg(not(loom))]
    inner: parking_lot::Mutex<T>,
    #[cfg(loom)]
    inner: loom::sync::Mutex<T>,
}

impl<T> Lock<T> {
    pub(crate) fn new(v: T) -> Lock<T> {
        Lock {
            #[cfg(not(loom))]
            inner: parking_lot::Mutex::new(v),
            #[cfg(loom)]
            inner: loom::sync::Mutex::new(v),
        }
    }

    #[cfg(not(loom))]
    #[inline]
    pub(crate) fn lock(&self) -> parking_lot::MutexGuard<'_, T> {
        self.inner.lock()
    }

    #[cfg(loom)]
    pub(crate) fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
        self.inner.lock().expect("loom mutex poisoned")
    }
}

/// How one thread sleeps until another wakes it (the kernel's task state
/// plus `wake_up_process`, as far as a wait queue entry needs it).
///
/// Normal builds park the thread (a futex). Under loom a condition
/// variable is used instead, because loom's `unpark` also makes runnable a
/// thread that is blocked on a mutex (a limitation of its model), which
/// would report a false failure.
pub(crate) struct Parker {
    #[cfg(not(loom))]
    thread: std::thread::Thread,
    #[cfg(loom)]
    lock: loom::sync::Mutex<()>,
    #[cfg(loom)]
    cv: loom::sync::Condvar,
}

impl Parker {
    /// A parker for the calling thread.
    pub(crate) fn for_current_thread() -> Parker {
        Parker {
            #[cfg(not(loom))]
            thread: std::thread::current(),
            #[cfg(loom)]
            lock: loom::sync::Mutex::new(()),
            #[cfg(loom)]
            cv: loom::sync::Condvar::new(),
        }
    }

    /// Wake the thread if it sleeps in [`Parker::park_until`]; the caller
    /// has already made the condition true.
    pub(crate) fn unpark(&self) {
        #[cfg(not(loom))]
        self.thread.unpark();
        #[cfg(loom)]
        {
            let _g = self.lock.lock().expect("loom mutex poisoned");
            self.cv.notify_one();
        }
    }

    /// Sleep until `done` returns true (checked before each sleep).
    pub(crate) fn park_until(&self, done: impl Fn() -> bool) {
        #[cfg(not(loom))]
        while !done() {
            std::thread::park();
        }
        #[cfg(loom)]
        {
            let mut g = self.lock.lock().expect("loom mutex poisoned");
            while !done() {
                g = self.cv.wait(g).expect("loom condvar");
            }
        }
    }
}
