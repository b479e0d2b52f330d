//! The metadata space map read back and committed
//! (`persistent-data/dm-space-map-metadata.c`): the space map that
//! counts the metadata device's blocks, its own blocks among them. Its
//! bitmaps are indexed by one index block (`struct
//! disk_metadata_index`), not a btree, so committing it changes no
//! btree but its reference count tree. Its blocks are handed out in the
//! kernel's order (`space_map.rs`).

use super::bitmap::{self, SmRoot, ENTRIES_PER_BITMAP};
use super::btree;
use super::sm_disk::{index_entry, load, sm_root};
use super::space_map::SpaceMap;
use super::tm::Tm;
use super::value_type::Le32;
use super::PdError;

/// Open the metadata space map whose root a superblock holds
/// (`dm_sm_metadata_open`). `tm.meta` must already cover `root`'s
/// blocks: its reference count tree's nodes are checked against it.
pub fn open(tm: &mut Tm, root: SmRoot) -> Result<SpaceMap, PdError> {
    let n = root.nr_blocks.div_ceil(ENTRIES_PER_BITMAP) as usize;
    let raw = tm.read_block(root.bitmap_root)?;
    let index = bitmap::decode_index(&raw, root.bitmap_root, n)?;
    load(tm, root, &index, true)
}

/// The reference count tree anew when a count above 2 changed in this
/// transaction (the kernel changes it entry by entry as counts change).
pub(super) fn rewrite_overflow(tm: &mut Tm, sm: Option<&mut SpaceMap>) -> Result<u64, PdError> {
    let (changed, old, overflow) = match &sm {
        Some(sm) => (sm.overflow_changed, sm.rc_root, sm.overflow()),
        None => (
            tm.meta.overflow_changed,
            tm.meta.rc_root,
            tm.meta.overflow(),
        ),
    };
    if !changed && old != 0 {
        return Ok(old);
    }
    let new = btree::build(tm, &overflow, &mut Le32)?;
    if old != 0 {
        btree::del(tm, old, &mut Le32)?;
    }
    match sm {
        Some(sm) => sm.rc_root = new,
        None => tm.meta.rc_root = new,
    }
    Ok(new)
}

/// Commit `tm.meta` (`sm_metadata_commit`, `metadata_ll_commit`): when a
/// count changed in this transaction the index block is copied (unless
/// it was made in it), and the bitmaps changed in it are written with
/// the index. Returns the root the superblock records.
pub fn commit(tm: &mut Tm) -> Result<SmRoot, PdError> {
    let rc_root = rewrite_overflow(tm, None)?;
    let meta = &mut tm.meta;
    if !meta.index_changed && !meta.index_fresh {
        return Ok(sm_root(meta, meta.index_root, rc_root));
    }
    if !meta.index_fresh {
        let new = meta.alloc().ok_or(PdError::NoMetadataSpace)?;
        let old = std::mem::replace(&mut meta.index_root, new);
        meta.dec(old)?;
        meta.index_fresh = true;
    }
    let index_block = tm.meta.index_root;
    let mut index = Vec::with_capacity(tm.meta.nr_bitmaps());
    for i in 0..tm.meta.nr_bitmaps() {
        if tm.meta.fresh[i] {
            let b = tm.meta.bitmap_blocks[i];
            let raw = bitmap::encode(tm.meta.bitmap_counts(i), b);
            tm.queue_raw(b, raw);
        }
        index.push(index_entry(&tm.meta, i));
    }
    tm.queue_raw(index_block, bitmap::encode_index(&index, index_block));
    tm.meta.sm_committed();
    Ok(sm_root(&tm.meta, index_block, rc_root))
}
