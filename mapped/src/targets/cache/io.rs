//! The cache target's I/O path and worker (`dm-cache-target.c`'s
//! `map_bio`, `process_deferred_bios`, `check_migrations` and the
//! migration state machine `mg_*`).
//!
//! Hits are remapped to the cache device and misses to the origin on the
//! submitter's thread, under the policy lock (the kernel's `mq->lock`),
//! except a read hit that would change nothing in the policy but its
//! stats, which is remapped without the lock (`hits.rs`); a plugged
//! batch's such hits go to the cache device as one batch (`map_batch`).
//! Everything that must wait goes to one worker thread: flushes and FUA
//! writes (committed first, as `issue_after_commit`), discards,
//! writethrough and passthrough write hits. Bios for a block under
//! migration wait in its cell (`cell.rs`) and are mapped again when it
//! is unlocked. The worker also starts the policy's background work,
//! which migration threads run several at a time (`migrate.rs`).
//! Metadata commits on FLUSH/FUA, every [`COMMIT_PERIOD`], and before a
//! demotion or an invalidation goes on (`batcher.rs`, one commit for all
//! that wait at once).
//!
//! Differences: a whole block write miss promoted at once
//! (`optimisable_bio`) goes to the origin and is then copied, rather
//! than written to the cache directly.

use super::batcher::Batcher;
use super::cell::Cells;
use super::copier::Copier;
use super::hits::HitIndex;
use super::metadata::{CacheMetadata, Stats};
use super::migrate::Step;
use super::smq::Smq;
use blkstack_core::sync::{submit_and_wait, submit_and_wait_flags};
use blkstack_core::{Bio, BioFlags, DeviceRef, EndIo, Op, Status};
use foldhash::HashMap;
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `COMMIT_PERIOD`: the worker commits a changed transaction this often.
pub const COMMIT_PERIOD: Duration = Duration::from_secs(1);
/// The target is idle when no bio arrived for this long (`iot_idle_for(HZ)`).
const IDLE_AFTER: Duration = Duration::from_secs(1);
/// Longest a suspend waits for the migrations in flight.
const QUIESCE_LIMIT: Duration = Duration::from_secs(30);
const KIND_HIT: u64 = 0;
const KIND_ORIGIN_WRITE: u64 = 1 << 62;
const KIND_MASK: u64 = 3 << 62;
const TICK: u64 = 1 << 61;
/// Least time between policy ticks. The kernel ticks on each tick bio's
/// completion, which a real device spaces by its latency and smq's
/// periods count in jiffies; an in-memory cache device completes at
/// once, so without this nearly every hit would also tick (a second
/// policy lock), for no change in what smq decides. On the coarse
/// clock, so ticks are also at least one of its ticks apart.
const TICK_EVERY_NS: u64 = 1_000_000;
/// The block index in a completion's private word; all ones for none.
const INDEX_MASK: u64 = (1 << 61) - 1;

/// `enum cache_io_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// Writes to cached blocks go to the cache only (dirty).
    Writeback,
    /// Writes to cached blocks go to both.
    Writethrough,
    /// Everything goes to the origin; written cached blocks are dropped.
    Passthrough,
}

/// What the worker and the map path share under the policy lock.
pub struct Core {
    /// The replacement policy.
    pub policy: Smq,
    /// One dirty bit per cache block (`cache->dirty_bitset`).
    pub dirty: Vec<bool>,
    /// Dirty blocks.
    pub nr_dirty: u64,
    /// One bit per discard block (`cache->discard_bitset`).
    pub discarded: Vec<bool>,
    /// Origin blocks under migration and the bios waiting for them.
    pub(super) cells: Cells<Bio>,
    /// Writes in flight to the origin, per origin block.
    pub(super) origin_writes: HashMap<u64, u32>,
    /// Bios for the worker.
    deferred: VecDeque<Bio>,
    /// Migrations started and not yet complete (`nr_io_migrations`).
    pub(super) nr_migrations: u32,
    /// Steps of the migrations in flight, waiting for a migration thread
    /// (at most one per migration, so at most
    /// [`super::migrate::MAX_MIGRATIONS`]).
    pub(super) mg_queue: VecDeque<Step>,
    /// The worker stops.
    pub(super) stop: bool,
    /// Background work is held off (suspended).
    pub(super) paused: bool,
}

/// The counters status shows (`struct cache_stats`).
#[derive(Default)]
pub struct Counters {
    /// Reads of cached blocks.
    pub read_hit: AtomicU32,
    /// Reads of uncached blocks.
    pub read_miss: AtomicU32,
    /// Writes to cached blocks.
    pub write_hit: AtomicU32,
    /// Writes to uncached blocks.
    pub write_miss: AtomicU32,
    /// Blocks demoted (or invalidated).
    pub demotion: AtomicU32,
    /// Blocks promoted.
    pub promotion: AtomicU32,
}

/// A cache's state (`struct cache`).
pub struct Shared {
    /// Policy, dirty bits and deferred bios.
    pub core: Mutex<Core>,
    /// The worker's wake-up, and where quiesces wait for I/O to drain.
    pub(super) cv: Condvar,
    /// Where the migration threads wait for work (with `core`).
    pub(super) mg_cv: Condvar,
    /// The migration threads (`migrate.rs`).
    pub(super) pool: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// The metadata, locked after `core` when both are held.
    pub md: Mutex<CacheMetadata>,
    /// Demotions and invalidations waiting for a commit (`cache->committer`).
    pub(super) committer: Batcher,
    /// The migrations' copies in flight (`cache->copier`).
    pub(super) copier: Arc<Copier>,
    /// The policy's mapping table, for read hits without the lock, and
    /// the bios in flight to each cache block.
    index: Arc<HitIndex>,
    need_tick: AtomicBool,
    /// Blocks locked by migrations (completions wake them when I/O drains).
    pub(super) migrating: AtomicU32,
    /// The origin device.
    pub origin: DeviceRef,
    /// The cache device.
    pub cache: DeviceRef,
    /// Bytes per cache block.
    pub block_bytes: u64,
    /// Its log2, when it is a power of two.
    block_shift: Option<u32>,
    /// Whole origin blocks the cache covers.
    pub origin_blocks: u64,
    /// Bytes per discard block.
    pub discard_bytes: u64,
    /// The I/O mode.
    pub mode: IoMode,
    /// Discards go on to the origin.
    pub discard_passdown: bool,
    /// `migration_threshold`, in sectors.
    pub migration_threshold: AtomicU64,
    /// Hit/miss/migration counters.
    pub counters: Counters,
    /// When the last bio arrived, in [`coarse_now_ns`] nanoseconds.
    last_io: AtomicU64,
    /// No tick bio before this time, in [`coarse_now_ns`] nanoseconds.
    next_tick: AtomicU64,
}

impl Shared {
    /// The state for a cache of `nr_cblocks` blocks.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        core: Core,
        md: CacheMetadata,
        origin: DeviceRef,
        cache: DeviceRef,
        block_bytes: u64,
        origin_blocks: u64,
        discard_bytes: u64,
        mode: IoMode,
        discard_passdown: bool,
    ) -> Shared {
        let index = core.policy.index();
        Shared {
            core: Mutex::new(core),
            cv: Condvar::new(),
            mg_cv: Condvar::new(),
            pool: Mutex::new(Vec::new()),
            md: Mutex::new(md),
            committer: Batcher::default(),
            copier: Copier::new(),
            index,
            need_tick: AtomicBool::new(true),
            migrating: AtomicU32::new(0),
            origin,
            cache,
            block_bytes,
            block_shift: block_bytes
                .is_power_of_two()
                .then_some(block_bytes.trailing_zeros()),
            origin_blocks,
            discard_bytes,
            mode,
            discard_passdown,
            migration_threshold: AtomicU64::new(2048),
            counters: Counters::default(),
            last_io: AtomicU64::new(coarse_now_ns()),
            next_tick: AtomicU64::new(0),
        }
    }
}

impl Core {
    /// The in-core state for `nr_cblocks` cache blocks and `nr_dblocks`
    /// discard blocks.
    pub fn new(policy: Smq, nr_cblocks: u32, nr_dblocks: u64) -> Core {
        Core {
            policy,
            dirty: vec![false; nr_cblocks as usize],
            nr_dirty: 0,
            discarded: vec![false; nr_dblocks as usize],
            cells: Cells::default(),
            origin_writes: HashMap::default(),
            deferred: VecDeque::new(),
            nr_migrations: 0,
            mg_queue: VecDeque::new(),
            stop: false,
            paused: false,
        }
    }

    pub(super) fn set_dirty(&mut self, cb: u32, dirty: bool) {
        let slot = &mut self.dirty[cb as usize];
        if *slot != dirty {
            *slot = dirty;
            if dirty {
                self.nr_dirty += 1;
            } else {
                self.nr_dirty -= 1;
            }
            self.policy.set_dirty(cb, dirty);
        }
    }
}

/// `CLOCK_MONOTONIC_COARSE`: the time at the clock's last tick, as the
/// kernel's jiffies that `iot_io_begin` and the tick spacing go by. Every
/// bio stamps it, and it costs a fraction of a precise clock read.
fn coarse_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid pointer to a timespec; CLOCK_MONOTONIC_COARSE exists
    // on every Linux blkstack runs on.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn needs_worker(bio: &Bio) -> bool {
    matches!(bio.op, Op::Flush | Op::Discard | Op::WriteZeroes)
        || bio.flags.contains(BioFlags::PREFLUSH)
        || bio.flags.contains(BioFlags::FUA)
}

impl Shared {
    /// `cache_map`.
    pub fn map(self: &Arc<Self>, bio: Bio) {
        self.last_io.store(coarse_now_ns(), Ordering::Relaxed);
        self.map_one(bio);
    }

    /// `cache_map` for a plugged batch: the fast read hits are remapped
    /// in place and go to the cache device as one batch, so the layers
    /// below pay their per-submission costs once; every other bio takes
    /// [`Shared::map`]'s path after them. Bios of one batch are all in
    /// flight at once, so nothing orders them against each other (a
    /// flush covers only writes completed before it was submitted).
    /// Leaves `bios` empty.
    pub fn map_batch(self: &Arc<Self>, bios: &mut Vec<Bio>) {
        self.last_io.store(coarse_now_ns(), Ordering::Relaxed);
        if self.mode != IoMode::Passthrough {
            // Each lookup loads a bucket, then the block its chain starts
            // at. Ask for all the buckets, then all the blocks, before the
            // first lookup: the lookups' in-flight counts are full
            // barriers, behind which a miss would be waited for alone.
            let reads = || bios.iter().filter(|b| b.op == Op::Read);
            for bio in reads() {
                self.index.prefetch_bucket(self.split(bio.offset).0);
            }
            for bio in reads() {
                self.index.prefetch_head(self.split(bio.offset).0);
            }
        }
        let mut slow = Vec::new();
        slow.extend(bios.extract_if(.., |b| !self.remap_fast_hit(b)));
        if !bios.is_empty() {
            self.cache.submit_batch(bios);
        }
        for bio in slow {
            self.map_one(bio);
        }
    }

    /// `cache_map` without the idle clock's stamp.
    fn map_one(self: &Arc<Self>, mut bio: Bio) {
        if needs_worker(&bio) {
            return self.defer(bio);
        }
        if self.remap_fast_hit(&mut bio) {
            return self.cache.submit(bio);
        }
        self.map_bio(bio, false);
    }

    /// Remap `bio` to the cache device if it is a fast read hit (see
    /// [`Shared::fast_read_hit`]), with the completion frame that uncounts
    /// it; false leaves it as it was, for `map_bio` or the worker.
    #[inline]
    fn remap_fast_hit(self: &Arc<Self>, bio: &mut Bio) -> bool {
        if bio.op != Op::Read || self.mode == IoMode::Passthrough || needs_worker(bio) {
            return false;
        }
        let Some((cb, within)) = self.fast_read_hit(bio.offset) else {
            return false;
        };
        bio.push_end(self.clone(), KIND_HIT | self.tick_flag() | cb as u64);
        bio.offset = cb as u64 * self.block_bytes + within;
        true
    }

    /// The origin block of a byte offset and the offset within it.
    #[inline]
    fn split(&self, offset: u64) -> (u64, u64) {
        match self.block_shift {
            Some(s) => (offset >> s, offset & (self.block_bytes - 1)),
            None => (offset / self.block_bytes, offset % self.block_bytes),
        }
    }

    /// A read at `offset` of a block that is cached, not pending and was
    /// hit this period (see `hits.rs`): counted as a read hit and in
    /// flight to its cache block, which is returned with the offset
    /// within it, all without the policy lock. `None`: `map_bio` decides.
    #[inline]
    fn fast_read_hit(&self, offset: u64) -> Option<(u32, u64)> {
        let (ob, within) = self.split(offset);
        if ob >= self.origin_blocks {
            return None;
        }
        let hit = self.index.find_fast(ob)?;
        let cb = hit.cblock;
        // Counted in flight before the check, which a migration's quiesce
        // pairs with (both sequentially consistent).
        self.inflight(cb).fetch_add(1, Ordering::SeqCst);
        if !self.index.confirm(hit) {
            self.put_inflight(cb as u64);
            return None;
        }
        self.counters.read_hit.fetch_add(1, Ordering::Relaxed);
        Some((cb, within))
    }

    /// `check_if_tick_bio_needed`: `TICK` for the first bio at least
    /// [`TICK_EVERY_NS`] after the last tick.
    #[inline]
    fn tick_flag(&self) -> u64 {
        if self.last_io.load(Ordering::Relaxed) >= self.next_tick.load(Ordering::Relaxed)
            && self.need_tick.swap(false, Ordering::Relaxed)
        {
            TICK
        } else {
            0
        }
    }

    /// The in-flight count of cache block `cb` (a block of the cache).
    #[inline]
    pub(super) fn inflight(&self, cb: u32) -> &AtomicU32 {
        match self.index.inflight(cb as u64) {
            Some(n) => n,
            None => panic!("cache block {cb} out of range"),
        }
    }

    /// One I/O to cache block `cb` is done; a waiting migration is woken
    /// when it was the last.
    fn put_inflight(&self, cb: u64) {
        if let Some(n) = self.index.inflight(cb) {
            if n.fetch_sub(1, Ordering::AcqRel) == 1 && self.migrating.load(Ordering::SeqCst) != 0 {
                self.cv.notify_all();
            }
        }
    }

    fn defer(&self, bio: Bio) {
        self.core.lock().deferred.push_back(bio);
        self.cv.notify_all();
    }

    /// `map_bio`: remap one data bio (`worker`: called by the worker, which
    /// may do writethrough and passthrough writes itself).
    pub(super) fn map_bio(self: &Arc<Self>, mut bio: Bio, worker: bool) {
        let ob = bio.offset / self.block_bytes;
        if ob >= self.origin_blocks {
            // A partial block at the origin's end is never cached.
            return self.origin.submit(bio);
        }
        let write = bio.op == Op::Write;
        let mut core = self.core.lock();
        if core.cells.holds(ob, write) {
            // Waits for the migration (`bio_detain_shared`).
            match core.cells.wait(ob, write, bio) {
                None => return,
                Some(b) => bio = b,
            }
        }
        let had_work = core.policy.has_work();
        // `optimisable_bio`: a whole-block write may be promoted at once
        // while the cache has free blocks.
        let whole =
            write && bio.offset.is_multiple_of(self.block_bytes) && bio.len == self.block_bytes;
        let hit = core
            .policy
            .lookup(ob, write, whole && self.mode != IoMode::Passthrough);
        if !had_work && core.policy.has_work() {
            self.cv.notify_all();
        }
        let c = &self.counters;
        let tick = self.tick_flag();
        match hit {
            None => {
                if write { &c.write_miss } else { &c.read_miss }.fetch_add(1, Ordering::Relaxed);
                if write {
                    *core.origin_writes.entry(ob).or_insert(0) += 1;
                    clear_discard(&mut core, ob * self.block_bytes, self.discard_bytes);
                }
                drop(core);
                if write || tick != 0 {
                    let kind = if write {
                        KIND_ORIGIN_WRITE | ob
                    } else {
                        KIND_HIT | INDEX_MASK
                    };
                    bio.push_end(self.clone(), kind | tick);
                }
                self.origin.submit(bio);
            }
            Some(cb) => {
                if write { &c.write_hit } else { &c.read_hit }.fetch_add(1, Ordering::Relaxed);
                let to_worker = write
                    && (self.mode == IoMode::Passthrough
                        || (self.mode == IoMode::Writethrough && !core.dirty[cb as usize]));
                if to_worker && !worker {
                    drop(core);
                    self.need_tick.store(true, Ordering::Relaxed);
                    return self.defer(bio);
                }
                if to_worker {
                    // Counted in flight from here, so that a migration of
                    // the block waits for both writes.
                    self.inflight(cb).fetch_add(1, Ordering::AcqRel);
                    drop(core);
                    return self.worker_write_hit(bio, ob, cb);
                }
                if self.mode == IoMode::Passthrough {
                    drop(core);
                    if tick != 0 {
                        bio.push_end(self.clone(), KIND_HIT | INDEX_MASK | tick);
                    }
                    return self.origin.submit(bio);
                }
                if write {
                    core.set_dirty(cb, true);
                    clear_discard(&mut core, ob * self.block_bytes, self.discard_bytes);
                }
                self.inflight(cb).fetch_add(1, Ordering::AcqRel);
                drop(core);
                bio.push_end(self.clone(), KIND_HIT | tick | cb as u64);
                bio.offset = cb as u64 * self.block_bytes + bio.offset % self.block_bytes;
                self.cache.submit(bio);
            }
        }
    }

    /// A write hit in writethrough (origin, then cache) or passthrough
    /// (the block is invalidated, then the write goes to the origin) mode.
    fn worker_write_hit(self: &Arc<Self>, bio: Bio, ob: u64, cb: u32) {
        if self.mode == IoMode::Passthrough {
            self.put_inflight(cb as u64);
            self.lock_block(ob);
            let ok = self.quiesce(ob, cb) && {
                let mut core = self.core.lock();
                core.policy.invalidate(cb)
            };
            if !ok {
                self.unlock_block(ob);
                return self.origin.submit(bio);
            }
            if let Err(e) = self.md.lock().remove(cb) {
                tracing::error!(error = %e, "cache: dm_cache_remove_mapping failed");
                self.unlock_block(ob);
                return bio.complete(Status::IoError);
            }
            self.counters.demotion.fetch_add(1, Ordering::Relaxed);
            // `invalidate_remove`: the block is unlocked and the write
            // sent once the removal is committed.
            let s = self.clone();
            let k = Box::new(move |committed: bool| {
                s.unlock_block(ob);
                if committed {
                    s.origin.submit(bio);
                } else {
                    bio.complete(Status::IoError);
                }
            });
            return self
                .committer
                .continue_after_commit(k, || self.commit_if_changed());
        }
        let mut data = bio.data().to_vec();
        let st = submit_and_wait(&*self.origin, Op::Write, bio.offset, bio.len, &mut data);
        if st != Status::Ok {
            self.put_inflight(cb as u64);
            return bio.complete(st);
        }
        self.map_cache(bio, cb);
    }

    /// Send a write hit already counted in flight to the cache device.
    fn map_cache(self: &Arc<Self>, mut bio: Bio, cb: u32) {
        bio.push_end(self.clone(), KIND_HIT | cb as u64);
        bio.offset = cb as u64 * self.block_bytes + bio.offset % self.block_bytes;
        self.cache.submit(bio);
    }

    /// Commit if the transaction changed (`commit(cache, false)`).
    pub fn commit_if_changed(&self) -> bool {
        let mut md = self.md.lock();
        if !md.changed() {
            return true;
        }
        match md.commit(false) {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, "cache: commit failed");
                false
            }
        }
    }

    /// A flush, FUA write, discard or write-zeroes, on the worker.
    fn process_deferred(self: &Arc<Self>, mut bio: Bio) {
        match bio.op {
            Op::Discard => return self.process_discard(bio),
            Op::WriteZeroes => return bio.complete(Status::NotSupported),
            _ => {}
        }
        let flushes = bio.op == Op::Flush || bio.flags.contains(BioFlags::PREFLUSH);
        let fua = bio.flags.contains(BioFlags::FUA);
        if (flushes || fua) && !self.commit_if_changed() {
            return bio.complete(Status::IoError);
        }
        if flushes {
            for dev in [&self.origin, &self.cache] {
                let st = submit_and_wait_flags(&**dev, Op::Flush, BioFlags::NONE, 0, 0, &mut []);
                if st != Status::Ok {
                    return bio.complete(st);
                }
            }
            if bio.op == Op::Flush {
                return bio.complete(Status::Ok);
            }
            bio.flags.remove(BioFlags::PREFLUSH);
        }
        self.map_bio(bio, true);
    }

    /// `process_discard_bio`: mark the whole discard blocks covered, and
    /// pass the discard to the origin unless `no_discard_passdown`.
    fn process_discard(&self, bio: Bio) {
        {
            let mut core = self.core.lock();
            let b = bio.offset.div_ceil(self.discard_bytes);
            let e = bio.end() / self.discard_bytes;
            for d in b..e {
                if let Some(slot) = core.discarded.get_mut(d as usize) {
                    *slot = true;
                }
            }
        }
        if self.discard_passdown {
            self.origin.submit(bio);
        } else {
            bio.complete(Status::Ok);
        }
    }

    pub(super) fn idle(&self) -> bool {
        let last = self.last_io.load(Ordering::Relaxed);
        coarse_now_ns().saturating_sub(last) >= IDLE_AFTER.as_nanos() as u64
    }

    /// The worker (`do_worker` + `check_migrations` + `do_waker`).
    pub fn run(self: &Arc<Self>) {
        let mut last_commit = Instant::now();
        loop {
            let batch: Vec<Bio> = {
                let mut core = self.core.lock();
                if core.stop && core.deferred.is_empty() {
                    return;
                }
                core.deferred.drain(..).collect()
            };
            for bio in batch {
                self.process_deferred(bio);
            }
            let in_flight = self.start_migrations();
            if last_commit.elapsed() >= COMMIT_PERIOD {
                self.commit_if_changed();
                last_commit = Instant::now();
                let c = &self.counters;
                tracing::trace!(
                    read_hits = c.read_hit.load(Ordering::Relaxed),
                    read_misses = c.read_miss.load(Ordering::Relaxed),
                    promotions = c.promotion.load(Ordering::Relaxed),
                    demotions = c.demotion.load(Ordering::Relaxed),
                    demotion_commits = self.committer.commits(),
                    "cache: counters"
                );
            }
            let mut core = self.core.lock();
            // Go round again at once if a migration ended since (its
            // bandwidth is free) or work came while the lock was free.
            let more = !core.paused
                && self.spare_migration_bandwidth(core.nr_migrations)
                && (core.nr_migrations < in_flight || core.policy.has_work());
            if core.deferred.is_empty() && !core.stop && !more {
                let wait = COMMIT_PERIOD.saturating_sub(last_commit.elapsed());
                self.cv
                    .wait_for(&mut core, wait.max(Duration::from_millis(10)));
            }
        }
    }

    /// Hold off background work and wait for the migrations in flight.
    pub fn pause(&self, paused: bool) {
        let mut core = self.core.lock();
        core.paused = paused;
        let deadline = Instant::now() + QUIESCE_LIMIT;
        while paused
            && (core.nr_migrations != 0 || self.migrating.load(Ordering::SeqCst) != 0)
            && Instant::now() < deadline
        {
            self.cv.wait_for(&mut core, Duration::from_millis(5));
        }
        drop(core);
        self.cv.notify_all();
    }

    /// Stop the worker once the deferred bios are done.
    pub fn stop(&self) {
        self.core.lock().stop = true;
        self.cv.notify_all();
        self.mg_cv.notify_all();
    }

    /// `sync_metadata`: dirty bits, discards, counters and hints, then a
    /// commit that marks a clean shutdown (only if all of it was written).
    pub fn sync_metadata(&self) -> bool {
        let core = self.core.lock();
        let mut md = self.md.lock();
        let c = &self.counters;
        md.set_stats(Stats {
            read_hits: c.read_hit.load(Ordering::Relaxed),
            read_misses: c.read_miss.load(Ordering::Relaxed),
            write_hits: c.write_hit.load(Ordering::Relaxed),
            write_misses: c.write_miss.load(Ordering::Relaxed),
        });
        let hints: Vec<u32> = (0..core.dirty.len() as u32)
            .map(|cb| core.policy.hint(cb))
            .collect();
        let r1 = md.set_dirty_bits(&core.dirty);
        let r2 = md.write_discards(self.discard_bytes / 512, &core.discarded);
        let r3 = md.write_hints(core.policy.name(), super::smq::VERSION, &hints);
        let all = r1.is_ok() && r2.is_ok() && r3.is_ok();
        for e in [r1, r2, r3].into_iter().filter_map(Result::err) {
            tracing::error!(error = %e, "cache: could not write metadata at shutdown");
        }
        match md.commit(all) {
            Ok(()) => all,
            Err(e) => {
                tracing::error!(error = %e, "cache: could not write cache metadata");
                false
            }
        }
    }
}

fn clear_discard(core: &mut Core, pos: u64, discard_bytes: u64) {
    if let Some(slot) = core.discarded.get_mut((pos / discard_bytes) as usize) {
        *slot = false;
    }
}

impl EndIo for Shared {
    /// `cache_end_io`: the bio's block is no longer busy; a tick bio
    /// ticks the policy.
    fn end_io(&self, bio: Bio, status: Status, private: u64) {
        let index = private & INDEX_MASK;
        match private & KIND_MASK {
            KIND_ORIGIN_WRITE => {
                let mut core = self.core.lock();
                if let Some(n) = core.origin_writes.get_mut(&index) {
                    *n -= 1;
                    if *n == 0 {
                        core.origin_writes.remove(&index);
                    }
                }
                if self.migrating.load(Ordering::SeqCst) != 0 {
                    self.cv.notify_all();
                }
            }
            _ => self.put_inflight(index),
        }
        if private & TICK != 0 {
            self.core.lock().policy.tick();
            self.next_tick
                .store(coarse_now_ns() + TICK_EVERY_NS, Ordering::Relaxed);
            self.need_tick.store(true, Ordering::Relaxed);
        }
        bio.complete(status);
    }
}
