//! Model checks of the queue-run protocol with loom: the queued bit of
//! "blk-mq: avoid repeatedly scheduling the same work to run hardware queue"
//! (an immediate run is not posted again while one is pending) and the
//! restart handshake (a busy driver is run again by the next completion,
//! or by a delayed run when nothing is in flight), every interleaving up
//! to a preemption bound.
//!
//! The state is the engine's own [`RunState`]; each model step calls the
//! method `queue.rs` calls at that point. The rest is a small model of
//! what `queue.rs` and `kblockd.rs` do around it:
//! - a dispatch list (`push_tail` on submit, `push_head` on busy);
//! - a driver that accepts one request at a time and says busy otherwise;
//! - submitters that issue directly when nothing waits, or queue behind
//!   what waits and run the queue inline, a run the restart bit may veto;
//! - kblockd's contract for one work item (kernel `WORK_STRUCT_PENDING`):
//!   a post while it is pending adds nothing, a run clears pending before
//!   it calls the work, and a delay only postpones (so a delayed run is
//!   modelled as a pending one). Pending is a flag under a lock, as the
//!   pool keeps it under each item's `claim` lock.
//!
//! The property: when every thread is done, running whatever work is
//! still pending and completing whatever is still in the driver leaves
//! the dispatch list empty. A lost run leaves a request on the list with
//! no run owed and nothing in flight to restart it.
//!
//! Run with: `RUSTFLAGS="--cfg loom" cargo test -p blkstack-mq --release --test loom_runstate`
#![cfg(loom)]

use blkstack_mq::runstate::RunState;
use loom::sync::{Arc, Mutex};
use std::collections::VecDeque;

/// One hardware queue, its driver and its kblockd work item.
struct Hctx {
    run: RunState,
    dispatch: Mutex<VecDeque<u32>>,
    /// The driver's single slot: the request in flight, if any.
    in_flight: Mutex<Option<u32>>,
    /// kblockd: the queue's run work is posted and has not started.
    work_pending: Mutex<bool>,
    /// Every request the driver accepted, in order.
    issued: Mutex<Vec<u32>>,
}

impl Hctx {
    fn new() -> Hctx {
        Hctx {
            run: RunState::new(),
            dispatch: Mutex::new(VecDeque::new()),
            in_flight: Mutex::new(None),
            work_pending: Mutex::new(false),
            issued: Mutex::new(Vec::new()),
        }
    }

    fn has_pending(&self) -> bool {
        !self.dispatch.lock().unwrap().is_empty()
    }

    /// `QueueInner::post_run` with dedup on.
    fn post_run(&self, delayed: bool) {
        if delayed {
            self.run.before_delayed_post();
        } else if !self.run.claim_immediate_post() {
            return;
        }
        *self.work_pending.lock().unwrap() = true;
    }

    /// `QueueInner::run_hw_queue(h, async_run = true)`.
    fn run_async(&self) {
        if !self.has_pending() || self.run.is_stopped() {
            return;
        }
        self.post_run(false);
    }

    /// A kblockd worker picks the item up if it is pending
    /// (`run_work_fn`).
    fn worker_step(&self) {
        let pending = std::mem::replace(&mut *self.work_pending.lock().unwrap(), false);
        if pending && self.run.begin_work() {
            self.dispatch();
        }
    }

    /// `QueueInner::dispatch`.
    fn dispatch(&self) {
        loop {
            let Some(tag) = self.dispatch.lock().unwrap().pop_front() else {
                return;
            };
            if !self.issue(tag) {
                return;
            }
        }
    }

    /// `QueueInner::issue_to` with its busy path: false if the driver was
    /// busy (the request is then back at the list's head).
    fn issue(&self, tag: u32) -> bool {
        self.run.enter_driver();
        let accepted = {
            let mut slot = self.in_flight.lock().unwrap();
            if slot.is_none() {
                *slot = Some(tag);
                true
            } else {
                false
            }
        };
        if accepted {
            self.issued.lock().unwrap().push(tag);
            return true;
        }
        self.dispatch.lock().unwrap().push_front(tag);
        if self.run.requeued_busy() {
            self.post_run(true);
        }
        false
    }

    /// `QueueInner::run_hw_queue(h, async_run = false)`: the inline run a
    /// submitter does, which the restart bit may veto.
    fn run_inline(&self) {
        if !self.has_pending() || self.run.is_stopped() {
            return;
        }
        if self.run.inline_run_allowed() {
            self.dispatch();
        }
    }

    /// `QueueInner::submit_want` with a non-blocking driver: issue
    /// directly when nothing waits, else queue behind the waiting
    /// requests and run inline. The check and the push are separate
    /// steps, as there, so the list can empty in between.
    fn submit_inline(&self, tag: u32) {
        if self.has_pending() {
            self.dispatch.lock().unwrap().push_back(tag);
            self.run_inline();
        } else {
            self.issue(tag);
        }
    }

    /// The device completes what it holds (`end_request`).
    fn complete_step(&self) {
        if self.in_flight.lock().unwrap().take().is_some() && self.run.left_driver(1) {
            self.run_async();
        }
    }

    /// A submitter queues a request behind others and asks for a run, as
    /// `submit` does when requests already wait (and always with a
    /// blocking driver, whose runs are posted).
    fn submit(&self, tag: u32) {
        self.dispatch.lock().unwrap().push_back(tag);
        self.run_async();
    }

    /// After the threads: run what is owed until nothing is.
    fn settle(&self) {
        loop {
            if *self.work_pending.lock().unwrap() {
                self.worker_step();
            } else if self.in_flight.lock().unwrap().is_some() {
                self.complete_step();
            } else {
                return;
            }
        }
    }
}

/// Check `f` under every interleaving with at most `preemptions`
/// preemptions.
fn explore(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(preemptions);
    builder.check(f);
}

/// A queue whose driver holds request 0.
fn with_request_in_driver() -> Arc<Hctx> {
    let h = Arc::new(Hctx::new());
    h.run.enter_driver();
    *h.in_flight.lock().unwrap() = Some(0);
    h.issued.lock().unwrap().push(0);
    h
}

fn check(h: &Hctx, requests: u32) {
    h.settle();
    assert!(
        h.dispatch.lock().unwrap().is_empty(),
        "requests left on the dispatch list with no run owed"
    );
    let mut issued = h.issued.lock().unwrap().clone();
    issued.sort_unstable();
    assert_eq!(
        issued,
        (0..requests).collect::<Vec<_>>(),
        "each issued once"
    );
    assert_eq!(h.run.in_driver(), 0);
}

/// Two submitters against one kblockd worker: the queued bit must never
/// let a request wait behind a run that has already looked at the list.
#[test]
fn queued_bit_loses_no_run() {
    explore(3, || {
        let h = Arc::new(Hctx::new());
        let submitters: Vec<_> = (0..2u32)
            .map(|t| {
                let h = h.clone();
                loom::thread::spawn(move || h.submit(t))
            })
            .collect();
        // The driver has room for one; completions come from the
        // device, here the worker thread itself between its runs.
        let w = h.clone();
        let worker = loom::thread::spawn(move || {
            w.worker_step();
            w.complete_step();
            w.worker_step();
        });
        for s in submitters {
            s.join().expect("submitter");
        }
        worker.join().expect("worker");
        check(&h, 2);
    });
}

/// A busy driver and a completion racing: the restart armed by the busy
/// path and the completion's check of it must not miss each other, and
/// with nothing in flight the delayed run must be owed.
#[test]
fn restart_handshake_loses_no_run() {
    explore(3, || {
        // Request 0 is in the driver already; 1 waits on the list with a
        // run posted.
        let h = with_request_in_driver();
        h.submit(1);
        let w = h.clone();
        let worker = loom::thread::spawn(move || w.worker_step());
        let c = h.clone();
        let device = loom::thread::spawn(move || c.complete_step());
        worker.join().expect("worker");
        device.join().expect("device");
        check(&h, 2);
    });
}

/// The hang `lab mq-run` found (8 jobs on `null max_inflight=32`, all
/// tags left on the dispatch list, nothing in flight, no run posted, the
/// restart bit set). A request the driver refused (1) is put back, and
/// before its submitter arms the restart a posted run takes it from the
/// list and the device completes it: that completion saw no restart. The
/// restart is then armed with nothing in flight, so the resource-delay
/// run is posted, and it runs while the list is empty. A submitter that
/// saw the list non-empty earlier now queues request 2 behind it and
/// tries to run the queue inline: the restart bit must not veto that run,
/// since no completion is left to honour the restart.
#[test]
fn restart_with_nothing_in_flight_vetoes_no_inline_run() {
    explore(4, || {
        // Request 0 is in the driver, and a run is posted (as completions
        // post with `run_on_completion`).
        let h = with_request_in_driver();
        h.post_run(false);
        let a = h.clone();
        let submitter = loom::thread::spawn(move || a.submit_inline(1));
        // The device and kblockd's worker take turns on one thread.
        let w = h.clone();
        let worker = loom::thread::spawn(move || {
            w.complete_step();
            w.worker_step();
            w.complete_step();
            w.worker_step();
        });
        h.submit_inline(2);
        submitter.join().expect("submitter");
        worker.join().expect("worker");
        check(&h, 3);
    });
}
