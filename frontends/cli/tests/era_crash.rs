//! The era target through `blkstack serve`, with real NBD clients:
//! qemu-io writes blocks, `blkstack message` checkpoints and takes a
//! metadata snapshot, and thin-provisioning-tools' `era_invalidate
//! --written-since N` lists exactly the blocks written since era N; and
//! `kill -9` of the server mid-workload (blkstack's own NBD client
//! writing, as thin_crash.rs does) leaves metadata `era_check` passes
//! in which every write that completed before the kill is marked, since
//! a mark is committed before its write is issued. Rounds come from
//! `BLKSTACK_ERA_CRASH_ROUNDS` (default 3).

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Op, Status};
use blkstack_mapped::Registry;
use blkstack_test_support::*;
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const SECTORS: u64 = 32768;
/// The era block, 128 sectors.
const BLOCK: u64 = 65536;

fn stack(dir: &Path) -> String {
    format!(
        "meta,,,rw,0 8192 file {m} create;data,,,rw,0 {SECTORS} file {d} create;\
         era,,,rw,0 {SECTORS} era meta data 128",
        m = dir.join("meta").display(),
        d = dir.join("data").display()
    )
}

/// The current era from `blkstack status era`.
fn era_of(srv: &Serve) -> u64 {
    let s = srv.ok("status", &["era"]);
    let w: Vec<&str> = s.split_whitespace().collect();
    assert_eq!(&w[..4], ["0", &SECTORS.to_string(), "era", "8"], "{s}");
    w[5].parse().unwrap_or_else(|_| panic!("era in {s}"))
}

fn qemu_write(srv: &Serve, blocks: &[u64]) {
    let mut c = Command::new(tool("qemu-io"));
    c.args(["-f", "raw"]);
    for b in blocks {
        c.args([
            "-c",
            &format!("write -P {} {} 4k", b % 250 + 1, b * BLOCK + 8192),
        ]);
    }
    c.arg(srv.uri("era"));
    let o = run_bounded(&mut c, None, Duration::from_secs(60), "qemu-io");
    assert!(
        o.status.success() && !o.stdout.contains("failed"),
        "qemu-io: {}{}",
        o.stdout,
        o.stderr
    );
}

#[test]
fn era_invalidate_lists_what_an_nbd_client_wrote_since_each_era() {
    let dir = tempfile::tempdir().unwrap();
    let meta = dir.path().join("meta");
    let srv = Serve::start(&stack(dir.path()), "era");
    assert_eq!(era_of(&srv), 1);
    qemu_write(&srv, &[0, 3]);
    srv.ok("message", &["era", "0", "checkpoint"]);
    qemu_write(&srv, &[3, 10, 255]);
    srv.ok("message", &["era", "0", "checkpoint"]);
    qemu_write(&srv, &[42]);
    srv.ok("message", &["era", "0", "take_metadata_snap"]);
    assert_eq!(era_of(&srv), 4);
    assert_eq!(
        era_written_since(&meta, 1),
        BTreeSet::from([0, 3, 10, 42, 255])
    );
    assert_eq!(
        era_written_since(&meta, 2),
        BTreeSet::from([3, 10, 42, 255])
    );
    assert_eq!(era_written_since(&meta, 3), BTreeSet::from([42]));
    pdata_tool_ok("era_check", &[], &meta);
    let e = srv.fails("message", &["era", "0", "take_metadata_snap"]);
    assert!(e.contains("already exists"), "{e}");
    srv.ok("message", &["era", "0", "drop_metadata_snap"]);
    drop(srv);
    pdata_tool_ok("era_check", &[], &meta);
}

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

#[test]
fn kill_9_mid_workload_leaves_metadata_that_checks_and_marks_every_completed_write() {
    let rounds: usize = std::env::var("BLKSTACK_ERA_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let dir = tempfile::tempdir().unwrap();
    let meta = dir.path().join("meta");
    let stack = stack(dir.path());
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..rounds {
        let srv = Serve::start(&stack, "era");
        let era = era_of(&srv);
        let reg = Registry::new();
        reg.create(
            "remote",
            &format!(
                "0 {SECTORS} nbd {} dead_timeout_ms=500 reconnect_delay_ms=50",
                srv.uri("era")
            ),
        )
        .expect("connect to the era export");
        let dev = reg.device("remote").unwrap();
        let pid = srv.pid();
        let run_for = Duration::from_millis(200 + next(&mut seed) % 600);
        let killer = std::thread::spawn(move || {
            std::thread::sleep(run_for);
            Command::new("kill").args(["-9", &pid.to_string()]).status()
        });
        let mut done = BTreeSet::new();
        let stop_at = Instant::now() + Duration::from_secs(30);
        let mut buf = vec![0x5au8; 4096];
        while Instant::now() < stop_at {
            let b = next(&mut seed) % (SECTORS * 512 / BLOCK);
            let st = submit_and_wait(&*dev, Op::Write, b * BLOCK, 4096, &mut buf);
            if st != Status::Ok {
                break;
            }
            done.insert(b);
        }
        assert!(killer.join().unwrap().unwrap().success(), "kill -9");
        drop(dev);
        reg.remove_all();
        drop(srv);
        pdata_tool_ok("era_check", &[], &meta);

        let srv = Serve::start(&stack, "era");
        srv.ok("message", &["era", "0", "take_metadata_snap"]);
        let marked = era_written_since(&meta, era);
        let missing: Vec<&u64> = done.difference(&marked).collect();
        assert!(
            missing.is_empty(),
            "round {round}: completed writes not marked since era {era}: {missing:?}"
        );
        srv.ok("message", &["era", "0", "drop_metadata_snap"]);
        drop(srv);
        pdata_tool_ok("era_check", &[], &meta);
        println!(
            "round {round}: {} blocks written from era {era}, all marked",
            done.len()
        );
    }
}
