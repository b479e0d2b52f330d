//! The kernel's allocation order, step by step, as read from
//! `dm-space-map-metadata.c` (6.12) and `dm-space-map-common.c`: the
//! bootstrap's blocks, the cursor that goes on across commits, the
//! bitmap copied on its first change in a transaction right after the
//! block asked for, a block freed in the transaction kept until the
//! commit while one made and freed in it is reused, and the free count
//! the kernel reports before a commit. The kernel VM test
//! (`frontends/cli/tests/kernel_thin.rs`) is the judge of the whole.

use super::tm::Tm;
use super::value_type::Le64;
use super::{btree, commit, format, open, SUPERBLOCK};

fn dev() -> blkstack_core::DeviceRef {
    let reg = crate::Registry::new();
    reg.create("meta", "0 8192 memory")
        .expect("a memory device")
}

fn used(tm: &Tm) -> Vec<u64> {
    (0..tm.meta.nr_blocks())
        .filter(|&b| tm.meta.get(b) > 0)
        .collect()
}

fn sb(_root: super::bitmap::SmRoot) -> Vec<u8> {
    vec![0u8; super::BLOCK_SIZE]
}

#[test]
fn the_bootstrap_then_the_cursor_then_a_bitmap_copy() {
    let dev = dev();
    let mut tm = format(dev.clone(), 1024);
    // Superblock, index block, reference count root, the one bitmap.
    assert_eq!(used(&tm), vec![0, 1, 2, 3]);
    let root = btree::build(&mut tm, &[], &mut Le64).unwrap();
    assert_eq!(root, 4, "the bootstrap's cursor goes on");
    // The first commit writes the index block in place: it was made in
    // this transaction.
    commit(&mut tm, sb).unwrap();
    assert_eq!(used(&tm), vec![0, 1, 2, 3, 4]);
    assert_eq!(tm.meta.nr_free(), 1024 - 5);
    // A new transaction: the block asked for comes first, then the
    // bitmap's copy (the old bitmap is let go, not reused before the
    // commit); the kernel's free count does not see the freed block.
    let root = btree::insert_value(&mut tm, root, 7, &mut Le64, 70).unwrap();
    assert_eq!(root, 5, "the shadow of the root");
    assert_eq!(used(&tm), vec![0, 1, 2, 5, 6]);
    assert_eq!(tm.meta.nr_free(), 1024 - 5 - 2);
    // The commit copies the index block to the next free block.
    commit(&mut tm, sb).unwrap();
    assert_eq!(used(&tm), vec![0, 2, 5, 6, 7]);
    // The cursor is not reset by the commit: blocks 1, 3 and 4, free
    // since, wait for it to wrap.
    let b = tm.new_raw(vec![0u8; super::BLOCK_SIZE]).unwrap();
    assert_eq!(b, 8);
    assert_eq!(tm.meta.get(9), 1, "the bitmap's copy, after the block");
    assert_eq!(tm.meta.get(6), 0, "the old bitmap let go");
    // A block made and freed in the same transaction is free at once
    // (the kernel's free count still counts it handed out).
    tm.meta.dec(b).unwrap();
    tm.unqueue_raw(b);
    assert_eq!(tm.meta.nr_allocated(), 5);
    let again = tm.new_raw(vec![0u8; super::BLOCK_SIZE]).unwrap();
    assert_eq!(again, 10, "the cursor moved on past 8 and 9");
    assert_eq!(tm.meta.nr_free(), 1024 - 5 - 3);
}

#[test]
fn what_format_and_commit_leave_opens_again() {
    let dev = dev();
    let mut tm = format(dev.clone(), 1024);
    let root = btree::build(&mut tm, &[(1, 10), (2, 20)], &mut Le64).unwrap();
    let mut kept = None;
    commit(&mut tm, |r| {
        kept = Some(r);
        sb(r)
    })
    .unwrap();
    let r = kept.expect("the metadata space map's root");
    assert_eq!(r.nr_allocated, 5);
    let mut tm2 = open(dev, r).unwrap();
    assert_eq!(used(&tm2), used(&tm));
    assert_eq!(btree::lookup::<Le64>(&mut tm2, root, 2).unwrap(), Some(20));
    assert_eq!(tm2.meta.get(SUPERBLOCK), 1);
}

fn put(tm: &mut Tm, root: u64, k: u64) -> u64 {
    btree::insert_value(tm, root, k, &mut Le64, k).unwrap()
}

/// The root's children: (block, first key, entries).
fn children(tm: &mut Tm, root: u64) -> Vec<(u64, u64, usize)> {
    let r = tm.node(root).unwrap();
    (0..r.len())
        .map(|i| {
            let b = r.value_u64(i);
            let n = tm.node(b).unwrap();
            (b, r.keys[i], n.len())
        })
        .collect()
}

#[test]
fn a_full_leaf_moves_entries_left_then_splits_in_two() {
    let mut tm = format(dev(), 1024);
    let mut root = btree::build(&mut tm, &[], &mut Le64).unwrap();
    commit(&mut tm, sb).unwrap();
    // 252 keys fill the root leaf (shadowed to 5, the bitmap to 6).
    for k in 0..252 {
        root = btree::insert_value(&mut tm, root, k, &mut Le64, k).unwrap();
    }
    assert_eq!(root, 5);
    // The 253rd splits the root beneath itself: the lower half to 7, the
    // upper to 8.
    root = btree::insert_value(&mut tm, root, 252, &mut Le64, 252).unwrap();
    assert_eq!(children(&mut tm, root), vec![(7, 0, 126), (8, 126, 127)]);
    // Leaf 8 full (126..378): its left sibling has room, so the two share
    // their entries (`rebalance_left`), nothing new allocated.
    for k in 253..=378 {
        root = btree::insert_value(&mut tm, root, k, &mut Le64, k).unwrap();
    }
    assert_eq!(children(&mut tm, root), vec![(7, 0, 189), (8, 189, 190)]);
    // Again and again while the left has 8 free entries: 441 -> 220/221,
    // 472 -> 236/236, 488 -> 244/244, 496 -> 248/248.
    for k in 379..=499 {
        root = btree::insert_value(&mut tm, root, k, &mut Le64, k).unwrap();
    }
    assert_eq!(children(&mut tm, root), vec![(7, 0, 248), (8, 248, 252)]);
    // The left has 4 free, there is no right sibling: one into two, the
    // upper half to a new block.
    root = btree::insert_value(&mut tm, root, 500, &mut Le64, 500).unwrap();
    assert_eq!(
        children(&mut tm, root),
        vec![(7, 0, 248), (8, 248, 126), (9, 374, 127)]
    );
    // Block 3, the bitmap before its copy to 6, and 4, the root before
    // its copy to 5, wait for the commit.
    assert_eq!(used(&tm), vec![0, 1, 2, 5, 6, 7, 8, 9]);
}

#[test]
fn a_full_middle_leaf_splits_two_into_three_or_moves_entries_right() {
    let mut tm = format(dev(), 1024);
    let mut root = btree::build(&mut tm, &[], &mut Le64).unwrap();
    // Rising keys (every fourth): each full last leaf fills its left
    // sibling to 248, then splits in two (the root's halves at 5 and 6,
    // then 7, 8, 9).
    for k in 0..=996u64 {
        root = put(&mut tm, root, 4 * k);
    }
    let want = vec![
        (5, 0, 248),
        (6, 992, 248),
        (7, 1984, 248),
        (8, 2976, 126),
        (9, 3480, 127),
    ];
    assert_eq!(children(&mut tm, root), want);
    // Leaf 6 filled: both siblings have 4 free entries, under the
    // threshold, so 5 and 6 share their 500 entries with a new leaf 10
    // between them, a third each (166, 167, 167), and the key goes to
    // the middle one.
    for k in [993, 994, 995, 997] {
        root = put(&mut tm, root, k);
    }
    root = put(&mut tm, root, 998);
    let want = vec![
        (5, 0, 166),
        (10, 664, 168),
        (6, 1316, 167),
        (7, 1984, 248),
        (8, 2976, 126),
        (9, 3480, 127),
    ];
    assert_eq!(children(&mut tm, root), want);
    // Leaf 8 filled: its left sibling has 4 free, its right 125, so the
    // two on the right share their entries (189 and 190).
    for k in 744..870u64 {
        root = put(&mut tm, root, 4 * k + 1);
    }
    root = put(&mut tm, root, 2978);
    let got = children(&mut tm, root);
    assert_eq!(got[4..], [(8, 2976, 190), (9, 3353, 190)]);
    assert_eq!(used(&tm), (0..=10).collect::<Vec<_>>());
}

#[test]
fn a_count_above_two_goes_into_the_reference_count_tree_as_it_changes() {
    let dev = dev();
    let mut tm = format(dev.clone(), 1024);
    let root = btree::build(&mut tm, &[], &mut Le64).unwrap();
    assert_eq!(root, 4);
    commit(&mut tm, sb).unwrap();
    // Two more references to 4: the first copies the bitmap (3 to 5), the
    // second takes the count to 3, which the reference count tree takes:
    // its root (2, committed) copied to 6.
    tm.inc(4).unwrap();
    tm.inc(4).unwrap();
    let mut kept = None;
    commit(&mut tm, |r| {
        kept = Some(r);
        sb(r)
    })
    .unwrap();
    let r = kept.unwrap();
    assert_eq!((r.ref_count_root, r.bitmap_root), (6, 7));
    assert_eq!(used(&tm), vec![0, 4, 5, 6, 7]);
    assert_eq!(
        btree::walk::<super::value_type::Le32>(&mut tm, 6).unwrap(),
        vec![(4, 3)]
    );
    // What the commit wrote opens again with the count.
    let again = open(dev.clone(), r).unwrap();
    assert_eq!(again.meta.get(4), 3);
    // Back to 2: the bitmap copied first (5 to 8), then the entry's leaf
    // (6 to 9) before the entry is removed; the index to 10.
    tm.dec(4).unwrap();
    commit(&mut tm, |r| {
        kept = Some(r);
        sb(r)
    })
    .unwrap();
    let r = kept.unwrap();
    assert_eq!((r.ref_count_root, r.bitmap_root), (9, 10));
    assert_eq!(used(&tm), vec![0, 4, 8, 9, 10]);
    assert!(btree::walk::<super::value_type::Le32>(&mut tm, 9)
        .unwrap()
        .is_empty());
    assert_eq!(open(dev, r).unwrap().meta.get(4), 2);
}

#[test]
fn the_reference_count_tree_changes_before_a_block_freed_after_it() {
    let dev = dev();
    let mut tm = format(dev.clone(), 16);
    commit(&mut tm, sb).unwrap();
    assert_eq!(used(&tm), vec![0, 1, 2, 3]);
    // 4, its bitmap's copy (3 to 5), then 6 to 15: the cursor at the end.
    let raw = || vec![0u8; super::BLOCK_SIZE];
    let a = tm.new_raw(raw()).unwrap();
    assert_eq!(a, 4);
    let rest: Vec<u64> = (0..10).map(|_| tm.new_raw(raw()).unwrap()).collect();
    assert_eq!(rest, (6..16).collect::<Vec<_>>());
    // 9, made and freed in this transaction, is free at once.
    tm.unqueue_raw(9);
    assert_eq!(tm.dec(9).unwrap(), 0);
    // Block 4 counted 3: `sm_ll_inc_bitmap` inserts it into the reference
    // count tree at once, whose root (2, committed) is copied to the
    // first block free now and at the commit from the cursor, wrapped:
    // 9.
    tm.inc(a).unwrap();
    tm.inc(a).unwrap();
    assert_eq!(tm.meta.rc_root, 9);
    assert_eq!(tm.meta.get(2), 0, "the old root let go");
    // 7 freed after it: the next block is 7 (the cursor past 9 wraps
    // again). Were the tree changed at the next block handed out instead,
    // its root would take 7 and this block 9.
    tm.unqueue_raw(7);
    tm.dec(7).unwrap();
    assert_eq!(tm.new_raw(raw()).unwrap(), 7);
    // Room for the commit's copy of the index block.
    tm.unqueue_raw(12);
    tm.dec(12).unwrap();
    let mut kept = None;
    commit(&mut tm, |r| {
        kept = Some(r);
        sb(r)
    })
    .unwrap();
    let r = kept.unwrap();
    assert_eq!((r.ref_count_root, r.bitmap_root), (9, 12));
    assert_eq!(
        btree::walk::<super::value_type::Le32>(&mut tm, 9).unwrap(),
        vec![(4, 3)]
    );
    assert_eq!(open(dev, r).unwrap().meta.get(4), 3);
}

#[test]
fn a_grown_metadata_device_hands_out_blocks_from_its_old_end() {
    let reg = crate::Registry::new();
    let dev = reg
        .create("big", "0 160000 memory")
        .expect("a memory device");
    let per = super::bitmap::ENTRIES_PER_BITMAP;
    let mut tm = format(dev.clone(), per - 100);
    btree::build(&mut tm, &[], &mut Le64).unwrap();
    commit(&mut tm, sb).unwrap();
    assert_eq!(used(&tm), vec![0, 1, 2, 3, 4]);
    // Within the last bitmap nothing is handed out; the new blocks are
    // free after the commit.
    tm.meta.extend_metadata(per - 10);
    assert_eq!(used(&tm), vec![0, 1, 2, 3, 4]);
    assert_eq!(
        tm.meta.nr_free(),
        per - 105,
        "old_ll's size until the commit"
    );
    tm.meta.extend_metadata(20000);
    // The new bitmap at the old end, counted in the next round, which
    // copies bitmap 0 (that block is in it) to the next block; the index
    // copied after it; each block counted in the round after it was
    // handed out, until a round hands out nothing.
    let (b1, b0, index) = (per - 10, per - 9, per - 8);
    assert_eq!(used(&tm), vec![0, 2, 4, b1, b0, index]);
    assert_eq!(tm.meta.bitmap_blocks, vec![b0, b1]);
    assert_eq!(tm.meta.index_root, index);
    let mut kept = None;
    commit(&mut tm, |r| {
        kept = Some(r);
        sb(r)
    })
    .unwrap();
    assert_eq!(tm.meta.nr_free(), 20000 - 6);
    // The cursor goes on from there.
    assert_eq!(tm.new_raw(vec![0u8; super::BLOCK_SIZE]).unwrap(), index + 1);
    let again = open(dev, kept.unwrap()).unwrap();
    assert_eq!(again.meta.nr_blocks(), 20000);
    assert_eq!(used(&again), vec![0, 2, 4, b1, b0, index]);
}

#[test]
fn more_than_64_bitmaps_write_index_entries_back_as_the_cache_evicts_them() {
    use super::sm_disk::{self, IndexEntries};
    let per = super::bitmap::ENTRIES_PER_BITMAP;
    let dev = dev();
    let mut tm = format(dev.clone(), 1024);
    let mut data = sm_disk::create(&mut tm, 0).unwrap();
    sm_disk::commit(&mut tm, &mut data).unwrap();
    commit(&mut tm, sb).unwrap();
    let index = data.index_root;
    // Grown to 66 bitmaps (`dm_pool_resize_data_dev`): each new bitmap's
    // block, then its entry saved in the cache; bitmap 64's entry takes
    // bitmap 0's slot, so bitmap 0's goes into the index tree (its root
    // copied) before bitmap 65 gets its block.
    data.extend(65 * per + 1);
    sm_disk::shadow_bitmaps(&mut tm, &mut data).unwrap();
    let bm = data.bitmap_blocks.clone();
    assert_eq!(
        bm[1],
        bm[0] + 2,
        "the metadata bitmap's copy after the first"
    );
    assert!((1..65).all(|i| bm[i + 1] == bm[i] + 1 || i == 64));
    assert_eq!(data.index_root, bm[64] + 1);
    assert_eq!(bm[65], data.index_root + 1);
    assert_ne!(data.index_root, index);
    // Bitmap 65's entry took bitmap 1's slot in turn (the root a copy
    // now, changed in place).
    let entries = btree::walk::<IndexEntries>(&mut tm, data.index_root).unwrap();
    assert_eq!(entries.iter().map(|e| e.0).collect::<Vec<_>>(), vec![0, 1]);
    // A lookup goes through the cache as `sm_ll_lookup` does (the
    // discard passdown's `dm_pool_block_is_shared`): bitmap 0's entry
    // takes its slot back, so bitmap 64's dirty one goes into the tree;
    // a second lookup in bitmap 0 finds its entry cached.
    assert_eq!(data.lookup(5), 0);
    sm_disk::shadow_bitmaps(&mut tm, &mut data).unwrap();
    let entries = btree::walk::<IndexEntries>(&mut tm, data.index_root).unwrap();
    assert_eq!(
        entries.iter().map(|e| e.0).collect::<Vec<_>>(),
        vec![0, 1, 64]
    );
    let root = data.index_root;
    assert_eq!(data.lookup(6), 0);
    sm_disk::shadow_bitmaps(&mut tm, &mut data).unwrap();
    assert_eq!(data.index_root, root);
    // The commit writes the other 64 back, in slot order.
    let r = sm_disk::commit(&mut tm, &mut data).unwrap();
    let entries = btree::walk::<IndexEntries>(&mut tm, r.bitmap_root).unwrap();
    assert_eq!(entries.len(), 66);
    assert!(entries
        .iter()
        .enumerate()
        .all(|(i, e)| e.1.blocknr == bm[i]));
    commit(&mut tm, sb).unwrap();
    let again = sm_disk::open(&mut tm, r).unwrap();
    assert_eq!(again.nr_blocks(), 65 * per + 1);
}
