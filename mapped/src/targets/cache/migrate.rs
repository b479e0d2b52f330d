//! The cache target's migrations, several in flight at once
//! (`dm-cache-target.c`'s `check_migrations`, `mg_start`,
//! `mg_lock_writes`, `mg_copy`, `mg_upgrade_lock`, `mg_update_metadata`
//! and `mg_complete`).
//!
//! The worker asks the policy for background work while there is spare
//! migration bandwidth, counted as the kernel's
//! `spare_migration_bandwidth` counts it: one more migration may start
//! while `(migrations in flight + 1) * sectors per block` stays within
//! `migration_threshold`. Each migration goes to a bounded pool of
//! migration threads (started as needed, at most [`MAX_MIGRATIONS`]),
//! which copy a block with plain reads and writes of the devices where
//! the kernel hands the copy to kcopyd; the pool is what lets copies to
//! and from slow devices overlap.
//!
//! A migration's steps follow the kernel's:
//! 1. lock the origin block (`cell.rs`) so every new bio to it waits, and
//!    quiesce: wait for the bios already in flight to the cache block and
//!    the origin writes to the block;
//! 2. lower the lock so that reads go on, and copy: origin -> cache for a
//!    promotion, cache -> origin for a writeback or for the demotion of a
//!    block that became dirty after it was queued (`mg_copy`), which so
//!    writes it back before it leaves the cache;
//! 3. raise the lock again and quiesce the reads that ran during the copy
//!    (`mg_upgrade_lock`);
//! 4. update the metadata and commit (a demotion must be committed before
//!    its cache block is reused, `mg_update_metadata`), tell the policy,
//!    clear the dirty bit where the copy made the origin current;
//! 5. unlock: the bios that waited are mapped again, so a write that
//!    waited out a writeback dirties the block anew.
//!
//! Commits are shared: a migration that finds the transaction already
//! committed after its change (by another migration, a flush or the
//! periodic commit) does not commit again, as the kernel's batcher.
//!
//! Differences: `migration_threshold` bounds the migrations in flight
//! (below one block none start); the kernel starts whatever the policy
//! queues and uses the threshold only to tell the policy whether it may
//! clean (`idle`). The copies are not throttled by `kcopyd_throttle`.

use super::cell::Level;
use super::io::Shared;
use super::metadata::{CacheMdError, CacheMetadata};
use super::smq::{Work, WorkOp};
use blkstack_core::sync::submit_and_wait;
use blkstack_core::{AlignedBuf, DeviceRef, Op, Status};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most migrations in flight, and so migration threads, per cache,
/// whatever `migration_threshold` allows.
pub const MAX_MIGRATIONS: u32 = 16;
/// Longest a migration waits for the I/O in flight to its block.
const QUIESCE_LIMIT: Duration = Duration::from_secs(30);

impl Shared {
    /// `spare_migration_bandwidth`: one more migration fits within
    /// `migration_threshold` (and the pool).
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
        let mut started = 0;
        let in_flight = {
            let mut core = self.core.lock();
            while !core.paused && !core.stop && self.spare_migration_bandwidth(core.nr_migrations) {
                let idle = self.idle();
                let Some(w) = core.policy.background_work(idle) else {
                    break;
                };
                core.nr_migrations += 1;
                core.mg_queue.push_back(w);
                started += 1;
            }
            if started == 0 {
                return core.nr_migrations;
            }
            self.mg_cv.notify_all();
            core.nr_migrations
        };
        self.grow_pool();
        in_flight
    }

    /// Start migration threads until there is one per migration in
    /// flight; if none can be started, the worker runs the work itself.
    fn grow_pool(self: &Arc<Self>) {
        let want = self.core.lock().nr_migrations.min(MAX_MIGRATIONS) as usize;
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
                let w = self.core.lock().mg_queue.pop_front();
                let Some(w) = w else { break };
                self.migrate(w);
                self.migration_done();
            }
        }
    }

    /// A pool thread: run queued migrations until the cache stops.
    fn migration_thread(self: Arc<Self>) {
        loop {
            let w = {
                let mut core = self.core.lock();
                loop {
                    if let Some(w) = core.mg_queue.pop_front() {
                        break w;
                    }
                    if core.stop {
                        return;
                    }
                    self.mg_cv.wait_for(&mut core, Duration::from_secs(1));
                }
            };
            self.migrate(w);
            self.migration_done();
        }
    }

    fn migration_done(&self) {
        self.core.lock().nr_migrations -= 1;
        self.cv.notify_all();
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

    /// Copy one block between the devices: `from` at `src` to `to` at `dst`.
    fn copy(&self, from: &DeviceRef, src: u64, to: &DeviceRef, dst: u64) -> Status {
        let mut buf = AlignedBuf::new(self.block_bytes as usize);
        let st = submit_and_wait(&**from, Op::Read, src, self.block_bytes, buf.as_mut_slice());
        if st != Status::Ok {
            return st;
        }
        submit_and_wait(&**to, Op::Write, dst, self.block_bytes, buf.as_mut_slice())
    }

    /// Run one piece of the policy's background work (`mg_start` to
    /// `mg_complete`), on a migration thread.
    pub(super) fn migrate(self: &Arc<Self>, w: Work) {
        self.lock_block(w.oblock);
        let mut ok = self.quiesce(w.oblock, w.cblock);
        // `mg_copy`: a writeback or demotion copies only a dirty block;
        // the lock keeps writes out, so the bit cannot change under it.
        let copy = w.op == WorkOp::Promote || self.core.lock().dirty[w.cblock as usize];
        if ok && copy {
            self.release_reads(w.oblock);
            let (cpos, opos) = (
                w.cblock as u64 * self.block_bytes,
                w.oblock * self.block_bytes,
            );
            let st = if w.op == WorkOp::Promote {
                self.copy(&self.origin, opos, &self.cache, cpos)
            } else {
                self.copy(&self.cache, cpos, &self.origin, opos)
            };
            if st != Status::Ok {
                tracing::error!(?w, ?st, "cache: migration copy failed");
            }
            self.core.lock().cells.upgrade(w.oblock);
            ok = st == Status::Ok && self.quiesce(w.oblock, w.cblock);
        }
        self.update_metadata(w, ok);
        self.unlock_block(w.oblock);
    }

    /// `mg_update_metadata` + `mg_complete`.
    fn update_metadata(&self, w: Work, mut ok: bool) {
        match w.op {
            WorkOp::Promote => {
                ok = ok && self.md_commit(|md| md.insert(w.cblock, w.oblock));
                if ok {
                    self.counters.promotion.fetch_add(1, Ordering::Relaxed);
                }
                self.core.lock().policy.complete(w, ok);
            }
            WorkOp::Demote => {
                ok = ok && self.md_commit(|md| md.remove(w.cblock));
                if ok {
                    self.counters.demotion.fetch_add(1, Ordering::Relaxed);
                }
                let mut core = self.core.lock();
                if ok {
                    core.set_dirty(w.cblock, false);
                }
                core.policy.complete(w, ok);
            }
            WorkOp::Writeback => {
                let mut core = self.core.lock();
                if ok {
                    core.set_dirty(w.cblock, false);
                }
                core.policy.complete(w, ok);
            }
        }
    }

    /// Change the metadata, then commit unless a commit since the change
    /// already carried it.
    fn md_commit(&self, f: impl FnOnce(&mut CacheMetadata) -> Result<(), CacheMdError>) -> bool {
        let r = f(&mut self.md.lock());
        let r = r.and_then(|_| {
            let mut md = self.md.lock();
            if md.changed() {
                md.commit(false)
            } else {
                Ok(())
            }
        });
        match r {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, "cache: metadata operation failed");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::io::{Core, IoMode};
    use super::super::smq::Smq;
    use super::*;
    use crate::Registry;

    const BS: u64 = 64;
    const BLOCK: u64 = BS * 512;

    fn rw(dev: &DeviceRef, op: Op, block: u64, data: &mut [u8]) {
        let st = submit_and_wait(&**dev, op, block * BLOCK, BLOCK, data);
        assert_eq!(st, Status::Ok);
    }

    /// A demotion queued while its block was clean, the block written
    /// (dirty) before the migration starts: the migration writes it back
    /// to the origin first, then drops the mapping (`mg_copy`).
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
        let s = Arc::new(Shared::new(
            Core::new(policy, 4, 16),
            md,
            origin.clone(),
            cdev.clone(),
            BLOCK,
            16,
            BLOCK,
            IoMode::Writeback,
            true,
        ));
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
        s.migrate(w);
        let mut back = vec![0; BLOCK as usize];
        rw(&origin, Op::Read, w.oblock, &mut back);
        assert!(back == data, "the dirty block was not written back");
        let core = s.core.lock();
        assert_eq!(core.policy.peek_mapping(w.oblock), None, "still mapped");
        assert_eq!(core.nr_dirty, 0);
        assert_eq!(s.counters.demotion.load(Ordering::Relaxed), 1);
        drop(core);
        let maps = s.md.lock().load_mappings("smq", 2, 4).unwrap();
        assert_eq!(
            maps.len(),
            3,
            "the committed metadata keeps the other three"
        );
        assert!(maps.iter().all(|m| m.oblock != w.oblock));
    }
}
