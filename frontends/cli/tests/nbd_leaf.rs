//! The `nbd` client leaf against real servers: `blkstack serve`, qemu-nbd
//! and nbdkit, each passing a write+verify workload run by `blkstack
//! bench` (fio's `verify=crc32c`, `do_verify`) over a stack whose table is
//! the `nbd` line; TLS against `blkstack serve --tls=require`; a table
//! longer than the export refused; a server killed with SIGKILL and
//! restarted (nothing lost) or not (errors within the dead timeout, no
//! hang); multi-conn only where the server advertises it; poll queues,
//! whose replies the bench's job threads read themselves.

mod tls_support;

use blkstack_test_support::*;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use tls_support::{certificates, tls_serve};

const LIMIT: Duration = Duration::from_secs(120);
/// 16 MiB exports.
const SECTORS: u64 = 32768;

fn blkstack() -> Command {
    Command::new(env!("CARGO_BIN_EXE_blkstack"))
}

fn text(o: &Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `blkstack bench` over the one-line stack `n0: 0 SECTORS nbd ARGS`.
fn bench(nbd_args: &str, job: &[&str]) -> Output {
    let concise = format!("n0,,,rw,0 {SECTORS} nbd {nbd_args}");
    run(
        blkstack()
            .args(["bench", "--concise", &concise, "--name=t", "--filename=n0"])
            .args(job),
        LIMIT,
    )
}

/// A random write+verify run; asserts it succeeded and checked blocks.
/// Returns the run's output.
fn bench_verify(nbd_args: &str, job: &[&str]) -> String {
    let mut args = vec![
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        "--size=8m",
        "--verify=crc32c",
        "--do_verify=1",
    ];
    args.extend_from_slice(job);
    let out = bench(nbd_args, &args);
    let all = text(&out);
    assert!(out.status.success(), "bench failed:\n{all}");
    let line = all
        .lines()
        .find(|l| l.trim_start().starts_with("verify"))
        .unwrap_or_else(|| panic!("no verify line:\n{all}"));
    assert!(line.contains("errors=0"), "{line}\n{all}");
    let checked: u64 = line
        .split("checked=")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    if job.contains(&"--rw=randrw") {
        // Random mixed I/O writes some blocks; every block written is
        // read back.
        assert!(checked > 256, "too few blocks verified:\n{line}");
    } else {
        assert_eq!(
            checked, 2048,
            "every 4 KiB block of 8 MiB verified:\n{line}"
        );
    }
    all
}

/// A peer process killed (SIGKILL) on drop.
struct Peer(Option<Child>);

impl Peer {
    fn spawn(cmd: &mut Command, socket: &Path) -> Peer {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        let peer = Peer(Some(child));
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(socket).is_err() {
            assert!(
                Instant::now() < deadline,
                "{cmd:?} did not listen on {} within 20 s",
                socket.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        peer
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn unix_uri(export: &str, socket: &Path) -> String {
    format!("nbd+unix:///{export}?socket={}", socket.display())
}

#[test]
fn verifies_against_blkstack_serve_over_unix_and_tcp() {
    let srv = Serve::start_tcp(&format!("mem,,,rw,0 {SECTORS} memory"), "mem");
    bench_verify(&srv.uri("mem"), &[]);
    bench_verify(&format!("{} queue_depth=8", srv.tcp_uri("mem")), &[]);
}

#[test]
fn poll_queues_verify_with_the_bench_reading_its_own_replies() {
    let srv = Serve::start_tcp(&format!("mem,,,rw,0 {SECTORS} memory"), "mem");
    let uri = srv.uri("mem");
    // The default wait sleeps in the leaf's poll (the job thread reads
    // its replies); wait=poll spins on the poll that never sleeps.
    bench_verify(&format!("{uri} poll_queues=1"), &[]);
    bench_verify(&format!("{uri} poll_queues=2"), &["--wait=poll"]);
    // Four jobs share one poll queue, each verifying its own 2 MiB.
    let out = bench(
        &format!("{uri} poll_queues=1"),
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=8",
            "--numjobs=4",
            "--size=2m",
            "--offset_increment=2m",
            "--verify=crc32c",
            "--do_verify=1",
        ],
    );
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    let verified = all
        .lines()
        .filter(|l| l.trim_start().starts_with("verify") && l.contains("checked=512, errors=0"))
        .count();
    assert_eq!(verified, 4, "every job verified all its blocks:\n{all}");
}

#[test]
fn verifies_against_qemu_nbd() {
    let dir = Scratch::new("leaf-qemu");
    let img = dir.path("disk.raw");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(SECTORS * 512))
        .expect("raw image");
    let sock = dir.path("q.sock");
    let _q = Peer::spawn(
        Command::new(tool("qemu-nbd"))
            .args(["-f", "raw", "-t", "--shared=8", "-x", "exp", "-k"])
            .arg(&sock)
            .arg(&img),
        &sock,
    );
    bench_verify(&unix_uri("exp", &sock), &["--rw=randrw"]);
}

#[test]
fn verifies_against_nbdkit_memory() {
    let dir = Scratch::new("leaf-nbdkit");
    let sock = dir.path("k.sock");
    let _k = Peer::spawn(
        Command::new(tool("nbdkit"))
            .args(["-f", "-U"])
            .arg(&sock)
            .args(["memory", &format!("{}", SECTORS * 512)]),
        &sock,
    );
    bench_verify(&format!("{} connections=2", unix_uri("", &sock)), &[]);
}

#[test]
fn table_longer_than_the_export_or_unreachable_server_is_refused() {
    let srv = Serve::start_tcp(&format!("mem,,,rw,0 {SECTORS} memory"), "mem");
    let uri = srv.uri("mem");
    let concise = format!("n0,,,rw,0 {} nbd {uri}", SECTORS + 8);
    let out = run(
        blkstack().args([
            "bench",
            "--concise",
            &concise,
            "--name=t",
            "--filename=n0",
            "--size=4k",
        ]),
        LIMIT,
    );
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    let want = format!(
        "the table line is {} bytes but export {uri} holds only {} bytes",
        (SECTORS + 8) * 512,
        SECTORS * 512
    );
    assert!(all.contains(&want), "want {want:?} in:\n{all}");
    assert!(all.contains("line 1"), "the message names the line:\n{all}");
    // No such export: the server's refusal is shown.
    let out = bench(&srv.uri("nope"), &["--size=4k"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("no such export"), "{}", text(&out));
    // Nobody listening: fails at once with the cause.
    let dir = Scratch::new("leaf-none");
    let out = bench(&unix_uri("", &dir.path("none.sock")), &["--size=4k"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("cannot reach"), "{}", text(&out));
}

#[test]
fn tls_leaf_against_serve_require_and_verify_peer() {
    let certs = Scratch::new("leaf-tls");
    certificates(&certs.0);
    let dir = certs.0.to_str().expect("utf-8 path");
    // The leaf presents client-cert.pem from the same directory.
    let stack = format!("mem,,,rw,0 {SECTORS} memory");
    let srv = tls_serve(&certs.0, &stack, "mem", &["--tls-verify-peer"]);
    let tls_uri = format!(
        "nbds+unix:///mem?socket={}&tls-certificates={dir}",
        srv.nbd_socket.display()
    );
    bench_verify(&tls_uri, &["--rw=randrw"]);
    // Over TCP the server certificate is checked against the address.
    let tcp = format!("nbds://{}/mem?tls-certificates={dir}", srv.tcp_addr());
    bench_verify(&tcp, &[]);
    // Poll queues over TLS: the job thread decrypts its own replies.
    bench_verify(&format!("{tls_uri} poll_queues=1"), &[]);
    // 64 KiB reads and writes at depth 16: more replies than the socket
    // holds while the job thread is still sending, so a send stalls until
    // the connection's thread reads replies (without it, both ends wait
    // for each other for ever); records and plaintext stay buffered
    // between polls.
    let out = bench(
        &format!("{tls_uri} poll_queues=2"),
        &[
            "--rw=randrw",
            "--bs=64k",
            "--iodepth=16",
            "--size=16m",
            "--wait=poll",
            "--verify=crc32c",
            "--do_verify=1",
        ],
    );
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(all.contains(", errors=0"), "{all}");
    // Without the CA's certificate the server is not trusted.
    let other = Scratch::new("leaf-tls-other");
    certificates(&other.0);
    let untrusted = format!(
        "nbds://{}/mem?tls-certificates={}",
        srv.tcp_addr(),
        other.0.display()
    );
    let out = bench(&untrusted, &["--size=4k"]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("invalid peer certificate"),
        "{}",
        text(&out)
    );
    // The same server refuses a plain client, and says why.
    let out = bench(&srv.uri("mem"), &["--size=4k"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("TLS required"), "{}", text(&out));
}

/// `blkstack serve` of a file on a fixed socket (so it can be restarted
/// where the client reconnects).
fn file_server(dir: &Scratch, img: &Path, sock: &Path) -> Peer {
    let _ = std::fs::remove_file(sock);
    Peer::spawn(
        blkstack()
            .args(["serve", "--concise"])
            .arg(format!("f0,,,rw,0 {SECTORS} file {}", img.display()))
            .args(["--export", "f0", "--listen"])
            .arg(format!("nbd+unix:///?socket={}", sock.display()))
            .arg("--control")
            .arg(dir.path("ctl.sock")),
        sock,
    )
}

fn file_image(dir: &Scratch) -> PathBuf {
    let img = dir.path("f.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(SECTORS * 512))
        .expect("image");
    img
}

#[test]
fn server_killed_and_restarted_within_dead_timeout_loses_nothing() {
    killed_and_restarted("");
}

/// The same with the bench's I/O on a poll queue: the job thread finds
/// the connection dead, and waits for the reconnect's resent requests.
#[test]
fn poll_queue_server_killed_and_restarted_loses_nothing() {
    killed_and_restarted(" poll_queues=1");
}

fn killed_and_restarted(extra: &str) {
    let dir = Scratch::new("leaf-restart");
    let (img, sock) = (file_image(&dir), dir.path("f.sock"));
    let mut srv = file_server(&dir, &img, &sock);
    let args = format!(
        "{} reconnect_delay_ms=20 dead_timeout_ms=10000{extra}",
        unix_uri("f0", &sock)
    );
    // About two seconds of paced writes, then the verify pass.
    let run = std::thread::spawn(move || bench_verify(&args, &["--rate_iops=1000"]));
    std::thread::sleep(Duration::from_millis(600));
    srv.kill();
    std::thread::sleep(Duration::from_millis(300));
    let _srv = file_server(&dir, &img, &sock);
    let all = run.join().expect("verify run across the restart");
    assert!(
        all.contains("connection lost"),
        "the kill happened during the run:\n{all}"
    );
}

/// nbdkit serving `img` with every request delayed, so requests pile up.
fn slow_nbdkit(img: &Path, sock: &Path) -> Peer {
    let _ = std::fs::remove_file(sock);
    Peer::spawn(
        Command::new(tool("nbdkit"))
            .args(["-f", "--filter=delay", "-U"])
            .arg(sock)
            .arg("file")
            .arg(img)
            .args(["rdelay=30ms", "wdelay=30ms"]),
        sock,
    )
}

/// 64 MiB of 1 MiB reads and writes in flight when the server dies: the
/// resend after the reconnect is more than the socket holds, and nbdkit
/// stops reading requests while its replies are not read. The replies
/// are read while the resend goes on (a reader thread, or on a poll
/// queue the connection's thread when the send stalls), so it finishes.
#[test]
fn resend_larger_than_the_socket_does_not_deadlock() {
    for extra in ["", " poll_queues=1"] {
        let dir = Scratch::new("leaf-resend");
        let (img, sock) = (file_image(&dir), dir.path("k.sock"));
        let mut srv = slow_nbdkit(&img, &sock);
        let args = format!(
            "{} reconnect_delay_ms=20 dead_timeout_ms=20000{extra}",
            unix_uri("", &sock)
        );
        let run = std::thread::spawn(move || {
            let job = [
                "--rw=randrw",
                "--bs=1m",
                "--iodepth=64",
                "--runtime=3",
                "--time_based",
            ];
            bench(&args, &job)
        });
        std::thread::sleep(Duration::from_millis(1200));
        srv.kill();
        std::thread::sleep(Duration::from_millis(300));
        let _srv = slow_nbdkit(&img, &sock);
        let out = run.join().expect("bench thread");
        let all = text(&out);
        assert!(out.status.success(), "{extra}: {all}");
        assert!(all.contains("connection lost"), "{extra}: {all}");
    }
}

#[test]
fn server_killed_for_good_fails_requests_within_dead_timeout() {
    let dir = Scratch::new("leaf-dead");
    let (img, sock) = (file_image(&dir), dir.path("f.sock"));
    let mut srv = file_server(&dir, &img, &sock);
    let args = format!(
        "{} reconnect_delay_ms=20 dead_timeout_ms=500",
        unix_uri("f0", &sock)
    );
    let start = Instant::now();
    let run = std::thread::spawn(move || {
        bench(
            &args,
            &[
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=16",
                "--size=8m",
                "--rate_iops=1000",
            ],
        )
    });
    std::thread::sleep(Duration::from_millis(500));
    srv.kill();
    let killed = start.elapsed();
    let out = run.join().expect("bench thread");
    let took = start.elapsed() - killed;
    let all = text(&out);
    assert!(
        !out.status.success(),
        "I/O must fail, not succeed silently:\n{all}"
    );
    assert!(all.contains("Input/output error"), "{all}");
    // Dead timeout (0.5 s) plus a bound for the bench to report.
    assert!(
        took < Duration::from_secs(10),
        "took {took:?} after the kill:\n{all}"
    );
}

/// `blkstack status n0` of a client-side `blkstack serve` holding an nbd
/// leaf with `connections=4` over `uri`.
fn status_with_four_connections(uri: &str) -> String {
    let dir = Scratch::new("leaf-mc");
    let ctl = dir.path("ctl.sock");
    let ctl_s = ctl.to_str().expect("utf-8");
    let client = Serve::options()
        .args(&[
            "--concise",
            &format!("n0,,,rw,0 {SECTORS} nbd {uri} connections=4"),
            "--export",
            "n0",
            "--control",
            ctl_s,
        ])
        .tcp()
        .control(Control::Given)
        .start();
    let out = run_ok(blkstack().args(["status", "n0", "--control", ctl_s]), LIMIT);
    drop(client);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn multi_conn_only_where_the_server_advertises_it() {
    let srv = Serve::start_tcp(&format!("mem,,,rw,0 {SECTORS} memory"), "mem");
    let st = status_with_four_connections(&srv.uri("mem"));
    assert!(st.contains("connections=4/4"), "{st}");
    assert!(st.contains("multi_conn=yes"), "{st}");

    let dir = Scratch::new("leaf-nomc");
    let sock = dir.path("k.sock");
    let _k = Peer::spawn(
        Command::new(tool("nbdkit"))
            .args(["-f", "--filter=multi-conn", "-U"])
            .arg(&sock)
            .args([
                "memory",
                &format!("{}", SECTORS * 512),
                "multi-conn-mode=disable",
            ]),
        &sock,
    );
    let st = status_with_four_connections(&unix_uri("", &sock));
    assert!(st.contains("connections=1/1"), "{st}");
    assert!(st.contains("multi_conn=no(asked_4"), "{st}");
}

#[test]
fn extent_map_passes_through_block_status() {
    let srv = Serve::start_tcp(&format!("mem,,,rw,0 {SECTORS} memory"), "mem");
    let dir = Scratch::new("leaf-map");
    let src = dir.path("src.bin");
    pattern_file_with_holes(&src, 1 << 20, 5);
    run_ok(
        Command::new(tool("nbdcopy")).arg(&src).arg(srv.uri("mem")),
        LIMIT,
    );
    // The nbd leaf re-exported: its map must be the remote one.
    let ctl = dir.path("ctl.sock");
    let client = Serve::options()
        .args(&[
            "--concise",
            &format!("n0,,,rw,0 {SECTORS} nbd {}", srv.uri("mem")),
            "--export",
            "n0",
            "--control",
            ctl.to_str().expect("utf-8"),
        ])
        .tcp()
        .control(Control::Given)
        .start();
    let map = |uri: String| {
        let out = run_ok(Command::new(tool("nbdinfo")).arg("--map").arg(uri), LIMIT);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let remote = map(srv.uri("mem"));
    assert!(remote.contains("hole"), "{remote}");
    assert!(remote.contains("data"), "{remote}");
    assert_eq!(map(client.uri("n0")), remote);
}
