//! Raw-socket interop tests against the real `blkstack serve` binary:
//! clients that break the protocol get errors or are hung up on, while
//! well-behaved clients connected at the same time keep being served; many
//! connections at once keep their data apart; SIGTERM stops gracefully.

use blkstack_nbd::client::{RawClient, Reply};
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

/// A TCP client whose receive buffer is 4 KiB (set before connecting, so
/// the window stays small): the server's replies stop short often, in
/// the middle of a header or of a read's data.
fn tcp_small_window(srv: &Serve) -> RawClient<TcpStream> {
    use std::os::fd::FromRawFd;
    let addr: std::net::SocketAddrV4 = srv.tcp_addr().parse().expect("ipv4 address");
    // SAFETY: plain syscalls on a fresh fd, owned by the TcpStream below;
    // `sa` and `rcvbuf` are valid for the calls.
    let s = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let s = TcpStream::from_raw_fd(fd);
        let rcvbuf: libc::c_int = 4096;
        let r = libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&rcvbuf as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        assert_eq!(r, 0, "SO_RCVBUF: {}", std::io::Error::last_os_error());
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: addr.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*addr.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        let r = libc::connect(
            fd,
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        assert_eq!(r, 0, "connect: {}", std::io::Error::last_os_error());
        s
    };
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    RawClient::new(s)
}

/// The handle of the next reply, left unread: bytes 8..16 of a simple
/// reply and of a structured chunk header alike.
fn peek_handle(s: &TcpStream) -> u64 {
    let mut h = [0u8; 16];
    loop {
        let n = s.peek(&mut h).expect("peek reply");
        assert!(n > 0, "the server closed the connection");
        if n == h.len() {
            return u64::from_be_bytes(h[8..16].try_into().expect("8 bytes"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Read the reply to READ `handle` of `want.len()` bytes from `off`
/// (simple, or structured: data and hole chunks, in any order, covering
/// the range exactly once) and check every byte against `want`; how many
/// hole chunks it had.
fn check_read_reply<S: Read + Write>(
    c: &mut RawClient<S>,
    handle: u64,
    off: u64,
    want: &[u8],
) -> usize {
    let mut holes = 0;
    let mut got = vec![0xa5u8; want.len()];
    let mut covered = 0usize;
    loop {
        match c.any_reply().expect("reply") {
            Reply::Simple(r) => {
                assert_eq!((r.handle, r.error), (handle, 0), "simple reply");
                c.s.read_exact(&mut got).expect("read data");
                covered = want.len();
                break;
            }
            Reply::Chunk(h, p) => {
                assert_eq!(h.handle, handle, "replies to one READ are not interleaved");
                let at = |p: &[u8]| u64::from_be_bytes(p[..8].try_into().expect("8 bytes"));
                match h.typ {
                    REPLY_TYPE_OFFSET_DATA => {
                        let rel = (at(&p) - off) as usize;
                        got[rel..rel + p.len() - 8].copy_from_slice(&p[8..]);
                        covered += p.len() - 8;
                    }
                    REPLY_TYPE_OFFSET_HOLE => {
                        let rel = (at(&p) - off) as usize;
                        let n = u32::from_be_bytes(p[8..12].try_into().expect("4 bytes")) as usize;
                        got[rel..rel + n].fill(0);
                        holes += 1;
                        covered += n;
                    }
                    t => panic!("unexpected chunk type {t} for READ {handle}"),
                }
                if h.flags & REPLY_FLAG_DONE != 0 {
                    break;
                }
            }
        }
    }
    assert_eq!(
        covered,
        want.len(),
        "READ {handle}: chunks cover the range once"
    );
    assert!(
        got == want,
        "READ {handle} ({} bytes at {off}): data differs",
        want.len()
    );
    holes
}

/// Reads of mixed sizes (512 B, copied into the reply, to 1 MiB, sent
/// from the request's own buffer) pipelined 96 deep, all asked for before
/// any reply is read: replies pile up past the socket buffers, so the
/// server's sends stop short and resume (on a 4 KiB TCP window, mid
/// header and mid data). The memory is written in stripes, so structured
/// replies mix data and hole chunks. Every byte is checked, with simple
/// and structured replies, then the connection ends cleanly.
#[test]
fn pipelined_mixed_reads_return_every_byte_simple_and_structured() {
    let srv = Serve::start_tcp(STACK, "mem");
    let size = 32usize << 20;
    let mut image = vec![0u8; size];
    let data = pattern(size, 11);
    let mut w = unix(&srv);
    w.start().expect("greeting");
    w.go("mem").expect("go");
    // Written: 1 MiB in every 3 MiB, and a 4 KiB page every 40 KiB.
    let mut writes: Vec<(usize, usize)> =
        (0..size).step_by(3 << 20).map(|o| (o, 1 << 20)).collect();
    writes.extend((0..size).step_by(40 << 10).map(|o| (o, 4096)));
    for (i, (o, l)) in writes.into_iter().enumerate() {
        image[o..o + l].copy_from_slice(&data[o..o + l]);
        let r = req(CMD_WRITE, 0, i as u64, o as u64, l as u32);
        w.request(&r, &image[o..o + l]).expect("send write");
        assert_eq!(w.status_reply().expect("write reply"), (i as u64, 0));
    }
    let sizes = [
        512usize,
        4096,
        1 << 20,
        64 << 10,
        8192,
        200 << 10,
        4608,
        128 << 10,
    ];
    for (structured, small_window) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut c = if small_window {
            tcp_small_window(&srv)
        } else {
            tcp(&srv)
        };
        c.start().expect("greeting");
        if structured {
            c.structured().expect("structured replies");
        }
        c.go("mem").expect("go");
        let mut reqs = Vec::new();
        let mut burst = Vec::new();
        let mut holes = 0;
        for i in 0..96u64 {
            let len = sizes[i as usize % sizes.len()];
            let off = (i as usize * 1_234_567 % (size - len)) / 512 * 512;
            reqs.push((i, off));
            burst.extend_from_slice(&req(CMD_READ, 0, i, off as u64, len as u32).encode());
        }
        c.s.write_all(&burst).expect("send reads");
        // Replies come back in completion order: check each by its handle.
        for _ in 0..reqs.len() {
            let handle = peek_handle(&c.s);
            let (_, off) = reqs[handle as usize];
            let len = sizes[handle as usize % sizes.len()];
            holes += check_read_reply(&mut c, handle, off as u64, &image[off..off + len]);
        }
        // Structured replies to reads over the stripes split into chunks.
        assert_eq!(
            holes > 0,
            structured,
            "hole chunks in structured replies only"
        );
        c.request(&req(CMD_DISC, 0, 0, 0, 0), &[])
            .expect("disconnect");
        assert!(hung_up(&mut c), "the server closes after NBD_CMD_DISC");
    }
    let (st, err) = srv.terminate();
    assert!(st.success(), "server exit {st}: {err}");
}
