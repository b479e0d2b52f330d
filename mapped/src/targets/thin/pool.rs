//! A running pool (`dm-thin.c` `struct pool`): its metadata, mode and
//! features, the cells of virtual blocks being provisioned (the kernel's
//! bio prison), the bios held while the pool is out of data space, and
//! the worker that commits (on FLUSH, on FUA, every second as the
//! kernel's `COMMIT_PERIOD`) and finishes provisioning after the data
//! write completes.
//!
//! A new mapping enters the metadata only once its data is written (as
//! `process_prepared_mapping`), so a commit never points at a block whose
//! data was not written first; the data device is flushed before each
//! commit, so everything a committed mapping points to is durable.

use super::deferred::{DeferredSet, Work};
use super::metadata::{MetadataError, PoolMetadata};
pub use super::mode::{Mode, PoolFeatures};
use super::params::no_space_timeout_secs;
use crate::target::{DevArg, Events};
use blkstack_core::sync::submit_and_wait;
use blkstack_core::{clock, Bio, EndIo, Op, Status, SECTOR_SIZE};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// `COMMIT_PERIOD`: the longest a change waits for a commit.
const COMMIT_PERIOD_NS: u64 = 1_000_000_000;
/// Bios held for data space at most (beyond this they fail at once).
const MAX_HELD: usize = 65536;
/// Free metadata blocks below which a provisioning insert is left to the
/// worker: more than the shadows and splits of two paths down can take.
const INLINE_METADATA_RESERVE: u64 = 64;

/// A thin device as the pool sees it: what its bios are mapped by again
/// when they waited (for a block being provisioned, for space, for a
/// commit before a PREFLUSH write).
pub trait ThinDev: Send + Sync {
    /// The thin device's id in the pool metadata.
    fn dev_id(&self) -> u64;
    /// Map a bio as it came from the device above.
    fn map(self: Arc<Self>, bio: Bio);
    /// Map a read or write again that already went through `map`.
    fn map_io(self: Arc<Self>, bio: Bio);
}

/// Bios waiting for a virtual block being provisioned.
type Waiters = Vec<(Bio, Arc<dyn ThinDev>)>;

/// A provisioning write in flight: where its data goes.
pub(super) struct Pending {
    thin: Arc<dyn ThinDev>,
    vblock: u64,
    block: u64,
    /// The metadata generation it was allocated in (an abort starts a new
    /// one, whose space map never saw the block).
    generation: u64,
    /// No read of the shared block it replaces, counted before it, is
    /// in flight any more (`m->quiesced` of `shared_read_ds`).
    pub(super) quiesced: bool,
    /// Its write, done before it was quiesced: mapped once it is.
    pub(super) done: Option<(Bio, Status)>,
}

/// The pool's mutable state under one lock (kernel `struct pool`'s
/// fields that the worker and the map paths share).
pub struct PoolState {
    /// The metadata: mappings, device details, space maps.
    pub md: PoolMetadata,
    /// The current pool mode.
    pub mode: Mode,
    /// The features in force now (the requested ones, changed by the mode).
    pub pf: PoolFeatures,
    /// Free data blocks below which the pool raises an event once
    /// (the table's `low_water_mark`).
    pub low_water_blocks: u64,
    low_water_triggered: bool,
    /// The free metadata blocks were at or under the threshold when last
    /// looked at (`struct threshold`'s edge, dm-space-map-metadata.c).
    metadata_low: bool,
    /// The table's features as asked for (`pt->requested_pf`), which the
    /// pool returns to when it leaves out-of-data-space.
    pub requested_pf: PoolFeatures,
    /// When the pool went out of data space (the no-space timeout's start).
    out_of_space_since: u64,
    /// The owning device's events, raised on low water and mode changes.
    pub events: Events,
    /// Virtual blocks being provisioned, with the bios that wait for them.
    pub(super) cells: HashMap<(u64, u64), Waiters>,
    pub(super) pending: HashMap<u64, Pending>,
    next_id: u64,
    generation: u64,
    /// Bios waiting for data space, with when they started waiting.
    no_space: Vec<(Bio, Arc<dyn ThinDev>, u64)>,
    /// Thin devices with a live target, and how many.
    pub open_thins: HashMap<u64, usize>,
    /// Data blocks a discard unmapped and holds until the I/O before it
    /// and its passdown are done, by id, with the metadata generation
    /// (they are committed as free: a crash finds them unmapped).
    pub(super) discard_holds: HashMap<u64, (Vec<u64>, u64)>,
}

impl PoolState {
    /// An id for a provisioning or a discard.
    pub(super) fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    /// Queue `bio` behind a virtual block of `dev` in `begin..end` being
    /// provisioned, to be mapped again when it is; gives `bio` back when
    /// none is.
    pub(super) fn wait_behind_provisioning(
        &mut self,
        dev: u64,
        begin: u64,
        end: u64,
        bio: Bio,
        thin: &Arc<dyn ThinDev>,
    ) -> Option<Bio> {
        let cell = if (end - begin) as usize > self.cells.len() {
            self.cells
                .keys()
                .find(|(d, v)| *d == dev && (begin..end).contains(v))
                .copied()
        } else {
            (begin..end)
                .map(|v| (dev, v))
                .find(|k| self.cells.contains_key(k))
        };
        match cell.and_then(|c| self.cells.get_mut(&c)) {
            Some(waiters) => {
                waiters.push((bio, thin.clone()));
                None
            }
            None => Some(bio),
        }
    }
}

pub(super) enum Job {
    Flush(Bio),
    Preflush(Bio, Arc<dyn ThinDev>),
    Fua(Bio, Status),
    Provisioned(Bio, Status, u64),
    Remap(Bio, Arc<dyn ThinDev>),
    Quiesced(u64),
    Run(Work),
}

#[derive(Default)]
struct Jobs {
    queue: Vec<Job>,
    stop: bool,
}

/// What a pool's targets and its worker share (kernel `struct pool`
/// with its `pool_c` devices).
pub struct PoolShared {
    /// The metadata device.
    pub metadata_dev: DevArg,
    /// The data device.
    pub data_dev: DevArg,
    /// Data block size in sectors.
    pub block_sectors: u64,
    /// The state the map paths and the worker change, under its lock.
    pub state: Mutex<PoolState>,
    /// Reads and writes in flight to data blocks (`all_io_ds`).
    pub all_io: Arc<DeferredSet>,
    /// Reads in flight of shared data blocks (`shared_read_ds`, see
    /// `deferred.rs`).
    pub(super) shared_reads: Arc<DeferredSet>,
    pub(super) me: Weak<PoolShared>,
    jobs: Mutex<Jobs>,
    cv: Condvar,
}

/// What a bio needs from the pool to be mapped.
pub enum Prepared {
    /// Remap to this data block.
    Mapped(u64),
    /// Unmapped: reads see zeroes (or the external origin).
    Unmapped,
    /// Waiting behind a block being provisioned, or for space: taken.
    Queued,
    /// A new block to write to (after copying `copy_from`, if any).
    Provision {
        /// The data block allocated for it.
        block: u64,
        /// The thin device whose mapping it becomes.
        id: u64,
        /// The shared data block to copy first (breaking sharing after a
        /// snapshot, or from an external origin), if any.
        copy_from: Option<u64>,
        /// The pool zeroes new blocks (no `skip_block_zeroing`).
        zero: bool,
    },
    /// The pool cannot map it (failed or read-only pool, out of space with
    /// `error_if_no_space`): complete it with this status.
    Fail(Status),
}

impl PoolShared {
    /// The shared part of a new pool over the opened metadata `md`: in
    /// [`Mode::Write`], or read-only when `pf` asks or the metadata needs
    /// a check; no worker yet (see [`Pool::start`]).
    pub fn new(
        metadata_dev: DevArg,
        data_dev: DevArg,
        block_sectors: u64,
        md: PoolMetadata,
        pf: PoolFeatures,
        low_water_blocks: u64,
    ) -> Arc<PoolShared> {
        // `set_pool_mode`: metadata flagged `needs_check` keeps the pool
        // read-only until thin_check/thin_repair clear the flag.
        let mode = if pf.read_only {
            Mode::ReadOnly
        } else if md.needs_check() {
            tracing::error!(pool = %data_dev.name, "thin-pool: unable to switch pool to write mode until repaired.");
            Mode::ReadOnly
        } else {
            Mode::Write
        };
        Arc::new_cyclic(|me| PoolShared {
            metadata_dev,
            data_dev,
            block_sectors,
            state: Mutex::new(PoolState {
                md,
                mode,
                pf,
                low_water_blocks,
                low_water_triggered: false,
                metadata_low: false,
                requested_pf: pf,
                out_of_space_since: 0,
                events: Events::default(),
                cells: HashMap::new(),
                pending: HashMap::new(),
                next_id: 1,
                generation: 0,
                no_space: Vec::new(),
                open_thins: HashMap::new(),
                discard_holds: HashMap::new(),
            }),
            all_io: Arc::new(DeferredSet::default()),
            shared_reads: Arc::new(DeferredSet::default()),
            me: me.clone(),
            jobs: Mutex::new(Jobs::default()),
            cv: Condvar::new(),
        })
    }

    /// Data block size in bytes.
    pub fn block_bytes(&self) -> u64 {
        self.block_sectors * SECTOR_SIZE
    }

    pub(super) fn push(&self, job: Job) {
        self.jobs.lock().queue.push(job);
        self.cv.notify_one();
    }

    /// Have the worker commit the metadata, then complete `bio`, an empty
    /// flush, with the commit's status (dm-thin's deferred flush).
    pub fn defer_flush(&self, bio: Bio) {
        self.push(Job::Flush(bio));
    }

    /// Have the worker commit the metadata, then map `bio`, a write with
    /// PREFLUSH, through `thin` (dm-thin's commit before REQ_PREFLUSH).
    pub fn defer_preflush(&self, bio: Bio, thin: Arc<dyn ThinDev>) {
        self.push(Job::Preflush(bio, thin));
    }

    /// Have the worker map `bio`, a read or write, through `thin` again
    /// ([`ThinDev::map_io`]), off the submitter's thread (kernel
    /// `thin_defer_bio`).
    pub fn defer_remap(&self, bio: Bio, thin: Arc<dyn ThinDev>) {
        self.push(Job::Remap(bio, thin));
    }

    /// Run `work` on the pool's worker.
    pub fn defer_work(&self, work: Work) {
        self.push(Job::Run(work));
    }

    /// Look `vblock` up for a bio and decide what it needs; `write` bios
    /// that find no unshared block get a new one (or wait, or fail).
    pub fn prepare(
        &self,
        thin: &dyn Fn() -> Arc<dyn ThinDev>,
        dev_id: u64,
        vblock: u64,
        mut bio: Bio,
        write: bool,
    ) -> (Prepared, Option<Bio>) {
        let mut st = self.state.lock();
        if st.mode == Mode::Fail {
            return (Prepared::Fail(Status::IoError), Some(bio));
        }
        let key = (dev_id, vblock);
        if let Some(waiters) = st.cells.get_mut(&key) {
            waiters.push((bio, thin()));
            return (Prepared::Queued, None);
        }
        let found = match st.md.find_block(dev_id, vblock) {
            Ok(f) => f,
            Err(e) => {
                self.metadata_failed(&mut st, "find_block", &e);
                return (Prepared::Fail(Status::IoError), Some(bio));
            }
        };
        match found {
            Some(l) if !write || !l.shared => {
                if l.shared {
                    // `process_shared_bio`: counted under the lock, so a
                    // write breaking the sharing after it waits for it.
                    let e = self.shared_reads.enter();
                    self.shared_reads.track(&mut bio, e);
                }
                return (Prepared::Mapped(l.data_block), Some(bio));
            }
            None if !write => return (Prepared::Unmapped, Some(bio)),
            _ => {}
        }
        self.check_for_metadata_space(&mut st);
        if st.mode.is_read_only() {
            return (Prepared::Fail(Status::IoError), Some(bio));
        }
        let Some(block) = st.md.alloc_data_block() else {
            return self.out_of_data_space(&mut st, bio, thin());
        };
        self.check_low_water(&mut st);
        st.cells.insert(key, Vec::new());
        let id = st.next_id;
        st.next_id += 1;
        let generation = st.generation;
        st.pending.insert(
            id,
            Pending {
                thin: thin(),
                vblock,
                block,
                generation,
                quiesced: true,
                done: None,
            },
        );
        if found.as_ref().is_some_and(|l| l.shared) && self.shared_reads.in_flight() > 0 {
            self.wait_for_shared_reads(&mut st, id);
        }
        let copy_from = found.map(|l| l.data_block);
        (
            Prepared::Provision {
                block,
                id,
                copy_from,
                zero: st.pf.zero_new_blocks,
            },
            Some(bio),
        )
    }

    /// `handle_unserviceable_bio` / `retry_on_resume` for a bio that
    /// found no free data block.
    fn out_of_data_space(
        &self,
        st: &mut PoolState,
        bio: Bio,
        thin: Arc<dyn ThinDev>,
    ) -> (Prepared, Option<Bio>) {
        if st.mode == Mode::Write {
            tracing::warn!(pool = %self.data_dev.name, "thin-pool: switching pool to out-of-data-space mode");
            st.mode = Mode::OutOfDataSpace;
            st.out_of_space_since = clock::now_ns();
            st.events.raise();
        }
        if st.pf.error_if_no_space || st.no_space.len() >= MAX_HELD {
            return (Prepared::Fail(Status::NoSpace), Some(bio));
        }
        st.no_space.push((bio, thin, clock::now_ns()));
        (Prepared::Queued, None)
    }

    /// `check_for_metadata_space`: the metadata reserve is for finishing
    /// what is in flight and for the user's repair, not for new blocks.
    fn check_for_metadata_space(&self, st: &mut PoolState) {
        if st.md.metadata_free() == 0 && matches!(st.mode, Mode::Write | Mode::OutOfDataSpace) {
            tracing::error!(pool = %self.data_dev.name, "thin-pool: switching pool to out-of-metadata-space (read-only) mode");
            st.mode = Mode::OutOfMetadataSpace;
            st.events.raise();
        }
    }

    /// `check_low_water_mark`.
    fn check_low_water(&self, st: &mut PoolState) {
        if st.md.data_free() <= st.low_water_blocks && !st.low_water_triggered {
            tracing::warn!(pool = %self.data_dev.name, "thin-pool: reached low water mark for data device: sending event.");
            st.low_water_triggered = true;
            st.events.raise();
        }
    }

    /// `metadata_low_callback`: an event when the free metadata blocks
    /// fall to the threshold the status shows (a quarter of the device,
    /// at most 1024 blocks), once until they rise above it again.
    pub(super) fn check_metadata_low_water(&self, st: &mut PoolState) {
        let total = st.md.metadata_blocks().1;
        let low = st.md.metadata_raw_free() <= (total / 4).min(1024);
        if low && !st.metadata_low {
            tracing::warn!(pool = %self.data_dev.name, "thin-pool: reached low water mark for metadata device: sending event.");
            st.events.raise();
        }
        st.metadata_low = low;
    }

    /// `check_for_data_space`: a pool out of data space that has free
    /// blocks again (a discard freed some) writes again.
    fn check_for_data_space(&self, st: &mut PoolState) {
        if st.mode != Mode::OutOfDataSpace || st.md.data_free() == 0 {
            return;
        }
        st.mode = Mode::Write;
        st.pf.error_if_no_space = st.requested_pf.error_if_no_space;
        st.events.raise();
        for (bio, thin, _) in std::mem::take(&mut st.no_space) {
            self.push(Job::Remap(bio, thin));
        }
    }

    /// `metadata_operation_failed`: abort the transaction, mark the
    /// metadata as needing a check, and go read-only (or fail).
    pub fn metadata_failed(&self, st: &mut PoolState, op: &str, e: &MetadataError) {
        tracing::error!(pool = %self.data_dev.name, "thin-pool: metadata operation '{op}' failed: {e}");
        if matches!(st.mode, Mode::Fail) {
            return;
        }
        let data_blocks = st.md.data_blocks().1;
        match PoolMetadata::open(
            self.metadata_dev.clone(),
            data_blocks,
            st.md.data_block_size(),
        ) {
            Ok(mut md) => {
                if let Err(e) = md.set_needs_check() {
                    tracing::error!("thin-pool: failed to set 'needs_check' flag in metadata: {e}");
                    st.mode = Mode::Fail;
                } else {
                    st.mode = Mode::ReadOnly;
                }
                st.md = md;
            }
            Err(e) => {
                tracing::error!("thin-pool: failed to abort metadata transaction: {e}");
                st.mode = Mode::Fail;
            }
        }
        st.generation += 1;
        st.events.raise();
    }

    /// Flush the data device, then commit the metadata (`commit`), with
    /// blocks still being written left out of the space map.
    pub fn commit(&self, st: &mut PoolState) -> Status {
        match st.mode {
            Mode::Fail => return Status::IoError,
            Mode::ReadOnly => return Status::Ok,
            Mode::Write | Mode::OutOfDataSpace | Mode::OutOfMetadataSpace => {}
        }
        let flushed = submit_and_wait(&*self.data_dev.dev, Op::Flush, 0, 0, &mut []);
        if !flushed.is_ok() {
            return flushed;
        }
        if !st.md.is_dirty() {
            return Status::Ok;
        }
        let in_flight: Vec<u64> = st
            .pending
            .values()
            .filter(|p| p.generation == st.generation)
            .map(|p| p.block)
            .chain(
                st.discard_holds
                    .values()
                    .filter(|h| h.1 == st.generation)
                    .flat_map(|h| h.0.iter().copied()),
            )
            .collect();
        let r = st.md.commit_without(&in_flight);
        match r {
            Ok(()) => {
                self.check_metadata_low_water(st);
                self.check_for_metadata_space(st);
                self.check_for_data_space(st);
                Status::Ok
            }
            Err(e) => {
                self.metadata_failed(st, "commit", &e);
                Status::IoError
            }
        }
    }

    /// Grow the data space map to `nr_blocks` and requeue the bios that
    /// waited for space (`maybe_resize_data_dev` on resume).
    pub fn resize(&self, nr_blocks: u64) {
        let held = {
            let mut st = self.state.lock();
            st.low_water_triggered = false;
            if let Err(e) = st.md.resize_data(nr_blocks) {
                tracing::error!(pool = %self.data_dev.name, "thin-pool: resize failed: {e}");
                return;
            }
            if st.mode == Mode::OutOfDataSpace && st.md.data_free() > 0 {
                st.mode = Mode::Write;
                st.pf.error_if_no_space = st.requested_pf.error_if_no_space;
                st.events.raise();
            }
            let _ = self.commit(&mut st);
            std::mem::take(&mut st.no_space)
        };
        for (bio, thin, _) in held {
            self.push(Job::Remap(bio, thin));
        }
    }

    /// Wait (a bounded while) for thin device `dev` to have no live
    /// target: a removed device's table goes with the last reference to
    /// it, which a completion finishing on another thread may hold for a
    /// moment after the remove returned.
    pub fn wait_closed(&self, dev: u64) {
        let deadline = clock::now_ns() + 1_000_000_000;
        while self.state.lock().open_thins.contains_key(&dev) && clock::now_ns() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The worker's loop; returns when told to stop (after a last commit).
    pub fn run(self: &Arc<Self>) {
        let mut next_commit = clock::now_ns() + COMMIT_PERIOD_NS;
        loop {
            let (jobs, stop) = {
                let mut j = self.jobs.lock();
                if j.queue.is_empty() && !j.stop {
                    let wait = next_commit.saturating_sub(clock::now_ns()).max(1_000_000);
                    self.cv.wait_for(&mut j, Duration::from_nanos(wait));
                }
                (std::mem::take(&mut j.queue), j.stop)
            };
            for job in jobs {
                self.handle(job);
            }
            let now = clock::now_ns();
            if now >= next_commit || stop {
                let mut st = self.state.lock();
                if st.md.is_dirty() {
                    let _ = self.commit(&mut st);
                }
                let expired = self.take_expired(&mut st, now);
                drop(st);
                for bio in expired {
                    bio.complete(Status::NoSpace);
                }
                next_commit = now + COMMIT_PERIOD_NS;
            }
            if stop && self.jobs.lock().queue.is_empty() {
                return;
            }
        }
    }

    /// `do_no_space_timeout`: a pool out of data space for longer than
    /// the no-space timeout stops queueing (its status says
    /// `error_if_no_space` until it has space again) and fails the bios
    /// it held.
    fn take_expired(&self, st: &mut PoolState, now: u64) -> Vec<Bio> {
        let timeout = no_space_timeout_secs().saturating_mul(1_000_000_000);
        if st.mode != Mode::OutOfDataSpace
            || st.pf.error_if_no_space
            || timeout == 0
            || now.saturating_sub(st.out_of_space_since) < timeout
        {
            return Vec::new();
        }
        tracing::warn!(pool = %self.data_dev.name, "thin-pool: no space timeout: failing queued I/O");
        st.pf.error_if_no_space = true;
        st.events.raise();
        std::mem::take(&mut st.no_space)
            .into_iter()
            .map(|(b, _, _)| b)
            .collect()
    }

    /// Ask the worker to exit after the jobs already queued.
    pub fn stop(&self) {
        self.jobs.lock().stop = true;
        self.cv.notify_one();
    }

    fn handle(&self, job: Job) {
        match job {
            Job::Flush(bio) => {
                let st = self.commit(&mut self.state.lock());
                bio.complete(st);
            }
            Job::Preflush(mut bio, thin) => {
                let st = self.commit(&mut self.state.lock());
                if !st.is_ok() {
                    bio.complete(st);
                    return;
                }
                bio.flags.remove(blkstack_core::BioFlags::PREFLUSH);
                thin.map(bio);
            }
            Job::Fua(bio, status) => {
                let mut st = self.state.lock();
                let c = if status.is_ok() && st.md.is_dirty() {
                    self.commit(&mut st)
                } else {
                    Status::Ok
                };
                drop(st);
                bio.complete(if status.is_ok() { c } else { status });
            }
            Job::Provisioned(bio, status, id) => self.provisioned(bio, status, id),
            Job::Remap(bio, thin) => thin.map_io(bio),
            Job::Quiesced(id) => self.quiesced(id),
            Job::Run(work) => work(),
        }
    }

    /// `process_prepared_mapping`: the data is written, so map it.
    fn provisioned(&self, bio: Bio, status: Status, id: u64) {
        self.finish_provisioning(self.state.lock(), bio, status, id, false);
    }

    /// Whether provisioning `id` can be finished right where its write
    /// completed: the insert touches only nodes in memory, so nothing
    /// waits on the metadata device (whose completions may come from the
    /// very thread this runs on), and it cannot fail for want of space.
    fn can_finish_inline(&self, st: &PoolState, status: Status, id: u64) -> bool {
        let Some(p) = st.pending.get(&id) else {
            return false;
        };
        p.quiesced
            && status.is_ok()
            && p.generation == st.generation
            && matches!(st.mode, Mode::Write | Mode::OutOfDataSpace)
            && st.md.metadata_free() >= INLINE_METADATA_RESERVE
            && st.md.insert_is_cached(p.thin.dev_id(), p.vblock)
    }

    pub(super) fn finish_provisioning(
        &self,
        mut st: MutexGuard<'_, PoolState>,
        bio: Bio,
        mut status: Status,
        id: u64,
        in_completion: bool,
    ) {
        if let Some(p) = st.pending.get_mut(&id).filter(|p| !p.quiesced) {
            p.done = Some((bio, status));
            return;
        }
        let Some(p) = st.pending.remove(&id) else {
            drop(st);
            bio.complete(Status::IoError);
            return;
        };
        if p.generation == st.generation {
            if status.is_ok() && !matches!(st.mode, Mode::ReadOnly | Mode::Fail) {
                if let Err(e) = st.md.insert_block(p.thin.dev_id(), p.vblock, p.block) {
                    self.metadata_failed(&mut st, "dm_thin_insert_block", &e);
                    status = Status::IoError;
                }
            } else {
                if let Err(e) = st.md.free_data_block(p.block) {
                    self.metadata_failed(&mut st, "dm_pool_free_data_block", &e);
                }
                if status.is_ok() {
                    status = Status::IoError;
                }
            }
        } else if status.is_ok() {
            status = Status::IoError;
        }
        let waiters = st
            .cells
            .remove(&(p.thin.dev_id(), p.vblock))
            .unwrap_or_default();
        drop(st);
        bio.complete(status);
        for (b, thin) in waiters {
            // Mapping them takes the lock: not in a completion.
            if in_completion {
                self.push(Job::Remap(b, thin));
            } else {
                thin.map_io(b);
            }
        }
    }
}

/// Completions of the data writes the pool waits for: `private` 0 is a
/// FUA write (commit before it completes), anything else a provisioning
/// write's id.
impl EndIo for PoolShared {
    fn end_io(&self, bio: Bio, status: Status, private: u64) {
        if private == 0 {
            return self.push(Job::Fua(bio, status));
        }
        // Most provisioning finishes here rather than on the worker (a
        // hand-off and a wake-up per new block). Nothing here may wait:
        // this thread may be the one to deliver the completion that the
        // holder of the lock waits for (a commit's flush of the data
        // device), so a busy lock, or an insert that would read metadata,
        // goes to the worker as in dm-thin.
        match self.state.try_lock() {
            Some(st) if self.can_finish_inline(&st, status, private) => {
                self.finish_provisioning(st, bio, status, private, true);
            }
            _ => self.push(Job::Provisioned(bio, status, private)),
        }
    }
}

/// The pool object a `thin-pool` target and its `thin` targets share;
/// the worker stops (after a last commit) when the last of them goes.
pub struct Pool {
    /// What the pool's targets and worker share.
    pub shared: Arc<PoolShared>,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl Pool {
    /// Start the pool's worker thread, named after `name`, and return the
    /// pool its targets hold (kernel `pool_create`).
    pub fn start(shared: Arc<PoolShared>, name: &str) -> std::io::Result<Arc<Pool>> {
        let s = shared.clone();
        let worker = std::thread::Builder::new()
            .name(format!("thin-pool/{name}"))
            .spawn(move || s.run())?;
        Ok(Arc::new(Pool {
            shared,
            worker: Some(worker),
        }))
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop();
        if let Some(w) = self.worker.take() {
            // The last reference can go on the worker itself (a removed
            // thin device whose last bio it completed): it then stops
            // after this job, and cannot wait for itself.
            if w.thread().id() != std::thread::current().id() {
                let _ = w.join();
            }
        }
    }
}
