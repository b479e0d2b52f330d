//! A submitter's claim on a hybrid `delay` target's held bios
//! (`Device::reaper` of a one-line mapped device, `delay/reaper.rs`):
//! a claimant that polls the claim's descriptor and reaps sends on every
//! bio itself, on its own thread, none before its deadline, whichever
//! thread (and so whichever per-CPU lane) submitted it; with the claimant
//! stalled the workers' backstop sends them on; dropping the claim gives
//! them back to the workers at once; `timer` and `kthread` offer no claim.
//! Counts only: the backstop bounds in these tables are either a minute
//! (so that only the claimant can send a bio on, however loaded the
//! machine) or the default, where nothing but the backstop can.

use blkstack_core::clock::now_ns;
use blkstack_core::{AlignedBuf, Bio, DeviceRef, EndIo, Op, Reaper, Status};
use blkstack_mapped::Registry;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

const MS: u64 = 1_000_000;
/// How long a test waits for completions before it fails (not a bound
/// it checks: the bios are due within milliseconds).
const PATIENCE: Duration = Duration::from_secs(60);

/// One completion: the bio's cookie, when and on which thread.
#[derive(Clone, Copy, Debug)]
struct Done {
    cookie: u64,
    at_ns: u64,
    thread: ThreadId,
    status: Status,
}

/// Records every completion with the thread it ran on.
#[derive(Default)]
struct Recorder {
    done: Mutex<Vec<Done>>,
    cv: Condvar,
}

impl EndIo for Recorder {
    fn end_io(&self, bio: Bio, status: Status, cookie: u64) {
        drop(bio);
        let d = Done {
            cookie,
            at_ns: now_ns(),
            thread: std::thread::current().id(),
            status,
        };
        self.done.lock().push(d);
        self.cv.notify_all();
    }
}

impl Recorder {
    fn count(&self) -> usize {
        self.done.lock().len()
    }

    /// Wait (without reaping) until `n` completions came.
    fn wait(&self, n: usize) -> Vec<Done> {
        let until = Instant::now() + PATIENCE;
        let mut g = self.done.lock();
        while g.len() < n {
            if self.cv.wait_until(&mut g, until).timed_out() {
                panic!("only {} of {n} bios completed", g.len());
            }
        }
        g.clone()
    }
}

fn setup(table: &str) -> (Arc<Registry>, DeviceRef) {
    let reg = Registry::new();
    reg.create("z", "0 8192 zero").expect("zero");
    reg.create("d", table).expect("delay");
    let dev = reg.device("d").expect("device d");
    (reg, dev)
}

/// A 4 KiB read of block `i` into block `i` of `mem`.
fn read(i: u64, mem: &AlignedBuf, rec: &Arc<Recorder>) -> Bio {
    // SAFETY: every test waits for all its bios before `mem` is dropped.
    let buf = unsafe { mem.io_buf(i as usize * 4096, 4096) };
    Bio::new(Op::Read, i * 4096, 4096, buf, rec.clone(), i)
}

/// Submit bios `range` now, each after a gap that varies, recording when.
fn submit(
    dev: &DeviceRef,
    range: std::ops::Range<u64>,
    mem: &AlignedBuf,
    rec: &Arc<Recorder>,
) -> Vec<(u64, u64)> {
    let mut at = Vec::new();
    for i in range {
        let b = read(i, mem, rec);
        at.push((i, now_ns()));
        dev.submit(b);
        std::thread::sleep(Duration::from_micros(i * 53 % 311));
    }
    at
}

/// Every bio completed OK, none before `submitted + delay`.
fn assert_never_early(done: &[Done], submitted: &[(u64, u64)], delay: u64) {
    for &(i, at) in submitted {
        let d = done
            .iter()
            .find(|d| d.cookie == i)
            .unwrap_or_else(|| panic!("bio {i} never completed"));
        assert_eq!(d.status, Status::Ok, "bio {i}");
        assert!(
            d.at_ns >= at + delay,
            "bio {i} completed {} ns after it was submitted, before its {delay} ns delay",
            d.at_ns - at
        );
    }
}

/// Sleep until `fd` polls readable (or a second passes).
fn wait_readable(fd: i32) {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, 1000) };
}

/// The `stats` counter `key`.
fn stat(reg: &Registry, key: &str) -> u64 {
    let text = reg.message("d", 0, &["stats"]).expect("stats");
    text.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {text:?}"))
}

#[test]
fn a_claimant_sends_on_every_bio_itself_never_early() {
    // A minute of backstop: only the claimant sends anything on.
    let (reg, dev) = setup("0 8192 delay z 0 1 reap_backstop_ms=60000");
    let table = reg.table_text("d").expect("table");
    assert!(
        table.ends_with(" 0 1 reap_backstop_ms=60000\n"),
        "{table:?}"
    );
    let claims: Vec<Box<dyn Reaper>> = (0..2)
        .map(|_| dev.reaper().expect("a hybrid delay table offers a claim"))
        .collect();
    assert_eq!(claims[0].fd(), claims[1].fd(), "claims poll one timer");
    let (threads, per) = (3u64, 30u64);
    let total = (threads * per) as usize;
    let mem = AlignedBuf::new(total * 4096);
    let rec = Arc::new(Recorder::default());
    let me = std::thread::current().id();
    let submitted = std::thread::scope(|s| {
        // Submitters on other threads (other CPUs' lanes, as they run).
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let (dev, mem, rec) = (&dev, &mem, &rec);
                s.spawn(move || submit(dev, t * per..(t + 1) * per, mem, rec))
            })
            .collect();
        // This thread is the claimant: it sleeps on the claim's
        // descriptor and reaps, through either claim.
        let mut turn = 0;
        while rec.count() < total {
            wait_readable(claims[turn % 2].fd());
            claims[turn % 2].reap();
            turn += 1;
        }
        hs.into_iter()
            .flat_map(|h| h.join().expect("submitter"))
            .collect::<Vec<_>>()
    });
    let done = rec.wait(total);
    assert_never_early(&done, &submitted, MS);
    let elsewhere = done.iter().filter(|d| d.thread != me).count();
    assert_eq!(elsewhere, 0, "every bio is sent on by the claimant");
    assert_eq!(stat(&reg, "reaped"), total as u64);
    assert_eq!(stat(&reg, "backstop"), 0);
    assert_eq!(
        reg.status_text("d").expect("status"),
        "0 8192 delay 0 0 0\n"
    );
}

#[test]
fn a_stalled_claimant_is_backed_up_by_the_workers() {
    // The default backstop; the claim is held and never reaped.
    let (reg, dev) = setup("0 8192 delay z 0 1");
    let claim = dev.reaper().expect("claim");
    let mem = AlignedBuf::new(40 * 4096);
    let rec = Arc::new(Recorder::default());
    let submitted = submit(&dev, 0..40, &mem, &rec);
    let done = rec.wait(40);
    assert_never_early(&done, &submitted, MS);
    let me = std::thread::current().id();
    assert!(done.iter().all(|d| d.thread != me), "nobody reaped here");
    assert_eq!(stat(&reg, "backstop"), 40);
    assert_eq!(stat(&reg, "reaped"), 0);
    drop(claim);
}

#[test]
fn dropping_the_claim_hands_held_bios_back_at_once() {
    // A minute of backstop: while claimed, nothing but a reap (or the
    // claim's end) sends these on within the test's patience.
    let (reg, dev) = setup("0 8192 delay z 0 1 reap_backstop_ms=60000 affinity=none");
    let claim = dev.reaper().expect("claim");
    let mem = AlignedBuf::new(40 * 4096);
    let rec = Arc::new(Recorder::default());
    let submitted = submit(&dev, 0..20, &mem, &rec);
    drop(claim);
    let done = rec.wait(20);
    assert_never_early(&done, &submitted, MS);
    assert_eq!(stat(&reg, "backstop") + stat(&reg, "reaped"), 0);
    assert_eq!(stat(&reg, "sent"), 20);
    // A later claim works the same as the first.
    let again = dev.reaper().expect("claim again");
    let more = submit(&dev, 20..40, &mem, &rec);
    while rec.count() < 40 {
        wait_readable(again.fd());
        again.reap();
    }
    assert_never_early(&rec.wait(40), &more, MS);
    assert_eq!(stat(&reg, "reaped"), 20);
}

#[test]
fn timer_and_kthread_modes_offer_no_claim() {
    for mode in ["timer", "kthread"] {
        let (_reg, dev) = setup(&format!("0 8192 delay z 0 1 mode={mode}"));
        assert!(dev.reaper().is_none(), "mode={mode}");
    }
    // A table of two lines offers none either.
    let reg = Registry::new();
    reg.create("z", "0 8192 zero").expect("zero");
    reg.create("d", "0 4096 delay z 0 1\n4096 4096 delay z 0 1")
        .expect("two lines");
    assert!(reg.device("d").expect("d").reaper().is_none());
}
