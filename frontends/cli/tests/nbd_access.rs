//! Who may reach `blkstack serve`: its NBD Unix sockets are private to the
//! owner (0600) unless `--socket-mode` says otherwise, whatever the umask,
//! and listening on a non-loopback TCP address without TLS is warned about.

use blkstack_test_support::*;
use std::os::unix::fs::PermissionsExt;

const STACK: &str = "mem,,,rw,0 2048 memory";

fn mode(srv: &Serve) -> u32 {
    std::fs::metadata(&srv.nbd_socket)
        .expect("socket exists")
        .permissions()
        .mode()
        & 0o777
}

#[test]
fn the_unix_socket_is_private_by_default() {
    let srv = Serve::start_tcp(STACK, "mem");
    assert_eq!(mode(&srv), 0o600);
    let err = srv.stderr_text();
    assert!(
        !err.contains("non-loopback"),
        "loopback only, no warning: {err}"
    );
}

#[test]
fn socket_mode_sets_the_unix_socket_permissions() {
    let srv = Serve::options()
        .args(&[
            "--concise",
            STACK,
            "--export",
            "mem",
            "--socket-mode",
            "0660",
        ])
        .tcp()
        .start();
    assert_eq!(mode(&srv), 0o660);
}

#[test]
fn a_bad_socket_mode_is_refused_by_name() {
    let out = run(
        std::process::Command::new(env!("CARGO_BIN_EXE_blkstack")).args([
            "serve",
            "--concise",
            STACK,
            "--export",
            "mem",
            "--socket-mode",
            "0999",
        ]),
        std::time::Duration::from_secs(20),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--socket-mode") && err.contains("octal"),
        "{err}"
    );
}

#[test]
fn listening_on_a_non_loopback_address_without_tls_warns() {
    let srv = Serve::options()
        .args(&[
            "--concise",
            STACK,
            "--export",
            "mem",
            "--listen",
            "nbd://0.0.0.0:0",
        ])
        .tcp()
        .start();
    let err = srv.stderr_text();
    assert!(
        err.contains("WARN") && err.contains("non-loopback") && err.contains("without TLS"),
        "{err}"
    );
}
