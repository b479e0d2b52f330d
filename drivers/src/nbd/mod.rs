//! `nbd`: a remote NBD export as a leaf device (the kernel's nbd client,
//! `drivers/block/nbd.c`, in userspace). Table line:
//!
//! ```text
//! 0 LEN nbd URI [connections=N] [queue_depth=N] [timeout_ms=N]
//!               [reconnect_delay_ms=N] [dead_timeout_ms=N] [poll_us=N]
//!               [poll_queues=N]
//! ```
//!
//! URI as libnbd spells it ([`uri`]). The table load connects and
//! negotiates ([`handshake`]): fixed newstyle, structured replies,
//! `base:allocation`, NBD_OPT_GO with the block-size constraints. The
//! export's size bounds the line's length; its minimum block size
//! (at least 512) is the logical block size, its preferred size the
//! physical one, and bios above its maximum are split.
//!
//! Each connection is one hardware queue of the blk-mq engine
//! ([`connection`]): `queue_depth` tags per connection, a request's cookie
//! its tag and hardware queue, replies read by one thread per connection
//! ([`reply`]). `connections=N` opens N connections only when the server
//! advertises CAN_MULTI_CONN (otherwise one, with a warning, as a flush on
//! one connection would not cover writes on another). A lost connection
//! reconnects with backoff and resends its requests ([`reconnect`]);
//! requests wait at most `dead_timeout_ms`, then fail with EIO, which
//! dm-multipath treats as a path error. `poll_queues=N` adds N
//! connections as blk-mq poll queues: `POLLED` bios go there and their
//! submitters read the replies ([`poll`]), as nvme-tcp's poll queues.

pub mod connection;
pub mod extents;
#[doc(hidden)]
pub mod fuzzing;
pub mod handshake;
pub mod options;
pub mod poll;
pub mod proto;
pub mod reconnect;
pub mod reply;
#[doc(hidden)]
pub mod scripted;
pub mod tls;
pub mod uri;
pub mod wire;

use crate::error::ArgError;
use blkstack_core::device::Extent;
use blkstack_core::Features;
use blkstack_mq::{
    CompleterRef, Disk, DiskLimits, Driver, EngineOptions, QueueError, QueueRq, RequestCompleter,
    Rq,
};
use connection::{Connection, Geometry};
use extents::ExtentQuery;
use handshake::{Connected, ExportInfo, HandshakeError};
use options::NbdOptions;
use proto::*;
use reconnect::DeviceShared;
use std::fmt::Write;
use std::ops::Deref;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

/// Why an `nbd` device could not be built.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    #[error("nbd: missing the server URI (syntax: nbd URI [connections=N] [queue_depth=N] [timeout_ms=N] [reconnect_delay_ms=N] [dead_timeout_ms=N] [poll_us=N] [poll_queues=N])")]
    MissingUri,
    #[error("nbd: {0}")]
    Uri(#[from] uri::UriError),
    #[error(transparent)]
    Args(#[from] ArgError),
    #[error("nbd: {0}: TLS URIs need tls-certificates=DIR in the query (ca-cert.pem, optional client-cert.pem/client-key.pem)")]
    NoCertificates(String),
    #[error("nbd: TLS certificates: {0}")]
    Tls(String),
    #[error("nbd: cannot reach {uri}")]
    Connect {
        uri: String,
        #[source]
        source: HandshakeError,
    },
    #[error("nbd: the table line is {line_bytes} bytes but export {uri} holds only {export_bytes} bytes")]
    TooLong {
        uri: String,
        line_bytes: u64,
        export_bytes: u64,
    },
    #[error("nbd: {uri}: line length {line_bytes} bytes is not a multiple of the export's block size {block_size}")]
    Unaligned {
        uri: String,
        line_bytes: u64,
        block_size: u32,
    },
    #[error("nbd: line length is zero")]
    ZeroSize,
    #[error("nbd: cannot start its queue")]
    Queue(#[source] QueueError),
    #[error("nbd: cannot start a connection thread")]
    Thread(#[source] std::io::Error),
    #[error("nbd: the engine attached no completer")]
    NoCompleter,
}

/// The driver under the engine: hardware queue `i` is connection `i`;
/// the last `poll_queues` of them are poll queues.
pub struct NbdDriver {
    shared: Arc<DeviceShared>,
    /// Index of the first poll queue (the number of connections if none).
    first_polled: usize,
    /// The export's `base:allocation` context, if it has one.
    allocation_context: Option<u32>,
    completer: OnceLock<RequestCompleter>,
}

impl NbdDriver {
    fn pollers(&self) -> poll::Pollers<'_> {
        poll::Pollers {
            conns: &self.shared.conns[self.first_polled..],
            extents: &self.shared.extents,
            timeout_ns: self.shared.opts.timeout_ms * 1_000_000,
        }
    }
}

impl Driver for NbdDriver {
    #[inline]
    fn queue_rq(&self, rq: Rq<'_>) -> QueueRq {
        match self.shared.conns.get(rq.hctx as usize) {
            Some(c) => c.queue_rq(rq),
            None => QueueRq::Done(blkstack_core::Status::Invalid),
        }
    }

    fn attach(&self, completer: RequestCompleter) {
        let _ = self.completer.set(completer);
    }

    fn polls(&self) -> bool {
        self.first_polled < self.shared.conns.len()
    }

    fn poll(&self, completer: &CompleterRef<'_>) -> usize {
        self.pollers().poll(completer)
    }

    fn poll_sleeps(&self) -> bool {
        self.polls()
    }

    fn poll_wait(&self, completer: &CompleterRef<'_>, ready: &dyn Fn() -> bool) -> usize {
        self.pollers().poll_wait(completer, ready)
    }

    /// The export's answers to BLOCK_STATUS, merged into runs.
    fn extents(&self, offset: u64, end: u64) -> Option<Vec<Extent>> {
        let ctx = self.allocation_context?;
        let wait = Duration::from_millis(self.shared.opts.dead_timeout_ms)
            + self.shared.opts.connect_timeout();
        let mut out: Vec<Extent> = Vec::new();
        let mut at = offset;
        while at < end {
            let part = self
                .shared
                .extents
                .query(&self.shared.conns[0], ctx, at, end - at, wait)?;
            let Some(last) = part.last() else { break };
            at = last.offset + last.len;
            for e in part {
                match out.last_mut() {
                    Some(l) if l.hole == e.hole && l.offset + l.len == e.offset => l.len += e.len,
                    _ => out.push(e),
                }
            }
        }
        Some(out)
    }
}

/// An nbd device: its connections, their threads and its disk.
pub struct NbdDevice {
    geo: Geometry,
    /// Connections asked for but refused (server without CAN_MULTI_CONN).
    multi_conn_refused: bool,
    shared: Arc<DeviceShared>,
    disk: Disk<NbdDriver>,
    threads: Vec<JoinHandle<()>>,
}

/// What the export's flags let the device offer.
fn features(i: &ExportInfo, connections: usize) -> Features {
    Features {
        flush: i.has(TFLAG_SEND_FLUSH),
        fua: i.has(TFLAG_SEND_FUA),
        discard: i.has(TFLAG_SEND_TRIM),
        discard_granularity: 0,
        write_zeroes: !i.has(TFLAG_READ_ONLY),
        fast_zero: i.has(TFLAG_SEND_WRITE_ZEROES) && i.has(TFLAG_SEND_FAST_ZERO),
        read_only: i.has(TFLAG_READ_ONLY),
        flush_is_global: i.has(TFLAG_CAN_MULTI_CONN) || connections == 1,
        knows_holes: i.allocation_context.is_some(),
    }
}

/// Block-size rules: logical = server minimum rounded up to 512, largest
/// part = server maximum (capped at the protocol's 32 MiB default)
/// rounded down to the logical size.
fn geometry(info: ExportInfo) -> (u32, Geometry) {
    let block_size = info.min_block.max(512);
    let max = (info.max_block.min(handshake::DEFAULT_MAX_BLOCK) as u64).max(block_size as u64);
    let max_part = max / block_size as u64 * block_size as u64;
    (block_size, Geometry { info, max_part })
}

impl NbdDevice {
    /// Build from a table line's length (bytes) and its arguments:
    /// connect, negotiate, start the connection threads.
    pub fn from_args(size_bytes: u64, args: &[&str]) -> Result<NbdDevice, NbdError> {
        let opts = NbdOptions::parse(args)?;
        if size_bytes == 0 {
            return Err(NbdError::ZeroSize);
        }
        let tls = match (&opts.uri.tls, &opts.uri.tls_certificates) {
            (false, _) => None,
            (true, None) => return Err(NbdError::NoCertificates(opts.uri.text.clone())),
            (true, Some(dir)) => Some(tls::client_config(dir)?),
        };
        let connect = || {
            handshake::connect(&opts.uri, tls.as_ref(), opts.connect_timeout()).map_err(|source| {
                NbdError::Connect {
                    uri: opts.uri.text.clone(),
                    source,
                }
            })
        };
        let first = connect()?;
        let info = first.info;
        if size_bytes > info.size {
            return Err(NbdError::TooLong {
                uri: opts.uri.text.clone(),
                line_bytes: size_bytes,
                export_bytes: info.size,
            });
        }
        let (block_size, geo) = geometry(info);
        if !size_bytes.is_multiple_of(block_size as u64) {
            return Err(NbdError::Unaligned {
                uri: opts.uri.text.clone(),
                line_bytes: size_bytes,
                block_size,
            });
        }
        let multi = info.has(TFLAG_CAN_MULTI_CONN);
        let multi_conn_refused = (opts.connections > 1 || opts.poll_queues > 0) && !multi;
        if multi_conn_refused {
            tracing::warn!(
                uri = %opts.uri,
                asked = opts.connections,
                "nbd: server does not advertise CAN_MULTI_CONN; using 1 connection"
            );
        }
        if opts.poll_queues > 0 && !multi {
            tracing::warn!(
                uri = %opts.uri,
                poll_queues = opts.poll_queues,
                "nbd: server does not advertise CAN_MULTI_CONN; no poll queues"
            );
        }
        let n = if multi { opts.connections } else { 1 };
        let polled = if multi { opts.poll_queues } else { 0 };
        let mut links = vec![first];
        for _ in 1..n + polled {
            links.push(connect()?);
        }
        Self::start(
            opts,
            tls,
            size_bytes,
            block_size,
            geo,
            links,
            multi_conn_refused,
        )
    }

    fn start(
        opts: NbdOptions,
        tls: Option<Arc<rustls::ClientConfig>>,
        size: u64,
        block_size: u32,
        geo: Geometry,
        links: Vec<Connected>,
        multi_conn_refused: bool,
    ) -> Result<NbdDevice, NbdError> {
        let dead_ns = opts.dead_timeout_ms.saturating_mul(1_000_000);
        let polled = links.len() - (opts.connections as usize).min(links.len());
        let first_polled = links.len() - polled;
        let conns: Box<[Arc<Connection>]> = (0..links.len())
            .map(|i| {
                Arc::new(Connection::new(
                    i as u32,
                    geo,
                    opts.queue_depth + 1,
                    dead_ns,
                    i >= first_polled,
                ))
            })
            .collect();
        let mut receivers = Vec::with_capacity(links.len());
        for (c, link) in conns.iter().zip(links) {
            let mut tx = c.tx.lock();
            c.attach_sender(&mut tx, link.sender);
            tx.gen = 1;
            c.stats.up.store(true, Ordering::Relaxed);
            receivers.push(link.receiver);
        }
        let engine = EngineOptions {
            hw_queues: conns.len() as u32,
            poll_queues: polled as u32,
            queue_depth: opts.queue_depth,
            ..EngineOptions::default()
        };
        let shared = Arc::new(DeviceShared {
            opts,
            tls,
            conns,
            extents: ExtentQuery::default(),
        });
        let driver = NbdDriver {
            shared: shared.clone(),
            first_polled,
            allocation_context: geo.info.allocation_context,
            completer: OnceLock::new(),
        };
        let limits = DiskLimits {
            // The server's preferred block size is its optimal I/O size.
            physical_block_size: geo.info.preferred_block.clamp(block_size, 64 * 1024),
            ..DiskLimits::new(size, block_size, features(&geo.info, shared.conns.len()))
        };
        let disk = Disk::new(driver, engine, limits).map_err(NbdError::Queue)?;
        let mut dev = NbdDevice {
            geo,
            multi_conn_refused,
            shared: shared.clone(),
            disk,
            threads: Vec::new(),
        };
        for (i, rx) in receivers.into_iter().enumerate() {
            let done = dev
                .disk
                .driver()
                .completer
                .get()
                .and_then(|c| c.hold())
                .ok_or(NbdError::NoCompleter)?;
            let shared = shared.clone();
            let t = std::thread::Builder::new()
                .name(format!("nbd-conn{i}"))
                .spawn(move || reconnect::run(shared, i, done, rx, 1))
                .map_err(NbdError::Thread)?;
            dev.threads.push(t);
        }
        Ok(dev)
    }

    pub fn options(&self) -> &NbdOptions {
        &self.shared.opts
    }

    pub fn export_info(&self) -> &ExportInfo {
        &self.geo.info
    }

    /// Connections that are up now, and in total.
    pub fn connections_up(&self) -> (usize, usize) {
        let c = &self.shared.conns;
        let up = c
            .iter()
            .filter(|c| c.stats.up.load(Ordering::Relaxed))
            .count();
        (up, c.len())
    }

    pub fn table_args(&self) -> String {
        self.shared.opts.table_args()
    }

    /// `dmsetup status` of the leaf: connections up/total, requests in
    /// flight, reconnects, timeouts, requests failed after the dead
    /// timeout, multi-conn, the negotiated geometry and the last error.
    pub fn status(&self) -> String {
        let conns = &self.shared.conns;
        let sum = |f: &dyn Fn(&Connection) -> u64| conns.iter().map(|c| f(c)).sum::<u64>();
        let (up, total) = self.connections_up();
        let polled = conns.iter().filter(|c| c.polled).count();
        let mut s = format!(
            "connections={up}/{total} poll_queues={polled} in_flight={} reconnects={} timeouts={} failed={}",
            sum(&|c| c.stats.in_flight.load(Ordering::Relaxed) as u64),
            sum(&|c| c.stats.reconnects.load(Ordering::Relaxed)),
            sum(&|c| c.stats.timeouts.load(Ordering::Relaxed)),
            sum(&|c| c.stats.failed.load(Ordering::Relaxed)),
        );
        let info = &self.geo.info;
        let multi = match (info.has(TFLAG_CAN_MULTI_CONN), self.multi_conn_refused) {
            (true, _) => "yes".to_string(),
            (false, true) => format!(
                "no(asked_{},server_lacks_CAN_MULTI_CONN)",
                self.shared.opts.connections
            ),
            (false, false) => "no".to_string(),
        };
        let _ = write!(
            s,
            " multi_conn={multi} structured={} bs={} io_opt={} max_io={} export_bytes={}",
            if info.structured { "yes" } else { "no" },
            self.disk.limits().logical_block_size,
            self.disk.limits().physical_block_size,
            self.geo.max_part,
            info.size
        );
        let last = conns.iter().rev().find_map(|c| c.last_error.lock().clone());
        match last {
            Some(e) => {
                let _ = write!(s, " last_error=\"{}\"", e.replace('"', "'"));
            }
            None => s.push_str(" last_error=-"),
        }
        s
    }
}

/// How long removal waits for a connection thread that is in the middle
/// of a connection attempt (bounded by its own timeout) before leaving
/// it to finish alone.
const THREAD_EXIT_WAIT: Duration = Duration::from_secs(1);

impl Drop for NbdDevice {
    fn drop(&mut self) {
        for c in self.shared.conns.iter() {
            c.stop.store(true, Ordering::Release);
            if let Some(s) = c.tx.lock().sender.take() {
                s.shutdown();
            }
        }
        for t in &self.threads {
            t.thread().unpark();
        }
        // The last reference may go on a connection thread (a completion
        // dropping the table): that thread cannot join itself; it sees
        // the stop flag and ends on its own once this returns. A thread
        // inside a connection attempt ends when the attempt times out;
        // meanwhile the requests it holds are ended here, once it is
        // surely not reading into their buffers (its reader lock), so
        // removal never waits for a server that is gone.
        let me = std::thread::current().id();
        let deadline = std::time::Instant::now() + THREAD_EXIT_WAIT;
        let done = self.disk.driver().completer.get().and_then(|c| c.hold());
        for (t, c) in self.threads.drain(..).zip(self.shared.conns.iter()) {
            if t.thread().id() == me {
                continue;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if let (Some(done), Some(_idle)) = (&done, c.reader_lock.try_lock_for(left)) {
                reconnect::fail_waiting(c, done, &self.shared.extents, |_| true);
            }
            while !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

/// The device is the engine's leaf [`Disk`] (submission, checks, polling).
impl Deref for NbdDevice {
    type Target = Disk<NbdDriver>;

    fn deref(&self) -> &Disk<NbdDriver> {
        &self.disk
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(min: u32, pref: u32, max: u32) -> ExportInfo {
        ExportInfo {
            size: 1 << 30,
            tflags: TFLAG_HAS_FLAGS,
            min_block: min,
            preferred_block: pref,
            max_block: max,
            structured: true,
            allocation_context: None,
        }
    }

    #[test]
    fn block_sizes_follow_the_server_constraints() {
        // Byte-granular servers still get 512-byte logical blocks.
        let (bs, geo) = geometry(info(1, 4096, 32 << 20));
        assert_eq!((bs, geo.max_part), (512, 32 << 20));
        // A 4 KiB minimum is the logical block size; the maximum is
        // rounded down to it.
        let (bs, geo) = geometry(info(4096, 65536, 100_000));
        assert_eq!((bs, geo.max_part), (4096, 98_304));
        // Larger than the protocol's default maximum: capped.
        let (_, geo) = geometry(info(512, 4096, u32::MAX));
        assert_eq!(geo.max_part, 32 << 20);
        // A maximum below the logical size still allows one block.
        let (bs, geo) = geometry(info(1, 4096, 256));
        assert_eq!((bs, geo.max_part), (512, 512));
    }

    #[test]
    fn construction_errors_name_the_problem() {
        let e = NbdDevice::from_args(1 << 20, &["nbds+unix:///e?socket=/nonexistent"])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("tls-certificates=DIR"), "{e}");
        let e = NbdDevice::from_args(0, &["nbd://127.0.0.1/e"])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("length is zero"), "{e}");
    }
}
