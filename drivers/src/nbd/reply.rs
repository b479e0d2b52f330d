//! The reader side of a connection: parse simple and structured replies
//! (`doc/proto.md`, "Transmission"), place READ data straight into the
//! request's buffer, and end a request once its last part is answered
//! (kernel nbd `recv_work` / `nbd_handle_reply`: the cookie gives the
//! hardware queue and the tag, a reply for an unknown or finished cookie
//! is a protocol error that kills the connection).
//!
//! The receiving half itself, with what it read ahead, is
//! [`ReadSide`](super::wire::ReadSide), in `wire.rs` beside the socket.
//!
//! The socket is read through one reusable buffer per connection; nothing
//! is allocated per reply. Reads time out periodically only when the
//! device has a request timeout, so the reader can notice a request that
//! the server never answers (kernel `nbd_xmit_timeout`).

use super::connection::{split_cookie, status_of, Connection, SlotData};
use super::extents::ExtentQuery;
use super::proto::*;
use super::wire::{timed_out, ReadSide};
use blkstack_core::clock::now_ns;
use blkstack_core::Status;
use blkstack_mq::CompleterRef;
use std::io::{self, Read};
use std::sync::atomic::Ordering;

/// Largest structured-reply payload that is not READ data (an error
/// message, a block-status chunk) the reader accepts.
const MAX_META_CHUNK: u32 = 1 << 20;

/// Why the reader stopped serving a connection.
pub enum ReaderExit {
    /// The device is being removed.
    Stop,
    /// The connection died; the text says how.
    Dead(String),
}

pub struct ReplyReader<'a> {
    pub conn: &'a Connection,
    pub side: &'a mut ReadSide,
    pub done: CompleterRef<'a>,
    pub extents: &'a ExtentQuery,
    /// Request timeout (0: none).
    pub timeout_ns: u64,
    /// Requests this reader ended.
    pub ended: usize,
}

type R<T> = Result<T, ReaderExit>;

fn dead(what: &str) -> ReaderExit {
    ReaderExit::Dead(what.to_string())
}

impl<'a> ReplyReader<'a> {
    pub fn new(
        conn: &'a Connection,
        side: &'a mut ReadSide,
        done: CompleterRef<'a>,
        extents: &'a ExtentQuery,
        timeout_ns: u64,
    ) -> Self {
        ReplyReader {
            conn,
            side,
            done,
            extents,
            timeout_ns,
            ended: 0,
        }
    }

    /// Called when a read timed out: stop, or declare the connection dead
    /// when a request waited longer than the timeout.
    fn tick(&self) -> R<()> {
        if self.conn.stop.load(Ordering::Acquire) {
            return Err(ReaderExit::Stop);
        }
        let now = now_ns();
        let oldest = self.conn.oldest_sent_ns(now);
        if self.timeout_ns > 0 && oldest > self.timeout_ns {
            self.conn.stats.timeouts.fetch_add(1, Ordering::Relaxed);
            return Err(dead("request timed out"));
        }
        // Reconnected, yet still nothing answered within the dead
        // timeout of the first failure: give the requests up.
        if let Some(since) = self.conn.stats.failing() {
            let limit = self.conn.dead_timeout_ns;
            if limit > 0 && oldest > 0 && now.saturating_sub(since) >= limit {
                return Err(dead("no progress within the dead timeout"));
            }
        }
        Ok(())
    }

    /// `read_exact` that survives read timeouts without losing bytes.
    fn read_full(&mut self, buf: &mut [u8]) -> R<()> {
        let mut done = 0;
        while done < buf.len() {
            match self.side.rx.read(&mut buf[done..]) {
                Ok(0) => {
                    if self.conn.stop.load(Ordering::Acquire) {
                        return Err(ReaderExit::Stop);
                    }
                    return Err(dead("server closed the connection"));
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if timed_out(&e) => self.tick()?,
                Err(e) => {
                    if self.conn.stop.load(Ordering::Acquire) {
                        return Err(ReaderExit::Stop);
                    }
                    return Err(ReaderExit::Dead(format!("receive: {e}")));
                }
            }
        }
        Ok(())
    }

    /// Read `len` bytes into the scratch buffer.
    fn read_scratch(&mut self, len: u32) -> R<()> {
        if len > MAX_META_CHUNK {
            return Err(dead("oversized reply chunk"));
        }
        let mut s = std::mem::take(&mut self.side.scratch);
        s.clear();
        s.resize(len as usize, 0);
        let r = self.read_full(&mut s);
        self.side.scratch = s;
        r
    }

    /// Serve replies until the connection dies or the device stops.
    pub fn run(&mut self) -> ReaderExit {
        loop {
            if let Err(e) = self.one_reply() {
                return e;
            }
        }
    }

    /// Read one reply (all of it, sleeping for its bytes as needed).
    pub fn one_reply(&mut self) -> R<()> {
        let mut m = [0u8; 4];
        self.read_full(&mut m)?;
        match u32::from_be_bytes(m) {
            SIMPLE_REPLY_MAGIC => {
                let mut b = [0u8; 12];
                self.read_full(&mut b)?;
                let error = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
                let handle = u64::from_be_bytes(b[4..12].try_into().unwrap_or([0; 8]));
                self.simple(error, handle)
            }
            STRUCTURED_REPLY_MAGIC => {
                let mut b = [0u8; 16];
                self.read_full(&mut b)?;
                let flags = u16::from_be_bytes([b[0], b[1]]);
                let typ = u16::from_be_bytes([b[2], b[3]]);
                let handle = u64::from_be_bytes(b[4..12].try_into().unwrap_or([0; 8]));
                let len = u32::from_be_bytes([b[12], b[13], b[14], b[15]]);
                self.chunk(flags, typ, handle, len)
            }
            other => Err(ReaderExit::Dead(format!("bad reply magic {other:#x}"))),
        }
    }

    /// The slot a cookie names, if it is a request in flight here.
    fn lookup(&self, handle: u64) -> R<(u32, u32, SlotData)> {
        let (h, part, tag) = split_cookie(handle);
        let slot = self
            .conn
            .slots
            .get(tag as usize)
            .filter(|_| h == self.conn.index)
            .ok_or_else(|| dead("reply with an unknown cookie"))?;
        let d = *slot.0.lock();
        if !d.active || d.sent_gen != self.side.gen || part >= d.parts {
            return Err(dead("reply for a request not in flight"));
        }
        Ok((tag, part, d))
    }

    fn simple(&mut self, error: u32, handle: u64) -> R<()> {
        let (tag, part, d) = self.lookup(handle)?;
        let mut covered = 0;
        if error == 0 && d.cmd == CMD_READ && part < d.data_parts {
            let (at, n) = d.part_range(part, self.conn.chunk(d.zero_fill));
            let buf = &mut d.buf.as_mut_slice()[at as usize..(at + n) as usize];
            self.read_full(buf)?;
            covered = n;
        }
        self.finish_part(tag, status_of(error), covered);
        Ok(())
    }

    fn chunk(&mut self, flags: u16, typ: u16, handle: u64, len: u32) -> R<()> {
        let (tag, _part, d) = self.lookup(handle)?;
        let mut status = Status::Ok;
        let mut covered = 0;
        match typ {
            REPLY_TYPE_NONE if len == 0 => {}
            REPLY_TYPE_OFFSET_DATA if len >= 8 && d.cmd == CMD_READ => {
                let mut o = [0u8; 8];
                self.read_full(&mut o)?;
                let at = self.place(&d, u64::from_be_bytes(o), (len - 8) as u64)?;
                let buf = &mut d.buf.as_mut_slice()[at..at + (len - 8) as usize];
                self.read_full(buf)?;
                covered = (len - 8) as u64;
            }
            REPLY_TYPE_OFFSET_HOLE if len == 12 && d.cmd == CMD_READ => {
                let mut b = [0u8; 12];
                self.read_full(&mut b)?;
                let off = u64::from_be_bytes(b[..8].try_into().unwrap_or([0; 8]));
                let n = u32::from_be_bytes([b[8], b[9], b[10], b[11]]) as usize;
                let at = self.place(&d, off, n as u64)?;
                d.buf.as_mut_slice()[at..at + n].fill(0);
                covered = n as u64;
            }
            REPLY_TYPE_BLOCK_STATUS if d.cmd == CMD_BLOCK_STATUS => {
                self.read_scratch(len)?;
                self.extents.add_chunk(&self.side.scratch);
            }
            t if t & (1 << 15) != 0 => {
                if len < 6 {
                    return Err(dead("short error chunk"));
                }
                self.read_scratch(len)?;
                let s = &self.side.scratch;
                status = status_of(u32::from_be_bytes([s[0], s[1], s[2], s[3]]));
                if status.is_ok() {
                    status = Status::IoError;
                }
            }
            _ => {
                return Err(ReaderExit::Dead(format!(
                    "unexpected reply chunk type {typ}"
                )))
            }
        }
        if !status.is_ok() {
            self.record(tag, status);
        }
        if flags & REPLY_FLAG_DONE != 0 {
            self.finish_part(tag, Status::Ok, covered);
        } else if covered > 0 {
            self.cover(tag, covered);
        }
        Ok(())
    }

    /// Where `off..off+len` of a READ's reply goes in its buffer.
    fn place(&self, d: &SlotData, off: u64, len: u64) -> R<usize> {
        if off < d.offset || off.saturating_add(len) > d.offset + d.len {
            return Err(dead("read reply outside the request"));
        }
        Ok((off - d.offset) as usize)
    }

    /// `n` more bytes of a READ answered.
    fn cover(&self, tag: u32, n: u64) {
        let mut d = self.conn.slots[tag as usize].0.lock();
        d.covered = d.covered.saturating_add(n);
    }

    fn record(&self, tag: u32, status: Status) {
        let mut d = self.conn.slots[tag as usize].0.lock();
        if d.status.is_ok() {
            d.status = status;
        }
    }

    /// One part answered, its last reply covering `covered` more bytes of
    /// a READ: end the request when it was the last part.
    fn finish_part(&mut self, tag: u32, status: Status, covered: u64) {
        let mut d = self.conn.slots[tag as usize].0.lock();
        // An extent query that gave up meanwhile is no longer ours.
        if !d.active || d.sent_gen != self.side.gen {
            return;
        }
        d.covered = d.covered.saturating_add(covered);
        if d.status.is_ok() {
            d.status = status;
        }
        d.remaining = d.remaining.saturating_sub(1);
        if d.remaining > 0 {
            return;
        }
        d.active = false;
        // A READ whose replies said "done" without covering every byte
        // would hand back whatever the buffer held: a server bug, and an
        // I/O error, never a silent success (libnbd checks the same).
        if d.cmd == CMD_READ && d.status.is_ok() && d.covered < d.len {
            tracing::warn!(
                covered = d.covered,
                len = d.len,
                "nbd: read reply did not cover the whole request"
            );
            d.status = Status::IoError;
        }
        let st = d.status;
        drop(d);
        // An answered request is progress: the connection is healthy.
        self.conn
            .stats
            .progress_ns
            .store(now_ns(), Ordering::Relaxed);
        if tag as usize == self.conn.slots.len() - 1 {
            self.extents.finish(st);
            return;
        }
        self.conn.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.ended += 1;
        self.done.end_request(self.conn.index, tag, st);
    }
}
