//! Bounded multi-thread stress of the tag allocator and the engine: every
//! tag is held by one owner at a time and freed exactly once, every sleeping
//! waiter is woken (a rescue timeout turns a lost wakeup into a counted
//! failure instead of a hang), and every bio completes exactly once. Sized
//! to finish in a few seconds in debug builds on a small machine.
#![cfg(not(loom))]

use blkstack_core::{Bio, EndIo, IoBuf, Op, Status};
use blkstack_mq::queue::{Driver, EngineOptions, Queue, QueueRq, Rq};

use blkstack_mq::sbitmap::{SbitmapQueue, SbqStats, WaitIndex, WakeupAlgo};
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

mod common;
use common::Deferred;

/// Run `f` on its own thread; fail if it has not finished in `secs`.
fn with_watchdog(secs: u64, name: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => h.join().expect("stress body"),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            // The body panicked: surface its panic.
            h.join().expect("stress body");
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{name}: hung for {secs} s"),
    }
}

fn sbitmap_stress(algo: WakeupAlgo, depth: u32, threads: u32, rounds: u32) -> SbqStats {
    // A rescue after 2 s: a lost wakeup shows up as `rescued > 0`.
    let q = Arc::new(SbitmapQueue::new(depth, false, algo).with_rescue_timeout_ns(2_000_000_000));
    let owners: Arc<Vec<AtomicU32>> = Arc::new((0..depth).map(|_| AtomicU32::new(0)).collect());
    let gets = Arc::new(AtomicU64::new(0));
    let frees = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (q, owners, gets, frees) = (q.clone(), owners.clone(), gets.clone(), frees.clone());
            std::thread::spawn(move || {
                let idx = WaitIndex::new();
                for _ in 0..t {
                    q.wait_ptr(&idx);
                }
                for r in 0..rounds {
                    let tag = q.get_blocking(&idx, || {});
                    gets.fetch_add(1, Relaxed);
                    let me = t + 1;
                    assert!(
                        owners[tag as usize]
                            .compare_exchange(0, me, SeqCst, SeqCst)
                            .is_ok(),
                        "tag {tag} handed to two owners"
                    );
                    if r % 7 == 0 {
                        std::thread::yield_now();
                    }
                    assert!(
                        owners[tag as usize]
                            .compare_exchange(me, 0, SeqCst, SeqCst)
                            .is_ok(),
                        "tag {tag} freed by a non-owner"
                    );
                    q.clear(tag);
                    frees.fetch_add(1, Relaxed);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("stress thread");
    }
    let total = (threads * rounds) as u64;
    assert_eq!(gets.load(Relaxed), total);
    assert_eq!(frees.load(Relaxed), total);
    assert_eq!(q.sbitmap().weight(), 0, "a tag was never freed");
    assert_eq!(q.ws_active(), 0, "a waiter is still registered");
    let s = q.stats();
    assert_eq!(s.rescued, 0, "{algo:?} depth {depth}: lost wakeups: {s:?}");
    assert!(s.woken >= s.waits, "a sleep ended without a wakeup: {s:?}");
    s
}

#[test]
fn sbitmap_counter_stress_small_depths() {
    with_watchdog(60, "sbitmap counter stress", || {
        let mut waits = 0;
        // More threads than bits, so that sleeping is the common case.
        for depth in [1, 2, 3, 4, 8, 16] {
            let s = sbitmap_stress(WakeupAlgo::Counter, depth, depth + 4, 2000);
            eprintln!("depth {depth}: {s:?}");
            waits += s.waits;
        }
        // The point is the sleeping path: it must have been taken.
        assert!(waits > 0, "no thread ever slept");
    });
}

/// An owner that counts completions per bio and lets a submitter keep a
/// bounded number in flight.
struct Owner {
    seen: Vec<AtomicU8>,
    outstanding: Mutex<u32>,
    cv: Condvar,
    completed: AtomicU64,
}

impl EndIo for Owner {
    fn end_io(&self, bio: Bio, status: Status, private: u64) {
        assert_eq!(status, Status::Ok);
        let prev = self.seen[private as usize].fetch_add(1, SeqCst);
        assert_eq!(prev, 0, "bio {private} completed twice");
        self.completed.fetch_add(1, Relaxed);
        drop(bio);
        let mut o = self.outstanding.lock();
        *o -= 1;
        self.cv.notify_all();
    }
}

/// A driver that is busy above `limit` requests per hardware queue.
struct LimitDriver {
    limit: u32,
    inflight: Vec<AtomicU32>,
    issued: AtomicU64,
}

impl Driver for LimitDriver {
    fn queue_rq(&self, rq: Rq<'_>) -> QueueRq {
        let n = &self.inflight[rq.hctx as usize];
        if self.limit > 0 && n.load(SeqCst) >= self.limit {
            return QueueRq::Busy;
        }
        n.fetch_add(1, SeqCst);
        self.issued.fetch_add(1, Relaxed);
        QueueRq::Done(Status::Ok)
    }

    fn complete(&self, rq: Rq<'_>, status: Status) -> Status {
        self.inflight[rq.hctx as usize].fetch_sub(1, SeqCst);
        status
    }
}

fn engine_stress(
    opts: EngineOptions,
    limit: u32,
    threads: u32,
    per_thread: u32,
    qd: u32,
) -> blkstack_mq::QueueStats {
    let nr_hw = opts.hw_queues as usize;
    let q = Arc::new(
        Queue::new(
            Deferred::new(LimitDriver {
                limit,
                inflight: (0..nr_hw).map(|_| AtomicU32::new(0)).collect(),
                issued: AtomicU64::new(0),
            }),
            opts.clone(),
        )
        .expect("queue"),
    );
    let total = threads * per_thread;
    let owner = Arc::new(Owner {
        seen: (0..total).map(|_| AtomicU8::new(0)).collect(),
        outstanding: Mutex::new(0),
        cv: Condvar::new(),
        completed: AtomicU64::new(0),
    });
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (q, owner) = (q.clone(), owner.clone());
            std::thread::spawn(move || {
                for i in 0..per_thread {
                    {
                        let mut o = owner.outstanding.lock();
                        while *o >= qd * threads {
                            owner.cv.wait(&mut o);
                        }
                        *o += 1;
                    }
                    let cookie = (t * per_thread + i) as u64;
                    let bio = Bio::new(Op::Write, 0, 0, IoBuf::empty(), owner.clone(), cookie);
                    q.submit(bio);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("submitter");
    }
    {
        let mut o = owner.outstanding.lock();
        while *o > 0 {
            let timed_out = owner
                .cv
                .wait_for(&mut o, Duration::from_secs(20))
                .timed_out();
            assert!(!timed_out, "requests never completed: {}", q.status());
        }
    }
    assert_eq!(owner.completed.load(Relaxed), total as u64);
    assert!(owner.seen.iter().all(|s| s.load(Relaxed) == 1));
    let s = q.stats();
    assert_eq!(s.tags_in_use, 0, "tags leaked: {}", q.status());
    assert_eq!(s.in_driver, 0);
    assert_eq!(s.dispatch_waiting, 0);
    if opts.tag_wakeup == WakeupAlgo::Counter {
        assert_eq!(s.tags.rescued, 0, "lost wakeups: {}", q.status());
    }
    assert_eq!(q.driver().inner.issued.load(Relaxed), total as u64);
    if limit > 0 {
        assert!(
            s.hctx.requeues > 0,
            "the busy path was not exercised: {}",
            q.status()
        );
    }
    eprintln!("{}", q.status());
    s
}

/// Options for a run whose requests are ended from a completion thread.
fn opts(depth: u32, hw: u32) -> EngineOptions {
    EngineOptions {
        hw_queues: hw,
        queue_depth: depth,
        rescue_timeout_ns: 2_000_000_000,
        ..EngineOptions::default()
    }
}

#[test]
fn engine_stress_softirq_tag_waits() {
    with_watchdog(60, "engine softirq", || {
        // 4 threads x QD 16 against 8 tags: submitters sleep for tags.
        let s = engine_stress(opts(8, 1), 0, 4, 3000, 16);
        assert!(s.tags.waits > 0, "no submitter ever slept for a tag");
    });
}

#[test]
fn engine_stress_shared_tags_busy_driver() {
    with_watchdog(60, "engine shared busy", || {
        let mut o = opts(16, 2);
        o.shared_tags = true;
        o.run_on_completion = true;
        engine_stress(o, 3, 4, 2000, 8);
    });
}

#[test]
fn engine_stress_shared_tags_with_fair_share_busy_driver() {
    with_watchdog(60, "engine shared fair busy", || {
        let mut o = opts(16, 2);
        o.shared_tags = true;
        o.tag_fair_share = true;
        o.run_on_completion = true;
        engine_stress(o, 3, 4, 2000, 8);
    });
}

#[test]
fn engine_stress_busy_without_dedup() {
    with_watchdog(60, "engine busy no dedup", || {
        let mut o = opts(32, 1);
        o.run_dedup = false;
        o.run_on_completion = true;
        engine_stress(o, 4, 3, 2000, 16);
    });
}

#[test]
fn engine_stress_softirq_wait_cnt() {
    with_watchdog(60, "engine wait_cnt", || {
        // The old algorithm must still free every tag and complete every
        // bio; its lost wakeups (if any) are rescued and counted, not hung.
        let mut o = opts(4, 1);
        o.tag_wakeup = WakeupAlgo::WaitCnt;
        let s = engine_stress(o, 0, 3, 3000, 8);
        assert!(s.tags.waits > 0, "no submitter ever slept for a tag");
    });
}
