//! A thin device's batch of reads and writes mapped together: a plugged
//! batch from the device above (the kernel's `blk_finish_plug`) is looked
//! up under one hold of the pool lock, counted in the pool's `all_io`
//! set with one atomic operation, and the bios that need nothing but a
//! remap (a read of a mapped block, a write to a block this device alone
//! maps) go on to the data device as one batch, so the data device pays
//! its own per-submission costs once per batch too.
//!
//! dm-thin has no such path: `thin_bio_map` looks every bio up on its own
//! (`dm_thin_find_block`, with `tc->pool->lock` only where it defers), and
//! the block layer's plug merges and batches below it. Here the per-bio
//! costs that a remap adds over the raw device (the lock, the count, the
//! data device's in-flight count and table load) are what stands between
//! a provisioned overwrite and the raw device's speed, so they are paid
//! once per batch. Everything else (flushes, PREFLUSH and FUA writes,
//! discards, unmapped or shared blocks, blocks being provisioned, a pool
//! that failed) takes the one-bio path of `thin_target.rs` afterwards,
//! which looks the block up again. The batch's mapping entries are
//! loaded together before they are looked at, so their cache misses
//! overlap instead of coming one after another.

use super::pool::{Mode, PoolState};
use super::thin_target::ThinCore;
use blkstack_core::{Bio, BioFlags, Op};
use std::sync::Arc;

impl ThinCore {
    /// Map `bios` (left empty): the remap-only ones as one batch to the
    /// data device, the rest one by one.
    pub(super) fn map_batch(self: &Arc<Self>, bios: &mut Vec<Bio>) {
        let pool = &self.pool;
        let bs = pool.block_bytes();
        let data_size = pool.data_dev.dev.size();
        // Counted before the lookups, as `map_rw` counts one bio: a
        // discard that unmaps a block after them waits for their I/O.
        let epoch = self
            .discards
            .then(|| pool.all_io.enter_n(bios.len() as u64));
        let slow: Vec<Bio> = {
            let mut st = pool.state.lock();
            st.md
                .prefetch(self.dev_id, bios.iter().map(|b| b.offset / bs));
            bios.extract_if(.., |bio| !remap(&mut st, self.dev_id, bs, data_size, bio))
                .collect()
        };
        if let Some(e) = epoch {
            // The others count themselves again on their own path.
            pool.all_io.exit_n(e, slow.len() as u64);
            for bio in bios.iter_mut() {
                pool.all_io.track(bio, e);
            }
        }
        match bios.len() {
            0 => {}
            1 => {
                if let Some(bio) = bios.pop() {
                    pool.data_dev.dev.submit(bio);
                }
            }
            _ => pool.data_dev.dev.submit_batch(bios),
        }
        for bio in slow {
            self.map_bio(bio);
        }
    }
}

/// Point `bio` at its data block if a remap is all it needs (the checks
/// of `PoolShared::prepare` and `ThinCore::data_block_in_device` that
/// let a bio through at once); false leaves it untouched.
fn remap(st: &mut PoolState, dev: u64, bs: u64, data_size: u64, bio: &mut Bio) -> bool {
    let write = match bio.op {
        Op::Read => false,
        Op::Write => true,
        _ => return false,
    };
    if bio.len == 0
        || bio.flags.contains(BioFlags::PREFLUSH)
        || bio.flags.contains(BioFlags::FUA)
        || st.mode == Mode::Fail
    {
        return false;
    }
    let (vblock, off) = (bio.offset / bs, bio.offset % bs);
    if !st.cells.is_empty() && st.cells.contains_key(&(dev, vblock)) {
        return false;
    }
    let Ok(Some(l)) = st.md.find_block(dev, vblock) else {
        return false;
    };
    let in_device = l
        .data_block
        .checked_add(1)
        .and_then(|n| n.checked_mul(bs))
        .is_some_and(|end| end <= data_size);
    if (write && l.shared) || !in_device {
        return false;
    }
    bio.offset = l.data_block * bs + off;
    true
}
