//! Fuzzing entry point (cargo-fuzz's `vhost_user` target, and the stable
//! test that replays its corpus): a VMM's side of one vhost-user-blk
//! connection from bytes, against the real backend behind rust-vmm's
//! message parser, over a real unix socket, with the file descriptors a
//! VMM passes. Whatever a VMM sends, the process must live on: a bad
//! message fails that message or that connection, never `serve`.
//!
//! The input is `[u16 guest memory length][guest memory][messages]`.
//! Guest memory is a 64 KiB memfd holding those bytes (descriptor
//! tables, rings, requests). Each message is a vhost-user header
//! (`request`, `flags`, `size`, little-endian u32s) and `size` bytes of
//! body, sent as it stands, lies included. A message that carries file
//! descriptors in vhost-user gets them, as a VMM would attach them: the
//! guest memfd once per region of a memory table, a fresh eventfd for a
//! vring's kick, call or error (unless its body sets the no-fd bit).
//! Two requests of the harness's own drive the guest's side: `KICK`
//! kicks every vring kicked so far and waits (a bounded time) for a
//! call; `SHRINK` truncates the guest memfd under the live mapping, the
//! attack [`crate::guard`] exists for.

use crate::backend::BlkBackend;
use blkstack_core::DeviceRef;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

/// The guest memfd's size.
pub const GUEST_MEM: u64 = 64 << 10;
/// Harness request: kick the vrings and wait for a call.
pub const KICK: u32 = 0xffff_0001;
/// Harness request: truncate the guest memfd to the body's u64 (at most
/// [`GUEST_MEM`]).
pub const SHRINK: u32 = 0xffff_0002;
/// How long `KICK` waits for the device to call.
const CALL_WAIT: Duration = Duration::from_millis(50);
/// `KICK`s of one session that wait for a call; later ones only kick, so
/// an input of many kicks costs no more than this many waits.
const MAX_KICK_WAITS: u32 = 8;
/// Regions of one memory table the harness attaches descriptors for
/// (vhost-user's own limit is 8).
const MAX_REGIONS: usize = 8;

const SET_MEM_TABLE: u32 = 5;
const SET_LOG_BASE: u32 = 6;
const SET_LOG_FD: u32 = 7;
const SET_VRING_KICK: u32 = 12;
const SET_VRING_CALL: u32 = 13;
const SET_VRING_ERR: u32 = 14;
const SET_BACKEND_REQ_FD: u32 = 21;
const SET_INFLIGHT_FD: u32 = 32;
const ADD_MEM_REG: u32 = 37;
/// A vring fd message's body bit that says no fd comes with it.
const VRING_NOFD: u64 = 0x100;

/// One fuzzed connection to a backend over `dev`.
pub fn session(dev: DeviceRef, input: &[u8]) {
    let Some((mem_len, rest)) = input.split_first_chunk::<2>() else {
        return;
    };
    let mem_len = usize::from(u16::from_le_bytes(*mem_len)).min(rest.len());
    let (guest, messages) = rest.split_at(mem_len);
    let Some(mut vmm) = Vmm::new(guest) else {
        return;
    };
    let Ok(backend) = BlkBackend::new("fuzz", dev, false, 1) else {
        return;
    };
    let path = socket_path();
    let Ok(mut listener) = Listener::new(&path, true) else {
        return;
    };
    let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
    let Ok(mut daemon) = VhostUserDaemon::new("blkstack-fuzz".into(), backend.clone(), mem) else {
        return;
    };
    let Ok(stream) = UnixStream::connect(&path) else {
        return;
    };
    let _ = std::fs::remove_file(&path);
    if daemon.start(&mut listener).is_err() {
        return;
    }
    backend.set_connection(daemon.shutdown_handle());
    let _ = stream.set_nonblocking(true);
    vmm.run(&stream, messages);
    let _ = stream.shutdown(std::net::Shutdown::Both);
    drop(stream);
    let _ = daemon.wait();
    backend.stop_workers();
    drop(daemon);
    backend.end_connection();
}

/// A socket path of this process's own.
fn socket_path() -> std::path::PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("blkstack-vu-fuzz-{}-{n}.sock", std::process::id()))
}

/// The VMM's side: its guest memory and the eventfds it handed over.
struct Vmm {
    guest: OwnedFd,
    kicks: Vec<OwnedFd>,
    calls: Vec<OwnedFd>,
    others: Vec<OwnedFd>,
    kick_waits: u32,
}

impl Vmm {
    fn new(content: &[u8]) -> Option<Vmm> {
        // SAFETY: the name is a NUL-terminated literal; a new fd results.
        let fd = unsafe { libc::memfd_create(c"vu-fuzz-guest".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let guest = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut f = std::fs::File::from(guest.try_clone().ok()?);
        f.set_len(GUEST_MEM).ok()?;
        f.write_all(&content[..content.len().min(GUEST_MEM as usize)])
            .ok()?;
        Some(Vmm {
            guest,
            kicks: Vec::new(),
            calls: Vec::new(),
            others: Vec::new(),
            kick_waits: 0,
        })
    }

    /// Send each message of `bytes`, draining replies as they come.
    fn run(&mut self, s: &UnixStream, mut bytes: &[u8]) {
        while let Some((hdr, _)) = bytes.split_first_chunk::<12>() {
            let word = |i: usize| u32::from_le_bytes([hdr[i], hdr[i + 1], hdr[i + 2], hdr[i + 3]]);
            let (request, size) = (word(0), word(8) as usize);
            let end = 12usize.saturating_add(size).min(bytes.len());
            let (msg, rest) = bytes.split_at(end);
            bytes = rest;
            let body = &msg[12..];
            let ok = match request {
                KICK => {
                    self.kick_and_wait();
                    true
                }
                SHRINK => {
                    self.shrink(body);
                    true
                }
                _ => {
                    let fds = self.fds_for(request, body);
                    send_with_fds(s, msg, &fds).is_ok()
                }
            };
            drain(s);
            if !ok {
                return;
            }
        }
    }

    /// The descriptors a VMM attaches to `request` with this `body`.
    fn fds_for(&mut self, request: u32, body: &[u8]) -> Vec<RawFd> {
        let u64_body = body.first_chunk::<8>().map(|b| u64::from_le_bytes(*b));
        match request {
            SET_MEM_TABLE => {
                let n = body
                    .first_chunk::<4>()
                    .map_or(0, |b| u32::from_le_bytes(*b));
                vec![self.guest.as_raw_fd(); (n as usize).min(MAX_REGIONS)]
            }
            ADD_MEM_REG | SET_LOG_BASE | SET_INFLIGHT_FD => vec![self.guest.as_raw_fd()],
            SET_VRING_KICK | SET_VRING_CALL | SET_VRING_ERR
                if u64_body.is_some_and(|v| v & VRING_NOFD == 0) =>
            {
                let Some(e) = eventfd() else {
                    return Vec::new();
                };
                let fd = e.as_raw_fd();
                match request {
                    SET_VRING_KICK => self.kicks.push(e),
                    SET_VRING_CALL => self.calls.push(e),
                    _ => self.others.push(e),
                }
                vec![fd]
            }
            SET_LOG_FD | SET_BACKEND_REQ_FD => match eventfd() {
                Some(e) => {
                    let fd = e.as_raw_fd();
                    self.others.push(e);
                    vec![fd]
                }
                None => Vec::new(),
            },
            _ => Vec::new(),
        }
    }

    fn kick_and_wait(&mut self) {
        for k in &self.kicks {
            let one = 1u64.to_le_bytes();
            // SAFETY: an 8-byte write from a live buffer to our eventfd.
            unsafe { libc::write(k.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
        let mut polls: Vec<libc::pollfd> = self
            .calls
            .iter()
            .map(|c| libc::pollfd {
                fd: c.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        self.kick_waits += 1;
        if !polls.is_empty() && self.kick_waits <= MAX_KICK_WAITS {
            // SAFETY: `polls` is a live array of that many pollfds.
            unsafe {
                libc::poll(
                    polls.as_mut_ptr(),
                    polls.len() as _,
                    CALL_WAIT.as_millis() as i32,
                )
            };
        }
    }

    fn shrink(&self, body: &[u8]) {
        let len = body
            .first_chunk::<8>()
            .map_or(0, |b| u64::from_le_bytes(*b));
        // SAFETY: ftruncate on our own memfd.
        unsafe { libc::ftruncate(self.guest.as_raw_fd(), len.min(GUEST_MEM) as i64) };
    }
}

/// Read and drop whatever the backend has replied so far.
fn drain(s: &UnixStream) {
    let mut b = [0u8; 512];
    while matches!((&*s).read(&mut b), Ok(n) if n > 0) {}
}

fn eventfd() -> Option<OwnedFd> {
    // SAFETY: creates a new eventfd; nothing else owns it.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    // SAFETY: `fd` is ours when non-negative.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `sendmsg` of `msg` with `fds` attached (SCM_RIGHTS), as a VMM sends
/// vhost-user messages; a full socket buffer is waited out briefly. The
/// scripted VMM of the hostile-VMM tests sends with it too.
pub fn send_with_fds(s: &UnixStream, msg: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: msg.as_ptr() as *mut libc::c_void,
        iov_len: msg.len(),
    };
    let bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(bytes as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; every pointer set below is valid for
    // the duration of sendmsg.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    if !fds.is_empty() {
        mh.msg_control = cbuf.as_mut_ptr().cast();
        mh.msg_controllen = space;
        // SAFETY: the control buffer holds one header with room for `fds`.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&mh);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes as u32) as usize;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
        }
    }
    for _ in 0..100 {
        // SAFETY: mh points at live buffers.
        let n = unsafe { libc::sendmsg(s.as_raw_fd(), &mh, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return if n as usize == msg.len() {
                Ok(())
            } else {
                Err(std::io::ErrorKind::WriteZero.into())
            };
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::WouldBlock {
            return Err(e);
        }
        drain(s);
        std::thread::sleep(Duration::from_millis(1));
    }
    Err(std::io::ErrorKind::TimedOut.into())
}
