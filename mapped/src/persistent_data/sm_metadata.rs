//! The metadata space map read back and committed
//! (`persistent-data/dm-space-map-metadata.c`): the space map that
//! counts the metadata device's blocks, its own blocks among them. Its
//! bitmaps are indexed by one index block (`struct
//! disk_metadata_index`), not a btree, so committing it changes no
//! btree. Its reference count tree changes as counts above 2 do, inside
//! the count change as the kernel's `sm_ll_inc`/`sm_ll_dec` make them
//! (`Tm::inc`). Its blocks are handed out in the kernel's order
//! (`space_map.rs`).

use super::bitmap::{self, SmRoot, ENTRIES_PER_BITMAP};
use super::btree;
use super::sm_disk::{index_entry, load, sm_root};
use super::space_map::{RcOp, SpaceMap, Todo};
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

/// Make `op` in the reference count tree at `root` as the kernel's
/// `sm_ll_inc`/`sm_ll_dec` do; returns the tree's new root. A count
/// leaving the tree is first looked up through its leaf, which the
/// kernel shadows before it removes the entry (`__sm_ll_dec_overflow`).
///
/// A space map with no tree (root 0: a bare map that was neither
/// formatted nor opened, which only tests make) keeps its counts in
/// memory alone.
pub(super) fn apply_rc(tm: &mut Tm, root: u64, op: RcOp) -> Result<u64, PdError> {
    if root == 0 {
        return Ok(0);
    }
    match op {
        RcOp::Insert(b) => btree::insert_value(tm, root, b, &mut Le32, 3),
        RcOp::Set(b, c) => btree::overwrite(tm, root, b, &mut Le32, c),
        RcOp::Remove(b) => {
            let root = btree::overwrite(tm, root, b, &mut Le32, 3)?;
            btree::remove(tm, root, b, &mut Le32)
        }
    }
}

/// Make the reference count tree changes a bare count change left
/// waiting: a change made on the map itself rather than through the
/// transaction manager (which makes them at once, `Tm::inc`), as a
/// growth of the map or a bare map in tests does. The tree's own
/// blocks change counts too: their changes are made in turn.
pub fn flush_rc(tm: &mut Tm) -> Result<(), PdError> {
    if !tm.begin_rc_flush() {
        return Ok(());
    }
    let r = (|| {
        // The metadata space map leaves nothing else to do (its index
        // is one block, its bitmaps' copies its own).
        while let Some(t) = tm.meta.next_todo() {
            if let Todo::Rc(op) = t {
                let root = tm.meta.rc_root;
                tm.meta.rc_root = apply_rc(tm, root, op)?;
            }
        }
        Ok(())
    })();
    tm.end_rc_flush();
    r
}

/// Commit `tm.meta` (`sm_metadata_commit`, `metadata_ll_commit`): when a
/// count changed in this transaction the index block is copied (unless
/// it was made in it), and the bitmaps changed in it are written with
/// the index. Returns the root the superblock records.
pub fn commit(tm: &mut Tm) -> Result<SmRoot, PdError> {
    flush_rc(tm)?;
    let rc_root = tm.meta.rc_root;
    let meta = &tm.meta;
    if !meta.index_changed && !meta.index_fresh {
        return Ok(sm_root(meta, meta.index_root, rc_root));
    }
    if !tm.meta.index_fresh {
        // `metadata_ll_commit`'s `dm_tm_shadow_block`: the new block,
        // then the old one let go.
        let new = tm.alloc()?;
        let old = std::mem::replace(&mut tm.meta.index_root, new);
        tm.dec(old)?;
        tm.meta.index_fresh = true;
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
