//! The floor probe for `scripts/bench-peers.sh` (issue 40): the least an
//! NBD server can do per request on the machine it runs on, as a fourth server beside
//! blkstack, nbdkit and qemu-nbd.
//!
//! Why it exists: issue 40 asks our server's CPU per I/O to be at most
//! half the best peer's on every row, and, where that is missed, the
//! measured floor. This is that floor, measured the same way as the
//! servers: one thread, no allocation per request, a `poll` loop that
//! reads whatever the socket holds into a bounded buffer, parses every
//! complete request in it and answers the batch with one `writev`. What a
//! row physically requires and nothing else: `null` reads answer from a
//! static zeroed buffer (no memset), `memory` writes land straight in the
//! export's `Vec<u8>` (a `readv` whose first buffer is the export), and
//! `delay` reads wait in a FIFO (the delay is constant, so deadlines come
//! in order) behind one timerfd armed for the earliest. TLS (the `-tls`
//! rows) goes through rustls, as our server's does.
//!
//! Why hand-written: it is a probe, like `docs/lab/delay.floor.c`, not a
//! server. It serves one export (`d`, read-only for `null` and `delay`),
//! simple replies only (it refuses structured replies and meta contexts),
//! READ, WRITE (memory), FLUSH (memory) and DISC; anything else gets a
//! clear refusal, and a malformed request closes its connection with an
//! error naming it. The handshake (`handshake.rs`) blocks the one thread
//! while it runs, which a benchmark's few connections do not notice. The
//! protocol is `doc/proto.md` of the NetworkBlockDevice/nbd project; its
//! constants and wire formats are the crate's own `proto`.
//!
//! Run: `cargo run --release -p blkstack-nbd --example nbd-floor --
//! --kind null --size 1073741824 --socket /tmp/floor.sock`.

mod conn;
mod handshake;
#[cfg(test)]
mod tests;

use anyhow::{bail, Context as _};
use clap::Parser;
use conn::{Conn, Delayed};
use rustls::ServerConfig;
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;

/// Connections served at once (the bench rows use one or two).
const MAX_CONNS: usize = 16;

/// What the export does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// Reads return zeros; read-only.
    Null,
    /// A RAM disk of `--size` bytes.
    Memory,
    /// Reads return zeros after `--delay-ms`; read-only.
    Delay,
}

#[derive(Parser, Debug)]
#[command(about = "The floor NBD server for bench-peers.sh (one thread, one export)")]
struct Args {
    #[arg(long, value_enum)]
    kind: Kind,
    /// Export size in bytes.
    #[arg(long)]
    size: u64,
    /// Unix socket to listen on.
    #[arg(long)]
    socket: PathBuf,
    /// The export's name.
    #[arg(long, default_value = "d")]
    export: String,
    /// The delay of each read, for `--kind delay`.
    #[arg(long, default_value_t = 1)]
    delay_ms: u64,
    /// Require TLS (STARTTLS) with server-cert.pem and server-key.pem from DIR.
    #[arg(long)]
    tls_certificates: Option<PathBuf>,
}

/// The one export.
pub struct Export {
    pub kind: Kind,
    pub name: String,
    pub size: u64,
    /// The memory kind's bytes (empty for the others).
    pub mem: Vec<u8>,
    pub delay_ns: u64,
}

impl Export {
    pub fn new(kind: Kind, name: &str, size: u64, delay_ms: u64) -> anyhow::Result<Export> {
        if size == 0 || !size.is_multiple_of(512) {
            bail!("--size {size}: must be a non-zero multiple of 512");
        }
        let mem = if kind == Kind::Memory {
            let len = usize::try_from(size).context("--size does not fit in memory")?;
            vec![0u8; len]
        } else {
            Vec::new()
        };
        Ok(Export {
            kind,
            name: name.to_string(),
            size,
            mem,
            delay_ns: delay_ms.saturating_mul(1_000_000),
        })
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
    let export = Export::new(args.kind, &args.export, args.size, args.delay_ms)?;
    let tls = match &args.tls_certificates {
        Some(dir) => {
            blkstack_nbd::tls::TlsPolicy::load(
                blkstack_nbd::tls::TlsMode::Require,
                Some(dir),
                false,
            )?
            .config
        }
        None => None,
    };
    // A client that vanishes must cost an EPIPE, not the process.
    // SAFETY: setting a signal's disposition to SIG_IGN has no handler to race.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    // Wake at the timer's deadline, not up to the default 50 µs slack later.
    // SAFETY: PR_SET_TIMERSLACK takes an integer and touches no memory.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    let _ = std::fs::remove_file(&args.socket);
    let listener = UnixListener::bind(&args.socket)
        .with_context(|| format!("listening on {}", args.socket.display()))?;
    tracing::info!(kind = ?args.kind, size = args.size, socket = %args.socket.display(),
        tls = tls.is_some(), "nbd-floor serving");
    serve(listener, export, tls)
}

/// The event loop: accept, read and parse, answer, fire the delay timer.
/// Never returns but on a failure of the listener or the timer.
pub fn serve(
    listener: UnixListener,
    mut export: Export,
    tls: Option<Arc<ServerConfig>>,
) -> anyhow::Result<()> {
    listener.set_nonblocking(true)?;
    let timer = timerfd()?;
    let mut conns: Vec<Option<Conn>> = (0..MAX_CONNS).map(|_| None).collect();
    let mut delayq: VecDeque<Delayed> = VecDeque::with_capacity(MAX_CONNS * conn::MAX_INFLIGHT);
    let mut pfds = [libc::pollfd {
        fd: -1,
        events: 0,
        revents: 0,
    }; MAX_CONNS + 2];
    let mut gen = 0u64;
    loop {
        pfds[0] = pollfd(listener.as_raw_fd(), libc::POLLIN);
        pfds[1] = pollfd(timer.as_raw_fd(), libc::POLLIN);
        let mut ready_now = false;
        for (i, c) in conns.iter().enumerate() {
            pfds[i + 2] = match c {
                Some(c) => {
                    ready_now |= c.has_buffered_input();
                    pollfd(c.fd(), c.poll_events())
                }
                None => pollfd(-1, 0),
            };
        }
        let timeout = if ready_now { 0 } else { -1 };
        // SAFETY: pfds is a live array of MAX_CONNS + 2 initialised pollfds.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e).context("poll");
        }
        if pfds[1].revents != 0 {
            fire_timer(&timer, &mut delayq, &mut conns, &export)?;
        }
        for i in 0..MAX_CONNS {
            let revents = pfds[i + 2].revents;
            let Some(c) = conns[i].as_mut() else { continue };
            if revents == 0 && !c.has_buffered_input() {
                continue;
            }
            let was_empty = delayq.is_empty();
            if let Err(e) = c.on_ready(revents, &mut export, &mut delayq, i) {
                e.log(i);
                conns[i] = None;
                continue;
            }
            if was_empty && !delayq.is_empty() {
                arm(&timer, delayq[0].deadline)?;
            }
        }
        if pfds[0].revents != 0 {
            accept(&listener, &mut conns, &export, &tls, &mut gen);
        }
    }
}

fn pollfd(fd: i32, events: i16) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

/// Take one waiting client through the handshake (blocking, bounded by
/// its timeout) into a free slot.
fn accept(
    listener: &UnixListener,
    conns: &mut [Option<Conn>],
    export: &Export,
    tls: &Option<Arc<ServerConfig>>,
    gen: &mut u64,
) {
    let sock = match listener.accept() {
        Ok((s, _)) => s,
        Err(e) => {
            if e.kind() != std::io::ErrorKind::WouldBlock {
                tracing::warn!("accept: {e}");
            }
            return;
        }
    };
    let Some(slot) = conns.iter().position(Option::is_none) else {
        tracing::warn!("refusing a connection: all {MAX_CONNS} slots are taken");
        return;
    };
    match handshake::handshake(sock, export, tls.clone()) {
        Ok(Some((sock, session))) => {
            *gen += 1;
            match Conn::new(sock, session, *gen) {
                Ok(c) => {
                    tracing::debug!(slot, "connection negotiated");
                    conns[slot] = Some(c);
                }
                Err(e) => tracing::warn!("connection {slot}: {e}"),
            }
        }
        Ok(None) => tracing::debug!("client ended the handshake"),
        Err(e) => tracing::warn!("handshake: {e}"),
    }
}

/// Monotonic time in nanoseconds (the timerfd's clock, CLOCK_MONOTONIC).
pub use blkstack_core::clock::now_ns;

fn timerfd() -> anyhow::Result<OwnedFd> {
    // SAFETY: plain syscall; the fd is owned on success.
    let fd = unsafe {
        libc::timerfd_create(
            libc::CLOCK_MONOTONIC,
            libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("timerfd_create");
    }
    // SAFETY: fd was just created and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Arm the timer for an absolute monotonic deadline.
fn arm(timer: &OwnedFd, deadline: u64) -> anyhow::Result<()> {
    let it = libc::itimerspec {
        it_interval: libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        it_value: libc::timespec {
            tv_sec: (deadline / 1_000_000_000) as libc::time_t,
            tv_nsec: (deadline % 1_000_000_000) as libc::c_long,
        },
    };
    // SAFETY: it is a valid itimerspec; the old value is not asked for.
    let r = unsafe {
        libc::timerfd_settime(
            timer.as_raw_fd(),
            libc::TFD_TIMER_ABSTIME,
            &it,
            std::ptr::null_mut(),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).context("timerfd_settime");
    }
    Ok(())
}

/// The timer fired: queue the reply of every delayed read now due on its
/// connection, send each touched connection's batch once, re-arm for the
/// next deadline.
fn fire_timer(
    timer: &OwnedFd,
    delayq: &mut VecDeque<Delayed>,
    conns: &mut [Option<Conn>],
    export: &Export,
) -> anyhow::Result<()> {
    let mut expirations = [0u8; 8];
    // SAFETY: reads 8 bytes into an 8-byte buffer; EAGAIN (a spurious
    // wake) is harmless, so the result is not needed.
    unsafe { libc::read(timer.as_raw_fd(), expirations.as_mut_ptr().cast(), 8) };
    let now = now_ns();
    let mut touched = 0u32;
    while let Some(d) = delayq.front() {
        if d.deadline > now {
            break;
        }
        let d = *d;
        delayq.pop_front();
        if let Some(c) = conns[d.slot].as_mut().filter(|c| c.gen() == d.gen) {
            c.delayed_due(d);
            touched |= 1 << d.slot;
        }
    }
    for (i, slot) in conns.iter_mut().enumerate() {
        if touched & (1 << i) == 0 {
            continue;
        }
        if let Some(c) = slot.as_mut() {
            if let Err(e) = c.flush(export) {
                e.log(i);
                *slot = None;
            }
        }
    }
    if let Some(d) = delayq.front() {
        arm(timer, d.deadline)?;
    }
    Ok(())
}
