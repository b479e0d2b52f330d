//! The `nbd` leaf's table arguments: `URI [connections=N] [queue_depth=N]
//! [timeout_ms=N] [reconnect_delay_ms=N] [dead_timeout_ms=N] [poll_us=N]
//! [poll_queues=N]`.
//!
//! They are the knobs of the kernel's nbd client (`nbd-client -C`
//! connections, the per-request timeout `nbd_xmit_timeout` enforces, and
//! `dead_conn_timeout`, how long requests wait for a lost server to come
//! back), plus the blk-mq tag depth per connection, the reply reader's
//! busy-poll bound (the NBD server's `--poll-us`, on the client side) and
//! the number of poll queues (nvme's `poll_queues`: extra connections
//! whose replies the polling submitters read). Each is printed back
//! by `table` only when it differs from its default, so a line re-parses
//! to the same device.

use super::uri::NbdUri;
use super::NbdError;
use crate::args::KvArgs;
use std::fmt::Write;
use std::time::Duration;

pub const DEFAULT_QUEUE_DEPTH: u64 = 64;
pub const MAX_QUEUE_DEPTH: u64 = 4096;
pub const MAX_CONNECTIONS: u64 = 64;
pub const DEFAULT_RECONNECT_DELAY_MS: u64 = 100;
/// Upper bound of the doubling reconnect backoff.
pub const MAX_RECONNECT_DELAY_MS: u64 = 5_000;
pub const DEFAULT_DEAD_TIMEOUT_MS: u64 = 30_000;
/// The reply reader's busy-poll bound: off unless asked. Unlike the
/// server's reader, which waits for a client that sends again at once,
/// the leaf's reader shares the CPUs with its own submitters and, when
/// CPUs are few, with a local server: polling bought little at depth 1
/// for much more CPU, and cost throughput at depth (docs/BENCHMARKS.md).
pub const DEFAULT_POLL_US: u64 = 0;
const MAX_POLL_US: u64 = 10_000;
/// How long a table load waits for the server when `timeout_ms` is 0.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_MS: u64 = 24 * 3600 * 1000;

/// Parsed table arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdOptions {
    pub uri: NbdUri,
    /// Connections asked for (hardware queues, if the server allows).
    pub connections: u32,
    /// Tags (requests in flight) per connection.
    pub queue_depth: u32,
    /// A request unanswered this long kills its connection (0: never).
    pub timeout_ms: u64,
    /// First reconnect delay; doubles up to [`MAX_RECONNECT_DELAY_MS`].
    pub reconnect_delay_ms: u64,
    /// How long requests wait for a lost connection to come back before
    /// they fail with EIO.
    pub dead_timeout_ms: u64,
    /// Longest busy-poll of a connection's socket before its reply reader
    /// blocks (0: never poll); adaptive, see `blkstack_core::timing::spin`.
    pub poll_us: u64,
    /// Extra connections for `POLLED` bios, read by their submitters
    /// (blk-mq poll queues; see `poll.rs`).
    pub poll_queues: u32,
}

impl NbdOptions {
    pub fn parse(args: &[&str]) -> Result<NbdOptions, NbdError> {
        let (uri, rest) = args.split_first().ok_or(NbdError::MissingUri)?;
        if uri.contains('=') && !uri.contains("://") {
            return Err(NbdError::MissingUri);
        }
        let uri = NbdUri::parse(uri)?;
        let mut kv = KvArgs::parse("nbd", rest)?;
        let connections = kv.take_u64("connections", 1, 1, MAX_CONNECTIONS)? as u32;
        let queue_depth =
            kv.take_u64("queue_depth", DEFAULT_QUEUE_DEPTH, 1, MAX_QUEUE_DEPTH)? as u32;
        let timeout_ms = kv.take_u64("timeout_ms", 0, 0, MAX_MS)?;
        let reconnect_delay_ms = kv.take_u64(
            "reconnect_delay_ms",
            DEFAULT_RECONNECT_DELAY_MS,
            1,
            MAX_RECONNECT_DELAY_MS,
        )?;
        let dead_timeout_ms = kv.take_u64("dead_timeout_ms", DEFAULT_DEAD_TIMEOUT_MS, 0, MAX_MS)?;
        let poll_us = kv.take_u64("poll_us", DEFAULT_POLL_US, 0, MAX_POLL_US)?;
        let poll_queues = kv.take_u64("poll_queues", 0, 0, MAX_CONNECTIONS)? as u32;
        kv.finish()?;
        Ok(NbdOptions {
            poll_us,
            poll_queues,
            uri,
            connections,
            queue_depth,
            timeout_ms,
            reconnect_delay_ms,
            dead_timeout_ms,
        })
    }

    /// The bound on connecting and on the handshake.
    pub fn connect_timeout(&self) -> Duration {
        if self.timeout_ms > 0 {
            Duration::from_millis(self.timeout_ms)
        } else {
            DEFAULT_CONNECT_TIMEOUT
        }
    }

    /// The arguments as a table line shows them.
    pub fn table_args(&self) -> String {
        let mut s = self.uri.text.clone();
        let mut num = |key: &str, v: u64, default: u64| {
            if v != default {
                let _ = write!(s, " {key}={v}");
            }
        };
        num("connections", self.connections.into(), 1);
        num("queue_depth", self.queue_depth.into(), DEFAULT_QUEUE_DEPTH);
        num("timeout_ms", self.timeout_ms, 0);
        num(
            "reconnect_delay_ms",
            self.reconnect_delay_ms,
            DEFAULT_RECONNECT_DELAY_MS,
        );
        num(
            "dead_timeout_ms",
            self.dead_timeout_ms,
            DEFAULT_DEAD_TIMEOUT_MS,
        );
        num("poll_us", self.poll_us, DEFAULT_POLL_US);
        num("poll_queues", self.poll_queues.into(), 0);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_round_trip() {
        let o = NbdOptions::parse(&["nbd://h/e"]).unwrap();
        assert_eq!(o.connections, 1);
        assert_eq!(o.queue_depth, 64);
        assert_eq!(o.table_args(), "nbd://h/e");
        let line = "nbd+unix:///e?socket=/s connections=4 queue_depth=8 timeout_ms=500 \
                    reconnect_delay_ms=10 dead_timeout_ms=200 poll_us=50 poll_queues=2";
        let args: Vec<&str> = line.split_whitespace().collect();
        let o = NbdOptions::parse(&args).unwrap();
        assert_eq!((o.connections, o.queue_depth, o.timeout_ms), (4, 8, 500));
        assert_eq!((o.reconnect_delay_ms, o.dead_timeout_ms), (10, 200));
        assert_eq!((o.poll_us, o.poll_queues), (50, 2));
        assert_eq!(o.table_args(), line);
        let again: Vec<String> = o.table_args().split(' ').map(String::from).collect();
        let again: Vec<&str> = again.iter().map(|s| s.as_str()).collect();
        assert_eq!(NbdOptions::parse(&again).unwrap(), o);
        assert_eq!(o.connect_timeout(), Duration::from_millis(500));
    }

    #[test]
    fn bad_args_are_named() {
        for (args, want) in [
            (&[][..], "missing the server URI"),
            (&["connections=2"][..], "missing the server URI"),
            (
                &["nbd://h/e", "connections=0"][..],
                "connections=0 is out of range",
            ),
            (&["nbd://h/e", "queue_depth=x"][..], "queue_depth='x'"),
            (
                &["nbd://h/e", "colour=red"][..],
                "unknown argument 'colour'",
            ),
            (&["ftp://h/e"][..], "expected nbd://"),
        ] {
            let e = NbdOptions::parse(args).unwrap_err().to_string();
            assert!(e.contains(want), "{args:?}: {e}");
        }
    }
}
