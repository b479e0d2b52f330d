//! What clients may cost `blkstack serve`, checked against the real
//! binary: the connection cap closes extra connections at once, a
//! handshake trickled byte by byte is cut at an absolute deadline (an idle
//! timeout that every byte restarts lets a slowloris client keep a thread
//! for ever), an accept loop out of file descriptors backs off and logs at
//! a bounded rate instead of spinning, an idle negotiated connection
//! keeps little resident memory, and a request may be as large as
//! nbdkit's limit (64 MiB) but no larger.

use blkstack_nbd::client::RawClient;
use blkstack_nbd::proto::*;
use blkstack_test_support::*;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::{Duration, Instant};

const STACK: &str = "mem,,,rw,0 65536 memory";

fn connect(srv: &Serve) -> UnixStream {
    let s = UnixStream::connect(&srv.nbd_socket).expect("connect unix");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s
}

/// A client that negotiated `mem` with NBD_OPT_GO.
fn negotiated(srv: &Serve) -> RawClient<UnixStream> {
    let mut c = RawClient::new(connect(srv));
    c.start().expect("greeting");
    c.go("mem").expect("go");
    c
}

fn read_4k(c: &mut RawClient<UnixStream>, handle: u64) {
    let r = Request {
        flags: 0,
        cmd: CMD_READ,
        handle,
        offset: handle * 4096 % (32 << 20),
        len: 4096,
    };
    c.request(&r, &[]).expect("send read");
    let rep = c.simple_reply().expect("reply");
    assert_eq!((rep.error, rep.handle), (0, handle));
    let mut data = vec![0u8; 4096];
    c.s.read_exact(&mut data).expect("read data");
}

/// The server closed `s` without sending anything: EOF, not a timeout.
fn closed_at_once(s: &mut UnixStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0))
}

#[test]
fn connections_over_the_cap_are_closed_at_once() {
    let srv = Serve::options()
        .args(&[
            "--concise",
            STACK,
            "--export",
            "mem",
            "--max-connections",
            "2",
        ])
        .tcp()
        .start();
    let a = negotiated(&srv);
    let mut b = negotiated(&srv);
    let mut c = connect(&srv);
    assert!(closed_at_once(&mut c), "a third connection must be closed");
    // Those under the cap keep working.
    read_4k(&mut b, 1);
    drop(a);
    // Once one leaves (its thread ends), a new client is served again.
    let t0 = Instant::now();
    loop {
        let mut d = RawClient::new(connect(&srv));
        if d.start().is_ok() {
            d.go("mem").expect("go after a slot freed");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "never served again");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A server whose handshake deadline is 2 s, and a client connected to it.
fn with_handshake_deadline_2s() -> (Serve, RawClient<UnixStream>) {
    let srv = Serve::options()
        .args(&[
            "--concise",
            STACK,
            "--export",
            "mem",
            "--handshake-timeout",
            "2",
        ])
        .tcp()
        .start();
    let c = RawClient::new(connect(&srv));
    (srv, c)
}

#[test]
fn a_handshake_trickled_byte_by_byte_is_cut_at_the_deadline() {
    let (_srv, mut c) = with_handshake_deadline_2s();
    c.greeting().expect("greeting");
    let t0 = Instant::now();
    // Client flags, then an option header: far more bytes than fit in the
    // deadline at one every 200 ms, each well inside any idle timeout.
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
    bytes.extend_from_slice(&IHAVEOPT.to_be_bytes());
    bytes.extend_from_slice(&OPT_LIST.to_be_bytes());
    bytes.extend_from_slice(&0u32.to_be_bytes());
    bytes.truncate(bytes.len() - 1); // never complete the option
    let mut cut = None;
    for b in bytes.iter().chain(std::iter::repeat_n(&0u8, 100)) {
        if c.s.write_all(&[*b]).is_err() {
            cut = Some(t0.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let cut = cut.expect("the server never cut the trickling client off");
    assert!(
        cut >= Duration::from_millis(1500),
        "cut before the deadline: {cut:?}"
    );
    assert!(
        cut < Duration::from_secs(15),
        "cut far after the deadline: {cut:?}"
    );
}

#[test]
fn a_handshake_client_that_never_reads_replies_is_cut_at_the_deadline() {
    let (_srv, mut c) = with_handshake_deadline_2s();
    c.start().expect("greeting");
    c.s.set_write_timeout(Some(Duration::from_millis(200)))
        .expect("write timeout");
    // NBD_OPT_LIST over and over, never reading a reply: both socket
    // buffers fill and the server's replies block.
    let mut opt = Vec::new();
    opt.extend_from_slice(&IHAVEOPT.to_be_bytes());
    opt.extend_from_slice(&OPT_LIST.to_be_bytes());
    opt.extend_from_slice(&0u32.to_be_bytes());
    let t0 = Instant::now();
    let cut = loop {
        match c.s.write(&opt) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => break t0.elapsed(),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the server kept a client that never reads for 20 s"
        );
    };
    assert!(
        cut < Duration::from_secs(15),
        "cut far after the deadline: {cut:?}"
    );
}

/// User plus system CPU time of process `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = after.split(' ').collect();
    // Fields 14 and 15 of stat(5), counted from the state (field 3).
    f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime")
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .count()
}

#[test]
fn out_of_descriptors_the_accept_loop_backs_off_and_logs_rarely() {
    let srv = Serve::start_tcp(STACK, "mem");
    let pid = srv.pid();
    let limit = open_fds(pid) + 5;
    run_ok(
        Command::new("prlimit")
            .arg(format!("--pid={pid}"))
            .arg(format!("--nofile={limit}:{limit}")),
        Duration::from_secs(10),
    );
    let before = cpu_ticks(pid);
    let t0 = Instant::now();
    // More connections than the server has descriptors for; they queue in
    // the listen backlog and keep the listener readable.
    let held: Vec<UnixStream> = (0..40).map(|_| connect(&srv)).collect();
    std::thread::sleep(Duration::from_secs(3));
    let spent = cpu_ticks(pid) - before;
    let wall = t0.elapsed().as_secs_f64();
    let ticks = 100.0; // USER_HZ on Linux
    let log = srv.stderr_text();
    let lines = log.lines().filter(|l| l.contains("accept failed")).count();
    assert!(lines >= 1, "the shortage must be reported once:\n{log}");
    assert!(
        lines <= 3,
        "{lines} accept-failure lines in {wall:.1} s:\n{log}"
    );
    assert!(
        (spent as f64 / ticks) < wall / 3.0,
        "the accept loop used {spent} ticks of CPU in {wall:.1} s"
    );
    drop(held);
    // Descriptors free again: the server accepts and serves within its
    // longest back-off.
    let t1 = Instant::now();
    loop {
        let mut c = RawClient::new(connect(&srv));
        if c.start().is_ok() && c.go("mem").is_ok() {
            break;
        }
        assert!(t1.elapsed() < Duration::from_secs(10), "never recovered");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn an_idle_negotiated_connection_keeps_at_most_64_kib() {
    const WARM: u64 = 20;
    const MORE: u64 = 200;
    let srv = Serve::start_tcp(STACK, "mem");
    let pid = srv.pid();
    // Warm up the allocator's per-thread arenas first, so the measure is
    // what each further connection costs.
    let mut conns: Vec<_> = (0..WARM).map(|_| negotiated(&srv)).collect();
    for (i, c) in conns.iter_mut().enumerate() {
        read_4k(c, i as u64);
    }
    // Past the idle time (2 s) every connection has trimmed its buffers.
    std::thread::sleep(Duration::from_secs(4));
    let base = rss_kib(pid);
    for i in 0..MORE {
        let mut c = negotiated(&srv);
        read_4k(&mut c, i);
        conns.push(c);
    }
    std::thread::sleep(Duration::from_secs(4));
    let grown = rss_kib(pid).saturating_sub(base);
    let per = grown / MORE;
    assert!(
        per <= 64,
        "{MORE} idle connections grew RSS by {grown} KiB: {per} KiB each"
    );
    // Still negotiated and served after trimming.
    read_4k(&mut conns[0], 7);
}

/// Requests up to 64 MiB (nbdkit's limit, advertised in
/// NBD_INFO_BLOCK_SIZE) go through for libnbd; one block more is
/// refused with EINVAL and the connection goes on.
#[test]
fn requests_up_to_64_mib_are_served_and_larger_ones_refused() {
    let srv = Serve::start_tcp("big,,,rw,0 262144 memory", "big");
    // fio's nbd engine (libnbd, which itself refuses a request over the
    // server's advertised maximum): 64 MiB writes, verified by reading.
    let out = run_ok(
        Command::new(tool("fio")).args([
            "--name=big",
            "--ioengine=nbd",
            &format!("--uri={}", srv.uri("big")),
            "--rw=write",
            "--bs=64m",
            "--size=128m",
            "--verify=crc32c",
            "--do_verify=1",
            "--output-format=terse",
        ]),
        Duration::from_secs(120),
    );
    assert!(
        out.status.success(),
        "fio: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut c = RawClient::new(UnixStream::connect(&srv.nbd_socket).expect("connect"));
    c.s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    c.start().expect("greeting");
    c.go("big").expect("go");
    let too_big = Request {
        flags: 0,
        cmd: CMD_READ,
        handle: 1,
        offset: 0,
        len: (64 << 20) + 512,
    };
    c.request(&too_big, &[]).expect("send");
    let rep = c.simple_reply().expect("reply");
    assert_eq!((rep.error, rep.handle), (EINVAL, 1));
    let ok = Request {
        handle: 2,
        len: 64 << 20,
        ..too_big
    };
    c.request(&ok, &[]).expect("send");
    let rep = c.simple_reply().expect("reply");
    assert_eq!((rep.error, rep.handle), (0, 2));
    let mut data = vec![0u8; 64 << 20];
    c.s.read_exact(&mut data).expect("read data");
}
