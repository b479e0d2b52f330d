//! Unmapping a range of a thin device's virtual blocks, for discards
//! (`dm-thin-metadata.c` `__remove_range`, `dm_pool_inc_data_range` /
//! `dm_pool_dec_data_range`).
//!
//! The kernel removes the range's leaves in place and rebalances
//! (`dm_btree_remove_leaves`, dm-btree-remove.c); blkstack rewrites the
//! device's mapping tree without the range, as `btree::remove` does for
//! the small trees, so every node is as full as `thin_check` wants
//! (a third at least). That costs a walk of the device's mappings per
//! discard that finds something to unmap (one that finds nothing costs
//! a descent); a discard is split at 1024 pool blocks (the kernel's
//! `BIO_PRISON_MAX_RANGE`), so a large one costs a walk per 1024 blocks.

use super::super::format::details::unpack_block_time;
use super::values::{device_trees, BlockTimes};
use super::{MetadataError, PoolMetadata};
use crate::persistent_data::btree;
use crate::persistent_data::value_type::{Le64, ValueType};

impl PoolMetadata {
    /// Unmap `begin..end` of `dev`; returns the data blocks the removed
    /// mappings pointed to (each lost a reference: the ones nothing else
    /// maps are free now, a snapshot's shared ones keep theirs).
    pub fn remove_range(
        &mut self,
        dev: u64,
        begin: u64,
        end: u64,
    ) -> Result<Vec<u64>, MetadataError> {
        if !self.exists(dev) {
            return Err(MetadataError::NoSuchDevice(dev));
        }
        let sub = self.subtree(dev)?;
        if btree::first_key_from(&mut self.tm, sub, begin)?.is_none_or(|k| k >= end) {
            return Ok(Vec::new());
        }
        let entries = btree::walk::<Le64>(&mut self.tm, sub)?;
        let (gone, kept): (Vec<_>, Vec<_>) = entries
            .into_iter()
            .partition(|(k, _)| (begin..end).contains(k));
        if gone.is_empty() {
            return Ok(Vec::new());
        }
        self.dirty = true;
        // Whatever happens below, the cache must not keep what was here.
        self.cache.forget_range(dev, begin, end);
        let new_sub = btree::build(
            &mut self.tm,
            &kept,
            &mut BlockTimes {
                data: &mut self.data,
            },
        )?;
        let root = self.root;
        self.root = btree::insert(
            &mut self.tm,
            root,
            dev,
            &mut device_trees(&mut self.data),
            &mut |tm, trees, old| {
                // The old tree goes (with the last reference to it, its
                // nodes and their blocks' references).
                trees.dec(tm, &old.ok_or(MetadataError::NoSuchDevice(dev))?)?;
                Ok::<_, MetadataError>(new_sub)
            },
        )?;
        if let Some(st) = self.devices.get_mut(&dev) {
            st.details.mapped_blocks = st.details.mapped_blocks.saturating_sub(gone.len() as u64);
            st.changed = true;
        }
        Ok(gone.iter().map(|&(_, v)| unpack_block_time(v).0).collect())
    }

    /// Take a reference to data block `b` (which a discard unmapped), so
    /// it is not handed out again while I/O to it may be in flight.
    pub fn hold_data_block(&mut self, b: u64) {
        self.data.inc(b);
        self.dirty = true;
    }
}
