//! Interop tests: the real NBD clients against the real `blkstack serve`.
//! fio's nbd engine (libnbd), qemu-img and qemu-io (qemu's own NBD client),
//! nbdinfo and nbdcopy (libnbd) each talk to the server over TCP or a Unix
//! socket; data is checked end to end (fio's crc32c verify, qemu-img
//! compare, byte comparison of copies).

use blkstack_test_support::*;
use std::process::Command;
use std::time::Duration;

const T: Duration = Duration::from_secs(120);
/// 64 MiB memory device, a 64 MiB zero device, a 64 MiB null device.
const STACK: &str = "mem,,,rw,0 131072 memory;zero,,,rw,0 131072 zero;nul,,,rw,0 131072 null";

fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn fio_nbd_engine_randrw_with_crc32c_verify() {
    let fio = tool("fio");
    let srv = Serve::start_tcp(STACK, "mem");
    for (uri, extra) in [
        (srv.tcp_uri("mem"), vec!["--bs=4k", "--iodepth=16"]),
        (
            srv.uri("mem"),
            vec!["--bsrange=512-64k", "--iodepth=8", "--numjobs=1"],
        ),
        // Small reads copied into the reply beside large ones sent from
        // their requests' buffers, at depth.
        (
            srv.uri("mem"),
            vec!["--bssplit=4k/40:64k/20:256k/20:1m/20", "--iodepth=32"],
        ),
    ] {
        let out = run_ok(
            Command::new(&fio)
                .args([
                    "--name=nbdjob",
                    "--ioengine=nbd",
                    &format!("--uri={uri}"),
                    "--rw=randrw",
                    "--size=16m",
                    "--verify=crc32c",
                    "--do_verify=1",
                    "--verify_fatal=1",
                    "--randrepeat=0",
                    "--verify_state_save=0",
                ])
                .args(&extra),
            T,
        );
        let t = text(&out);
        assert!(t.contains("err= 0"), "fio reported an error:\n{t}");
        assert!(
            !t.contains("verify failed") && !t.contains("bad magic"),
            "fio verify failure:\n{t}"
        );
        assert!(
            t.contains("READ: bw="),
            "fio did not read anything back:\n{t}"
        );
    }
    let (st, err) = srv.terminate();
    assert!(st.success(), "server exit {st}: {err}");
}

/// `--poll-us auto`: fio writes and reads back with crc32c verify at
/// QD1, where the adaptive window opens, and at QD64 with two jobs, where
/// it shuts, over the Unix socket; the server then stops cleanly on
/// SIGTERM. (Fixed bounds: the nbd crate's concurrent_flush tests; one
/// setting here keeps `make test` short.)
#[test]
fn adaptive_polling_serves_qd1_and_qd64_with_verify_and_stops() {
    let fio = tool("fio");
    let poll = "auto";
    let srv = Serve::options()
        .args(&["--concise", STACK, "--export", "mem", "--poll-us", poll])
        .start();
    for (qd, jobs) in [("1", "1"), ("64", "2")] {
        let out = run_ok(
            Command::new(&fio).args([
                "--name=poll",
                "--ioengine=nbd",
                &format!("--uri={}", srv.uri("mem")),
                "--rw=randwrite",
                "--bs=4k",
                &format!("--iodepth={qd}"),
                &format!("--numjobs={jobs}"),
                "--size=4m",
                "--offset_increment=8m",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
                "--randrepeat=0",
                "--verify_state_save=0",
                "--group_reporting",
            ]),
            T,
        );
        let t = text(&out);
        assert!(t.contains("err= 0"), "--poll-us {poll} QD{qd}:\n{t}");
        assert!(
            !t.contains("verify failed") && !t.contains("bad magic"),
            "--poll-us {poll} QD{qd} verify failure:\n{t}"
        );
        assert!(
            t.contains("READ: bw="),
            "--poll-us {poll} QD{qd} read nothing:\n{t}"
        );
    }
    let (st, err) = srv.terminate();
    assert!(st.success(), "--poll-us {poll}: server exit {st}: {err}");
}

#[test]
fn bad_poll_settings_are_refused_by_name() {
    for (bad, says) in [("auto:0", "auto:0"), ("soon", "soon"), ("20000", "at most")] {
        let out = run(
            Command::new(env!("CARGO_BIN_EXE_blkstack")).args([
                "serve",
                "--concise",
                STACK,
                "--export",
                "mem",
                "--poll-us",
                bad,
            ]),
            T,
        );
        assert!(!out.status.success(), "--poll-us {bad} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--poll-us") && err.contains(says),
            "--poll-us {bad}: {err}"
        );
    }
}

#[test]
fn qemu_img_info_convert_and_compare_both_ways() {
    let qemu_img = tool("qemu-img");
    let srv = Serve::start_tcp(STACK, "mem");
    let dir = Scratch::new("qemu");
    let src = dir.path("src.raw");
    pattern_file_with_holes(&src, 8 << 20, 7);
    let uri = srv.tcp_uri("mem");

    let info = run_ok(Command::new(&qemu_img).args(["info", &uri]), T);
    let t = text(&info);
    assert!(t.contains("virtual size: 64 MiB (67108864 bytes)"), "{t}");

    // File -> export (no create: the export exists), then compare.
    run_ok(
        Command::new(&qemu_img)
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&src)
            .arg(&uri),
        T,
    );
    // qemu-img compare fails unless the first 8 MiB are identical; the rest
    // of the export must read as zeroes ("Images are identical" with -s off
    // treats the larger image's tail that way).
    let cmp = run_ok(
        Command::new(&qemu_img)
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&src)
            .arg(&uri),
        T,
    );
    assert!(
        text(&cmp).contains("Images are identical"),
        "{}",
        text(&cmp)
    );

    // Export -> file, byte-compared with the source.
    let back = dir.path("back.raw");
    run_ok(
        Command::new(&qemu_img)
            .args(["convert", "-f", "raw", "-O", "raw", &uri])
            .arg(&back),
        T,
    );
    let a = std::fs::read(&src).expect("src");
    let b = std::fs::read(&back).expect("back");
    assert_eq!(b.len(), 64 << 20);
    assert!(b[..a.len()] == a[..], "round trip changed the data");
    assert!(b[a.len()..].iter().all(|&x| x == 0), "tail not zero");
    let (st, err) = srv.terminate();
    assert!(st.success(), "server exit {st}: {err}");
}

#[test]
fn qemu_io_reads_and_writes_patterns() {
    let qemu_io = tool("qemu-io");
    let srv = Serve::start_tcp(STACK, "mem,zero:ro");
    let uri = srv.uri("mem");
    let out = run_ok(
        Command::new(&qemu_io).args([
            "-f",
            "raw",
            "-c",
            "write -P 0xab 1M 64k",
            "-c",
            "write -P 0xcd 3M 512",
            "-c",
            "read -P 0xab 1M 64k",
            "-c",
            "read -P 0xcd 3M 512",
            "-c",
            "read -P 0 0 4k",
            "-c",
            "write -z 1M 4k",
            "-c",
            "read -P 0 1M 4k",
            "-c",
            "flush",
            &uri,
        ]),
        T,
    );
    let t = text(&out);
    assert!(!t.contains("failed") && !t.contains("error"), "{t}");
    assert_eq!(t.matches("read ").count(), 4, "{t}");

    // A pattern that is not there must be noticed (the check above can fail).
    let bad = run(
        Command::new(&qemu_io).args(["-f", "raw", "-c", "read -P 0x11 1M 4k", &uri]),
        T,
    );
    assert!(
        text(&bad).contains("Pattern verification failed"),
        "{}",
        text(&bad)
    );

    // The read-only export refuses writes.
    let ro = run(
        Command::new(&qemu_io).args(["-f", "raw", "-r", "-c", "read -P 0 0 64k", &srv.uri("zero")]),
        T,
    );
    assert!(
        ro.status.success() && !text(&ro).contains("failed"),
        "{}",
        text(&ro)
    );
    let w = run(
        Command::new(&qemu_io).args(["-f", "raw", "-c", "write -P 1 0 4k", &srv.uri("zero")]),
        T,
    );
    let wt = text(&w);
    // qemu sees NBD_FLAG_READ_ONLY and refuses to open the export for
    // writing (writes that get through anyway are refused with EPERM:
    // see the raw-socket tests).
    assert!(
        !w.status.success()
            && (wt.contains("Permission denied") || wt.contains("Operation not permitted")),
        "write to a read-only export was not refused: {wt}"
    );
}

#[test]
fn nbdinfo_size_block_sizes_list_and_map() {
    let nbdinfo = tool("nbdinfo");
    let srv = Serve::start_tcp(STACK, "mem,zero:ro,nul");
    let out = run_ok(Command::new(&nbdinfo).arg(srv.tcp_uri("mem")), T);
    let t = text(&out);
    for want in [
        "export-size: 67108864",
        "block_size_minimum: 512",
        "block_size_preferred: 4096",
        "block_size_maximum: 67108864",
        "can_multi_conn: true",
        "can_zero: true",
        "is_read_only: false",
        "base:allocation",
    ] {
        assert!(t.contains(want), "nbdinfo lacks {want:?}:\n{t}");
    }
    let size = run_ok(Command::new(&nbdinfo).args(["--size", &srv.uri("zero")]), T);
    assert_eq!(String::from_utf8_lossy(&size.stdout).trim(), "67108864");
    let ro = run_ok(Command::new(&nbdinfo).arg(srv.uri("zero")), T);
    assert!(text(&ro).contains("is_read_only: true"), "{}", text(&ro));

    let list = run_ok(Command::new(&nbdinfo).args(["--list", &srv.uri("")]), T);
    let lt = text(&list);
    for e in ["export=\"mem\"", "export=\"zero\"", "export=\"nul\""] {
        assert!(lt.contains(e), "--list lacks {e}:\n{lt}");
    }

    // The zero device is one hole; a fresh memory device too, until written.
    let map = run_ok(Command::new(&nbdinfo).args(["--map", &srv.uri("zero")]), T);
    let mt = text(&map);
    assert!(mt.contains("hole,zero"), "{mt}");
}

#[test]
fn nbdcopy_round_trip_over_multiple_connections() {
    let nbdcopy = tool("nbdcopy");
    let srv = Serve::start_tcp(STACK, "mem");
    let dir = Scratch::new("copy");
    let src = dir.path("src.raw");
    pattern_file_with_holes(&src, 64 << 20, 11);
    // nbdcopy uses several connections when the server offers multi-conn.
    run_ok(
        Command::new(&nbdcopy)
            .args(["--connections=4", "--requests=16"])
            .arg(&src)
            .arg(srv.uri("mem")),
        T,
    );
    let back = dir.path("back.raw");
    run_ok(
        Command::new(&nbdcopy)
            .args(["--connections=4"])
            .arg(srv.tcp_uri("mem"))
            .arg(&back),
        T,
    );
    let a = std::fs::read(&src).expect("src");
    let b = std::fs::read(&back).expect("back");
    assert!(a == b, "nbdcopy round trip changed the data");
    let (st, err) = srv.terminate();
    assert!(st.success(), "server exit {st}: {err}");
    assert!(err.contains("devices flushed"), "{err}");
}
