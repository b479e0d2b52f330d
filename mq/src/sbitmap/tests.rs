//! Tests of [`super`] (`sbitmap.rs`), kept apart so that file stays short.

use super::*;
use std::collections::HashSet;

#[test]
fn shift_matches_kernel() {
    assert_eq!(calculate_shift(1), 6);
    assert_eq!(calculate_shift(4), 0);
    assert_eq!(calculate_shift(64), 4);
    assert_eq!(calculate_shift(256), 6);
    assert_eq!(calculate_shift(10240), 6);
    assert_eq!(calculate_shift(31), 2);
}

#[test]
fn wake_batch_matches_kernel() {
    for (depth, batch) in [(1, 1), (2, 1), (16, 2), (32, 4), (64, 8), (1024, 8)] {
        let q = SbitmapQueue::new(depth, false, WakeupAlgo::Counter);
        assert_eq!(q.wake_batch(), batch, "depth {depth}");
    }
    // Shallow depth: 4 words of 16 bits, 2 usable per word -> 8 bits.
    let q = SbitmapQueue::new(64, false, WakeupAlgo::Counter);
    q.set_min_shallow_depth(2);
    assert_eq!(q.wake_batch(), 1);
    // Shared users (with the b5fcf7871acb fix): 64 / 4 users = 16 -> 2.
    let q = SbitmapQueue::new(64, false, WakeupAlgo::Counter);
    q.recalculate_wake_batch(4);
    assert_eq!(q.wake_batch(), 2);
    // 64 tags, 16 users: share 4 -> batch 1 (the old code forced 4).
    q.recalculate_wake_batch(16);
    assert_eq!(q.wake_batch(), 1);
    q.resize(16);
    assert_eq!(q.wake_batch(), 2);
}

#[test]
fn old_algorithm_rearms_counts_on_batch_change() {
    let q = SbitmapQueue::new(64, false, WakeupAlgo::WaitCnt);
    assert_eq!(q.wait_cnt(3), 8);
    q.recalculate_wake_batch(4);
    assert_eq!(q.wait_cnt(3), 1);
}

/// A thread woken with no bit free retries, finds none and sleeps
/// again: one wasted wakeup, counted once; it then gets the bit freed
/// later (no lost wakeup).
#[test]
fn wakeup_that_finds_no_bit_is_counted_as_wasted() {
    for algo in [WakeupAlgo::Counter, WakeupAlgo::WaitCnt] {
        let q = std::sync::Arc::new(SbitmapQueue::new(1, false, algo));
        let held = q.get().expect("the only bit");
        let q2 = q.clone();
        let waiter = std::thread::spawn(move || q2.get_blocking(&WaitIndex::new(), || ()));
        let wait_until = |what: &str, f: &dyn Fn(&SbqStats) -> bool| {
            let deadline = blkstack_core::clock::now_ns() + 5_000_000_000;
            while !f(&q.stats()) {
                assert!(
                    blkstack_core::clock::now_ns() < deadline,
                    "{algo:?}: {what}"
                );
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        };
        wait_until("waiter never slept", &|s| s.waits == 1);
        assert_eq!(q.stats().wasted_wakeups, 0);
        // Woken once with the bitmap still full: it must sleep again.
        // (Not `wake_all`: it keeps scanning while any queue is active,
        // so it may wake the waiter a second time after it re-queues.)
        let woke = (0..SBQ_WAIT_QUEUES)
            .find(|&i| q.waitqueue_active(i))
            .map(|i| q.wake_up_nr(i, 1));
        assert_eq!(woke, Some(1), "{algo:?}: one waiter to wake");
        wait_until("woken waiter did not sleep again", &|s| s.waits == 2);
        assert_eq!(q.stats().wasted_wakeups, 1, "{algo:?}");
        q.clear(held);
        let got = waiter.join().expect("waiter panicked");
        assert_eq!(got, held);
        assert_eq!(
            q.stats().wasted_wakeups,
            1,
            "{algo:?}: the last wakeup was not wasted"
        );
        assert_eq!(q.stats().rescued, 0);
    }
}

#[test]
fn every_bit_allocated_once_then_full() {
    for depth in [1u32, 2, 3, 7, 64, 100, 1000, 10240] {
        let q = SbitmapQueue::new(depth, false, WakeupAlgo::Counter);
        let mut seen = HashSet::new();
        for _ in 0..depth {
            let nr = q.get().expect("free bit");
            assert!(nr < depth);
            assert!(seen.insert(nr), "bit {nr} handed out twice");
        }
        assert_eq!(q.get(), None, "depth {depth}: full map gave a bit");
        assert_eq!(q.sbitmap().weight(), depth);
        for nr in seen {
            q.clear(nr);
        }
        assert_eq!(q.sbitmap().weight(), 0);
        // Deferred clears fold back in: the whole map is usable again.
        for _ in 0..depth {
            assert!(q.get().is_some());
        }
    }
}

#[test]
fn freed_bit_is_reused_by_the_same_thread() {
    let q = SbitmapQueue::new(256, false, WakeupAlgo::Counter);
    let a = q.get().unwrap();
    let b = q.get().unwrap();
    q.clear(a);
    // The hint now points at `a`'s word: the next get comes from there.
    let c = q.get().unwrap();
    assert_eq!(c >> q.sbitmap().shift(), a >> q.sbitmap().shift());
    assert_ne!(c, b);
}

#[test]
fn resize_limits_allocation() {
    let q = SbitmapQueue::new(64, false, WakeupAlgo::Counter);
    q.resize(10);
    let got: Vec<u32> = std::iter::from_fn(|| q.get()).collect();
    assert_eq!(got.len(), 10);
    assert!(got.iter().all(|&n| n < 10));
    for n in got {
        q.clear(n);
    }
    q.resize(64);
    assert_eq!(std::iter::from_fn(|| q.get()).count(), 64);
}

#[test]
fn shallow_get_uses_only_low_bits_of_each_word() {
    let q = SbitmapQueue::new(64, false, WakeupAlgo::Counter);
    let got: Vec<u32> = std::iter::from_fn(|| q.get_shallow(2)).collect();
    assert_eq!(got.len(), 8);
    assert!(got.iter().all(|&n| n % 16 < 2));
}

/// Register `n` waiters (one thread, detached entries) on queue 0.
fn waiters_on_queue0(q: &SbitmapQueue, n: usize) -> Vec<SbqWait> {
    (0..n)
        .map(|_| {
            let mut w = SbqWait::new_detached();
            q.prepare_to_wait(0, &mut w);
            w
        })
        .collect()
}

/// The nested completion the upstream counter change was made for: completion A is between its first
/// atomic step and the end of its wakeup when completion B arrives.
/// Returns how many of two waiters were woken by two completions.
fn nested_completion(algo: WakeupAlgo) -> (usize, SbqStats) {
    let q = Arc::new(SbitmapQueue::new(2, false, algo));
    assert_eq!(q.wake_batch(), 1);
    let a = q.get().unwrap();
    let b = q.get().unwrap();
    assert_eq!(q.get(), None);
    let waiters = waiters_on_queue0(&q, 2);
    let q2 = q.clone();
    q.set_nested_hook(Box::new(move || q2.clear(b)));
    q.clear(a);
    let woken = waiters.iter().filter(|w| w.is_woken()).count();
    (woken, q.stats())
}

#[test]
fn nested_completion_counter_wakes_everyone() {
    let (woken, stats) = nested_completion(WakeupAlgo::Counter);
    assert_eq!(woken, 2, "{stats:?}");
    assert_eq!(stats.dropped_credits, 0);
}

#[test]
fn nested_completion_wait_cnt_loses_a_wakeup() {
    // The known weakness, reproduced: two tags freed, two waiters, one
    // woken; the other sleeps beside a free tag until some unrelated
    // completion comes along (if one ever does).
    let (woken, stats) = nested_completion(WakeupAlgo::WaitCnt);
    assert_eq!(woken, 1, "{stats:?}");
    assert_eq!(stats.dropped_credits, 1);
}

#[test]
fn counter_batches_wakeups() {
    // depth 32 -> wake_batch 4: three completions wake nobody, the
    // fourth wakes a batch of four.
    let q = SbitmapQueue::new(32, false, WakeupAlgo::Counter);
    let tags: Vec<u32> = std::iter::from_fn(|| q.get()).collect();
    let waiters = waiters_on_queue0(&q, 6);
    for &t in &tags[..3] {
        q.clear(t);
    }
    assert_eq!(waiters.iter().filter(|w| w.is_woken()).count(), 0);
    q.clear(tags[3]);
    assert_eq!(waiters.iter().filter(|w| w.is_woken()).count(), 4);
    assert_eq!(q.wakeup_cnt(), 4);
    assert_eq!(q.completion_cnt(), 4);
}

#[test]
fn counter_wake_spills_to_next_queue() {
    let q = SbitmapQueue::new(16, false, WakeupAlgo::Counter);
    assert_eq!(q.wake_batch(), 2);
    let tags: Vec<u32> = std::iter::from_fn(|| q.get()).collect();
    let mut w0 = SbqWait::new_detached();
    let mut w1 = SbqWait::new_detached();
    q.prepare_to_wait(0, &mut w0);
    q.prepare_to_wait(1, &mut w1);
    q.clear(tags[0]);
    q.clear(tags[1]);
    assert!(w0.is_woken() && w1.is_woken());
    q.finish_wait(&mut w0);
    q.finish_wait(&mut w1);
    assert_eq!(q.ws_active(), 0);
}

#[test]
fn plug_weight_wakes_sleepers_until_their_wants_cover_the_batch() {
    // Depth 64, batch 8; four sleepers on four queues, as four
    // submitters with full plugs. The kernel's count wakes all four
    // for one batch of 8 freed tags (2 tags each); plug weight wakes
    // the first, which will take all 8.
    for (weight, want, expect) in [
        (WakeWeight::One, 64, 4u64),
        (WakeWeight::Plug, 64, 1),
        (WakeWeight::Plug, 3, 3),
        (WakeWeight::Plug, 1, 4),
    ] {
        let q = SbitmapQueue::new(64, false, WakeupAlgo::Counter).with_wake_weight(weight);
        assert_eq!(q.wake_batch(), 8);
        let tags: Vec<u32> = std::iter::from_fn(|| q.get()).collect();
        let mut waits: Vec<SbqWait> = (0..4).map(|_| SbqWait::new_detached()).collect();
        for (i, w) in waits.iter_mut().enumerate() {
            w.set_want(want);
            q.prepare_to_wait(i, w);
        }
        q.clear_batch(&tags[..8]);
        let woken = waits.iter().filter(|w| w.is_woken()).count() as u64;
        assert_eq!(woken, expect, "{weight:?} want {want}");
        assert_eq!(q.stats().woken, expect);
        // The next batch goes on from the queue after the last one
        // woken, so nobody is left behind.
        q.clear_batch(&tags[8..16]);
        if weight == WakeWeight::Plug && want == 64 {
            assert!(waits[1].is_woken(), "second batch wakes the next queue");
        }
        for w in waits.iter_mut() {
            q.finish_wait(w);
        }
        assert_eq!(q.ws_active(), 0);
    }
}

#[test]
fn counter_first_queue_stops_after_one_queue() {
    // The same two completions, one sleeper on each of two queues:
    // before upstream's 2023 fix the batch stops at the first queue
    // that woke anyone, and the second sleeper is left behind.
    let q = SbitmapQueue::new(16, false, WakeupAlgo::CounterFirstQueue);
    assert_eq!(WakeupAlgo::parse("counter_first_queue"), Some(q.algo()));
    let tags: Vec<u32> = std::iter::from_fn(|| q.get()).collect();
    let mut w0 = SbqWait::new_detached();
    let mut w1 = SbqWait::new_detached();
    q.prepare_to_wait(0, &mut w0);
    q.prepare_to_wait(1, &mut w1);
    q.clear(tags[0]);
    q.clear(tags[1]);
    assert!(w0.is_woken());
    assert!(!w1.is_woken());
    assert_eq!(q.stats().woken, 1);
    q.finish_wait(&mut w0);
    q.finish_wait(&mut w1);
}

#[test]
fn finish_wait_leaves_queue() {
    let q = SbitmapQueue::new(4, false, WakeupAlgo::Counter);
    let mut w = SbqWait::new_detached();
    q.prepare_to_wait(2, &mut w);
    assert_eq!(q.waiters_on(2), 1);
    assert_eq!(q.ws_active(), 1);
    q.finish_wait(&mut w);
    assert_eq!(q.waiters_on(2), 0);
    assert_eq!(q.ws_active(), 0);
}

#[test]
fn blocking_get_sleeps_until_a_bit_is_freed() {
    let q = Arc::new(SbitmapQueue::new(1, false, WakeupAlgo::Counter));
    let t = q.get().unwrap();
    let q2 = q.clone();
    let h = std::thread::spawn(move || {
        let idx = WaitIndex::new();
        q2.get_blocking(&idx, || {})
    });
    while q.ws_active() == 0 {
        std::thread::yield_now();
    }
    q.clear(t);
    assert_eq!(h.join().unwrap(), t);
    assert_eq!(q.stats().rescued, 0);
}
