//! dm-delay's kthread flush (upstream 'dm: delay: use kthread instead of
//! timers and wq'): one worker polls the held bios while any is queued,
//! yielding the CPU every round so it starves no one (`cond_resched`), and
//! sleeps when none is held. It is accurate and keeps a CPU busy per
//! device while bios are held, which is what the maintainer objected to.
//! (The upstream worker still compares jiffies, so at HZ=1000 it could
//! release a bio up to a tick early; here it compares the nanosecond
//! deadline.)

use super::held::{pop_due, Held};
use super::{Flusher, Shared, WORKER_SLICE_NS};
use crate::error::TargetError;
use blkstack_core::clock;
use blkstack_core::timing::{self, Parker};
use parking_lot::Mutex;
use std::collections::BinaryHeap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub(super) struct KthreadFlusher(Arc<Kthread>);

struct Kthread {
    sh: Arc<Shared>,
    heap: Mutex<BinaryHeap<Held>>,
    worker: Parker,
}

impl KthreadFlusher {
    pub fn start(sh: &Arc<Shared>) -> Result<KthreadFlusher, TargetError> {
        let k = Arc::new(Kthread {
            sh: sh.clone(),
            heap: Mutex::new(BinaryHeap::with_capacity(64)),
            worker: Parker::new(),
        });
        let w = k.clone();
        sh.spawn(format!("dlyk-{}", sh.name), move || w.run())?;
        Ok(KthreadFlusher(k))
    }
}

impl Kthread {
    /// The upstream `flush_worker_fn`: poll while bios are held.
    fn run(&self) {
        timing::prepare_precise_worker(WORKER_SLICE_NS);
        let sh = &self.sh;
        let mut batch: Vec<Held> = Vec::with_capacity(64);
        while !sh.stop.load(Ordering::Acquire) {
            let (seen, empty) = {
                let mut heap = self.heap.lock();
                let now = clock::now_ns();
                pop_due(sh, &mut heap, now, |d| d, &mut batch);
                let empty = heap.is_empty();
                // Polling needs no wake-ups; an idle worker needs one.
                self.worker
                    .target
                    .store(if empty { u64::MAX } else { 0 }, Ordering::Relaxed);
                (self.worker.seen(), empty)
            };
            sh.send_expired_batch(&mut batch);
            if empty {
                self.worker.park(seen, None);
            } else {
                // cond_resched(): let anyone else runnable here go first.
                // SAFETY: plain syscall.
                unsafe { libc::sched_yield() };
            }
        }
    }
}

impl Flusher for KthreadFlusher {
    fn hold(&self, _queue: usize, held: Held) {
        let k = &self.0;
        let wake = {
            // The worker sets its wake target under this lock, so the
            // comparison sees either the bio's push or an idle worker.
            let mut heap = k.heap.lock();
            let key = held.key;
            heap.push(held);
            key < k.worker.target.load(Ordering::Relaxed)
        };
        if wake {
            k.worker.unpark();
        }
    }

    fn take_all(&self) -> Vec<Held> {
        std::mem::take(&mut *self.0.heap.lock()).into_vec()
    }

    fn wake_for_stop(&self) {
        self.0.worker.unpark();
    }
}
