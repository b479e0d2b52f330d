//! NBD as one of `serve`'s export frontends (blkstack-control's
//! [`ExportDriver`] and [`ExportHost`], qemu's `BlockExportDriver` as
//! `block/export/export.c` drives it; the same file in ublk and
//! vhost-user-blk does the same for those): serve's NBD flags, starting
//! the server on its own accept thread once the stack exists, and the
//! control socket's `export`/`unexport`/`exports` of NBD exports.
//!
//! An exported device is held open (`MappedDevice::open`), as a block
//! device an NBD server has open is in the kernel, so `remove` refuses it
//! until it is unexported.

use crate::export::{Export, ExportTable};
use crate::server::{ServeSummary, Server, Stopper};
use crate::uri::{self, ListenUri};
use crate::{limits, server, tls};
use anyhow::{bail, Context};
use blkstack_control::proto::{EBUSY, EINVAL};
use blkstack_control::{not_exported, ExportDriver, ExportHost, ExportInfo, RpcError};
use blkstack_core::timing::spin::PollSetting;
use blkstack_core::DeviceRef;
use blkstack_mapped::{MappedDevice, Registry};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// `serve`'s NBD flags.
#[derive(clap::Args, Debug)]
pub struct NbdArgs {
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

    /// Busy-poll of a connection's socket before its reader blocks: US
    /// microseconds at most (0: never poll; at most 10000), backing off
    /// after polls that find nothing or lose the CPU to another thread;
    /// or `auto[:MAX]`, a window per connection that grows while the
    /// waits for requests are shorter than MAX µs (default 50) and closes
    /// when one is longer, the client pipelines or a poll loses the CPU,
    /// as qemu's poll-max-ns.
    /// Off by default: it buys latency at low queue depth with CPU.
    #[arg(long, value_name = "US|auto[:MAX]", default_value_t = server::DEFAULT_POLL)]
    pub poll_us: PollSetting,

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
}

/// A `--socket-mode` value clap refuses.
#[derive(Debug, thiserror::Error)]
enum ModeError {
    #[error("{0:?} is not an octal mode (e.g. 0600)")]
    NotOctal(String),
    #[error("{0}: only permission bits (at most 0777) are allowed")]
    NotPermissionBits(String),
}

/// An octal file mode such as `0660`, permission bits only.
fn parse_mode(s: &str) -> Result<u32, ModeError> {
    let m = u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .map_err(|_| ModeError::NotOctal(s.to_string()))?;
    if m > 0o777 {
        return Err(ModeError::NotPermissionBits(s.to_string()));
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

impl NbdArgs {
    /// The addresses to listen on: `--listen`, else the default one.
    fn listen_uris(&self) -> anyhow::Result<Vec<ListenUri>> {
        if self.listen.is_empty() {
            return Ok(vec![ListenUri::Tcp(
                ([127, 0, 0, 1], uri::DEFAULT_PORT).into(),
            )]);
        }
        self.listen
            .iter()
            .map(|s| ListenUri::parse(s).map_err(anyhow::Error::from))
            .collect()
    }

    /// The `--export` devices of `reg`, with their names.
    fn exports(&self, reg: &Registry) -> anyhow::Result<Vec<(String, Arc<MappedDevice>, bool)>> {
        let mut out = Vec::new();
        for (name, ro) in parse_exports(&self.export, &self.readonly)? {
            let dev = reg
                .get(&name)
                .ok_or_else(|| blkstack_mapped::DmError::NoSuchDevice(name.clone()))
                .with_context(|| format!("--export {name}"))?;
            out.push((name, dev, ro));
        }
        Ok(out)
    }

    /// Bind the listeners and set the server up as the flags say.
    fn bind(&self, exports: Vec<Export>) -> anyhow::Result<Server> {
        let mut server = Server::bind(exports, &self.listen_uris()?)?;
        server.set_poll(self.poll_us);
        server.set_socket_mode(self.socket_mode)?;
        server.set_tls(
            tls::TlsPolicy::load(
                self.tls,
                self.tls_certificates.as_deref(),
                self.tls_verify_peer,
            )
            .context("--tls")?,
        );
        server.set_limits(limits::Limits {
            max_connections: self.max_connections,
            max_handshakes: self.max_handshakes,
            handshake_deadline: Duration::from_secs(self.handshake_timeout),
            send_timeout: Duration::from_secs(self.send_timeout),
            ..limits::Limits::default()
        });
        Ok(server)
    }
}

/// One `serving` line per export and address, so a script (or a test)
/// can read the real port when it asked for port 0.
fn announce(server: &Server) -> std::io::Result<()> {
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
    Ok(())
}

impl ExportDriver for NbdArgs {
    fn frontend(&self) -> &'static str {
        "nbd"
    }

    fn requested(&self) -> bool {
        !self.export.is_empty()
    }

    /// `--listen` alone starts NBD beside another frontend, for exports
    /// the control socket adds.
    fn enabled(&self) -> bool {
        self.requested() || !self.listen.is_empty()
    }

    fn usage(&self) -> &'static str {
        "--export NAME (NBD)"
    }

    fn start(&self, reg: &Arc<Registry>) -> anyhow::Result<Arc<dyn ExportHost>> {
        let held = self.exports(reg)?;
        let list = held
            .iter()
            .map(|(name, dev, ro)| Export::new(name.clone(), dev.clone() as DeviceRef, *ro))
            .collect();
        let server = self.bind(list)?;
        announce(&server)?;
        let held = held.into_iter().map(|(n, d, _)| (n, d)).collect();
        Ok(Arc::new(NbdHost::start(server, held)?))
    }
}

/// NBD's running exports: the server on its accept thread, and the
/// devices its exports hold open.
pub struct NbdHost {
    table: ExportTable,
    addresses: Vec<ListenUri>,
    /// The mapped devices behind the exports, to `close()` on unexport.
    held: Mutex<HashMap<String, Arc<MappedDevice>>>,
    /// The accept thread and its stop, until [`ExportHost::shutdown`].
    running: Mutex<Option<(Stopper, JoinHandle<std::io::Result<ServeSummary>>)>>,
    /// Connections served, once the server has stopped.
    served: AtomicU64,
}

impl NbdHost {
    /// Run `server` on its own thread. `held` are the devices it was
    /// started with: they are opened here, as later exports are.
    pub fn start(
        server: Server,
        held: Vec<(String, Arc<MappedDevice>)>,
    ) -> std::io::Result<NbdHost> {
        let table = server.export_table();
        let addresses = server.addresses();
        let stopper = server.stopper();
        let thread = std::thread::Builder::new()
            .name("nbd-accept".into())
            .spawn(move || server.run())?;
        for (_, d) in &held {
            d.open();
        }
        Ok(NbdHost {
            table,
            addresses,
            held: Mutex::new(held.into_iter().collect()),
            running: Mutex::new(Some((stopper, thread))),
            served: AtomicU64::new(0),
        })
    }

    fn info(&self, e: &Export, device: &str) -> ExportInfo {
        ExportInfo {
            device: device.to_string(),
            name: e.name.clone(),
            read_only: e.read_only,
            connections: e.clients.lock().len() as u64,
            uris: self
                .addresses
                .iter()
                .map(|a| a.client_uri(&e.name))
                .collect(),
        }
    }
}

impl ExportHost for NbdHost {
    fn export(
        &self,
        name: &str,
        dev: Arc<MappedDevice>,
        read_only: bool,
    ) -> Result<ExportInfo, RpcError> {
        if name.is_empty() {
            return Err(RpcError::new(EINVAL, "an export needs a name"));
        }
        let mut held = self.held.lock();
        let mut added = None;
        self.table.update(|cur| {
            if cur.iter().any(|e| e.name == name) {
                return Err(RpcError::new(EBUSY, format!("{name} is already exported")));
            }
            let e = Export::new(name, dev.clone() as DeviceRef, read_only);
            added = Some(e.clone());
            let mut next = cur.to_vec();
            next.push(e);
            Ok(next)
        })?;
        dev.open();
        let device = dev.name.clone();
        held.insert(name.to_string(), dev);
        let e = added.ok_or_else(|| RpcError::new(EINVAL, "export vanished"))?;
        Ok(self.info(&e, &device))
    }

    fn unexport(&self, name: &str, force: bool) -> Result<(), RpcError> {
        let mut held = self.held.lock();
        let mut gone = None;
        self.table.update(|cur| {
            let Some(i) = cur.iter().position(|e| e.name == name) else {
                return Err(not_exported(name));
            };
            let clients = cur[i].clients.lock().len();
            if clients > 0 && !force {
                return Err(RpcError::new(
                    EBUSY,
                    format!(
                        "{name} has {clients} client(s) connected; use force to disconnect them"
                    ),
                ));
            }
            let mut next = cur.to_vec();
            gone = Some(next.remove(i));
            Ok(next)
        })?;
        if let Some(e) = gone {
            // As a graceful server stop does: no new requests, the ones
            // in flight answered, then the connection ends.
            for s in e.clients.lock().iter() {
                s.shutdown(std::net::Shutdown::Read);
            }
        }
        if let Some(d) = held.remove(name) {
            d.close();
        }
        Ok(())
    }

    fn exports(&self) -> Vec<ExportInfo> {
        let held = self.held.lock();
        self.table
            .snapshot()
            .iter()
            .map(|e| {
                let device = held.get(&e.name).map(|d| d.name.as_str()).unwrap_or("");
                self.info(e, device)
            })
            .collect()
    }

    fn frontend(&self) -> &'static str {
        "nbd"
    }

    /// The graceful stop (`server.rs`): no new connections, in-flight
    /// requests answered, every writable export flushed; then the
    /// devices are no longer held.
    fn shutdown(&self) {
        let Some((stopper, thread)) = self.running.lock().take() else {
            return;
        };
        stopper.stop();
        match thread.join() {
            Ok(Ok(summary)) => self.served.store(summary.connections, Ordering::Relaxed),
            Ok(Err(e)) => tracing::warn!(error = %e, "nbd: server failed"),
            Err(_) => tracing::warn!("nbd: the accept thread panicked"),
        }
        for (_, d) in self.held.lock().drain() {
            d.close();
        }
    }

    fn connections_served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }
}
