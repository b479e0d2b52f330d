//! One connection of the floor server in its transmission phase: a
//! bounded input buffer, the replies not yet sent, and a WRITE whose
//! payload is still arriving. Nothing here allocates per request: the
//! buffer and the reply queue are sized once, replies name their data
//! (the static zeros or a range of the export) instead of copying it, and
//! a batch of replies leaves in one `writev` (or, over TLS, one
//! `write_vectored` into rustls).

use crate::{now_ns, Export, Kind};
use blkstack_nbd::proto::{self, Request};
use rustls::ServerConnection;
use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

/// Requests in flight on one connection (queued replies and delayed
/// reads); past it the connection stops reading until replies leave.
pub const MAX_INFLIGHT: usize = 1024;
/// The largest READ or WRITE served (the bench's fill writes 1 MiB).
pub const MAX_LEN: u32 = 1 << 20;
/// Bytes of requests buffered: headers and, for writes, payload bytes that
/// came with them.
const INBUF: usize = 256 << 10;
/// Replies per `writev` (two slices each).
const BATCH: usize = 256;

/// What a reply carries after its header.
#[derive(Clone, Copy)]
enum Data {
    None,
    /// `len` bytes of the static zeros.
    Zero(u32),
    /// A range of the memory export.
    Mem(u64, u32),
}

struct Reply {
    hdr: [u8; 16],
    data: Data,
}

/// A delayed read, due at `deadline` on the connection in `slot`.
#[derive(Clone, Copy)]
pub struct Delayed {
    pub deadline: u64,
    pub slot: usize,
    /// Which connection held the slot when the read came (a new one may
    /// have taken it since).
    pub gen: u64,
    pub handle: u64,
    pub len: u32,
}

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
pub enum ConnEnd {
    #[error("the client disconnected (NBD_CMD_DISC)")]
    Disc,
    #[error("the client closed the connection")]
    Eof,
    #[error("malformed request: {0}")]
    Malformed(#[from] proto::WireError),
    #[error("{what} of {len} bytes at {offset}: beyond the {size}-byte export or the {MAX_LEN}-byte limit")]
    OutOfRange {
        what: &'static str,
        offset: u64,
        len: u32,
        size: u64,
    },
    #[error("NBD_CMD_WRITE on the read-only {0:?} export")]
    ReadOnly(Kind),
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl ConnEnd {
    pub fn log(&self, slot: usize) {
        match self {
            ConnEnd::Disc | ConnEnd::Eof => tracing::debug!("connection {slot}: {self}"),
            _ => tracing::error!("connection {slot} closed: {self}"),
        }
    }
}

static ZEROS: [u8; MAX_LEN as usize] = [0; MAX_LEN as usize];

pub struct Conn {
    sock: UnixStream,
    tls: Option<ServerConnection>,
    gen: u64,
    inbuf: Box<[u8]>,
    start: usize,
    end: usize,
    /// A WRITE whose payload is still arriving: the export offset of the
    /// next byte, the bytes left and the handle to answer.
    payload: Option<(u64, u32, u64)>,
    out: VecDeque<Reply>,
    /// Bytes of `out`'s front reply already sent.
    sent: usize,
    delayed: usize,
    /// Parsing stopped at the in-flight bound with requests still in the
    /// buffer: parse again once replies leave.
    stalled: bool,
    /// rustls holds plaintext the buffer had no room for.
    tls_left: bool,
}

impl Conn {
    pub fn new(sock: UnixStream, tls: Option<ServerConnection>, gen: u64) -> io::Result<Conn> {
        sock.set_nonblocking(true)?;
        // The handshake's reads may have left requests in rustls.
        let tls_on = tls.is_some();
        Ok(Conn {
            sock,
            tls,
            gen,
            inbuf: vec![0u8; INBUF].into_boxed_slice(),
            start: 0,
            end: 0,
            payload: None,
            out: VecDeque::with_capacity(MAX_INFLIGHT),
            sent: 0,
            delayed: 0,
            stalled: false,
            tls_left: tls_on,
        })
    }

    pub fn fd(&self) -> i32 {
        self.sock.as_raw_fd()
    }

    pub fn gen(&self) -> u64 {
        self.gen
    }

    fn inflight(&self) -> usize {
        self.out.len() + self.delayed
    }

    /// Requests wait in the buffer and there is room to take them.
    pub fn has_buffered_input(&self) -> bool {
        (self.stalled || self.tls_left) && self.inflight() < MAX_INFLIGHT
    }

    pub fn poll_events(&self) -> i16 {
        let mut ev = 0;
        if self.inflight() < MAX_INFLIGHT {
            ev |= libc::POLLIN;
        }
        if !self.out.is_empty() || self.tls.as_ref().is_some_and(|t| t.wants_write()) {
            ev |= libc::POLLOUT;
        }
        ev
    }

    /// poll said the socket is readable or writable (or parsing was stalled).
    pub fn on_ready(
        &mut self,
        revents: i16,
        export: &mut Export,
        delayq: &mut VecDeque<Delayed>,
        slot: usize,
    ) -> Result<(), ConnEnd> {
        if revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
            self.receive(export)?;
        } else if self.tls_left {
            self.compact();
            self.drain_plaintext(export)?;
        }
        self.parse(export, delayq, slot)?;
        self.flush(export)
    }

    /// Make room at the buffer's end: restart it when empty, move a
    /// partial request to its front past the half.
    fn compact(&mut self) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.start > INBUF / 2 {
            self.inbuf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }

    /// One read of what the socket holds: into the buffer, or for a WRITE
    /// in progress, into the export first and the buffer after.
    fn receive(&mut self, export: &mut Export) -> Result<(), ConnEnd> {
        self.compact();
        if self.tls.is_some() {
            return self.receive_tls(export);
        }
        let (target, rest) = split_target(&mut self.payload, export, &mut self.inbuf[self.end..]);
        let n = if target.is_empty() {
            (&self.sock).read(rest)
        } else {
            let mut iov = [IoSliceMut::new(target), IoSliceMut::new(rest)];
            (&self.sock).read_vectored(&mut iov)
        };
        let n = match n {
            Ok(0) => return Err(ConnEnd::Eof),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let direct = advance_payload(&mut self.payload, n, &mut self.out);
        self.end += n - direct;
        Ok(())
    }

    /// Over TLS: one `read_tls` of the socket, then the plaintext into the
    /// export (a WRITE in progress) and the buffer.
    fn receive_tls(&mut self, export: &mut Export) -> Result<(), ConnEnd> {
        let Some(tls) = self.tls.as_mut() else {
            return Ok(());
        };
        match tls.read_tls(&mut self.sock) {
            Ok(0) => return Err(ConnEnd::Eof),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e.into()),
        }
        let state = tls.process_new_packets()?;
        if state.peer_has_closed() && state.plaintext_bytes_to_read() == 0 {
            return Err(ConnEnd::Eof);
        }
        self.drain_plaintext(export)
    }

    /// Move rustls's plaintext into the export and the buffer, as far as
    /// the buffer has room.
    fn drain_plaintext(&mut self, export: &mut Export) -> Result<(), ConnEnd> {
        let Some(tls) = self.tls.as_mut() else {
            return Ok(());
        };
        self.tls_left = false;
        loop {
            let (target, rest) =
                split_target(&mut self.payload, export, &mut self.inbuf[self.end..]);
            let into = if target.is_empty() { rest } else { target };
            if into.is_empty() {
                self.tls_left = true;
                break;
            }
            let n = match tls.reader().read(into) {
                Ok(0) => return Err(ConnEnd::Eof),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e.into()),
            };
            let direct = advance_payload(&mut self.payload, n, &mut self.out);
            self.end += n - direct;
        }
        Ok(())
    }

    /// Serve every complete request in the buffer, up to the in-flight bound.
    fn parse(
        &mut self,
        export: &mut Export,
        delayq: &mut VecDeque<Delayed>,
        slot: usize,
    ) -> Result<(), ConnEnd> {
        self.stalled = false;
        loop {
            if let Some((off, left, handle)) = self.payload {
                // Payload bytes that came in the buffer with the header.
                let take = (left as usize).min(self.end - self.start);
                let o = off as usize;
                export.mem[o..o + take].copy_from_slice(&self.inbuf[self.start..self.start + take]);
                self.start += take;
                if take < left as usize {
                    self.payload = Some((off + take as u64, left - take as u32, handle));
                    return Ok(());
                }
                self.payload = None;
                self.push(proto::simple_reply(0, handle), Data::None);
            }
            if self.end - self.start < Request::SIZE {
                break;
            }
            if self.inflight() >= MAX_INFLIGHT {
                self.stalled = true;
                break;
            }
            let mut h = [0u8; Request::SIZE];
            h.copy_from_slice(&self.inbuf[self.start..self.start + Request::SIZE]);
            self.start += Request::SIZE;
            self.request(Request::parse(&h)?, export, delayq, slot)?;
        }
        Ok(())
    }

    fn request(
        &mut self,
        r: Request,
        export: &mut Export,
        delayq: &mut VecDeque<Delayed>,
        slot: usize,
    ) -> Result<(), ConnEnd> {
        let in_range = |what| {
            if r.len <= MAX_LEN
                && r.offset
                    .checked_add(r.len as u64)
                    .is_some_and(|e| e <= export.size)
            {
                Ok(())
            } else {
                Err(ConnEnd::OutOfRange {
                    what,
                    offset: r.offset,
                    len: r.len,
                    size: export.size,
                })
            }
        };
        match r.cmd {
            proto::CMD_READ => {
                in_range("NBD_CMD_READ")?;
                let hdr = proto::simple_reply(0, r.handle);
                match export.kind {
                    Kind::Null => self.push(hdr, Data::Zero(r.len)),
                    Kind::Memory => self.push(hdr, Data::Mem(r.offset, r.len)),
                    Kind::Delay => {
                        delayq.push_back(Delayed {
                            deadline: now_ns() + export.delay_ns,
                            slot,
                            gen: self.gen,
                            handle: r.handle,
                            len: r.len,
                        });
                        self.delayed += 1;
                    }
                }
            }
            proto::CMD_WRITE => {
                if export.kind != Kind::Memory {
                    return Err(ConnEnd::ReadOnly(export.kind));
                }
                in_range("NBD_CMD_WRITE")?;
                self.payload = Some((r.offset, r.len, r.handle));
            }
            proto::CMD_FLUSH => self.push(proto::simple_reply(0, r.handle), Data::None),
            proto::CMD_DISC => return Err(ConnEnd::Disc),
            other => {
                tracing::warn!("refusing command {other}: the floor serves READ, WRITE, FLUSH");
                self.push(proto::simple_reply(proto::EINVAL, r.handle), Data::None);
            }
        }
        Ok(())
    }

    fn push(&mut self, hdr: [u8; 16], data: Data) {
        self.out.push_back(Reply { hdr, data });
    }

    /// A delayed read is due: queue its reply (sent by the caller's flush).
    pub fn delayed_due(&mut self, d: Delayed) {
        self.delayed -= 1;
        self.push(proto::simple_reply(0, d.handle), Data::Zero(d.len));
    }

    /// Send queued replies until none are left or the socket is full.
    pub fn flush(&mut self, export: &Export) -> Result<(), ConnEnd> {
        while !self.out.is_empty() {
            let n = {
                let mut iov = [IoSlice::new(&[]); 2 * BATCH];
                let k = slices(&self.out, self.sent, export, &mut iov);
                let r = match self.tls.as_mut() {
                    Some(tls) => tls.writer().write_vectored(&iov[..k]),
                    None => (&self.sock).write_vectored(&iov[..k]),
                };
                match r {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e.into()),
                }
            };
            if n == 0 {
                break;
            }
            self.consume(n);
            if self.tls.is_some() && !self.write_tls()? {
                break;
            }
        }
        if self.tls.is_some() {
            self.write_tls()?;
        }
        Ok(())
    }

    /// Send rustls's records; false when the socket is full.
    fn write_tls(&mut self) -> Result<bool, ConnEnd> {
        let Some(tls) = self.tls.as_mut() else {
            return Ok(true);
        };
        while tls.wants_write() {
            match tls.write_tls(&mut self.sock) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(true)
    }

    /// `n` more bytes of the queue went out: drop the replies they finish.
    fn consume(&mut self, mut n: usize) {
        n += self.sent;
        while let Some(r) = self.out.front() {
            let len = 16
                + match r.data {
                    Data::None => 0,
                    Data::Zero(l) | Data::Mem(_, l) => l as usize,
                };
            if n < len {
                break;
            }
            n -= len;
            self.out.pop_front();
        }
        self.sent = n;
    }
}

/// The unsent bytes of up to BATCH replies, as slices.
fn slices<'a>(
    out: &'a VecDeque<Reply>,
    sent: usize,
    export: &'a Export,
    iov: &mut [IoSlice<'a>],
) -> usize {
    let mut k = 0;
    let mut skip = sent;
    for r in out.iter().take(BATCH) {
        let data: &[u8] = match r.data {
            Data::None => &[],
            Data::Zero(len) => &ZEROS[..len as usize],
            Data::Mem(off, len) => &export.mem[off as usize..off as usize + len as usize],
        };
        for part in [&r.hdr[..], data] {
            if skip >= part.len() {
                skip -= part.len();
                continue;
            }
            iov[k] = IoSlice::new(&part[skip..]);
            skip = 0;
            k += 1;
        }
    }
    k
}

/// Where received bytes go: the rest of a WRITE's payload in the export
/// (empty when no WRITE is in progress or the buffer already holds its
/// payload), then the buffer's free space.
fn split_target<'a>(
    payload: &mut Option<(u64, u32, u64)>,
    export: &'a mut Export,
    rest: &'a mut [u8],
) -> (&'a mut [u8], &'a mut [u8]) {
    match payload {
        Some((off, left, _)) => {
            let o = *off as usize;
            (&mut export.mem[o..o + *left as usize], rest)
        }
        None => (&mut [], rest),
    }
}

/// `n` bytes were received, the first of them into the WRITE's payload:
/// account for them, queue the WRITE's reply when its payload is
/// complete, and return how many went to the export.
fn advance_payload(
    payload: &mut Option<(u64, u32, u64)>,
    n: usize,
    out: &mut VecDeque<Reply>,
) -> usize {
    let Some((off, left, handle)) = *payload else {
        return 0;
    };
    let direct = n.min(left as usize);
    if direct == left as usize {
        *payload = None;
        out.push_back(Reply {
            hdr: proto::simple_reply(0, handle),
            data: Data::None,
        });
    } else {
        *payload = Some((off + direct as u64, left - direct as u32, handle));
    }
    direct
}
