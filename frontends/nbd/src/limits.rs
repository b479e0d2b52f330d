//! What one client, or many, may cost the server: a connection cap, an
//! absolute handshake deadline, the idle time after which a connection's
//! buffers are given back, and the accept loop's back-off when the process
//! is out of file descriptors.
//!
//! The back-off follows what a kernel does with a noisy condition it cannot
//! fix itself: slow down and say so at a bounded rate (`printk_ratelimit`,
//! `net_ratelimit`). Without it, a listener with a pending connection stays
//! readable while `accept` keeps failing with EMFILE, and the loop spins a
//! CPU writing one line per failure.

use std::io;
use std::time::{Duration, Instant};

/// Default cap on connections served at once (each has its own thread).
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Default bound on the whole handshake, from accept to the export chosen.
pub const DEFAULT_HANDSHAKE_DEADLINE: Duration = Duration::from_secs(60);
/// Default idle time after which a connection frees its request buffers.
pub const DEFAULT_IDLE_TRIM: Duration = Duration::from_secs(2);

/// Per-server limits (see the module documentation).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub handshake_deadline: Duration,
    pub idle_trim: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            handshake_deadline: DEFAULT_HANDSHAKE_DEADLINE,
            idle_trim: DEFAULT_IDLE_TRIM,
        }
    }
}

/// Shortest and longest pause after an accept failure that will repeat
/// (out of descriptors or memory): doubled while failures continue.
const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// At most one log line per this interval per kind of event.
const LOG_INTERVAL: Duration = Duration::from_secs(5);

/// A log line allowed at most once per [`LOG_INTERVAL`], counting what it
/// suppressed meanwhile.
#[derive(Debug, Default)]
pub struct RateLimitedLog {
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimitedLog {
    /// Whether to log now; `Some(n)`: log, mentioning `n` suppressed since
    /// the previous line.
    pub fn allow(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(t) if now.duration_since(t) < LOG_INTERVAL => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// The accept loop's state across failures.
#[derive(Debug, Default)]
pub struct AcceptBackoff {
    pause: Option<Duration>,
    log: RateLimitedLog,
    refused_log: RateLimitedLog,
}

/// An accept failure that repeats until something else changes: the
/// process or system is out of descriptors, or the kernel out of memory.
pub fn is_resource_shortage(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

impl AcceptBackoff {
    /// Record an accept failure; how long the loop must wait before
    /// accepting again (zero for a one-off failure such as a client that
    /// left before accept).
    pub fn failed(&mut self, e: &io::Error) -> Duration {
        let shortage = is_resource_shortage(e);
        if let Some(n) = self.log.allow(Instant::now()) {
            tracing::warn!(error = %e, suppressed = n, "nbd: accept failed");
        }
        if !shortage {
            return Duration::ZERO;
        }
        let next = match self.pause {
            None => BACKOFF_MIN,
            Some(p) => (p * 2).min(BACKOFF_MAX),
        };
        self.pause = Some(next);
        next
    }

    /// An accept succeeded: the shortage is over.
    pub fn succeeded(&mut self) {
        self.pause = None;
    }

    /// A connection was refused because `max` are already served.
    pub fn refused(&mut self, max: usize) {
        if let Some(n) = self.refused_log.allow(Instant::now()) {
            tracing::warn!(
                max_connections = max,
                suppressed = n,
                "nbd: connection refused: too many connections"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_shortage_backs_off_doubling_to_a_bound_and_resets() {
        let mut b = AcceptBackoff::default();
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        let mut pauses = Vec::new();
        for _ in 0..10 {
            pauses.push(b.failed(&emfile));
        }
        assert_eq!(pauses[0], BACKOFF_MIN);
        assert_eq!(pauses[1], BACKOFF_MIN * 2);
        assert_eq!(*pauses.last().unwrap(), BACKOFF_MAX);
        assert!(pauses.windows(2).all(|w| w[0] <= w[1]));
        b.succeeded();
        assert_eq!(b.failed(&emfile), BACKOFF_MIN);
        let aborted = io::Error::from_raw_os_error(libc::ECONNABORTED);
        assert_eq!(b.failed(&aborted), Duration::ZERO);
    }

    #[test]
    fn a_rate_limited_log_allows_one_line_per_interval_and_counts_the_rest() {
        let mut l = RateLimitedLog::default();
        let t0 = Instant::now();
        assert_eq!(l.allow(t0), Some(0));
        for i in 1..=1000 {
            assert_eq!(l.allow(t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(l.allow(t0 + LOG_INTERVAL), Some(1000));
        assert_eq!(l.allow(t0 + LOG_INTERVAL), None);
    }
}
