//! The binary's logging: libraries log through `tracing`, and `blkstack`
//! installs a subscriber writing to stderr at warn by default, raised by
//! the global `-v`/`-vv` flags or by RUST_LOG. The probe is a debug-level
//! event every server emits deterministically: a client dropped during the
//! handshake (here for setting an unknown client flag).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

const DROPPED: &str = "handshake ended without an export";

/// Run `blkstack serve` with `args` (after `serve`) and RUST_LOG set to
/// `rust_log` (unset for `None`), drop one client at the handshake, stop
/// the server and return its stderr.
fn serve_and_drop_a_client(args: &[&str], rust_log: Option<&str>) -> String {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "logging-cli-{}-{}",
        std::process::id(),
        args.len() + rust_log.map_or(0, |_| 10)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("nbd.sock");
    let stderr_path = dir.join("stderr.txt");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_blkstack"));
    cmd.arg("serve")
        .args(["--concise", "d0,,,rw,0 2048 memory", "--export", "d0"])
        .arg("--listen")
        .arg(format!("nbd+unix:///?socket={}", socket.display()))
        .arg("--control")
        .arg(dir.join("control.sock"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap());
    match rust_log {
        Some(v) => cmd.env("RUST_LOG", v),
        None => cmd.env_remove("RUST_LOG"),
    };
    let mut child = cmd.spawn().expect("start blkstack serve");
    let stdout = child.stdout.take().unwrap();
    let ready = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .any(|l| l == "ready");
    assert!(
        ready,
        "server never ready: {}",
        std::fs::read_to_string(&stderr_path).unwrap_or_default()
    );

    let mut c = UnixStream::connect(&socket).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; 18];
    c.read_exact(&mut greeting).expect("greeting");
    c.write_all(&0x80u32.to_be_bytes()).unwrap();
    // The server logs why before it closes the connection: EOF here means
    // the event was written.
    let mut rest = Vec::new();
    c.read_to_end(&mut rest)
        .expect("server closes the connection");
    assert!(rest.is_empty(), "no reply to a client that must be dropped");

    child.kill().unwrap();
    child.wait().unwrap();
    let text = std::fs::read_to_string(&stderr_path).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    text
}

#[test]
fn verbosity_flags_and_rust_log_raise_the_level() {
    let quiet = serve_and_drop_a_client(&[], None);
    assert!(!quiet.contains(DROPPED), "warn by default:\n{quiet}");

    let info = serve_and_drop_a_client(&["-v"], None);
    assert!(!info.contains(DROPPED), "-v is info, not debug:\n{info}");

    let debug = serve_and_drop_a_client(&["-vv"], None);
    assert!(debug.contains(DROPPED), "-vv shows debug:\n{debug}");
    assert!(debug.contains("client flags 0x80"), "{debug}");

    let env = serve_and_drop_a_client(&[], Some("blkstack_nbd=debug"));
    assert!(env.contains(DROPPED), "RUST_LOG shows debug:\n{env}");
}
