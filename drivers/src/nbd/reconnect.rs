//! A connection's thread: read replies while the connection lives, and
//! when it dies, reconnect with a doubling backoff (from
//! `reconnect_delay_ms`, capped), resending every request that was in
//! flight on it. Requests wait for the server at most `dead_timeout_ms`
//! (counted from the connection's first failure since it last answered
//! a request, or from their submission if later) and then fail with EIO,
//! as the kernel's nbd `dead_conn_timeout` fails requests while no
//! connection is alive; dm-multipath sees a path error and retries them
//! on another path.
//!
//! A server that accepts connections but misbehaves (replies with
//! unknown cookies or outside the request, hangs mid-reply, never
//! answers) must not keep requests for ever by letting each reconnect
//! succeed: a reconnect is not progress, only an answered request is. So
//! the dead timeout is not reset by a reconnect, the backoff keeps
//! doubling across reconnects until a request is answered, a protocol
//! violation kills the connection as a timeout does (kernel
//! `nbd_handle_reply` errors), and a request whose connection died
//! [`MAX_FAILED_SENDS`] times without answering anything since it was
//! sent fails with EIO rather than being resent again.
//!
//! The resend runs on a thread of its own while replies are read, so a
//! resend larger than the socket holds cannot wait for a server that
//! waits for its replies to be read.
//!
//! Removal sets the stop flag and shuts the socket down: the thread
//! leaves whatever it blocks in (a read, a backoff sleep, a connection
//! attempt bounded by its timeout) and fails the requests it still holds,
//! so nothing is left uncompleted and no thread outlives its device.

use super::connection::{Connection, SlotData};
use super::extents::ExtentQuery;
use super::handshake;
use super::options::{NbdOptions, MAX_RECONNECT_DELAY_MS};
use super::poll::Pollers;
use super::reply::{ReaderExit, ReplyReader};
use super::wire::{ReadSide, Receiver, Sender};
use blkstack_core::clock::now_ns;
use blkstack_core::Status;
use blkstack_mq::HeldCompleter;
use rustls::ClientConfig;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Sends of one request on connections that then died without answering
/// anything after it was sent; at this many it fails with EIO.
pub const MAX_FAILED_SENDS: u32 = 3;

/// Longest the thread sleeps between checks while disconnected (the
/// granularity of the dead timeout and of noticing removal).
const IDLE_TICK: Duration = Duration::from_millis(10);

/// How often a poll queue's thread looks at its connection when nothing
/// wakes it (a poller that finds it dead, and removal, do).
const POLLED_IDLE_TICK: Duration = Duration::from_millis(100);

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

    /// With a request timeout, reads wake up periodically to check it.
    fn set_read_tick(&self, rx: &Receiver) {
        if let Some(t) = self.read_tick() {
            let _ = rx.socket().set_read_timeout(Some(t));
        }
    }
}

/// The body of connection `index`'s thread.
pub fn run(shared: Arc<DeviceShared>, index: usize, done: HeldCompleter, rx: Receiver, gen: u64) {
    let conn = &shared.conns[index];
    if conn.polled {
        return run_polled(&shared, index, done, rx, gen);
    }
    let timeout_ns = shared.opts.timeout_ms * 1_000_000;
    let mut next = Some((rx, gen));
    // Held while replies are read into request buffers: removal ends
    // the waiting requests itself only when it can take this.
    let mut reading = conn.reader_lock.lock();
    // The first connection has nothing to resend.
    let mut resend = false;
    while let Some((mut rx, gen)) = next.take() {
        rx.set_poll_ns(shared.opts.poll_us * 1000);
        shared.set_read_tick(&rx);
        let mut side = ReadSide::new(rx, gen);
        let exit = std::thread::scope(|s| {
            if std::mem::take(&mut resend) {
                resend_beside(s, conn);
            }
            let exit = ReplyReader::new(
                conn,
                &mut side,
                done.completer_ref(),
                &shared.extents,
                timeout_ns,
            )
            .run();
            // A resend blocked on the dead socket ends before the scope.
            side.shutdown();
            exit
        });
        match exit {
            ReaderExit::Stop => break,
            ReaderExit::Dead(why) => conn.mark_down(&why),
        }
        drop(side);
        next = parking_lot::MutexGuard::unlocked(&mut reading, || reconnect(&shared, conn, &done))
            .and_then(|c| {
                // Removal may have begun while the handshake ran.
                (!conn.stop.load(Ordering::Acquire))
                    .then(|| install(conn, c.sender, c.receiver))
                    .flatten()
            });
        resend = true;
    }
    fail_waiting(conn, &done, &shared.extents, |_| true);
}

/// Resend what waited for the new connection from a thread of its own,
/// while the caller goes on reading replies: a resend of more than the
/// socket holds, with nobody reading, would wait for a server that waits
/// for its replies to be read. If no thread can be had, resend inline.
fn resend_beside<'s>(s: &'s std::thread::Scope<'s, '_>, conn: &'s Connection) {
    let spawned = std::thread::Builder::new()
        .name(format!("nbd-resend{}", conn.index))
        .spawn_scoped(s, || resend_all(conn));
    if let Err(e) = spawned {
        tracing::warn!(connection = conn.index, error = %e, "nbd: no resend thread; resending inline");
        resend_all(conn);
    }
}

/// Send every waiting request not yet sent on the current connection.
fn resend_all(conn: &Connection) {
    let mut tx = conn.tx.lock();
    for tag in 0..conn.slots.len() {
        if let Err(e) = conn.send_slot(&mut tx, tag as u32) {
            conn.note_send_error(&mut tx, e);
            break;
        }
    }
}

/// A poll queue's thread: the submitters read the replies (`poll.rs`);
/// this thread puts each new connection's read side where they find it,
/// reads replies while a sender is stalled on a full socket, fails a
/// connection whose request timed out while nobody polled, and
/// reconnects when a poller found the connection dead.
fn run_polled(
    shared: &DeviceShared,
    index: usize,
    done: HeldCompleter,
    mut rx: Receiver,
    gen: u64,
) {
    let conn = &shared.conns[index];
    conn.wake.set_thread();
    let own = Pollers {
        conns: std::slice::from_ref(conn),
        extents: &shared.extents,
        timeout_ns: shared.opts.timeout_ms * 1_000_000,
    };
    let tick = shared.read_tick().unwrap_or(POLLED_IDLE_TICK);
    // A poller at depth 1 polls its socket before sleeping in the read,
    // as a reader thread does (`poll_us=`): the reply often comes back
    // within the poll, and the wake-up it saves is on every request's path.
    rx.set_poll_ns(shared.opts.poll_us * 1000);
    shared.set_read_tick(&rx);
    *conn.reader_lock.lock() = Some(ReadSide::new(rx, gen));
    let mut resend = false;
    loop {
        std::thread::scope(|s| {
            if std::mem::take(&mut resend) {
                resend_beside(s, conn);
            }
            while conn.stats.up.load(Ordering::Acquire) && !conn.stop.load(Ordering::Acquire) {
                let stalled = || conn.wake.send_stalled.load(Ordering::Acquire);
                if stalled() {
                    own.reap(conn, &done.completer_ref(), &|| !stalled(), true);
                    continue;
                }
                std::thread::park_timeout(tick);
                expire_polled(conn, own.timeout_ns);
            }
        });
        if conn.stop.load(Ordering::Acquire) {
            break;
        }
        // The poller that found it dead took the read side; a poller
        // still inside it is done once this lock is ours.
        drop(conn.reader_lock.lock().take());
        let Some(c) = reconnect(shared, conn, &done) else {
            break;
        };
        if conn.stop.load(Ordering::Acquire) {
            break;
        }
        let mut rx = c.receiver;
        rx.set_poll_ns(shared.opts.poll_us * 1000);
        shared.set_read_tick(&rx);
        install(conn, c.sender, rx);
        resend = true;
    }
    let mut side = conn.reader_lock.lock();
    side.take();
    fail_waiting(conn, &done, &shared.extents, |_| true);
}

/// A request unanswered past the timeout while no poller reads (one
/// that reads notices it itself) fails the connection.
fn expire_polled(conn: &Connection, timeout_ns: u64) {
    if timeout_ns == 0 || conn.oldest_sent_ns(now_ns()) <= timeout_ns {
        return;
    }
    let Some(side) = conn.reader_lock.try_lock().and_then(|mut g| g.take()) else {
        return;
    };
    conn.stats.timeouts.fetch_add(1, Ordering::Relaxed);
    side.shutdown();
    conn.mark_down("request timed out");
}

/// End the active requests `pick` chooses with EIO; returns how many.
pub fn fail_waiting(
    conn: &Connection,
    done: &HeldCompleter,
    extents: &ExtentQuery,
    pick: impl Fn(&SlotData) -> bool,
) -> usize {
    let last = conn.slots.len() - 1;
    let mut failed = 0;
    for (tag, slot) in conn.slots.iter().enumerate() {
        let mut d = slot.0.lock();
        if !d.active || !pick(&d) {
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

/// Requests that waited longer than the dead timeout since the first
/// failure, or whose connections died [`MAX_FAILED_SENDS`] times without
/// answering, fail.
fn expire(shared: &DeviceShared, conn: &Connection, done: &HeldCompleter) {
    let Some(since) = conn.stats.failing() else {
        return;
    };
    let now = now_ns();
    let dead = conn.dead_timeout_ns;
    let failed = fail_waiting(conn, done, &shared.extents, |d| {
        d.failed_sends >= MAX_FAILED_SENDS || now.saturating_sub(d.queued_ns.max(since)) >= dead
    });
    if failed > 0 {
        tracing::warn!(
            connection = conn.index,
            requests = failed,
            dead_timeout_ms = shared.opts.dead_timeout_ms,
            max_failed_sends = MAX_FAILED_SENDS,
            "nbd: server gone or answering nothing; requests failed with EIO"
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
    // A reconnect that made no progress resumes the backoff where the
    // last one left it.
    let resumed = conn.stats.backoff_ms.load(Ordering::Relaxed);
    let mut delay = Duration::from_millis(opts.reconnect_delay_ms.max(resumed));
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
                let next = (delay * 2).min(Duration::from_millis(MAX_RECONNECT_DELAY_MS));
                conn.stats
                    .backoff_ms
                    .store(next.as_millis() as u64, Ordering::Relaxed);
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

/// Put a new socket in place; the caller then resends what waited for
/// it (`resend_beside`). A poll queue's read side goes where its pollers
/// find it (`None` then); a reader thread's is handed back to it.
fn install(conn: &Connection, sender: Sender, rx: Receiver) -> Option<(Receiver, u64)> {
    let mut tx = conn.tx.lock();
    tx.gen += 1;
    conn.attach_sender(&mut tx, sender);
    let gen = tx.gen;
    let mut rx = Some(rx);
    if conn.polled {
        // Pollers take this lock before the send lock only to find the
        // read side gone; none holds it now.
        *conn.reader_lock.lock() = rx.take().map(|rx| ReadSide::new(rx, gen));
    }
    conn.stats.up.store(true, Ordering::Release);
    conn.stats.down_since.store(0, Ordering::Relaxed);
    conn.stats.reconnects.fetch_add(1, Ordering::Relaxed);
    drop(tx);
    tracing::info!(connection = conn.index, "nbd: reconnected");
    rx.map(|rx| (rx, gen))
}
