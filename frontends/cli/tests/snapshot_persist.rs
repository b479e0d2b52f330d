//! The persistent snapshot store across processes: `blkstack serve` runs
//! a `snapshot ... P 8` over `file` origin and COW devices, qemu-io
//! writes through it over NBD, serve is killed (SIGKILL: each exception
//! is committed before its write completes, so nothing waits for a clean
//! stop), and a new serve over the same files reads back what was
//! written, with the same status, and the origin file unchanged.

use blkstack_test_support::*;
use std::process::Command;
use std::time::Duration;

fn qemu_io_ok(srv: &Serve, export: &str, cmd: &str) -> String {
    let mut c = Command::new(tool("qemu-io"));
    c.args(["-f", "raw", "-c", cmd, &srv.uri(export)]);
    let o = run_bounded(&mut c, None, Duration::from_secs(60), "qemu-io");
    let out = format!("{}{}", o.stdout, o.stderr);
    assert!(
        o.status.success() && !out.contains("failed") && !out.contains("Pattern verification"),
        "qemu-io -c '{cmd}': {out}"
    );
    out
}

#[test]
fn a_persistent_snapshot_survives_a_killed_serve() {
    let scratch = Scratch::new("snap-persist");
    let origin = scratch.path("origin");
    let cow = scratch.path("cow");
    pattern_file(&origin, 1 << 20, 7);
    std::fs::File::create(&cow)
        .and_then(|f| f.set_len(512 << 10))
        .expect("cow file");
    let stack = format!(
        "o,,,rw,0 2048 file {};c,,,rw,0 1024 file {};s,,,rw,0 2048 snapshot o c P 8",
        origin.display(),
        cow.display()
    );
    let writes = [
        "write -P 0x61 4096 512",
        "write -P 0x62 65536 8192",
        "write -P 0x63 1044480 4096",
    ];
    let reads = [
        "read -P 0x61 4096 512",
        "read -P 0x62 65536 8192",
        "read -P 0x63 1044480 4096",
    ];
    let srv = Serve::start(&stack, "s");
    for w in writes {
        qemu_io_ok(&srv, "s", w);
    }
    let status = srv.ok("status", &["s"]);
    // Header, area 0, and the four chunks written (8 sectors each).
    assert!(status.contains("snapshot 48/1024 16"), "{status}");
    let pid = srv.pid().to_string();
    let killed = Command::new("kill").args(["-9", &pid]).status();
    assert!(killed.is_ok_and(|s| s.success()), "kill -9 serve");
    drop(srv);

    let srv = Serve::start(&stack, "s");
    for r in reads {
        qemu_io_ok(&srv, "s", r);
    }
    // The rest of the written chunks kept the origin's bytes.
    let want = pattern(1 << 20, 7);
    let got = std::fs::read(&origin).expect("origin");
    assert!(got == want, "the origin file is unchanged");
    let out = qemu_io_ok(&srv, "s", "read -v 4608 16");
    let hex: String = want[4608..4624]
        .iter()
        .map(|b| format!("{b:02x} "))
        .collect();
    assert!(
        out.contains(hex.trim()),
        "origin bytes after a partial write: {out}"
    );
    assert_eq!(srv.ok("status", &["s"]), status, "status after the restart");
    let _ = srv.terminate();
}
