//! Unmapping a range of a thin device's virtual blocks, for discards
//! (`dm-thin-metadata.c` `__remove_range`, `dm_pool_inc_data_range` /
//! `dm_pool_dec_data_range`).
//!
//! As the kernel: the device's mapping tree is taken out of the
//! top-level tree (holding a reference to it meanwhile), the range's
//! entries are removed from it in place, run by run
//! (`btree_remove::remove_range`, the kernel's `dm_btree_remove_leaves`
//! and `dm-btree-remove.c`'s rebalancing, which keeps every node the
//! third full `thin_check` wants), and the tree goes back in. That costs
//! a descent per block unmapped, not a walk of the device's mappings; a
//! discard that finds nothing to unmap costs one descent and changes
//! nothing.

use super::super::format::details::unpack_block_time;
use super::values::{device_trees, BlockTimes};
use super::{MetadataError, PoolMetadata};
use crate::persistent_data::{btree, btree_remove, sm_disk};

/// Most blocks one unmapping reports up front room for (a discard is
/// split at `discard::MAX_RANGE_BLOCKS`, the same number).
const REPORT_ROOM: u64 = 1024;

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
        self.dirty = true;
        // Whatever happens below, the cache must not keep what was here.
        self.cache.forget_range(dev, begin, end);
        // The top-level tree lets go of the mapping tree, whose root
        // this reference keeps alive until it goes back in.
        self.tm.inc(sub)?;
        let root = self.root;
        self.root = btree::remove(&mut self.tm, root, dev, &mut device_trees(&mut self.data))?;
        let mut gone = Vec::with_capacity(end.saturating_sub(begin).min(REPORT_ROOM) as usize);
        let done = btree_remove::remove_range(
            &mut self.tm,
            sub,
            begin,
            end,
            &mut BlockTimes {
                data: &mut self.data,
            },
            &mut |_, v| gone.push(unpack_block_time(v).0),
        )?;
        let root = self.root;
        self.root = btree::insert_value(
            &mut self.tm,
            root,
            dev,
            &mut device_trees(&mut self.data),
            done.root,
        )?;
        if let Some(st) = self.devices.get_mut(&dev) {
            st.details.mapped_blocks = st.details.mapped_blocks.saturating_sub(done.count);
            st.changed = true;
        }
        Ok(gone)
    }

    /// Take a reference to data block `b` (which a discard unmapped), so
    /// it is not handed out again while I/O to it may be in flight
    /// (`dm_pool_inc_data_range`: through the index entry cache, a count
    /// above 2 into the reference count tree).
    pub fn hold_data_block(&mut self, b: u64) -> Result<(), MetadataError> {
        self.data.inc(b);
        self.dirty = true;
        Ok(sm_disk::shadow_bitmaps(&mut self.tm, &mut self.data)?)
    }

    /// `dm_pool_block_is_shared`: whether data block `b` counts more
    /// than one reference, looked up as the kernel's `sm_ll_lookup` does,
    /// through the index entry cache (a miss may write another entry
    /// into the index tree, which takes metadata blocks).
    pub fn data_block_is_shared(&mut self, b: u64) -> Result<bool, MetadataError> {
        let count = self.data.lookup(b);
        sm_disk::shadow_bitmaps(&mut self.tm, &mut self.data)?;
        Ok(count > 1)
    }
}
