//! Sizes checked, RAM bounded, no silent data loss on reload, through the
//! real `blkstack` verbs against `blkstack serve` with qemu-io as the NBD
//! client: an overflowing table is refused naming the line and field; a
//! `memory` device past its `max_alloc=` answers ENOSPC; a reload keeping
//! a memory line keeps its data, one dropping it (or a remove) is refused
//! unless `--force`/`-f`, and a refused reload leaves the old table live.

use blkstack_test_support::*;
use std::process::Command;
use std::time::Duration;

const STACK: &str = "mm,,,rw,0 8192 memory;mb,,,rw,0 2048 memory max_alloc=8K";

/// `qemu-io -c CMD` against an export; its stdout (qemu-io prints errors
/// there) and whether it exited 0.
fn qemu_io(srv: &Serve, export: &str, cmd: &str) -> (bool, String) {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw", "-c", cmd, &srv.uri(export)]);
    let o = run_bounded(&mut c, None, Duration::from_secs(60), "qemu-io");
    (o.status.success(), format!("{}{}", o.stdout, o.stderr))
}

fn qemu_io_ok(srv: &Serve, export: &str, cmd: &str) -> String {
    let (ok, out) = qemu_io(srv, export, cmd);
    assert!(
        ok && !out.contains("failed") && !out.contains("Pattern verification"),
        "qemu-io -c '{cmd}': {out}"
    );
    out
}

fn field(status: &str, key: &str) -> u64 {
    status
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {status}"))
}

#[test]
fn overflowing_sizes_are_refused_naming_line_and_field() {
    let srv = Serve::start(STACK, "mm");
    let before = srv.snapshot();
    let cases: &[(&str, &str)] = &[
        (
            "0 36028797018963976 memory",
            "line 1: length 36028797018963976 sectors x 512 bytes overflows u64",
        ),
        ("0 18446744073709551615 zero", "line 1: length"),
        (
            "0 8 zero\n8 18446744073709551610 zero",
            "line 2: start sector 8 + length 18446744073709551610 overflows u64",
        ),
        (
            "0 18014398509481984 zero",
            "ends at sector 18014398509481984, past the device limit of 18014398509481983 sectors (below 2^63 bytes)",
        ),
    ];
    for (table, want) in cases {
        let err = srv.fails("create", &["big", "--table", table]);
        assert!(err.contains(want), "{table}: {err}");
        assert!(err.contains("Invalid argument"), "{table}: {err}");
        let err = srv.fails("reload", &["mm", "--table", table]);
        assert!(err.contains(want), "reload {table}: {err}");
    }
    assert_eq!(srv.snapshot(), before);
    // The largest device, 2^63 - 512 bytes, is accepted (sparse zero) and
    // a real client sees its size positive.
    srv.ok("create", &["big", "--table", "0 18014398509481983 zero"]);
    srv.ok("export", &["big"]);
    let mut c = Command::new("nbdinfo");
    c.args(["--size", &srv.uri("big")]);
    let o = run_bounded(&mut c, None, Duration::from_secs(60), "nbdinfo");
    assert_eq!(o.stdout.trim(), "9223372036854775296", "{}", o.stderr);
}

#[test]
fn a_memory_device_past_max_alloc_answers_enospc() {
    let srv = Serve::start(STACK, "mb");
    let status = srv.ok("status", &["mb"]);
    assert_eq!(field(&status, "max_alloc_bytes="), 8192, "{status}");
    qemu_io_ok(&srv, "mb", "write -P 0x11 0 8k");
    let (ok, out) = qemu_io(&srv, "mb", "write -P 0x22 512k 4k");
    assert!(
        !ok || out.contains("No space left on device"),
        "a write past max_alloc must fail: {out}"
    );
    assert!(out.contains("No space left on device"), "{out}");
    let status = srv.ok("status", &["mb"]);
    assert_eq!(field(&status, "allocated_bytes="), 8192, "{status}");
    // What was written is intact, and rewriting it needs no new page.
    qemu_io_ok(&srv, "mb", "read -P 0x11 0 8k");
    qemu_io_ok(&srv, "mb", "write -P 0x33 0 4k");
    // Discarding frees a page, so the refused write now fits.
    qemu_io_ok(&srv, "mb", "discard 4k 4k");
    qemu_io_ok(&srv, "mb", "write -P 0x22 512k 4k");
    qemu_io_ok(&srv, "mb", "read -P 0x22 512k 4k");
}

#[test]
fn reload_keeps_memory_data_and_refuses_to_drop_it_unless_forced() {
    let srv = Serve::start(STACK, "mm");
    qemu_io_ok(&srv, "mm", "write -P 0x5a 4k 8k");
    // The reproducer: the same table, reloaded and resumed, keeps the data.
    srv.ok("reload", &["mm", "--table", "0 8192 memory"]);
    srv.ok("resume", &["mm"]);
    assert!(srv.ok("info", &["mm"]).contains("Event number:      1\n"));
    qemu_io_ok(&srv, "mm", "read -P 0x5a 4k 8k");
    assert_eq!(field(&srv.ok("status", &["mm"]), "allocated_bytes="), 8192);

    // A table that drops it is refused, saying what would be lost, and
    // changes nothing.
    let before = srv.snapshot();
    let err = srv.fails("reload", &["mm", "--table", "0 8192 zero"]);
    assert!(
        err.contains("Device or resource busy")
            && err.contains("device mm: reload would discard data held in RAM")
            && err.contains("'0 8192 memory' holds 8192 bytes")
            && err.contains("--force"),
        "{err}"
    );
    let err = srv.fails("reload", &["mm", "--table", "0 16384 memory"]);
    assert!(err.contains("holds 8192 bytes"), "{err}");
    assert_eq!(srv.snapshot(), before);
    qemu_io_ok(&srv, "mm", "read -P 0x5a 4k 8k");

    // Forced: staged, live at resume, data gone.
    srv.ok("reload", &["mm", "--force", "--table", "0 16384 memory"]);
    qemu_io_ok(&srv, "mm", "read -P 0x5a 4k 8k");
    srv.ok("resume", &["mm"]);
    assert_eq!(field(&srv.ok("status", &["mm"]), "allocated_bytes="), 0);
    qemu_io_ok(&srv, "mm", "read -P 0 4k 8k");

    // Empty, so a reload dropping it is accepted; data written before the
    // resume makes the resume refuse, keeping the device as it was.
    srv.ok("reload", &["mm", "--table", "0 16384 zero"]);
    qemu_io_ok(&srv, "mm", "write -P 0x6b 0 4k");
    let before = srv.snapshot();
    let err = srv.fails("resume", &["mm"]);
    assert!(
        err.contains(
            "device mm: resume would discard data held in RAM: '0 16384 memory' holds 4096 bytes"
        ) && err.contains("reload with --force"),
        "{err}"
    );
    assert_eq!(srv.snapshot(), before);
    qemu_io_ok(&srv, "mm", "read -P 0x6b 0 4k");
    srv.ok("clear", &["mm"]);
    srv.ok("resume", &["mm"]);
    qemu_io_ok(&srv, "mm", "read -P 0x6b 0 4k");
}

#[test]
fn removing_a_device_holding_ram_data_needs_force() {
    let srv = Serve::start(STACK, "mm");
    srv.ok("create", &["empty", "--table", "0 64 memory"]);
    qemu_io_ok(&srv, "mm", "write -P 0x77 0 4k");
    srv.ok("unexport", &["mm"]);
    let before = srv.snapshot();
    let err = srv.fails("remove", &["mm"]);
    assert!(
        err.contains("device-mapper: remove ioctl on mm failed: Device or resource busy")
            && err.contains("device mm: remove would discard data held in RAM: '0 8192 memory' holds 4096 bytes"),
        "{err}"
    );
    assert_eq!(srv.snapshot(), before);
    // Nothing written: nothing to lose.
    srv.ok("remove", &["empty"]);
    srv.ok("remove", &["-f", "mm"]);
    assert!(!srv.ok("ls", &[]).contains("mm"));
}

#[test]
fn serve_memory_limit_bounds_all_memory_devices_together() {
    // Two 4 MiB RAM disks under a 16 KiB process budget: four pages in all,
    // whichever device takes them.
    let srv = Serve::options()
        .args(&[
            "--concise",
            "ma,,,rw,0 8192 memory;mc,,,rw,0 8192 memory",
            "--export",
            "ma,mc",
        ])
        .args(&["--memory-limit", "16K"])
        .start();
    qemu_io_ok(&srv, "ma", "write -P 0x44 0 8k");
    qemu_io_ok(&srv, "mc", "write -P 0x55 0 8k");
    let (ok, out) = qemu_io(&srv, "ma", "write -P 0x66 1M 4k");
    assert!(!ok || out.contains("No space left on device"), "{out}");
    assert!(out.contains("No space left on device"), "{out}");
    qemu_io_ok(&srv, "ma", "read -P 0x44 0 8k");
    qemu_io_ok(&srv, "mc", "read -P 0x55 0 8k");
    // A page freed on one device is there for the other.
    qemu_io_ok(&srv, "mc", "discard 4k 4k");
    qemu_io_ok(&srv, "ma", "write -P 0x66 1M 4k");
}

#[test]
fn serve_refuses_a_malformed_memory_limit() {
    for (bad, want) in [
        ("12Q", "is not a size"),
        ("100", "at least one 4096-byte page"),
    ] {
        let o = Command::new(blkstack_bin())
            .args(["serve", "--concise", "m,,,rw,0 8 memory", "--export", "m"])
            .args(["--memory-limit", bad])
            .output()
            .expect("run blkstack");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "--memory-limit {bad} accepted");
        assert!(
            err.contains("--memory-limit") && err.contains(want),
            "{err}"
        );
    }
}
