//! A connection's receive buffer: one large `recv` takes many pipelined
//! requests at once, and the reader parses them from here without a
//! system call each. The handshake reads through it too, so bytes a client
//! sends ahead of the option replies are never lost.

use super::INBUF;
use crate::sock::Sock;
use std::io;

/// Buffered receive side. `fill` is the only place the reader blocks.
pub(super) struct InBuf {
    pub(super) buf: Box<[u8]>,
    pub(super) start: usize,
    pub(super) end: usize,
}

impl InBuf {
    pub(super) fn new() -> InBuf {
        InBuf {
            buf: vec![0u8; INBUF].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    pub(super) fn available(&self) -> usize {
        self.end - self.start
    }

    /// Read more bytes from the socket; `Ok(false)` at end of stream.
    pub(super) fn fill(&mut self, sock: &Sock) -> io::Result<bool> {
        self.make_room();
        let n = sock.recv(&mut self.buf[self.end..])?;
        self.end += n;
        Ok(n > 0)
    }

    /// Like [`fill`](Self::fill) but never blocks: `Ok(None)` when nothing
    /// is queued on the socket yet.
    pub(super) fn try_fill(&mut self, sock: &Sock) -> io::Result<Option<bool>> {
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

    pub(super) fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0u8; N];
        a.copy_from_slice(&self.buf[self.start..self.start + N]);
        self.start += N;
        a
    }

    /// Fill `dst` from the buffer, reading the socket as needed (the
    /// handshake's blocking reads).
    pub(super) fn recv_exact(&mut self, sock: &Sock, dst: &mut [u8]) -> io::Result<()> {
        let mut done = 0;
        while done < dst.len() {
            if self.available() == 0 && !self.fill(sock)? {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let n = self.available().min(dst.len() - done);
            dst[done..done + n].copy_from_slice(&self.buf[self.start..self.start + n]);
            self.start += n;
            done += n;
        }
        Ok(())
    }
}
