//! `multipath` as a dmsetup user and a workload see it: dm-mpath's table
//! grammar and its errors, `status`/`table` text, messages, path failover
//! on I/O errors, `queue_if_no_path` holding I/O until a path returns,
//! EIO without it, group failover in priority order, and data integrity
//! with paths failing and coming back under a multi-threaded load.

use blkstack_core::sync::submit_and_wait;
use blkstack_core::testing::CompletionRecorder;
use blkstack_core::{Bio, Device, IoBuf, Op, Status};
use blkstack_mapped::Registry;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Memory `m` (minor 0) and three linear paths over it (minors 1..=3).
fn paths() -> Arc<Registry> {
    let reg = Registry::new();
    reg.create_stack(
        "m: 0 8192 memory\n\
         p0: 0 8192 linear m 0\n\
         p1: 0 8192 linear m 0\n\
         p2: 0 8192 linear m 0\n",
    )
    .unwrap();
    reg
}

fn status_args(reg: &Registry, name: &str) -> String {
    let s = reg.status_text(name).unwrap();
    let s = s
        .strip_prefix("0 8192 multipath ")
        .expect("one multipath line");
    s.strip_suffix('\n').unwrap().to_string()
}

fn write(dev: &dyn Device, off: u64, byte: u8) -> Status {
    let mut buf = vec![byte; 4096];
    submit_and_wait(dev, Op::Write, off, 4096, &mut buf)
}

fn read(dev: &dyn Device, off: u64) -> (Status, Vec<u8>) {
    let mut buf = vec![0u8; 4096];
    let s = submit_and_wait(dev, Op::Read, off, 4096, &mut buf);
    (s, buf)
}

#[test]
fn table_and_status_text_match_dm_mpath() {
    let reg = paths();
    reg.create(
        "mp",
        "0 8192 multipath 1 queue_if_no_path 0 2 1 round-robin 0 2 1 p0 1 p1 1 service-time 0 1 2 p2 1 4",
    )
    .unwrap();
    assert_eq!(
        reg.table_text("mp").unwrap(),
        "0 8192 multipath 1 queue_if_no_path 0 2 1 round-robin 0 2 1 253:1 1 253:2 1 service-time 0 1 2 253:3 1 4\n"
    );
    // Fresh: QUEUE_IO still set, no group active yet.
    assert_eq!(
        status_args(&reg, "mp"),
        "2 1 0 0 2 1 E 0 2 0 253:1 A 0 253:2 A 0 E 0 1 2 253:3 A 0 0 4 "
    );
    let mp = reg.device("mp").unwrap();
    assert_eq!(write(&*mp, 0, 1), Status::Ok);
    assert_eq!(
        status_args(&reg, "mp"),
        "2 0 0 0 2 1 A 0 2 0 253:1 A 0 253:2 A 0 E 0 1 2 253:3 A 0 0 4 "
    );
    reg.message("mp", 0, &["fail_path", "p0"]).unwrap();
    reg.message("mp", 0, &["disable_group", "2"]).unwrap();
    assert_eq!(
        status_args(&reg, "mp"),
        "2 0 0 0 2 1 E 0 2 0 253:1 F 1 253:2 A 0 D 0 1 2 253:3 A 0 0 4 "
    );
    reg.message("mp", 0, &["fail_if_no_path"]).unwrap();
    reg.message("mp", 0, &["switch_group", "2"]).unwrap();
    assert_eq!(
        reg.table_text("mp").unwrap(),
        "0 8192 multipath 0 0 2 2 round-robin 0 2 1 253:1 1 253:2 1 service-time 0 1 2 253:3 1 4\n"
    );
    // The table text builds the same target again.
    let t = reg.table_text("mp").unwrap();
    reg.create("mp2", &t).unwrap();
    assert_eq!(reg.table_text("mp2").unwrap(), t);
}

#[test]
fn features_and_selector_views_round_trip() {
    let reg = paths();
    let cases = [
        (
            "4 queue_mode bio pg_init_retries 5",
            "5 pg_init_retries 5 retain_attached_hw_handler queue_mode bio",
        ),
        (
            "4 pg_init_delay_msecs 100 start_time jiffies:250",
            "4 pg_init_delay_msecs 100 start_time jiffies:250",
        ),
        ("2 queue_mode MQ", "0"),
        ("2 start_time ns", "0"),
    ];
    for (i, (features, shown)) in cases.iter().enumerate() {
        let name = format!("f{i}");
        reg.create(
            &name,
            &format!("0 8192 multipath {features} 0 1 1 historical-service-time 0 2 0 p0 p1"),
        )
        .unwrap();
        assert_eq!(
            reg.table_text(&name).unwrap(),
            format!(
                "0 8192 multipath {shown} 0 1 1 historical-service-time 2 972 0 2 1 253:1 0 253:2 0\n"
            ),
            "features '{features}'"
        );
    }
    // HST status: per path hst (fixed point, starts at 1 ns = 1024),
    // outstanding and stale_after.
    assert_eq!(
        status_args(&reg, "f0"),
        "2 1 0 0 1 1 E 2 972 0 2 3 253:1 A 0 1024 0 0 253:2 A 0 1024 0 0 "
    );
    // Bio mode without a hardware handler runs no pg_init: the group
    // switch clears queue_io before dm-mpath's `__map_bio` tests it again
    // (Linux 6.12 in the kernel VM prints `2 0 0`, case mpath-bio).
    let f0 = reg.device("f0").unwrap();
    assert_eq!(write(&*f0, 0, 3), Status::Ok);
    assert!(status_args(&reg, "f0").starts_with("2 0 0 0 1 1 A 2 972 0 2 3 "));

    reg.create(
        "ql",
        "0 8192 multipath 0 0 1 1 queue-length 0 2 1 p0 1 p1 1",
    )
    .unwrap();
    assert_eq!(
        status_args(&reg, "ql"),
        "2 1 0 0 1 1 E 0 2 1 253:1 A 0 0 253:2 A 0 0 "
    );
}

#[test]
fn bad_tables_are_refused_with_the_problem_named() {
    let reg = paths();
    let cases: &[(&str, &str)] = &[
        ("0 1 1 round-robin 0 1 0 p0", "number of priority groups"),
        (
            "0 1 alua 1 1 round-robin 0 1 0 p0",
            "error attaching hardware handler 'alua'",
        ),
        (
            "0 0 2 1 round-robin 0 1 0 p0",
            "priority group count mismatch: the table declares 2",
        ),
        (
            "0 0 1 1 round-robin 0 1 0 p0 round-robin 0 1 0 p1",
            "declares 1 group(s) but describes 2",
        ),
        (
            "0 0 1 1 nosuch 0 1 0 p0",
            "unknown path selector type 'nosuch'",
        ),
        ("0 0 1 1 round-robin 0 2 0 p0", "not enough path parameters"),
        ("0 0 1 1 round-robin 0 0 0", "invalid number of paths 0"),
        (
            "0 0 1 0 round-robin 0 1 0 p0",
            "invalid initial priority group 0",
        ),
        (
            "1 bogus 0 1 1 round-robin 0 1 0 p0",
            "unrecognised multipath feature 'bogus'",
        ),
        (
            "1 pg_init_retries 0 1 1 round-robin 0 1 0 p0",
            "needs a value",
        ),
        (
            "2 pg_init_retries 99 0 1 1 round-robin 0 1 0 p0",
            "pg_init_retries",
        ),
        (
            "2 queue_mode nvme 0 1 1 round-robin 0 1 0 p0",
            "unknown queue_mode 'nvme'",
        ),
        (
            "2 start_time jiffies:x 0 1 1 round-robin 0 1 0 p0",
            "invalid HZ",
        ),
        (
            "17 queue_if_no_path 0 1 1 round-robin 0 1 0 p0",
            "invalid number of feature args 17",
        ),
        (
            "5 queue_if_no_path 0 1 1",
            "number of feature args is 5 but only 4",
        ),
        (
            "9 queue_if_no_path queue_if_no_path queue_if_no_path queue_if_no_path queue_if_no_path queue_if_no_path queue_if_no_path queue_if_no_path queue_if_no_path 0 1 1 round-robin 0 1 0 p0",
            "number of feature args",
        ),
        ("0 0 1 +1 round-robin 0 1 0 p0", "initial priority group number"),
        ("0 0 1 1 round-robin 0 1 1 p0 +1", "repeat count"),
        (
            "0 1 alua 1 1 round-robin 0 1 0 p0",
            "error attaching hardware handler",
        ),
        ("0 0 1 1 service-time 0 1 2 p0 1 500", "relative_throughput"),
        (
            "0 0 1 1 historical-service-time 1 2000 1 0 p0",
            "base_weight",
        ),
        (
            "0 0 1 1 round-robin 0 1 0 nodev",
            "device 'nodev' not found",
        ),
    ];
    for (args, want) in cases {
        let err = reg
            .create("bad", &format!("0 8192 multipath {args}"))
            .err()
            .unwrap_or_else(|| panic!("'{args}' was accepted"))
            .report();
        assert!(err.contains(want), "'{args}': got '{err}', want '{want}'");
        assert!(err.contains("line 1"), "'{args}': {err}");
        assert!(reg.get("bad").is_none());
    }
    // What dm-mpath 6.12 accepts: selector args it ignores, an initial
    // group past the last (none), a bio-based table's hardware handler
    // (ignored), a handler name in a table without paths.
    for (args, table) in [
        (
            "0 0 1 1 round-robin 1 x 1 0 p0",
            "0 0 1 1 round-robin 0 1 1 253:1 1",
        ),
        (
            "0 0 1 2 round-robin 0 1 0 p0",
            "0 0 1 1 round-robin 0 1 1 253:1 1",
        ),
        (
            "2 queue_mode bio 2 alua x 1 1 round-robin 0 1 0 p0",
            "3 retain_attached_hw_handler queue_mode bio 0 1 1 round-robin 0 1 1 253:1 1",
        ),
        ("0 1 alua 0 0", "0 1 alua 0 0"),
    ] {
        reg.create("ok", &format!("0 8192 multipath {args}"))
            .unwrap_or_else(|e| panic!("'{args}': {}", e.report()));
        assert_eq!(
            reg.table_text("ok").unwrap(),
            format!("0 8192 multipath {table}\n"),
            "{args}"
        );
        reg.remove("ok", false).unwrap();
    }
    // Multipath is a singleton target: alone in its table.
    for t in [
        "0 8192 multipath 0 0 1 1 round-robin 0 1 0 p0\n8192 8 zero",
        "0 8 zero\n8 8192 multipath 0 0 1 1 round-robin 0 1 0 p0",
    ] {
        let err = reg.create("bad", t).err().expect(t).report();
        assert!(err.contains("must appear alone in table"), "{t}: {err}");
    }
    // A path device smaller than the target.
    reg.create("small", "0 100 zero").unwrap();
    let err = reg
        .create("bad", "0 8192 multipath 0 0 1 1 round-robin 0 1 0 small")
        .err()
        .expect("a too small path is refused")
        .report();
    assert!(err.contains("too small"), "{err}");
}

#[test]
fn messages_are_checked() {
    let reg = paths();
    reg.create("mp", "0 8192 multipath 0 0 1 1 round-robin 0 2 0 p0 p1")
        .unwrap();
    for (msg, want) in [
        (&["fail_path", "p2"][..], "not a path of this multipath"),
        (&["switch_group", "2"][..], "groups are numbered 1..=1"),
        (
            &["enable_group", "x"][..],
            "invalid priority group number 'x'",
        ),
        (&["fail_path"][..], "expects 2 argument(s), got 1"),
        (
            &["frobnicate", "1"][..],
            "unrecognised multipath message 'frobnicate'",
        ),
    ] {
        let err = reg.message("mp", 0, msg).unwrap_err().report();
        assert!(err.contains(want), "{msg:?}: {err}");
    }
    // Devices are named as the registry knows them, or MAJOR:MINOR.
    reg.message("mp", 0, &["fail_path", "/dev/mapper/p0"])
        .unwrap();
    reg.message("mp", 0, &["fail_path", "253:2"]).unwrap();
    assert!(status_args(&reg, "mp").contains("253:1 F 1 253:2 F 1"));
    reg.message("mp", 0, &["reinstate_path", "p1"]).unwrap();
    assert!(status_args(&reg, "mp").contains("253:2 A 1"));
}

#[test]
fn a_path_error_fails_the_path_and_the_io_is_retried_on_another() {
    let reg = paths();
    reg.create("bad0", "0 8192 error").unwrap();
    reg.create("mp", "0 8192 multipath 0 0 1 1 round-robin 0 2 0 bad0 p0")
        .unwrap();
    let mp = reg.device("mp").unwrap();
    for i in 0..8u64 {
        assert_eq!(write(&*mp, i * 4096, i as u8 + 1), Status::Ok);
    }
    let st = status_args(&reg, "mp");
    assert!(st.contains("253:4 F 1 253:1 A 0"), "{st}");
    // The failed attempt and the eight successes, per path.
    assert_eq!(
        reg.message("mp", 0, &["path_stats"]).unwrap(),
        "253:4 1 4096\n253:1 8 32768\n"
    );
    let m = reg.device("m").unwrap();
    for i in 0..8u64 {
        let (s, data) = read(&*m, i * 4096);
        assert_eq!(s, Status::Ok);
        assert!(data.iter().all(|&b| b == i as u8 + 1));
    }
    // A target error is not a path error: it is returned, the path stays.
    reg.create("p0ro", "0 8192 linear m 0").unwrap();
    reg.get("p0ro").unwrap().set_read_only(true);
    reg.create("mpro", "0 8192 multipath 0 0 1 1 round-robin 0 1 0 p0ro")
        .unwrap();
    let mpro = reg.device("mpro").unwrap();
    assert_eq!(write(&*mpro, 0, 9), Status::Permission);
    assert!(status_args(&reg, "mpro").contains("253:6 A 0"));
}

#[test]
fn groups_fail_over_in_priority_order() {
    let reg = paths();
    reg.create(
        "mp",
        "0 8192 multipath 0 0 3 1 round-robin 0 1 0 p0 round-robin 0 1 0 p1 round-robin 0 1 0 p2",
    )
    .unwrap();
    let mp = reg.device("mp").unwrap();
    let active_group = |reg: &Registry| -> usize {
        let st = status_args(reg, "mp");
        let words: Vec<&str> = st.split_whitespace().collect();
        let groups: Vec<&str> = words
            .iter()
            .copied()
            .filter(|w| ["A", "E", "D", "F"].contains(w))
            .collect();
        // Group state letters come first in each group, path letters after
        // the path device; the group letters are every other one here.
        groups
            .iter()
            .step_by(2)
            .position(|&w| w == "A")
            .map(|g| g + 1)
            .unwrap_or(0)
    };
    assert_eq!(write(&*mp, 0, 1), Status::Ok);
    assert_eq!(active_group(&reg), 1);
    reg.message("mp", 0, &["fail_path", "p0"]).unwrap();
    assert_eq!(write(&*mp, 0, 2), Status::Ok);
    assert_eq!(active_group(&reg), 2);
    // A group comes back: the current group stays until it has no path.
    reg.message("mp", 0, &["reinstate_path", "p0"]).unwrap();
    assert_eq!(write(&*mp, 0, 3), Status::Ok);
    assert_eq!(active_group(&reg), 2);
    // Disabling the current group moves I/O to the first enabled one.
    reg.message("mp", 0, &["disable_group", "2"]).unwrap();
    assert_eq!(write(&*mp, 0, 4), Status::Ok);
    assert_eq!(active_group(&reg), 1);
    // A disabled group is still used when nothing else is left.
    reg.message("mp", 0, &["fail_path", "p0"]).unwrap();
    reg.message("mp", 0, &["fail_path", "p2"]).unwrap();
    assert_eq!(write(&*mp, 0, 5), Status::Ok);
    let st = status_args(&reg, "mp");
    assert!(st.contains("D 0 1 0 253:2 A 0"), "{st}");
    // switch_group clears every bypass and takes effect at the next I/O.
    reg.message("mp", 0, &["reinstate_path", "p2"]).unwrap();
    reg.message("mp", 0, &["switch_group", "3"]).unwrap();
    assert_eq!(write(&*mp, 0, 6), Status::Ok);
    assert_eq!(active_group(&reg), 3);
    let (s, data) = read(&*reg.device("m").unwrap(), 0);
    assert_eq!(s, Status::Ok);
    assert!(data.iter().all(|&b| b == 6));
}

/// The owner of `n` requests, on the shared completion recorder: each
/// request's status, and how many times it completed.
struct Tracker {
    n: usize,
    rec: Arc<CompletionRecorder>,
}

impl Tracker {
    fn new(n: usize) -> Arc<Tracker> {
        Arc::new(Tracker {
            n,
            rec: CompletionRecorder::new(),
        })
    }

    fn submit(&self, dev: &dyn Device, op: Op, off: u64, buf: &mut [u8], id: usize) {
        // SAFETY: every caller waits for request `id` before touching or
        // dropping `buf`.
        let io = unsafe { IoBuf::from_slice(buf) };
        dev.submit(Bio::new(
            op,
            off,
            buf.len() as u64,
            io,
            self.rec.clone(),
            id as u64,
        ));
    }

    /// Request `id`'s status once it completed, `None` if it does not
    /// within `timeout`.
    fn wait(&self, id: usize, timeout: Duration) -> Option<Status> {
        let until = Instant::now() + timeout;
        loop {
            let seen = self.rec.count();
            let done = self.rec.completions();
            if let Some(c) = done.iter().find(|c| c.cookie == id as u64) {
                return Some(c.status);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            let _ = self.rec.try_wait(seen + 1, left);
        }
    }

    /// How many times each request completed.
    fn counts(&self) -> Vec<usize> {
        let mut v = vec![0; self.n];
        for c in self.rec.completions() {
            v[c.cookie as usize] += 1;
        }
        v
    }
}

#[test]
fn without_a_path_io_waits_with_queue_if_no_path_and_fails_without() {
    let reg = paths();
    reg.create(
        "mp",
        "0 8192 multipath 1 queue_if_no_path 0 1 1 round-robin 0 2 0 p0 p1",
    )
    .unwrap();
    let mp = reg.device("mp").unwrap();
    reg.message("mp", 0, &["fail_path", "p0"]).unwrap();
    reg.message("mp", 0, &["fail_path", "p1"]).unwrap();

    let t = Tracker::new(3);
    let mut b0 = vec![7u8; 4096];
    t.submit(&*mp, Op::Write, 0, &mut b0, 0);
    // Held, not failed.
    assert_eq!(t.wait(0, Duration::from_millis(50)), None);
    reg.message("mp", 0, &["reinstate_path", "p1"]).unwrap();
    assert_eq!(t.wait(0, Duration::from_secs(10)), Some(Status::Ok));
    assert_eq!(read(&*reg.device("m").unwrap(), 0).1, vec![7u8; 4096]);

    // fail_if_no_path ends what waits with EIO.
    reg.message("mp", 0, &["fail_path", "p1"]).unwrap();
    let mut b1 = vec![8u8; 4096];
    t.submit(&*mp, Op::Write, 4096, &mut b1, 1);
    assert_eq!(t.wait(1, Duration::from_millis(50)), None);
    reg.message("mp", 0, &["fail_if_no_path"]).unwrap();
    assert_eq!(t.wait(1, Duration::from_secs(10)), Some(Status::IoError));

    // Without queue_if_no_path: EIO at once, and the device recovers.
    assert_eq!(write(&*mp, 8192, 9), Status::IoError);
    reg.message("mp", 0, &["reinstate_path", "p0"]).unwrap();
    assert_eq!(write(&*mp, 8192, 9), Status::Ok);

    // Suspend ends waiting bios (it must drain), and resume restores
    // queue_if_no_path.
    reg.message("mp", 0, &["queue_if_no_path"]).unwrap();
    reg.message("mp", 0, &["fail_path", "p0"]).unwrap();
    let mut b2 = vec![1u8; 4096];
    t.submit(&*mp, Op::Write, 0, &mut b2, 2);
    assert_eq!(t.wait(2, Duration::from_millis(50)), None);
    reg.suspend("mp").unwrap();
    assert_eq!(t.wait(2, Duration::from_secs(10)), Some(Status::IoError));
    assert!(reg.message("mp", 0, &["reinstate_path", "p0"]).is_err());
    reg.resume("mp").unwrap();
    assert!(reg
        .table_text("mp")
        .unwrap()
        .contains(" 1 queue_if_no_path "));
    assert!(t.counts().iter().all(|&c| c == 1), "{:?}", t.counts());
}

#[test]
fn paths_fail_and_return_under_load_without_errors_or_lost_io() {
    const THREADS: usize = 4;
    const PER_THREAD: usize = 2000;
    const QD: usize = 4;
    let reg = paths();
    // p3 is a path whose table can be switched to `error`: real I/O errors.
    reg.create("p3", "0 8192 linear m 0").unwrap();
    reg.create(
        "mp",
        "0 8192 multipath 1 queue_if_no_path 0 2 1 queue-length 0 3 0 p0 p1 p3 round-robin 0 1 0 p2",
    )
    .unwrap();
    let mp = reg.device("mp").unwrap();
    let tracker = Tracker::new(THREADS * PER_THREAD);
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));

    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (mp, tracker, errors) = (mp.clone(), tracker.clone(), errors.clone());
            std::thread::spawn(move || {
                // Each thread owns 1 MiB: 256 blocks; block b holds (t, b, gen).
                let base = t as u64 * (1 << 20);
                let mut last_gen = vec![0u8; 256];
                let mut bufs: Vec<Vec<u8>> = (0..QD).map(|_| vec![0u8; 4096]).collect();
                let mut i = 0;
                while i < PER_THREAD {
                    let batch = QD.min(PER_THREAD - i);
                    let mut ids = Vec::new();
                    for (k, buf) in bufs.iter_mut().enumerate().take(batch) {
                        let id = t * PER_THREAD + i + k;
                        let block = (id * 7 + k * 13) % 256;
                        let off = base + block as u64 * 4096;
                        if (i + k) % 3 == 2 {
                            tracker.submit(&*mp, Op::Read, off, buf, id);
                            ids.push((id, block, None));
                        } else {
                            let gen = last_gen[block].wrapping_add(1).max(1);
                            last_gen[block] = gen;
                            buf.fill(gen);
                            buf[0] = t as u8;
                            buf[1] = block as u8;
                            tracker.submit(&*mp, Op::Write, off, buf, id);
                            ids.push((id, block, Some(gen)));
                        }
                    }
                    for (k, (id, block, wrote)) in ids.into_iter().enumerate() {
                        match tracker.wait(id, Duration::from_secs(30)) {
                            Some(Status::Ok) => {}
                            _ => {
                                errors.fetch_add(1, Ordering::SeqCst);
                                continue;
                            }
                        }
                        if wrote.is_none() && last_gen[block] != 0 {
                            let b = &bufs[k];
                            // Several I/Os of one batch may hit one block;
                            // a read sees its owner's header either way.
                            assert_eq!((b[0], b[1]), (t as u8, block as u8));
                            assert!(b[2..].iter().all(|&x| x == last_gen[block]));
                        }
                    }
                    i += batch;
                }
                last_gen
            })
        })
        .collect();

    let flipper = {
        let (reg, stop) = (reg.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut round = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let msg = |verb: &str, dev: &str| {
                    reg.message("mp", 0, &[verb, dev]).unwrap();
                };
                match round % 4 {
                    0 => {
                        // A real path error: p3 starts failing I/O.
                        reg.reload("p3", "0 8192 error").unwrap();
                        reg.resume("p3").unwrap();
                    }
                    1 => {
                        msg("fail_path", "p0");
                        msg("fail_path", "p1");
                        msg("fail_path", "p2");
                        msg("fail_path", "p3");
                        // Every path down: I/O waits.
                        std::thread::sleep(Duration::from_millis(3));
                        msg("reinstate_path", "p2");
                    }
                    2 => {
                        reg.reload("p3", "0 8192 linear m 0").unwrap();
                        reg.resume("p3").unwrap();
                        msg("reinstate_path", "p3");
                        msg("reinstate_path", "p0");
                    }
                    _ => msg("reinstate_path", "p1"),
                }
                round += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            round
        })
    };

    let gens: Vec<Vec<u8>> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    stop.store(true, Ordering::SeqCst);
    let rounds = flipper.join().unwrap();
    assert!(rounds >= 4, "the failure loop ran {rounds} rounds");
    assert_eq!(errors.load(Ordering::SeqCst), 0);
    for (id, c) in tracker.counts().into_iter().enumerate() {
        assert_eq!(c, 1, "request {id}");
    }
    // Everything written reads back through the memory device.
    let m = reg.device("m").unwrap();
    for (t, g) in gens.iter().enumerate() {
        for (block, &gen) in g.iter().enumerate() {
            if gen == 0 {
                continue;
            }
            let (s, data) = read(&*m, t as u64 * (1 << 20) + block as u64 * 4096);
            assert_eq!(s, Status::Ok);
            assert_eq!((data[0], data[1]), (t as u8, block as u8));
            assert!(
                data[2..].iter().all(|&b| b == gen),
                "thread {t} block {block}"
            );
        }
    }
    // Every path was failed at least once, by message or by I/O error.
    let st = status_args(&reg, "mp");
    let words: Vec<&str> = st.split_whitespace().collect();
    for dev in ["253:1", "253:2", "253:3", "253:4"] {
        let i = words.iter().position(|&w| w == dev).unwrap();
        let fails: u32 = words[i + 2].parse().unwrap();
        assert!(fails >= 1, "{dev} in {st}");
    }
}

/// HST's history after one I/O with base weight 0 is exactly the measured
/// service time: with `start_time ns` it is at most the I/O's duration,
/// with `start_time tick:1` it reaches back to the start of the second.
#[test]
fn hst_is_given_ns_or_jiffy_start_times_as_the_table_says() {
    use blkstack_core::clock::now_ns;
    let reg = paths();
    for (name, features) in [("ns", "0"), ("jf", "2 start_time tick:1")] {
        reg.create(
            name,
            &format!("0 8192 multipath {features} 0 1 1 historical-service-time 1 0 1 0 p0"),
        )
        .unwrap();
        let dev = reg.device(name).unwrap();
        let t0 = now_ns();
        assert_eq!(write(&*dev, 0, 1), Status::Ok);
        let t1 = now_ns();
        let st = status_args(&reg, name);
        let words: Vec<&str> = st.split_whitespace().collect();
        let i = words.iter().position(|&w| w == "253:1").unwrap();
        let hst_ns: u64 = words[i + 3].parse::<u64>().unwrap() >> 10;
        if name == "ns" {
            assert!(hst_ns <= t1 - t0, "{hst_ns} > {} ({st})", t1 - t0);
        } else {
            assert!(hst_ns >= t0 % 1_000_000_000, "{hst_ns} ({st})");
        }
    }
}
