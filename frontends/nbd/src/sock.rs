//! A connected stream socket (TCP or Unix) used through its raw fd.
//!
//! The reader thread and whichever thread completes a bio share one socket:
//! the reader only receives, completers only send (under the connection's
//! writer lock). Going through `recv`/`send`/`sendmsg` directly, instead of
//! `TcpStream`/`UnixStream`, gives one type for both families, lets replies
//! go out with `MSG_NOSIGNAL` (a vanished client must not kill the server
//! with SIGPIPE) and lets the output queue's headers and READ data leave
//! in one `sendmsg` of many iovecs without copying the data
//! ([`Sock::send_iov`]). Completers send with `MSG_DONTWAIT` only;
//! blocking sends, bounded by the send timeout, are left to the
//! connection's own threads. After
//! STARTTLS the same calls go through the connection's TLS session
//! (`tls.rs`).

use crate::tls::TlsSession;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

pub struct Sock {
    fd: OwnedFd,
    /// Set once the client upgraded with STARTTLS: from then on every
    /// byte goes through it (see `tls.rs`).
    tls: OnceLock<TlsSession>,
    /// The receive timeout in milliseconds (0: none), for the TLS path,
    /// which waits in `poll` rather than in a blocking `recv`.
    recv_timeout_ms: AtomicU64,
}

/// Non-blocking reads of the raw socket, for rustls's `read_tls`.
struct RawReader<'a>(&'a Sock);

impl Read for RawReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.0.raw_recv_nowait(buf)? {
            Some(n) => Ok(n),
            None => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

impl Sock {
    pub fn new(fd: OwnedFd) -> Sock {
        Sock {
            fd,
            tls: OnceLock::new(),
            recv_timeout_ms: AtomicU64::new(0),
        }
    }

    /// Switch to TLS (after NBD_OPT_STARTTLS was acknowledged).
    pub fn start_tls(&self, session: TlsSession) -> io::Result<()> {
        self.tls
            .set(session)
            .map_err(|_| io::Error::other("TLS already started"))
    }

    pub fn is_tls(&self) -> bool {
        self.tls.get().is_some()
    }

    /// Receive through TLS: plaintext rustls already holds, else records
    /// read without blocking while the session is locked; `block` waits
    /// for the socket (bounded by the receive timeout: then WouldBlock).
    /// `Ok(None)`: nothing yet and `block` is false.
    fn tls_recv(&self, t: &TlsSession, buf: &mut [u8], block: bool) -> io::Result<Option<usize>> {
        loop {
            let mut conn = t.conn.lock();
            match conn.reader().read(buf) {
                Ok(n) => return Ok(Some(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            match conn.read_tls(&mut RawReader(self)) {
                Ok(0) => return Ok(Some(0)),
                Ok(_) => {
                    let processed = conn.process_new_packets().map(|_| ());
                    // Handshake messages, or the alert for a bad record.
                    t.flush(conn, |d| self.raw_send_all2(d, &[]))?;
                    processed.map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    drop(conn);
                    if !block {
                        return Ok(None);
                    }
                    if !self.poll_in(self.recv_timeout())? {
                        return Err(io::ErrorKind::WouldBlock.into());
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn recv_timeout(&self) -> Option<Duration> {
        match self.recv_timeout_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    /// Wait until the socket is readable or `t` passes; whether readable.
    fn poll_in(&self, t: Option<Duration>) -> io::Result<bool> {
        let ms = t.map_or(-1, |d| {
            d.as_millis().clamp(1, i32::MAX as u128) as libc::c_int
        });
        let mut pfd = libc::pollfd {
            fd: self.raw(),
            events: libc::POLLIN,
            revents: 0,
        };
        loop {
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(&mut pfd, 1, ms) };
            if n >= 0 {
                return Ok(n > 0);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// One `recv`; `Ok(0)` is end of stream. Retries on EINTR.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(t) = self.tls.get() {
            return Ok(self.tls_recv(t, buf, true)?.unwrap_or(0));
        }
        loop {
            // SAFETY: buf is valid writable memory of buf.len() bytes.
            let n = unsafe { libc::recv(self.raw(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// One non-blocking `recv`: `Ok(None)` when nothing is queued yet,
    /// `Ok(Some(0))` at end of stream. Used by the reader's bounded poll.
    pub fn recv_nowait(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        match self.tls.get() {
            Some(t) => self.tls_recv(t, buf, false),
            None => self.raw_recv_nowait(buf),
        }
    }

    fn raw_recv_nowait(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        loop {
            // SAFETY: buf is valid writable memory of buf.len() bytes.
            let n = unsafe {
                libc::recv(
                    self.raw(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n >= 0 {
                return Ok(Some(n as usize));
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => return Ok(None),
                _ => return Err(e),
            }
        }
    }

    /// Sleep until this socket or one of `others` is readable (a negative
    /// descriptor is left out); which of them are, the socket first (also
    /// when it hung up, or holds decrypted bytes already). Retries on
    /// EINTR.
    pub fn wait_ready(&self, others: [RawFd; 2]) -> io::Result<[bool; 3]> {
        if let Some(t) = self.tls.get() {
            let mut conn = t.conn.lock();
            let buffered = conn
                .process_new_packets()
                .map(|s| s.plaintext_bytes_to_read() > 0)
                .unwrap_or(true); // an error: let the reader see it
            if buffered {
                return Ok([true, false, false]);
            }
        }
        let fd = |fd: RawFd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let mut fds = [fd(self.raw()), fd(others[0]), fd(others[1])];
        loop {
            // SAFETY: fds is a valid array of three pollfd (poll skips
            // negative descriptors).
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 3, -1) };
            if n >= 0 {
                return Ok(fds.map(|f| f.revents != 0));
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Receive exactly `buf.len()` bytes or fail (EOF is `UnexpectedEof`).
    pub fn recv_exact(&self, mut buf: &mut [u8]) -> io::Result<()> {
        while !buf.is_empty() {
            let n = self.recv(buf)?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            buf = &mut buf[n..];
        }
        Ok(())
    }

    /// Send all of `a` then all of `b`, with as few syscalls as the kernel
    /// allows (one `sendmsg` in the common case).
    pub fn send_all2(&self, a: &[u8], b: &[u8]) -> io::Result<()> {
        let Some(t) = self.tls.get() else {
            return self.raw_send_all2(a, b);
        };
        let mut conn = t.conn.lock();
        let mut w = conn.writer();
        std::io::Write::write_all(&mut w, a)?;
        std::io::Write::write_all(&mut w, b)?;
        t.flush(conn, |d| self.raw_send_all2(d, &[]))
    }

    /// Blocking: bounded by the socket's send timeout (SO_SNDTIMEO) when
    /// no byte goes for that long, which then fails with WouldBlock.
    fn raw_send_all2(&self, mut a: &[u8], mut b: &[u8]) -> io::Result<()> {
        while !a.is_empty() || !b.is_empty() {
            let mut n = self.sendmsg(a, b, libc::MSG_NOSIGNAL)?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            let from_a = n.min(a.len());
            a = &a[from_a..];
            n -= from_a;
            b = &b[n..];
        }
        Ok(())
    }

    /// One `sendmsg` of `a` then `b`; retries on EINTR.
    fn sendmsg(&self, a: &[u8], b: &[u8], flags: libc::c_int) -> io::Result<usize> {
        self.sendmsg_iov(&[io::IoSlice::new(a), io::IoSlice::new(b)], flags)
    }

    /// One `sendmsg` of `iov` (the output queue's run of segments);
    /// `block` false adds `MSG_DONTWAIT`. Blocking, it is bounded by the
    /// send timeout (then WouldBlock). Plain sockets only: over TLS use
    /// [`Sock::send_all_iov`]. Retries on EINTR.
    pub fn send_iov(&self, iov: &[io::IoSlice<'_>], block: bool) -> io::Result<usize> {
        let mut flags = libc::MSG_NOSIGNAL;
        if !block {
            flags |= libc::MSG_DONTWAIT;
        }
        self.sendmsg_iov(iov, flags)
    }

    /// One `sendmsg` of `iov` with `flags`; retries on EINTR.
    fn sendmsg_iov(&self, iov: &[io::IoSlice<'_>], flags: libc::c_int) -> io::Result<usize> {
        // SAFETY: zeroed msghdr is a valid "no name, no control" header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        // IoSlice is ABI-compatible with iovec on Unix (std guarantees it).
        msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = iov.len() as _;
        loop {
            // SAFETY: msg_iov points at `iov`, live slices, for the call.
            let n = unsafe { libc::sendmsg(self.raw(), &msg, flags) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Send every byte of `iov`, blocking (bounded by the send timeout
    /// without progress). Over TLS the slices are encrypted into records
    /// and the records sent at once.
    pub fn send_all_iov(&self, iov: &[io::IoSlice<'_>]) -> io::Result<()> {
        let Some(t) = self.tls.get() else {
            for s in iov {
                self.raw_send_all2(s, &[])?;
            }
            return Ok(());
        };
        let mut conn = t.conn.lock();
        let mut w = conn.writer();
        // One vectored write: rustls fills its records across the slices
        // (a reply header does not get a record of its own).
        let mut skip = std::io::Write::write_vectored(&mut w, iov)?;
        for s in iov {
            if skip >= s.len() {
                skip -= s.len();
                continue;
            }
            // Only if rustls took less (it has no send limit here).
            std::io::Write::write_all(&mut w, &s[skip..])?;
            skip = 0;
        }
        t.flush(conn, |d| self.raw_send_all2(d, &[]))
    }

    pub fn send_all(&self, a: &[u8]) -> io::Result<()> {
        self.send_all2(a, &[])
    }

    /// `shutdown(2)`; errors (e.g. already disconnected) are irrelevant to
    /// every caller, which only wants the other side unblocked.
    pub fn shutdown(&self, how: std::net::Shutdown) {
        let how = match how {
            std::net::Shutdown::Read => libc::SHUT_RD,
            std::net::Shutdown::Write => libc::SHUT_WR,
            std::net::Shutdown::Both => libc::SHUT_RDWR,
        };
        // SAFETY: plain syscall on an fd we own.
        unsafe { libc::shutdown(self.raw(), how) };
    }

    /// Bound how long a `recv` may block (None: forever). Used so that a
    /// client that stalls mid-handshake cannot pin a thread for ever.
    pub fn set_recv_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        let ms = t.map_or(0, |d| d.as_millis().clamp(1, u64::MAX as u128) as u64);
        self.recv_timeout_ms.store(ms, Ordering::Relaxed);
        self.set_timeout(libc::SO_RCVTIMEO, t)
    }

    /// Bound how long a `send` may block without progress (None: forever):
    /// a handshake client that never reads its replies.
    pub fn set_send_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.set_timeout(libc::SO_SNDTIMEO, t)
    }

    fn set_timeout(&self, opt: libc::c_int, t: Option<Duration>) -> io::Result<()> {
        let tv = match t {
            Some(d) => libc::timeval {
                tv_sec: d.as_secs() as libc::time_t,
                tv_usec: d.subsec_micros() as libc::suseconds_t,
            },
            None => libc::timeval {
                tv_sec: 0,
                tv_usec: 0,
            },
        };
        // SAFETY: tv is a valid timeval for SO_RCVTIMEO/SO_SNDTIMEO.
        let r = unsafe {
            libc::setsockopt(
                self.raw(),
                libc::SOL_SOCKET,
                opt,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}
