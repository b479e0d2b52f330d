//! dm-multipath over two `nbd` leaves, one to a healthy `blkstack serve`
//! and one to a server that accepts, negotiates on every connection, and
//! then never answers (`blkstack_drivers::nbd::scripted`). The leaf must
//! give its requests up within its timeouts (per-attempt `timeout_ms`, a
//! bounded number of resends, `dead_timeout_ms` from the first failure)
//! so that multipath fails the path and retries on the healthy one: the
//! verify run completes with no error, as fio over dm-multipath does
//! when a SAN path hangs.

use blkstack_drivers::nbd::scripted::{self, Misbehaviour};
use blkstack_test_support::*;
use std::process::Command;
use std::time::{Duration, Instant};

const SECTORS: u64 = 65536;

#[test]
fn multipath_over_a_healthy_and_a_hung_nbd_leaf_verifies_cleanly() {
    let good = Serve::start_tcp(&format!("mem,,,rw,0 {SECTORS} memory"), "mem");
    let dir = Scratch::new("failover");
    let hung_sock = dir.path("hung.sock");
    scripted::spawn(&hung_sock, SECTORS * 512, Misbehaviour::NeverReply).expect("hung server");
    let leaf = "timeout_ms=500 dead_timeout_ms=3000 reconnect_delay_ms=20";
    let stack = format!(
        "good: 0 {SECTORS} nbd {} {leaf}\n\
         hung: 0 {SECTORS} nbd nbd+unix:///?socket={} {leaf}\n\
         mp: 0 {SECTORS} multipath 0 0 1 1 round-robin 0 2 1 good 1 hung 1\n",
        good.uri("mem"),
        hung_sock.display()
    );
    let stack_file = dir.path("mp.stack");
    std::fs::write(&stack_file, stack).expect("stack file");
    let t0 = Instant::now();
    let out = run(
        Command::new(env!("CARGO_BIN_EXE_blkstack"))
            .arg("bench")
            .arg("--stack")
            .arg(&stack_file)
            .args([
                "--name=failover",
                "--filename=mp",
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=8",
                "--size=4m",
                "--verify=crc32c",
                "--do_verify=1",
                "--output-format=json",
            ]),
        Duration::from_secs(90),
    );
    let took = t0.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "bench failed ({took:?}):\n{stdout}\n{stderr}"
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("bench JSON");
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0, "{job}");
    assert_eq!(job["verify_errors"], 0, "{job}");
    assert_eq!(job["verify_checked"], 1024, "{job}");
    assert!(
        took < Duration::from_secs(60),
        "the hung path held the run for {took:?}"
    );
    // The hung path was tried and given up by the leaf (its server
    // accepts and negotiates every reconnect, so only the leaf's failure
    // model can end those requests).
    assert!(
        stderr.contains("requests failed with EIO"),
        "the hung leaf never failed a request:\n{stderr}"
    );
}
