//! One client connection: the fixed-newstyle handshake, then the
//! transmission phase.
//!
//! Threading model (why it looks like this): every connection has exactly
//! one thread, its reader. The reader parses requests and submits bios
//! straight into the export's device — no queue or hand-off between
//! threads per I/O, because a futex wake across vCPUs costs about 10 µs on
//! the machines this runs on, more than the rest of an I/O. Whoever
//! completes a bio writes its reply: the device's completion thread, or
//! the reader itself when the device completes inline. Replies go through
//! one per-connection writer lock ([`Out`]); while the reader is working
//! through requests that are already in its receive buffer it marks the
//! connection as "batching", and replies produced meanwhile are only
//! appended to the output buffer, to leave in one `send` when the reader is
//! about to block. Replies are therefore sent in completion order, not
//! request order, as the protocol allows.
//!
//! Each request in flight owns a slot (its index is the bio's cookie, as a
//! blk-mq tag is a request's index): a reusable, page-aligned data buffer
//! and the few fields needed to write the reply. Slots are preallocated up
//! to [`MAX_INFLIGHT`] per connection, so in steady state no I/O allocates
//! in this file (the one exception: a structured READ on a device that
//! knows its holes asks for the device's extent map, a `Vec`, to answer
//! with OFFSET_HOLE chunks instead of zeroes). Slot accounting has its own
//! lock, apart from the writer lock, so the reader keeps starting requests
//! while a completer is busy sending a large reply. Before blocking for
//! input the reader may poll the socket for a bounded time, yielding the
//! CPU between polls, and only while such polls keep finding requests
//! ([`crate::spin`]); it also asks the scheduler for a short slice so that
//! its wake-up is not queued behind a CPU-bound thread. While requests are
//! in flight it sleeps on the socket and an eventfd that the completer of
//! the last of them signals ([`IdleWake`]). A fixed 10-20 µs poll without
//! those rules lowered the median IOPS at QD1 and QD64 here under load and
//! raised CPU per I/O. When every slot is busy, or the requests in flight
//! already hold [`INFLIGHT_BYTES`] of data, the reader stops reading: that is the
//! connection's queue depth limit and the client's backpressure, and it
//! bounds the memory one client can make the server hold.

use crate::export::Export;
use crate::proto::*;
use crate::sock::Sock;
use crate::spin::{SpinOutcome, SpinPolicy, PREEMPT_GAP_NS};
use blkstack_core::clock;
use blkstack_core::device::Extent;
use blkstack_core::{AlignedBuf, Bio, BioFlags, EndIo, IoBuf, Op, Status};
use parking_lot::{Condvar, Mutex};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Requests one connection may have in flight at once.
pub const MAX_INFLIGHT: usize = 256;
/// Largest option payload accepted during the handshake; anything larger is
/// a client misbehaving (real options are a few hundred bytes).
const MAX_OPTION_LEN: u32 = 1 << 20;
/// Options one connection may send before being cut off (a client looping
/// on NBD_OPT_LIST must not keep a thread for ever).
const MAX_OPTIONS: u32 = 10_000;
/// A client silent this long during the handshake is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);
/// Reads larger than this are sent straight from the slot's buffer with
/// `sendmsg` instead of being copied into the output buffer.
const COPY_LIMIT: usize = 64 << 10;
const INBUF: usize = 256 << 10;
/// Data buffers larger than this are given back when their request
/// completes, so an idle connection keeps at most this much per slot.
const KEEP_BUF: usize = 256 << 10;
/// Bytes of READ/WRITE data one connection may have in flight: 256 slots
/// of 32 MiB would otherwise let one client pin 8 GiB of server memory.
const INFLIGHT_BYTES: usize = 128 << 20;
/// Context id of `base:allocation` on this server.
const BASE_ALLOCATION_ID: u32 = 1;
/// At most this many block-status descriptors per reply (the spec lets a
/// server stop early; clients ask again from where it stopped).
const MAX_DESCRIPTORS: usize = 1024;

/// Buffered receive side. `fill` is the only place the reader blocks.
struct InBuf {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl InBuf {
    fn new() -> InBuf {
        InBuf {
            buf: vec![0u8; INBUF].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    fn available(&self) -> usize {
        self.end - self.start
    }

    /// Read more bytes from the socket; `Ok(false)` at end of stream.
    fn fill(&mut self, sock: &Sock) -> io::Result<bool> {
        self.make_room();
        let n = sock.recv(&mut self.buf[self.end..])?;
        self.end += n;
        Ok(n > 0)
    }

    /// Like [`fill`](Self::fill) but never blocks: `Ok(None)` when nothing
    /// is queued on the socket yet.
    fn try_fill(&mut self, sock: &Sock) -> io::Result<Option<bool>> {
        self.make_room();
        let n = sock.recv_nowait(&mut self.buf[self.end..])?;
        if let Some(n) = n {
            self.end += n;
        }
        Ok(n.map(|n| n > 0))
    }

    fn make_room(&mut self) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.buf.len() || (self.start > 0 && self.available() < 4096) {
            // Move the partial message to the front (cheap: it is small,
            // or the buffer is full) so the next recv can take a lot.
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }

    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0u8; N];
        a.copy_from_slice(&self.buf[self.start..self.start + N]);
        self.start += N;
        a
    }
}

/// What the handshake settled on.
struct Negotiated {
    export: usize,
    structured: bool,
    base_allocation: bool,
}

/// Per-request state kept between submission and completion.
struct SlotMeta {
    handle: u64,
    cmd: u16,
    flags: u16,
    offset: u64,
    len: u32,
    buf: AlignedBuf,
    /// Holes and data of a READ's range when the device knows them, so the
    /// reply can use OFFSET_HOLE chunks (empty: all data).
    extents: Vec<Extent>,
}

struct Slot {
    meta: Mutex<SlotMeta>,
    /// Bios still to complete for this request (TRIM/WRITE_ZEROES larger
    /// than the device's limit are split).
    pending: AtomicU32,
    /// First failure among those bios (0 = none).
    err: AtomicU8,
}

/// The writer side, behind the writer lock.
struct Out {
    buf: Vec<u8>,
    /// The reader is working through buffered requests: append, don't send.
    batching: bool,
    /// A send failed: the client is gone; stop writing, keep draining.
    dead: bool,
}

/// Slot accounting, behind its own lock so that the reader can start new
/// requests while a completer is busy sending a large reply.
struct Slots {
    free: Vec<u16>,
    inflight: usize,
    /// Data bytes of the requests in flight (see [`INFLIGHT_BYTES`]).
    inflight_bytes: usize,
}

/// The transmission-phase state shared by the reader and completers.
struct Shared {
    sock: Arc<Sock>,
    structured: bool,
    slots: Box<[Slot]>,
    out: Mutex<Out>,
    /// Set with `out.dead`, readable without the writer lock.
    dead: AtomicBool,
    accounting: Mutex<Slots>,
    /// Signalled when a slot is freed (reader waiting for a slot or for
    /// the drain at the end).
    freed: Condvar,
    /// Early wake of a reader blocked for input (see [`IdleWake`]); `None`
    /// when polling is off.
    idle_wake: Option<IdleWake>,
}

/// Lets a completer wake the blocked reader as soon as the connection's
/// last request in flight is answered. At queue depth 1 the client's next
/// request follows that reply within one client wake-up; a reader that
/// sleeps until the request arrives adds its own wake-up (60-140 µs for an
/// idle vCPU here) after the client's. Woken early, the reader wakes while
/// the client does and polls for the request instead. A plain eventfd:
/// the reader sleeps in `poll(2)` on it and the socket, so a wake that is
/// early for nothing costs one poll, never a lost request.
struct IdleWake {
    efd: OwnedFd,
    /// The reader is (about to be) asleep in that `poll`.
    parked: AtomicBool,
}

impl IdleWake {
    fn new() -> io::Result<IdleWake> {
        // SAFETY: plain syscall; the fd is checked and then owned.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(IdleWake {
            // SAFETY: a fresh fd nobody else owns.
            efd: unsafe { OwnedFd::from_raw_fd(fd) },
            parked: AtomicBool::new(false),
        })
    }

    fn signal(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a valid u64. A full counter (EAGAIN)
        // means a wake is already pending.
        unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn clear(&self) {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a valid u64; EAGAIN when not signalled.
        unsafe { libc::read(self.efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

impl Shared {
    /// Send what is buffered. Called with the writer lock held.
    fn flush(&self, out: &mut Out) {
        if out.buf.is_empty() {
            return;
        }
        if !out.dead && self.sock.send_all(&out.buf).is_err() {
            self.kill(out);
        }
        out.buf.clear();
    }

    fn kill(&self, out: &mut Out) {
        out.dead = true;
        self.dead.store(true, Ordering::Release);
        // Unblock the reader too: nobody is listening any more.
        self.sock.shutdown(std::net::Shutdown::Both);
    }

    /// Encode a reply with no payload (any command but a successful READ).
    fn push_status(&self, out: &mut Out, handle: u64, error: u32, msg: &str) {
        if error != 0 && self.structured {
            encode_error_chunk(&mut out.buf, handle, error, msg);
        } else {
            encode_simple_reply(&mut out.buf, error, handle);
        }
    }

    fn set_batching(&self, on: bool) {
        let mut out = self.out.lock();
        out.batching = on;
        if !on {
            self.flush(&mut out);
        }
    }

    /// Give back a slot (its request is answered, or never reached the
    /// device).
    fn release(&self, idx: usize, bytes: usize) {
        let mut a = self.accounting.lock();
        a.free.push(idx as u16);
        a.inflight -= 1;
        a.inflight_bytes -= bytes;
        let idle = a.inflight == 0;
        drop(a);
        self.freed.notify_one();
        if let Some(w) = &self.idle_wake {
            if idle && w.parked.load(Ordering::SeqCst) {
                w.signal();
            }
        }
    }

    fn reply_now(&self, handle: u64, error: u32, msg: &str) {
        let mut out = self.out.lock();
        self.push_status(&mut out, handle, error, msg);
        if !out.batching {
            self.flush(&mut out);
        }
    }

    /// Write the reply of a finished READ. Writer lock held.
    fn push_read(&self, out: &mut Out, m: &SlotMeta) {
        let data = &m.buf.as_slice()[..m.len as usize];
        if !self.structured {
            encode_simple_reply(&mut out.buf, 0, m.handle);
            self.push_data(out, data);
            return;
        }
        if m.extents.is_empty() {
            encode_data_chunk_header(&mut out.buf, REPLY_FLAG_DONE, m.handle, m.offset, m.len);
            self.push_data(out, data);
            return;
        }
        let last = m.extents.len() - 1;
        for (i, e) in m.extents.iter().enumerate() {
            let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
            if e.hole {
                encode_hole_chunk(&mut out.buf, flags, m.handle, e.offset, e.len as u32);
            } else {
                let rel = (e.offset - m.offset) as usize;
                encode_data_chunk_header(&mut out.buf, flags, m.handle, e.offset, e.len as u32);
                self.push_data(out, &data[rel..rel + e.len as usize]);
            }
        }
    }

    fn push_data(&self, out: &mut Out, data: &[u8]) {
        if data.len() <= COPY_LIMIT {
            out.buf.extend_from_slice(data);
            return;
        }
        // Big: send what is queued and the data in one sendmsg, no copy.
        if !out.dead && self.sock.send_all2(&out.buf, data).is_err() {
            self.kill(out);
        }
        out.buf.clear();
    }
}

/// Data bytes a request holds in its slot's buffer.
fn data_bytes(m: &SlotMeta) -> usize {
    if matches!(m.cmd, CMD_READ | CMD_WRITE) {
        m.len as usize
    } else {
        0
    }
}

impl EndIo for Shared {
    fn end_io(&self, bio: Bio, status: Status, private: u64) {
        drop(bio);
        let idx = private as usize;
        let slot = &self.slots[idx];
        if !status.is_ok() {
            let _ =
                slot.err
                    .compare_exchange(0, status.as_u8(), Ordering::AcqRel, Ordering::Acquire);
        }
        if slot.pending.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let status = Status::from_u8(slot.err.swap(0, Ordering::AcqRel));
        let mut m = slot.meta.lock();
        let mut out = self.out.lock();
        if status.is_ok() && m.cmd == CMD_READ {
            self.push_read(&mut out, &m);
        } else {
            let err = if m.flags & CMD_FLAG_FAST_ZERO != 0 && status == Status::Again {
                ENOTSUP
            } else {
                nbd_error(status)
            };
            if err == 0 {
                self.push_status(&mut out, m.handle, 0, "");
            } else {
                self.push_status(&mut out, m.handle, err, &status.to_string());
            }
        }
        if !out.batching {
            self.flush(&mut out);
        }
        drop(out);
        let bytes = data_bytes(&m);
        if m.buf.len() > KEEP_BUF {
            m.buf = AlignedBuf::new(0);
        }
        drop(m);
        self.release(idx, bytes);
    }
}

/// Serve one accepted connection until the client leaves, misbehaves
/// beyond recovery, or the server stops (which shuts the socket's read
/// side). Returns once every request it submitted has completed.
///
/// `poll_ns` bounds the reader's busy-poll of the socket before it blocks
/// (0: never poll); [`SpinPolicy`] decides when polling is worth it.
pub fn serve(sock: Arc<Sock>, exports: &[Export], poll_ns: u64) -> io::Result<()> {
    let mut inb = InBuf::new();
    sock.set_recv_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let Some(neg) = handshake(&sock, &mut inb, exports)? else {
        return Ok(());
    };
    sock.set_recv_timeout(None)?;
    // The reader's wake-up is on every request's path: see spin.rs.
    crate::spin::ask_short_slice();
    let export = &exports[neg.export];
    // Live control: lets `unexport` see and disconnect this client.
    let _listed = export.attach(&sock);
    let slots: Box<[Slot]> = (0..MAX_INFLIGHT)
        .map(|_| Slot {
            meta: Mutex::new(SlotMeta {
                handle: 0,
                cmd: 0,
                flags: 0,
                offset: 0,
                len: 0,
                buf: AlignedBuf::new(0),
                extents: Vec::new(),
            }),
            pending: AtomicU32::new(0),
            err: AtomicU8::new(0),
        })
        .collect();
    let shared = Arc::new(Shared {
        sock: sock.clone(),
        structured: neg.structured,
        slots,
        out: Mutex::new(Out {
            buf: Vec::with_capacity(COPY_LIMIT * 2),
            batching: false,
            dead: false,
        }),
        dead: AtomicBool::new(false),
        accounting: Mutex::new(Slots {
            free: (0..MAX_INFLIGHT as u16).rev().collect(),
            inflight: 0,
            inflight_bytes: 0,
        }),
        freed: Condvar::new(),
        idle_wake: if poll_ns > 0 {
            Some(IdleWake::new()?)
        } else {
            None
        },
    });
    let mut t = Transmission {
        owner: shared.clone(),
        shared,
        export,
        inb,
        base_allocation: neg.base_allocation,
        lbs: export.dev.logical_block_size().max(1) as u64,
        max_request: export.max_request(),
        size: export.dev.size(),
        features: export.dev.features(),
        spin: SpinPolicy::new(poll_ns),
        wake_spin: SpinPolicy::new(poll_ns),
    };
    let r = t.run();
    t.drain();

    r
}

// ---- handshake ------------------------------------------------------------

fn recv_exact(sock: &Sock, inb: &mut InBuf, dst: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < dst.len() {
        if inb.available() == 0 && !inb.fill(sock)? {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let n = inb.available().min(dst.len() - done);
        dst[done..done + n].copy_from_slice(&inb.buf[inb.start..inb.start + n]);
        inb.start += n;
        done += n;
    }
    Ok(())
}

fn find_export(exports: &[Export], name: &str) -> Option<usize> {
    if name.is_empty() {
        // The "default" export of the spec: the first one given.
        return if exports.is_empty() { None } else { Some(0) };
    }
    exports.iter().position(|e| e.name == name)
}

fn opt_reply(sock: &Sock, option: u32, rep: u32, payload: &[u8]) -> io::Result<()> {
    let mut v = Vec::with_capacity(20 + payload.len());
    encode_option_reply(&mut v, option, rep, payload);
    sock.send_all(&v)
}

fn opt_err(sock: &Sock, option: u32, rep: u32, msg: &str) -> io::Result<()> {
    opt_reply(sock, option, rep, msg.as_bytes())
}

/// Run option haggling. `Ok(None)`: the client aborted or must be dropped.
fn handshake(sock: &Sock, inb: &mut InBuf, exports: &[Export]) -> io::Result<Option<Negotiated>> {
    let mut v = Vec::new();
    encode_greeting(&mut v, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    sock.send_all(&v)?;
    let mut cf = [0u8; 4];
    recv_exact(sock, inb, &mut cf)?;
    let cflags = u32::from_be_bytes(cf);
    if cflags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        // The spec: the server MUST drop a client that sets unknown flags.
        return Ok(None);
    }
    let no_zeroes = cflags & FLAG_C_NO_ZEROES != 0;
    let mut structured = false;
    // Export index and whether base:allocation was selected for it.
    let mut meta: Option<(usize, bool)> = None;
    for _ in 0..MAX_OPTIONS {
        let mut h = [0u8; OptionHeader::SIZE];
        recv_exact(sock, inb, &mut h)?;
        let Ok(hdr) = OptionHeader::parse(&h) else {
            return Ok(None);
        };
        if hdr.len > MAX_OPTION_LEN {
            return Ok(None);
        }
        let mut data = vec![0u8; hdr.len as usize];
        recv_exact(sock, inb, &mut data)?;
        let opt = hdr.option;
        match opt {
            OPT_EXPORT_NAME => {
                let Ok(name) = parse_name("export name", &data) else {
                    return Ok(None);
                };
                let Some(idx) = find_export(exports, &name) else {
                    // No way to report an error to this option: hang up.
                    return Ok(None);
                };
                let e = &exports[idx];
                let mut v = Vec::new();
                encode_export_name_reply(
                    &mut v,
                    e.dev.size(),
                    e.transmission_flags(structured),
                    no_zeroes,
                );
                sock.send_all(&v)?;
                return Ok(Some(Negotiated {
                    export: idx,
                    structured,
                    base_allocation: matches!(meta, Some((i, true)) if i == idx),
                }));
            }
            OPT_ABORT => {
                // The client may already have closed; that is fine.
                let _ = opt_reply(sock, opt, REP_ACK, &[]);
                return Ok(None);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    opt_err(sock, opt, REP_ERR_INVALID, "NBD_OPT_LIST takes no data")?;
                    continue;
                }
                for e in exports {
                    let mut p = Vec::new();
                    encode_rep_server(&mut p, &e.name, &e.description);
                    opt_reply(sock, opt, REP_SERVER, &p)?;
                }
                opt_reply(sock, opt, REP_ACK, &[])?;
            }
            OPT_STARTTLS => {
                opt_err(sock, opt, REP_ERR_POLICY, "this server does not offer TLS")?;
            }
            OPT_INFO | OPT_GO => {
                let req = match GoRequest::parse(&data) {
                    Ok(r) => r,
                    Err(e) => {
                        opt_err(sock, opt, REP_ERR_INVALID, &e.to_string())?;
                        continue;
                    }
                };
                let Some(idx) = find_export(exports, &req.name) else {
                    opt_err(
                        sock,
                        opt,
                        REP_ERR_UNKNOWN,
                        &format!("no export named {:?}", req.name),
                    )?;
                    continue;
                };
                let e = &exports[idx];
                let mut p = Vec::new();
                encode_info_export(&mut p, e.dev.size(), e.transmission_flags(structured));
                opt_reply(sock, opt, REP_INFO, &p)?;
                if req.infos.contains(&INFO_NAME) {
                    p.clear();
                    encode_info_string(&mut p, INFO_NAME, &e.name);
                    opt_reply(sock, opt, REP_INFO, &p)?;
                }
                if req.infos.contains(&INFO_DESCRIPTION) {
                    p.clear();
                    encode_info_string(&mut p, INFO_DESCRIPTION, &e.description);
                    opt_reply(sock, opt, REP_INFO, &p)?;
                }
                // Always sent: misaligned requests are refused, so every
                // client must learn the minimum (they all honour it).
                let (min, pref, max) = e.block_sizes();
                p.clear();
                encode_info_block_size(&mut p, min, pref, max);
                opt_reply(sock, opt, REP_INFO, &p)?;
                opt_reply(sock, opt, REP_ACK, &[])?;
                if opt == OPT_GO {
                    return Ok(Some(Negotiated {
                        export: idx,
                        structured,
                        base_allocation: matches!(meta, Some((i, true)) if i == idx),
                    }));
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    opt_err(
                        sock,
                        opt,
                        REP_ERR_INVALID,
                        "NBD_OPT_STRUCTURED_REPLY takes no data",
                    )?;
                } else if structured {
                    opt_err(
                        sock,
                        opt,
                        REP_ERR_INVALID,
                        "structured replies already negotiated",
                    )?;
                } else {
                    structured = true;
                    opt_reply(sock, opt, REP_ACK, &[])?;
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                if !structured {
                    opt_err(
                        sock,
                        opt,
                        REP_ERR_INVALID,
                        "negotiate NBD_OPT_STRUCTURED_REPLY before metadata contexts",
                    )?;
                    continue;
                }
                let req = match MetaRequest::parse(&data) {
                    Ok(r) => r,
                    Err(e) => {
                        opt_err(sock, opt, REP_ERR_INVALID, &e.to_string())?;
                        continue;
                    }
                };
                let Some(idx) = find_export(exports, &req.export) else {
                    opt_err(
                        sock,
                        opt,
                        REP_ERR_UNKNOWN,
                        &format!("no export named {:?}", req.export),
                    )?;
                    continue;
                };
                let list = opt == OPT_LIST_META_CONTEXT;
                let selected = if list {
                    req.queries.is_empty()
                        || req
                            .queries
                            .iter()
                            .any(|q| q == "base:" || q == BASE_ALLOCATION)
                } else {
                    req.queries.iter().any(|q| q == BASE_ALLOCATION)
                };
                if selected {
                    let mut p = Vec::new();
                    let id = if list { 0 } else { BASE_ALLOCATION_ID };
                    encode_meta_context(&mut p, id, BASE_ALLOCATION);
                    opt_reply(sock, opt, REP_META_CONTEXT, &p)?;
                }
                if !list {
                    meta = Some((idx, selected));
                }
                opt_reply(sock, opt, REP_ACK, &[])?;
            }
            _ => {
                opt_err(
                    sock,
                    opt,
                    REP_ERR_UNSUP,
                    &format!("option {opt} is not supported"),
                )?;
            }
        }
    }
    Ok(None)
}

// ---- transmission -----------------------------------------------------------

/// Read a WRITE's payload into `dst`, from the receive buffer and then
/// straight from the socket (no second copy for large writes).
fn read_payload(inb: &mut InBuf, shared: &Shared, dst: &mut [u8]) -> io::Result<()> {
    let n = inb.available().min(dst.len());
    dst[..n].copy_from_slice(&inb.buf[inb.start..inb.start + n]);
    inb.start += n;
    if n < dst.len() {
        shared.set_batching(false);
        shared.sock.recv_exact(&mut dst[n..])?;
    }
    Ok(())
}

struct Transmission<'a> {
    shared: Arc<Shared>,
    /// The same `Shared`, as the completion sink every bio carries.
    owner: Arc<dyn EndIo>,
    export: &'a Export,
    inb: InBuf,
    base_allocation: bool,
    lbs: u64,
    max_request: u32,
    size: u64,
    features: blkstack_core::Features,
    /// Polls right after the reader blocked, when input is due.
    spin: SpinPolicy,
    /// Polls after an [`IdleWake`]: kept apart because at a high device
    /// latency the first kind always misses while this one pays.
    wake_spin: SpinPolicy,
}

/// A request refused before it reaches the device.
struct Refusal(u32, &'static str);

impl Transmission<'_> {
    fn set_batching(&self, on: bool) {
        self.shared.set_batching(on);
    }

    /// Block for more input, sending buffered replies first.
    fn fill(&mut self) -> io::Result<bool> {
        self.set_batching(false);
        let more = match self.poll(false)? {
            Some(more) => more,
            None => self.wait_input()?,
        };
        if more {
            self.set_batching(true);
        }
        Ok(more)
    }

    /// Block until input arrives. While requests are in flight, sleep on
    /// the socket and the [`IdleWake`] together, and when the last of them
    /// is answered first, poll for the client's next request.
    fn wait_input(&mut self) -> io::Result<bool> {
        let shared = self.shared.clone();
        if let Some(w) = &shared.idle_wake {
            w.parked.store(true, Ordering::SeqCst);
            // Checked after `parked` is set: a completion that empties the
            // connection from here on sees it and signals.
            let busy = shared.accounting.lock().inflight > 0;
            let mut input = true;
            if busy {
                input = shared.sock.wait_readable(w.efd.as_raw_fd())?;
                w.clear();
            }
            w.parked.store(false, Ordering::SeqCst);
            if !input {
                if let Some(more) = self.poll(true)? {
                    return Ok(more);
                }
            }
        }
        self.inb.fill(&shared.sock)
    }

    /// Busy-poll the socket for at most the bound [`SpinPolicy`] allows
    /// (see `spin.rs` for why); `None` when the caller must block.
    fn poll(&mut self, after_wake: bool) -> io::Result<Option<bool>> {
        let policy = if after_wake {
            &mut self.wake_spin
        } else {
            &mut self.spin
        };
        let Some(bound) = policy.next_wait() else {
            return Ok(None);
        };
        let sock = &*self.shared.sock;
        let start = clock::now_ns();
        let mut prev = start;
        loop {
            if let Some(more) = self.inb.try_fill(sock)? {
                policy.record(SpinOutcome::Hit);
                return Ok(Some(more));
            }
            let now = clock::now_ns();
            if now - prev > PREEMPT_GAP_NS {
                policy.record(SpinOutcome::Preempted);
                return Ok(None);
            }
            if now - start >= bound {
                policy.record(SpinOutcome::Miss);
                return Ok(None);
            }
            prev = now;
            // Polling must not keep a runnable thread off this CPU (on a
            // 2-vCPU machine often the client itself, which has to run
            // to send the request polled for): yield between polls. With
            // nobody else runnable this is a cheap syscall; with someone,
            // they run, and the gap check above ends the poll if they
            // held the CPU long.
            // SAFETY: plain syscall without arguments.
            unsafe { libc::sched_yield() };
        }
    }

    /// Make sure `n` bytes are buffered; `Ok(false)` on a clean EOF before
    /// the first byte.
    fn need(&mut self, n: usize) -> io::Result<bool> {
        while self.inb.available() < n {
            if !self.fill()? {
                if self.inb.available() == 0 {
                    return Ok(false);
                }
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(true)
    }

    fn discard_payload(&mut self, mut len: usize) -> io::Result<()> {
        while len > 0 {
            if self.inb.available() == 0 && !self.fill()? {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let n = self.inb.available().min(len);
            self.inb.start += n;
            len -= n;
        }
        Ok(())
    }

    fn run(&mut self) -> io::Result<()> {
        loop {
            if !self.need(Request::SIZE)? {
                return Ok(());
            }
            let hdr = self.inb.take::<{ Request::SIZE }>();
            let req = match Request::parse(&hdr) {
                Ok(r) => r,
                // Without a valid header the stream cannot be resynchronised:
                // hard disconnect, as the spec allows.
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
            };
            if req.cmd == CMD_DISC {
                return Ok(());
            }
            let payload = if req.cmd == CMD_WRITE {
                req.len as usize
            } else {
                0
            };
            if let Err(Refusal(err, msg)) = self.check(&req) {
                if payload > 0 {
                    self.discard_payload(payload)?;
                }
                self.shared.reply_now(req.handle, err, msg);
                continue;
            }
            match req.cmd {
                CMD_CACHE => self.shared.reply_now(req.handle, 0, ""),
                CMD_BLOCK_STATUS => self.block_status(&req),
                _ => self.submit(&req)?,
            }
        }
    }

    /// Validate a request against the negotiated flags and the device.
    fn check(&self, r: &Request) -> Result<(), Refusal> {
        let allowed = CMD_FLAG_FUA
            | match r.cmd {
                CMD_READ if self.shared.structured => CMD_FLAG_DF,
                CMD_WRITE_ZEROES => CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
                CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
                _ => 0,
            };
        if r.flags & !allowed != 0 {
            return Err(Refusal(EINVAL, "command flag not valid for this command"));
        }
        let writes = matches!(r.cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
        match r.cmd {
            CMD_FLUSH => return Ok(()),
            CMD_READ | CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES | CMD_CACHE => {}
            CMD_BLOCK_STATUS if self.base_allocation => {}
            CMD_BLOCK_STATUS => {
                return Err(Refusal(EINVAL, "no metadata context was negotiated"));
            }
            _ => return Err(Refusal(EINVAL, "unknown command")),
        }
        if writes && self.export.read_only {
            return Err(Refusal(EPERM, "export is read-only"));
        }
        if r.len == 0 {
            return Err(Refusal(EINVAL, "zero-length request"));
        }
        if matches!(r.cmd, CMD_READ | CMD_WRITE) && r.len > self.max_request {
            return Err(Refusal(
                EOVERFLOW,
                "request larger than the maximum block size",
            ));
        }
        let end = r.offset.checked_add(r.len as u64);
        if end.is_none_or(|e| e > self.size) {
            return Err(if writes {
                Refusal(ENOSPC, "request extends beyond the end of the export")
            } else {
                Refusal(EINVAL, "request extends beyond the end of the export")
            });
        }
        if matches!(r.cmd, CMD_CACHE | CMD_BLOCK_STATUS) {
            return Ok(());
        }
        if !r.offset.is_multiple_of(self.lbs) || !(r.len as u64).is_multiple_of(self.lbs) {
            return Err(Refusal(
                EINVAL,
                "request not aligned to the minimum block size",
            ));
        }
        match r.cmd {
            CMD_TRIM if !self.features.discard => {
                Err(Refusal(EINVAL, "trim is not supported by this export"))
            }
            CMD_WRITE_ZEROES if !self.features.write_zeroes => Err(Refusal(
                EINVAL,
                "write zeroes is not supported by this export",
            )),
            CMD_WRITE_ZEROES if r.flags & CMD_FLAG_FAST_ZERO != 0 && !self.features.fast_zero => {
                Err(Refusal(ENOTSUP, "zeroing is not fast on this export"))
            }
            _ => Ok(()),
        }
    }

    /// Take a free slot for a request moving `bytes` of data, waiting for
    /// completions while all slots are busy or the data budget is spent
    /// (a request alone may always go, whatever its size).
    fn alloc_slot(&self, bytes: usize) -> io::Result<usize> {
        let mut flushed = false;
        let mut a = self.shared.accounting.lock();
        loop {
            if self.shared.dead.load(Ordering::Acquire) {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            let fits = a.inflight == 0 || a.inflight_bytes + bytes <= INFLIGHT_BYTES;
            if fits {
                if let Some(i) = a.free.pop() {
                    a.inflight += 1;
                    a.inflight_bytes += bytes;
                    return Ok(i as usize);
                }
            }
            if !flushed {
                // About to wait: whatever was batched must go out first
                // (without holding the accounting lock across a send).
                drop(a);
                self.set_batching(false);
                flushed = true;
                a = self.shared.accounting.lock();
                continue;
            }
            self.shared.freed.wait(&mut a);
        }
    }

    fn submit(&mut self, r: &Request) -> io::Result<()> {
        let bytes = if matches!(r.cmd, CMD_READ | CMD_WRITE) {
            r.len as usize
        } else {
            0
        };
        let idx = self.alloc_slot(bytes)?;
        let shared = &*self.shared;
        let slot = &shared.slots[idx];
        let mut m = slot.meta.lock();
        m.handle = r.handle;
        m.cmd = r.cmd;
        m.flags = r.flags;
        m.offset = r.offset;
        m.len = r.len;
        m.extents.clear();
        let len = r.len as usize;
        let mut flags = BioFlags::NONE;
        if r.flags & CMD_FLAG_FUA != 0 {
            flags.insert(BioFlags::FUA);
        }
        let (op, buf) = match r.cmd {
            CMD_READ | CMD_WRITE => {
                if m.buf.len() < len {
                    m.buf = AlignedBuf::new(len.next_power_of_two());
                }
                if r.cmd == CMD_WRITE {
                    let dst = &mut m.buf.as_mut_slice()[..len];
                    if let Err(e) = read_payload(&mut self.inb, shared, dst) {
                        drop(m);
                        shared.release(idx, bytes);
                        return Err(e);
                    }
                } else if self.shared.structured
                    && self.features.knows_holes
                    && r.flags & CMD_FLAG_DF == 0
                {
                    self.plan_holes(&mut m);
                }
                // SAFETY: the slot (and with it `m.buf`) belongs to this
                // request until its completion frees it; `Shared`, which
                // owns the slots, outlives the bio through the `owner`
                // Arc the bio carries.
                let buf = unsafe { m.buf.io_buf(0, len) };
                let op = if r.cmd == CMD_READ {
                    Op::Read
                } else {
                    Op::Write
                };
                (op, buf)
            }
            CMD_FLUSH => (Op::Flush, IoBuf::empty()),
            CMD_TRIM => (Op::Discard, IoBuf::empty()),
            CMD_WRITE_ZEROES => {
                if r.flags & CMD_FLAG_NO_HOLE != 0 {
                    flags.insert(BioFlags::NOUNMAP);
                }
                if r.flags & CMD_FLAG_FAST_ZERO != 0 {
                    flags.insert(BioFlags::FAST_ZERO);
                }
                (Op::WriteZeroes, IoBuf::empty())
            }
            _ => unreachable!("check() admits only known commands"),
        };
        drop(m);
        let (offset, total) = if op == Op::Flush {
            (0, 0)
        } else {
            (r.offset, r.len as u64)
        };
        // Data ops are capped by max_request; trim and zeroing may be much
        // larger than the device takes at once, so they are split.
        let piece = if op.has_data() || op == Op::Flush {
            total.max(1)
        } else {
            self.max_request as u64
        };
        let count = total.div_ceil(piece).max(1);
        slot.pending.store(count as u32, Ordering::Release);
        let mut off = 0;
        for _ in 0..count {
            let l = piece.min(total - off);
            let b = if op.has_data() { buf } else { IoBuf::empty() };
            let bio =
                Bio::new(op, offset + off, l, b, self.owner.clone(), idx as u64).with_flags(flags);
            off += l;
            self.export.dev.submit(bio);
        }
        Ok(())
    }

    /// For a structured READ on a device that knows its holes: remember
    /// the extents, clipped to the request, if there is at least one hole.
    fn plan_holes(&self, m: &mut SlotMeta) {
        let (start, end) = (m.offset, m.offset + m.len as u64);
        let Some(ext) = self.export.dev.extents(start, end - start) else {
            return;
        };
        let mut pos = start;
        let mut any_hole = false;
        for e in ext {
            let s = e.offset.max(pos);
            let t = (e.offset.saturating_add(e.len)).min(end);
            if s != pos || t <= s {
                if t <= pos {
                    continue; // before the range, or already covered
                }
                m.extents.clear();
                return; // a gap or overlap: do not trust this map
            }
            // Chunks of the same kind next to each other are merged.
            match m.extents.last_mut() {
                Some(l) if l.hole == e.hole => l.len += t - s,
                _ => m.extents.push(Extent {
                    offset: s,
                    len: t - s,
                    hole: e.hole,
                }),
            }
            any_hole |= e.hole;
            pos = t;
            if pos == end {
                break;
            }
        }
        if pos != end || !any_hole {
            m.extents.clear();
        }
    }

    /// NBD_CMD_BLOCK_STATUS for base:allocation, answered synchronously
    /// from the device's extent map (all data if it has none).
    fn block_status(&self, r: &Request) {
        let (start, end) = (r.offset, r.offset + r.len as u64);
        let mut desc: Vec<(u32, u32)> = Vec::new();
        let mut pos = start;
        if self.features.knows_holes {
            if let Some(ext) = self.export.dev.extents(start, end - start) {
                for e in ext {
                    let s = e.offset.max(pos);
                    let t = (e.offset.saturating_add(e.len)).min(end);
                    if s != pos || t <= s {
                        if t <= pos {
                            continue;
                        }
                        break;
                    }
                    let st = if e.hole { STATE_HOLE | STATE_ZERO } else { 0 };
                    match desc.last_mut() {
                        Some(l) if l.1 == st => l.0 += (t - s) as u32,
                        _ => desc.push(((t - s) as u32, st)),
                    }
                    pos = t;
                    if pos == end || desc.len() >= MAX_DESCRIPTORS {
                        break;
                    }
                }
            }
        }
        if desc.is_empty() {
            desc.push((r.len, 0));
        }
        if r.flags & CMD_FLAG_REQ_ONE != 0 {
            desc.truncate(1);
        }
        let mut out = self.shared.out.lock();
        encode_block_status_chunk(
            &mut out.buf,
            REPLY_FLAG_DONE,
            r.handle,
            BASE_ALLOCATION_ID,
            &desc,
        );
        if !out.batching {
            self.shared.flush(&mut out);
        }
    }

    /// Wait until every submitted request has completed and its reply has
    /// been written (the spec: handle all outstanding requests before
    /// closing).
    fn drain(&mut self) {
        self.set_batching(false);
        let mut a = self.shared.accounting.lock();
        while a.inflight > 0 {
            self.shared.freed.wait(&mut a);
        }
    }
}
