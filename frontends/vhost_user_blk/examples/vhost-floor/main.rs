//! The floor probe for `scripts/bench-vhost-peers.sh` (issue 40): the least
//! a vhost-user-blk server can spend per request on the machine it runs on, as a third
//! server beside qemu-storage-daemon's export and `blkstack serve
//! --vhost-user-blk`, for the bench's two legs.
//!
//! Why it exists: issue 40 asks our server's CPU per I/O to be at most 0.7x
//! qsd's and, where that is missed, the measured floor and what bounds it.
//! This is that floor, measured the same way as the servers (its process's
//! CPU between the guest's marks): one thread for the protocol and the one
//! virtqueue, no allocation per request, the data moved straight in guest
//! memory, one call (an eventfd `write`) per batch and only when the
//! guest's `used_event` asks for it (`VIRTIO_RING_F_EVENT_IDX`), and no
//! `read` of the kick eventfd at all (see [`Wait`] for why that is
//! correct). What a leg needs and nothing else:
//!
//! - `null`: reads are filled with zeros in the guest's pages (qsd's
//!   `null-co,read-zeroes=on` does the same `memset`: a read must not
//!   return stale guest memory, so the fill is the request's own work),
//!   writes are dropped;
//! - `file`: a raw file opened `O_DIRECT`, each request one `READ` or
//!   `WRITE` in an io_uring owned by the same thread, its completion reaped
//!   from the ring's mapped queue.
//!
//! The protocol (messages, their file descriptors, their checks) is the
//! `vhost` crate's [`BackendReqHandler`] with our own request handler
//! (`proto.rs`); the rings are `virtio-queue`'s, guest memory `vm-memory`'s.
//! Not `vhost-user-backend`'s daemon: its worker reads the kick eventfd
//! for every kick before the backend sees it and waits in a level-triggered
//! epoll, which is what this probe measures against. The requests follow
//! virtio 1.2 section 5.2.6 as Linux's `drivers/block/virtio_blk.c` sends
//! them; anything beyond the bench's reads and writes (flush, discard,
//! get-id, scattered data) is answered `VIRTIO_BLK_S_UNSUPP` or
//! `VIRTIO_BLK_S_IOERR`, and a malformed message ends its connection with
//! an error naming it while the probe waits for the next one. It trusts
//! the VMM not to shrink the memory it shared (our server's `guard.rs`
//! covers that; a probe for a bench does not).
//!
//! Run: `cargo run --release -p blkstack-vhost-user-blk --example
//! vhost-floor -- --kind null --size 1073741824 --socket /tmp/floor.sock`.

mod blk;
mod proto;
#[cfg(test)]
mod tests;

use anyhow::{bail, Context as _};
use clap::Parser;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use vhost::vhost_user::{BackendReqHandler, Error as VuError};

/// The medium behind the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// Reads return zeros, writes are dropped (qsd's `null-co`).
    Null,
    /// A raw file, `O_DIRECT`, through io_uring.
    File,
}

/// Where the thread sleeps between events.
///
/// - `epoll`: an epoll set holding the vhost-user socket (level), the
///   ring's descriptor for the file leg (level) and the kick eventfd
///   **edge-triggered, never read**. An eventfd's `write` (qemu's
///   `event_notifier_set`) and KVM's ioeventfd (`eventfd_signal`) both
///   call `wake_up_locked_poll` on every signal whether or not the counter
///   was already non-zero (fs/eventfd.c), and each wake puts an
///   edge-triggered item back on epoll's ready list (fs/eventpoll.c
///   `ep_poll_callback`); so a kick that lands while the thread works still
///   wakes the next `epoll_wait`. The counter only grows; it would need
///   2^64 - 2 kicks to reach the point where a `write` blocks.
/// - `ring`: the thread waits in its io_uring (`io_uring_enter` with
///   `GETEVENTS`, which also submits the batch's I/O), as qemu's
///   `fdmon-io_uring` does; the kick is a multishot `POLL_ADD`, which is
///   edge-triggered the same way (one completion per wake of the eventfd,
///   io_uring/poll.c; `IORING_POLL_ADD_LEVEL` is the level form), the
///   socket a one-shot `POLL_ADD` re-armed after each message (a level
///   check at arming: two messages in one wake are not lost).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Wait {
    Epoll,
    Ring,
}

#[derive(Parser, Debug)]
#[command(
    about = "The floor vhost-user-blk server for bench-vhost-peers.sh (one thread, one queue)"
)]
pub struct Args {
    #[arg(long, value_enum)]
    kind: Kind,
    /// Disk size in bytes, for `--kind null` (a multiple of 512).
    #[arg(long)]
    size: Option<u64>,
    /// The raw file, for `--kind file` (its size is the disk's).
    #[arg(long)]
    path: Option<PathBuf>,
    /// Unix socket to listen on (the VMM connects to it).
    #[arg(long)]
    socket: PathBuf,
    /// Where the thread waits between events.
    #[arg(long, value_enum, default_value = "ring")]
    wait: Wait,
}

/// The disk a connection serves.
pub struct Medium {
    pub kind: Kind,
    pub size: u64,
    /// The file of `--kind file`, opened `O_DIRECT`.
    pub file: Option<std::fs::File>,
    pub wait: Wait,
}

impl Medium {
    pub fn open(args: &Args) -> anyhow::Result<Medium> {
        let (size, file) = match (args.kind, args.size, &args.path) {
            (Kind::Null, Some(size), None) => (size, None),
            (Kind::File, None, Some(path)) => {
                use std::os::unix::fs::OpenOptionsExt;
                let file = std::fs::File::options()
                    .read(true)
                    .write(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(path)
                    .with_context(|| format!("--path {}: cannot open O_DIRECT", path.display()))?;
                let size = file.metadata().context("--path: stat")?.len();
                (size, Some(file))
            }
            (Kind::Null, _, _) => bail!("--kind null wants --size and no --path"),
            (Kind::File, _, _) => bail!("--kind file wants --path and no --size"),
        };
        if size == 0 || !size.is_multiple_of(512) {
            bail!("the disk's size {size}: must be a non-zero multiple of 512");
        }
        Ok(Medium {
            kind: args.kind,
            size,
            file,
            wait: args.wait,
        })
    }
}

/// The connection's state, shared by the protocol handler and the loop
/// (the one thread takes it in turn: the lock is never contended).
pub fn lock(f: &Mutex<blk::Floor>) -> MutexGuard<'_, blk::Floor> {
    f.lock().unwrap_or_else(|e| e.into_inner())
}

/// Serve one VMM connection until it ends: wait, then either handle one
/// protocol message or run the queue. Ok when the VMM hung up.
pub fn serve_conn(stream: std::os::unix::net::UnixStream, medium: &Medium) -> anyhow::Result<()> {
    let floor = Arc::new(Mutex::new(blk::Floor::new(medium)?));
    let mut handler = BackendReqHandler::from_stream(stream, floor.clone());
    lock(&floor).arm_socket(handler.as_raw_fd())?;
    loop {
        let message = lock(&floor).wait_and_work()?;
        if !message {
            continue;
        }
        match handler.handle_request() {
            Ok(()) => {}
            Err(VuError::Disconnected | VuError::PartialMessage) => {
                lock(&floor).drain();
                return Ok(());
            }
            Err(e) => {
                lock(&floor).drain();
                bail!("vhost-user message refused, connection closed: {e}");
            }
        }
        let mut f = lock(&floor);
        f.arm_socket(handler.as_raw_fd())?;
        f.after_message()?;
    }
}

/// Accept one VMM at a time, for ever; a connection's failure is logged
/// and the next one served.
pub fn serve(listener: UnixListener, medium: &Medium) {
    for stream in listener.incoming() {
        match stream {
            Ok(s) => match serve_conn(s, medium) {
                Ok(()) => tracing::info!("VMM disconnected"),
                Err(e) => tracing::warn!("{e:#}"),
            },
            Err(e) => tracing::warn!("accept: {e}"),
        }
    }
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let medium = Medium::open(&args)?;
    let _ = std::fs::remove_file(&args.socket);
    let listener = UnixListener::bind(&args.socket)
        .with_context(|| format!("bind {}", args.socket.display()))?;
    tracing::info!(
        "vhost-floor: {:?} disk of {} bytes on {}, waiting in {:?}",
        medium.kind,
        medium.size,
        args.socket.display(),
        medium.wait
    );
    serve(listener, &medium);
    Ok(())
}
