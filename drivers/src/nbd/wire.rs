//! One connection's byte streams: the socket (TCP or Unix), split into a
//! sending half (submitters, one `writev` per request: header and payload
//! together, as the kernel's `nbd_send_cmd` sends a request with one
//! `sock_xmit` of an iov) and a receiving half owned by the connection's
//! reader thread (on a poll queue, by whichever poller holds the reader
//! lock).
//!
//! With TLS both halves go through one rustls connection behind a mutex.
//! The receiver never blocks while holding it: it reads records from the
//! socket unlocked, then feeds them to rustls under the lock; a sender
//! encrypts under the lock and writes the records after releasing it, and
//! senders are serialised by the caller's per-connection send lock, so
//! records reach the socket in the order they were made.

use blkstack_core::timing::spin::{self, SpinPolicy};
use parking_lot::Mutex;
use rustls::ClientConnection;
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A connected stream socket.
#[derive(Debug)]
pub enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    /// Connect to `host:port` within `timeout` (every address the name
    /// resolves to is tried), with TCP_NODELAY: requests are small and
    /// latency-bound.
    pub fn connect_tcp(host: &str, port: u16, timeout: Duration) -> io::Result<Socket> {
        let mut last = io::Error::new(io::ErrorKind::NotFound, "host resolves to no address");
        for addr in (host, port).to_socket_addrs()? {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    return Ok(Socket::Tcp(s));
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    pub fn connect_unix(path: &Path) -> io::Result<Socket> {
        UnixStream::connect(path).map(Socket::Unix)
    }

    pub fn try_clone(&self) -> io::Result<Socket> {
        Ok(match self {
            Socket::Tcp(s) => Socket::Tcp(s.try_clone()?),
            Socket::Unix(s) => Socket::Unix(s.try_clone()?),
        })
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_read_timeout(t),
            Socket::Unix(s) => s.set_read_timeout(t),
        }
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_write_timeout(t),
            Socket::Unix(s) => s.set_write_timeout(t),
        }
    }

    /// TCP_USER_TIMEOUT: a TCP connection whose sent data stays
    /// unacknowledged this long fails (a cut link then ends in an error,
    /// not a send blocked for the kernel's default quarter of an hour).
    pub fn set_user_timeout(&self, t: Duration) -> io::Result<()> {
        let Socket::Tcp(s) = self else {
            return Ok(());
        };
        let ms = t.as_millis().min(u32::MAX as u128) as libc::c_uint;
        // SAFETY: a valid socket descriptor and an option of the size
        // the kernel expects for TCP_USER_TIMEOUT (unsigned int).
        let r = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_USER_TIMEOUT,
                (&ms as *const libc::c_uint).cast(),
                std::mem::size_of::<libc::c_uint>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Wake whoever blocks on this socket (both directions).
    pub fn shutdown(&self) {
        let _ = match self {
            Socket::Tcp(s) => s.shutdown(Shutdown::Both),
            Socket::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }
}

impl Socket {
    /// One non-blocking read (`MSG_DONTWAIT`): `Ok(None)` when nothing is
    /// there yet.
    fn try_read(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        let fd = match self {
            Socket::Tcp(s) => s.as_raw_fd(),
            Socket::Unix(s) => s.as_raw_fd(),
        };
        // SAFETY: `buf` is valid for `buf.len()` bytes; the fd is ours.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
            _ => Err(e),
        }
    }
}

impl Socket {
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        match self {
            Socket::Tcp(s) => s.as_raw_fd(),
            Socket::Unix(s) => s.as_raw_fd(),
        }
    }

    /// Whether the socket has bytes to read (or an error or end of
    /// stream to report) now: `poll` with a zero timeout.
    pub fn readable_now(&self) -> bool {
        let fd = self.raw_fd();
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, the fd is ours.
        unsafe { libc::poll(&mut p, 1, 0) > 0 }
    }
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.read(buf),
            Socket::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.write(buf),
            Socket::Unix(s) => s.write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.write_vectored(bufs),
            Socket::Unix(s) => s.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A connection thread's handle, and the flag a sender raises when the
/// socket stays full. On a poll queue nobody reads replies while its
/// submitter is inside a send; a server that stops reading requests
/// because its replies are not read would then hold that send forever,
/// so a stalled sender wakes the connection's thread to read replies
/// meanwhile (libnbd reads while it waits to write, for the same reason).
#[derive(Default)]
pub struct ThreadWake {
    pub send_stalled: AtomicBool,
    thread: Mutex<Option<std::thread::Thread>>,
}

impl ThreadWake {
    /// Record the calling thread as the one to wake.
    pub fn set_thread(&self) {
        *self.thread.lock() = Some(std::thread::current());
    }

    pub fn wake(&self) {
        if let Some(t) = self.thread.lock().as_ref() {
            t.unpark();
        }
    }

    fn stall(&self) {
        self.send_stalled.store(true, Ordering::Release);
        self.wake();
    }
}

/// Whether a socket call ended on its timeout (`SO_RCVTIMEO` and
/// `SO_SNDTIMEO` report `EAGAIN`), not on an error.
pub fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// How long a send on a poll queue may wait for room before it asks for
/// the replies to be read.
pub const SEND_STALL: Duration = Duration::from_millis(1);

/// Write every byte of `bufs` with as few `writev` calls as the socket
/// allows; a write that times out (only a poll queue's socket has a send
/// timeout) raises `stall` and goes on.
fn write_all_vectored(
    w: &mut impl Write,
    mut bufs: &mut [IoSlice<'_>],
    stall: Option<&ThreadWake>,
) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if timed_out(&e) => match stall {
                Some(s) => s.stall(),
                None => return Err(e),
            },
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The sending half.
pub struct Sender {
    sock: Socket,
    tls: Option<Arc<Mutex<ClientConnection>>>,
    /// Encrypted records waiting to be written (reused).
    records: Vec<u8>,
    /// A poll queue's: raised when a send stalls (see [`ThreadWake`]).
    stall: Option<Arc<ThreadWake>>,
}

impl Sender {
    /// Send one request: its header and payload (empty unless a write).
    pub fn send(&mut self, header: &[u8], payload: &[u8]) -> io::Result<()> {
        let stall = self.stall.as_deref();
        let Some(tls) = &self.tls else {
            let mut bufs = [IoSlice::new(header), IoSlice::new(payload)];
            return write_all_vectored(&mut self.sock, &mut bufs, stall);
        };
        self.records.clear();
        {
            let mut c = tls.lock();
            c.writer().write_all(header)?;
            c.writer().write_all(payload)?;
            while c.wants_write() {
                c.write_tls(&mut self.records)?;
            }
        }
        write_all_vectored(&mut self.sock, &mut [IoSlice::new(&self.records)], stall)
    }

    /// Make sends that wait [`SEND_STALL`] for room raise `stall` and
    /// carry on waiting (a poll queue's sender).
    pub fn set_stall(&mut self, stall: Arc<ThreadWake>) -> io::Result<()> {
        self.sock.set_write_timeout(Some(SEND_STALL))?;
        self.stall = Some(stall);
        Ok(())
    }

    pub fn shutdown(&self) {
        self.sock.shutdown();
    }
}

/// The receiving half (a plain socket or rustls over it).
pub struct Receiver {
    sock: Socket,
    /// Whether to busy-poll the socket before a blocking read
    /// (`poll_us=`; see `blkstack_core::timing::spin`).
    spin: SpinPolicy,
    tls: Option<Arc<Mutex<ClientConnection>>>,
    raw: Box<[u8]>,
    raw_start: usize,
    raw_end: usize,
}

/// Largest TLS record plus header: what one socket read feeds rustls.
const RAW_TLS_BUF: usize = 18 * 1024;

impl Receiver {
    /// Read from the socket, polling it first for as long as the spin
    /// policy allows: at low depth the reply comes soon after the request,
    /// and an awake reader saves a wake-up on every request's path.
    fn sock_read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let sock = &self.sock;
        if let Some(n) = spin::poll_for(&mut self.spin, || sock.try_read(buf))? {
            return Ok(n);
        }
        self.sock.read(buf)
    }
}

impl Read for Receiver {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(tls) = self.tls.clone() else {
            return self.sock_read(buf);
        };
        loop {
            {
                let mut c = tls.lock();
                match c.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                if self.raw_start < self.raw_end {
                    let mut rd = &self.raw[self.raw_start..self.raw_end];
                    let n = c.read_tls(&mut rd)?;
                    self.raw_start += n;
                    c.process_new_packets()
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                    continue;
                }
            }
            let mut raw = std::mem::take(&mut self.raw);
            let n = self.sock_read(&mut raw);
            self.raw = raw;
            let n = n?;
            if n == 0 {
                return Ok(0);
            }
            self.raw_start = 0;
            self.raw_end = n;
        }
    }
}

impl Receiver {
    pub fn socket(&self) -> &Socket {
        &self.sock
    }

    /// Whether bytes were received that a read would return without
    /// touching the socket (TLS records read but not yet decrypted, or
    /// plaintext rustls holds).
    pub fn has_pending(&self) -> bool {
        let Some(tls) = &self.tls else {
            return false;
        };
        if self.raw_start < self.raw_end {
            return true;
        }
        let mut c = tls.lock();
        c.process_new_packets()
            .map(|st| st.plaintext_bytes_to_read() > 0)
            .unwrap_or(true)
    }

    /// Busy-poll the socket up to `ns` before each blocking read (0: never).
    pub fn set_poll_ns(&mut self, ns: u64) {
        self.spin = SpinPolicy::new(ns);
    }
}

/// Split a connected (and negotiated) stream into its two halves.
pub fn split(sock: Socket, tls: Option<ClientConnection>) -> io::Result<(Sender, Receiver)> {
    let tx_sock = sock.try_clone()?;
    let tls = tls.map(|mut c| {
        // Requests are written whole; never let rustls refuse plaintext
        // because a large write outgrew its default buffer.
        c.set_buffer_limit(None);
        Arc::new(Mutex::new(c))
    });
    Ok((
        Sender {
            sock: tx_sock,
            tls: tls.clone(),
            records: Vec::new(),
            stall: None,
        },
        Receiver {
            sock,
            spin: SpinPolicy::new(0),
            tls,
            raw: vec![0u8; RAW_TLS_BUF].into_boxed_slice(),
            raw_start: 0,
            raw_end: 0,
        },
    ))
}

/// What outlives one reader: the socket's receiving half with the bytes
/// read ahead of the current reply, and the generation it belongs to. A
/// connection's thread keeps it; on a poll queue it lives in the
/// connection's reader lock, where each polling submitter picks it up.
pub struct ReadSide {
    pub rx: BufReader<Receiver>,
    pub gen: u64,
    /// A structured reply's chunk payload, read whole (reply.rs).
    pub scratch: Vec<u8>,
}

impl ReadSide {
    pub fn new(rx: Receiver, gen: u64) -> ReadSide {
        ReadSide {
            rx: BufReader::with_capacity(64 * 1024, rx),
            gen,
            scratch: Vec::with_capacity(4096),
        }
    }

    /// Bytes already read from the socket (or decrypted) that no reply
    /// has consumed yet.
    pub fn has_buffered(&self) -> bool {
        !self.rx.buffer().is_empty() || self.rx.get_ref().has_pending()
    }

    /// Whether a read would find something now (buffered, or on the
    /// socket) rather than sleep.
    pub fn readable_now(&self) -> bool {
        self.has_buffered() || self.rx.get_ref().socket().readable_now()
    }

    /// Shut the socket down, waking a submitter blocked sending on it
    /// (it holds the send lock that marking the connection down needs).
    pub fn shutdown(&self) {
        self.rx.get_ref().socket().shutdown();
    }
}
