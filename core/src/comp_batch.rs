//! Completion batches: a thread about to complete several bios in a row
//! (a delay worker's pass over the bios now due, a completion thread's
//! sweep) opens a [`CompletionBatch`]; a completion sink that would
//! otherwise act once per bio (the NBD server sends each reply as it is
//! produced) asks to be [`defer`]red instead, and is called back once
//! when the outermost batch on that thread closes.
//!
//! Why: a bio completed by a thread other than the connection's reader
//! cost one `sendmsg` (and a client wake-up) per reply, where a pass of k
//! bios can leave in one. This follows the kernel's `struct
//! io_comp_batch` (include/linux/blkdev.h: `blk_mq_add_to_batch`,
//! `blk_mq_end_request_batch`), where a poller collects completions and
//! ends them together, and the networking stack's flush at the end of a
//! NAPI poll. Only the end of the batch is deferred, never the
//! completion itself: every `end_io` still runs at once, in order.
//!
//! Bounded: at most [`MAX_DEFERRED`] sinks wait per thread; one more is
//! refused (the caller acts at once, as without a batch).

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;

/// Sinks one thread may have waiting for the end of its batch.
pub const MAX_DEFERRED: usize = 64;

/// What a deferred sink does when the batch that deferred it closes.
pub trait Unplug: Send + Sync {
    /// The batch is over: do what was put off (send the replies).
    fn unplug(&self);
}

struct State {
    depth: u32,
    /// The sinks waiting, with the address that identifies each (one
    /// entry per sink however many of its bios completed).
    deferred: Vec<(usize, Arc<dyn Unplug>)>,
}

thread_local! {
    static STATE: RefCell<State> = const {
        RefCell::new(State {
            depth: 0,
            deferred: Vec::new(),
        })
    };
}

/// An open completion batch on this thread; closing the outermost one
/// calls every deferred sink. Not `Send`: it belongs to the thread that
/// completes the bios.
#[must_use = "the batch closes when this guard is dropped"]
pub struct CompletionBatch {
    _thread: PhantomData<*const ()>,
}

impl CompletionBatch {
    /// Open a batch (batches nest; only the outermost one's end counts).
    pub fn start() -> CompletionBatch {
        STATE.with(|s| s.borrow_mut().depth += 1);
        CompletionBatch {
            _thread: PhantomData,
        }
    }
}

impl Drop for CompletionBatch {
    fn drop(&mut self) {
        let sinks = STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.depth -= 1;
            if s.depth == 0 {
                std::mem::take(&mut s.deferred)
            } else {
                Vec::new()
            }
        });
        // Called with the state released: an unplug may complete bios
        // (and open batches) itself.
        for (_, sink) in &sinks {
            sink.unplug();
        }
        // Keep the vector's capacity for the next batch on this thread.
        STATE.with(|s| {
            let mut s = s.borrow_mut();
            if s.deferred.is_empty() && s.depth == 0 {
                let mut v = sinks;
                v.clear();
                s.deferred = v;
            }
        });
    }
}

/// Whether a batch is open on this thread.
pub fn in_batch() -> bool {
    STATE.with(|s| s.borrow().depth > 0)
}

/// Put off the sink identified by `key` until the batch open on this
/// thread closes; `make` gives the sink the first time (`None`: it is
/// gone). `false` when there is no batch, `make` gave nothing, or
/// [`MAX_DEFERRED`] sinks already wait: then the caller acts at once.
pub fn defer(key: usize, make: impl FnOnce() -> Option<Arc<dyn Unplug>>) -> bool {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if s.depth == 0 {
            return false;
        }
        if s.deferred.iter().any(|(k, _)| *k == key) {
            return true;
        }
        if s.deferred.len() >= MAX_DEFERRED {
            return false;
        }
        match make() {
            Some(sink) => {
                s.deferred.push((key, sink));
                true
            }
            None => false,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Count(AtomicUsize);
    impl Unplug for Count {
        fn unplug(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn without_a_batch_nothing_is_deferred() {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        assert!(!defer(1, || Some(c.clone())));
        assert_eq!(c.0.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_sink_deferred_many_times_runs_once_at_the_outermost_end() {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        let outer = CompletionBatch::start();
        {
            let _inner = CompletionBatch::start();
            for _ in 0..10 {
                assert!(defer(7, || Some(c.clone())));
            }
        }
        assert_eq!(c.0.load(Ordering::SeqCst), 0, "inner end must not unplug");
        drop(outer);
        assert_eq!(c.0.load(Ordering::SeqCst), 1);
        assert!(!in_batch());
    }

    #[test]
    fn past_the_bound_the_caller_acts_at_once() {
        let _b = CompletionBatch::start();
        let c = Arc::new(Count(AtomicUsize::new(0)));
        for k in 0..MAX_DEFERRED {
            assert!(defer(k, || Some(c.clone())));
        }
        assert!(!defer(MAX_DEFERRED, || Some(c.clone())));
        assert!(!defer(usize::MAX, || None));
    }
}
