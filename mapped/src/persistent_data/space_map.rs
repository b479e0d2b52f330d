//! A space map's reference counts, held in memory while the metadata is
//! open and written as the kernel's on-disk space map at each commit
//! (`persistent-data/dm-space-map-disk.c` for data blocks, `sm_disk.rs`;
//! `dm-space-map-metadata.c` for metadata blocks, `sm_metadata.rs`;
//! layout in `bitmap.rs`).
//!
//! As in the kernel, a block freed in the running transaction is not
//! handed out again before the commit (`sm_ll_find_common_free_block`
//! looks for blocks free in both the committed and the current counts):
//! the last committed metadata may still point at it, and a crash must
//! find it as it was.
//!
//! Where this differs from the kernel: every count is a `u32` in memory
//! (4 bytes per block of the device, read whole at open), and a commit
//! writes each changed bitmap to a new block and rebuilds the index and
//! reference count trees whole. The kernel keeps only its bitmaps on
//! disk, read and shadowed through the transaction manager's block
//! cache as counts change (`sm_ll_mutate`), its index and reference
//! count trees changed in place; and it hands out blocks in another
//! order (from block 0 again after each commit, `smm->begin = 0`, among
//! blocks free in the committed counts). So block numbers differ from
//! the kernel's for the same steps, though both are valid metadata.

use super::bitmap::ENTRIES_PER_BITMAP;
use std::collections::HashSet;

/// A reference count change the space map refuses.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RefCountError {
    /// The block's count is already 0 (the kernel's -EINVAL).
    #[error("space map common: unable to decrement block {0}: its reference count is 0")]
    BelowZero(u64),
}

/// The reference counts of one device's blocks (data or metadata), with
/// what the next commit must write (kernel `struct dm_space_map`).
pub struct SpaceMap {
    counts: Vec<u32>,
    /// Blocks whose count fell to 0 in this transaction.
    freed: HashSet<u64>,
    /// Per bitmap block: changed since the last commit.
    pub(super) dirty: Vec<bool>,
    /// Per bitmap block: its location on disk (0 = not written yet).
    pub(super) bitmap_blocks: Vec<u64>,
    /// Per bitmap block: placed at a block allocated in this commit.
    pub(super) fresh: Vec<bool>,
    /// The last commit's index: a btree's root (disk space map) or the
    /// index block (metadata space map); 0 before the first commit.
    pub(super) index_root: u64,
    /// The last commit's reference count tree, 0 before the first.
    pub(super) rc_root: u64,
    allocated: u64,
    cursor: u64,
}

fn nr_bitmaps(nr_blocks: u64) -> usize {
    nr_blocks.div_ceil(ENTRIES_PER_BITMAP) as usize
}

impl SpaceMap {
    /// A space map of `nr_blocks` blocks, all free, every bitmap to be
    /// written (a freshly formatted pool).
    pub fn new(nr_blocks: u64) -> SpaceMap {
        let n = nr_bitmaps(nr_blocks);
        SpaceMap {
            counts: vec![0; nr_blocks as usize],
            freed: HashSet::new(),
            dirty: vec![true; n],
            bitmap_blocks: vec![0; n],
            fresh: vec![false; n],
            index_root: 0,
            rc_root: 0,
            allocated: 0,
            cursor: 0,
        }
    }

    /// A space map read back from disk: its counts and bitmap locations.
    pub fn loaded(counts: Vec<u32>, bitmap_blocks: Vec<u64>) -> SpaceMap {
        let n = bitmap_blocks.len();
        let allocated = counts.iter().filter(|&&c| c > 0).count() as u64;
        SpaceMap {
            counts,
            freed: HashSet::new(),
            dirty: vec![false; n],
            bitmap_blocks,
            fresh: vec![false; n],
            index_root: 0,
            rc_root: 0,
            allocated,
            cursor: 0,
        }
    }

    /// Blocks the map covers (kernel `sm_get_nr_blocks`).
    pub fn nr_blocks(&self) -> u64 {
        self.counts.len() as u64
    }

    /// Blocks with a count above zero.
    pub fn nr_allocated(&self) -> u64 {
        self.allocated
    }

    /// Blocks with a count of zero (kernel `sm_get_nr_free`); some may not
    /// be handed out before the commit (see the module documentation).
    pub fn nr_free(&self) -> u64 {
        self.nr_blocks() - self.allocated
    }

    /// Block `b`'s reference count (kernel `sm_get_count`); 0 beyond the
    /// map.
    pub fn get(&self, b: u64) -> u32 {
        self.counts.get(b as usize).copied().unwrap_or(0)
    }

    /// Every block's count, in block order.
    pub fn counts(&self) -> &[u32] {
        &self.counts
    }

    fn set(&mut self, b: u64, c: u32) {
        let Some(slot) = self.counts.get_mut(b as usize) else {
            tracing::error!(block = b, "reference count of a block beyond the space map");
            return;
        };
        let old = *slot;
        *slot = c;
        if old == 0 && c > 0 {
            self.allocated += 1;
        } else if old > 0 && c == 0 {
            self.allocated -= 1;
            self.freed.insert(b);
        }
        self.dirty[(b / ENTRIES_PER_BITMAP) as usize] = true;
    }

    /// Add one reference to block `b` (kernel `sm_inc_block`).
    pub fn inc(&mut self, b: u64) {
        let c = self.get(b);
        self.set(b, c.saturating_add(1));
    }

    /// Drop one reference; returns the count left. A block already free
    /// is refused (`sm_ll_dec_bitmap`: "unable to decrement block",
    /// -EINVAL): metadata that counts fewer references than it holds is
    /// corrupt, and freeing the block would hand out data a snapshot
    /// still maps.
    pub fn dec(&mut self, b: u64) -> Result<u32, RefCountError> {
        let c = self.get(b);
        if c == 0 {
            tracing::error!(block = b, "space map common: unable to decrement block");
            return Err(RefCountError::BelowZero(b));
        }
        self.set(b, c - 1);
        Ok(c - 1)
    }

    /// A block free now and at the last commit, with its count set to 1.
    pub fn alloc(&mut self) -> Option<u64> {
        let n = self.nr_blocks();
        for i in 0..n {
            let b = (self.cursor + i) % n;
            if self.counts[b as usize] == 0 && !self.freed.contains(&b) {
                self.cursor = (b + 1) % n;
                self.set(b, 1);
                return Some(b);
            }
        }
        None
    }

    /// Grow to `nr_blocks` (a resized data device).
    pub fn extend(&mut self, nr_blocks: u64) {
        if nr_blocks <= self.nr_blocks() {
            return;
        }
        self.counts.resize(nr_blocks as usize, 0);
        let n = nr_bitmaps(nr_blocks);
        if let Some(last) = self.dirty.last_mut() {
            *last = true;
        }
        self.dirty.resize(n, true);
        self.bitmap_blocks.resize(n, 0);
        self.fresh.resize(n, false);
    }

    /// The counts bitmap `i` covers.
    pub fn bitmap_counts(&self, i: usize) -> &[u32] {
        let start = i * ENTRIES_PER_BITMAP as usize;
        let end = (start + ENTRIES_PER_BITMAP as usize).min(self.counts.len());
        &self.counts[start..end]
    }

    /// Bitmap blocks the map needs on disk.
    pub fn nr_bitmaps(&self) -> usize {
        self.bitmap_blocks.len()
    }

    /// (block, count) of every block counted above 2, which the reference
    /// count tree holds.
    pub fn overflow(&self) -> Vec<(u64, u32)> {
        self.counts
            .iter()
            .enumerate()
            .filter(|(_, &c)| c > 2)
            .map(|(b, &c)| (b as u64, c))
            .collect()
    }

    /// The transaction is on disk: freed blocks may be reused, bitmaps
    /// are clean.
    pub fn committed(&mut self) {
        self.freed.clear();
        self.dirty.iter_mut().for_each(|d| *d = false);
        self.fresh.iter_mut().for_each(|f| *f = false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_blocks_wait_for_the_commit() {
        let mut sm = SpaceMap::new(3);
        assert_eq!(sm.alloc(), Some(0));
        assert_eq!(sm.alloc(), Some(1));
        sm.committed();
        assert_eq!(sm.dec(0), Ok(0));
        assert_eq!(sm.dec(0), Err(RefCountError::BelowZero(0)));
        assert_eq!(sm.alloc(), Some(2));
        assert_eq!(sm.alloc(), None, "block 0 was freed in this transaction");
        sm.committed();
        assert_eq!(sm.alloc(), Some(0));
        assert_eq!(sm.nr_free(), 0);
        sm.inc(1);
        sm.inc(1);
        assert_eq!(sm.overflow(), vec![(1, 3)]);
    }
}
