//! The `throttle` target as a table user sees it: the table round-trips in
//! its normalised form, bad tables and messages are refused naming the
//! word and change nothing, held requests keep their order within a
//! direction while the other direction and flushes pass, a full queue
//! makes the submitter wait (never fail), `set` releases held requests,
//! and suspend sends on everything held. The rates themselves are the
//! bucket unit tests' (injected clock) and the fio tests' business: here
//! the limits are so low (1 byte a second) that nothing is timed.

use blkstack_core::testing::CompletionRecorder as Recorder;
use blkstack_core::{AlignedBuf, Bio, DeviceRef, IoBuf, Op, Status};
use blkstack_mapped::targets::throttle::MAX_HELD;
use blkstack_mapped::Registry;
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(20);

fn setup(table: &str) -> (Arc<Registry>, DeviceRef) {
    let reg = Registry::new();
    reg.create("z", "0 8192 zero").unwrap();
    reg.create("t", table).unwrap();
    let dev = reg.device("t").unwrap();
    (reg, dev)
}

/// A 4 KiB bio of `op` at block `i % 8`, its data in `mem`, cookie `i`.
fn bio(op: Op, i: u64, mem: &AlignedBuf, rec: &Arc<Recorder>) -> Bio {
    let blk = (i % 8) as usize;
    let (buf, off, len) = match op {
        // SAFETY: every test waits for all its bios before `mem` goes;
        // writes only read the buffer, and reads of one block at a time
        // are not compared.
        Op::Read | Op::Write => (
            unsafe { mem.io_buf(blk * 4096, 4096) },
            blk as u64 * 4096,
            4096,
        ),
        Op::Flush => (IoBuf::empty(), 0, 0),
        _ => (IoBuf::empty(), blk as u64 * 4096, 4096),
    };
    Bio::new(op, off, len, buf, rec.clone(), i)
}

fn status(reg: &Registry) -> String {
    reg.status_text("t").unwrap()
}

#[test]
fn the_table_round_trips_normalised() {
    let (reg, _) = setup("0 8192 throttle z 7 riops 500 wbps 8192K wbps_burst 1G 3");
    let text = reg.table_text("t").unwrap();
    assert_eq!(
        text,
        "0 8192 throttle 253:0 7 riops 500 wbps 8M wbps_burst 1G 3\n"
    );
    reg.create("t2", text.trim_end()).unwrap();
    assert_eq!(reg.table_text("t2").unwrap(), text);
    assert_eq!(
        status(&reg),
        "0 8192 throttle 7 riops 500 wbps 8M wbps_burst 1G 3 0 0 0 0 0\n"
    );
    reg.create("t3", "0 8192 throttle z").unwrap();
    assert_eq!(reg.table_text("t3").unwrap(), "0 8192 throttle 253:0 0\n");
    reg.create("t4", "0 8192 throttle z 2 riops 0").unwrap();
    assert_eq!(reg.table_text("t4").unwrap(), "0 8192 throttle 253:0 0\n");
}

#[test]
fn bad_tables_are_refused_naming_the_word() {
    let reg = Registry::new();
    reg.create("z", "0 8192 zero").unwrap();
    let cases: &[(&str, &str)] = &[
        ("0 8192 throttle", "missing device"),
        ("0 8192 throttle nosuch", "'nosuch' not found"),
        ("0 8192 throttle z x", "invalid argument count 'x'"),
        ("0 8192 throttle z 3 riops 5", "argument count 3 but 2"),
        ("0 8192 throttle z 1 riops 5", "argument count 1 but 2"),
        (
            "0 8192 throttle z 2 riops many",
            "invalid value 'many' for riops",
        ),
        ("0 8192 throttle z 2 wbps 8Q", "invalid size '8Q' for wbps"),
        ("0 8192 throttle z 2 speed 5", "unknown key 'speed'"),
        (
            "0 8192 throttle z 4 iops 5 wiops 5",
            "iops cannot be given with riops or wiops",
        ),
        (
            "0 8192 throttle z 3 riops_burst 9 2",
            "riops_burst needs riops",
        ),
        (
            "0 8192 throttle z 5 riops 9 riops_burst 5 2",
            "lower than riops",
        ),
        (
            "0 8192 throttle z 5 riops 9 riops_burst 10 0",
            "length cannot be 0",
        ),
        ("0 16384 throttle z 0", "too small"),
    ];
    for (table, want) in cases {
        let e = reg.create("t", table).err().expect(table).report();
        assert!(e.contains(want), "{table}: '{e}' lacks '{want}'");
        assert!(reg.get("t").is_none());
    }
    // A failed reload leaves the old table live.
    reg.create("t", "0 8192 throttle z 2 riops 100").unwrap();
    assert!(reg.reload("t", "0 8192 throttle z 2 riops x").is_err());
    assert_eq!(
        reg.table_text("t").unwrap(),
        "0 8192 throttle 253:0 2 riops 100\n"
    );
}

#[test]
fn held_writes_keep_their_order_while_reads_and_flushes_pass() {
    // One byte a second: the first write empties nothing, every later
    // one waits for hours.
    let (reg, dev) = setup("0 8192 throttle z 2 wbps 1");
    let mem = AlignedBuf::new(8 * 4096);
    let rec = Recorder::new();
    for i in 0..5 {
        dev.submit(bio(Op::Write, i, &mem, &rec));
    }
    assert_eq!(rec.wait(1, T)[0].cookie, 0, "the first write goes at once");
    dev.submit(bio(Op::Read, 100, &mem, &rec));
    dev.submit(bio(Op::Flush, 101, &mem, &rec));
    let done = rec.wait(3, T);
    let mut got: Vec<u64> = done.iter().map(|c| c.cookie).collect();
    got.sort_unstable();
    assert_eq!(got, [0, 100, 101], "a read and a flush pass held writes");
    let st = status(&reg);
    assert!(
        st.starts_with("0 8192 throttle 2 wbps 1 4 16384 4 16384 "),
        "{st}"
    );
    throttled_ms(&st);
    // A discard is a write: it waits behind them.
    dev.submit(bio(Op::Discard, 5, &mem, &rec));
    assert!(status(&reg).contains(" wbps 1 5 20480 5 20480 "));
    reg.message("t", 0, &["set", "wbps", "0"]).unwrap();
    let done = rec.wait(8, T);
    let writes: Vec<u64> = done.iter().map(|c| c.cookie).filter(|&c| c < 100).collect();
    assert_eq!(writes, [0, 1, 2, 3, 4, 5], "FIFO within a direction");
    assert!(done.iter().all(|c| c.status == Status::Ok), "never failed");
    assert!(status(&reg).starts_with("0 8192 throttle 0 0 0 5 20480 "));
}

fn throttled_ms(status: &str) -> u64 {
    status
        .split_whitespace()
        .last()
        .and_then(|w| w.parse().ok())
        .expect("a throttled_ms word")
}

#[test]
fn a_bad_message_changes_nothing() {
    let (reg, _) = setup("0 8192 throttle z 5 riops 500 riops_burst 1000 2");
    let before = reg.table_text("t").unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["set", "speed", "1"], "unknown key 'speed'"),
        (&["set", "riops", "x"], "invalid value 'x' for riops"),
        (
            &["set", "riops", "2000"],
            "riops_burst 1000 is lower than riops 2000",
        ),
        (&["set", "iops", "5"], "iops cannot be given with riops"),
        (&["set", "riops"], "riops takes 1 value(s), got 0"),
        (
            &["set", "riops_burst", "5000"],
            "riops_burst takes 2 value(s)",
        ),
        (&["frob"], "unknown message 'frob'"),
    ];
    for (msg, want) in cases {
        let e = reg.message("t", 0, msg).expect_err("refused").report();
        assert!(e.contains(want), "{msg:?}: '{e}' lacks '{want}'");
        assert_eq!(reg.table_text("t").unwrap(), before);
    }
    reg.message("t", 0, &["set", "riops_burst", "4000", "3"])
        .unwrap();
    reg.message("t", 0, &["set", "wbps", "4M"]).unwrap();
    assert_eq!(
        reg.table_text("t").unwrap(),
        "0 8192 throttle 253:0 7 riops 500 riops_burst 4000 3 wbps 4M\n"
    );
}

#[test]
fn suspend_sends_on_what_is_held_and_resume_throttles_again() {
    let (reg, dev) = setup("0 8192 throttle z 2 rbps 1");
    let mem = AlignedBuf::new(8 * 4096);
    let rec = Recorder::new();
    for i in 0..4 {
        dev.submit(bio(Op::Read, i, &mem, &rec));
    }
    rec.wait(1, T);
    assert!(status(&reg).contains(" rbps 1 3 12288 "));
    reg.suspend("t").unwrap();
    let done = rec.wait(4, T);
    assert!(done.iter().all(|c| c.status == Status::Ok));
    assert!(status(&reg).contains(" rbps 1 0 0 3 12288 "));
    reg.resume("t").unwrap();
    dev.submit(bio(Op::Read, 4, &mem, &rec));
    assert!(status(&reg).contains(" rbps 1 1 4096 4 16384 "));
    // Removing the device (which suspends it) sends it on too.
    reg.remove("t", false).unwrap();
    rec.wait(5, T);
}

#[test]
fn a_full_queue_makes_the_submitter_wait_and_never_fails() {
    let (reg, dev) = setup("0 8192 throttle z 2 wbps 1");
    let mem = Arc::new(AlignedBuf::new(8 * 4096));
    let rec = Recorder::new();
    let n = MAX_HELD as u64 + 3;
    let submitter = {
        let (dev, mem, rec) = (dev.clone(), mem.clone(), rec.clone());
        std::thread::spawn(move || {
            for i in 0..n {
                dev.submit(bio(Op::Write, i, &mem, &rec));
            }
        })
    };
    // One went down, MAX_HELD are held, the submitter waits with the
    // next one: it cannot finish while the limit stands.
    let held = format!(" wbps 1 {MAX_HELD} ");
    let t0 = std::time::Instant::now();
    while !status(&reg).contains(&held) {
        assert!(t0.elapsed() < T, "never filled: {}", status(&reg));
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !submitter.is_finished(),
        "the submitter went past a full queue"
    );
    assert!(status(&reg).contains(&held), "no more than MAX_HELD held");
    assert_eq!(rec.count(), 1);
    reg.message("t", 0, &["set", "wbps", "0"]).unwrap();
    submitter.join().unwrap();
    let done = rec.wait(n as usize, T);
    assert!(done.iter().all(|c| c.status == Status::Ok));
    let order: Vec<u64> = done.iter().map(|c| c.cookie).collect();
    assert_eq!(order, (0..n).collect::<Vec<_>>(), "in order");
}

/// The fuzz seeds for throttle lines are tables that build (so the
/// fuzzer starts from the constructor's inside, not its first refusal),
/// and their `table` text builds the same target again.
#[test]
fn the_fuzz_seeds_build_and_round_trip() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/table");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).expect("fuzz/corpus/table") {
        let p = e.expect("entry").path();
        if !p
            .file_name()
            .is_some_and(|f| f.to_string_lossy().starts_with("throttle"))
        {
            continue;
        }
        let text = std::fs::read_to_string(&p).expect("seed");
        let reg = Registry::new();
        reg.create("base", "0 16384 memory").unwrap();
        reg.create("slow", "0 8192 zero").unwrap();
        reg.create("fz", text.trim_end())
            .unwrap_or_else(|e| panic!("{}: {}", p.display(), e.report()));
        let printed = reg.table_text("fz").unwrap();
        reg.create("again", printed.trim_end()).unwrap();
        assert_eq!(reg.table_text("again").unwrap(), printed);
        n += 1;
    }
    assert!(n >= 3, "{n} throttle seeds");
}
