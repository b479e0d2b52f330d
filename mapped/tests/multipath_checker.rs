//! The multipath path checker as multipathd's users rely on it: failed
//! paths come back by themselves once their device answers, queued I/O
//! then completes with its data intact, an active path whose probe fails
//! is failed before user I/O meets it, a hanging probe times out once and
//! is never doubled, removing the device ends the checker thread, and
//! `no_path_retry N` gives up queueing after the intervals it counts.
//!
//! Path devices are linear lines over one memory device whose tables are
//! reloaded to `error` and back, or suspended to make a probe hang. Bounds
//! are generous (tens of intervals): the assertions are about what
//! happens, never about how fast.

use blkstack_core::sync::submit_and_wait;
use blkstack_core::testing::CompletionRecorder;
use blkstack_core::{Bio, Device, IoBuf, Op, Status};
use blkstack_mapped::Registry;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The tests count checker threads, so they run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Memory `m` (minor 0) and two linear paths over it, `pa` (253:1) and
/// `pb` (253:2).
fn paths() -> Arc<Registry> {
    let reg = Registry::new();
    reg.create_stack(
        "m: 0 8192 memory\n\
         pa: 0 8192 linear m 0\n\
         pb: 0 8192 linear m 0\n",
    )
    .unwrap();
    reg
}

/// [`paths`] and `mp`, a multipath with `features` over `pa` and `pb`.
fn with_mp(features: &str) -> Arc<Registry> {
    let reg = paths();
    reg.create(
        "mp",
        &format!("0 8192 multipath {features} 0 1 1 round-robin 0 2 0 pa pb"),
    )
    .unwrap();
    reg
}

/// Submit a write of `buf` at `off`, completing to `rec` with `cookie`.
fn submit_write(
    dev: &dyn Device,
    rec: &Arc<CompletionRecorder>,
    off: u64,
    buf: &mut [u8],
    cookie: u64,
) {
    // SAFETY: every caller waits for the completion while `buf` lives.
    let io = unsafe { IoBuf::from_slice(buf) };
    dev.submit(Bio::new(
        Op::Write,
        off,
        buf.len() as u64,
        io,
        rec.clone(),
        cookie,
    ));
}

/// Swap a path's table (reload + resume), as an admin repairing or
/// breaking a path would.
fn set_path(reg: &Registry, name: &str, table: &str) {
    reg.reload(name, table).unwrap();
    reg.resume(name).unwrap();
}

fn break_path(reg: &Registry, name: &str) {
    set_path(reg, name, "0 8192 error");
}

fn repair_path(reg: &Registry, name: &str) {
    set_path(reg, name, "0 8192 linear m 0");
}

/// `A` or `F` for path `dev` (`253:N`) in the multipath's status.
fn path_state(reg: &Registry, mp: &str, dev: &str) -> char {
    let st = reg.status_text(mp).unwrap();
    let words: Vec<&str> = st.split_whitespace().collect();
    let i = words
        .iter()
        .position(|w| *w == dev)
        .unwrap_or_else(|| panic!("{dev} not in status '{st}'"));
    words[i + 1].chars().next().unwrap()
}

/// Poll `cond` every 5 ms until it holds or `limit` passes.
fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + limit;
    while Instant::now() < until {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    cond()
}

/// `key value` pairs of one path's line in the `checker` answer.
fn checker_counter(reg: &Registry, mp: &str, dev: &str, key: &str) -> u64 {
    let rep = reg.message(mp, 0, &["checker"]).unwrap();
    let line = rep
        .lines()
        .find(|l| l.starts_with(&format!("{dev} ")))
        .unwrap_or_else(|| panic!("{dev} not in checker report '{rep}'"));
    let w: Vec<&str> = line.split_whitespace().collect();
    let i = w.iter().position(|x| *x == key).unwrap();
    w[i + 1].parse().unwrap()
}

/// Threads named like the checker's, in this process.
fn checker_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .filter(|c| c.trim_end() == "mpath-checker")
        .count()
}

/// The checker thread count reaches `n`. A new thread names itself once
/// running and an ended one leaves `/proc` just after its join, so both
/// are waited for (the count is exact once reached: the tests are serial).
fn assert_threads(n: usize) {
    assert!(
        wait_for(Duration::from_secs(10), || checker_threads() == n),
        "{} checker threads, want {n}",
        checker_threads()
    );
}

fn write(dev: &dyn Device, off: u64, byte: u8) -> Status {
    let mut buf = vec![byte; 4096];
    submit_and_wait(dev, Op::Write, off, 4096, &mut buf)
}

#[test]
fn a_path_failed_by_io_errors_is_reinstated_once_it_answers() {
    let _s = serial();
    // A checker so slow it only probes at start, while both paths are fine.
    let reg = with_mp("2 checker_interval 3600000");
    let mp = reg.device("mp").unwrap();
    assert!(wait_for(Duration::from_secs(10), || checker_counter(
        &reg, "mp", "253:1", "ok"
    ) == 1));
    break_path(&reg, "pa");
    for i in 0..4u64 {
        assert_eq!(write(&*mp, i * 4096, 1), Status::Ok);
    }
    assert_eq!(path_state(&reg, "mp", "253:1"), 'F');
    assert_eq!(
        checker_counter(&reg, "mp", "253:1", "fail"),
        0,
        "failed by I/O, not by a probe"
    );
    repair_path(&reg, "pa");
    // Now probe every 20 ms: the path comes back with no reinstate_path.
    reg.message("mp", 0, &["checker_interval", "20"]).unwrap();
    assert!(
        wait_for(Duration::from_secs(10), || path_state(&reg, "mp", "253:1")
            == 'A'),
        "{}",
        reg.message("mp", 0, &["checker"]).unwrap()
    );
    assert_eq!(checker_counter(&reg, "mp", "253:1", "reinstated"), 1);
    assert_eq!(checker_counter(&reg, "mp", "253:2", "reinstated"), 0);
    // The table now says what the message set, and parses back to it.
    let t = reg.table_text("mp").unwrap();
    assert!(t.contains(" 2 checker_interval 20 0 1 1 "), "{t}");
    reg.create("again", &t).unwrap();
    assert_eq!(reg.table_text("again").unwrap(), t);
}

#[test]
fn queued_writes_complete_intact_after_the_checker_reinstates_a_path() {
    let _s = serial();
    let reg = with_mp("3 queue_if_no_path checker_interval 20");
    let mp = reg.device("mp").unwrap();
    break_path(&reg, "pa");
    break_path(&reg, "pb");
    assert!(wait_for(Duration::from_secs(10), || {
        path_state(&reg, "mp", "253:1") == 'F' && path_state(&reg, "mp", "253:2") == 'F'
    }));
    const N: usize = 16;
    let rec = CompletionRecorder::new();
    let mut bufs: Vec<Vec<u8>> = (0..N).map(|i| vec![i as u8 + 1; 4096]).collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        submit_write(&*mp, &rec, i as u64 * 4096, b, i as u64);
    }
    // Held while no path answers.
    assert!(rec.try_wait(1, Duration::from_millis(100)).is_none());
    repair_path(&reg, "pb");
    let done = rec.wait(N, Duration::from_secs(10));
    assert_eq!(done.len(), N, "each write completes exactly once");
    assert!(done.iter().all(|c| c.status == Status::Ok), "{done:?}");
    assert_eq!(path_state(&reg, "mp", "253:2"), 'A');
    // Counted once the reinstatement (which released the queue) returns.
    assert!(wait_for(Duration::from_secs(10), || checker_counter(
        &reg,
        "mp",
        "253:2",
        "reinstated"
    ) == 1));
    let m = reg.device("m").unwrap();
    for i in 0..N {
        let mut back = vec![0u8; 4096];
        let s = submit_and_wait(&*m, Op::Read, i as u64 * 4096, 4096, &mut back);
        assert_eq!(s, Status::Ok);
        assert_eq!(back, vec![i as u8 + 1; 4096], "block {i}");
    }
}

#[test]
fn an_active_path_whose_probe_fails_is_failed_before_user_io() {
    let _s = serial();
    let reg = with_mp("2 checker_interval 20");
    break_path(&reg, "pa");
    assert!(wait_for(Duration::from_secs(10), || path_state(
        &reg, "mp", "253:1"
    ) == 'F'));
    // No user I/O has touched either path: the checker failed it.
    assert_eq!(
        reg.message("mp", 0, &["path_stats"])
            .unwrap()
            .lines()
            .map(|l| l.split_whitespace().nth(1).unwrap().to_string())
            .collect::<Vec<_>>(),
        ["0", "0"]
    );
    assert_eq!(checker_counter(&reg, "mp", "253:1", "failed"), 1);
    assert!(checker_counter(&reg, "mp", "253:1", "fail") >= 1);
    assert_eq!(checker_counter(&reg, "mp", "253:2", "fail"), 0);
    assert_eq!(path_state(&reg, "mp", "253:2"), 'A');
    // User I/O only ever meets the good path.
    let mp = reg.device("mp").unwrap();
    for i in 0..4u64 {
        assert_eq!(write(&*mp, i * 4096, 3), Status::Ok);
    }
    assert!(reg
        .status_text("mp")
        .unwrap()
        .contains("253:1 F 1 253:2 A 0"));
}

#[test]
fn a_hanging_probe_fails_the_path_after_the_timeout_and_is_not_doubled() {
    let _s = serial();
    let reg = with_mp("4 checker_interval 10 checker_timeout 50");
    assert!(wait_for(Duration::from_secs(10), || checker_counter(
        &reg, "mp", "253:1", "ok"
    ) >= 1));
    // A suspended device holds the probe bio: it neither answers nor fails.
    reg.suspend("pa").unwrap();
    assert!(wait_for(Duration::from_secs(10), || path_state(
        &reg, "mp", "253:1"
    ) == 'F'));
    let probes = checker_counter(&reg, "mp", "253:1", "probes");
    let fails = checker_counter(&reg, "mp", "253:1", "fail");
    assert_eq!(fails, 1, "one timeout, counted once");
    // Many intervals later the held probe is still the only one.
    let pb_before = checker_counter(&reg, "mp", "253:2", "probes");
    assert!(wait_for(Duration::from_secs(10), || checker_counter(
        &reg, "mp", "253:2", "probes"
    ) >= pb_before + 20));
    assert_eq!(checker_counter(&reg, "mp", "253:1", "probes"), probes);
    assert_eq!(checker_counter(&reg, "mp", "253:1", "fail"), 1);
    // Resumed, the late answer is ignored and the next probe reinstates.
    reg.resume("pa").unwrap();
    assert!(wait_for(Duration::from_secs(10), || path_state(
        &reg, "mp", "253:1"
    ) == 'A'));
    assert!(checker_counter(&reg, "mp", "253:1", "probes") > probes);
    assert_eq!(checker_counter(&reg, "mp", "253:1", "reinstated"), 1);
}

#[test]
fn removing_or_replacing_the_table_stops_its_checker_thread() {
    let _s = serial();
    let before = checker_threads();
    let reg = paths();
    let table = "0 8192 multipath 2 checker_interval 10 0 1 1 round-robin 0 2 0 pa pb";
    reg.create("mp", table).unwrap();
    assert_threads(before + 1);
    // Suspend stops it, resume starts it again.
    reg.suspend("mp").unwrap();
    assert_threads(before);
    reg.resume("mp").unwrap();
    assert_threads(before + 1);
    // The message stops and restarts it.
    reg.message("mp", 0, &["checker_interval", "0"]).unwrap();
    assert_threads(before);
    assert!(!reg.table_text("mp").unwrap().contains("checker_interval"));
    reg.message("mp", 0, &["checker_interval", "10"]).unwrap();
    assert_threads(before + 1);
    // A staged table's target starts one; clearing it drops the target.
    reg.reload("mp", table).unwrap();
    assert_threads(before + 2);
    reg.clear("mp").unwrap();
    assert_threads(before + 1);
    // Reload + resume: the old table's thread goes, the new one's stays.
    reg.reload("mp", table).unwrap();
    reg.resume("mp").unwrap();
    assert_threads(before + 1);
    // Held by a caller, the device outlives its removal; its checker not.
    let dev = reg.device("mp").unwrap();
    reg.remove("mp", false).unwrap();
    assert_threads(before);
    drop(dev);
    // No table with a checker: no thread at all.
    reg.create("plain", "0 8192 multipath 0 0 1 1 round-robin 0 2 0 pa pb")
        .unwrap();
    assert_threads(before);
}

#[test]
fn no_path_retry_fails_the_queue_after_its_intervals_and_queues_again() {
    let _s = serial();
    let reg = with_mp("4 checker_interval 20 no_path_retry 3");
    // no_path_retry N queues: the table says so.
    let t = reg.table_text("mp").unwrap();
    assert!(
        t.contains(" 5 queue_if_no_path checker_interval 20 no_path_retry 3 0 "),
        "{t}"
    );
    let mp = reg.device("mp").unwrap();
    break_path(&reg, "pa");
    break_path(&reg, "pb");
    let rec = CompletionRecorder::new();
    let mut buf = vec![5u8; 4096];
    submit_write(&*mp, &rec, 0, &mut buf, 0);
    // Failed after about 3 intervals; allow a hundred.
    let done = rec.wait(1, Duration::from_secs(10));
    assert_eq!(done[0].status, Status::IoError);
    assert!(!reg.table_text("mp").unwrap().contains("queue_if_no_path"));
    assert_eq!(write(&*mp, 4096, 6), Status::IoError, "no queueing now");
    // A path back: queueing is on again, as multipathd turns it back on.
    repair_path(&reg, "pa");
    assert!(wait_for(Duration::from_secs(10), || reg
        .table_text("mp")
        .unwrap()
        .contains(" queue_if_no_path ")));
    assert_eq!(write(&*mp, 4096, 6), Status::Ok);

    // `queue` never gives up.
    reg.create(
        "mq",
        "0 8192 multipath 4 checker_interval 10 no_path_retry queue 0 1 1 round-robin 0 1 0 pb",
    )
    .unwrap();
    // Its checker cannot be stopped while no_path_retry counts on it.
    let err = reg
        .message("mp", 0, &["checker_interval", "0"])
        .unwrap_err()
        .report();
    assert!(err.contains("no_path_retry 3"), "{err}");
    assert!(reg
        .table_text("mp")
        .unwrap()
        .contains("checker_interval 20"));
    let mq = reg.device("mq").unwrap();
    let rec = CompletionRecorder::new();
    let mut buf = vec![7u8; 4096];
    submit_write(&*mq, &rec, 0, &mut buf, 0);
    assert!(rec.try_wait(1, Duration::from_millis(300)).is_none());
    repair_path(&reg, "pb");
    assert_eq!(rec.wait(1, Duration::from_secs(10))[0].status, Status::Ok);
}

#[test]
fn checker_features_and_messages_are_checked() {
    let _s = serial();
    let reg = paths();
    let cases: &[(&str, &str)] = &[
        ("2 checker_interval 0", "checker_interval (milliseconds)"),
        ("2 checker_interval -5", "-5"),
        ("2 checker_interval 99999999999", "99999999999"),
        ("2 checker_interval 3600001", "3600001"),
        ("1 checker_interval", "needs a value"),
        ("2 checker_timeout x", "checker_timeout"),
        ("2 no_path_retry 3", "add 'checker_interval MS'"),
        ("2 no_path_retry sometimes", "sometimes"),
        (
            "3 queue_if_no_path no_path_retry fail",
            "contradict each other",
        ),
    ];
    for (features, want) in cases {
        let err = reg
            .create(
                "bad",
                &format!("0 8192 multipath {features} 0 1 1 round-robin 0 1 0 pa"),
            )
            .err()
            .unwrap_or_else(|| panic!("'{features}' was accepted"))
            .report();
        assert!(
            err.contains(want),
            "'{features}': got '{err}', want '{want}'"
        );
        assert!(reg.get("bad").is_none());
    }
    // Printed back so that they parse to the same table.
    for (features, shown) in [
        ("2 no_path_retry 0", "2 no_path_retry fail"),
        (
            "2 no_path_retry queue",
            "3 queue_if_no_path no_path_retry queue",
        ),
        (
            "6 checker_timeout 500 no_path_retry 2 checker_interval 100",
            "7 queue_if_no_path checker_interval 100 checker_timeout 500 no_path_retry 2",
        ),
    ] {
        let dev = format!("ok{}", features.len());
        reg.create(
            &dev,
            &format!("0 8192 multipath {features} 0 1 1 round-robin 0 1 0 pa"),
        )
        .unwrap();
        let t = reg.table_text(&dev).unwrap();
        assert!(
            t.starts_with(&format!("0 8192 multipath {shown} 0 1 1 ")),
            "{t}"
        );
        reg.create("copy", &t).unwrap();
        assert_eq!(reg.table_text("copy").unwrap(), t);
        reg.remove("copy", false).unwrap();
    }
    // Messages: bad values change nothing.
    reg.create(
        "mp",
        "0 8192 multipath 2 checker_interval 1000 0 1 1 round-robin 0 1 0 pa",
    )
    .unwrap();
    for bad in [
        &["checker_interval"][..],
        &["checker_interval", "x"],
        &["checker_interval", "-1"],
        &["checker_interval", "4000000"],
        &["checker", "now"],
    ] {
        assert!(reg.message("mp", 0, bad).is_err(), "{bad:?}");
    }
    let rep = reg.message("mp", 0, &["checker"]).unwrap();
    assert!(
        rep.starts_with("interval_ms 1000 timeout_ms 1000 no_path_retry none running 1\n"),
        "{rep}"
    );
    assert!(rep.contains("\n253:1 A probes "), "{rep}");
    // path_stats carries the counters once a checker ran.
    let ps = reg.message("mp", 0, &["path_stats"]).unwrap();
    assert_eq!(ps.split_whitespace().count(), 7, "{ps}");
}
