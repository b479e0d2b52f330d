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
//! overlap instead of coming one after another, and each bio's entry is
//! found once (one hash of its page), with the device's snapshot time
//! read once per batch; a power-of-two block size (the usual) splits an
//! offset with a shift and a mask, not a 64-bit division.

use super::metadata::lookup_of;
use super::pool::{Mode, PoolState};
use super::thin_target::ThinCore;
use blkstack_core::{Bio, BioFlags, Op};
use std::sync::Arc;

/// Bios of a batch whose mapping entries are loaded together before any
/// is looked at; a longer batch looks the rest up one by one.
const LOOKAHEAD: usize = 32;

/// A pool's data block size as the map path divides by it: a shift and a
/// mask when it is a power of two (as dm-thin keeps
/// `sectors_per_block_shift`), a division otherwise.
#[derive(Clone, Copy)]
pub(super) struct BlockGeometry {
    bytes: u64,
    shift: Option<u32>,
}

impl BlockGeometry {
    pub(super) fn new(bytes: u64) -> BlockGeometry {
        let shift = bytes.is_power_of_two().then(|| bytes.trailing_zeros());
        BlockGeometry { bytes, shift }
    }

    /// The block holding byte `offset`, and the offset inside it.
    #[inline]
    pub(super) fn split(self, offset: u64) -> (u64, u64) {
        match self.shift {
            Some(s) => (offset >> s, offset & (self.bytes - 1)),
            None => (offset / self.bytes, offset % self.bytes),
        }
    }
}

/// One batch's view of its device: what the remap of each bio needs.
struct Batch {
    dev: u64,
    geo: BlockGeometry,
    data_size: u64,
    /// The device's last snapshot time (`None`: the device is gone).
    snapshotted: Option<u32>,
}

impl ThinCore {
    /// Map `bios` (left empty): the remap-only ones as one batch to the
    /// data device, the rest one by one.
    pub(super) fn map_batch(self: &Arc<Self>, bios: &mut Vec<Bio>) {
        let pool = &self.pool;
        let geo = BlockGeometry::new(pool.block_bytes());
        // Counted before the lookups, as `map_rw` counts one bio: a
        // discard that unmaps a block after them waits for their I/O.
        let epoch = self
            .discards
            .then(|| pool.all_io.enter_n(bios.len() as u64));
        let slow: Vec<Bio> = {
            let mut st = pool.state.lock();
            let batch = Batch {
                dev: self.dev_id,
                geo,
                data_size: pool.data_dev.dev.size(),
                snapshotted: st.md.snapshotted_time(self.dev_id),
            };
            // The entries of the first bios, loaded one after another
            // before any is used: their misses overlap.
            let mut ahead = [None; LOOKAHEAD];
            for (a, bio) in ahead.iter_mut().zip(bios.iter()) {
                *a = st.md.cached_block(batch.dev, geo.split(bio.offset).0);
            }
            let mut i = 0;
            bios.extract_if(.., |bio| {
                let known = ahead.get(i).copied().flatten();
                i += 1;
                !remap(&mut st, &batch, known, bio)
            })
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
/// let a bio through at once); false leaves it untouched. `known` is its
/// entry in the mapping cache, if it was loaded ahead and held one.
fn remap(st: &mut PoolState, b: &Batch, known: Option<Option<u64>>, bio: &mut Bio) -> bool {
    if !matches!(bio.op, Op::Read | Op::Write) {
        return false;
    }
    if bio.len == 0
        || bio.flags.contains(BioFlags::PREFLUSH)
        || bio.flags.contains(BioFlags::FUA)
        || st.mode == Mode::Fail
    {
        return false;
    }
    let Some(snapshotted) = b.snapshotted else {
        return false;
    };
    let (vblock, off) = b.geo.split(bio.offset);
    if !st.cells.is_empty() && st.cells.contains_key(&(b.dev, vblock)) {
        return false;
    }
    let l = match known {
        Some(Some(packed)) => lookup_of(packed, snapshotted),
        Some(None) => return false,
        None => match st.md.find_block(b.dev, vblock) {
            Ok(Some(l)) => l,
            _ => return false,
        },
    };
    let in_device = l
        .data_block
        .checked_add(1)
        .and_then(|n| n.checked_mul(b.geo.bytes))
        .is_some_and(|end| end <= b.data_size);
    // A shared block's bios take the pool's path: a read of one is
    // counted (`shared_read_ds`), a write breaks the sharing.
    if l.shared || !in_device {
        return false;
    }
    bio.offset = l.data_block * b.geo.bytes + off;
    true
}
