//! Model checks of the sbitmap queue's sleep/wake protocol with loom: every
//! interleaving (up to a preemption bound) of 2-3 threads that each take a
//! bit, sleeping if none is free, and give it back. A lost wakeup leaves a
//! thread parked forever, which loom reports as a deadlock, so these pass
//! only if the counter algorithm never loses one at these depths.
//!
//! Run with: `RUSTFLAGS="--cfg loom" cargo test -p blkstack-mq --release --test loom_sbitmap`
#![cfg(loom)]

use blkstack_mq::sbitmap::{SbitmapQueue, WaitIndex, WakeWeight, WakeupAlgo};
use loom::sync::Arc;

fn model(threads: usize, depth: u32, rounds: usize, preemptions: usize) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(preemptions);
    builder.check(move || {
        let q = Arc::new(SbitmapQueue::new(depth, false, WakeupAlgo::Counter));
        let handles: Vec<_> = (0..threads - 1)
            .map(|i| {
                let q = q.clone();
                loom::thread::spawn(move || {
                    // Spread the threads over wait queues as hctxs do.
                    let idx = WaitIndex::new();
                    for _ in 0..i {
                        q.wait_ptr(&idx);
                    }
                    for _ in 0..rounds {
                        let tag = q.get_blocking(&idx, || {});
                        q.clear(tag);
                    }
                })
            })
            .collect();
        let idx = WaitIndex::new();
        for _ in 0..rounds {
            let tag = q.get_blocking(&idx, || {});
            q.clear(tag);
        }
        for h in handles {
            h.join().expect("model thread");
        }
        assert_eq!(q.sbitmap().weight(), 0, "every bit freed");
        assert_eq!(q.ws_active(), 0, "no waiter left registered");
    });
}

#[test]
fn counter_two_threads_depth1() {
    model(2, 1, 2, 1);
}

#[test]
fn counter_three_threads_depth1() {
    model(3, 1, 1, 1);
}

#[test]
fn counter_three_threads_depth2() {
    model(3, 2, 1, 2);
}

/// Plug-weighted wakeups: the main thread holds every bit of a depth-16
/// bitmap (wake batch 2) while two submitters each try to flush a plug of
/// two, sleeping with "I want 2, then 1"; the main thread then frees its
/// bits in two batches of 8 (one wakeup decision each, as a completion
/// batch makes). A batch of 2 wakeups now wakes one sleeper whose want
/// covers it, not two: no interleaving may leave the other asleep for
/// good (the credit left over and the woken one's own frees must reach
/// it).
fn model_plug(preemptions: usize) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(preemptions);
    builder.check(move || {
        let q = Arc::new(
            SbitmapQueue::new(16, false, WakeupAlgo::Counter).with_wake_weight(WakeWeight::Plug),
        );
        assert_eq!(q.wake_batch(), 2);
        let held: Vec<u32> = (0..16).map(|_| q.get().expect("free bit")).collect();
        let submitters: Vec<_> = (0..2)
            .map(|i| {
                let q = q.clone();
                loom::thread::spawn(move || {
                    let idx = WaitIndex::new();
                    for _ in 0..i {
                        q.wait_ptr(&idx);
                    }
                    let a = q.get_blocking_want(&idx, 2, || {});
                    let b = q.get_blocking_want(&idx, 1, || {});
                    q.clear_batch(&[a, b]);
                })
            })
            .collect();
        q.clear_batch(&held[..8]);
        q.clear_batch(&held[8..]);
        for s in submitters {
            s.join().expect("model thread");
        }
        assert_eq!(q.sbitmap().weight(), 0, "every bit freed");
        assert_eq!(q.ws_active(), 0, "no waiter left registered");
    });
}

#[test]
fn counter_plug_two_sleepers_depth16() {
    model_plug(1);
}
