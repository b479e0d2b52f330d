//! null's completion modes, which live in the driver (as null_blk's
//! `irqmode`, hrtimer and poll queues do) rather than in the engine:
//! timer completions never early and timed by the spin budget, polled
//! bios reaped by the submitter's poll and never early, the completion
//! thread as the backstop after `poll_backstop_ms`, teardown ending what
//! is held, a device dropped from its own completion thread, and every
//! bio completed once under several submitters.

use blkstack_core::clock::now_ns;
use blkstack_core::testing::CompletionRecorder;
use blkstack_core::{Bio, BioFlags, Device, EndIo, IoBuf, Op, Status};
use blkstack_drivers::NullDevice;
use parking_lot::Mutex;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;

fn null(args: &[&str]) -> NullDevice {
    NullDevice::from_args(1 << 20, args).expect("null device")
}

fn flush(owner: &Arc<CompletionRecorder>, cookie: u64) -> Bio {
    Bio::new(Op::Flush, 0, 0, IoBuf::empty(), owner.clone(), cookie)
}

fn polled_flush(owner: &Arc<CompletionRecorder>) -> Bio {
    let mut b = flush(owner, 0);
    b.flags.insert(BioFlags::POLLED);
    b
}

#[test]
fn timer_completions_with_a_spin_budget_end_on_time_and_report_the_spin() {
    const NSEC: u64 = 300_000;
    let d = null(&[
        "irqmode=2",
        "completion_nsec=300000",
        "timer_spin_ns=200000",
    ]);
    let owner = CompletionRecorder::new();
    for _ in 0..20u64 {
        // The bio carries the earliest time it may complete.
        let due = now_ns() + NSEC;
        d.submit(flush(&owner, due));
        std::thread::sleep(Duration::from_micros(700));
    }
    let done = owner.wait(20, Duration::from_secs(5));
    for c in &done {
        assert!(
            c.at_ns >= c.cookie,
            "completed {} ns early",
            c.cookie - c.at_ns
        );
    }
    assert_eq!(d.timer_stats().completions, 20);
    assert!(d.status().contains("timer_spin_cpu_ns="), "{}", d.status());
}

#[test]
fn polled_bios_complete_from_poll_on_time_and_never_early() {
    // 200 ms, so that the 10 ms nap below, however much a loaded test
    // machine stretches it, ends long before the requests are due; a
    // backstop of a minute, so that only this thread's poll can end them
    // however long it is descheduled.
    let d = null(&[
        "irqmode=2",
        "completion_nsec=200000000",
        "iopoll=1",
        "poll_backstop_ms=60000",
    ]);
    assert!(d.polls());
    let rec = CompletionRecorder::new();
    let t0 = now_ns();
    for _ in 0..4 {
        d.submit(polled_flush(&rec));
    }
    // Not due: polling completes nothing, and the timer thread does not
    // complete them either.
    assert_eq!(d.poll(), 0);
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!(rec.count(), 0);
    let mut by_poll = 0;
    while rec.count() < 4 {
        let n = d.poll();
        if n > 0 {
            assert!(now_ns() - t0 >= 200_000_000, "completed early");
        }
        by_poll += n;
        assert!(now_ns() - t0 < 30_000_000_000, "never became due");
    }
    assert!(rec
        .completions()
        .iter()
        .all(|c| c.at_ns - t0 >= 200_000_000));
    assert_eq!(by_poll, 4, "the backstop took a bio that was polled for");
    assert_eq!(d.timer_stats().completions, 4);
}

#[test]
fn a_polled_bio_nobody_polls_is_completed_by_the_backstop() {
    let d = null(&["irqmode=2", "completion_nsec=1000000", "iopoll=1"]);
    let rec = CompletionRecorder::new();
    d.submit(polled_flush(&rec));
    // Due after 1 ms, left to the completion thread 1 ms later, which
    // looks every 10 ms when idle.
    rec.wait(1, Duration::from_secs(2));
}

#[test]
fn the_backstop_waits_poll_backstop_ms_past_the_deadline() {
    const DUE_NS: u64 = 1_000_000;
    const BACKSTOP_NS: u64 = 100_000_000;
    let d = null(&[
        "irqmode=2",
        "completion_nsec=1000000",
        "iopoll=1",
        "poll_backstop_ms=100",
    ]);
    assert_eq!(
        d.table_args(),
        "irqmode=2 completion_nsec=1000000 iopoll=1 poll_backstop_ms=100"
    );
    assert!(
        d.status().contains("poll_backstop_ms=100"),
        "{}",
        d.status()
    );
    let rec = CompletionRecorder::new();
    let t0 = now_ns();
    d.submit(polled_flush(&rec));
    // Nobody polls: the completion thread ends it, never before the
    // backstop (a bound load cannot break), and surely within seconds.
    let done = rec.wait(1, Duration::from_secs(10));
    let after = done[0].at_ns - t0;
    assert!(after >= DUE_NS + BACKSTOP_NS, "backstop early: {after} ns");
    for bad in [
        &["irqmode=2", "poll_backstop_ms=5"][..],
        &["irqmode=2", "iopoll=1", "poll_backstop_ms=0"],
        &["irqmode=2", "iopoll=1", "poll_backstop_ms=60001"],
    ] {
        let e = NullDevice::from_args(1 << 20, bad).err().expect("refused");
        assert!(e.to_string().contains("poll_backstop_ms"), "{bad:?}: {e}");
    }
}

#[test]
fn dropping_the_device_ends_its_polled_bios_no_earlier_than_due() {
    let rec = CompletionRecorder::new();
    let t0 = now_ns();
    {
        let d = null(&["irqmode=2", "completion_nsec=5000000", "iopoll=1"]);
        d.submit(polled_flush(&rec));
        d.submit(polled_flush(&rec));
    }
    assert_eq!(rec.count(), 2);
    assert!(rec.completions().iter().all(|c| c.at_ns - t0 >= 5_000_000));
}

#[test]
fn without_iopoll_a_polled_bio_completes_on_the_timer_thread() {
    let d = null(&["irqmode=2", "completion_nsec=1000000"]);
    assert!(!d.polls());
    let rec = CompletionRecorder::new();
    d.submit(polled_flush(&rec));
    assert_eq!(d.poll(), 0);
    rec.wait(1, Duration::from_secs(2));
    assert_eq!(d.poll(), 0);
    for bad in [&["iopoll=1"][..], &["irqmode=1", "timer_spin_ns=1000"]] {
        let e = NullDevice::from_args(1 << 20, bad).err().expect("refused");
        assert!(e.to_string().contains("irqmode=2"), "{bad:?}: {e}");
    }
}

#[test]
fn device_dropped_from_its_own_completion_thread() {
    struct DropOnEnd {
        dev: Mutex<Option<Arc<NullDevice>>>,
        done: AtomicBool,
    }
    impl EndIo for DropOnEnd {
        fn end_io(&self, bio: Bio, _status: Status, _private: u64) {
            drop(bio);
            let last = self.dev.lock().take();
            drop(last);
            self.done.store(true, SeqCst);
        }
    }
    for irq in ["irqmode=1", "irqmode=2"] {
        let d = Arc::new(null(&[irq]));
        let owner = Arc::new(DropOnEnd {
            dev: Mutex::new(Some(d.clone())),
            done: AtomicBool::new(false),
        });
        d.submit(Bio::new(Op::Flush, 0, 0, IoBuf::empty(), owner.clone(), 0));
        drop(d);
        let deadline = now_ns() + 2_000_000_000;
        while !owner.done.load(SeqCst) {
            assert!(now_ns() < deadline, "{irq}: completion never ran");
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

#[test]
fn timer_mode_completes_every_bio_once_under_several_submitters() {
    // 2 hardware queues of 4 tags, 3 submitters keeping 8 each in flight:
    // submitters sleep for tags that timer completions free.
    let d = Arc::new(null(&[
        "irqmode=2",
        "completion_nsec=20000",
        "submit_queues=2",
        "hw_queue_depth=4",
    ]));
    let rec = CompletionRecorder::new();
    let threads: Vec<_> = (0..3u64)
        .map(|t| {
            let (d, rec) = (d.clone(), rec.clone());
            std::thread::spawn(move || {
                for i in 0..300u64 {
                    // A submitter sleeps for a tag when none is free.
                    d.submit(flush(&rec, t * 1000 + i));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("submitter");
    }
    let mut got: Vec<u64> = rec
        .wait(900, Duration::from_secs(20))
        .iter()
        .map(|c| c.cookie)
        .collect();
    got.sort_unstable();
    let want: Vec<u64> = (0..3u64)
        .flat_map(|t| (0..300).map(move |i| t * 1000 + i))
        .collect();
    assert_eq!(got, want, "a bio lost or completed twice");
    let s = d.engine_stats();
    assert_eq!(s.tags_in_use, 0, "{}", d.status());
    assert_eq!(s.in_driver, 0);
    assert_eq!(d.timer_stats().completions, 900);
}
