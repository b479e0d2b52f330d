//! One connection's byte streams: the socket (TCP or Unix), split into a
//! sending half (submitters, one `writev` per request: header and payload
//! together, as the kernel's `nbd_send_cmd` sends a request with one
//! `sock_xmit` of an iov) and a receiving half owned by the connection's
//! reader thread.
//!
//! With TLS both halves go through one rustls connection behind a mutex.
//! The receiver never blocks while holding it: it reads records from the
//! socket unlocked, then feeds them to rustls under the lock; a sender
//! encrypts under the lock and writes the records after releasing it, and
//! senders are serialised by the caller's per-connection send lock, so
//! records reach the socket in the order they were made.

use parking_lot::Mutex;
use rustls::ClientConnection;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
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

/// Write every byte of `bufs` with as few `writev` calls as the socket
/// allows.
fn write_all_vectored(w: &mut impl Write, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
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
}

impl Sender {
    /// Send one request: its header and payload (empty unless a write).
    pub fn send(&mut self, header: &[u8], payload: &[u8]) -> io::Result<()> {
        let Some(tls) = &self.tls else {
            let mut bufs = [IoSlice::new(header), IoSlice::new(payload)];
            return write_all_vectored(&mut self.sock, &mut bufs);
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
        self.sock.write_all(&self.records)
    }

    pub fn shutdown(&self) {
        self.sock.shutdown();
    }
}

/// The receiving half (a plain socket or rustls over it).
pub struct Receiver {
    sock: Socket,
    tls: Option<Arc<Mutex<ClientConnection>>>,
    raw: Box<[u8]>,
    raw_start: usize,
    raw_end: usize,
}

/// Largest TLS record plus header: what one socket read feeds rustls.
const RAW_TLS_BUF: usize = 18 * 1024;

impl Read for Receiver {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(tls) = &self.tls else {
            return self.sock.read(buf);
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
            let n = self.sock.read(&mut self.raw)?;
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
        },
        Receiver {
            sock,
            tls,
            raw: vec![0u8; RAW_TLS_BUF].into_boxed_slice(),
            raw_start: 0,
            raw_end: 0,
        },
    ))
}
