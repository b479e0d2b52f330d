//! Hostile peers against the real `blkstack serve`: raw-socket clients
//! that pipeline requests and never read the replies, that stop reading
//! mid-stream, that hold handshakes open, a process out of threads, and
//! socket paths that name a user's file. Each test asserts what must hold
//! whatever one client does: the server's memory stays within its
//! per-connection budget, other clients keep being served, the server
//! stays up (only a signal stops it, gracefully) and no file is deleted.
//! The bounds are those nbdkit and qemu-nbd keep: a client that does not
//! read its replies stops being read (backpressure) and, past the send
//! timeout, is disconnected.

mod tls_support;

use blkstack_nbd::client::RawClient;
use blkstack_nbd::proto::*;
use blkstack_test_support::*;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::{Duration, Instant};

/// 4 GiB of `null` (no memory behind it): reads cost the server only
/// what it buffers. `slow` completes on null's completion thread, which
/// every connection of the export shares.
const BIG: &str = "big,,,rw,0 8388608 null;slow,,,rw,0 8388608 null irqmode=1";

fn connect(srv: &Serve) -> UnixStream {
    let s = UnixStream::connect(&srv.nbd_socket).expect("connect unix");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s
}

fn negotiated(srv: &Serve, export: &str) -> RawClient<UnixStream> {
    let mut c = RawClient::new(connect(srv));
    c.start().expect("greeting");
    c.go(export).expect("go");
    c
}

fn read_req(handle: u64, offset: u64, len: u32) -> Request {
    Request {
        flags: 0,
        cmd: CMD_READ,
        handle,
        offset,
        len,
    }
}

/// One 4 KiB read, answered.
fn read_4k(c: &mut RawClient<UnixStream>, handle: u64) {
    c.request(&read_req(handle, handle % 1024 * 4096, 4096), &[])
        .expect("send read");
    let rep = c.simple_reply().expect("reply");
    assert_eq!((rep.error, rep.handle), (0, handle));
    let mut data = vec![0u8; 4096];
    c.s.read_exact(&mut data).expect("read data");
}

/// Send `n` READs of `len` bytes in one burst (one buffer, as a client
/// that pipelines does, so the server's reader finds thousands of them
/// at once) without reading a reply; stops early when the server stops
/// reading (its receive buffer and ours full). Returns how many went out.
fn pipeline_unread(c: &mut RawClient<UnixStream>, n: u64, len: u32) -> u64 {
    c.s.set_write_timeout(Some(Duration::from_secs(2)))
        .expect("write timeout");
    let mut burst = Vec::with_capacity(n as usize * Request::SIZE);
    for i in 0..n {
        burst.extend_from_slice(&read_req(i, i * len as u64 % (4 << 30), len).encode());
    }
    let mut sent = 0;
    while sent < burst.len() {
        match c.s.write(&burst[sent..]) {
            Ok(k) if k > 0 => sent += k,
            _ => break,
        }
    }
    (sent / Request::SIZE) as u64
}

/// The server's per-connection budget for request data in flight plus
/// replies produced but not yet sent (frontends/nbd/src/conn/mod.rs).
const BUDGET_KIB: u64 = 64 << 10;

/// `serve` of `BIG`, exporting `big`, with one more `--FLAG VALUE`.
fn serve_big_with(flag: &str, value: &str) -> Serve {
    Serve::options()
        .args(&["--concise", BIG, "--export", "big", flag, value])
        .tcp()
        .start()
}

#[test]
fn pipelined_reads_never_read_cost_at_most_the_connection_budget() {
    let srv = Serve::start_tcp(BIG, "big");
    let pid = srv.pid();
    let mut warm = negotiated(&srv, "big");
    read_4k(&mut warm, 1);
    let base = rss_kib(pid);
    // 9,000 x 64 KiB: 560 MiB of replies nobody reads.
    let mut c = negotiated(&srv, "big");
    let sent = pipeline_unread(&mut c, 9_000, 64 << 10);
    std::thread::sleep(Duration::from_secs(2));
    let grown = rss_kib(pid).saturating_sub(base);
    assert!(
        grown <= BUDGET_KIB + (32 << 10),
        "{sent} unread 64 KiB reads grew the server by {grown} KiB (budget {BUDGET_KIB} KiB)"
    );
    // Someone else is still served meanwhile.
    for h in 0..50 {
        read_4k(&mut warm, 100 + h);
    }
    // And the pipelining client gets its replies once it reads them.
    let rep = c.simple_reply().expect("first reply");
    assert_eq!(rep.error, 0);
}

#[test]
fn an_unaligned_write_zeroes_of_4_gib_allocates_no_buffer_of_that_size() {
    let srv = Serve::start_tcp(BIG, "big");
    let pid = srv.pid();
    // NBD_OPT_EXPORT_NAME: no block sizes learnt, so unaligned requests
    // are served rather than refused.
    let mut c = RawClient::new(connect(&srv));
    c.start().expect("greeting");
    c.option(OPT_EXPORT_NAME, b"big").expect("export name");
    let mut info = [0u8; 10];
    c.s.read_exact(&mut info).expect("export info");
    let base = rss_kib(pid);
    let len = u32::MAX - 4095; // just under 4 GiB, unaligned at both ends
    for h in 0..2 {
        let r = Request {
            flags: 0,
            cmd: CMD_WRITE_ZEROES,
            handle: h,
            offset: 100,
            len,
        };
        c.request(&r, &[]).expect("send write zeroes");
        c.s.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let rep = c.simple_reply().expect("write zeroes reply");
        assert_eq!((rep.error, rep.handle), (0, h));
    }
    let grown = rss_kib(pid).saturating_sub(base);
    assert!(
        grown < 64 << 10,
        "two unaligned 4 GiB zeroings grew the server by {grown} KiB"
    );
}

/// Two clients stop reading mid-stream, one with simple replies to 64 KiB
/// reads, one with structured replies to 1 MiB reads (both sent from the
/// requests' own buffers, which stay held until sent): nobody else is
/// frozen meanwhile, both are cut off past the send timeout, and their
/// slots are given back: a new connection is served and the server then
/// stops gracefully (its drain waits for every slot of every connection).
#[test]
fn a_client_that_stops_reading_freezes_nobody_else_and_is_cut_off() {
    let srv = Serve::options()
        .args(&["--concise", BIG, "--export", "slow", "--send-timeout", "2"])
        .tcp()
        .start();
    let mut stalled = negotiated(&srv, "slow");
    // 128 MiB of replies: far more than both socket buffers hold.
    pipeline_unread(&mut stalled, 2_000, 64 << 10);
    let mut stalled_big = RawClient::new(connect(&srv));
    stalled_big.start().expect("greeting");
    stalled_big.structured().expect("structured replies");
    stalled_big.go("slow").expect("go");
    pipeline_unread(&mut stalled_big, 200, 1 << 20);
    std::thread::sleep(Duration::from_millis(500));
    // The export's completion thread must not be stuck in a send to it.
    let mut other = negotiated(&srv, "slow");
    other
        .s
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let t0 = Instant::now();
    for h in 0..200 {
        read_4k(&mut other, h);
    }
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "200 reads of another client took {:?}",
        t0.elapsed()
    );
    // Past the send timeout the stalled clients are disconnected: what
    // was in flight on the wire drains, then EOF.
    std::thread::sleep(Duration::from_secs(4));
    for c in [&mut stalled, &mut stalled_big] {
        c.s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut buf = vec![0u8; 1 << 20];
        let t1 = Instant::now();
        let closed = loop {
            match c.s.read(&mut buf) {
                Ok(0) | Err(_) => break true,
                Ok(_) if t1.elapsed() > Duration::from_secs(20) => break false,
                Ok(_) => {}
            }
        };
        assert!(closed, "a stalled client was never disconnected");
    }
    read_4k(&mut other, 999);
    let mut fresh = negotiated(&srv, "slow");
    read_4k(&mut fresh, 1000);
    drop((other, fresh));
    let (st, err) = srv.terminate();
    assert!(st.success(), "server exit {st}: {err}");
}

fn prlimit_as(pid: u32, limit: &str) {
    run_ok(
        Command::new("prlimit")
            .arg(format!("--pid={pid}"))
            .arg(format!("--as={limit}")),
        Duration::from_secs(10),
    );
}

#[test]
fn out_of_threads_a_connection_is_refused_and_the_server_stays_up() {
    let srv = Serve::start_tcp(BIG, "big");
    let pid = srv.pid();
    let mut warm = negotiated(&srv, "big");
    read_4k(&mut warm, 1);
    // No room for another thread's stack (root ignores --nproc; an
    // address-space limit fails pthread_create the same way).
    let limit = (status_kib(pid, "VmSize") + 512) * 1024;
    prlimit_as(pid, &format!("{limit}:unlimited"));
    let mut refused = 0;
    for _ in 0..3 {
        let mut c = RawClient::new(connect(&srv));
        if c.start().is_err() {
            refused += 1;
        }
    }
    prlimit_as(pid, "unlimited:unlimited");
    assert!(refused > 0, "no connection was refused under the limit");
    std::thread::sleep(Duration::from_millis(300));
    let log = srv.stderr_text();
    assert!(
        log.contains("cannot start a connection thread"),
        "no log line for the refused connection:\n{log}"
    );
    // Still up, serving, and it stops gracefully on a signal.
    read_4k(&mut warm, 2);
    let mut c = negotiated(&srv, "big");
    read_4k(&mut c, 3);
    drop((c, warm));
    let (st, err) = srv.terminate();
    assert!(st.success(), "serve exited with {st}: {err}");
    assert!(err.contains("devices flushed"), "{err}");
}

#[test]
fn silent_handshakes_do_not_lock_negotiated_clients_out() {
    let srv = serve_big_with("--max-connections", "2");
    // Two sockets that connect and never speak.
    let silent: Vec<UnixStream> = (0..2).map(|_| connect(&srv)).collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut a = negotiated(&srv, "big");
    let mut b = negotiated(&srv, "big");
    read_4k(&mut a, 1);
    read_4k(&mut b, 2);
    drop(silent);
}

#[test]
fn a_handshake_that_finds_every_place_taken_is_refused_at_go() {
    let srv = serve_big_with("--max-connections", "1");
    // Admitted while a place was free, it chooses its export only after
    // another client took the last place.
    let mut late = RawClient::new(connect(&srv));
    late.start().expect("greeting");
    let mut first = negotiated(&srv, "big");
    let e = late.go("big").expect_err("GO with every place taken");
    assert!(e.to_string().contains("too many connections"), "{e}");
    read_4k(&mut first, 1);
}

#[test]
fn handshakes_beyond_their_own_pool_are_closed_at_once() {
    let srv = serve_big_with("--max-handshakes", "2");
    let silent: Vec<UnixStream> = (0..2).map(|_| connect(&srv)).collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut third = connect(&srv);
    let mut b = [0u8; 1];
    assert!(
        matches!(third.read(&mut b), Ok(0)),
        "a third handshake must be closed"
    );
    drop(silent);
    // Once they leave, handshakes are admitted again.
    let t0 = Instant::now();
    loop {
        let mut c = RawClient::new(connect(&srv));
        if c.start().is_ok() && c.go("big").is_ok() {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "never admitted");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn tls_on_with_verify_peer_warns_that_plaintext_clients_skip_it() {
    let dir = Scratch::new("tlswarn");
    tls_support::certificates(&dir.0);
    let certs = dir.0.to_str().expect("utf-8");
    let srv = Serve::options()
        .args(&[
            "--concise",
            BIG,
            "--export",
            "big",
            "--tls",
            "on",
            "--tls-certificates",
            certs,
            "--tls-verify-peer",
        ])
        .tcp()
        .start();
    let log = srv.stderr_text();
    assert!(
        log.contains("--tls-verify-peer") && log.contains("--tls=require"),
        "no warning for --tls=on with --tls-verify-peer:\n{log}"
    );
}

/// `blkstack serve` with `--listen` / `--control` at `path`: its exit
/// status and stderr.
fn serve_at(listen: Option<&std::path::Path>, control: &std::path::Path) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_blkstack"));
    cmd.args(["serve", "--concise", BIG, "--export", "big"])
        .arg("--control")
        .arg(control);
    match listen {
        Some(p) => cmd
            .arg("--listen")
            .arg(format!("nbd+unix:///?socket={}", p.display())),
        None => cmd.args(["--listen", "nbd://127.0.0.1:0"]),
    };
    let out = run(&mut cmd, Duration::from_secs(10));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_write_payload_trickled_after_the_handshake_delays_nobody_else() {
    let srv = Serve::start_tcp(BIG, "big");
    let mut slow = negotiated(&srv, "big");
    let w = Request {
        flags: 0,
        cmd: CMD_WRITE,
        handle: 1,
        offset: 0,
        len: 1 << 20,
    };
    slow.s.write_all(&w.encode()).expect("write header");
    let mut other = negotiated(&srv, "big");
    let t0 = Instant::now();
    for h in 0..100u64 {
        if h % 10 == 0 {
            // A byte of the megabyte now and then: the slow client's
            // reader waits for the rest, on its own thread only.
            slow.s.write_all(&[0x5a]).expect("trickle");
        }
        read_4k(&mut other, h);
    }
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "another client's reads took {:?}",
        t0.elapsed()
    );
}

/// `serve_at` refused and left the file alone.
fn refused_and_kept(ok: bool, err: &str, precious: &std::path::Path) {
    assert!(
        !ok,
        "serve started over the regular file {}",
        precious.display()
    );
    assert!(
        err.contains(&precious.display().to_string()) && err.contains("not a socket"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(precious).expect("still there"),
        b"four years of work"
    );
}

#[test]
fn a_regular_file_at_a_socket_path_is_never_replaced() {
    let dir = Scratch::new("notasock");
    let precious = dir.path("thesis.txt");
    std::fs::write(&precious, b"four years of work").expect("write");
    let (ok, err) = serve_at(Some(&precious), &dir.path("control.sock"));
    refused_and_kept(ok, &err, &precious);
    let (ok, err) = serve_at(None, &precious);
    refused_and_kept(ok, &err, &precious);
}

/// One JSON-RPC call on the control socket at `ctl`; the reply line.
fn rpc(ctl: &std::path::Path, method: &str, params: serde_json::Value) -> serde_json::Value {
    let mut s = UnixStream::connect(ctl).expect("connect control");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let req = serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    writeln!(s, "{req}").expect("send request");
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(s), &mut line).expect("reply");
    serde_json::from_str(&line).expect("reply is JSON")
}

/// A "server" that accepts and sends its greeting a byte every 300 ms,
/// then nothing.
fn trickling_server(path: &std::path::Path) {
    let l = std::os::unix::net::UnixListener::bind(path).expect("bind");
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { break };
            std::thread::spawn(move || {
                let mut g = NBDMAGIC.to_be_bytes().to_vec();
                g.extend_from_slice(&IHAVEOPT.to_be_bytes());
                g.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
                for b in g {
                    if s.write_all(&[b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(300));
                }
                std::thread::sleep(Duration::from_secs(60));
            });
        }
    });
}

#[test]
fn creating_an_nbd_leaf_never_blocks_the_control_socket() {
    let dir = Scratch::new("trickle");
    let remote = dir.path("trickle.sock");
    trickling_server(&remote);
    let ctl = dir.path("control.sock");
    let ctl_arg = ctl.to_str().expect("utf-8");
    let _srv = Serve::options()
        .args(&["--concise", BIG, "--export", "big", "--control", ctl_arg])
        .tcp()
        .control(Control::Given)
        .start();
    let table = format!(
        "0 2048 nbd nbd+unix:///e?socket={} timeout_ms=2000",
        remote.display()
    );
    let ctl2 = ctl.clone();
    let create = std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = rpc(
            &ctl2,
            "create",
            serde_json::json!({"name": "remote", "table": table}),
        );
        (r, t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let ls = rpc(&ctl, "ls", serde_json::json!({}));
    let took = t0.elapsed();
    assert!(ls.to_string().contains("big"), "{ls}");
    assert!(
        took < Duration::from_secs(1),
        "ls waited {took:?} for an nbd leaf's handshake"
    );
    let (r, took) = create.join().expect("create thread");
    assert!(
        r.get("error").is_some(),
        "the trickled handshake succeeded: {r}"
    );
    assert!(
        took < Duration::from_secs(5),
        "create took {took:?} with timeout_ms=2000 (an absolute deadline)"
    );
}
