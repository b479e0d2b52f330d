//! The kernel-facing frontends' refusals, on the host: `serve --ublk`
//! where the ublk driver is not loaded names the module to load (run
//! where /dev/ublk-control is missing; where it exists the case is
//! skipped, saying so: the guest tests cover the working path),
//! `--ublk-queues` / `--ublk-depth` beyond the stack's tag set are
//! refused, naming what the stack offers;
//! `export --ublk` on a serve without the ublk frontend says how to get
//! one, a serve with nothing to export says what it needs, and a bad
//! `--vhost-user-blk` spec is named. Each refusal leaves nothing behind.

use blkstack_test_support::*;
use std::process::{Command, Stdio};

fn serve(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_blkstack"))
        .arg("serve")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run blkstack serve");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn serve_ublk_without_the_driver_names_the_module() {
    if std::path::Path::new("/dev/ublk-control").exists() {
        blkstack_test_support::skip(
            "/dev/ublk-control exists here, so the missing-driver error cannot be shown \
             (the kernel VM tests cover ublk with the driver)",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ctl = dir.path().join("c.sock");
    let (code, err) = serve(&[
        "--concise",
        "d0,,,rw,0 2048 memory",
        "--ublk",
        "d0",
        "--control",
        ctl.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--ublk d0"), "{err}");
    assert!(err.contains("/dev/ublk-control is missing"), "{err}");
    assert!(err.contains("modprobe ublk_drv"), "{err}");
    assert!(!ctl.exists(), "a refused serve left its control socket");
}

#[test]
fn ublk_queues_or_depth_beyond_the_stack_are_refused() {
    // Checked before the driver is looked for: the same refusal wherever
    // this runs.
    let (code, err) = serve(&[
        "--concise",
        "d0,,,rw,0 2048 memory submit_queues=2 hw_queue_depth=48",
        "--ublk",
        "d0",
        "--ublk-queues",
        "3",
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--ublk d0"), "{err}");
    assert!(
        err.contains("--ublk-queues 3: the stack offers 2 hardware queue(s)"),
        "{err}"
    );
    let (code, err) = serve(&[
        "--concise",
        "d0,,,rw,0 2048 memory submit_queues=2 hw_queue_depth=48",
        "--ublk",
        "d0",
        "--ublk-depth",
        "64",
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--ublk-depth 64: the stack offers 48 tags per queue"),
        "{err}"
    );
}

#[test]
fn serve_without_anything_to_export_says_what_it_needs() {
    let (code, err) = serve(&["--concise", "d0,,,rw,0 2048 memory"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--export NAME"), "{err}");
    assert!(err.contains("--ublk NAME"), "{err}");
    assert!(err.contains("--vhost-user-blk SOCKET:NAME"), "{err}");
    let (code, err) = serve(&[
        "--concise",
        "d0,,,rw,0 2048 memory",
        "--vhost-user-blk",
        "nocolon",
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--vhost-user-blk nocolon: want SOCKET:NAME"),
        "{err}"
    );
    let (code, err) = serve(&["--concise", "d0,,,rw,0 2048 memory", "--ublk", "nosuch"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("nosuch"), "{err}");
}

#[test]
fn export_ublk_on_a_serve_without_ublk_is_refused_and_changes_nothing() {
    let srv = Serve::start("d0,,,rw,0 2048 memory;d1,,,rw,0 2048 memory", "d0");
    let before = srv.snapshot();
    let err = srv.fails("export", &["--ublk", "d1"]);
    assert!(err.contains("no ublk frontend"), "{err}");
    assert!(err.contains("--ublk"), "{err}");
    let err = srv.fails("unexport", &["--ublk", "d0"]);
    assert!(err.contains("no ublk frontend"), "{err}");
    assert_eq!(srv.snapshot(), before);
}

#[test]
fn a_vhost_user_blk_serve_stops_on_sigterm_even_without_its_socket_path() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vu.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_blkstack"))
        .arg("serve")
        .args(["--concise", "d0,,,rw,0 2048 memory", "--vhost-user-blk"])
        .arg(format!("{}:d0", sock.display()))
        .arg("--control")
        .arg(dir.path().join("c.sock"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn serve");
    let out = BufReader::new(child.stdout.take().unwrap());
    let lines: Vec<String> = out
        .lines()
        .map_while(Result::ok)
        .take_while(|l| l != "ready")
        .collect();
    assert!(
        lines.iter().any(|l| l.contains("vhost-user socket")),
        "{lines:?}"
    );
    assert!(sock.exists(), "no socket at {}", sock.display());
    // Whoever started serve may clean its directory before serve is gone:
    // the stop must not need the path to wake the listener.
    std::fs::remove_file(&sock).unwrap();
    let st = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let t0 = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "serve exited {status:?}");
            break;
        }
        if t0.elapsed() > std::time::Duration::from_secs(20) {
            let _ = child.kill();
            panic!("serve did not stop within 20 s of SIGTERM");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
