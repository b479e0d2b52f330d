//! A connection's receive buffer: one large `recv` takes many pipelined
//! requests at once, and the reader parses them from here without a
//! system call each. The handshake reads through it too, so bytes a client
//! sends ahead of the option replies are never lost.

use super::INBUF;
use crate::sock::Sock;
use std::io;
use std::time::{Duration, Instant};

/// Anonymous memory mapped for the receive buffer: its pages become
/// resident only when a `recv` writes them, and [`PageBuf::release`] gives
/// them back (`MADV_DONTNEED`) while the mapping stays. A heap allocation
/// could not promise either: once the allocator has raised its mmap
/// threshold, a zeroed 256 KiB block comes from a heap arena and is
/// written in full, so every idle connection would keep it resident.
pub(super) struct PageBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: PageBuf owns its mapping exclusively, as a Box<[u8]> would.
unsafe impl Send for PageBuf {}

impl PageBuf {
    fn new(len: usize) -> io::Result<PageBuf> {
        // SAFETY: a fresh private anonymous mapping; no existing memory is
        // touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = std::ptr::NonNull::new(p.cast()).ok_or_else(io::Error::last_os_error)?;
        Ok(PageBuf { ptr, len })
    }

    /// Drop the pages' contents and residency; they read as zero again.
    fn release(&mut self) {
        // SAFETY: the range is our own mapping; MADV_DONTNEED on private
        // anonymous memory only discards its contents.
        unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, libc::MADV_DONTNEED) };
    }
}

impl std::ops::Deref for PageBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` mapped, readable bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: `len` mapped, writable bytes owned by self, borrowed
        // mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Buffered receive side. `fill` is the only place the reader blocks.
pub(super) struct InBuf {
    pub(super) buf: PageBuf,
    pub(super) start: usize,
    pub(super) end: usize,
    /// While set (the handshake), blocking reads fail with `TimedOut`
    /// once this instant passes, however the client trickles its bytes:
    /// an absolute bound, not an idle timeout a slowloris client resets.
    pub(super) deadline: Option<Instant>,
}

impl InBuf {
    pub(super) fn new() -> io::Result<InBuf> {
        Ok(InBuf {
            buf: PageBuf::new(INBUF)?,
            start: 0,
            end: 0,
            deadline: None,
        })
    }

    /// Give the buffer's memory back while nothing is buffered (an idle
    /// connection).
    pub(super) fn release_if_empty(&mut self) {
        if self.available() == 0 {
            self.buf.release();
            self.start = 0;
            self.end = 0;
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
            if let Some(d) = self.deadline {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "handshake not finished in time",
                    ));
                }
                // (A zero timeout would mean none at all.) Replies sent
                // until the next read are bounded by what is left too.
                let left = Some(left.max(Duration::from_millis(1)));
                sock.set_recv_timeout(left)?;
                sock.set_send_timeout(left)?;
            }
            if self.available() == 0 {
                match self.fill(sock) {
                    Ok(true) => {}
                    Ok(false) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "handshake not finished in time",
                        ));
                    }
                    Err(e) => return Err(e),
                }
            }
            let n = self.available().min(dst.len() - done);
            dst[done..done + n].copy_from_slice(&self.buf[self.start..self.start + n]);
            self.start += n;
            done += n;
        }
        Ok(())
    }
}
