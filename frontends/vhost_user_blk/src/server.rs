//! One vhost-user-blk socket: listen, serve one VMM connection at a
//! time, and listen again when it goes, so a VMM whose chardev has
//! `reconnect=N` (qemu) comes back after this server restarts, or after
//! it hung up. A stop (serve ending) shuts the listening socket down,
//! which ends a blocked accept (Linux's `unix_accept` fails once the
//! socket is shut for reading), and shuts a live connection down; it
//! never depends on the socket's path still being there.

use crate::backend::BlkBackend;
use blkstack_core::DeviceRef;
use parking_lot::Mutex;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

#[derive(Debug, thiserror::Error)]
pub enum VhostError {
    #[error("--vhost-user-blk {socket}: {what}")]
    Setup { socket: String, what: String },
}

pub struct VhostExport {
    pub name: String,
    pub socket: PathBuf,
    stop: Arc<AtomicBool>,
    live: Arc<Mutex<Option<ShutdownHandle>>>,
    /// Kept open here (not only in the thread) so that its descriptor
    /// stays ours until the stop has used it.
    listener: Arc<Mutex<Listener>>,
    listen_fd: RawFd,
    backend: Arc<BlkBackend>,
    thread: Option<JoinHandle<()>>,
}

impl VhostExport {
    /// Listen on `socket` for a VMM and serve `dev` to it as a
    /// virtio-blk disk with `queues` virtqueues.
    pub fn start(
        socket: &Path,
        name: &str,
        dev: DeviceRef,
        read_only: bool,
        queues: u16,
    ) -> Result<VhostExport, VhostError> {
        let err = |what: String| VhostError::Setup {
            socket: socket.display().to_string(),
            what,
        };
        if queues == 0 || queues > 64 {
            return Err(err(format!("{queues} queues: must be 1..=64")));
        }
        blkstack_control::remove_stale_socket(socket, "vhost-user socket")
            .map_err(|e| err(e.to_string()))?;
        let listener = Arc::new(Mutex::new(
            Listener::new(socket, true).map_err(|e| err(format!("cannot listen: {e}")))?,
        ));
        let listen_fd = listener.lock().as_raw_fd();
        let backend =
            BlkBackend::new(name, dev, read_only, queues).map_err(|e| err(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let live: Arc<Mutex<Option<ShutdownHandle>>> = Arc::default();
        let thread = {
            let (backend, stop, live, name) = (
                backend.clone(),
                stop.clone(),
                live.clone(),
                name.to_string(),
            );
            let listener = listener.clone();
            std::thread::Builder::new()
                .name(format!("vhost-{name}"))
                .spawn(move || serve_loop(&name, &listener, backend, &stop, &live))
                .map_err(|e| err(e.to_string()))?
        };
        Ok(VhostExport {
            name: name.to_string(),
            socket: socket.to_path_buf(),
            stop,
            live,
            listener,
            listen_fd,
            backend,
            thread: Some(thread),
        })
    }

    /// Disconnect the VMM (its disk waits for a server, if it reconnects)
    /// and stop listening.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.live.lock().take() {
            h.shutdown();
        }
        // End an accept that waits for a VMM. The descriptor is still
        // ours: `self.listener` keeps it open.
        // SAFETY: shutdown(2) on a socket descriptor we hold open.
        unsafe { libc::shutdown(self.listen_fd, libc::SHUT_RDWR) };
        let _ = &self.listener;
        self.backend.stop_workers();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

impl Drop for VhostExport {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop_inner();
        }
    }
}

fn serve_loop(
    name: &str,
    listener: &Mutex<Listener>,
    backend: Arc<BlkBackend>,
    stop: &AtomicBool,
    live: &Mutex<Option<ShutdownHandle>>,
) {
    let mut failures = 0u32;
    while !stop.load(Ordering::SeqCst) {
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
        let mut daemon =
            match VhostUserDaemon::new(format!("blkstack-{name}"), backend.clone(), mem) {
                Ok(d) => d,
                Err(e) => {
                    tracing::error!(export = name, "vhost-user-blk: {e}");
                    return;
                }
            };
        let started = daemon.start(&mut listener.lock());
        if let Err(e) = started {
            backend.stop_workers();
            if stop.load(Ordering::SeqCst) {
                break;
            }
            failures += 1;
            tracing::warn!(export = name, "vhost-user-blk: a connection failed: {e}");
            // Bounded back-off: a peer that keeps failing costs little.
            std::thread::sleep(std::time::Duration::from_millis(
                10 * u64::from(failures.min(100)),
            ));
            continue;
        }
        failures = 0;
        *live.lock() = daemon.shutdown_handle();
        // The backend shuts a connection down that fails for good.
        backend.set_connection(daemon.shutdown_handle());
        if stop.load(Ordering::SeqCst) {
            daemon.request_shutdown();
        }
        tracing::info!(export = name, "vhost-user-blk: VMM connected");
        if let Err(e) = daemon.wait() {
            tracing::info!(export = name, "vhost-user-blk: connection ended: {e}");
        }
        live.lock().take();
        backend.stop_workers();
        backend.end_connection();
        tracing::info!(
            export = name,
            "vhost-user-blk: VMM disconnected; listening again"
        );
    }
}
