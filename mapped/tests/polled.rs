//! Polled bios pass through linear and striped, as Linux dm lets a
//! REQ_POLLED bio through a table whose devices all poll
//! (`dm_table_supports_poll`): the submitter's `poll` on the mapped device
//! reaps them from the null devices below, exactly once and never before
//! their completion time. The nulls' backstop is set long
//! (`poll_backstop_ms`), so every bio must be reaped by the poll;
//! `drivers/tests/null_completion.rs` shows the backstop still ends a
//! polled bio nobody polls.

use blkstack_core::clock::now_ns;
use blkstack_core::testing::CompletionRecorder;
use blkstack_core::{Bio, BioFlags, Device, IoBuf, Op, Status};
use blkstack_mapped::Registry;

/// Long enough that the submit and the first polls end well before any bio
/// is due, so an early completion cannot hide.
const COMPLETION_NS: u64 = 20_000_000;

/// The null devices' backstop, a minute past the deadline: only the
/// submitter's poll can end a bio within the test, however long a loaded
/// machine deschedules the poller, so reaping by poll is deterministic.
fn null_line(sectors: u64) -> String {
    format!(
        "0 {sectors} null irqmode=2 completion_nsec={COMPLETION_NS} iopoll=1 poll_backstop_ms=60000"
    )
}

/// Submit one polled read at each offset through `dev` and poll until all
/// are done: each is reaped by this thread's `poll` (its count of
/// completions), exactly once and never early.
fn assert_reaped_by_poll(dev: &dyn Device, offsets: &[u64]) {
    assert!(dev.polls(), "the mapped device must advertise polling");
    let done = CompletionRecorder::new();
    let mut bufs: Vec<Vec<u8>> = offsets.iter().map(|_| vec![0u8; 4096]).collect();
    let t0 = now_ns();
    for (i, (&off, buf)) in offsets.iter().zip(bufs.iter_mut()).enumerate() {
        // SAFETY: `bufs` outlives the bios: this function waits for every
        // completion before it returns.
        let io = unsafe { IoBuf::from_slice(buf) };
        let bio =
            Bio::new(Op::Read, off, 4096, io, done.clone(), i as u64).with_flags(BioFlags::POLLED);
        dev.submit(bio);
    }
    let mut by_poll = 0;
    while done.count() < offsets.len() {
        by_poll += dev.poll();
        assert!(
            now_ns() - t0 < 30_000_000_000,
            "polled bios never completed"
        );
    }
    let got = done.completions();
    let mut cookies: Vec<u64> = got.iter().map(|c| c.cookie).collect();
    cookies.sort_unstable();
    assert_eq!(
        cookies,
        (0..offsets.len() as u64).collect::<Vec<_>>(),
        "not exactly once"
    );
    for c in &got {
        assert_eq!(c.status, Status::Ok);
        let after = c.at_ns - t0;
        assert!(after >= COMPLETION_NS, "completed early: {after} ns");
    }
    assert_eq!(
        by_poll,
        offsets.len(),
        "polled bios were not all reaped by the submitter's poll"
    );
}

#[test]
fn a_polled_bio_through_linear_is_reaped_by_poll() {
    let reg = Registry::new();
    reg.create("n0", &null_line(2048)).unwrap();
    reg.create("lin", "0 1024 linear n0 512").unwrap();
    let dev = reg.device("lin").unwrap();
    assert_reaped_by_poll(&*dev, &[0]);
}

#[test]
fn polled_bios_through_striped_are_reaped_by_poll_on_every_stripe() {
    let reg = Registry::new();
    reg.create("n0", &null_line(1024)).unwrap();
    reg.create("n1", &null_line(1024)).unwrap();
    reg.create("st", "0 2048 striped 2 8 n0 0 n1 0").unwrap();
    let dev = reg.device("st").unwrap();
    // Chunk 0 lies on n0, chunk 1 (sector 8) on n1.
    assert_reaped_by_poll(&*dev, &[0, 8 * 512]);
}

#[test]
fn striped_polls_only_if_every_stripe_polls() {
    let reg = Registry::new();
    reg.create("n0", &null_line(1024)).unwrap();
    reg.create("m1", "0 1024 memory").unwrap();
    reg.create("st", "0 2048 striped 2 8 n0 0 m1 0").unwrap();
    assert!(!reg.device("st").unwrap().polls());
    reg.create("lin", "0 1024 linear m1 0").unwrap();
    assert!(!reg.device("lin").unwrap().polls());
}
