//! Tests of [`super`] (`queue.rs`), kept apart so that file stays short.

use super::*;
use blkstack_core::clock::now_ns;
use blkstack_core::testing::CompletionRecorder;
use blkstack_core::{IoBuf, Op};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

/// Busy while `refuse` is set; counts completions.
#[derive(Default)]
struct Gate {
    refuse: AtomicBool,
}

impl Driver for Gate {
    fn queue_rq(&self, _rq: Rq<'_>) -> QueueRq {
        if self.refuse.load(SeqCst) {
            QueueRq::Busy
        } else {
            QueueRq::Done(Status::Ok)
        }
    }
}

fn write_bio(owner: &Arc<CompletionRecorder>) -> Bio {
    Bio::new(Op::Write, 0, 0, IoBuf::empty(), owner.clone(), 0)
}

fn wait_done(d: &CompletionRecorder, n: usize, within_ns: u64) {
    d.wait(n, Duration::from_nanos(within_ns));
}

/// A pool whose only worker is held until `release`, so posted runs
/// stay pending while the test looks at them.
fn held_pool() -> (Arc<Kblockd>, Arc<AtomicBool>) {
    let pool = Kblockd::new(1);
    let go = Arc::new(AtomicBool::new(false));
    let go2 = go.clone();
    let blocker = DelayedWork::new(move || {
        while !go2.load(SeqCst) {
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    });
    pool.post(&blocker, 0);
    (pool, go)
}

fn release(go: &AtomicBool) {
    go.store(true, SeqCst);
}

/// A queue on a held pool whose driver refused the one request
/// submitted: it waits on the dispatch list with nothing in flight.
fn refused_on_held_pool() -> (
    Queue<Gate>,
    Arc<Kblockd>,
    Arc<AtomicBool>,
    Arc<CompletionRecorder>,
) {
    let (pool, gate) = held_pool();
    let q = Queue::with_kblockd(Gate::default(), EngineOptions::default(), pool.clone()).unwrap();
    q.driver().refuse.store(true, SeqCst);
    let done = CompletionRecorder::new();
    q.submit(write_bio(&done));
    (q, pool, gate, done)
}

#[test]
fn queued_bit_dedups_immediate_runs_and_delayed_runs_never_stand_in() {
    let (q, pool, gate, done) = refused_on_held_pool();
    let h = &q.hw_queues()[0];
    assert_eq!(h.dispatch_len(), 1);
    // Busy with nothing in flight: a delayed (3 ms) run was posted and
    // the queued bit is clear.
    assert_eq!(h.stats().runs_posted, 1);
    assert!(!h.work_queued());
    q.run_hw_queue(0, true);
    assert!(h.work_queued());
    q.run_hw_queue(0, true);
    q.run_hw_queue(0, true);
    assert_eq!(h.stats().runs_posted, 2);
    assert_eq!(h.stats().runs_deduped, 2);
    // A delayed run clears the bit, so the next immediate one posts.
    q.delay_run_hw_queue(0, 5_000_000_000);
    assert!(!h.work_queued());
    q.run_hw_queue(0, true);
    assert_eq!(h.stats().runs_posted, 4);
    // ...and the pending work is not postponed by the 5 s delay.
    q.driver().refuse.store(false, SeqCst);
    let t0 = now_ns();
    release(&gate);
    wait_done(&done, 1, 2_000_000_000);
    assert!(now_ns() - t0 < 2_000_000_000);
    assert_eq!(q.stats().tags_in_use, 0);
    drop(q);
    pool.shutdown();
}

#[test]
fn without_dedup_every_async_run_is_posted() {
    let (pool, gate) = held_pool();
    let opts = EngineOptions {
        run_dedup: false,
        ..EngineOptions::default()
    };
    let q = Queue::with_kblockd(Gate::default(), opts, pool.clone()).unwrap();
    q.driver().refuse.store(true, SeqCst);
    let done = CompletionRecorder::new();
    q.submit(write_bio(&done));
    for _ in 0..5 {
        q.run_hw_queue(0, true);
    }
    let s = q.hw_queues()[0].stats();
    assert_eq!(s.runs_posted, 6);
    assert_eq!(s.runs_deduped, 0);
    q.driver().refuse.store(false, SeqCst);
    release(&gate);
    wait_done(&done, 1, 2_000_000_000);
    drop(q);
    pool.shutdown();
}

/// A restart armed with nothing in flight has no completion to honour
/// it: once its resource-delay run is gone (cancelled here by a stop;
/// in the `lab mq-run` hang, run while the list was empty), the
/// restart bit must not veto the next inline run, or the request waits
/// on the dispatch list for ever.
#[test]
fn restart_with_nothing_in_flight_vetoes_no_inline_run() {
    let (q, pool, gate, done) = refused_on_held_pool();
    let h = &q.hw_queues()[0];
    assert_eq!((h.dispatch_len(), h.in_driver()), (1, 0));
    // The resource-delay run is pending on the held worker; the stop
    // cancels it, and the restart bit stays set.
    q.stop_hw_queue(0);
    q.driver().refuse.store(false, SeqCst);
    q.start_hw_queue(0, false);
    assert_eq!(done.count(), 1, "the inline run was vetoed: {}", q.status());
    assert_eq!(q.stats().tags_in_use, 0);
    release(&gate);
    drop(q);
    pool.shutdown();
}

#[test]
fn stopped_queue_holds_requests_until_started() {
    let q = Queue::new(Gate::default(), EngineOptions::default()).unwrap();
    let done = CompletionRecorder::new();
    q.stop_hw_queue(0);
    q.submit(write_bio(&done));
    q.submit(write_bio(&done));
    assert_eq!(done.count(), 0);
    assert_eq!(q.hw_queues()[0].dispatch_len(), 2);
    q.start_hw_queue(0, false);
    assert_eq!(done.count(), 2);
    assert_eq!(q.stats().tags_in_use, 0);
}

#[test]
fn blocking_driver_runs_only_from_kblockd() {
    let opts = EngineOptions {
        blocking: true,
        ..EngineOptions::default()
    };
    let q = Queue::new(Gate::default(), opts).unwrap();
    let done = CompletionRecorder::new();
    q.stop_hw_queue(0);
    q.submit(write_bio(&done));
    q.start_hw_queue(0, false);
    wait_done(&done, 1, 2_000_000_000);
    let s = q.hw_queues()[0].stats();
    assert_eq!(s.runs_inline, 0);
    assert!(s.runs_from_work >= 1);
}

/// Keeps every request it is given until polled or ended through
/// its completer.
#[derive(Default)]
struct Holder {
    held: parking_lot::Mutex<Vec<(u32, u32)>>,
    completer: OnceLock<RequestCompleter>,
}

impl Driver for Holder {
    fn queue_rq(&self, rq: Rq<'_>) -> QueueRq {
        self.held.lock().push((rq.hctx, rq.tag));
        QueueRq::Issued
    }

    fn attach(&self, completer: RequestCompleter) {
        let _ = self.completer.set(completer);
    }

    fn polls(&self) -> bool {
        true
    }

    fn poll(&self, completer: &CompleterRef<'_>) -> usize {
        let held = std::mem::take(&mut *self.held.lock());
        for &(hctx, tag) in &held {
            completer.end_request(hctx, tag, Status::Ok);
        }
        held.len()
    }
}

#[test]
fn poll_calls_the_drivers_poll_which_ends_its_requests() {
    let q = Queue::new(Holder::default(), EngineOptions::default()).unwrap();
    assert!(q.polls());
    let done = CompletionRecorder::new();
    for _ in 0..3 {
        q.submit(write_bio(&done));
    }
    assert_eq!(done.count(), 0);
    assert_eq!(q.stats().in_driver, 3);
    assert_eq!(q.poll(), 3);
    assert_eq!(done.count(), 3);
    assert_eq!(q.poll(), 0);
    let s = q.stats();
    assert_eq!((s.tags_in_use, s.in_driver), (0, 0));
    // A driver without a poll hook polls nothing.
    let g = Queue::new(Gate::default(), EngineOptions::default()).unwrap();
    assert!(!g.polls());
    assert_eq!(g.poll(), 0);
}

/// A polled submitter whose tag set is full polls for the requests
/// holding the tags instead of sleeping in the tag wait, where nothing
/// would end them (`Holder` ends requests only when polled). It slept
/// there for ever before, and with more polling jobs than tags the
/// bench's pollers waited on each other.
#[test]
fn a_polled_submitter_with_no_free_tag_polls_instead_of_sleeping() {
    let opts = EngineOptions {
        queue_depth: 2,
        ..EngineOptions::default()
    };
    let q = Arc::new(Queue::new(Holder::default(), opts).unwrap());
    let done = Arc::new(CompletionRecorder::new());
    let (tx, rx) = std::sync::mpsc::channel();
    let (q2, d2) = (q.clone(), done.clone());
    std::thread::spawn(move || {
        for _ in 0..8 {
            let mut b = write_bio(&d2);
            b.flags.insert(BioFlags::POLLED);
            q2.submit(b);
        }
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("the submitter slept in the tag wait with every tag held by a polled request");
    assert_eq!(done.count() + q.stats().in_driver as usize, 8);
    q.poll();
    assert_eq!(done.count(), 8);
}

#[test]
fn polled_bios_map_to_the_poll_queues_and_the_rest_to_the_others() {
    let opts = EngineOptions {
        hw_queues: 3,
        poll_queues: 1,
        ..EngineOptions::default()
    };
    let q = Queue::new(Holder::default(), opts).unwrap();
    let done = CompletionRecorder::new();
    let mut batch = Vec::new();
    for i in 0..6 {
        let mut b = write_bio(&done);
        if i % 2 == 0 {
            b.flags.insert(BioFlags::POLLED);
        }
        batch.push(b);
    }
    q.submit(write_bio(&done));
    // A mixed batch is split by type, not sent to the first bio's queue.
    q.submit_batch(&mut batch);
    let held = q.driver().held.lock().clone();
    assert_eq!(held.len(), 7);
    assert_eq!(held.iter().filter(|&&(h, _)| h == 2).count(), 3, "{held:?}");
    assert_eq!(q.poll(), 7);
    assert_eq!(done.count(), 7);
}

#[test]
fn a_completer_ends_requests_from_another_thread_and_outlives_the_queue() {
    let q = Queue::new(Holder::default(), EngineOptions::default()).unwrap();
    let done = CompletionRecorder::new();
    q.submit(write_bio(&done));
    q.submit(write_bio(&done));
    let completer = q.driver().completer.get().cloned().expect("attached");
    let held = std::mem::take(&mut *q.driver().held.lock());
    let (first, second) = (held[0], held[1]);
    let c = completer.clone();
    std::thread::spawn(move || c.end_request(first.0, first.1, Status::IoError))
        .join()
        .expect("completing thread");
    let h = completer.hold().expect("queue alive");
    h.end_request(second.0, second.1, Status::Ok);
    drop(h);
    // The thread was joined before the second end: completion order.
    assert_eq!(done.statuses(), [Status::IoError, Status::Ok]);
    assert_eq!(q.stats().tags_in_use, 0);
    drop(q);
    // The queue is gone: nothing to hold, and ending is a no-op.
    assert!(completer.hold().is_none());
    completer.end_request(0, 0, Status::Ok);
    assert_eq!(done.count(), 2);
}
