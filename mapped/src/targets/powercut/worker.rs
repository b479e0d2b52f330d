//! Writeback batches of one `powercut` target: the disk's firmware. Cached
//! data goes down when a flush, a FUA write or a full cache asks for it,
//! one batch at a time, so two writes of the same sector are never on
//! their way to the device at once (the older could land last).
//!
//! A batch is planned under the state lock and submitted without it; its
//! end runs on the thread that completes its last request (the device
//! flush, then [`finish`]), so nothing waits for it. A flush or FUA write
//! starts its batch on the submitter's thread when none is running (no
//! thread hop on the common path); anything else (a batch due while one
//! ran, a full cache) is started by the target's worker thread, which a
//! batch's end only wakes, never recursing into the next batch.
//! Flushes and FUA writes wait in the shared state until their batch
//! ends; a write that finds the cache full waits there (uncopied) until a
//! forced writeback makes room, which bounds the memory the cache uses.

use super::cache::Extent;
use super::writeback::{self, WritebackError};
use super::{Shared, State};
use blkstack_core::{BioFlags, Op, Status};
use parking_lot::MutexGuard;
use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a worker that is shutting down waits for the device.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(30);

thread_local! {
    /// This thread is completing a batch's requests: a batch started from
    /// here would nest inside the last one's completion, so the worker
    /// starts it instead.
    static FINISHING: Cell<bool> = const { Cell::new(false) };
}

/// A batch of writeback.
pub(super) struct Batch {
    pub extents: Vec<Extent>,
    /// Flush the device afterwards (a flush, or FUA on a device without).
    pub flush_dev: bool,
    /// Pieces forced down by a full cache.
    pub forced: u64,
}

/// The worker's loop: start the batches that are due, until shutdown.
pub(super) fn run(sh: Arc<Shared>) {
    loop {
        let mut st = sh.state.lock();
        if st.shutdown {
            drop(st);
            return shut_down(&sh);
        }
        if let Some(b) = plan(&sh, &mut st) {
            drop(st);
            start(&sh, b);
            continue;
        }
        sh.work.wait_for(&mut st, writeback::WAIT_SLICE);
    }
}

/// From the map path, with the state locked: start the batch that is due
/// on this thread, or leave it to the worker if this thread is ending a
/// batch.
pub(super) fn kick(sh: &Arc<Shared>, mut st: MutexGuard<'_, State>) {
    if FINISHING.get() {
        drop(st);
        sh.work.notify_one();
        return;
    }
    let batch = plan(sh, &mut st);
    drop(st);
    if let Some(b) = batch {
        start(sh, b);
    }
}

/// How much a full cache must force down now, in bytes and pieces, if
/// anything: past three quarters of `max_dirty` down to half, or enough
/// for the write waiting at the head of the stalled queue.
fn eviction_target(sh: &Shared, st: &State) -> Option<(u64, usize)> {
    let c = &st.cache;
    let head = st.stalled.front().map(|b| b.len);
    let over = c.mem > sh.max_dirty / 4 * 3 || c.pieces() > sh.max_pieces / 4 * 3;
    if c.is_empty() || (head.is_none() && !over) {
        return None;
    }
    let mut bytes = c.mem.saturating_sub(sh.max_dirty / 2);
    let mut pieces = c.pieces().saturating_sub(sh.max_pieces / 2);
    match head {
        Some(h) if h > sh.max_dirty => return Some((u64::MAX, usize::MAX)),
        Some(h) => {
            bytes = bytes.max((c.mem + h).saturating_sub(sh.max_dirty));
            pieces = pieces.max((c.pieces() + 2).saturating_sub(sh.max_pieces));
        }
        None => {}
    }
    Some((bytes, pieces.max(1)))
}

/// Decide the next batch, if there is work and none is in flight; the
/// requests it will complete move to `batch_waiters`, where a cut finds
/// them.
fn plan(sh: &Shared, st: &mut State) -> Option<Batch> {
    if st.off || st.in_flight {
        return None;
    }
    let flush = !st.pending_flush.is_empty();
    let fua = !st.pending_fua.is_empty();
    let evict = eviction_target(sh, st);
    if !flush && !fua && evict.is_none() {
        return None;
    }
    let dev_fua = sh.dev.dev.features().fua;
    let mut extents = Vec::new();
    let mut forced = 0;
    if flush {
        st.cache.take_all(&mut extents);
    } else {
        for (_, start, end) in &st.pending_fua {
            st.cache.take_range(*start, *end, dev_fua, &mut extents);
        }
        if let Some((bytes, pieces)) = evict {
            forced = st.cache.take_oldest(bytes, pieces, &mut extents) as u64;
        }
        extents.sort_unstable_by_key(|e| e.start);
    }
    let mut waiters = std::mem::take(&mut st.pending_flush);
    waiters.extend(st.pending_fua.drain(..).map(|(b, _, _)| b));
    st.batch_waiters = waiters;
    st.in_flight = true;
    st.writeback = extents.len();
    Some(Batch {
        extents,
        flush_dev: flush || (fua && !dev_fua),
        forced,
    })
}

/// Submit a batch; its end runs where its last request completes.
fn start(sh: &Arc<Shared>, batch: Batch) {
    let pending = writeback::submit(&sh.dev.dev, &batch.extents);
    let sh = sh.clone();
    pending.then(move |r| after_writes(sh, batch, r));
}

fn after_writes(sh: Arc<Shared>, batch: Batch, r: Result<(), WritebackError>) {
    if r.is_ok() && batch.flush_dev {
        let sh2 = sh.clone();
        writeback::flush(&sh.dev.dev).then(move |r| finish(&sh2, batch, r));
    } else {
        finish(&sh, batch, r);
    }
}

/// End a batch: drop what it wrote from the cache (or give it back if it
/// failed), let waiting writes in, then complete its requests.
fn finish(sh: &Arc<Shared>, batch: Batch, result: Result<(), WritebackError>) {
    let ok = result.is_ok();
    if let Err(e) = &result {
        tracing::warn!(device = %sh.dev.name, error = ?e, "powercut: writeback failed");
    }
    let (waiters, admitted) = {
        let mut st = sh.state.lock();
        st.cache.finish(&batch.extents, ok);
        st.in_flight = false;
        st.writeback = 0;
        if ok && batch.flush_dev {
            st.dev_dirty = false;
        } else if !batch.extents.is_empty() {
            st.dev_dirty = true;
        }
        if ok {
            st.stats.forced += batch.forced;
        }
        let waiters = std::mem::take(&mut st.batch_waiters);
        if ok {
            for w in &waiters {
                if w.op == Op::Flush || w.flags.contains(BioFlags::PREFLUSH) {
                    st.stats.flushes += 1;
                } else {
                    st.stats.fua_writes += 1;
                }
            }
        }
        let admitted = if st.off {
            Vec::new()
        } else {
            sh.admit_stalled(&mut st)
        };
        sh.idle.notify_all();
        (waiters, admitted)
    };
    let was = FINISHING.replace(true);
    for mut w in waiters {
        if !ok {
            w.complete(Status::IoError);
        } else if w.op != Op::Flush && w.flags.contains(BioFlags::PREFLUSH) {
            // The flush before it is done; now the write itself.
            w.flags.remove(BioFlags::PREFLUSH);
            sh.map(w);
        } else {
            w.complete(Status::Ok);
        }
    }
    for b in admitted {
        b.complete(Status::Ok);
    }
    FINISHING.set(was);
    // Whatever came in meanwhile is the worker's to start.
    let st = sh.state.lock();
    let due = !st.off
        && (!st.pending_flush.is_empty()
            || !st.pending_fua.is_empty()
            || eviction_target(sh, &st).is_some());
    drop(st);
    if due {
        sh.work.notify_one();
    }
}

/// Wait until no batch is in flight, at most until `deadline`.
fn wait_idle(sh: &Shared, st: &mut MutexGuard<'_, State>, deadline: Instant) {
    while st.in_flight && Instant::now() < deadline {
        sh.idle.wait_for(st, writeback::WAIT_SLICE);
    }
}

/// The target is going away: write the cache down (what a disk does on
/// an orderly power-off), then fail whatever still waits.
fn shut_down(sh: &Arc<Shared>) {
    let deadline = Instant::now() + SHUTDOWN_LIMIT;
    let mut st = sh.state.lock();
    wait_idle(sh, &mut st, deadline);
    if !st.off && !st.in_flight && !st.cache.is_empty() {
        let mut extents = Vec::new();
        st.cache.take_all(&mut extents);
        st.in_flight = true;
        drop(st);
        start(
            sh,
            Batch {
                extents,
                flush_dev: true,
                forced: 0,
            },
        );
        st = sh.state.lock();
        wait_idle(sh, &mut st, deadline);
    }
    if st.in_flight {
        tracing::warn!(device = %sh.dev.name, "powercut: the final writeback did not finish");
    }
    st.off = true;
    let left = st.take_waiting();
    drop(st);
    for b in left {
        b.complete(Status::IoError);
    }
}
