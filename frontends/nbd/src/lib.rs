//! NBD server: exports blkstack devices to real NBD clients (fio's nbd
//! engine, qemu-img/qemu-io, nbdinfo/nbdcopy, the kernel's nbd-client).
//!
//! The protocol (`doc/proto.md` of the NetworkBlockDevice/nbd project) is
//! implemented here by hand — no maintained Rust crate implements its
//! server side — in [`proto`] (constants and wire format, unit-tested on
//! its own), [`conn`] (handshake and transmission for one connection) and
//! [`server`] (listeners, accept loop, graceful stop). Supported: fixed
//! newstyle with NO_ZEROES; OPT_EXPORT_NAME, OPT_GO, OPT_INFO (EXPORT,
//! NAME, DESCRIPTION, BLOCK_SIZE), OPT_LIST, OPT_ABORT,
//! OPT_STRUCTURED_REPLY, OPT_LIST/SET_META_CONTEXT (`base:allocation`);
//! READ (OFFSET_DATA and, where the device knows its holes, OFFSET_HOLE),
//! WRITE, FLUSH, FUA, TRIM, WRITE_ZEROES (NO_HOLE, FAST_ZERO), CACHE,
//! BLOCK_STATUS, DISC; replies out of order; many connections.
//! NBD_OPT_STARTTLS with rustls ([`tls`]). Not supported: TLS-PSK,
//! extended headers, RESIZE.

pub mod client;
pub mod conn;
/// Live control (blkstack-control): runtime export/unexport.
pub mod control;
pub mod export;
/// Entry points of the cargo-fuzz targets in fuzz/ (and their corpus replay tests).
#[doc(hidden)]
pub mod fuzzing;
pub mod limits;
/// The NBD wire format, shared with the client leaf driver (`blkstack_drivers::nbd`).
pub use blkstack_drivers::nbd::proto;
pub mod server;
pub mod sock;
pub mod tls;
pub mod uri;

#[cfg(test)]
mod tests;

pub use export::Export;
pub use server::{install_signal_stop, Server, Stopper};
pub use uri::ListenUri;

use anyhow::{bail, Context};
use std::io::Write;
use std::path::PathBuf;

/// `blkstack serve`: export devices over NBD until SIGINT/SIGTERM.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    blkstack serve --concise 'd0,,,rw,0 2097152 memory' --export d0 --listen nbd://127.0.0.1:10809\n  \
    blkstack serve --stack stack.txt --export data,golden:ro --listen 'nbd+unix:///?socket=/tmp/nbd.sock'\n\n\
    Clients then use e.g. nbd://127.0.0.1:10809/d0 or nbd+unix:///data?socket=/tmp/nbd.sock.\n\
    SIGINT/SIGTERM stop gracefully: no new connections, in-flight I/O answered, devices flushed.")]
pub struct NbdArgs {
    /// Create devices from a stack file (dmsetup concise text, or `NAME: <table line>` lines).
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with = "concise",
        required_unless_present = "concise"
    )]
    pub stack: Option<PathBuf>,

    /// Create devices from a dmsetup --concise string.
    #[arg(long, value_name = "STRING")]
    pub concise: Option<String>,

    /// Devices to export (comma-separated or repeated). `NAME:ro` exports NAME
    /// read-only (writes, trims and zeroing fail with EPERM). The first export
    /// is also the default one (empty export name).
    #[arg(long, value_name = "NAME[:ro][,NAME[:ro]...]", value_delimiter = ',')]
    pub export: Vec<String>,

    /// Export these devices read-only (same as NAME:ro in --export).
    #[arg(long, value_name = "NAME", value_delimiter = ',')]
    pub readonly: Vec<String>,

    /// Where to listen (repeatable): nbd://[HOST][:PORT] (TCP; HOST defaults to
    /// 127.0.0.1, PORT to 10809, 0 picks a free port) or nbd+unix:///?socket=PATH.
    /// Default: nbd://127.0.0.1:10809.
    #[arg(long, value_name = "URI")]
    pub listen: Vec<String>,

    /// Live control (blkstack-control): the control socket for `blkstack
    /// create/reload/suspend/resume/export/...` [default:
    /// $XDG_RUNTIME_DIR/blkstack/control.sock, else /run/blkstack/control.sock;
    /// if that default is taken by another server, serve runs without one].
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,

    /// Longest busy-poll of a connection's socket before its reader blocks,
    /// in microseconds (0: never poll). Polling is adaptive: it stops after
    /// polls that find nothing or lose the CPU to another thread, and
    /// resumes when it pays again.
    #[arg(long, value_name = "US", default_value_t = server::DEFAULT_POLL_NS / 1000)]
    pub poll_us: u64,

    /// Most connections served at once; more are closed as soon as they
    /// are accepted.
    #[arg(long, value_name = "N", default_value_t = limits::DEFAULT_MAX_CONNECTIONS,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_connections: usize,

    /// Most connections in their handshake at once, counted apart from
    /// --max-connections (silent sockets cannot lock negotiated clients
    /// out); more are closed as soon as they are accepted.
    #[arg(long, value_name = "N", default_value_t = limits::DEFAULT_MAX_HANDSHAKES,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_handshakes: usize,

    /// Longest a reply may wait for a client that takes none of its bytes,
    /// in seconds; then the client is disconnected. Meanwhile the client
    /// costs at most its per-connection byte budget, and nobody else waits.
    #[arg(long, value_name = "SECS", default_value_t = limits::DEFAULT_SEND_TIMEOUT.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..))]
    pub send_timeout: u64,

    /// Longest a client may take over the whole handshake (greeting to
    /// export chosen), in seconds, however it paces its bytes.
    #[arg(long, value_name = "SECS", default_value_t = limits::DEFAULT_HANDSHAKE_DEADLINE.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..))]
    pub handshake_timeout: u64,

    /// Permissions of the NBD Unix sockets, in octal: whoever may connect
    /// may read and write every export.
    #[arg(long, value_name = "OCTAL", default_value = "0600", value_parser = parse_mode)]
    pub socket_mode: u32,

    /// TLS (STARTTLS): off, on (clients choose) or require (every option
    /// but STARTTLS and ABORT is refused before TLS).
    #[arg(long, value_enum, value_name = "MODE", default_value = "off")]
    pub tls: tls::TlsMode,

    /// Directory with server-cert.pem and server-key.pem (and ca-cert.pem
    /// for --tls-verify-peer), as qemu-nbd and nbdkit lay it out.
    #[arg(long, value_name = "DIR")]
    pub tls_certificates: Option<PathBuf>,

    /// Require client certificates signed by DIR/ca-cert.pem.
    #[arg(long)]
    pub tls_verify_peer: bool,

    /// Most RAM all `memory` targets of this server may hold together
    /// (bytes, or a K/M/G/T suffix); a write needing more fails with ENOSPC,
    /// as a thin pool out of space does. Default: three quarters of
    /// MemAvailable at start. Each line's `max_alloc=` bounds it further.
    #[arg(long, value_name = "SIZE", value_parser = parse_memory_limit)]
    pub memory_limit: Option<u64>,
}

fn parse_memory_limit(s: &str) -> Result<u64, String> {
    match blkstack_drivers::memory::parse_alloc_size(s) {
        Some(n) if n >= 4096 => Ok(n),
        Some(_) => Err(format!("{s}: at least one 4096-byte page")),
        None => Err(format!(
            "{s:?} is not a size (bytes or a K, M, G or T suffix, e.g. 512M)"
        )),
    }
}

/// An octal file mode such as `0660`, permission bits only.
fn parse_mode(s: &str) -> Result<u32, String> {
    let m = u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .map_err(|_| format!("{s:?} is not an octal mode (e.g. 0600)"))?;
    if m > 0o777 {
        return Err(format!(
            "{s}: only permission bits (at most 0777) are allowed"
        ));
    }
    Ok(m)
}

/// Parse `--export`/`--readonly` into (name, read_only) pairs.
pub fn parse_exports(
    export: &[String],
    readonly: &[String],
) -> anyhow::Result<Vec<(String, bool)>> {
    let mut out = blkstack_control::cli::parse_named_modes("--export", export)?;
    for r in readonly {
        match out.iter_mut().find(|(n, _)| n == r.trim()) {
            Some(x) => x.1 = true,
            None => bail!("--readonly {r}: not among the --export names"),
        }
    }
    Ok(out)
}

pub fn run_cli(args: NbdArgs) -> anyhow::Result<()> {
    run_serve(args, Vec::new())
}

/// Another frontend `serve` runs beside NBD (ublk): called once the stack
/// exists, it exports its devices and returns the host the control socket
/// drives; serve ends its exports (`ExportHost::shutdown`) when it stops.
pub type ExtraFrontend = Box<
    dyn FnOnce(
        &std::sync::Arc<blkstack_mapped::Registry>,
    ) -> anyhow::Result<std::sync::Arc<dyn blkstack_control::ExportHost>>,
>;

/// `serve` with NBD and the `extra` frontends. Without `--export` and
/// `--listen`, NBD listens nowhere (a ublk-only serve).
pub fn run_serve(args: NbdArgs, extra: Vec<ExtraFrontend>) -> anyhow::Result<()> {
    let exports = parse_exports(&args.export, &args.readonly)?;
    if exports.is_empty() && extra.is_empty() {
        bail!("serve needs devices to export: --export NAME (NBD), --ublk NAME (/dev/ublkbN) or --vhost-user-blk SOCKET:NAME");
    }
    let nbd_listens = !exports.is_empty() || !args.listen.is_empty();
    let listen: Vec<ListenUri> = if !nbd_listens {
        Vec::new()
    } else if args.listen.is_empty() {
        vec![ListenUri::Tcp(([127, 0, 0, 1], uri::DEFAULT_PORT).into())]
    } else {
        args.listen
            .iter()
            .map(|s| ListenUri::parse(s).map_err(anyhow::Error::from))
            .collect::<anyhow::Result<_>>()?
    };
    if let Some(limit) = args.memory_limit {
        blkstack_drivers::memory::process_budget().set_limit_bytes(limit);
    }
    let reg = blkstack_mapped::Registry::new();
    if let Some(path) = &args.stack {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading stack file {}", path.display()))?;
        reg.create_stack(&text)
            .with_context(|| format!("stack file {}", path.display()))?;
    }
    if let Some(c) = &args.concise {
        reg.create_concise(c).context("--concise")?;
    }
    let mut list = Vec::new();
    let mut held = Vec::new();
    for (name, ro) in exports {
        let dev = reg
            .get(&name)
            .ok_or_else(|| blkstack_mapped::DmError::NoSuchDevice(name.clone()))
            .with_context(|| format!("--export {name}"))?;
        held.push((name.clone(), dev.clone()));
        list.push(Export::new(name, dev, ro));
    }
    let mut server = Server::bind(list, &listen)?;
    server.set_poll_ns(args.poll_us.saturating_mul(1000));
    server.set_socket_mode(args.socket_mode)?;
    server.set_tls(
        tls::TlsPolicy::load(
            args.tls,
            args.tls_certificates.as_deref(),
            args.tls_verify_peer,
        )
        .context("--tls")?,
    );
    server.set_limits(limits::Limits {
        max_connections: args.max_connections,
        max_handshakes: args.max_handshakes,
        handshake_deadline: std::time::Duration::from_secs(args.handshake_timeout),
        send_timeout: std::time::Duration::from_secs(args.send_timeout),
        ..limits::Limits::default()
    });
    // Live control (blkstack-control): the control socket lives as long
    // as the server runs.
    let mut hosts: Vec<std::sync::Arc<dyn blkstack_control::ExportHost>> = Vec::new();
    if nbd_listens {
        hosts.push(std::sync::Arc::new(control::NbdExportHost::new(
            server.export_table(),
            server.addresses(),
            held,
        )));
    }
    for f in extra {
        match f(&reg) {
            Ok(h) => hosts.push(h),
            Err(e) => {
                for h in &hosts {
                    h.shutdown();
                }
                return Err(e);
            }
        }
    }
    let control_state =
        std::sync::Arc::new(blkstack_control::Control::with_hosts(reg.clone(), hosts));
    let stop_frontends = control_state.clone();
    let control_server = match &args.control {
        Some(p) => Some(blkstack_control::ControlServer::start(
            p,
            control_state,
            false,
        )?),
        None => {
            let p = blkstack_control::default_socket_path();
            match blkstack_control::ControlServer::start(&p, control_state, true) {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "serve: no control socket");
                    None
                }
            }
        }
    };
    install_signal_stop(&server.stopper())?;
    {
        // One line per export and address, so a script (or a test) can
        // read the real port when it asked for port 0.
        let mut so = std::io::stdout().lock();
        for a in server.addresses() {
            for e in server.exports().iter() {
                writeln!(
                    so,
                    "serving {} ({} bytes{}) at {}",
                    e.name,
                    e.dev.size(),
                    if e.read_only { ", read-only" } else { "" },
                    a.client_uri(&e.name)
                )?;
            }
        }
        if let Some(c) = &control_server {
            writeln!(so, "control socket at {}", c.path().display())?;
        }
        writeln!(so, "ready")?;
        so.flush()?;
    }
    let summary = server.run();
    drop(control_server);
    // The other frontends' devices (ublk) end here, before the stack.
    stop_frontends.shutdown();
    let summary = summary?;
    // Deliberately user-facing (the counterpart of "ready" on stdout).
    eprintln!(
        "blkstack serve: stopped after {} connection(s); devices flushed",
        summary.connections
    );
    Ok(())
}
