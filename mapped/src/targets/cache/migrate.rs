//! The cache target's migrations, several in flight at once
//! (`dm-cache-target.c`'s `check_migrations`, `mg_start`,
//! `mg_lock_writes`, `mg_copy`, `mg_upgrade_lock`, `mg_update_metadata`
//! and `mg_complete`).
//!
//! The worker asks the policy for background work while there is spare
//! migration bandwidth, counted as the kernel's
//! `spare_migration_bandwidth` counts it: one more migration may start
//! while `(migrations in flight + 1) * sectors per block` stays within
//! `migration_threshold`. A migration is a chain of steps, as the
//! kernel's continuations: each step runs on a small pool of migration
//! threads (started as needed, at most [`MAX_THREADS`]) and ends by
//! handing the migration on, so a thread never waits for a copy: the copy
//! is submitted (`copier.rs`, the kernel's kcopyd) and its completion
//! queues the next step.
//!
//! A migration's steps follow the kernel's:
//! 1. lock the origin block (`cell.rs`) so every new bio to it waits, and
//!    quiesce: wait for the bios already in flight to the cache block and
//!    the origin writes to the block;
//! 2. lower the lock so that reads go on, and submit the copy: origin ->
//!    cache for a promotion, cache -> origin for a writeback or for the
//!    demotion of a block that became dirty after it was queued
//!    (`mg_copy`), which so writes it back before it leaves the cache;
//! 3. when the copy ends, raise the lock again and quiesce the reads that
//!    ran during the copy (`mg_upgrade_lock`);
//! 4. update the metadata (`mg_update_metadata`). Only a demotion then
//!    waits for a commit (`batcher.rs`, shared with every other demotion
//!    that reached this step meanwhile): its cache block must not be
//!    reused while the committed metadata still maps it. A promotion's
//!    new mapping and a writeback's cleared dirty bit are committed by the
//!    next flush, FUA write or periodic commit, as in the kernel;
//! 5. `mg_complete`: tell the policy, clear the dirty bit where the copy
//!    made the origin current, unlock: the bios that waited are mapped
//!    again, so a write that waited out a writeback dirties the block anew.
//!
//! Differences: `migration_threshold` bounds the migrations in flight
//! (below one block none start), and so does [`MAX_MIGRATIONS`]; the
//! kernel starts whatever the policy queues and uses the threshold only to
//! tell the policy whether it may clean (`idle`). The copies are not
//! throttled by `kcopyd_throttle`. Quiesces wait on a pool thread (woken
//! by the completions) where the kernel's cell queues the continuation.

use super::cell::Level;
use super::copier::Done;
use super::io::Shared;
use super::smq::{Work, WorkOp};
use blkstack_core::Status;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most migrations in flight per cache, whatever `migration_threshold`
/// allows: each holds one block's copy buffer while its copy runs.
pub const MAX_MIGRATIONS: u32 = 64;
/// Most migration threads per cache. They run the steps between copies
/// (locks, quiesces, metadata), not the copies.
pub const MAX_THREADS: usize = 4;
/// Longest a migration waits for the I/O in flight to its block.
const QUIESCE_LIMIT: Duration = Duration::from_secs(30);

/// The next step of a migration in flight (the kernel's continuation).
pub enum Step {
    /// `mg_start`: lock, quiesce, submit the copy.
    Start(Work),
    /// The copy ended with this status: `mg_upgrade_lock` onwards.
    Copied(Work, Status),
}

impl Shared {
    /// `spare_migration_bandwidth`: one more migration fits within
    /// `migration_threshold` (and [`MAX_MIGRATIONS`]).
    pub(super) fn spare_migration_bandwidth(&self, in_flight: u32) -> bool {
        let volume = (in_flight as u64 + 1) * (self.block_bytes / 512);
        in_flight < MAX_MIGRATIONS && volume <= self.migration_threshold.load(Ordering::Relaxed)
    }

    /// Wake the worker: the bound changed (`migration_threshold`).
    pub fn wake(&self) {
        self.cv.notify_all();
    }

    /// `check_migrations`: hand the policy's background work to the pool
    /// while there is bandwidth for it; the migrations then in flight.
    /// Called by the worker.
    pub(super) fn start_migrations(self: &Arc<Self>) -> u32 {
        let (in_flight, queued) = {
            let mut core = self.core.lock();
            let mut started = 0;
            while !core.paused && !core.stop && self.spare_migration_bandwidth(core.nr_migrations) {
                let idle = self.idle();
                let Some(w) = core.policy.background_work(idle) else {
                    break;
                };
                core.nr_migrations += 1;
                core.mg_queue.push_back(Step::Start(w));
                started += 1;
            }
            if started > 0 {
                self.mg_cv.notify_all();
            }
            (core.nr_migrations, !core.mg_queue.is_empty())
        };
        if queued {
            self.grow_pool();
        }
        in_flight
    }

    /// Queue a migration's next step for the pool (from a completion:
    /// never blocks).
    fn queue_step(&self, step: Step) {
        self.core.lock().mg_queue.push_back(step);
        self.mg_cv.notify_one();
        // The worker runs the steps itself if it has no pool.
        if self.pool.lock().is_empty() {
            self.cv.notify_all();
        }
    }

    /// Start migration threads until there is one per migration in
    /// flight, up to [`MAX_THREADS`]; if none can be started, the worker
    /// runs the queued steps itself.
    pub(super) fn grow_pool(self: &Arc<Self>) {
        let want = (self.core.lock().nr_migrations as usize).min(MAX_THREADS);
        let mut pool = self.pool.lock();
        while pool.len() < want {
            let s = self.clone();
            match std::thread::Builder::new()
                .name("cache-migrate".into())
                .spawn(move || s.migration_thread())
            {
                Ok(h) => pool.push(h),
                Err(e) => {
                    tracing::error!(error = %e, "cache: could not start a migration thread");
                    break;
                }
            }
        }
        if pool.is_empty() {
            drop(pool);
            loop {
                let step = self.core.lock().mg_queue.pop_front();
                let Some(step) = step else { break };
                self.run_step(step);
            }
        }
    }

    /// A pool thread: run queued steps until the cache stops and no
    /// migration is left in flight (a copy still running comes back as a
    /// step).
    fn migration_thread(self: Arc<Self>) {
        loop {
            let step = {
                let mut core = self.core.lock();
                loop {
                    if let Some(step) = core.mg_queue.pop_front() {
                        break step;
                    }
                    if core.stop && core.nr_migrations == 0 {
                        return;
                    }
                    self.mg_cv.wait_for(&mut core, Duration::from_secs(1));
                }
            };
            self.run_step(step);
        }
    }

    fn run_step(self: &Arc<Self>, step: Step) {
        match step {
            Step::Start(w) => self.mg_start(w),
            Step::Copied(w, st) => self.mg_copied(w, st),
        }
    }

    /// Wait for the migration threads to end (after [`Shared::stop`]).
    pub fn join_pool(&self) {
        self.mg_cv.notify_all();
        let threads: Vec<_> = self.pool.lock().drain(..).collect();
        for t in threads {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }

    /// Lock origin block `ob` at [`Level::All`], waiting while another
    /// holder has it.
    pub(super) fn lock_block(&self, ob: u64) {
        let mut core = self.core.lock();
        while !core.cells.lock(ob, Level::All) {
            self.cv.wait_for(&mut core, Duration::from_millis(5));
        }
        self.migrating.fetch_add(1, Ordering::SeqCst);
    }

    /// Unlock `ob` and map the bios that waited for it again.
    pub(super) fn unlock_block(self: &Arc<Self>, ob: u64) {
        let waiting = {
            let mut core = self.core.lock();
            self.migrating.fetch_sub(1, Ordering::SeqCst);
            core.cells.unlock(ob)
        };
        self.cv.notify_all();
        for bio in waiting {
            self.map_bio(bio, false);
        }
    }

    /// Lower `ob`'s lock to writes only and send the reads that waited.
    fn release_reads(self: &Arc<Self>, ob: u64) {
        let reads = self.core.lock().cells.downgrade(ob);
        for bio in reads {
            self.map_bio(bio, false);
        }
    }

    /// Wait until no bio is in flight to cache block `cb` nor writing
    /// origin block `ob`; false if that took longer than [`QUIESCE_LIMIT`].
    pub(super) fn quiesce(&self, ob: u64, cb: u32) -> bool {
        let deadline = Instant::now() + QUIESCE_LIMIT;
        let mut core = self.core.lock();
        loop {
            let busy = self.inflight(cb).load(Ordering::SeqCst) != 0
                || core.origin_writes.get(&ob).is_some_and(|&n| n > 0);
            if !busy {
                return true;
            }
            if Instant::now() >= deadline {
                tracing::error!(
                    oblock = ob,
                    cblock = cb,
                    "cache: I/O to a migrating block did not drain"
                );
                return false;
            }
            self.cv.wait_for(&mut core, Duration::from_millis(5));
        }
    }

    /// `mg_start` + `mg_lock_writes` + `mg_copy`: lock and quiesce the
    /// block, then submit the copy, whose completion queues
    /// [`Step::Copied`]; with nothing to copy, straight on to the metadata.
    fn mg_start(self: &Arc<Self>, w: Work) {
        self.lock_block(w.oblock);
        let ok = self.quiesce(w.oblock, w.cblock);
        // `mg_copy`: a writeback or demotion copies only a dirty block;
        // the lock keeps writes out, so the bit cannot change under it.
        let copy = w.op == WorkOp::Promote || self.core.lock().dirty[w.cblock as usize];
        if !(ok && copy) {
            return self.update_metadata(w, ok);
        }
        self.release_reads(w.oblock);
        let (cpos, opos) = (
            w.cblock as u64 * self.block_bytes,
            w.oblock * self.block_bytes,
        );
        let s = self.clone();
        let done: Done = Box::new(move |st| s.queue_step(Step::Copied(w, st)));
        if w.op == WorkOp::Promote {
            self.copier.copy(
                &self.origin,
                opos,
                self.cache.clone(),
                cpos,
                self.block_bytes,
                done,
            );
        } else {
            self.copier.copy(
                &self.cache,
                cpos,
                self.origin.clone(),
                opos,
                self.block_bytes,
                done,
            );
        }
    }

    /// `mg_upgrade_lock`: the copy ended; lock reads out again and wait
    /// for those that ran during it.
    fn mg_copied(self: &Arc<Self>, w: Work, st: Status) {
        if st != Status::Ok {
            tracing::error!(?w, ?st, "cache: migration copy failed");
        }
        self.core.lock().cells.upgrade(w.oblock);
        let ok = st == Status::Ok && self.quiesce(w.oblock, w.cblock);
        self.update_metadata(w, ok);
    }

    /// `mg_update_metadata`: a demotion goes on after the next commit
    /// (see the module doc), the others at once.
    fn update_metadata(self: &Arc<Self>, w: Work, ok: bool) {
        if !ok {
            return self.mg_complete(w, false);
        }
        let r = match w.op {
            WorkOp::Promote => self.md.lock().insert(w.cblock, w.oblock),
            WorkOp::Demote => self.md.lock().remove(w.cblock),
            WorkOp::Writeback => Ok(()),
        };
        if let Err(e) = r {
            tracing::error!(error = %e, ?w, "cache: migration failed; couldn't update metadata");
            return self.mg_complete(w, false);
        }
        if w.op != WorkOp::Demote {
            return self.mg_complete(w, true);
        }
        let s = self.clone();
        self.committer.continue_after_commit(
            Box::new(move |committed| s.mg_complete(w, committed)),
            || self.commit_if_changed(),
        );
    }

    /// `mg_complete`: count it, tell the policy, clear the dirty bit the
    /// copy made stale, unlock the block; the migration is over.
    fn mg_complete(self: &Arc<Self>, w: Work, ok: bool) {
        if ok {
            let c = &self.counters;
            match w.op {
                WorkOp::Promote => c.promotion.fetch_add(1, Ordering::Relaxed),
                WorkOp::Demote => c.demotion.fetch_add(1, Ordering::Relaxed),
                WorkOp::Writeback => 0,
            };
        }
        {
            let mut core = self.core.lock();
            if ok && w.op != WorkOp::Promote {
                core.set_dirty(w.cblock, false);
            }
            core.policy.complete(w, ok);
        }
        self.unlock_block(w.oblock);
        self.core.lock().nr_migrations -= 1;
        self.cv.notify_all();
        self.mg_cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::super::io::{Core, IoMode};
    use super::super::metadata::CacheMetadata;
    use super::super::smq::Smq;
    use super::*;
    use crate::Registry;
    use blkstack_core::sync::submit_and_wait;
    use blkstack_core::{DeviceRef, Op};

    const BS: u64 = 64;
    const BLOCK: u64 = BS * 512;

    fn rw(dev: &DeviceRef, op: Op, block: u64, data: &mut [u8]) {
        let st = submit_and_wait(&**dev, op, block * BLOCK, BLOCK, data);
        assert_eq!(st, Status::Ok);
    }

    /// Poll until `done`, for at most a minute; panics naming `what`.
    fn until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done() {
            assert!(Instant::now() < deadline, "timed out: {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Run one migration through the pool to its end.
    fn run_to_end(s: &Arc<Shared>, w: Work) {
        {
            let mut core = s.core.lock();
            core.nr_migrations += 1;
            core.mg_queue.push_back(Step::Start(w));
        }
        s.grow_pool();
        until("the migration", || s.core.lock().nr_migrations == 0);
    }

    fn shared(md: CacheMetadata, policy: Smq, origin: DeviceRef, cdev: DeviceRef) -> Arc<Shared> {
        let cblocks = (cdev.size() / BLOCK) as u32;
        let oblocks = origin.size() / BLOCK;
        Arc::new(Shared::new(
            Core::new(policy, cblocks, oblocks),
            md,
            origin,
            cdev,
            BLOCK,
            oblocks,
            BLOCK,
            IoMode::Writeback,
            true,
        ))
    }

    /// A demotion queued while its block was clean, the block written
    /// (dirty) before the migration starts: the migration writes it back
    /// to the origin first, then drops the mapping (`mg_copy`) and commits
    /// before it ends.
    #[test]
    fn a_cache_demotion_of_a_block_dirtied_meanwhile_writes_it_back_first() {
        let reg = Registry::new();
        reg.create("meta", "0 8192 memory").unwrap();
        reg.create("cdev", &format!("0 {} memory", 4 * BS)).unwrap();
        reg.create("origin", &format!("0 {} memory", 16 * BS))
            .unwrap();
        let dev = |n: &str| reg.device(n).unwrap();
        let (origin, cdev) = (dev("origin"), dev("cdev"));
        // A full cache of four clean blocks holding origin blocks 0..4.
        let mut md = CacheMetadata::open(dev("meta"), BS as u32, 2).unwrap();
        md.resize(4).unwrap();
        let mut policy = Smq::create("smq", 4, 16 * BS, BS).unwrap();
        for b in 0..4 {
            md.insert(b, b as u64).unwrap();
            policy.load_mapping(b as u64, b, false, None);
        }
        md.commit(false).unwrap();
        let s = shared(md, policy, origin.clone(), cdev.clone());
        // Misses on block 9 until smq wants it promoted: the cache is
        // full, so it queues a demotion instead.
        let mut rounds = 0;
        while !s.core.lock().policy.has_work() {
            let mut core = s.core.lock();
            assert_eq!(core.policy.lookup(9, false, false), None);
            core.policy.tick();
            rounds += 1;
            assert!(rounds < 100_000, "smq never asked for a demotion");
        }
        let w = s.core.lock().policy.background_work(false).unwrap();
        assert_eq!(w.op, WorkOp::Demote, "{w:?}");
        // The block written in the cache meanwhile (a write hit).
        let mut data = vec![0xd5; BLOCK as usize];
        rw(&cdev, Op::Write, w.cblock as u64, &mut data);
        s.core.lock().set_dirty(w.cblock, true);
        run_to_end(&s, w);
        s.stop();
        s.join_pool();
        let mut back = vec![0; BLOCK as usize];
        rw(&origin, Op::Read, w.oblock, &mut back);
        assert!(back == data, "the dirty block was not written back");
        let core = s.core.lock();
        assert_eq!(core.policy.peek_mapping(w.oblock), None, "still mapped");
        assert_eq!(core.nr_dirty, 0);
        assert_eq!(s.counters.demotion.load(Ordering::Relaxed), 1);
        drop(core);
        assert_eq!(s.committer.commits(), 1, "the demotion waited for a commit");
        assert!(!s.md.lock().changed(), "and it was committed");
        let maps = s.md.lock().load_mappings("smq", 2, 4).unwrap();
        assert_eq!(
            maps.len(),
            3,
            "the committed metadata keeps the other three"
        );
        assert!(maps.iter().all(|m| m.oblock != w.oblock));
    }

    /// Eight promotions at once over an origin whose reads are held (its
    /// device suspended): all eight copies are in flight together on at
    /// most [`MAX_THREADS`] threads, so no thread waits per copy. Once the
    /// origin resumes they complete without a commit of their own (the
    /// kernel commits a promotion with the next flush or periodic commit);
    /// one commit then carries all eight mappings, and each cache block
    /// holds its origin block's data.
    #[test]
    fn promotions_copy_asynchronously_and_share_one_later_commit() {
        const N: u64 = 8;
        let reg = Registry::new();
        reg.create("meta", "0 8192 memory").unwrap();
        reg.create("cdev", &format!("0 {} memory", 16 * BS))
            .unwrap();
        reg.create("slowmem", &format!("0 {} memory", 64 * BS))
            .unwrap();
        reg.create("origin", &format!("0 {} linear slowmem 0", 64 * BS))
            .unwrap();
        let dev = |n: &str| reg.device(n).unwrap();
        let (origin, cdev) = (dev("origin"), dev("cdev"));
        for b in 0..N {
            let mut data = vec![b as u8 + 1; BLOCK as usize];
            rw(&origin, Op::Write, b, &mut data);
        }
        let mut md = CacheMetadata::open(dev("meta"), BS as u32, 2).unwrap();
        md.resize(16).unwrap();
        md.commit(false).unwrap();
        let policy = Smq::create("smq", 16, 64 * BS, BS).unwrap();
        let s = shared(md, policy, origin.clone(), cdev.clone());
        s.migration_threshold.store(1 << 20, Ordering::Relaxed);
        // Whole-block write misses: smq promotes each at once while it
        // has free blocks.
        for b in 0..N {
            assert_eq!(s.core.lock().policy.lookup(b, true, true), None);
        }
        let commits = s.md.lock().commits();
        reg.suspend("slowmem").unwrap();
        assert_eq!(s.start_migrations(), N as u32);
        until("every copy in flight", || {
            s.copier.in_flight() == N as usize
        });
        assert!(s.pool.lock().len() <= MAX_THREADS);
        assert_eq!(s.counters.promotion.load(Ordering::Relaxed), 0);
        reg.resume("slowmem").unwrap();
        until("the promotions", || s.core.lock().nr_migrations == 0);
        s.stop();
        s.join_pool();
        assert_eq!(s.counters.promotion.load(Ordering::Relaxed), N as u32);
        assert_eq!(s.md.lock().commits(), commits, "a promotion committed");
        assert_eq!(s.committer.commits(), 0);
        assert!(s.commit_if_changed());
        assert_eq!(s.md.lock().commits(), commits + 1);
        let mut maps = s.md.lock().load_mappings("smq", 2, 4).unwrap();
        maps.sort_by_key(|m| m.oblock);
        assert_eq!(maps.len(), N as usize, "one commit carries all eight");
        for (b, m) in maps.iter().enumerate() {
            assert_eq!(m.oblock, b as u64);
            assert_eq!(s.core.lock().policy.peek_mapping(m.oblock), Some(m.cblock));
            let mut got = vec![0; BLOCK as usize];
            rw(&cdev, Op::Read, m.cblock as u64, &mut got);
            assert!(got.iter().all(|&x| x == b as u8 + 1), "block {b}");
        }
    }
}
