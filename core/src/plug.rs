//! Submission plugs: a thread about to submit several bios in a row (a
//! vhost-user-blk queue thread taking a round of requests from its ring)
//! opens a [`SubmitPlug`]; a device that would otherwise enter the kernel
//! once per bio (the `file` device's io_uring: one `io_uring_enter` per
//! SQE) only queues each one and asks to be [`defer`]red, and is flushed
//! once, with every SQE of the round, when the outermost plug on that
//! thread closes. This is the kernel's `blk_start_plug` /
//! `blk_finish_plug` (block/blk-core.c), which holds a task's requests
//! and issues them together, and what qemu's `blk_io_plug` /
//! `blk_io_unplug` do around a virtqueue's requests.
//!
//! Unlike a completion batch ([`crate::comp_batch`]) a plug delays the
//! I/O itself, so only a thread that never waits for its own bios while
//! the plug is open may hold one (the kernel flushes a plug when the task
//! sleeps; we cannot): the vhost queue thread opens one only around
//! taking requests from its ring, whose submissions never block.
//!
//! Bounded: at most [`MAX_PLUGGED`] devices wait per thread; one more is
//! refused (it enters the kernel at once, as without a plug).

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;

/// Devices one thread may hold back until its plug closes.
pub const MAX_PLUGGED: usize = 16;

/// What a plugged device does when the plug that held it closes.
pub trait Flush: Send + Sync {
    /// Issue what was queued (enter the kernel with the SQEs).
    fn flush(&self);
}

struct State {
    depth: u32,
    held: Vec<(usize, Arc<dyn Flush>)>,
}

thread_local! {
    static STATE: RefCell<State> = const {
        RefCell::new(State {
            depth: 0,
            held: Vec::new(),
        })
    };
}

/// An open plug on this thread; closing the outermost one flushes every
/// device held. Not `Send`: it belongs to the submitting thread.
#[must_use = "the plug closes when this guard is dropped"]
pub struct SubmitPlug {
    _thread: PhantomData<*const ()>,
}

impl SubmitPlug {
    /// Open a plug (plugs nest; only the outermost one's end flushes).
    pub fn start() -> SubmitPlug {
        STATE.with(|s| s.borrow_mut().depth += 1);
        SubmitPlug {
            _thread: PhantomData,
        }
    }
}

impl Drop for SubmitPlug {
    fn drop(&mut self) {
        let held = STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.depth -= 1;
            if s.depth == 0 {
                std::mem::take(&mut s.held)
            } else {
                Vec::new()
            }
        });
        // Flushed with the state released: a flush may submit (and plug)
        // again.
        for (_, dev) in &held {
            dev.flush();
        }
        STATE.with(|s| {
            let mut s = s.borrow_mut();
            if s.held.is_empty() && s.depth == 0 {
                let mut v = held;
                v.clear();
                s.held = v;
            }
        });
    }
}

/// Hold the device identified by `key` back until the plug open on this
/// thread closes; `make` gives its flush the first time (`None`: it is
/// gone). `false` when there is no plug, `make` gave nothing, or
/// [`MAX_PLUGGED`] devices are held already: then the caller issues now.
pub fn defer(key: usize, make: impl FnOnce() -> Option<Arc<dyn Flush>>) -> bool {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if s.depth == 0 {
            return false;
        }
        if s.held.iter().any(|(k, _)| *k == key) {
            return true;
        }
        if s.held.len() >= MAX_PLUGGED {
            return false;
        }
        match make() {
            Some(dev) => {
                s.held.push((key, dev));
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
    impl Flush for Count {
        fn flush(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_plug_flushes_each_device_once_at_its_outermost_end() {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        let mk = || Some(c.clone() as Arc<dyn Flush>);
        assert!(!defer(1, mk), "no plug: issue at once");
        {
            let _outer = SubmitPlug::start();
            {
                let _inner = SubmitPlug::start();
                assert!(defer(1, mk));
                assert!(defer(1, mk));
            }
            assert_eq!(
                c.0.load(Ordering::SeqCst),
                0,
                "the inner end flushes nothing"
            );
        }
        assert_eq!(c.0.load(Ordering::SeqCst), 1);
        assert!(!defer(1, mk), "closed: issue at once");
    }

    #[test]
    fn past_the_bound_a_device_issues_at_once() {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        let mk = || Some(c.clone() as Arc<dyn Flush>);
        let plug = SubmitPlug::start();
        for k in 0..MAX_PLUGGED {
            assert!(defer(k, mk));
        }
        assert!(!defer(MAX_PLUGGED, mk));
        assert!(!defer(MAX_PLUGGED + 1, || None));
        drop(plug);
        assert_eq!(c.0.load(Ordering::SeqCst), MAX_PLUGGED);
    }
}
