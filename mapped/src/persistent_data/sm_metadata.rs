//! The metadata space map read back and committed
//! (`persistent-data/dm-space-map-metadata.c`): the space map that
//! counts the metadata device's blocks, its own blocks among them. Its
//! bitmaps are indexed by one index block (`struct
//! disk_metadata_index`), not a btree, so committing it changes no
//! btree but its reference count tree.

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
    load(tm, root, &index)
}

/// Commit `tm.meta`: it counts the blocks that hold it, so new blocks
/// for its changed bitmaps are taken until taking them changes no bitmap
/// that has not got one yet. Returns the root the superblock records.
pub fn commit(tm: &mut Tm) -> Result<SmRoot, PdError> {
    if tm.meta.rc_root != 0 {
        let old = tm.meta.rc_root;
        btree::del(tm, old, &mut Le32)?;
    }
    if tm.meta.index_root != 0 {
        let old = tm.meta.index_root;
        tm.meta.dec(old)?;
    }
    let overflow = tm.meta.overflow();
    let rc_root = btree::build(tm, &overflow, &mut Le32)?;
    let index_block = tm.meta.alloc().ok_or(PdError::NoMetadataSpace)?;
    let meta = &mut tm.meta;
    loop {
        let mut changed = false;
        for i in 0..meta.nr_bitmaps() {
            if (meta.dirty[i] || meta.bitmap_blocks[i] == 0) && !meta.fresh[i] {
                let new = meta.alloc().ok_or(PdError::NoMetadataSpace)?;
                let old = std::mem::replace(&mut meta.bitmap_blocks[i], new);
                if old != 0 {
                    meta.dec(old)?;
                }
                meta.fresh[i] = true;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
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
    tm.meta.index_root = index_block;
    tm.meta.rc_root = rc_root;
    Ok(sm_root(&tm.meta, index_block, rc_root))
}
