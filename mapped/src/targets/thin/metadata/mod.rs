//! A pool's metadata (`dm-thin-metadata.c`): the two-level mapping tree
//! (thin device id -> that device's tree of virtual block -> data block
//! and time), the device-details tree, the data and metadata space maps
//! and the superblock, changed in copy-on-write transactions that
//! [`PoolMetadata::commit`] makes durable.
//!
//! A commit writes, in order: the changed device details into their
//! tree; the data space map (new bitmap blocks for the changed bitmaps, a
//! new index tree, a new reference count tree); the metadata space map
//! (same, counting its own blocks until nothing more changes); every
//! block this transaction made; a flush; and last the superblock, with
//! FUA. Until the superblock lands the previous transaction is intact on
//! disk, because no block it uses was changed or handed out again.

mod commit;
pub use commit::metadata_blocks_of;
pub mod mapping_cache;
mod remove_range;
mod values;

use super::format::details::{pack_block_time, unpack_block_time, DeviceDetails};
use super::format::superblock::Superblock;
use super::format::FormatError;
use crate::persistent_data::space_map::{self, SpaceMap};
use crate::persistent_data::tm::Tm;
use crate::persistent_data::value_type::{Le64, ValueType};
use crate::persistent_data::{btree, sm_disk, PdError};
use mapping_cache::MappingCache;
use std::collections::BTreeMap;
use values::{device_trees, BlockTimes, Details};

/// The largest thin device id (`MAX_DEV_ID`, 24 bits).
pub const MAX_DEV_ID: u64 = (1 << 24) - 1;

/// `read_dev_id`: a thin device id as messages and tables give it.
pub fn read_dev_id(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse::<u64>().ok().filter(|&id| id <= MAX_DEV_ID)
}

/// Why a metadata operation failed; any of them puts the pool in
/// read-only or fail mode unless the caller can refuse it alone (kernel
/// `metadata_operation_failed`).
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    /// The persistent-data layer failed: I/O, a block that does not
    /// decode, corrupt contents, no metadata space, or a reference count
    /// going below zero.
    #[error(transparent)]
    Pd(#[from] PdError),
    /// `create_thin`/`create_snap` named an id in use (kernel `-EEXIST`).
    #[error("thin device {0} already exists")]
    Exists(u64),
    /// The thin device id is not in the metadata (kernel `-ENODATA`).
    #[error("thin device {0} does not exist")]
    NoSuchDevice(u64),
    /// A request the metadata refuses as invalid (kernel `-EINVAL`), with
    /// the reason.
    #[error("{0}")]
    Refused(String),
    /// Refused because something holds it (the kernel's -EBUSY).
    #[error("{0}")]
    Busy(String),
}

impl From<FormatError> for MetadataError {
    fn from(e: FormatError) -> MetadataError {
        MetadataError::Pd(PdError::Format(e))
    }
}

impl From<space_map::RefCountError> for MetadataError {
    fn from(e: space_map::RefCountError) -> MetadataError {
        MetadataError::Pd(PdError::RefCount(e))
    }
}

impl MetadataError {
    /// [`PdError::Corrupt`] for `block`, saying `why`.
    pub fn corrupt(block: u64, why: &str) -> MetadataError {
        MetadataError::Pd(PdError::Corrupt {
            block,
            why: why.to_string(),
        })
    }
}

/// A thin device's details as the running transaction has them.
#[derive(Clone, Copy, Debug)]
struct DevState {
    details: DeviceDetails,
    changed: bool,
}

/// Where a virtual block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lookup {
    /// The data block it is mapped to.
    pub data_block: u64,
    /// Written before the device's last snapshot: a write must copy it.
    pub shared: bool,
}

/// What a mapping's packed `block << 24 | time` value means to a device
/// whose last snapshot was at `snapshotted` (`dm_thin_find_block`'s
/// `__snapshotted_since`).
#[inline]
pub fn lookup_of(packed: u64, snapshotted: u32) -> Lookup {
    let (data_block, time) = unpack_block_time(packed);
    Lookup {
        data_block,
        shared: snapshotted > time,
    }
}

/// A pool's open metadata: the running transaction over the last
/// committed one (kernel `struct dm_pool_metadata`).
pub struct PoolMetadata {
    /// The transaction manager, with the metadata space map.
    tm: Tm,
    /// Reference counts of the data device's blocks.
    data: SpaceMap,
    /// Top of the two-level mapping tree.
    root: u64,
    details_root: u64,
    time: u32,
    trans_id: u64,
    held_root: u64,
    flags: u32,
    data_block_size: u32,
    devices: BTreeMap<u64, DevState>,
    /// What the mapping trees said, kept coherent by every change here.
    cache: MappingCache,
    /// Something changed since the last commit.
    dirty: bool,
}

impl PoolMetadata {
    /// Open the metadata on `tm`'s device, formatting it when its first
    /// block is all zeroes (`dm_pool_metadata_open`), for a data device
    /// of `data_blocks` blocks of `data_block_size` sectors.
    pub fn open(
        dev: crate::target::DevArg,
        data_blocks: u64,
        data_block_size: u32,
    ) -> Result<PoolMetadata, MetadataError> {
        commit::open(dev, data_blocks, data_block_size)
    }

    /// Make the running transaction durable (kernel
    /// `dm_pool_commit_metadata`), in the order the module documentation
    /// gives; nothing to do when nothing changed.
    pub fn commit(&mut self) -> Result<(), MetadataError> {
        if !self.dirty {
            return Ok(());
        }
        commit::commit(self)
    }

    /// Commit as if the data blocks in `in_flight` (allocated for writes
    /// not yet finished, so not mapped yet) were still free: a crash
    /// must not find them allocated and referred to by nothing.
    pub fn commit_without(&mut self, in_flight: &[u64]) -> Result<(), MetadataError> {
        if !self.dirty {
            return Ok(());
        }
        for (i, &b) in in_flight.iter().enumerate() {
            if let Err(e) = self.data.dec(b) {
                in_flight[..i].iter().for_each(|&b| self.data.inc(b));
                return Err(e.into());
            }
        }
        let r = commit::commit(self);
        for &b in in_flight {
            self.data.inc(b);
        }
        // Their bitmap's new block; left for the next change or commit
        // (which report a failure) if there is no metadata space.
        let _ = sm_disk::shadow_bitmaps(&mut self.tm, &mut self.data);
        r
    }

    /// `dm_pool_metadata_set_needs_check`: set the flag in the committed
    /// superblock (after an aborted transaction).
    pub fn set_needs_check(&mut self) -> Result<(), MetadataError> {
        self.flags |= super::format::superblock::NEEDS_CHECK;
        let loc = super::format::superblock::LOCATION;
        let mut sb = Superblock::decode(&self.tm.read_block(loc)?, loc)?;
        sb.flags = self.flags;
        self.tm.write_block(loc, &mut sb.encode(), true)?;
        Ok(self.tm.flush()?)
    }

    /// Whether there is anything to commit.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// The transaction id userspace set (`set_transaction_id`), as the
    /// pool's status shows it.
    pub fn transaction_id(&self) -> u64 {
        self.trans_id
    }

    /// The held metadata snapshot's block (`reserve_metadata_snap`), 0 if
    /// none.
    pub fn held_root(&self) -> u64 {
        self.held_root
    }

    /// Whether the superblock carries `NEEDS_CHECK`: the pool stays
    /// read-only until `thin_check`/`thin_repair` clear it.
    pub fn needs_check(&self) -> bool {
        self.flags & super::format::superblock::NEEDS_CHECK != 0
    }

    /// Data block size in 512-byte sectors, as the superblock records it.
    pub fn data_block_size(&self) -> u32 {
        self.data_block_size
    }

    /// (used, total) metadata blocks as the pool's status shows them:
    /// the kernel counts its reserve (`__set_metadata_reserve`: a tenth
    /// of the device, at most 4096 blocks) as used
    /// (`dm_pool_get_free_metadata_block_count`).
    pub fn metadata_blocks(&self) -> (u64, u64) {
        let total = self.tm.meta.nr_blocks();
        (total - self.metadata_free(), total)
    }

    /// Free metadata blocks beyond the reserve.
    pub fn metadata_free(&self) -> u64 {
        let reserve = (self.tm.meta.nr_blocks() / 10).min(4096);
        self.tm.meta.nr_free().saturating_sub(reserve)
    }

    /// Free metadata blocks, the reserve included (what the kernel's
    /// metadata low water threshold is checked against).
    pub fn metadata_raw_free(&self) -> u64 {
        self.tm.meta.nr_free()
    }

    /// (used, total) data blocks, as the pool's status shows them.
    pub fn data_blocks(&self) -> (u64, u64) {
        (self.data.nr_allocated(), self.data.nr_blocks())
    }

    /// Free data blocks.
    pub fn data_free(&self) -> u64 {
        self.data.nr_free()
    }

    /// Whether thin device `dev` exists in the running transaction.
    pub fn exists(&self, dev: u64) -> bool {
        self.devices.contains_key(&dev)
    }

    /// The data space map's reference count of a data block.
    pub fn data_ref_count(&self, b: u64) -> u32 {
        self.data.get(b)
    }

    fn check_id(dev: u64) -> Result<(), MetadataError> {
        if dev > MAX_DEV_ID {
            return Err(MetadataError::Refused(format!(
                "device id {dev} is above the largest, {MAX_DEV_ID}"
            )));
        }
        Ok(())
    }

    fn new_details(&self) -> DevState {
        DevState {
            details: DeviceDetails {
                mapped_blocks: 0,
                transaction_id: self.trans_id,
                creation_time: self.time,
                snapshotted_time: self.time,
            },
            changed: true,
        }
    }

    /// `__create_thin`.
    pub fn create_thin(&mut self, dev: u64) -> Result<(), MetadataError> {
        Self::check_id(dev)?;
        if self.exists(dev) {
            return Err(MetadataError::Exists(dev));
        }
        self.dirty = true;
        self.cache.forget(dev);
        let sub = btree::build(
            &mut self.tm,
            &[],
            &mut BlockTimes {
                data: &mut self.data,
            },
        )?;
        self.root = btree::insert(
            &mut self.tm,
            self.root,
            dev,
            &mut device_trees(&mut self.data),
            &mut |_, _, _| Ok::<_, MetadataError>(sub),
        )?;
        let st = self.new_details();
        self.devices.insert(dev, st);
        Ok(())
    }

    /// `__create_snap`: the snapshot shares the origin's mapping tree (one
    /// more reference to its root), and both record the new time, so a
    /// write to either copies blocks mapped before it.
    pub fn create_snap(&mut self, dev: u64, origin: u64) -> Result<(), MetadataError> {
        Self::check_id(dev)?;
        if self.exists(dev) {
            return Err(MetadataError::Exists(dev));
        }
        let origin_root = self.subtree(origin)?;
        self.dirty = true;
        self.cache.forget(dev);
        self.tm.inc(origin_root)?;
        self.root = btree::insert(
            &mut self.tm,
            self.root,
            dev,
            &mut device_trees(&mut self.data),
            &mut |_, _, _| Ok::<_, MetadataError>(origin_root),
        )?;
        self.time = self.time.wrapping_add(1);
        let time = self.time;
        let mut snap = self.new_details();
        let o = self
            .devices
            .get_mut(&origin)
            .ok_or(MetadataError::NoSuchDevice(origin))?;
        o.details.snapshotted_time = time;
        o.changed = true;
        snap.details.mapped_blocks = o.details.mapped_blocks;
        snap.details.snapshotted_time = time;
        self.devices.insert(dev, snap);
        Ok(())
    }

    /// `__delete_device`: its mapping tree loses a reference (and with
    /// the last one its blocks return to the space maps).
    pub fn delete(&mut self, dev: u64) -> Result<(), MetadataError> {
        if !self.exists(dev) {
            return Err(MetadataError::NoSuchDevice(dev));
        }
        self.dirty = true;
        self.details_root = btree::remove(&mut self.tm, self.details_root, dev, &mut Details)?;
        self.cache.forget(dev);
        let trees = &mut device_trees(&mut self.data);
        self.root = btree::remove(&mut self.tm, self.root, dev, trees)?;
        self.devices.remove(&dev);
        Ok(())
    }

    /// `dm_pool_set_metadata_transaction_id`.
    pub fn set_transaction_id(&mut self, current: u64, new: u64) -> Result<(), MetadataError> {
        if self.trans_id != current {
            return Err(MetadataError::Refused(format!(
                "transaction id mismatch (supplied {current}, expected {})",
                self.trans_id
            )));
        }
        self.trans_id = new;
        self.dirty = true;
        Ok(())
    }

    fn subtree(&mut self, dev: u64) -> Result<u64, MetadataError> {
        btree::lookup::<Le64>(&mut self.tm, self.root, dev)?.ok_or(MetadataError::NoSuchDevice(dev))
    }

    /// `dm_thin_find_block`.
    pub fn find_block(&mut self, dev: u64, vblock: u64) -> Result<Option<Lookup>, MetadataError> {
        let snapshotted = self
            .snapshotted_time(dev)
            .ok_or(MetadataError::NoSuchDevice(dev))?;
        let packed = match self.cache.get(dev, vblock) {
            Some(known) => known,
            None => {
                let sub = self.subtree(dev)?;
                let span = btree::leaf_span::<Le64>(&mut self.tm, sub, vblock)?;
                self.cache.fill(dev, vblock, &span);
                span.value::<Le64>(vblock)
            }
        };
        Ok(packed.map(|v| lookup_of(v, snapshotted)))
    }

    /// The time of `dev`'s last snapshot (`None`: no such device), for
    /// [`lookup_of`] on what [`Self::cached_block`] found: a batch asks
    /// for it once, not once per bio as [`Self::find_block`] does.
    #[inline]
    pub fn snapshotted_time(&self, dev: u64) -> Option<u32> {
        self.devices.get(&dev).map(|d| d.details.snapshotted_time)
    }

    /// `vblock`'s mapping if the mapping cache knows it, without a walk:
    /// `None` unknown, `Some(None)` unmapped, `Some(Some(packed))` mapped
    /// (see [`lookup_of`]). A batch loads its bios' entries with this one
    /// after another, so their misses in the CPU's caches overlap.
    #[inline]
    pub fn cached_block(&self, dev: u64, vblock: u64) -> Option<Option<u64>> {
        self.cache.get(dev, vblock)
    }

    /// A free data block, referenced once (`dm_pool_alloc_data_block`).
    pub fn alloc_data_block(&mut self) -> Option<u64> {
        let b = self.data.alloc()?;
        self.dirty = true;
        if sm_disk::shadow_bitmaps(&mut self.tm, &mut self.data).is_err() {
            // No metadata block for the data bitmap: the commit fails.
            tracing::warn!("no metadata space for a data space map bitmap");
        }
        Some(b)
    }

    /// Give back a block from [`Self::alloc_data_block`] that was never
    /// mapped (a write that failed).
    pub fn free_data_block(&mut self, b: u64) -> Result<(), MetadataError> {
        self.data.dec(b)?;
        Ok(sm_disk::shadow_bitmaps(&mut self.tm, &mut self.data)?)
    }

    /// Whether [`Self::insert_block`] of `vblock` would read nothing from
    /// the metadata device: every node on both trees' paths is in memory.
    pub fn insert_is_cached(&self, dev: u64, vblock: u64) -> bool {
        match btree::insert_path_cached::<Le64>(&self.tm, self.root, dev) {
            Some(Some(sub)) => btree::insert_path_cached::<Le64>(&self.tm, sub, vblock).is_some(),
            _ => false,
        }
    }

    /// `dm_thin_insert_block`: map `vblock` to `data_block` (whose
    /// reference this takes over); a block it replaces loses one.
    pub fn insert_block(
        &mut self,
        dev: u64,
        vblock: u64,
        data_block: u64,
    ) -> Result<(), MetadataError> {
        if !self.exists(dev) {
            return Err(MetadataError::NoSuchDevice(dev));
        }
        self.dirty = true;
        let packed = pack_block_time(data_block, self.time);
        let mut inserted = false;
        let root = self.root;
        let r = btree::insert(
            &mut self.tm,
            root,
            dev,
            &mut device_trees(&mut self.data),
            &mut |tm, trees, old| {
                let sub = old.ok_or(MetadataError::NoSuchDevice(dev))?;
                btree::insert(tm, sub, vblock, &mut trees.0, &mut |tm, blocks, old| {
                    // The old block loses its reference even when it is
                    // the new one too: the caller's reference replaces it.
                    match old {
                        Some(o) => blocks.dec(tm, &o)?,
                        None => inserted = true,
                    }
                    Ok::<_, MetadataError>(packed)
                })
            },
        );
        self.root = match r {
            Ok(root) => root,
            Err(e) => {
                self.cache.forget(dev);
                return Err(e);
            }
        };
        self.cache.set(dev, vblock, Some(packed));
        if let Some(st) = self.devices.get_mut(&dev) {
            st.changed = true;
            if inserted {
                st.details.mapped_blocks += 1;
            }
        }
        Ok(())
    }

    /// Blocks mapped by thin device `dev`, `None` if it does not exist.
    pub fn mapped_blocks(&self, dev: u64) -> Option<u64> {
        self.devices.get(&dev).map(|d| d.details.mapped_blocks)
    }

    /// The highest virtual block thin device `dev` maps, `None` if it maps
    /// none (a thin target's status).
    pub fn highest_mapped(&mut self, dev: u64) -> Result<Option<u64>, MetadataError> {
        let sub = self.subtree(dev)?;
        Ok(btree::highest_key(&mut self.tm, sub)?)
    }

    /// Grow the data space map (a pool reloaded over a larger device).
    pub fn resize_data(&mut self, nr_blocks: u64) -> Result<(), MetadataError> {
        let have = self.data.nr_blocks();
        if nr_blocks < have {
            return Err(MetadataError::Refused(format!(
                "pool target ({nr_blocks} blocks) too small: expected {have}"
            )));
        }
        if nr_blocks > have {
            self.data.extend(nr_blocks);
            sm_disk::shadow_bitmaps(&mut self.tm, &mut self.data)?;
            self.dirty = true;
        }
        Ok(())
    }

    /// `dm_pool_resize_metadata_dev`: grow the metadata space map to
    /// what the metadata device holds now (it was reloaded larger);
    /// returns whether it grew. A smaller device is refused.
    pub fn resize_metadata(&mut self) -> Result<bool, MetadataError> {
        let have = self.tm.meta.nr_blocks();
        let now = commit::metadata_blocks_of(self.tm.bm.size_bytes());
        if now < have {
            return Err(MetadataError::Refused(format!(
                "metadata device ({now} blocks) too small: expected {have}"
            )));
        }
        if now == have {
            return Ok(false);
        }
        self.tm.meta.extend_metadata(now);
        self.dirty = true;
        Ok(true)
    }

    /// `__reserve_metadata_snap`: commit, then a copy of the superblock
    /// holding a reference to the committed mapping and details trees.
    pub fn reserve_metadata_snap(&mut self) -> Result<(), MetadataError> {
        if self.held_root != 0 {
            return Err(MetadataError::Busy(
                "Pool metadata snapshot already exists: release this before taking another.".into(),
            ));
        }
        self.dirty = true;
        self.commit()?;
        let copy = self
            .tm
            .copy_superblock(super::format::superblock::LOCATION)?;
        let sb = Superblock {
            flags: self.flags,
            blocknr: copy,
            time: self.time,
            trans_id: self.trans_id,
            held_root: 0,
            data_sm: Default::default(),
            metadata_sm: Default::default(),
            data_mapping_root: self.root,
            device_details_root: self.details_root,
            data_block_size: self.data_block_size,
            metadata_nr_blocks: self.tm.meta.nr_blocks(),
        };
        self.tm.queue_raw(copy, sb.encode());
        self.tm.inc(self.root)?;
        self.tm.inc(self.details_root)?;
        self.held_root = copy;
        self.dirty = true;
        Ok(())
    }

    /// `__release_metadata_snap`.
    pub fn release_metadata_snap(&mut self) -> Result<(), MetadataError> {
        let held = self.held_root;
        if held == 0 {
            return Err(MetadataError::Refused(
                "No pool metadata snapshot found: please create one via 'reserve_metadata_snap'"
                    .into(),
            ));
        }
        let sb = match self.tm.queued_raw(held) {
            Some(raw) => Superblock::decode(raw, held)?,
            None => Superblock::decode(&self.tm.read_block(held)?, held)?,
        };
        self.tm.unqueue_raw(held);
        let trees = &mut device_trees(&mut self.data);
        btree::del(&mut self.tm, sb.data_mapping_root, trees)?;
        btree::del(&mut self.tm, sb.device_details_root, &mut Details)?;
        self.tm.dec(held)?;
        self.held_root = 0;
        self.dirty = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
