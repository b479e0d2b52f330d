//! End to end: the real fio (nbd engine, with verify) runs against
//! `blkstack serve` while the control verbs change the stack under it.
//!
//! - A delay device is suspended, reloaded from 10 ms to 1 ms and resumed
//!   in the middle of a verified write run: fio sees no error, verify
//!   passes, the I/O issued during the suspend was held (its latency
//!   spans the suspension) rather than failed, and fio's mean completion
//!   latency before and after the reload shows the new table is live.
//! - A multipath device with `queue_if_no_path` has its paths failed and
//!   reinstated by `message` while fio runs: no error, verify passes.
//!
//! Every process is bounded in time (see blkstack-test-support). The latency
//! comparison is a 5x difference in configured delay checked with a 2x
//! margin: it tests which table serves I/O, not how fast the machine is.

use blkstack_test_support::*;
use serde_json::Value;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const FIO_DEADLINE: Duration = Duration::from_secs(180);

/// One fio job over NBD, JSON written to `out`.
fn fio(uri: &str, out: &Path, args: &[&str]) -> Command {
    let mut c = Command::new("fio");
    c.arg("--name=job")
        .arg("--ioengine=nbd")
        .arg(format!("--uri={uri}"))
        .arg("--output-format=json")
        // No verify state file left in the working directory.
        .arg("--verify_state_save=0")
        .arg(format!("--output={}", out.display()))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

fn spawn_fio(uri: &str, out: &Path, args: &[&str]) -> Child {
    fio(uri, out, args).spawn().expect("spawn fio (installed?)")
}

/// Finish a fio run; its job's JSON, after checking it succeeded.
fn finish_fio(mut child: Child, out: &Path, what: &str) -> Value {
    let st = wait_bounded(&mut child, FIO_DEADLINE, what);
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        std::io::Read::read_to_string(&mut e, &mut err).ok();
    }
    assert!(st.success(), "{what}: fio failed ({st}): {err}");
    let text = std::fs::read_to_string(out).expect("fio json");
    // fio may print notes before the JSON object.
    let start = text.find('{').expect("json in fio output");
    let v: Value = serde_json::from_str(&text[start..]).expect("fio json parses");
    let job = v["jobs"][0].clone();
    assert_eq!(job["error"], 0, "{what}: fio job error: {job}");
    job
}

fn clat_ms(job: &Value, dir: &str, stat: &str) -> f64 {
    job[dir]["clat_ns"][stat].as_f64().unwrap_or(0.0) / 1e6
}

/// Wait until `cond` holds, polling; false after `limit`.
fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// The memory target reports how much has been written to it.
fn allocated_bytes(srv: &Serve, mem: &str) -> u64 {
    let s = srv.ok("status", &[mem]);
    s.split_whitespace()
        .find_map(|w| w.strip_prefix("allocated_bytes="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[test]
fn delay_reload_under_fio_verify() {
    // 8 MiB of RAM behind a 10 ms delay.
    let srv = Serve::start(
        "mem,,,rw,0 16384 memory;d0,,,rw,0 16384 delay mem 0 10",
        "d0",
    );
    let uri = srv.uri("d0");
    let read_probe = [
        "--rw=randread",
        "--bs=4k",
        "--iodepth=1",
        "--time_based",
        "--runtime=1",
    ];

    let out = srv.dir.join("before.json");
    let before = finish_fio(spawn_fio(&uri, &out, &read_probe), &out, "fio before");

    // Verified writes (then fio reads everything back and checks it);
    // the suspend/reload/resume happens while they are in flight.
    let out = srv.dir.join("during.json");
    let during = spawn_fio(
        &uri,
        &out,
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--size=2m",
            "--iodepth=4",
            "--verify=crc32c",
            "--verify_fatal=1",
        ],
    );
    assert!(
        eventually(Duration::from_secs(60), || allocated_bytes(&srv, "mem") > 0),
        "fio's writes never reached the device"
    );
    let hold = Duration::from_millis(300);
    srv.ok("suspend", &["d0"]);
    std::thread::sleep(hold);
    srv.ok("reload", &["d0", "--table", "0 16384 delay mem 0 1"]);
    srv.ok("resume", &["d0"]);
    let during = finish_fio(during, &out, "fio during the reload");
    assert_eq!(
        during["read"]["io_bytes"],
        2 << 20,
        "verify read back everything written"
    );
    // Writes, or verify reads if fio got that far, were held.
    let held_ms = clat_ms(&during, "write", "max").max(clat_ms(&during, "read", "max"));
    assert!(
        held_ms >= hold.as_millis() as f64 * 0.8,
        "no I/O was held across the suspension (max clat {held_ms:.1} ms)"
    );
    assert_eq!(srv.ok("table", &["d0"]), "0 16384 delay 253:0 0 1\n");

    let out = srv.dir.join("after.json");
    let after = finish_fio(spawn_fio(&uri, &out, &read_probe), &out, "fio after");
    let (b, a) = (
        clat_ms(&before, "read", "mean"),
        clat_ms(&after, "read", "mean"),
    );
    eprintln!(
        "delay 10 ms -> 1 ms: read clat mean {b:.2} ms -> {a:.2} ms; \
         during: write clat mean {:.2} ms, max held {held_ms:.1} ms (suspended {} ms), verify ok",
        clat_ms(&during, "write", "mean"),
        hold.as_millis()
    );
    assert!(b >= 9.0, "a 10 ms delay served reads in {b:.2} ms");
    assert!(
        a * 2.0 < b,
        "latency did not drop after the reload: {b:.2} -> {a:.2} ms"
    );
}

#[test]
fn multipath_fail_and_reinstate_under_fio_verify() {
    // Two paths to one RAM disk, each with a 1 ms delay so fio runs long
    // enough to see the path changes.
    let srv = Serve::start(
        "mem,,,rw,0 16384 memory;\
         p0,,,rw,0 16384 delay mem 0 1;\
         p1,,,rw,0 16384 delay mem 0 1;\
         mp,,,rw,0 16384 multipath 1 queue_if_no_path 0 1 1 round-robin 0 2 1 p0 1 p1 1",
        "mp",
    );
    let uri = srv.uri("mp");
    let out = srv.dir.join("mp.json");
    let fio = spawn_fio(
        &uri,
        &out,
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--size=4m",
            "--iodepth=8",
            "--rate_iops=1000",
            "--verify=crc32c",
            "--verify_fatal=1",
        ],
    );
    assert!(
        eventually(Duration::from_secs(60), || allocated_bytes(&srv, "mem") > 0),
        "fio's writes never reached the device"
    );
    srv.ok("message", &["mp", "0", "fail_path", "p0"]);
    let st = srv.ok("status", &["mp"]);
    assert!(st.contains("253:1 F") && st.contains("253:2 A"), "{st}");
    std::thread::sleep(Duration::from_millis(150));
    // No path left: I/O is queued, not failed.
    let hold = Duration::from_millis(300);
    srv.ok("message", &["mp", "0", "fail_path", "253:2"]);
    std::thread::sleep(hold);
    srv.ok("message", &["mp", "0", "reinstate_path", "p0"]);
    std::thread::sleep(Duration::from_millis(150));
    srv.ok("message", &["mp", "0", "reinstate_path", "p1"]);
    let st = srv.ok("status", &["mp"]);
    assert!(st.contains("253:1 A") && st.contains("253:2 A"), "{st}");

    let job = finish_fio(fio, &out, "fio over multipath");
    assert_eq!(
        job["read"]["io_bytes"],
        4 << 20,
        "verify read back everything"
    );
    let held_ms = clat_ms(&job, "write", "max").max(clat_ms(&job, "read", "max"));
    eprintln!(
        "multipath: fail p0, fail p1 ({} ms without paths), reinstate both: \
         no error, verify ok, max clat {held_ms:.1} ms",
        hold.as_millis()
    );
    assert!(
        held_ms >= hold.as_millis() as f64 * 0.8,
        "no I/O was queued while every path was down (max clat {held_ms:.1} ms)"
    );
}
