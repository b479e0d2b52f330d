//! A driver wrapper for the engine's tests and benches: what the driver
//! under it finishes in `queue_rq` is ended later from another thread
//! through the engine's `RequestCompleter`, as an interrupt handler ends
//! a real device's requests. The engine's completion-side paths (restart
//! on completion, tag frees racing submitters, runs posted from a foreign
//! thread) need such a driver; null_blk's own completion modes live in
//! `blkstack-drivers`.
#![allow(dead_code)]

use blkstack_core::Status;
use blkstack_mq::queue::{Driver, QueueRq, RequestCompleter, Rq};
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, OnceLock};

/// Requests finished by the inner driver, waiting for the thread.
struct Pending {
    list: Mutex<Vec<(u32, u32, Status)>>,
    cv: Condvar,
    stop: AtomicBool,
    completer: OnceLock<RequestCompleter>,
}

/// Driver `D` whose finished requests are ended on a completion thread.
pub struct Deferred<D: Driver> {
    pub inner: D,
    pending: Arc<Pending>,
}

impl<D: Driver> Deferred<D> {
    pub fn new(inner: D) -> Deferred<D> {
        Deferred {
            inner,
            pending: Arc::new(Pending {
                // Room for any depth the tests use, so that the hot path
                // never grows it.
                list: Mutex::new(Vec::with_capacity(16_384)),
                cv: Condvar::new(),
                stop: AtomicBool::new(false),
                completer: OnceLock::new(),
            }),
        }
    }
}

impl<D: Driver> Driver for Deferred<D> {
    fn queue_rq(&self, rq: Rq<'_>) -> QueueRq {
        let (hctx, tag) = (rq.hctx, rq.tag);
        match self.inner.queue_rq(rq) {
            QueueRq::Done(status) => {
                self.pending.list.lock().push((hctx, tag, status));
                self.pending.cv.notify_one();
                QueueRq::Issued
            }
            other => other,
        }
    }

    fn complete(&self, rq: Rq<'_>, status: Status) -> Status {
        self.inner.complete(rq, status)
    }

    fn attach(&self, completer: RequestCompleter) {
        let _ = self.pending.completer.set(completer);
        let pending = self.pending.clone();
        std::thread::Builder::new()
            .name("test-cpl".into())
            .spawn(move || completion_thread(&pending))
            .expect("completion thread");
    }
}

impl<D: Driver> Drop for Deferred<D> {
    fn drop(&mut self) {
        self.pending.stop.store(true, SeqCst);
        self.pending.cv.notify_one();
    }
}

fn completion_thread(p: &Pending) {
    let Some(completer) = p.completer.get() else {
        return;
    };
    let mut local = Vec::with_capacity(16_384);
    loop {
        {
            let mut list = p.list.lock();
            while list.is_empty() {
                if p.stop.load(SeqCst) {
                    return;
                }
                p.cv.wait(&mut list);
            }
            std::mem::swap(&mut *list, &mut local);
        }
        for (hctx, tag, status) in local.drain(..) {
            completer.end_request(hctx, tag, status);
        }
    }
}
