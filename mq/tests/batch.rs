//! The batch paths (kernel plugging): `Queue::submit_batch` with batched
//! tag allocation (`blk_mq_get_tags`) and batched completion
//! (`blk_mq_end_request_batch`), and the sbitmap calls under them
//! (`__sbitmap_queue_get_batch`, `sbitmap_queue_clear_batch`). Every bio
//! of a batch must complete exactly once and every tag come back, whatever
//! the depth, completion mode, tag sharing or driver pushback; a waiter
//! must be woken by a batched free as by a single one.
#![cfg(not(loom))]

use blkstack_core::clock::now_ns;
use blkstack_core::{Bio, EndIo, IoBuf, Op, Status};
use blkstack_mq::queue::{Driver, EngineOptions, Queue, QueueRq, Rq};

mod common;
use blkstack_mq::sbitmap::{SbitmapQueue, WaitIndex, WakeupAlgo};
use blkstack_mq::tags::{HctxTagState, Tags, TagsConfig};
use common::Deferred;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::Arc;

/// Finishes every request inline; busy on every `busy_every`-th call when
/// that is non-zero.
#[derive(Default)]
struct Finisher {
    busy_every: u64,
    calls: AtomicU64,
}

impl Driver for Finisher {
    fn queue_rq(&self, _rq: Rq<'_>) -> QueueRq {
        let n = self.calls.fetch_add(1, Relaxed) + 1;
        if self.busy_every != 0 && n.is_multiple_of(self.busy_every) {
            QueueRq::Busy
        } else {
            QueueRq::Done(Status::Ok)
        }
    }
}

/// Counts completions per cookie.
struct PerBio {
    seen: Vec<AtomicU32>,
    total: AtomicU64,
}

impl PerBio {
    fn new(n: usize) -> Arc<PerBio> {
        Arc::new(PerBio {
            seen: (0..n).map(|_| AtomicU32::new(0)).collect(),
            total: AtomicU64::new(0),
        })
    }

    fn wait_all(&self, n: u64) {
        let deadline = now_ns() + 10_000_000_000;
        while self.total.load(SeqCst) < n {
            assert!(
                now_ns() < deadline,
                "only {} of {n} completed",
                self.total.load(SeqCst)
            );
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    fn assert_each_once(&self) {
        for (i, s) in self.seen.iter().enumerate() {
            assert_eq!(
                s.load(SeqCst),
                1,
                "bio {i} completed {} times",
                s.load(SeqCst)
            );
        }
    }
}

impl EndIo for PerBio {
    fn end_io(&self, bio: Bio, status: Status, private: u64) {
        assert_eq!(status, Status::Ok);
        self.seen[private as usize].fetch_add(1, SeqCst);
        self.total.fetch_add(1, SeqCst);
        drop(bio);
    }
}

fn batch(n: usize, owner: &Arc<PerBio>) -> Vec<Bio> {
    let owner: Arc<dyn EndIo> = owner.clone();
    (0..n)
        .map(|i| Bio::new(Op::Write, 0, 0, IoBuf::empty(), owner.clone(), i as u64))
        .collect()
}

fn run_batch<D: Driver>(q: &Queue<D>, n: usize) {
    submit_and_check(q, n);
    let s = q.stats();
    assert_eq!(s.tags_in_use, 0, "tags leaked");
    assert_eq!(s.in_driver, 0);
    assert_eq!(s.dispatch_waiting, 0);
}

/// One batch of `n`, each bio completed once (the queue may be in use by
/// other threads).
fn submit_and_check<D: Driver>(q: &Queue<D>, n: usize) {
    let owner = PerBio::new(n);
    let mut bios = batch(n, &owner);
    let cap = bios.capacity();
    q.submit_batch(&mut bios);
    assert!(bios.is_empty());
    assert_eq!(
        bios.capacity(),
        cap,
        "the caller's vector keeps its capacity"
    );
    owner.wait_all(n as u64);
    owner.assert_each_once();
}

#[test]
fn every_bio_of_a_batch_completes_once_and_every_tag_returns() {
    // Ended inline, then from another thread (as an interrupt would).
    for deferred in [false, true] {
        // Depth 4 has one tag per bitmap word, so batches larger than the
        // free tags take the one-by-one path after ending what they did.
        for depth in [1, 4, 64, 256] {
            let opts = EngineOptions {
                queue_depth: depth,
                ..EngineOptions::default()
            };
            if deferred {
                let q = Queue::new(Deferred::new(Finisher::default()), opts).unwrap();
                for n in [1, 2, 17, 64, 65, 300] {
                    run_batch(&q, n);
                }
            } else {
                let q = Queue::new(Finisher::default(), opts).unwrap();
                for n in [1, 2, 17, 64, 65, 300] {
                    run_batch(&q, n);
                }
            }
        }
    }
}

#[test]
fn reserved_tags_are_never_handed_out_by_a_batch() {
    let opts = EngineOptions {
        queue_depth: 64,
        reserved_tags: 8,
        ..EngineOptions::default()
    };
    let tags = Tags::new(TagsConfig {
        depth: 64,
        reserved: 8,
        ..TagsConfig::default()
    })
    .unwrap();
    let mut got = Vec::new();
    while let Some((mask, offset)) = tags.get_batch(64) {
        let mut m = mask;
        while m != 0 {
            got.push(offset + m.trailing_zeros());
            m &= m - 1;
        }
    }
    got.sort_unstable();
    assert_eq!(got, (8..64).collect::<Vec<u32>>());
    assert_eq!(tags.in_use(), 56);
    let hs = HctxTagState::default();
    for chunk in got.chunks(Tags::MAX_BATCH) {
        tags.put_batch(&hs, chunk);
    }
    assert_eq!(tags.in_use(), 0);
    let q = Queue::new(Finisher::default(), opts).unwrap();
    run_batch(&q, 100);
}

#[test]
fn a_busy_driver_in_a_batch_requeues_and_still_completes_everything() {
    let driver = Finisher {
        busy_every: 3,
        calls: AtomicU64::new(0),
    };
    let q = Queue::new(driver, EngineOptions::default()).unwrap();
    run_batch(&q, 200);
    assert!(q.stats().hctx.requeues > 0, "{}", q.status());
}

#[test]
fn a_stopped_queue_holds_a_batch_until_started() {
    let q = Queue::new(Finisher::default(), EngineOptions::default()).unwrap();
    q.stop_hw_queue(0);
    let owner = PerBio::new(10);
    let mut bios = batch(10, &owner);
    q.submit_batch(&mut bios);
    assert_eq!(owner.total.load(SeqCst), 0);
    assert_eq!(q.hw_queues()[0].dispatch_len(), 10);
    q.start_hw_queue(0, false);
    owner.wait_all(10);
    owner.assert_each_once();
    assert_eq!(q.stats().tags_in_use, 0);
}

/// Two submitters on two hardware queues sharing one tag set of 16, each
/// submitting 20 batches of 40: every bio completes once and every tag
/// comes back.
fn two_submitters_on_a_shared_set(tag_fair_share: bool) {
    let opts = EngineOptions {
        hw_queues: 2,
        shared_tags: true,
        tag_fair_share,
        queue_depth: 16,
        ..EngineOptions::default()
    };
    let q = Arc::new(Queue::new(Finisher::default(), opts).unwrap());
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let q = q.clone();
            std::thread::spawn(move || {
                for _ in 0..20 {
                    submit_and_check(&q, 40);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(q.stats().tags_in_use, 0);
}

/// With a fair share (the kernel's `BLK_MQ_F_TAG_QUEUE_SHARED`) tags are
/// taken one by one, each passing the share check.
#[test]
fn shared_tags_take_the_fair_one_by_one_path() {
    two_submitters_on_a_shared_set(true);
}

/// One device's hardware queues sharing a tag set without a fair share
/// (null_blk `shared_tag_bitmap`) take the batched path, as in the kernel.
#[test]
fn shared_tags_without_fair_share_take_the_batched_path() {
    two_submitters_on_a_shared_set(false);
}

#[test]
fn sbitmap_batch_get_takes_one_word_and_clear_batch_frees_it() {
    // Depth 64 is four 16-bit words.
    let q = SbitmapQueue::new(64, false, WakeupAlgo::Counter);
    let (mask, offset) = q.get_batch(16).unwrap();
    assert_eq!(mask, 0xffff);
    assert_eq!(offset % 16, 0, "a whole word from its first bit");
    assert_eq!(q.sbitmap().weight(), 16);
    // Asking for more than a word holds is refused, not truncated.
    assert!(q.get_batch(17).is_none());
    // A word with its first bits taken gives the run after them.
    q.clear_batch(&(offset..offset + 16).collect::<Vec<u32>>());
    assert_eq!(q.sbitmap().weight(), 0);
    let single: Vec<u32> = (0..3).map(|_| q.get().unwrap()).collect();
    let (mask, off2) = q.get_batch(4).unwrap();
    assert_eq!(mask.count_ones(), 4);
    let batch_bits: Vec<u32> = (0..64)
        .filter(|b| mask & (1 << b) != 0)
        .map(|b| off2 + b)
        .collect();
    for b in &batch_bits {
        assert!(!single.contains(b), "bit {b} handed out twice");
        assert!(q.sbitmap().test_bit(*b));
    }
    // Frees spanning several words, out of order.
    let mut all = single.clone();
    all.extend(&batch_bits);
    all.reverse();
    q.clear_batch(&all);
    assert_eq!(q.sbitmap().weight(), 0);
    // Round-robin maps never batch (as in the kernel).
    assert!(SbitmapQueue::new(64, true, WakeupAlgo::Counter)
        .get_batch(4)
        .is_none());
}

#[test]
fn a_batched_free_wakes_a_sleeping_waiter() {
    for algo in [WakeupAlgo::Counter, WakeupAlgo::WaitCnt] {
        let tags = Arc::new(
            Tags::new(TagsConfig {
                depth: 8,
                wakeup: algo,
                ..TagsConfig::default()
            })
            .unwrap(),
        );
        let hs = Arc::new(HctxTagState::default());
        let mut held = Vec::new();
        while let Some((mask, offset)) = tags.get_batch(8) {
            let mut m = mask;
            while m != 0 {
                held.push(offset + m.trailing_zeros());
                m &= m - 1;
            }
        }
        assert_eq!(held.len(), 8);
        let got = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (tags, hs, got) = (tags.clone(), hs.clone(), got.clone());
            std::thread::spawn(move || {
                let t = tags.get(&hs, false, &WaitIndex::new(), 1, || {});
                got.store(true, SeqCst);
                tags.put(&hs, t);
            })
        };
        // Let it go to sleep (it holds no tag until we free ours).
        let deadline = now_ns() + 2_000_000_000;
        while tags.bitmap().ws_active() == 0 && now_ns() < deadline {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        assert!(!got.load(SeqCst));
        tags.put_batch(&hs, &held);
        waiter.join().unwrap();
        assert!(got.load(SeqCst));
        assert_eq!(
            tags.stats().rescued,
            0,
            "woken by the rescue timer, not the free"
        );
        assert_eq!(tags.in_use(), 0);
    }
}
