//! `remove -f` of an exported device with I/O in flight and held (the
//! device suspended) answers every request and never hangs the client or
//! the server: held requests fail with EIO, as they do when
//! `dmsetup remove --force` swaps in an `error` table before removing, the
//! export's clients are disconnected, and SIGTERM afterwards stops the
//! server within a bound. Real clients: qemu-io and fio's nbd engine.

use blkstack_test_support::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A client must see its error within this after `remove -f` returns.
const CLIENT_ANSWERED: Duration = Duration::from_secs(20);
/// The server must exit within this after SIGTERM.
const STOP_BOUND: Duration = Duration::from_secs(20);

fn spawn(cmd: &mut Command) -> Child {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?} (installed?): {e}"))
}

fn output_of(child: &mut Child) -> String {
    let mut s = String::new();
    if let Some(mut o) = child.stdout.take() {
        std::io::Read::read_to_string(&mut o, &mut s).ok();
    }
    if let Some(mut e) = child.stderr.take() {
        std::io::Read::read_to_string(&mut e, &mut s).ok();
    }
    s
}

/// A server with `dx` (memory) created and exported live, then suspended.
fn suspended_export() -> Serve {
    let srv = Serve::start("d0,,,rw,0 2048 zero", "d0");
    srv.ok("create", &["dx", "--table", "0 8192 memory"]);
    srv.ok("export", &["dx"]);
    srv.ok("suspend", &["dx"]);
    srv
}

/// Give `client` time to connect and send its I/O, which the suspended
/// device holds: the client must not finish meanwhile.
fn wait_client_held(client: &mut Child) {
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        client.try_wait().expect("try_wait").is_none(),
        "the client finished while its I/O should be held: {}",
        output_of(client)
    );
}

/// `remove -f dx` returns, the client ends with an error soon after, and
/// the server stops on SIGTERM.
fn remove_force_answers(mut srv: Serve, mut client: Child, what: &str) -> String {
    wait_client_held(&mut client);
    let t0 = Instant::now();
    srv.ok("remove", &["-f", "dx"]);
    let st = wait_bounded(&mut client, CLIENT_ANSWERED, what);
    let out = output_of(&mut client);
    assert!(
        !st.success(),
        "{what} should fail once its device is removed: {out}"
    );
    assert!(t0.elapsed() < CLIENT_ANSWERED);
    // The device is gone and the server still answers.
    let ls = srv.ok("ls", &[]);
    assert!(!ls.contains("dx"), "dx still listed: {ls}");
    let st = srv.terminate_within(STOP_BOUND);
    assert!(st.success(), "serve exited with {st}");
    out
}

#[test]
fn remove_force_fails_a_held_qemu_io_read() {
    let srv = suspended_export();
    let client = spawn(
        Command::new("qemu-io")
            .args(["-f", "raw", "-c", "read 0 4k"])
            .arg(srv.uri("dx")),
    );
    let out = remove_force_answers(srv, client, "qemu-io read");
    assert!(
        out.contains("Input/output error") || out.contains("error"),
        "qemu-io should report the failed read: {out}"
    );
}

#[test]
fn remove_force_fails_held_fio_io() {
    for run in 0..2 {
        let srv = suspended_export();
        let client = spawn(
            Command::new("fio")
                .args([
                    "--name=job",
                    "--ioengine=nbd",
                    "--rw=randrw",
                    "--bs=4k",
                    "--iodepth=8",
                    "--size=4m",
                    "--time_based",
                    "--runtime=60",
                    "--verify_state_save=0",
                ])
                .arg(format!("--uri={}", srv.uri("dx"))),
        );
        remove_force_answers(srv, client, &format!("fio run {run}"));
    }
}

#[test]
fn sigterm_stops_a_server_whose_device_holds_io() {
    let mut srv = suspended_export();
    let mut client = spawn(
        Command::new("qemu-io")
            .args(["-f", "raw", "-c", "read 0 4k"])
            .arg(srv.uri("dx")),
    );
    wait_client_held(&mut client);
    let st = srv.terminate_within(STOP_BOUND);
    assert!(st.success(), "serve exited with {st}");
    let st = wait_bounded(&mut client, CLIENT_ANSWERED, "qemu-io after stop");
    assert!(
        !st.success(),
        "qemu-io read cannot succeed: {}",
        output_of(&mut client)
    );
}
