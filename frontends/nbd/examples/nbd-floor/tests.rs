//! The floor probe serves real clients correctly: qemu-io writes a
//! pattern into the memory export and reads it back, and reads zeros
//! from the null export; a malformed request closes its connection.

use crate::{serve, Export, Kind};
use blkstack_nbd::proto;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Start a floor server on a fresh socket (its thread lives as long as
/// the test process).
fn start(kind: Kind, dir: &Path) -> PathBuf {
    let path = dir.join("floor.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let export = Export::new(kind, "d", 1 << 20, 1).expect("export");
    std::thread::spawn(move || serve(listener, export, None));
    path
}

fn have_qemu_io() -> bool {
    if Command::new("qemu-io").arg("--version").output().is_err() {
        blkstack_test_support::skip("qemu-io is not installed (apt-get install qemu-utils)");
        return false;
    }
    true
}

/// qemu-io on the export (`-r`: read-only): exit status and all its output.
fn qemu_io(sock: &Path, read_only: bool, cmds: &[&str]) -> (bool, String) {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    if read_only {
        c.arg("-r");
    }
    c.arg(format!("nbd+unix:///d?socket={}", sock.display()));
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    let out = blkstack_test_support::run(&mut c, Duration::from_secs(20));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// As [`qemu_io`], and every command must succeed (patterns included).
fn qemu_io_ok(sock: &Path, read_only: bool, cmds: &[&str]) -> String {
    let (ok, text) = qemu_io(sock, read_only, cmds);
    assert!(
        ok && !text.contains("failed"),
        "qemu-io reported a failure:\n{text}"
    );
    text
}

#[test]
fn memory_export_keeps_what_qemu_io_writes() {
    let dir = tempfile::tempdir().expect("tempdir");
    if !have_qemu_io() {
        return;
    }
    let sock = start(Kind::Memory, dir.path());
    let out = qemu_io_ok(
        &sock,
        false,
        &[
            "write -P 0xab 4096 12288",
            "write -P 0x5c 1040384 8192",
            "read -P 0xab 4096 12288",
            "read -P 0x5c 1040384 8192",
            "read -P 0 0 4096",
        ],
    );
    assert_eq!(out.matches("wrote ").count(), 2, "{out}");
    assert_eq!(out.matches("read ").count(), 3, "{out}");
}

#[test]
fn null_export_reads_zeros_and_refuses_writes() {
    let dir = tempfile::tempdir().expect("tempdir");
    if !have_qemu_io() {
        return;
    }
    let sock = start(Kind::Null, dir.path());
    let out = qemu_io_ok(
        &sock,
        true,
        &["read -P 0 0 65536", "read -P 0 983040 65536"],
    );
    assert_eq!(out.matches("read 65536/65536").count(), 2, "{out}");
    // The export says it is read-only: a writer cannot open it.
    let (ok, out) = qemu_io(&sock, false, &["write 0 4096"]);
    assert!(!ok && out.contains("Permission denied"), "{out}");
}

#[test]
fn malformed_request_closes_the_connection() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = start(Kind::Memory, dir.path());
    let mut s = UnixStream::connect(&path).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("greeting");
    assert_eq!(&greeting[..8], &proto::NBDMAGIC.to_be_bytes());
    let mut v = (proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    proto::OptionHeader {
        option: proto::OPT_EXPORT_NAME,
        len: 1,
    }
    .encode(&mut v);
    v.push(b'd');
    s.write_all(&v).expect("options");
    let mut reply = [0u8; 10];
    s.read_exact(&mut reply).expect("export reply");
    assert_eq!(u64::from_be_bytes(reply[..8].try_into().unwrap()), 1 << 20);
    // A READ header with a wrong magic: the server must hang up.
    let mut req = proto::Request {
        flags: 0,
        cmd: proto::CMD_READ,
        handle: 7,
        offset: 0,
        len: 4096,
    }
    .encode();
    req[0] ^= 0xff;
    s.write_all(&req).expect("request");
    let mut rest = Vec::new();
    let n = s
        .read_to_end(&mut rest)
        .expect("the server closes, not times out");
    assert_eq!(n, 0, "no reply to a malformed request, got {rest:?}");
}
