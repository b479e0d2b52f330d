//! One vhost-user-blk socket: listen, serve each VMM connection on its
//! own, and keep listening, so a VMM whose chardev has `reconnect=N`
//! (qemu) comes back after this server restarts, or after it hung up. A
//! stop (serve ending) shuts the listening socket down, which ends every
//! blocked accept (Linux's `unix_accept` fails once the socket is shut
//! for reading), and shuts live connections down; it never depends on
//! the socket's path still being there.
//!
//! Bounds (issue 35, item 7), so no peer can hold the socket hostage:
//! - at most [`MAX_SESSIONS`] connections are served at once, each by its
//!   own acceptor thread with its own backend (several VMMs on one disk
//!   share it as a shared disk, as NBD's multi-conn clients do). One more
//!   acceptor than that stands by: a connection it accepts beyond the cap
//!   is logged and closed at once, so a crowd is refused promptly instead
//!   of queueing silently in the listen backlog.
//! - a connection must speak vhost-user's setup within
//!   [`HANDSHAKE_DEADLINE`] of being accepted: ask for the protocol
//!   features (every frontend that sees `VHOST_USER_F_PROTOCOL_FEATURES`
//!   does, first thing; qemu in `vhost_user_backend_init`), read the
//!   config, or set a memory table. A silent peer is dropped then, and it
//!   only ever held its own acceptor: the others keep serving.
//! - past the setup, a VMM may stay quiet as long as it likes (a guest
//!   that does no I/O); that is the VMM's session, and the cap bounds
//!   how many there are.
//! - a memory table whose regions overrun their files is refused and the
//!   connection closed; guest memory that vanishes later fails the
//!   connection, never the process ([`crate::guard`]).

use crate::backend::BlkBackend;
use blkstack_core::DeviceRef;
use parking_lot::Mutex;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;

/// VMM connections one vhost-user-blk socket serves at once.
pub const MAX_SESSIONS: usize = 4;

/// How long an accepted connection has to start vhost-user's setup.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);

/// Back-off after a failed accept or setup grows to at most this.
const MAX_BACKOFF: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum VhostError {
    #[error("--vhost-user-blk {socket}: {what}")]
    Setup { socket: String, what: String },
}

/// One acceptor: the connection it serves, if any.
#[derive(Default)]
struct Acceptor {
    live: Mutex<Option<ShutdownHandle>>,
    backend: Mutex<Option<Arc<BlkBackend>>>,
}

/// What every acceptor of one socket shares.
struct Shared {
    name: String,
    dev: DeviceRef,
    read_only: bool,
    queues: u16,
    /// How long a queue may poll its ring before it sleeps (adaptive).
    poll_limit: Duration,
    stop: AtomicBool,
    /// Connections being served (accepted, not yet ended).
    busy: AtomicUsize,
}

pub struct VhostExport {
    pub name: String,
    pub socket: PathBuf,
    shared: Arc<Shared>,
    acceptors: Vec<Arc<Acceptor>>,
    /// Kept open here (not only in the threads) so that its descriptor
    /// stays ours until the stop has used it.
    listener: Listener,
    threads: Vec<JoinHandle<()>>,
}

impl VhostExport {
    /// Listen on `socket` for VMMs and serve `dev` to each as a
    /// virtio-blk disk with `queues` virtqueues, each polling its ring
    /// up to `poll_limit` between kicks ([`crate::poll`]; zero: never).
    pub fn start(
        socket: &Path,
        name: &str,
        dev: DeviceRef,
        read_only: bool,
        (queues, poll_limit): (u16, Duration),
    ) -> Result<VhostExport, VhostError> {
        let err = |what: String| VhostError::Setup {
            socket: socket.display().to_string(),
            what,
        };
        if queues == 0 || queues > 64 {
            return Err(err(format!("{queues} queues: must be 1..=64")));
        }
        if poll_limit > crate::poll::MAX_LIMIT {
            return Err(err(format!(
                "a polling limit of {poll_limit:?}: at most {:?}",
                crate::poll::MAX_LIMIT
            )));
        }
        blkstack_control::remove_stale_socket(socket, "vhost-user socket")
            .map_err(|e| err(e.to_string()))?;
        let listener =
            Listener::new(socket, true).map_err(|e| err(format!("cannot listen: {e}")))?;
        // A backend built once up front reports a device it cannot serve
        // before anything is started.
        BlkBackend::new(name, dev.clone(), read_only, queues).map_err(|e| err(e.to_string()))?;
        let shared = Arc::new(Shared {
            name: name.to_string(),
            dev,
            read_only,
            queues,
            poll_limit,
            stop: AtomicBool::new(false),
            busy: AtomicUsize::new(0),
        });
        let mut export = VhostExport {
            name: name.to_string(),
            socket: socket.to_path_buf(),
            shared,
            acceptors: Vec::new(),
            listener,
            threads: Vec::new(),
        };
        for i in 0..=MAX_SESSIONS {
            let fd = dup_listener(&export.listener).map_err(|e| err(format!("dup: {e}")))?;
            let acc = Arc::new(Acceptor::default());
            let (shared, a) = (export.shared.clone(), acc.clone());
            let t = std::thread::Builder::new()
                .name(format!("vhost-{name}-{i}"))
                .spawn(move || serve_loop(&shared, &a, fd))
                .map_err(|e| err(e.to_string()))?;
            export.acceptors.push(acc);
            export.threads.push(t);
        }
        Ok(export)
    }

    /// Disconnect the VMMs (their disks wait for a server, if they
    /// reconnect) and stop listening.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // End the accepts that wait for a VMM. The descriptor is still
        // ours: `self.listener` keeps it open.
        // SAFETY: shutdown(2) on a socket descriptor we hold open.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        for a in &self.acceptors {
            if let Some(h) = a.live.lock().take() {
                h.shutdown();
            }
            if let Some(b) = a.backend.lock().as_ref() {
                b.close();
                b.stop_workers();
            }
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

impl Drop for VhostExport {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.stop_inner();
        }
    }
}

/// Another descriptor for the listening socket, for one acceptor.
fn dup_listener(l: &Listener) -> std::io::Result<Listener> {
    // SAFETY: F_DUPFD_CLOEXEC on a descriptor we hold open.
    let fd = unsafe { libc::fcntl(l.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor of a listening unix socket that
    // nothing else owns; a Listener made from it unlinks no path.
    Ok(unsafe { Listener::from_raw_fd(fd) })
}

/// Counts a connection as served while it lives.
struct Busy<'a>(&'a AtomicUsize);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn serve_loop(sh: &Shared, acc: &Acceptor, mut listener: Listener) {
    let name = sh.name.as_str();
    let mut failures = 0u32;
    while !sh.stop.load(Ordering::SeqCst) {
        let ok = serve_one(sh, acc, &mut listener);
        if let Some(b) = acc.backend.lock().take() {
            b.stop_workers();
            b.end_connection();
        }
        if sh.stop.load(Ordering::SeqCst) {
            break;
        }
        failures = if ok { 0 } else { failures.saturating_add(1) };
        if failures > 0 {
            // Bounded back-off: a peer that keeps failing costs little.
            let wait = Duration::from_millis(10 * u64::from(failures.min(50)));
            std::thread::sleep(wait.min(MAX_BACKOFF));
        }
    }
    tracing::debug!(export = name, "vhost-user-blk: acceptor stopped");
}

/// Let the queues' threads reap the device's completions themselves
/// (see [`BlkBackend::attach_reaper`]). A thread whose epoll refused the
/// descriptor leaves its completions to the others; if every one refused
/// it, the claim is dropped and the device's own thread reaps as before.
fn attach_reaper(name: &str, backend: &Arc<BlkBackend>, daemon: &VhostUserDaemon<Arc<BlkBackend>>) {
    let Some(fd) = backend.attach_reaper() else {
        return;
    };
    let ev = EventSet::IN | EventSet::EXCLUSIVE;
    let id = u64::from(backend.reap_event());
    let mut added = 0;
    for h in daemon.get_epoll_handlers() {
        match h.register_listener(fd, ev, id) {
            Ok(()) => added += 1,
            Err(e) => tracing::warn!(
                export = name,
                "vhost-user-blk: a queue thread cannot reap the device's completions: {e}"
            ),
        }
    }
    if added == 0 {
        backend.detach_reaper();
    }
}

/// Accept one connection and serve it to its end. False if accepting
/// or setting up failed.
fn serve_one(sh: &Shared, acc: &Acceptor, listener: &mut Listener) -> bool {
    let name = sh.name.as_str();
    let backend =
        match BlkBackend::with_poll(name, sh.dev.clone(), sh.read_only, sh.queues, sh.poll_limit) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(export = name, "vhost-user-blk: {e}");
                return false;
            }
        };
    *acc.backend.lock() = Some(backend.clone());
    let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
    let mut daemon = match VhostUserDaemon::new(format!("blkstack-{name}"), backend.clone(), mem) {
        Ok(d) => d,
        Err(e) => {
            tracing::error!(export = name, "vhost-user-blk: {e}");
            return false;
        }
    };
    // Before any message: the workers' epolls, where kicks go
    // edge-triggered (crate::vring).
    backend.set_epolls(
        daemon
            .get_epoll_handlers()
            .iter()
            .map(|h| h.as_raw_fd())
            .collect(),
    );
    if let Err(e) = daemon.start(listener) {
        if !sh.stop.load(Ordering::SeqCst) {
            tracing::warn!(export = name, "vhost-user-blk: a connection failed: {e}");
        }
        return false;
    }
    let handle = daemon.shutdown_handle();
    attach_reaper(name, &backend, &daemon);
    let _busy = Busy(&sh.busy);
    if sh.busy.fetch_add(1, Ordering::SeqCst) >= MAX_SESSIONS {
        tracing::warn!(
            export = name,
            max = MAX_SESSIONS,
            "vhost-user-blk: too many VMM connections; closing a new one"
        );
        daemon.request_shutdown();
        let _ = daemon.wait();
        return true;
    }
    *acc.live.lock() = handle.clone();
    backend.set_connection(handle);
    if sh.stop.load(Ordering::SeqCst) {
        daemon.request_shutdown();
    }
    if backend.wait_setup(Instant::now() + HANDSHAKE_DEADLINE) {
        tracing::info!(export = name, "vhost-user-blk: VMM connected");
    } else {
        tracing::warn!(
            export = name,
            "vhost-user-blk: a connection did not start vhost-user's setup within {:?} (or failed in it); closing it",
            HANDSHAKE_DEADLINE
        );
        daemon.request_shutdown();
    }
    if let Err(e) = daemon.wait() {
        tracing::info!(export = name, "vhost-user-blk: connection ended: {e}");
    }
    acc.live.lock().take();
    tracing::info!(export = name, "vhost-user-blk: VMM disconnected");
    true
}
