//! Listening sockets, accepting connections, and the graceful stop.
//!
//! One thread accepts on every listener at once with `poll(2)`, which also
//! watches a self-pipe: [`Stopper::stop`] (serve's stop, on SIGINT or
//! SIGTERM) writes a byte there. Stopping then
//! follows what the NBD spec asks of a server that shuts down: no new
//! connections (listeners closed, Unix socket files removed), the read side
//! of every connection shut so no new request is accepted, every request
//! already in flight completed and answered, and finally every exported
//! device flushed.

use crate::conn;
use crate::export::{Export, ExportTable};
use crate::limits::{AcceptBackoff, Admission, HandshakeTicket, Limits};
use crate::sock::Sock;
use crate::tls::{TlsMode, TlsPolicy};
use crate::uri::ListenUri;
use blkstack_core::sync::submit_and_wait;
use blkstack_core::timing::spin::PollSetting;
use blkstack_core::Op;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io;
use std::net::TcpListener;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Default bound of a reader's busy-poll (see `blkstack_core::timing::spin`):
/// off. A poll buys latency at low queue depth with CPU the peers
/// (nbdkit, qemu-nbd) do not spend: each empty try is a `recv` and a
/// `sched_yield`, several per request at QD1, where a blocking reader
/// makes one `recv` (docs/BENCHMARKS.md, "where the µs go").
/// `--poll-us 50` turns it back on, `--poll-us auto` sizes it per
/// connection from the gaps between requests.
pub const DEFAULT_POLL_NS: u64 = 0;

/// [`DEFAULT_POLL_NS`] as a [`PollSetting`].
pub const DEFAULT_POLL: PollSetting = PollSetting::Off;

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Listener {
    fn fd(&self) -> RawFd {
        match self {
            Listener::Tcp(l) => l.as_raw_fd(),
            Listener::Unix(l, _) => l.as_raw_fd(),
        }
    }

    fn accept(&self) -> io::Result<OwnedFd> {
        match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                // Replies are small and latency-bound: never wait for Nagle.
                s.set_nodelay(true)?;
                Ok(OwnedFd::from(s))
            }
            Listener::Unix(l, _) => Ok(OwnedFd::from(l.accept()?.0)),
        }
    }
}

/// Wakes a running [`Server`] up and makes it stop gracefully.
#[derive(Clone)]
pub struct Stopper {
    w: Arc<OwnedFd>,
}

impl Stopper {
    pub fn stop(&self) {
        let b = 1u8;
        // SAFETY: writes one byte from a valid buffer to our pipe. A full
        // pipe (EAGAIN) means a stop is already pending: nothing to do.
        unsafe { libc::write(self.w.as_raw_fd(), (&b as *const u8).cast(), 1) };
    }
}

/// What a finished [`Server::run`] did.
#[derive(Debug, Default, Clone, Copy)]
pub struct ServeSummary {
    pub connections: u64,
}

pub struct Server {
    exports: ExportTable,
    listeners: Vec<(ListenUri, Listener)>,
    stop_r: OwnedFd,
    stop_w: Arc<OwnedFd>,
    /// How each connection reader busy-polls before it blocks (see
    /// `blkstack_core::timing::spin`).
    poll: PollSetting,
    limits: Limits,
    tls: TlsPolicy,
}

/// Unix sockets are private to their owner unless asked otherwise (the
/// umask would otherwise decide, 0777 at umask 0), as the control socket.
pub const DEFAULT_SOCKET_MODE: u32 = 0o600;

fn set_mode(p: &std::path::Path, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("cannot set mode {mode:o} on {}: {e}", p.display()),
        )
    })
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: fds is a valid array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two fresh fds that we now own.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

impl Server {
    /// Bind every address. A Unix socket path that holds a socket nobody
    /// listens on (a crashed earlier server) is replaced; a live socket or
    /// anything else is an error
    /// ([`blkstack_control::remove_stale_socket`]).
    pub fn bind(exports: Vec<Export>, addrs: &[ListenUri]) -> io::Result<Server> {
        // No exports is allowed: `export` may add them later, and a
        // ublk-only serve binds no address at all.
        let mut listeners = Vec::new();
        for a in addrs {
            let l = match a {
                ListenUri::Tcp(sa) => {
                    let l = TcpListener::bind(sa).map_err(|e| {
                        io::Error::new(e.kind(), format!("cannot listen on {a}: {e}"))
                    })?;
                    let bound = l.local_addr()?;
                    (ListenUri::Tcp(bound), Listener::Tcp(l))
                }
                ListenUri::Unix(p) => {
                    blkstack_control::remove_stale_socket(p, "NBD socket")?;
                    let l = UnixListener::bind(p).map_err(|e| {
                        io::Error::new(e.kind(), format!("cannot listen on {a}: {e}"))
                    })?;
                    set_mode(p, DEFAULT_SOCKET_MODE)?;
                    (a.clone(), Listener::Unix(l, p.clone()))
                }
            };
            listeners.push(l);
        }
        let (stop_r, stop_w) = pipe()?;
        Ok(Server {
            exports: ExportTable::new(exports),
            listeners,
            stop_r,
            stop_w: Arc::new(stop_w),
            poll: DEFAULT_POLL,
            limits: Limits::default(),
            tls: TlsPolicy::default(),
        })
    }

    /// The addresses actually bound (TCP port 0 resolved).
    pub fn addresses(&self) -> Vec<ListenUri> {
        self.listeners.iter().map(|(u, _)| u.clone()).collect()
    }

    /// The exports now (live control may change them while running).
    pub fn exports(&self) -> Arc<Vec<Export>> {
        self.exports.snapshot()
    }

    /// Live control: the handle `export`/`unexport` change.
    pub fn export_table(&self) -> ExportTable {
        self.exports.clone()
    }

    /// Bound each connection reader's busy-poll of its socket (0: never
    /// poll, always block).
    pub fn set_poll_ns(&mut self, ns: u64) {
        self.poll = match ns {
            0 => PollSetting::Off,
            ns => PollSetting::Fixed(ns),
        };
    }

    /// How each connection reader polls its socket: off, a fixed bound,
    /// or a window sized from the waits it sees (`--poll-us auto`).
    pub fn set_poll(&mut self, poll: PollSetting) {
        self.poll = poll;
    }

    /// Permissions of the Unix sockets (default [`DEFAULT_SOCKET_MODE`]):
    /// whoever may connect may read and write every export.
    pub fn set_socket_mode(&self, mode: u32) -> io::Result<()> {
        for (_, l) in &self.listeners {
            if let Listener::Unix(_, p) = l {
                set_mode(p, mode)?;
            }
        }
        Ok(())
    }

    /// Connection cap, handshake deadline, idle trim (see `limits.rs`).
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    /// STARTTLS policy (see `tls.rs`).
    pub fn set_tls(&mut self, tls: TlsPolicy) {
        if tls.mode != TlsMode::Require {
            self.warn_open_tcp();
        }
        if tls.mode == TlsMode::On && tls.verify_peer {
            // nbdkit accepts this pair silently; the certificate check
            // then guards only clients that choose TLS.
            tracing::warn!(
                "nbd: --tls-verify-peer with --tls=on checks only clients that choose TLS: \
                 plaintext clients skip it and get full access; use --tls=require"
            );
        }
        self.tls = tls;
    }

    /// Say so when a TCP listener is reachable from other hosts while
    /// clients may skip TLS.
    fn warn_open_tcp(&self) {
        for (a, _) in &self.listeners {
            if matches!(a, ListenUri::Tcp(sa) if !sa.ip().is_loopback()) {
                tracing::warn!(
                    address = %a,
                    "nbd: listening on a non-loopback address without TLS required: \
                     anyone who can reach it can read and write the exports"
                );
            }
        }
    }

    pub fn stopper(&self) -> Stopper {
        Stopper {
            w: self.stop_w.clone(),
        }
    }

    /// Accept and serve until stopped; then stop gracefully (see the
    /// module documentation) and return.
    pub fn run(self) -> io::Result<ServeSummary> {
        let live: Live = Arc::default();
        let admission = Arc::new(Admission::default());
        let mut threads: Vec<JoinHandle<()>> = Vec::new();
        let mut summary = ServeSummary::default();
        let mut backoff = AcceptBackoff::default();
        let mut pfds: Vec<libc::pollfd> = self
            .listeners
            .iter()
            .map(|(_, l)| l.fd())
            .chain(std::iter::once(self.stop_r.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        loop {
            // SAFETY: pfds is a valid array of pollfd.
            let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, -1) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                // Only a signal or a stop ends the server, and always
                // gracefully: back off as for any other shortage.
                if self.wait_for_stop(backoff.failed(&e).max(Duration::from_millis(10))) {
                    break;
                }
                continue;
            }
            if pfds[pfds.len() - 1].revents != 0 {
                break;
            }
            let mut pause = Duration::ZERO;
            for (i, (_, l)) in self.listeners.iter().enumerate() {
                if pfds[i].revents == 0 {
                    continue;
                }
                let fd = match l.accept() {
                    Ok(fd) => fd,
                    // A client that went away before accept: keep serving.
                    // Out of descriptors: the listener stays readable, so
                    // wait before trying again (see limits.rs).
                    Err(e) => {
                        pause = pause.max(backoff.failed(&e));
                        continue;
                    }
                };
                backoff.succeeded();
                let Some(ticket) = admission.admit(&self.limits) else {
                    // Closed at once: the client sees EOF before the
                    // greeting instead of waiting in a queue.
                    drop(fd);
                    backoff.refused(&self.limits);
                    continue;
                };
                summary.connections += 1;
                match self.spawn_connection(summary.connections, fd, ticket, &live) {
                    Ok(t) => threads.push(t),
                    // Out of threads or memory: this client is refused
                    // (its socket closed with the failed closure), the
                    // server carries on.
                    Err(e) => pause = pause.max(backoff.spawn_failed(&e)),
                }
            }
            threads.retain(|t| !t.is_finished());
            if !pause.is_zero() && self.wait_for_stop(pause) {
                break;
            }
        }
        self.stop_gracefully(&live, threads);
        Ok(summary)
    }

    /// Sleep `d` unless a stop is asked for first; whether it was.
    fn wait_for_stop(&self, d: Duration) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.stop_r.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = d.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        r > 0 && pfd.revents != 0
    }

    /// Serve connection `id` on its own thread, listed in `live` while it
    /// runs.
    fn spawn_connection(
        &self,
        id: u64,
        fd: OwnedFd,
        ticket: HandshakeTicket,
        live: &Live,
    ) -> io::Result<JoinHandle<()>> {
        let sock = Arc::new(Sock::new(fd));
        live.lock().insert(id, sock.clone());
        let exports = self.exports.snapshot();
        let live2 = live.clone();
        let poll = self.poll;
        let limits = self.limits;
        let tls = self.tls.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .spawn(move || {
                let live = live2;
                let r = conn::serve(sock, &exports, poll, &limits, &tls, Some(ticket));
                if let Err(e) = r {
                    if !matches!(
                        e.kind(),
                        io::ErrorKind::UnexpectedEof
                            | io::ErrorKind::ConnectionReset
                            | io::ErrorKind::BrokenPipe
                    ) {
                        tracing::warn!(connection = id, error = %e, "nbd: connection failed");
                    }
                }
                live.lock().remove(&id);
            });
        if spawned.is_err() {
            live.lock().remove(&id);
        }
        spawned
    }

    /// No new connections, no new requests, in-flight ones answered, and
    /// every writable export flushed — each step bounded by
    /// [`STOP_GRACE`], so a stop never hangs on a client or on a device
    /// that holds its I/O (a suspended one): past the bound, sockets are
    /// shut both ways and the connections left behind.
    fn stop_gracefully(self, live: &Live, threads: Vec<JoinHandle<()>>) {
        for (_, l) in &self.listeners {
            if let Listener::Unix(_, p) = l {
                let _ = std::fs::remove_file(p);
            }
        }
        drop(self.listeners);
        for s in live.lock().values() {
            s.shutdown(std::net::Shutdown::Read);
        }
        let deadline = Instant::now() + STOP_GRACE;
        if !join_until(threads, deadline) {
            let stuck = live.lock();
            tracing::warn!(
                connections = stuck.len(),
                "nbd: stop: requests still in flight after the grace period; disconnecting"
            );
            for s in stuck.values() {
                s.shutdown(std::net::Shutdown::Both);
            }
        }
        for e in self.exports.snapshot().iter() {
            if !e.read_only && !flush_until(e, deadline.max(Instant::now() + FLUSH_GRACE)) {
                tracing::warn!(export = %e.name, "nbd: stop: flush did not finish in time");
            }
        }
    }
}

/// How long a stop waits for in-flight requests before disconnecting.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// At least this long is left for each export's final flush.
const FLUSH_GRACE: Duration = Duration::from_secs(2);

/// Join `threads`, giving up at `deadline`; whether all finished.
fn join_until(threads: Vec<JoinHandle<()>>, deadline: Instant) -> bool {
    let mut left = threads;
    loop {
        let (done, rest): (Vec<_>, Vec<_>) = left.into_iter().partition(|t| t.is_finished());
        for t in done {
            let _ = t.join();
        }
        if rest.is_empty() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        left = rest;
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Flush `e`'s device, waiting no later than `deadline`; whether the
/// flush completed (a suspended device holds it: then it is abandoned).
fn flush_until(e: &Export, deadline: Instant) -> bool {
    let (tx, rx) = std::sync::mpsc::channel();
    let dev = e.dev.clone();
    let name = e.name.clone();
    let spawned = std::thread::Builder::new()
        .name("nbd-stop-flush".into())
        .spawn(move || {
            let st = submit_and_wait(&*dev, Op::Flush, 0, 0, &mut []);
            if !st.is_ok() {
                tracing::warn!(export = %name, status = %st, "nbd: flush at stop failed");
            }
            let _ = tx.send(());
        });
    if spawned.is_err() {
        return false;
    }
    rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .is_ok()
}

/// The connections being served, by id (the graceful stop shuts them).
type Live = Arc<Mutex<HashMap<u64, Arc<Sock>>>>;
