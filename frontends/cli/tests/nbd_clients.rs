//! Interop tests: the real NBD clients against the real `blkstack serve`.
//! fio's nbd engine (libnbd), qemu-img and qemu-io (qemu's own NBD client),
//! nbdinfo and nbdcopy (libnbd) each talk to the server over TCP or a Unix
//! socket; data is checked end to end (fio's crc32c verify, qemu-img
//! compare, byte comparison of copies). A `delay` table's held bios are
//! reaped by the connections' readers, and backed up by the target's
//! workers while one reader is stalled.

use blkstack_nbd::client::RawClient;
use blkstack_nbd::proto::*;
use blkstack_test_support::*;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
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

/// A client on the Unix socket that negotiated `name` with NBD_OPT_GO.
fn raw_client(srv: &Serve, name: &str) -> RawClient<UnixStream> {
    let s = UnixStream::connect(&srv.nbd_socket).expect("connect unix");
    s.set_read_timeout(Some(T)).expect("timeout");
    let mut c = RawClient::new(s);
    c.start().expect("greeting");
    c.go(name).expect("go");
    c
}

/// A `delay` stat of device `d` (see docs/TARGETS.md).
fn delay_stat(srv: &Serve, key: &str) -> u64 {
    let text = srv.ok("message", &["d", "0", "stats"]);
    text.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {text:?}"))
}

/// A `delay` table (hybrid, as scripts/bench-peers.sh runs it) over
/// memory, served to three connections: one idle, one stalled (its reader
/// blocked in the middle of a WRITE's payload with eight READs held in
/// the target), and fio with crc32c verify. Every connection claims the
/// target's held bios; the stalled one's READs are answered all the same
/// (by the workers' backstop: nobody else reaps them), fio's data checks
/// out while it is stalled, fio's bios are sent on by its own reader,
/// and the stalled WRITE completes once its payload comes.
#[test]
fn delay_bios_are_reaped_by_readers_and_a_stalled_one_is_backed_up() {
    let fio = tool("fio");
    let stack = "mem,,,rw,0 65536 memory;d,,,rw,0 65536 delay /dev/mapper/mem 0 1 spin_us=0";
    let srv = Serve::options()
        .args(&["--concise", stack, "--export", "d"])
        .start();
    let mut idle = raw_client(&srv, "d");
    let mut stalled = raw_client(&srv, "d");
    // Eight READs at 16 MiB, then a 64 KiB WRITE at 20 MiB with only its
    // first 4 KiB, in one send: the reader submits the READs, then blocks
    // for the rest of the payload.
    let mut burst = Vec::new();
    for h in 0..8u64 {
        let r = Request {
            flags: 0,
            cmd: CMD_READ,
            handle: h,
            offset: (16 << 20) + h * 4096,
            len: 4096,
        };
        burst.extend_from_slice(&r.encode());
    }
    let payload: Vec<u8> = (0..64 << 10).map(|i: u32| (i * 7 % 251) as u8).collect();
    let write = Request {
        flags: 0,
        cmd: CMD_WRITE,
        handle: 100,
        offset: 20 << 20,
        len: 64 << 10,
    };
    burst.extend_from_slice(&write.encode());
    burst.extend_from_slice(&payload[..4096]);
    stalled.s.write_all(&burst).expect("send the burst");
    let mut data = vec![0u8; 4096];
    let mut handles = Vec::new();
    for _ in 0..8 {
        let rep = stalled.simple_reply().expect("a READ reply while stalled");
        assert_eq!(rep.error, 0, "READ {}", rep.handle);
        stalled.s.read_exact(&mut data).expect("READ data");
        assert!(data.iter().all(|&b| b == 0), "fresh memory reads zeroes");
        handles.push(rep.handle);
    }
    handles.sort_unstable();
    assert_eq!(handles, (0..8).collect::<Vec<_>>());
    // Only the backstop could send them on: the stalled reader waits for
    // its payload and the idle one has nothing in flight.
    assert_eq!(delay_stat(&srv, "backstop"), 8);
    assert_eq!(delay_stat(&srv, "reaped"), 0);

    let out = run_ok(
        Command::new(&fio).args([
            "--name=delayed",
            "--ioengine=nbd",
            &format!("--uri={}", srv.uri("d")),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=4m",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--randrepeat=0",
            "--verify_state_save=0",
        ]),
        T,
    );
    let t = text(&out);
    assert!(t.contains("err= 0"), "fio reported an error:\n{t}");
    assert!(
        !t.contains("verify failed") && !t.contains("bad magic"),
        "fio verify failure:\n{t}"
    );
    assert!(t.contains("READ: bw="), "fio read nothing back:\n{t}");
    // fio's reader reaps its bios (the backstop takes one only after it
    // has waited half a tick past its deadline, which load may make
    // happen now and then: no share is asserted).
    let reaped = delay_stat(&srv, "reaped");
    assert!(reaped > 0, "fio's reader reaped none of its bios");

    // The stalled WRITE completes with the rest of its payload, and reads
    // back.
    stalled
        .s
        .write_all(&payload[4096..])
        .expect("rest of the payload");
    let rep = stalled.simple_reply().expect("WRITE reply");
    assert_eq!((rep.handle, rep.error), (100, 0));
    let back = Request {
        flags: 0,
        cmd: CMD_READ,
        handle: 101,
        offset: 20 << 20,
        len: 64 << 10,
    };
    stalled.request(&back, &[]).expect("read back");
    let rep = stalled.simple_reply().expect("READ reply");
    assert_eq!((rep.handle, rep.error), (101, 0));
    let mut got = vec![0u8; 64 << 10];
    stalled.s.read_exact(&mut got).expect("data");
    assert!(got == payload, "the stalled WRITE's data did not read back");
    // The idle connection is served too.
    let r = Request {
        flags: 0,
        cmd: CMD_READ,
        handle: 7,
        offset: 20 << 20,
        len: 4096,
    };
    idle.request(&r, &[]).expect("idle read");
    let rep = idle.simple_reply().expect("idle reply");
    assert_eq!((rep.handle, rep.error), (7, 0));
    idle.s.read_exact(&mut data).expect("data");
    assert!(data[..] == payload[..4096]);
    drop((idle, stalled));
    let (st, err) = srv.terminate();
    assert!(st.success(), "server exit {st}: {err}");
}
