//! `blkstack replay-log` as xfstests' scripts run replay-log: a log made
//! by our log-writes target (in process, its log in an image file) is
//! replayed to a mark, found, counted and checked with a checker at every
//! flush; `--reorder-seed` (and `--torn`) applies exactly the crash state
//! its `-v` lines describe, the same for the same seed; bad logs and
//! options are refused with a clear error and change nothing.

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Op, Status};
use blkstack_mapped::Registry;
use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_blkstack");

fn replay_log(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("replay-log")
        .args(args)
        .output()
        .expect("run blkstack replay-log")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A log of: A at block 0, flush, mark one, B at 0 and C at 8 (4 KiB
/// each), flush, mark two, and the closing mark.
fn make_log(dir: &Path) -> std::path::PathBuf {
    let log = dir.join("log.img");
    let reg = Registry::new();
    reg.create("data", "0 4096 memory").unwrap();
    reg.create("log", &format!("0 4096 file {} create", log.display()))
        .unwrap();
    reg.create("lw", "0 4096 log-writes data log").unwrap();
    let lw = reg.device("lw").unwrap();
    let put = |off: u64, byte: u8| {
        let mut b = vec![byte; 4096];
        assert_eq!(
            submit_and_wait(&*lw, Op::Write, off, 4096, &mut b),
            Status::Ok
        );
    };
    put(0, b'A');
    assert_eq!(submit_and_wait(&*lw, Op::Flush, 0, 0, &mut []), Status::Ok);
    reg.message("lw", 0, &["mark", "one"]).unwrap();
    put(0, b'B');
    put(8 * 512, b'C');
    assert_eq!(submit_and_wait(&*lw, Op::Flush, 0, 0, &mut []), Status::Ok);
    reg.message("lw", 0, &["mark", "two"]).unwrap();
    drop(lw);
    reg.remove("lw", false).unwrap();
    reg.remove_all();
    log
}

#[test]
fn replays_to_marks_finds_counts_and_checks() {
    let dir = tempfile::tempdir().unwrap();
    let log = make_log(dir.path());
    let log_s = log.to_str().unwrap();
    let img = dir.path().join("replay.img");
    let img_s = img.to_str().unwrap();

    let o = replay_log(&["--log", log_s, "--num-entries"]);
    assert!(o.status.success(), "{}", text(&o));
    // A, flush, one, B, C, flush, two, end.
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "8");
    let o = replay_log(&["--log", log_s]);
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        "Log version=1, sectorsize=512, entries=8"
    );
    // Entry 6 is the mark two; its header is at block 1+9+1+1+9+9+1 = 31,
    // and find prints the block after it.
    let o = replay_log(&["--log", log_s, "--find", "--end-mark", "two"]);
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        "6@32",
        "{}",
        text(&o)
    );

    std::fs::write(&img, vec![0u8; 4096 * 512]).unwrap();
    let o = replay_log(&["--log", log_s, "--replay", img_s, "--end-mark", "one"]);
    assert!(o.status.success(), "{}", text(&o));
    let b = std::fs::read(&img).unwrap();
    assert!(b[..4096].iter().all(|&x| x == b'A') && b[4096] == 0);
    let o = replay_log(&[
        "--log",
        log_s,
        "--replay",
        img_s,
        "--start-mark",
        "one",
        "-v",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("replaying 3@13: sector 0, size 4096, flags 0x0(NONE)"),
        "{out}"
    );
    let b = std::fs::read(&img).unwrap();
    assert!(b[..4096].iter().all(|&x| x == b'B'));
    assert!(b[4096..8192].iter().all(|&x| x == b'C'));

    // A checker at every flush: it passes at the first (A) and fails at
    // the second (B), and replay stops there naming the entry.
    std::fs::write(&img, vec![0u8; 4096 * 512]).unwrap();
    let check = format!("head -c 1 {img_s} | grep -q A");
    let o = replay_log(&[
        "--log", log_s, "--replay", img_s, "--fsck", &check, "--check", "flush",
    ]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("fsck errored out on entry 5"),
        "{}",
        text(&o)
    );
}

#[test]
fn bad_logs_and_options_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let log = make_log(dir.path());
    let log_s = log.to_str().unwrap();
    let junk = dir.path().join("junk");
    std::fs::write(&junk, vec![7u8; 4096]).unwrap();
    let o = replay_log(&["--log", junk.to_str().unwrap(), "--num-entries"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("not a dm-log-writes log"), "{}", text(&o));

    let cut = dir.path().join("cut");
    let all = std::fs::read(&log).unwrap();
    std::fs::write(&cut, &all[..512 * 15]).unwrap();
    let img = dir.path().join("img");
    std::fs::write(&img, vec![0u8; 4096 * 512]).unwrap();
    let o = replay_log(&[
        "--log",
        cut.to_str().unwrap(),
        "--replay",
        img.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("truncated"), "{}", text(&o));

    let o = replay_log(&["--log", log_s, "--find", "--end-mark", "nosuch"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("couldn't find entry"), "{}", text(&o));
    let o = replay_log(&["--log", log_s, "--start-mark", "nosuch"]);
    assert!(
        text(&o).contains("couldn't find the starting mark 'nosuch'"),
        "{}",
        text(&o)
    );
    let o = replay_log(&["--log", log_s, "--fsck", "true"]);
    assert!(
        text(&o).contains("--fsck and --check go together"),
        "{}",
        text(&o)
    );
    let o = replay_log(&["--log", log_s, "--check", "0"]);
    assert!(!o.status.success(), "{}", text(&o));
    let o = replay_log(&["--log", log_s, "--start-entry", "99"]);
    assert!(
        text(&o).contains("invalid entry number 99: the log has 8"),
        "{}",
        text(&o)
    );
}

/// A crafted log entry: `(sector, nr_sectors, flags)`.
type RawEntry = (u64, u64, u64);

/// A log written byte by byte: the super block (`sectorsize`, the count of
/// `entries`), then each entry's header block and, for a write, its data.
fn crafted_log(dir: &Path, name: &str, sectorsize: u32, entries: &[RawEntry]) -> String {
    use blkstack_mapped::targets::log_writes::format::{LogEntry, LogSuper, LOG_DISCARD_FLAG};
    let bs = sectorsize as usize;
    let sup = LogSuper {
        nr_entries: entries.len() as u64,
        sectorsize,
    };
    let mut bytes = sup.encode(bs);
    for &(sector, nr_sectors, flags) in entries {
        let e = LogEntry {
            sector,
            nr_sectors,
            flags,
            data_len: 0,
        };
        bytes.extend(e.encode(&[], bs));
        if flags & LOG_DISCARD_FLAG == 0 {
            bytes.extend(std::iter::repeat_n(0xd5u8, nr_sectors as usize * bs));
        }
    }
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p.to_str().unwrap().to_string()
}

/// Logs that point anywhere: a sector whose byte offset wraps 64 bits,
/// writes and discards past the replay image's end (a file would grow to
/// wherever they point), a discard of 2^55 sectors, a block size of 2 GiB
/// in a small log. Each is refused, naming the entry or its bytes, the
/// image's size and bytes unchanged, and each error is said once.
#[test]
fn hostile_logs_are_refused_before_anything_lands() {
    use blkstack_mapped::targets::log_writes::format::LOG_DISCARD_FLAG;
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img");
    let img_s = img.to_str().unwrap();
    let size: u64 = 1 << 20;
    let cases: [(&str, Vec<RawEntry>, &str); 5] = [
        // 2^55 + 8 sectors of 512 bytes is 2^64 + 4096: byte 4096 if wrapped.
        ("wrap", vec![((1 << 55) + 8, 1, 0)], "do not fit in 64 bits"),
        ("far", vec![(1 << 30, 1, 0)], "past its end"),
        ("straddle", vec![(2047, 2, 0)], "past its end"),
        (
            "far-discard",
            vec![((1 << 40) / 512, (64 << 20) / 512, LOG_DISCARD_FLAG)],
            "past its end",
        ),
        (
            "huge-discard",
            vec![(0, (1 << 55) - 1, LOG_DISCARD_FLAG)],
            "past its end",
        ),
    ];
    for (name, entries, want) in cases {
        std::fs::write(&img, vec![0x11u8; size as usize]).unwrap();
        let log = crafted_log(dir.path(), name, 512, &entries);
        let o = replay_log(&["--log", &log, "--replay", img_s]);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(1), "{name}: {t}");
        assert!(t.contains(want), "{name}: {t}");
        assert_eq!(
            t.matches(want).count(),
            1,
            "{name}: said more than once: {t}"
        );
        let after = std::fs::read(&img).unwrap();
        assert_eq!(after.len() as u64, size, "{name}: the image changed size");
        assert!(after.iter().all(|&b| b == 0x11), "{name}: bytes landed");
    }
    // A block size of 2 GiB would be one 2 GiB read per entry header.
    let log = crafted_log(dir.path(), "bs2g", 512, &[(0, 1, 0)]);
    let mut raw = std::fs::read(&log).unwrap();
    raw[24..28].copy_from_slice(&(1u32 << 31).to_le_bytes());
    std::fs::write(&log, &raw).unwrap();
    let o = replay_log(&["--log", &log, "--replay", img_s]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("512..=65536"), "{}", text(&o));
    // 64 KiB is a block size the reader takes, but not in a 1 KiB log.
    raw[24..28].copy_from_slice(&(1u32 << 16).to_le_bytes());
    std::fs::write(&log, &raw).unwrap();
    let o = replay_log(&["--log", &log, "--num-entries"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("larger than the log itself"),
        "{}",
        text(&o)
    );
    // An error with a cause says each part once.
    let o = replay_log(&["--log", "/no/such/log", "--num-entries"]);
    let t = text(&o);
    assert_eq!(t.matches("No such file or directory").count(), 1, "{t}");
}

/// What `-v` says became of one epoch entry, and the block it wrote.
fn fate(out: &str, entry: u64) -> String {
    let head = format!("reorder {entry}@");
    let line = out
        .lines()
        .find(|l| l.starts_with(&head))
        .unwrap_or_else(|| panic!("no line for entry {entry}: {out}"));
    line.split_once("): ").unwrap().1.to_string()
}

/// How much of `b` (from the start) holds `byte`, the rest holding `old`.
fn prefix_of(b: &[u8], byte: u8, old: u8) -> usize {
    let n = b.iter().take_while(|&&x| x == byte).count();
    assert!(b[n..].iter().all(|&x| x == old), "a mix beyond a prefix");
    n
}

#[test]
fn reorder_seed_applies_the_state_it_prints() {
    let dir = tempfile::tempdir().unwrap();
    let log = make_log(dir.path());
    let log_s = log.to_str().unwrap();
    let img = dir.path().join("replay.img");
    let img_s = img.to_str().unwrap();
    let mut seen = std::collections::HashSet::new();
    for seed in 0..16u64 {
        for torn in [false, true] {
            std::fs::write(&img, vec![0u8; 4096 * 512]).unwrap();
            let s = seed.to_string();
            // Entry 1 is the first flush: its epoch is B (entry 3) and C
            // (entry 4); the flush at entry 5 ends it.
            let mut args = vec![
                "--log",
                log_s,
                "--replay",
                img_s,
                "--limit",
                "2",
                "--reorder-seed",
                &s,
                "-v",
            ];
            if torn {
                args.push("--torn");
            }
            let o = replay_log(&args);
            assert!(o.status.success(), "{}", text(&o));
            let out = String::from_utf8_lossy(&o.stdout).into_owned();
            assert!(
                !out.contains("reorder 5@"),
                "the next flush is no member: {out}"
            );
            let b = std::fs::read(&img).unwrap();
            let (fb, fc) = (fate(&out, 3), fate(&out, 4));
            for (f, block, byte, old) in [
                (&fb, &b[..4096], b'B', b'A'),
                (&fc, &b[4096..8192], b'C', 0),
            ] {
                let n = prefix_of(block, byte, old);
                match f.as_str() {
                    "kept" => assert_eq!(n, 4096, "{out}"),
                    "dropped" => assert_eq!(n, 0, "{out}"),
                    t => {
                        assert!(torn, "{out}");
                        let k: usize = t
                            .strip_prefix("torn: ")
                            .and_then(|r| r.strip_suffix(" of 8 blocks"))
                            .and_then(|k| k.parse().ok())
                            .unwrap_or_else(|| panic!("'{t}'"));
                        assert!((1..8).contains(&k) && n == k * 512, "{out}");
                    }
                }
            }
            if torn {
                assert!(fb.starts_with("torn") || fc.starts_with("torn"), "{out}");
            }
            seen.insert((torn, fb.clone(), fc.clone()));
            // The same seed again: the same image.
            let again = dir.path().join("again.img");
            std::fs::write(&again, vec![0u8; 4096 * 512]).unwrap();
            args[3] = again.to_str().unwrap();
            assert!(replay_log(&args).status.success());
            assert!(
                std::fs::read(&again).unwrap() == b,
                "seed {seed}: two images"
            );
        }
    }
    for pair in [
        ("kept", "kept"),
        ("kept", "dropped"),
        ("dropped", "kept"),
        ("dropped", "dropped"),
    ] {
        assert!(
            seen.contains(&(false, pair.0.to_string(), pair.1.to_string())),
            "16 seeds never made {pair:?}: {seen:?}"
        );
    }
}
