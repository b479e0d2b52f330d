//! A connection's thread: read replies while the connection lives, and
//! when it dies, reconnect with a doubling backoff (from
//! `reconnect_delay_ms`, capped), resending every request that was in
//! flight on it. Requests wait for the server at most `dead_timeout_ms`
//! (counted from when the connection died, or from their submission if
//! later) and then fail with EIO, as the kernel's nbd `dead_conn_timeout`
//! fails requests while no connection is alive; dm-multipath sees a path
//! error and retries them on another path.
//!
//! Removal sets the stop flag and shuts the socket down: the thread
//! leaves whatever it blocks in (a read, a backoff sleep, a connection
//! attempt bounded by its timeout) and fails the requests it still holds,
//! so nothing is left uncompleted and no thread outlives its device.

use super::connection::Connection;
use super::extents::ExtentQuery;
use super::handshake;
use super::options::{NbdOptions, MAX_RECONNECT_DELAY_MS};
use super::reply::{ReaderExit, ReplyReader};
use super::wire::Receiver;
use blkstack_core::clock::now_ns;
use blkstack_core::Status;
use blkstack_mq::HeldCompleter;
use rustls::ClientConfig;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Longest the thread sleeps between checks while disconnected (the
/// granularity of the dead timeout and of noticing removal).
const IDLE_TICK: Duration = Duration::from_millis(10);

/// What every connection thread of a device shares.
pub struct DeviceShared {
    pub opts: NbdOptions,
    pub tls: Option<Arc<ClientConfig>>,
    pub conns: Box<[Arc<Connection>]>,
    pub extents: ExtentQuery,
}

impl DeviceShared {
    /// How long one reconnect attempt may take: long enough for a
    /// handshake, short enough that removal and the dead timeout are
    /// noticed soon.
    fn attempt_timeout(&self) -> Duration {
        let half_dead = Duration::from_millis(self.opts.dead_timeout_ms / 2);
        half_dead
            .max(Duration::from_millis(200))
            .min(self.opts.connect_timeout())
    }

    fn read_tick(&self) -> Option<Duration> {
        (self.opts.timeout_ms > 0)
            .then(|| Duration::from_millis((self.opts.timeout_ms / 4).clamp(5, 1000)))
    }
}

/// The body of connection `index`'s thread.
pub fn run(shared: Arc<DeviceShared>, index: usize, done: HeldCompleter, rx: Receiver, gen: u64) {
    let conn = &shared.conns[index];
    let timeout_ns = shared.opts.timeout_ms * 1_000_000;
    let mut next = Some((rx, gen));
    // Held while replies are read into request buffers: removal ends
    // the waiting requests itself only when it can take this.
    let mut reading = conn.reader_lock.lock();
    while let Some((rx, gen)) = next.take() {
        if let Some(t) = shared.read_tick() {
            let _ = rx.socket().set_read_timeout(Some(t));
        }
        let mut reader = ReplyReader::new(conn, rx, &done, &shared.extents, gen, timeout_ns);
        match reader.run() {
            ReaderExit::Stop => break,
            ReaderExit::Dead(why) => {
                reader.shutdown();
                mark_down(conn, &why)
            }
        }
        drop(reader);
        next = parking_lot::MutexGuard::unlocked(&mut reading, || reconnect(&shared, conn, &done))
            .and_then(|c| {
                // Removal may have begun while the handshake ran.
                (!conn.stop.load(Ordering::Acquire)).then(|| install(conn, c.sender, c.receiver))
            });
    }
    fail_waiting(conn, &done, &shared.extents, |_| true);
}

fn mark_down(conn: &Connection, why: &str) {
    let mut tx = conn.tx.lock();
    if let Some(s) = tx.sender.take() {
        s.shutdown();
    }
    conn.stats.up.store(false, Ordering::Relaxed);
    conn.stats.down_since.store(now_ns(), Ordering::Relaxed);
    drop(tx);
    tracing::warn!(
        connection = conn.index,
        reason = why,
        "nbd: connection lost, reconnecting"
    );
    conn.set_error(why.to_string());
}

/// End the active requests `pick` chooses (by their queued time) with
/// EIO; returns how many.
pub fn fail_waiting(
    conn: &Connection,
    done: &HeldCompleter,
    extents: &ExtentQuery,
    pick: impl Fn(u64) -> bool,
) -> usize {
    let last = conn.slots.len() - 1;
    let mut failed = 0;
    for (tag, slot) in conn.slots.iter().enumerate() {
        let mut d = slot.0.lock();
        if !d.active || !pick(d.queued_ns) {
            continue;
        }
        d.active = false;
        drop(d);
        failed += 1;
        conn.stats.failed.fetch_add(1, Ordering::Relaxed);
        if tag == last {
            extents.finish(Status::IoError);
        } else {
            conn.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
            done.end_request(conn.index, tag as u32, Status::IoError);
        }
    }
    failed
}

/// Requests that waited longer than the dead timeout fail.
fn expire(shared: &DeviceShared, conn: &Connection, done: &HeldCompleter) {
    let down = conn.stats.down_since.load(Ordering::Relaxed);
    if down == 0 {
        return;
    }
    let now = now_ns();
    let dead = conn.dead_timeout_ns;
    let failed = fail_waiting(conn, done, &shared.extents, |queued| {
        now.saturating_sub(queued.max(down)) >= dead
    });
    if failed > 0 {
        tracing::warn!(
            connection = conn.index,
            requests = failed,
            dead_timeout_ms = shared.opts.dead_timeout_ms,
            "nbd: server still gone after the dead timeout; requests failed with EIO"
        );
    }
}

/// Try until connected again (Some: the negotiated connection, not yet
/// installed) or stopped (None).
fn reconnect(
    shared: &DeviceShared,
    conn: &Connection,
    done: &HeldCompleter,
) -> Option<handshake::Connected> {
    let opts = &shared.opts;
    let mut delay = Duration::from_millis(opts.reconnect_delay_ms);
    let mut next_try = std::time::Instant::now() + delay;
    loop {
        if conn.stop.load(Ordering::Acquire) {
            return None;
        }
        expire(shared, conn, done);
        let now = std::time::Instant::now();
        if now < next_try {
            std::thread::park_timeout((next_try - now).min(IDLE_TICK));
            continue;
        }
        match handshake::connect(&opts.uri, shared.tls.as_ref(), shared.attempt_timeout()) {
            Ok(c) if c.info.size == conn.geo.info.size && c.info.tflags == conn.geo.info.tflags => {
                return Some(c);
            }
            Ok(c) => conn.set_error(format!(
                "reconnect: export changed (size {} flags {:#x}, was {} {:#x})",
                c.info.size, c.info.tflags, conn.geo.info.size, conn.geo.info.tflags
            )),
            Err(e) => conn.set_error(format!("reconnect: {}", e.describe())),
        }
        delay = (delay * 2).min(Duration::from_millis(MAX_RECONNECT_DELAY_MS));
        next_try = std::time::Instant::now() + delay;
    }
}

/// Put a new socket in place and resend what waited for it.
fn install(conn: &Connection, sender: super::wire::Sender, rx: Receiver) -> (Receiver, u64) {
    let mut tx = conn.tx.lock();
    tx.gen += 1;
    tx.sender = Some(sender);
    let gen = tx.gen;
    for tag in 0..conn.slots.len() {
        if let Err(e) = conn.send_slot(&mut tx, tag as u32) {
            conn.note_send_error(&mut tx, e);
            break;
        }
    }
    conn.stats.up.store(tx.sender.is_some(), Ordering::Relaxed);
    conn.stats.down_since.store(0, Ordering::Relaxed);
    conn.stats.reconnects.fetch_add(1, Ordering::Relaxed);
    drop(tx);
    tracing::info!(connection = conn.index, "nbd: reconnected");
    (rx, gen)
}
