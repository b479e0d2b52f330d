//! A disk space map read back and committed (`persistent-data/
//! dm-space-map-disk.c`, `dm-space-map-common.c` `sm_ll_open_disk`,
//! `sm_ll_commit`): its bitmaps, indexed by a btree of index entries,
//! and a btree of the counts above 2. dm-thin counts its data blocks in
//! one; the metadata blocks it lives in are counted by the metadata
//! space map (`sm_metadata.rs`).

use super::bitmap::{self, IndexEntry, SmRoot, ENTRIES_PER_BITMAP};
use super::btree;
use super::space_map::SpaceMap;
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
    load(tm, root, &index)
}

/// A space map's counts from the bitmaps `index` names and its reference
/// count tree; it remembers where its index and tree were.
pub(super) fn load(tm: &mut Tm, root: SmRoot, index: &[IndexEntry]) -> Result<SpaceMap, PdError> {
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
    let mut sm = SpaceMap::loaded(counts, blocks);
    sm.index_root = root.bitmap_root;
    sm.rc_root = root.ref_count_root;
    Ok(sm)
}

/// The index entry of `sm`'s bitmap `i`.
pub(super) fn index_entry(sm: &SpaceMap, i: usize) -> IndexEntry {
    let counts = sm.bitmap_counts(i);
    let used = counts.iter().filter(|&&c| c > 0).count() as u32;
    let first_free = counts.iter().position(|&c| c == 0).unwrap_or(counts.len());
    IndexEntry {
        blocknr: sm.bitmap_blocks[i],
        nr_free: ENTRIES_PER_BITMAP as u32 - used,
        none_free_before: first_free as u32,
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

/// Commit `sm` (`sm_disk_commit`): its changed bitmaps to new metadata
/// blocks, a new index tree and reference count tree; the old ones are
/// dropped. Returns the root the superblock records.
pub fn commit(tm: &mut Tm, sm: &mut SpaceMap) -> Result<SmRoot, PdError> {
    for i in 0..sm.nr_bitmaps() {
        if sm.dirty[i] || sm.bitmap_blocks[i] == 0 {
            let new = tm.meta.alloc().ok_or(PdError::NoMetadataSpace)?;
            let old = std::mem::replace(&mut sm.bitmap_blocks[i], new);
            if old != 0 {
                tm.meta.dec(old)?;
            }
            tm.queue_raw(new, bitmap::encode(sm.bitmap_counts(i), new));
        }
    }
    let index: Vec<(u64, IndexEntry)> = (0..sm.nr_bitmaps())
        .map(|i| (i as u64, index_entry(sm, i)))
        .collect();
    let index_root = btree::build(tm, &index, &mut IndexEntries)?;
    let rc_root = btree::build(tm, &sm.overflow(), &mut Le32)?;
    if sm.index_root != 0 {
        btree::del(tm, sm.index_root, &mut IndexEntries)?;
    }
    if sm.rc_root != 0 {
        btree::del(tm, sm.rc_root, &mut Le32)?;
    }
    sm.index_root = index_root;
    sm.rc_root = rc_root;
    Ok(sm_root(sm, index_root, rc_root))
}
