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
