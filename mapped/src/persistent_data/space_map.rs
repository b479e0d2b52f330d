//! A space map's reference counts, held in memory while the metadata is
//! open and written as the kernel's on-disk space map at each commit
//! (`persistent-data/dm-space-map-disk.c` for data blocks, `sm_disk.rs`;
//! `dm-space-map-metadata.c` for metadata blocks, `sm_metadata.rs`;
//! layout in `bitmap.rs`), handing out blocks in the kernel's order so
//! the same steps leave the same blocks in use.
//!
//! Allocation follows `sm_ll_find_common_free_block`: the first block
//! at or after `begin` (the block after the last one handed out,
//! wrapping to 0) that is free both now and at the last commit -- a
//! block freed in the running transaction waits for the commit, since
//! the last committed metadata may still point at it, but one made and
//! freed again in it may be reused at once. The search goes on from
//! `begin` across commits: kernels before 5.15 started the metadata
//! space map from block 0 again at each commit (`smm->begin = 0`), the
//! ones since ("dm space maps: don't reset space map allocation cursor
//! when committing") do not, and 6.12 is the judge here.
//!
//! Bitmaps are copied on write as the kernel's are: the first change to
//! a bitmap in a transaction moves it to a new block
//! (`dm_tm_shadow_block` in `sm_ll_inc`/`sm_ll_dec`), which the metadata
//! space map takes from itself at once, in the order of the kernel's
//! recursion (the block asked for first, then the bitmap's new block,
//! their counts applied afterwards as `apply_bops` does); a disk space
//! map's new bitmap blocks are metadata blocks its owner allocates
//! ([`Todo::Shadow`], `sm_disk::shadow_bitmaps`).
//!
//! Counts above 2 live in the space map's reference count btree as the
//! kernel keeps them (`sm_ll_inc_bitmap`, `sm_ll_dec_bitmap`): a count
//! going from 2 to 3 is inserted, one changing above 2 is overwritten in
//! its leaf (`btree_get_overwrite_leaf`), one going from 3 to 2 removed.
//! The map hands each such change ([`RcOp`]) to its owner, who holds the
//! transaction manager the btree needs. The metadata space map's owner,
//! the transaction manager, makes it at once, inside the count change,
//! with the map recursing (`Tm::inc`, `Tm::dec`, `Tm::alloc`: the
//! kernel's `in()`/`out()`): the counts the tree's own blocks change
//! wait in the map's queue of block operations (`add_bop`) and are
//! applied when the outermost change ends (`apply_bops`). A disk space
//! map's owner makes them right after each change
//! (`sm_disk::shadow_bitmaps`).
//!
//! Where this differs from the kernel: every count is a `u32` in memory
//! (4 bytes per block of the device, read whole at open).

use super::bitmap::ENTRIES_PER_BITMAP;
use std::collections::{HashMap, VecDeque};

/// A reference count change the space map refuses.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RefCountError {
    /// The block's count is already 0 (the kernel's -EINVAL).
    #[error("space map common: unable to decrement block {0}: its reference count is 0")]
    BelowZero(u64),
    /// More count changes wait inside one change than the kernel's
    /// ring of block operations holds (`add_bop`'s -ENOMEM).
    #[error("space map metadata: too many recursive allocations")]
    TooManyRecursive,
}

/// `MAX_RECURSIVE_ALLOCATIONS`: the count changes that may wait inside
/// one change of the metadata space map.
const MAX_RECURSIVE_ALLOCATIONS: usize = 1024;

/// A change to the reference count tree that a count change needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RcOp {
    /// The block's count went from 2 to 3: insert it with 3.
    Insert(u64),
    /// The block's count changed above 2: overwrite it.
    Set(u64, u32),
    /// The block's count went from 3 to 2: remove it.
    Remove(u64),
}

/// What a disk space map's owner, who holds the transaction manager,
/// has still to do for the count changes made, in order
/// ([`SpaceMap::next_todo`]); the metadata space map leaves only
/// [`Todo::Rc`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Todo {
    /// `disk_ll_load_ie` of bitmap `i`'s index entry: the cache slot it
    /// takes may first write another dirty entry into the index tree.
    Load(usize),
    /// `disk_ll_save_ie` of bitmap `i`'s index entry, likewise.
    Save(usize),
    /// Bitmap `i`'s new block (its first change in the transaction, or
    /// a bitmap the map grew by).
    Shadow(usize),
    /// A reference count tree change.
    Rc(RcOp),
}

/// `IE_CACHE_SIZE`: the index entries a disk space map keeps in memory
/// (`struct ie_cache`), written into the index tree when another entry
/// takes their slot or at the commit.
const IE_CACHE_SIZE: usize = 64;

/// `dm_hash_block(index, IE_CACHE_MASK)`.
fn ie_slot(i: usize) -> usize {
    ((i as u32).wrapping_mul(4_294_967_291) as usize) & (IE_CACHE_SIZE - 1)
}

/// The reference counts of one device's blocks (data or metadata), with
/// what the next commit must write (kernel `struct dm_space_map`).
pub struct SpaceMap {
    counts: Vec<u32>,
    /// The count at the last commit of every block changed since (the
    /// kernel's `old_ll`, kept as the difference).
    before: HashMap<u64, u32>,
    /// Per bitmap block: its location on disk (0 = not made yet).
    pub(super) bitmap_blocks: Vec<u64>,
    /// Per bitmap block: changed in this transaction, so at a block made
    /// in it (or waiting for one: [`Todo::Shadow`]) and written at the
    /// commit.
    pub(super) fresh: Vec<bool>,
    /// Per bitmap: the index entry's `none_free_before`, kept as the
    /// kernel keeps it (a block taken at it moves it on, a block freed
    /// below it moves it back), a lower bound of the first free entry.
    nfb: Vec<u32>,
    /// What the owner has still to do, in order.
    todo: VecDeque<Todo>,
    /// A disk space map's index entry cache: per slot, the bitmap whose
    /// entry it holds and whether that entry is newer than the tree's.
    ie_cache: [Option<(usize, bool)>; IE_CACHE_SIZE],
    /// Some count changed since the last commit
    /// (`ll->bitmap_index_changed`).
    pub(super) index_changed: bool,
    /// The index (a btree's root for a disk space map, the index block
    /// for the metadata one); 0 before it is made.
    pub(super) index_root: u64,
    /// The index block was made in this transaction (metadata space map).
    pub(super) index_fresh: bool,
    /// The reference count tree's root; 0 before it is made.
    pub(super) rc_root: u64,
    allocated: u64,
    /// `allocated` at the last commit (the kernel's `old_ll.nr_allocated`).
    allocated_at_commit: u64,
    /// Blocks handed out since the last commit (the metadata space map's
    /// `allocated_this_transaction`).
    new_this_transaction: u64,
    /// Where the next search for a free block starts.
    begin: u64,
    /// The map counts the blocks it is stored in (the metadata space
    /// map): its bitmaps' new blocks are its own.
    self_counting: bool,
    /// Count changes made while one is being applied (`uncommitted`,
    /// the kernel's `bop_ring_buffer`).
    pending: VecDeque<(u64, bool)>,
    /// A change is being applied (`recursion_count` above 0).
    applying: bool,
    /// The metadata space map is growing (`sm_metadata_extend`'s
    /// bootstrap mode): new blocks are the next ones, uncounted.
    bootstrap: bool,
    /// Blocks the map covered at the last commit (`old_ll.nr_blocks`).
    blocks_at_commit: u64,
}

fn nr_bitmaps(nr_blocks: u64) -> usize {
    nr_blocks.div_ceil(ENTRIES_PER_BITMAP) as usize
}

impl SpaceMap {
    /// A disk space map of `nr_blocks` blocks, all free, none of its
    /// bitmaps made yet (each is the first time it changes, or at the
    /// commit).
    pub fn new(nr_blocks: u64) -> SpaceMap {
        let n = nr_bitmaps(nr_blocks);
        SpaceMap {
            counts: vec![0; nr_blocks as usize],
            before: HashMap::new(),
            bitmap_blocks: vec![0; n],
            fresh: vec![true; n],
            nfb: vec![0; n],
            todo: (0..n)
                .flat_map(|i| [Todo::Shadow(i), Todo::Save(i)])
                .collect(),
            ie_cache: [None; IE_CACHE_SIZE],
            index_changed: true,
            index_root: 0,
            index_fresh: false,
            rc_root: 0,
            allocated: 0,
            allocated_at_commit: 0,
            new_this_transaction: 0,
            begin: 0,
            self_counting: false,
            pending: VecDeque::new(),
            applying: false,
            bootstrap: false,
            blocks_at_commit: nr_blocks,
        }
    }

    /// A space map read back from disk: its counts and bitmap locations;
    /// `self_counting` for the metadata space map.
    pub fn loaded(counts: Vec<u32>, bitmap_blocks: Vec<u64>, self_counting: bool) -> SpaceMap {
        let n = bitmap_blocks.len();
        let nr = counts.len() as u64;
        let allocated = counts.iter().filter(|&&c| c > 0).count() as u64;
        SpaceMap {
            counts,
            before: HashMap::new(),
            bitmap_blocks,
            fresh: vec![false; n],
            nfb: vec![0; n],
            todo: VecDeque::new(),
            ie_cache: [None; IE_CACHE_SIZE],
            index_changed: false,
            index_root: 0,
            index_fresh: false,
            rc_root: 0,
            allocated,
            allocated_at_commit: allocated,
            new_this_transaction: 0,
            begin: 0,
            self_counting,
            pending: VecDeque::new(),
            applying: false,
            bootstrap: false,
            blocks_at_commit: nr,
        }
    }

    /// The metadata space map of a fresh device of `nr_blocks` blocks as
    /// `dm_sm_metadata_create`'s bootstrap leaves it: `superblock` and
    /// the blocks the bootstrap allocator handed out after it in order
    /// (the index block, the reference count tree's root, then one block
    /// per bitmap) counted once, all of them made in this transaction.
    /// Returns the map and its index block and reference count root.
    pub(super) fn bootstrap(nr_blocks: u64, superblock: u64) -> (SpaceMap, u64, u64) {
        let mut sm = SpaceMap::new(nr_blocks);
        sm.self_counting = true;
        sm.todo.clear();
        let index = superblock + 1;
        let rc_root = index + 1;
        let n = sm.nr_bitmaps() as u64;
        for i in 0..n {
            sm.bitmap_blocks[i as usize] = rc_root + 1 + i;
            sm.fresh[i as usize] = true;
        }
        for b in superblock..rc_root + 1 + n {
            sm.inc(b);
        }
        sm.index_root = index;
        sm.index_fresh = true;
        sm.rc_root = rc_root;
        sm.begin = rc_root + 1 + n;
        // `dm_sm_metadata_create` ends with a commit of the space map
        // alone: these counts are the committed ones, and the blocks stay
        // this transaction's.
        sm.sm_committed();
        (sm, index, rc_root)
    }

    /// Blocks the map covers (kernel `sm_get_nr_blocks`).
    pub fn nr_blocks(&self) -> u64 {
        self.counts.len() as u64
    }

    /// Blocks with a count above zero.
    pub fn nr_allocated(&self) -> u64 {
        self.allocated
    }

    /// Free blocks as the kernel counts them (`sm_get_nr_free`): for a
    /// disk space map, blocks with a count of zero (some may not be
    /// handed out before the commit); for the metadata space map, the
    /// blocks free at the last commit less those handed out since
    /// (`sm_metadata_get_nr_free`: blocks freed in the transaction are
    /// not free before the commit), which the pool's and era's status
    /// show.
    pub fn nr_free(&self) -> u64 {
        if self.self_counting {
            self.blocks_at_commit
                .saturating_sub(self.allocated_at_commit + self.new_this_transaction)
        } else {
            self.nr_blocks() - self.allocated
        }
    }

    /// Block `b`'s reference count (kernel `sm_get_count`); 0 beyond the
    /// map.
    /// For the metadata space map inside a change, the changes still
    /// waiting count (`sm_metadata_get_count` adds them).
    pub fn get(&self, b: u64) -> u32 {
        let c = self.counts.get(b as usize).copied().unwrap_or(0);
        if self.pending.is_empty() {
            return c;
        }
        let adj: i64 = self
            .pending
            .iter()
            .filter(|&&(p, _)| p == b)
            .map(|&(_, inc)| if inc { 1 } else { -1 })
            .sum();
        (c as i64 + adj).clamp(0, u32::MAX as i64) as u32
    }

    /// Block `b`'s count as the kernel's `sm_ll_lookup` reads it: a disk
    /// space map loads the bitmap's index entry through its cache
    /// ([`Todo::Load`]), which may write another dirty entry back.
    pub fn lookup(&mut self, b: u64) -> u32 {
        if !self.self_counting && b < self.nr_blocks() {
            self.todo
                .push_back(Todo::Load((b / ENTRIES_PER_BITMAP) as usize));
        }
        self.get(b)
    }

    /// Whether this is the metadata space map, which counts the blocks
    /// it is stored in.
    pub fn is_self_counting(&self) -> bool {
        self.self_counting
    }

    /// `in()`: a change starts; false when one is being applied already
    /// (the caller is recursing and queues with [`Self::add_bop`]).
    pub(super) fn enter(&mut self) -> bool {
        !std::mem::replace(&mut self.applying, true)
    }

    /// The outermost change ended (`out()` after `apply_bops`).
    pub(super) fn leave(&mut self) {
        self.applying = false;
        // Left over only when a change failed; the transaction is
        // aborted and the map read again.
        self.pending.clear();
    }

    /// `add_bop`: a count change made inside another waits for it;
    /// returns the count it leaves as [`Self::get`] sees it.
    pub(super) fn add_bop(&mut self, b: u64, inc: bool) -> Result<u32, RefCountError> {
        if self.pending.len() >= MAX_RECURSIVE_ALLOCATIONS {
            tracing::error!("too many recursive allocations");
            return Err(RefCountError::TooManyRecursive);
        }
        let now = self.get(b);
        if !inc && now == 0 {
            tracing::error!(block = b, "space map common: unable to decrement block");
            return Err(RefCountError::BelowZero(b));
        }
        self.pending.push_back((b, inc));
        Ok(if inc { now.saturating_add(1) } else { now - 1 })
    }

    /// The oldest count change waiting (`apply_bops`' `brb_peek` and
    /// `brb_pop`).
    pub(super) fn pop_bop(&mut self) -> Option<(u64, bool)> {
        self.pending.pop_front()
    }

    /// `sm_ll_inc`/`sm_ll_dec` of one block of the metadata space map,
    /// inside a change ([`Self::enter`]): its bitmap copied on its first
    /// change (the copy's count and the old block's drop queued), the
    /// count changed; returns the reference count tree change the owner
    /// makes now, before anything queued.
    pub(super) fn ll_change(&mut self, b: u64, inc: bool) -> Result<Option<RcOp>, RefCountError> {
        if !inc && self.counts.get(b as usize).copied().unwrap_or(0) == 0 {
            tracing::error!(block = b, "space map common: unable to decrement block");
            return Err(RefCountError::BelowZero(b));
        }
        Ok(self.apply(b, inc))
    }

    /// `sm_ll_find_common_free_block` for `sm_metadata_new_block_`: the
    /// block to hand out, the cursor moved past it; the caller counts it.
    pub(super) fn find_new(&mut self) -> Option<u64> {
        let b = self.find_common_free()?;
        self.begin = b + 1;
        self.new_this_transaction += 1;
        Some(b)
    }

    /// Every block's count, in block order.
    pub fn counts(&self) -> &[u32] {
        &self.counts
    }

    /// Add one reference to block `b` (kernel `sm_inc_block`).
    pub fn inc(&mut self, b: u64) {
        self.change(b, true);
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
        self.change(b, false);
        Ok(c - 1)
    }

    /// `sm_metadata_inc_block`/`dec_block`: a change made while another
    /// is applied waits in `pending` and is applied after it, in order.
    fn change(&mut self, b: u64, inc: bool) {
        if self.applying {
            self.pending.push_back((b, inc));
            return;
        }
        self.applying = true;
        let rc = self.apply(b, inc);
        self.todo.extend(rc.map(Todo::Rc));
        self.drain_pending();
    }

    /// One count change; returns the reference count tree change it
    /// needs. A disk space map queues its index entry's load and save
    /// around it.
    fn apply(&mut self, b: u64, inc: bool) -> Option<RcOp> {
        let Some(&old) = self.counts.get(b as usize) else {
            tracing::error!(block = b, "reference count of a block beyond the space map");
            return None;
        };
        let i = (b / ENTRIES_PER_BITMAP) as usize;
        if !self.self_counting {
            self.todo.push_back(Todo::Load(i));
        }
        if !self.fresh[i] {
            self.shadow_bitmap(i);
        }
        let new = if inc {
            old.saturating_add(1)
        } else {
            old.saturating_sub(1)
        };
        self.before.entry(b).or_insert(old);
        self.counts[b as usize] = new;
        let bit = (b % ENTRIES_PER_BITMAP) as u32;
        if old == 0 && new > 0 {
            self.allocated += 1;
            if self.nfb[i] == bit {
                self.nfb[i] = bit + 1;
            }
        } else if old > 0 && new == 0 {
            self.allocated -= 1;
            self.nfb[i] = self.nfb[i].min(bit);
        }
        let rc = match (old > 2, new > 2) {
            (false, true) => Some(RcOp::Insert(b)),
            (true, true) => Some(RcOp::Set(b, new)),
            (true, false) => Some(RcOp::Remove(b)),
            (false, false) => None,
        };
        if !self.self_counting {
            self.todo.extend(rc.map(Todo::Rc));
            self.todo.push_back(Todo::Save(i));
            self.index_changed = true;
            return None;
        }
        self.index_changed = true;
        rc
    }

    /// The first change to bitmap `i` in this transaction: it moves to a
    /// new block. The metadata space map takes it from itself now (its
    /// count and the old block's drop wait in `pending`); a disk space
    /// map's owner allocates it.
    fn shadow_bitmap(&mut self, i: usize) {
        self.fresh[i] = true;
        if !self.self_counting {
            self.todo.push_back(Todo::Shadow(i));
            return;
        }
        let new = if self.bootstrap {
            // `sm_bootstrap_new_block`: the next block, counted by the
            // extend's next round.
            self.begin += 1;
            self.begin - 1
        } else {
            let Some(new) = self.find_common_free() else {
                tracing::error!("no free metadata block for a space map bitmap");
                return;
            };
            self.begin = new + 1;
            self.new_this_transaction += 1;
            self.pending.push_back((new, true));
            new
        };
        let old = std::mem::replace(&mut self.bitmap_blocks[i], new);
        if old != 0 {
            self.pending.push_back((old, false));
        }
    }

    /// Whether `b` is free now and was at the last commit.
    fn free_in_both(&self, b: u64) -> bool {
        self.counts[b as usize] == 0 && self.before.get(&b).is_none_or(|&c| c == 0)
    }

    /// `sm_ll_find_common_free_block` from `begin` to the end, then from
    /// 0. A disk space map loads the index entry of every bitmap the
    /// kernel's search looks at (`sm_ll_find_free_block`, whose second
    /// search runs from 0 to the end), which its cache sees.
    fn find_common_free(&mut self) -> Option<u64> {
        let n = self.nr_blocks();
        let begin = self.begin.min(n);
        if self.self_counting {
            return (begin..n).chain(0..begin).find(|&b| self.free_in_both(b));
        }
        self.find_common_from(begin)
            .or_else(|| self.find_common_from(0))
    }

    /// One `sm_ll_find_common_free_block` of a disk space map from
    /// `begin`: a block free now, searched again after it while the
    /// last commit still used it.
    fn find_common_from(&mut self, mut begin: u64) -> Option<u64> {
        loop {
            let b = self.find_free_from(begin)?;
            if self.free_in_both(b) {
                return Some(b);
            }
            begin = b + 1;
        }
    }

    /// `sm_ll_find_free_block` from `begin` to the end: each bitmap's
    /// index entry loaded, those with no free entry skipped.
    fn find_free_from(&mut self, begin: u64) -> Option<u64> {
        let n = self.nr_blocks();
        let mut from = begin;
        for i in (begin / ENTRIES_PER_BITMAP) as usize..self.nr_bitmaps() {
            self.todo.push_back(Todo::Load(i));
            let start = i as u64 * ENTRIES_PER_BITMAP;
            let end = (start + ENTRIES_PER_BITMAP).min(n);
            let counts = &self.counts[start as usize..end as usize];
            if counts.len() as u64 == ENTRIES_PER_BITMAP && counts.iter().all(|&c| c > 0) {
                continue;
            }
            if let Some(b) = (from.max(start)..end).find(|&b| self.counts[b as usize] == 0) {
                return Some(b);
            }
            from = end;
        }
        None
    }

    /// A block free now and at the last commit, with its count set to 1
    /// (`sm_metadata_new_block`, `sm_disk_new_block`).
    pub fn alloc(&mut self) -> Option<u64> {
        let b = self.find_common_free()?;
        self.begin = b + 1;
        self.new_this_transaction += 1;
        self.inc(b);
        Some(b)
    }

    /// The next thing the owner has to do for the changes made, oldest
    /// first.
    pub fn next_todo(&mut self) -> Option<Todo> {
        self.todo.pop_front()
    }

    /// Put `t` back first (it could not be done now).
    pub fn requeue_todo(&mut self, t: Todo) {
        self.todo.push_front(t);
    }

    /// `disk_ll_load_ie` (`save`: `disk_ll_save_ie`) of bitmap `i`'s
    /// entry in the cache; returns the bitmap whose dirty entry its slot
    /// held, which must be written into the index tree first.
    pub fn ie_touch(&mut self, i: usize, save: bool) -> Option<usize> {
        let slot = &mut self.ie_cache[ie_slot(i)];
        match *slot {
            Some((j, dirty)) if j == i => {
                *slot = Some((i, dirty || save));
                None
            }
            old => {
                *slot = Some((i, save));
                old.and_then(|(j, dirty)| dirty.then_some(j))
            }
        }
    }

    /// `disk_ll_commit`: the bitmaps whose cached entries are dirty, in
    /// slot order, now clean.
    pub fn ie_take_dirty(&mut self) -> Vec<usize> {
        let mut out = Vec::new();
        for slot in self.ie_cache.iter_mut().flatten() {
            if slot.1 {
                slot.1 = false;
                out.push(slot.0);
            }
        }
        out
    }

    /// Bitmap `i` is now at block `b`; returns where it was (0: nowhere).
    pub fn set_bitmap_block(&mut self, i: usize, b: u64) -> u64 {
        std::mem::replace(&mut self.bitmap_blocks[i], b)
    }

    /// Grow to `nr_blocks` (a resized data device): the new bitmaps are
    /// made, and their index entries saved, by the owner's next
    /// [`SpaceMap::next_todo`]s (`sm_ll_extend`); nothing else changes.
    pub fn extend(&mut self, nr_blocks: u64) {
        if nr_blocks <= self.nr_blocks() {
            return;
        }
        let old = self.nr_bitmaps();
        self.counts.resize(nr_blocks as usize, 0);
        let n = nr_bitmaps(nr_blocks);
        self.bitmap_blocks.resize(n, 0);
        self.fresh.resize(n, false);
        self.nfb.resize(n, 0);
        // The last bitmap's block and index entry stay as they are: its
        // entries past the old end are free already, and an entry's free
        // count is of the whole bitmap (`sm_ll_extend` makes only the new
        // bitmaps).
        for i in old..n {
            self.index_changed = true;
            self.fresh[i] = true;
            self.todo.push_back(Todo::Shadow(i));
            self.todo.push_back(Todo::Save(i));
        }
    }

    /// Grow the metadata space map to `nr_blocks` (`sm_metadata_extend`),
    /// as the kernel does in its bootstrap mode: blocks are handed out
    /// one after the other from the old end (the new bitmaps first,
    /// `sm_ll_extend`), and the blocks handed out are counted, which may
    /// copy a bitmap or the index block to the next one, until a round
    /// hands out nothing more. Blocks beyond the old end count as free
    /// only after the next commit (`old_ll`).
    pub fn extend_metadata(&mut self, nr_blocks: u64) {
        let mut old_len = self.nr_blocks();
        if nr_blocks <= old_len {
            return;
        }
        self.begin = old_len;
        self.bootstrap = true;
        let old = self.nr_bitmaps();
        self.counts.resize(nr_blocks as usize, 0);
        let n = nr_bitmaps(nr_blocks);
        self.bitmap_blocks.resize(n, 0);
        self.fresh.resize(n, false);
        self.nfb.resize(n, 0);
        for i in old..n {
            self.bitmap_blocks[i] = self.begin;
            self.fresh[i] = true;
            self.begin += 1;
            self.index_changed = true;
        }
        loop {
            self.pending
                .extend((old_len..self.begin).map(|b| (b, true)));
            old_len = self.begin;
            self.drain_pending();
            // `metadata_ll_commit` within the loop: the index copied to
            // the next block unless it is this transaction's already.
            if self.index_changed && !self.index_fresh {
                let new = self.begin;
                self.begin += 1;
                let prev = std::mem::replace(&mut self.index_root, new);
                self.pending.push_back((prev, false));
                self.index_fresh = true;
            }
            if old_len == self.begin {
                break;
            }
        }
        self.bootstrap = false;
    }

    /// Apply the count changes waiting, in order (`apply_bops`).
    /// Without an owner to make them (a change made on the map itself,
    /// or its growth), reference count tree changes wait for the next
    /// [`Self::next_todo`]; the metadata space map's owner makes them at
    /// once instead (`Tm::inc`).
    fn drain_pending(&mut self) {
        self.applying = true;
        while let Some((b, inc)) = self.pending.pop_front() {
            let rc = self.apply(b, inc);
            self.todo.extend(rc.map(Todo::Rc));
        }
        self.applying = false;
    }

    /// Bitmap `i`'s `none_free_before`.
    pub fn none_free_before(&self, i: usize) -> u32 {
        self.nfb[i]
    }

    /// The `none_free_before` of each bitmap, as read from its index
    /// entry.
    pub(super) fn set_none_free_before(&mut self, nfb: Vec<u32>) {
        if nfb.len() == self.nfb.len() {
            self.nfb = nfb;
        }
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

    /// The space map's own commit (`sm_metadata_commit`,
    /// `sm_disk_commit`): the counts now are the committed ones. Its
    /// blocks stay made in this transaction until
    /// [`SpaceMap::committed`].
    pub fn sm_committed(&mut self) {
        self.before.clear();
        self.blocks_at_commit = self.nr_blocks();
        self.allocated_at_commit = self.allocated;
        self.new_this_transaction = 0;
        self.index_changed = false;
    }

    /// The transaction is on disk (`dm_tm_commit`): every block is the
    /// last commit's, changed again only through a copy.
    pub fn committed(&mut self) {
        self.sm_committed();
        self.fresh.iter_mut().for_each(|f| *f = false);
        self.index_fresh = false;
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
        sm.inc(1);
        assert_eq!(sm.dec(1), Ok(3));
        assert_eq!(sm.dec(1), Ok(2));
        let rc: Vec<RcOp> = std::iter::from_fn(|| sm.next_todo())
            .filter_map(|t| match t {
                Todo::Rc(op) => Some(op),
                _ => None,
            })
            .collect();
        assert_eq!(
            rc,
            vec![
                RcOp::Insert(1),
                RcOp::Set(1, 4),
                RcOp::Set(1, 3),
                RcOp::Remove(1)
            ]
        );
    }
}
