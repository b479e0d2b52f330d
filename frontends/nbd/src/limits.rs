//! What one client, or many, may cost the server: a cap on negotiated
//! connections and a separate, smaller pool for connections still in
//! their handshake (each with an absolute deadline), so that silent
//! sockets cannot lock negotiated clients out (nbdkit bounds its
//! handshake the same way, with its own timeout); the send timeout after
//! which a client that stopped reading is disconnected; the idle time
//! after which a connection's buffers are given back; and the accept
//! loop's back-off when the process is out of file descriptors, memory or
//! threads.
//!
//! The back-off follows what a kernel does with a noisy condition it cannot
//! fix itself: slow down and say so at a bounded rate (`printk_ratelimit`,
//! `net_ratelimit`). Without it, a listener with a pending connection stays
//! readable while `accept` keeps failing with EMFILE, and the loop spins a
//! CPU writing one line per failure.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default cap on negotiated connections served at once (each has its
/// own threads).
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Default cap on connections still in their handshake, counted apart
/// from negotiated ones.
pub const DEFAULT_MAX_HANDSHAKES: usize = 16;
/// Default bound on the whole handshake, from accept to the export chosen.
pub const DEFAULT_HANDSHAKE_DEADLINE: Duration = Duration::from_secs(60);
/// Default time a reply may wait for the client to take any byte of it
/// before the client is disconnected (qemu-nbd and nbdkit leave this to
/// TCP; a local socket has no such bound, hence ours).
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// Default idle time after which a connection frees its request buffers.
pub const DEFAULT_IDLE_TRIM: Duration = Duration::from_secs(2);

/// Per-server limits (see the module documentation).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub max_handshakes: usize,
    pub handshake_deadline: Duration,
    pub send_timeout: Duration,
    pub idle_trim: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
            handshake_deadline: DEFAULT_HANDSHAKE_DEADLINE,
            send_timeout: DEFAULT_SEND_TIMEOUT,
            idle_trim: DEFAULT_IDLE_TRIM,
        }
    }
}

/// How many connections are in their handshake and how many negotiated,
/// shared by the accept loop and the connections.
#[derive(Debug, Default)]
pub struct Admission {
    handshaking: AtomicUsize,
    negotiated: AtomicUsize,
}

/// A connection counted in the handshake pool until dropped or promoted.
#[derive(Debug)]
pub struct HandshakeTicket {
    adm: Arc<Admission>,
    max_connections: usize,
}

/// A negotiated connection's place under `max_connections`.
#[derive(Debug)]
pub struct NegotiatedSlot {
    adm: Arc<Admission>,
}

impl Admission {
    /// Admit a new connection into the handshake pool, if there is room
    /// both there and (eventually) among negotiated connections.
    pub fn admit(self: &Arc<Self>, limits: &Limits) -> Option<HandshakeTicket> {
        if self.negotiated.load(Ordering::Acquire) >= limits.max_connections {
            return None;
        }
        let taken = self
            .handshaking
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limits.max_handshakes).then_some(n + 1)
            });
        taken.ok().map(|_| HandshakeTicket {
            adm: self.clone(),
            max_connections: limits.max_connections,
        })
    }
}

impl HandshakeTicket {
    /// The client chose its export: take a negotiated place, or `None`
    /// when all are taken (the client is refused). The ticket stays in
    /// the handshake pool until dropped with the handshake.
    pub fn promote(&self) -> Option<NegotiatedSlot> {
        let max = self.max_connections;
        let taken = self
            .adm
            .negotiated
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            });
        taken.ok().map(|_| NegotiatedSlot {
            adm: self.adm.clone(),
        })
    }
}

impl Drop for HandshakeTicket {
    fn drop(&mut self) {
        self.adm.handshaking.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for NegotiatedSlot {
    fn drop(&mut self) {
        self.adm.negotiated.fetch_sub(1, Ordering::AcqRel);
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

    /// A connection was refused because the negotiated or handshaking
    /// connections are at their cap.
    pub fn refused(&mut self, limits: &Limits) {
        if let Some(n) = self.refused_log.allow(Instant::now()) {
            tracing::warn!(
                max_connections = limits.max_connections,
                max_handshakes = limits.max_handshakes,
                suppressed = n,
                "nbd: connection refused: too many connections or handshakes"
            );
        }
    }

    /// No thread could be started for an accepted connection (out of
    /// threads or memory): it is closed, and accepting pauses as for
    /// any other shortage.
    pub fn spawn_failed(&mut self, e: &io::Error) -> Duration {
        if let Some(n) = self.log.allow(Instant::now()) {
            tracing::warn!(
                error = %e,
                suppressed = n,
                "nbd: cannot start a connection thread; connection refused"
            );
        }
        let next = match self.pause {
            None => BACKOFF_MIN,
            Some(p) => (p * 2).min(BACKOFF_MAX),
        };
        self.pause = Some(next);
        next
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
    fn handshakes_and_negotiated_connections_have_separate_caps() {
        let limits = Limits {
            max_connections: 2,
            max_handshakes: 3,
            ..Limits::default()
        };
        let adm = Arc::new(Admission::default());
        let hs: Vec<_> = (0..3).map(|_| adm.admit(&limits)).collect();
        assert!(hs.iter().all(Option::is_some));
        assert!(adm.admit(&limits).is_none(), "handshake pool full");
        let mut slots = Vec::new();
        for t in hs.into_iter().flatten() {
            slots.push(t.promote());
        }
        // Two negotiated, the third handshake finds no place.
        assert_eq!(slots.iter().filter(|s| s.is_some()).count(), 2);
        assert!(adm.admit(&limits).is_none(), "negotiated connections full");
        slots.pop();
        slots.pop();
        assert!(adm.admit(&limits).is_some(), "a place freed");
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
