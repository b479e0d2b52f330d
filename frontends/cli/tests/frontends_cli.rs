//! The kernel-facing frontends' refusals, on the host: `serve --ublk`
//! where the ublk driver is not loaded names the module to load (this
//! machine's kernel has no /dev/ublk-control; where one exists the case
//! is skipped, saying so: the guest tests cover the working path),
//! `export --ublk` on a serve without the ublk frontend says how to get
//! one, a serve with nothing to export says what it needs, and a bad
//! `--vhost-user-blk` spec is named. Each refusal leaves nothing behind.

mod control_support;

use control_support::Serve;
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
        eprintln!("SKIP: /dev/ublk-control exists here (the kernel VM tests cover ublk)");
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
