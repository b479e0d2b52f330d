//! A disk space map read back and committed (`persistent-data/
//! dm-space-map-disk.c`, `dm-space-map-common.c` `sm_ll_open_disk`,
//! `sm_ll_commit`): its bitmaps, indexed by a btree of index entries,
//! and a btree of the counts above 2, changed as they change. dm-thin counts its data blocks in
//! one; the metadata blocks it lives in are counted by the metadata
//! space map (`sm_metadata.rs`).

use super::bitmap::{self, IndexEntry, SmRoot, ENTRIES_PER_BITMAP};
use super::btree;
use super::space_map::{SpaceMap, Todo};
use super::tm::Tm;
use super::value_type::{Le32, ValueType};
use super::PdError;

/// A disk space map's index entries, the values of its index btree.
pub struct IndexEntries;

impl ValueType for IndexEntries {
    type Value = IndexEntry;
    const SIZE: usize = IndexEntry::SIZE;
    fn unpack(b: &[u8]) -> IndexEntry {
        IndexEntry::decode(b)
    }
    fn pack(v: &IndexEntry, out: &mut [u8]) {
        v.encode(out)
    }
}

/// Open the disk space map whose root a superblock holds
/// (`dm_sm_disk_open`): its counts, read from its bitmaps and reference
/// count tree.
pub fn open(tm: &mut Tm, root: SmRoot) -> Result<SpaceMap, PdError> {
    let entries = btree::walk::<IndexEntries>(tm, root.bitmap_root)?;
    let index: Vec<IndexEntry> = entries.into_iter().map(|(_, v)| v).collect();
    if index.len() as u64 != root.nr_blocks.div_ceil(ENTRIES_PER_BITMAP) {
        return Err(PdError::corrupt(
            root.bitmap_root,
            "data space map index has the wrong number of bitmaps",
        ));
    }
    load(tm, root, &index, false)
}

/// A space map's counts from the bitmaps `index` names and its reference
/// count tree; it remembers where its index and tree were.
pub(super) fn load(
    tm: &mut Tm,
    root: SmRoot,
    index: &[IndexEntry],
    self_counting: bool,
) -> Result<SpaceMap, PdError> {
    let mut counts = vec![0u32; root.nr_blocks as usize];
    let mut blocks = Vec::with_capacity(index.len());
    for (i, ie) in index.iter().enumerate() {
        let raw = tm.read_block(ie.blocknr)?;
        bitmap::check(&raw, ie.blocknr)?;
        let start = i * ENTRIES_PER_BITMAP as usize;
        let end = (start + ENTRIES_PER_BITMAP as usize).min(counts.len());
        for (j, c) in counts[start..end].iter_mut().enumerate() {
            *c = bitmap::get(&raw, j);
        }
        blocks.push(ie.blocknr);
    }
    for (b, v) in btree::walk::<Le32>(tm, root.ref_count_root)? {
        match counts.get_mut(b as usize) {
            Some(c) if *c == 3 => *c = v,
            _ => {
                return Err(PdError::corrupt(
                    root.ref_count_root,
                    "reference count of a block whose bitmap entry is not 3",
                ))
            }
        }
    }
    let mut sm = SpaceMap::loaded(counts, blocks, self_counting);
    sm.set_none_free_before(index.iter().map(|ie| ie.none_free_before).collect());
    sm.index_root = root.bitmap_root;
    sm.rc_root = root.ref_count_root;
    Ok(sm)
}

/// The index entry of `sm`'s bitmap `i`.
pub(super) fn index_entry(sm: &SpaceMap, i: usize) -> IndexEntry {
    let counts = sm.bitmap_counts(i);
    let used = counts.iter().filter(|&&c| c > 0).count() as u32;
    IndexEntry {
        blocknr: sm.bitmap_blocks[i],
        nr_free: ENTRIES_PER_BITMAP as u32 - used,
        none_free_before: sm.none_free_before(i),
    }
}

/// The root a superblock records for `sm`.
pub(super) fn sm_root(sm: &SpaceMap, bitmap_root: u64, ref_count_root: u64) -> SmRoot {
    SmRoot {
        nr_blocks: sm.nr_blocks(),
        nr_allocated: sm.nr_allocated(),
        bitmap_root,
        ref_count_root,
    }
}

/// `dm_sm_disk_create`: a disk space map of `nr_blocks` blocks, its
/// empty index and reference count trees made now (in that order), its
/// bitmaps at the next [`shadow_bitmaps`].
pub fn create(tm: &mut Tm, nr_blocks: u64) -> Result<SpaceMap, PdError> {
    let mut sm = SpaceMap::new(nr_blocks);
    sm.index_root = btree::build(tm, &[], &mut IndexEntries)?;
    sm.rc_root = btree::build(tm, &[], &mut Le32)?;
    Ok(sm)
}

/// Do what the count changes made to `sm` left to do, in the kernel's
/// order (`sm_ll_inc`/`sm_ll_dec`: the index entry loaded, the bitmap
/// copied on its first change in the transaction with `dm_tm_shadow_block`,
/// the counts above 2 changed in the reference count tree, the entry
/// saved; `sm_ll_extend`: each new bitmap's block, then its entry). An
/// entry loaded or saved into a cache slot that held another dirty entry
/// writes that one into the index tree first (`disk_ll_load_ie`,
/// `disk_ll_save_ie`). Called right after each change to `sm`, so the
/// metadata blocks are taken in the kernel's order; a bitmap left
/// without a block (no metadata space) waits for the next call (the
/// commit calls it last).
pub fn shadow_bitmaps(tm: &mut Tm, sm: &mut SpaceMap) -> Result<(), PdError> {
    super::sm_metadata::flush_rc(tm)?;
    while let Some(t) = sm.next_todo() {
        match t {
            Todo::Load(i) | Todo::Save(i) => {
                if let Some(j) = sm.ie_touch(i, matches!(t, Todo::Save(_))) {
                    write_back(tm, sm, j)?;
                }
            }
            Todo::Shadow(i) => {
                let Ok(new) = tm.alloc() else {
                    sm.requeue_todo(t);
                    return Err(PdError::NoMetadataSpace);
                };
                let old = sm.set_bitmap_block(i, new);
                if old != 0 {
                    tm.dec(old)?;
                }
            }
            Todo::Rc(op) => {
                sm.rc_root = super::sm_metadata::apply_rc(tm, sm.rc_root, op)?;
            }
        }
    }
    Ok(())
}

/// `ie_cache_writeback`: bitmap `i`'s index entry into the index tree.
fn write_back(tm: &mut Tm, sm: &mut SpaceMap, i: usize) -> Result<(), PdError> {
    let ie = index_entry(sm, i);
    sm.index_root = btree::insert_value(tm, sm.index_root, i as u64, &mut IndexEntries, ie)?;
    Ok(())
}

/// Commit `sm` (`sm_disk_commit`, `disk_ll_commit`): when a count
/// changed, each bitmap changed in the transaction is written and the
/// cached index entries still dirty go into the index tree, in the
/// cache's slot order. Returns the root the superblock records.
pub fn commit(tm: &mut Tm, sm: &mut SpaceMap) -> Result<SmRoot, PdError> {
    shadow_bitmaps(tm, sm)?;
    let rc_root = sm.rc_root;
    if sm.index_changed {
        for i in 0..sm.nr_bitmaps() {
            if sm.fresh[i] {
                let b = sm.bitmap_blocks[i];
                tm.queue_raw(b, bitmap::encode(sm.bitmap_counts(i), b));
            }
        }
        for i in sm.ie_take_dirty() {
            write_back(tm, sm, i)?;
        }
    }
    sm.sm_committed();
    Ok(sm_root(sm, sm.index_root, rc_root))
}
