//! `blkstack crashtest` over real filesystems in the kernel VM: ext4 and
//! xfs made and used by the guest's kernel on our log-writes device, then
//! every FLUSH/FUA point replayed into the snapshot overlay, mounted
//! (journal recovery by the kernel) and checked with `e2fsck -fn` /
//! `xfs_repair -n` in the guest. With `--reorder N --torn`, the host also
//! hands the guest crash states of each flush epoch (a subset of its
//! writes, one torn), checked the same way. Short runs here; `make
//! crashtest` runs the long ones (at least 100 points each, and reorder
//! runs, `--ignored`). A state from before mkfs ended must fail, so the
//! check is shown to bite.

mod kernel_vm_support;

use kernel_vm_support::{script, vm_available};
use std::process::{Command, Output};
use std::sync::Mutex;

const BIN: &str = env!("CARGO_BIN_EXE_blkstack");

/// One guest at a time: TCG guests share the machine's CPUs.
static ONE_VM: Mutex<()> = Mutex::new(());

fn crashtest(args: &[&str]) -> (Output, serde_json::Value) {
    let _one = ONE_VM.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let o = Command::new(BIN)
        .arg("crashtest")
        .args(args)
        .arg("--vm-script")
        .arg(script())
        .arg("--report")
        .arg(&report)
        .output()
        .expect("run blkstack crashtest");
    println!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let j = std::fs::read(&report)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(serde_json::Value::Null);
    (o, j)
}

/// `reorder`: the `--reorder` count (with `--torn`) and how many such
/// states the run must check at least.
fn passes(fs: &str, ops: &str, min_points: u64, reorder: Option<(&str, u64)>) {
    if !vm_available() {
        return;
    }
    let mut args = vec!["--workload", fs, "--ops", ops, "--vm-timeout", "3000"];
    if let Some((n, _)) = reorder {
        args.extend(["--reorder", n, "--torn"]);
    }
    let (o, j) = crashtest(&args);
    assert!(o.status.success(), "{fs}: crashtest failed");
    let checked = j["points_checked"].as_u64().unwrap_or(0);
    assert!(checked >= min_points, "{fs}: only {checked} points");
    assert_eq!(j["points_planned"].as_u64(), Some(checked));
    assert_eq!(j["failures"].as_array().map(Vec::len), Some(0));
    let states = j["states_checked"].as_u64().unwrap_or(0);
    match reorder {
        Some((_, min)) => assert!(states >= min, "{fs}: only {states} reorder states"),
        None => assert_eq!(states, 0),
    }
}

#[test]
fn ext4_is_clean_at_every_flush_point_and_reorder_state() {
    passes("ext4", "2", 6, Some(("1", 3)));
}

#[test]
fn xfs_is_clean_at_every_flush_point() {
    passes("xfs", "1", 4, None);
}

#[test]
fn a_state_before_mkfs_ended_fails_its_check() {
    if !vm_available() {
        return;
    }
    let (o, j) = crashtest(&[
        "--workload",
        "ext4",
        "--ops",
        "1",
        "--from-start",
        "--points",
        "every:1",
        "--max-points",
        "3",
        "--stop-at-failure",
    ]);
    assert!(!o.status.success());
    assert_eq!(j["points_planned"], 3);
    assert_eq!(j["points_checked"], 1, "{j}");
    assert_eq!(j["failures"].as_array().map(Vec::len), Some(1), "{j}");
    assert_eq!(j["first_failure_entry"], 0);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("FAIL point 1 at entry 0"), "{out}");
}

/// `make crashtest`: at least 100 flush points of ext4.
#[test]
#[ignore]
fn ext4_long() {
    passes("ext4", "45", 100, None);
}

/// `make crashtest`: at least 100 flush points of xfs.
#[test]
#[ignore]
fn xfs_long() {
    passes("xfs", "50", 100, None);
}

/// `make crashtest`: ext4 with reorder and torn states at every flush
/// point.
#[test]
#[ignore]
fn ext4_reorder_long() {
    passes("ext4", "20", 40, Some(("3", 40)));
}

/// `make crashtest`: xfs with reorder and torn states at every flush
/// point.
#[test]
#[ignore]
fn xfs_reorder_long() {
    passes("xfs", "10", 20, Some(("2", 20)));
}
