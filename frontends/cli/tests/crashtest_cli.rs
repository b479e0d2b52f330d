//! `blkstack crashtest` on its block workloads (in process, seconds): the
//! verify and journal workloads pass at every FLUSH/FUA point; the
//! planted ordering bug (a commit record without the flush before it) is
//! reported at the first commit, with its entry, in the summary and the
//! JSON report; bad logs, a missing mark and bad options are refused with
//! a clear error before anything is replayed or written.

use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_blkstack");

fn crashtest(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("crashtest")
        .args(args)
        .output()
        .expect("run blkstack crashtest")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn report(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).expect("the JSON report")).expect("JSON")
}

#[test]
fn verify_and_journal_pass_at_every_flush_and_fua_point() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path().join("v.json");
    let o = crashtest(&[
        "--workload",
        "verify",
        "--ops",
        "40",
        "--report",
        r.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("40 of 40 points checked"), "{}", text(&o));
    let j = report(&r);
    assert_eq!(j["points_checked"], 40);
    assert_eq!(j["failures"].as_array().map(Vec::len), Some(0));
    assert!(j["per_point_ms"]["overlay_reset"].as_f64().unwrap() > 0.0);

    let o = crashtest(&["--workload", "journal", "--ops", "24"]);
    assert!(o.status.success(), "{}", text(&o));
    // A flush and a FUA commit per transaction, and the last flush.
    assert!(text(&o).contains("49 of 49 points checked"), "{}", text(&o));
}

#[test]
fn the_planted_ordering_bug_is_found_at_the_first_commit() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path().join("p.json");
    let log = dir.path().join("planted.log");
    let o = crashtest(&[
        "--workload",
        "journal",
        "--plant-bug",
        "--ops",
        "16",
        "--keep-log",
        log.to_str().unwrap(),
        "--report",
        r.to_str().unwrap(),
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("FAIL point 1 at entry 0 (FUA)"), "{t}");
    assert!(
        t.contains("transaction 0 is committed but its data block 16 is not there"),
        "{t}"
    );
    assert!(t.contains("the first at log entry 0"), "{t}");
    let j = report(&r);
    assert_eq!(j["first_failure_entry"], 0);
    assert_eq!(j["planted"], true);
    assert_eq!(j["failures"][0]["flags"], "FUA");

    // The same log checked again (--log) fails the same way, and
    // stopping at the first failure checks one point.
    let o = crashtest(&[
        "--workload",
        "journal",
        "--ops",
        "16",
        "--log",
        log.to_str().unwrap(),
        "--stop-at-failure",
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("1 of 17 points checked"), "{}", text(&o));
    // At FLUSH points alone the bug cannot show: the one flush comes
    // after every data write. This is why FUA entries are crash points.
    let o = crashtest(&[
        "--workload",
        "journal",
        "--ops",
        "16",
        "--log",
        log.to_str().unwrap(),
        "--points",
        "flush",
    ]);
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn bad_logs_marks_and_options_are_refused_before_anything_changes() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path().join("r.json");
    let rs = r.to_str().unwrap();
    let junk = dir.path().join("junk");
    std::fs::write(&junk, vec![7u8; 8192]).unwrap();
    let o = crashtest(&[
        "--workload",
        "journal",
        "--log",
        junk.to_str().unwrap(),
        "--report",
        rs,
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("not a dm-log-writes log"), "{}", text(&o));
    assert!(!r.exists(), "a refused run wrote a report");

    let log = dir.path().join("ok.log");
    let o = crashtest(&[
        "--workload",
        "journal",
        "--ops",
        "8",
        "--keep-log",
        log.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let all = std::fs::read(&log).unwrap();
    let cut = dir.path().join("cut.log");
    // The log file is as long as its device; its entries fill ~190 KiB.
    std::fs::write(&cut, &all[..64 << 10]).unwrap();
    let o = crashtest(&["--workload", "journal", "--log", cut.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o).contains("truncated"), "{}", text(&o));

    let l = log.to_str().unwrap();
    for (args, want) in [
        (
            vec!["--log", l, "--start-mark", "nosuch"],
            "the log has no mark 'nosuch'",
        ),
        (vec!["--log", l, "--every", "0"], "--every 0"),
        (vec!["--log", l, "--points", "sometimes"], "sometimes"),
        (
            vec!["--plant-bug", "--workload", "verify"],
            "only the journal",
        ),
        (
            vec!["--log", l, "--workload", "verify"],
            "verify checks against",
        ),
        (
            vec!["--log", l, "--start-mark", "dm-log-writes-end"],
            "no crash point",
        ),
    ] {
        let mut a = args.clone();
        if !a.contains(&"--workload") {
            a.extend(["--workload", "journal"]);
        }
        a.extend(["--report", rs]);
        let o = crashtest(&a);
        assert!(!o.status.success(), "{args:?}");
        assert!(text(&o).contains(want), "{args:?}: {}", text(&o));
        assert!(!r.exists(), "{args:?} wrote a report");
    }
}

#[test]
fn reorder_and_torn_states_pass_where_the_order_is_right() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path().join("v.json");
    for wl in ["verify", "journal"] {
        let o = crashtest(&[
            "--workload",
            wl,
            "--ops",
            "12",
            "--reorder",
            "2",
            "--torn",
            "--report",
            r.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{wl}: {}", text(&o));
        let j = report(&r);
        // Every FLUSH point's epoch has writes to choose from.
        let states = j["states_checked"].as_u64().unwrap();
        assert!(states >= 12, "{wl}: {states} states\n{}", text(&o));
        assert!(
            text(&o).contains(&format!("and {states} reorder states")),
            "{}",
            text(&o)
        );
        assert_eq!(j["failures"].as_array().map(Vec::len), Some(0));
    }
}

/// Run a failure's printed rebuild command, as printed, in `dir` (with
/// this build's blkstack first on PATH); the image it made.
fn rebuild(cmd: &str, dir: &Path) -> Vec<u8> {
    let bin_dir = Path::new(BIN).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let o = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .current_dir(dir)
        .env("PATH", path)
        .output()
        .unwrap();
    assert!(o.status.success(), "{cmd}: {}", text(&o));
    std::fs::read(dir.join("state.img")).unwrap()
}

#[test]
fn reorder_finds_a_commit_in_its_datas_epoch_and_replay_log_rebuilds_the_state() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("same-epoch.log");
    let r = dir.path().join("r.json");
    let saved = dir.path().join("failing");
    // In order, every FLUSH point has each commit with its data.
    let o = crashtest(&[
        "--workload",
        "journal",
        "--plant-bug",
        "same-epoch",
        "--ops",
        "8",
        "--size-mib",
        "1",
        "--keep-log",
        log.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("9 of 9 points checked"), "{}", text(&o));
    // A state that keeps a commit without its data fails.
    let o = crashtest(&[
        "--workload",
        "journal",
        "--ops",
        "8",
        "--size-mib",
        "1",
        "--log",
        log.to_str().unwrap(),
        "--reorder",
        "4",
        "--torn",
        "--report",
        r.to_str().unwrap(),
        "--save-failing",
        saved.to_str().unwrap(),
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    let t = text(&o);
    let j = report(&r);
    let failures = j["failures"].as_array().unwrap();
    assert!(!failures.is_empty());
    assert!(
        failures.iter().all(|f| f["state"].is_object()),
        "an in-order point failed: {t}"
    );
    assert!(t.contains("is committed but its data block"), "{t}");
    assert!(t.contains("reorder state"), "{t}");
    // The first failing state of each mode, rebuilt by the printed
    // replay-log command, is byte for byte what the check read.
    for torn in [false, true] {
        let f = failures
            .iter()
            .find(|f| f["state"]["torn"] == torn)
            .unwrap_or_else(|| panic!("no failing state with torn={torn}: {t}"));
        let cmd = f["rebuild"].as_str().unwrap();
        let seed = f["state"]["seed"].as_u64().unwrap();
        assert!(t.contains(&format!("rebuild: {cmd}")), "{t}");
        assert!(cmd.contains(&format!("--reorder-seed {seed}")), "{cmd}");
        assert_eq!(cmd.contains("--torn"), torn, "{cmd}");
        let label = format!(
            "{}.{}{}",
            f["point"],
            if torn { 't' } else { 'r' },
            f["state"]["j"]
        );
        let checked = std::fs::read(saved.join(format!("state-{label}.img"))).unwrap();
        let work = tempfile::tempdir().unwrap();
        let img = rebuild(cmd, work.path());
        assert_eq!(img.len(), checked.len());
        assert!(img == checked, "state {label}: the rebuilt image differs");
    }
}

#[test]
fn reorder_options_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("ok.log");
    let o = crashtest(&[
        "--workload",
        "journal",
        "--ops",
        "4",
        "--keep-log",
        log.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let l = log.to_str().unwrap();
    for (args, want) in [
        (
            vec!["--reorder", "2", "--points", "marks"],
            "--points flush",
        ),
        (vec!["--reorder", "0", "--torn"], "--torn"),
        (vec!["--reorder", "70000"], "at most 65536 states"),
        (vec!["--plant-bug", "sometimes"], "sometimes"),
    ] {
        let mut a = vec!["--workload", "journal", "--log", l];
        a.extend(args.iter());
        let o = crashtest(&a);
        assert!(!o.status.success(), "{args:?}");
        assert!(text(&o).contains(want), "{args:?}: {}", text(&o));
    }
    let img = dir.path().join("img");
    std::fs::write(&img, vec![0u8; 16 << 20]).unwrap();
    for (args, want) in [
        (vec!["--torn"], "--reorder-seed"),
        (vec!["--reorder-seed", "1", "--find"], "--find"),
        (
            vec!["--reorder-seed", "1", "--end-sector", "8"],
            "--end-sector",
        ),
        (vec!["--reorder-seed", "x"], "x"),
    ] {
        let o = Command::new(BIN)
            .args(["replay-log", "--log", l, "--replay", img.to_str().unwrap()])
            .args(&args)
            .output()
            .unwrap();
        assert!(!o.status.success(), "{args:?}");
        assert!(text(&o).contains(want), "{args:?}: {}", text(&o));
        assert!(
            std::fs::read(&img).unwrap().iter().all(|&b| b == 0),
            "{args:?} changed the image"
        );
    }
}
