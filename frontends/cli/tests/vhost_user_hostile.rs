//! Hostile vhost-user clients (issue 35, items 1 and 7) against the real
//! `blkstack serve`: raw vhost-user messages (qemu's
//! docs/interop/vhost-user.rst) over the socket, guest memory in a memfd
//! this test creates and shrinks. A region declared larger than its file
//! is refused; a file shrunk under a live queue fails that connection
//! only; a silent connection is dropped at the handshake deadline and
//! never holds up another VMM; a crowd beyond the connection cap is
//! closed at once; a guest's event index (`used_event`) at any value
//! decides only whether it is called, never whether its requests are
//! answered. Through all of it serve stays up and its NBD export and
//! control socket keep answering.

use blkstack_nbd::client::RawClient;
use blkstack_test_support::*;
use blkstack_vhost_user_blk::fuzzing::send_with_fds;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const STACK: &str = "mem,,,rw,0 2048 memory";

// Front-end message types and flags (vhost-user.rst).
const GET_FEATURES: u32 = 1;
const SET_FEATURES: u32 = 2;
const SET_OWNER: u32 = 3;
const SET_MEM_TABLE: u32 = 5;
const SET_VRING_NUM: u32 = 8;
const SET_VRING_ADDR: u32 = 9;
const SET_VRING_BASE: u32 = 10;
const SET_VRING_KICK: u32 = 12;
const SET_VRING_CALL: u32 = 13;
const GET_PROTOCOL_FEATURES: u32 = 15;
const SET_PROTOCOL_FEATURES: u32 = 16;
const SET_VRING_ENABLE: u32 = 18;
const VERSION: u32 = 1;
const NEED_REPLY: u32 = 1 << 3;
const F_PROTOCOL_FEATURES: u64 = 1 << 30;
const F_VERSION_1: u64 = 1 << 32;
const F_EVENT_IDX: u64 = 1 << 29;
const PROTOCOL_REPLY_ACK: u64 = 1 << 3;

/// Where the VMM pretends the memory sits in its address space.
const USER_ADDR: u64 = 0x7f00_0000_0000;
const MEMFD_LEN: u64 = 64 << 10;
// The queue inside the memfd: 16 descriptors, rings, one write request.
const DESC: u64 = 0;
const AVAIL: u64 = 0x400;
const USED: u64 = 0x800;
const HDR: u64 = 0x1000;
const STATUS: u64 = 0x1100;
const DATA: u64 = 0xE000;

/// The serve under test and its socket, in a directory removed when the
/// test ends.
fn serve() -> (Serve, PathBuf, tempfile::TempDir) {
    let dir = tempfile::Builder::new()
        .prefix("blkstack-vu-")
        .tempdir()
        .expect("socket dir");
    let sock = dir.path().join("vhost.sock");
    let arg = format!("{}:mem", sock.display());
    let srv = Serve::options()
        .args(&["--concise", STACK, "--export", "mem"])
        .args(&["--vhost-user-blk", &arg])
        .start();
    (srv, sock, dir)
}

/// serve is alive and its other frontends answer.
fn others_still_served(srv: &mut Serve) {
    assert_eq!(srv.exited(), None, "blkstack serve died");
    let out = srv.run("ls", &[]);
    assert!(out.status.success(), "control socket: {}", out.stderr);
    let s = UnixStream::connect(&srv.nbd_socket).expect("nbd connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut c = RawClient::new(s);
    c.start().expect("nbd greeting");
    let (size, _) = c.go("mem").expect("nbd go");
    assert_eq!(size, 2048 * 512);
}

struct Vu {
    s: UnixStream,
}

impl Vu {
    fn connect(path: &PathBuf) -> Vu {
        let s = UnixStream::connect(path).expect("connect vhost-user");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Vu { s }
    }

    fn send(&mut self, req: u32, flags: u32, body: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
        let mut msg = Vec::with_capacity(12 + body.len());
        msg.extend_from_slice(&req.to_le_bytes());
        msg.extend_from_slice(&(VERSION | flags).to_le_bytes());
        msg.extend_from_slice(&(body.len() as u32).to_le_bytes());
        msg.extend_from_slice(body);
        send_with_fds(&self.s, &msg, fds)
    }

    /// Read a reply's u64 body; `None` if the server closed instead.
    fn reply_u64(&mut self) -> Option<u64> {
        let mut hdr = [0u8; 12];
        self.s.read_exact(&mut hdr).ok()?;
        let mut body = [0u8; 8];
        self.s.read_exact(&mut body).ok()?;
        Some(u64::from_le_bytes(body))
    }

    /// The setup every VMM starts with: owner, features, protocol
    /// features with REPLY_ACK.
    fn setup(&mut self) -> std::io::Result<()> {
        self.setup_with(0)
    }

    /// [`Vu::setup`] with the virtio features `extra` on top.
    fn setup_with(&mut self, extra: u64) -> std::io::Result<()> {
        self.send(SET_OWNER, 0, &[], &[])?;
        self.send(GET_FEATURES, 0, &[], &[])?;
        self.reply_u64().ok_or(std::io::ErrorKind::UnexpectedEof)?;
        self.send(GET_PROTOCOL_FEATURES, 0, &[], &[])?;
        self.reply_u64().ok_or(std::io::ErrorKind::UnexpectedEof)?;
        self.send(
            SET_PROTOCOL_FEATURES,
            0,
            &PROTOCOL_REPLY_ACK.to_le_bytes(),
            &[],
        )?;
        let f = F_VERSION_1 | F_PROTOCOL_FEATURES | extra;
        self.send(SET_FEATURES, 0, &f.to_le_bytes(), &[])
    }

    /// SET_MEM_TABLE of one region at guest address 0; the ack (0 is
    /// success), or `None` if the server closed the connection.
    fn mem_table(&mut self, fd: RawFd, size: u64) -> Option<u64> {
        let mut b = Vec::new();
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        for v in [0, size, USER_ADDR, 0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        self.send(SET_MEM_TABLE, NEED_REPLY, &b, &[fd]).ok()?;
        self.reply_u64()
    }

    /// Queue 0 on the rings in the memfd, kicked by `kick`; errors are
    /// ignored (a server that refused may have closed already).
    fn queue(&mut self, kick: RawFd, call: RawFd) {
        let state = |num: u32| [0u32.to_le_bytes(), num.to_le_bytes()].concat();
        let _ = self.send(SET_VRING_NUM, 0, &state(16), &[]);
        let mut addr = Vec::new();
        addr.extend_from_slice(&0u32.to_le_bytes());
        addr.extend_from_slice(&0u32.to_le_bytes());
        for a in [DESC, USED, AVAIL, 0] {
            addr.extend_from_slice(&(USER_ADDR + a).to_le_bytes());
        }
        let _ = self.send(SET_VRING_ADDR, 0, &addr, &[]);
        let _ = self.send(SET_VRING_BASE, 0, &state(0), &[]);
        let _ = self.send(SET_VRING_CALL, 0, &0u64.to_le_bytes(), &[call]);
        let _ = self.send(SET_VRING_KICK, 0, &0u64.to_le_bytes(), &[kick]);
        let _ = self.send(SET_VRING_ENABLE, 0, &state(1), &[]);
    }

    /// Has the server closed this connection within `limit`? (Replies
    /// that arrive meanwhile are skipped.)
    fn closed_within(&mut self, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        let mut b = [0u8; 256];
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            self.s.set_read_timeout(Some(left)).unwrap();
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return false
                }
                Err(_) => return true,
            }
        }
    }
}

fn memfd() -> OwnedFd {
    // SAFETY: a fresh memfd, owned below.
    let fd = unsafe { libc::memfd_create(c"vu-guest".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create");
    // SAFETY: fd is ours.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    truncate(&fd, MEMFD_LEN);
    fd
}

fn truncate(fd: &OwnedFd, len: u64) {
    // SAFETY: ftruncate on our own memfd.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len as i64) }, 0);
}

fn pwrite(fd: &OwnedFd, off: u64, data: &[u8]) {
    // SAFETY: data is a live slice; fd is our memfd.
    let n = unsafe {
        libc::pwrite(
            fd.as_raw_fd(),
            data.as_ptr() as *const libc::c_void,
            data.len(),
            off as i64,
        )
    };
    assert_eq!(n, data.len() as isize);
}

fn eventfd() -> OwnedFd {
    // SAFETY: a fresh eventfd, owned below.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fd is ours.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// Put one virtio-blk write (header, 4 KiB at `data`, status) on the
/// rings in the memfd.
fn write_request(mem: &OwnedFd, data: u64) {
    let desc = |addr: u64, len: u32, flags: u16, next: u16| {
        [
            addr.to_le_bytes().to_vec(),
            len.to_le_bytes().to_vec(),
            flags.to_le_bytes().to_vec(),
            next.to_le_bytes().to_vec(),
        ]
        .concat()
    };
    let (next, write) = (1u16, 2u16);
    pwrite(mem, DESC, &desc(HDR, 16, next, 1));
    pwrite(mem, DESC + 16, &desc(data, 4096, next, 2));
    pwrite(mem, DESC + 32, &desc(STATUS, 1, write, 0));
    let mut hdr = [0u8; 16];
    hdr[0] = 1; // VIRTIO_BLK_T_OUT, sector 0
    pwrite(mem, HDR, &hdr);
    pwrite(mem, STATUS, &[0xff]);
    // avail: flags 0, idx 1, ring[0] = head 0.
    pwrite(mem, AVAIL, &[0, 0, 1, 0, 0, 0]);
}

fn pread(fd: &OwnedFd, off: u64, buf: &mut [u8]) {
    // SAFETY: buf is a live mutable slice; fd is our memfd.
    let n = unsafe {
        libc::pread(
            fd.as_raw_fd(),
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            off as i64,
        )
    };
    assert_eq!(n, buf.len() as isize);
}

fn kick(fd: &OwnedFd) {
    let one = 1u64.to_le_bytes();
    // SAFETY: an 8-byte write to our eventfd.
    unsafe { libc::write(fd.as_raw_fd(), one.as_ptr() as *const libc::c_void, 8) };
}

/// A region declared `size` bytes over a 64 KiB memfd, then a request
/// whose data lies past the file's end.
fn oversized_region(size: u64) {
    let (mut srv, sock, _dir) = serve();
    let mem = memfd();
    let (k, c) = (eventfd(), eventfd());
    let mut vu = Vu::connect(&sock);
    vu.setup().expect("setup");
    let ack = vu.mem_table(mem.as_raw_fd(), size);
    // Whatever the server said, try what a hostile VMM would do next.
    write_request(&mem, MEMFD_LEN + 0x10000);
    vu.queue(k.as_raw_fd(), c.as_raw_fd());
    kick(&k);
    std::thread::sleep(Duration::from_millis(500));
    others_still_served(&mut srv);
    assert!(
        matches!(ack, None | Some(1..)),
        "a {size}-byte region over a {MEMFD_LEN}-byte memfd was accepted (ack {ack:?})"
    );
    assert!(vu.closed_within(Duration::from_secs(5)), "connection kept");
}

#[test]
fn a_region_larger_than_its_memfd_is_refused() {
    oversized_region(1 << 30);
}

#[test]
fn a_region_of_2_pow_46_bytes_is_refused() {
    oversized_region(1 << 46);
}

#[test]
fn a_memfd_shrunk_under_a_live_queue_fails_that_connection_only() {
    let (mut srv, sock, _dir) = serve();
    let mem = memfd();
    let (k, c) = (eventfd(), eventfd());
    let mut vu = Vu::connect(&sock);
    vu.setup().expect("setup");
    assert_eq!(
        vu.mem_table(mem.as_raw_fd(), MEMFD_LEN),
        Some(0),
        "a fitting table"
    );
    write_request(&mem, DATA);
    vu.queue(k.as_raw_fd(), c.as_raw_fd());
    // The data page goes: the server's mapping of it now has no file
    // page behind it.
    truncate(&mem, 0x2000);
    kick(&k);
    assert!(vu.closed_within(Duration::from_secs(10)), "connection kept");
    others_still_served(&mut srv);
    // And a new VMM is served as before.
    let mut again = Vu::connect(&sock);
    again.setup().expect("a new VMM after the failed one");
}

#[test]
fn a_silent_connection_is_dropped_and_blocks_no_other_vmm() {
    let (mut srv, sock, _dir) = serve();
    let mut silent = Vu::connect(&sock);
    std::thread::sleep(Duration::from_millis(200));
    // Another VMM sets up at once, while the silent one still holds on.
    let t0 = Instant::now();
    let mut vmm = Vu::connect(&sock);
    vmm.setup().expect("a second VMM's setup");
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "setup waited {:?}",
        t0.elapsed()
    );
    // The silent one is dropped at the handshake deadline.
    assert!(
        silent.closed_within(Duration::from_secs(15)),
        "silent peer kept"
    );
    others_still_served(&mut srv);
}

#[test]
fn connections_beyond_the_cap_are_closed_at_once() {
    let (mut srv, sock, _dir) = serve();
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut v = Vu::connect(&sock);
        v.setup().expect("setup within the cap");
        held.push(v);
    }
    // 30 more at once: each is closed promptly, none waits in a queue.
    let mut crowd: Vec<Vu> = (0..30).map(|_| Vu::connect(&sock)).collect();
    let t0 = Instant::now();
    for v in &mut crowd {
        assert!(
            v.closed_within(Duration::from_secs(5)),
            "over the cap, kept"
        );
    }
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "refusals took {:?}",
        t0.elapsed()
    );
    // The sessions within the cap still answer.
    for v in &mut held {
        v.send(GET_FEATURES, 0, &[], &[]).expect("send");
        assert!(v.reply_u64().is_some(), "a held session was dropped");
    }
    drop(held);
    std::thread::sleep(Duration::from_millis(300));
    let mut next = Vu::connect(&sock);
    next.setup().expect("a VMM after the crowd");
    others_still_served(&mut srv);
}

/// A VMM that connects and goes again and again (qemu's `reconnect=N`)
/// costs serve no descriptor: vhost-user-backend leaves each
/// connection's exit event open, and serve closes it when the
/// connection ends. Before, each round left one, until the process ran
/// out and its acceptors hung.
#[test]
fn reconnecting_vmms_leave_no_descriptors_behind() {
    let (srv, sock, _dir) = serve();
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", srv.pid()))
            .expect("serve's fds")
            .count()
    };
    let round = || {
        let mut vmm = Vu::connect(&sock);
        vmm.setup().expect("setup");
        let mem = memfd();
        assert_eq!(vmm.mem_table(mem.as_raw_fd(), MEMFD_LEN), Some(0));
        drop(vmm);
    };
    round();
    std::thread::sleep(Duration::from_millis(300));
    let before = fds();
    for _ in 0..20 {
        round();
    }
    // The last connection's end is noticed asynchronously.
    let deadline = Instant::now() + Duration::from_secs(10);
    while fds() >= before + 5 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let after = fds();
    assert!(
        after < before + 5,
        "serve had {before} descriptors before 20 VMM connections, {after} after"
    );
}

/// With EVENT_IDX negotiated, the guest's `used_event` (after the avail
/// ring) says when it wants a call; whatever it holds (behind, far
/// ahead, the wrap point), each request is answered, only the call may
/// be skipped, and the connection and serve live on.
#[test]
fn any_used_event_value_only_decides_the_call() {
    let (mut srv, sock, _dir) = serve();
    let mem = memfd();
    let (k, c) = (eventfd(), eventfd());
    let mut vu = Vu::connect(&sock);
    vu.setup_with(F_EVENT_IDX).expect("setup");
    assert_eq!(vu.mem_table(mem.as_raw_fd(), MEMFD_LEN), Some(0));
    write_request(&mem, DATA);
    // No request yet: idx 0 (write_request made it 1).
    pwrite(&mem, AVAIL + 2, &0u16.to_le_bytes());
    vu.queue(k.as_raw_fd(), c.as_raw_fd());
    // used_event sits after the 16 ring entries of the avail ring.
    let used_event = AVAIL + 4 + 2 * 16;
    for (n, ev) in [0xffffu16, 0x8000, 0x7fff, 0, 1, 0xfffe]
        .into_iter()
        .enumerate()
    {
        let n = n as u16;
        pwrite(&mem, STATUS, &[0xff]);
        pwrite(&mem, used_event, &ev.to_le_bytes());
        // The same chain again: ring[n] = head 0, then idx n + 1.
        pwrite(&mem, AVAIL + 4 + 2 * u64::from(n), &0u16.to_le_bytes());
        pwrite(&mem, AVAIL + 2, &(n + 1).to_le_bytes());
        kick(&k);
        let deadline = Instant::now() + Duration::from_secs(10);
        let (mut status, mut used) = ([0xffu8], [0u8; 2]);
        while Instant::now() < deadline {
            pread(&mem, STATUS, &mut status);
            pread(&mem, USED + 2, &mut used);
            if status[0] == 0 && u16::from_le_bytes(used) == n + 1 {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            (status[0], u16::from_le_bytes(used)),
            (0, n + 1),
            "request {n} with used_event {ev:#x} was not answered"
        );
    }
    assert!(
        !vu.closed_within(Duration::from_millis(300)),
        "the connection was closed"
    );
    others_still_served(&mut srv);
}
