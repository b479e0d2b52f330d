//! Raw-socket interop tests against the real `blkstack serve` binary:
//! clients that break the protocol get errors or are hung up on, while
//! well-behaved clients connected at the same time keep being served; many
//! connections at once keep their data apart; SIGTERM stops gracefully.

use blkstack_nbd::client::RawClient;
use blkstack_nbd::proto::*;
use blkstack_test_support::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

const STACK: &str = "mem,,,rw,0 65536 memory;ro0,,,rw,0 65536 zero";

fn unix(srv: &Serve) -> RawClient<UnixStream> {
    let s = UnixStream::connect(&srv.nbd_socket).expect("connect unix");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    RawClient::new(s)
}

fn tcp(srv: &Serve) -> RawClient<TcpStream> {
    let s = TcpStream::connect(srv.tcp_addr()).expect("connect tcp");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    RawClient::new(s)
}

fn req(cmd: u16, flags: u16, handle: u64, offset: u64, len: u32) -> Request {
    Request {
        flags,
        cmd,
        handle,
        offset,
        len,
    }
}

fn hung_up<S: Read + Write>(c: &mut RawClient<S>) -> bool {
    let mut b = [0u8; 64];
    // Drain anything the server said before closing; EOF or reset = closed.
    for _ in 0..16 {
        match c.s.read(&mut b) {
            Ok(0) | Err(_) => return true,
            Ok(_) => continue,
        }
    }
    false
}

fn read_back<S: Read + Write>(c: &mut RawClient<S>, handle: u64, off: u64, len: usize) -> Vec<u8> {
    c.request(&req(CMD_READ, 0, handle, off, len as u32), &[])
        .expect("send read");
    let r = c.simple_reply().expect("read reply");
    assert_eq!((r.handle, r.error), (handle, 0));
    let mut v = vec![0u8; len];
    c.s.read_exact(&mut v).expect("read data");
    v
}

#[test]
fn malformed_handshakes_and_requests_leave_other_clients_served() {
    let srv = Serve::start_tcp(STACK, "mem,ro0:ro");
    let mut good = tcp(&srv);
    good.start().expect("greeting");
    good.structured().expect("structured");
    good.go("mem").expect("go");

    // Garbage instead of client flags and options.
    let mut c = unix(&srv);
    c.greeting().expect("greeting");
    c.s.write_all(&[0xffu8; 64]).expect("write");
    assert!(hung_up(&mut c), "garbage client flags not dropped");

    // Wrong option magic after a good start.
    let mut c = unix(&srv);
    c.start().expect("greeting");
    c.s.write_all(b"NOTMAGIC\0\0\0\x07\0\0\0\0").expect("write");
    assert!(hung_up(&mut c), "bad option magic not dropped");

    // Unknown option and truncated GO data: errors, session continues.
    let mut c = unix(&srv);
    c.start().expect("greeting");
    c.option(0x4242, &[1, 2, 3]).expect("option");
    assert_eq!(c.option_reply().expect("reply").0.rep, REP_ERR_UNSUP);
    c.option(OPT_GO, &[0, 0, 1, 0]).expect("option");
    assert_eq!(c.option_reply().expect("reply").0.rep, REP_ERR_INVALID);
    c.option(OPT_STRUCTURED_REPLY, b"junk").expect("option");
    assert_eq!(c.option_reply().expect("reply").0.rep, REP_ERR_INVALID);
    c.go("mem").expect("go after errors");
    // Bad requests: errors, then the stream is still in sync.
    for (r, want) in [
        (req(CMD_READ, 0, 1, 32 << 20, 4096), EINVAL),
        (req(CMD_READ, 0, 2, 7, 4096), EINVAL),
        (req(CMD_READ, 0, 3, 0, 65 << 20), EINVAL),
        (req(77, 0, 4, 0, 512), EINVAL),
        (req(CMD_WRITE_ZEROES, 0x100, 5, 0, 512), EINVAL),
    ] {
        c.request(&r, &[]).expect("send");
        assert_eq!(c.status_reply().expect("reply"), (r.handle, want), "{r:?}");
    }
    c.request(&req(CMD_WRITE, 0, 6, 4096, 512), &[3u8; 512])
        .expect("send");
    assert_eq!(c.status_reply().expect("reply"), (6, 0));
    assert_eq!(read_back(&mut c, 7, 4096, 512), vec![3u8; 512]);
    // Then a torn request header: this client is dropped...
    c.s.write_all(&[0x25, 0x60, 0x95]).expect("write");
    drop(c);

    // ...and the read-only export refuses writes with EPERM.
    let mut ro = unix(&srv);
    ro.start().expect("greeting");
    ro.go("ro0").expect("go");
    ro.request(&req(CMD_WRITE, CMD_FLAG_FUA, 9, 0, 4096), &[1u8; 4096])
        .expect("send");
    assert_eq!(ro.status_reply().expect("reply"), (9, EPERM));

    // The first client never noticed any of it.
    good.request(&req(CMD_READ, 0, 10, 4096, 512), &[])
        .expect("send");
    match good.any_reply().expect("reply") {
        blkstack_nbd::client::Reply::Chunk(h, p) => {
            assert_eq!(h.handle, 10);
            assert!(h.typ == REPLY_TYPE_OFFSET_DATA || h.typ == REPLY_TYPE_OFFSET_HOLE);
            if h.typ == REPLY_TYPE_OFFSET_DATA {
                assert_eq!(&p[8..], &[3u8; 512][..]);
            }
        }
        other => panic!("structured client got {other:?}"),
    }
    let (st, err) = srv.terminate();
    assert!(st.success(), "server exit {st}: {err}");
}

/// Pipeline 32 writes into this client's own region, collect the replies
/// in whatever order they come, then read every block back.
fn exercise<S: Read + Write>(mut c: RawClient<S>, i: u8) {
    let region = i as u64 * (1 << 20);
    let byte = |k: u64| i.wrapping_mul(31).wrapping_add(k as u8);
    c.start().expect("greeting");
    c.go("mem").expect("go");
    let mut handles = std::collections::HashSet::new();
    for k in 0..32u64 {
        c.request(
            &req(CMD_WRITE, 0, k, region + k * 4096, 4096),
            &[byte(k); 4096],
        )
        .expect("send");
        handles.insert(k);
    }
    for _ in 0..32 {
        let (h, e) = c.status_reply().expect("reply");
        assert_eq!(e, 0);
        assert!(handles.remove(&h), "unknown or repeated handle {h}");
    }
    for k in 0..32u64 {
        assert_eq!(
            read_back(&mut c, 100 + k, region + k * 4096, 4096),
            vec![byte(k); 4096]
        );
    }
}

#[test]
fn many_connections_at_once_keep_their_data_apart() {
    let srv = Serve::start_tcp(STACK, "mem");
    let threads: Vec<_> = (0..8u8)
        .map(|i| {
            let path = srv.nbd_socket.clone();
            let tcp_addr = srv.tcp_addr().to_string();
            std::thread::spawn(move || {
                if i % 2 == 0 {
                    let s = UnixStream::connect(&path).expect("connect");
                    s.set_read_timeout(Some(Duration::from_secs(10)))
                        .expect("timeout");
                    exercise(RawClient::new(s), i);
                } else {
                    let s = TcpStream::connect(&tcp_addr).expect("connect");
                    s.set_read_timeout(Some(Duration::from_secs(10)))
                        .expect("timeout");
                    exercise(RawClient::new(s), i);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("client thread");
    }
    let (st, err) = srv.terminate();
    assert!(st.success(), "server exit {st}: {err}");
}

#[test]
fn sigterm_stops_gracefully_and_removes_the_socket() {
    let srv = Serve::start_tcp(STACK, "mem");
    let mut c = unix(&srv);
    c.start().expect("greeting");
    c.go("mem").expect("go");
    c.request(&req(CMD_WRITE, 0, 1, 0, 4096), &[5u8; 4096])
        .expect("send");
    assert_eq!(c.status_reply().expect("reply"), (1, 0));
    let sock = srv.nbd_socket.clone();
    let (st, err) = srv.terminate();
    assert!(st.success(), "server exit {st}: {err}");
    assert!(err.contains("devices flushed"), "{err}");
    assert!(!sock.exists(), "socket file left behind");
    // The connection that was open is closed by the stop.
    assert!(hung_up(&mut c));
}
