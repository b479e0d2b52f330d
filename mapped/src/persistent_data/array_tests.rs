//! Arrays and bitsets against a model: resizes across block boundaries,
//! sets, copy-on-write of a committed array block, the header bytes as
//! the kernel lays them out, and every block let go when the array is.

use super::array::*;
use super::block_manager::BlockManager;
use super::btree;
use super::space_map::SpaceMap;
use super::tm::Tm;
use super::value_type::{Le32, Le64};
use super::{bitset, le32, le64};

fn tm() -> Tm {
    let reg = crate::Registry::new();
    let dev = reg
        .create("meta", "0 65536 memory")
        .expect("a memory device");
    Tm::new(BlockManager::new(dev), SpaceMap::new(8192))
}

fn all(tm: &mut Tm, root: u64) -> Vec<u32> {
    let mut out = Vec::new();
    walk::<Le32>(tm, root, u64::MAX, &mut |i, v| {
        assert_eq!(i, out.len() as u64);
        out.push(v)
    })
    .expect("walk");
    out
}

#[test]
fn resizes_and_sets_follow_a_model() {
    let mut tm = tm();
    let base = tm.meta.nr_allocated();
    let mut root = empty(&mut tm, &mut Le32).expect("empty");
    let mut model: Vec<u32> = Vec::new();
    let max = max_entries(4);
    assert_eq!(max, 1018);
    for (len, fill) in [
        (5u32, 7u32),
        (max, 8),
        (3 * max + 17, 9),
        (max + 1, 0),
        (2, 1),
        (0, 0),
        (2500, 3),
    ] {
        root = resize(&mut tm, root, model.len() as u32, len, &mut Le32, &fill).expect("resize");
        model.resize(len as usize, fill);
        assert_eq!(all(&mut tm, root), model, "after resize to {len}");
        for i in (0..len as u64).step_by(97) {
            let v = (i as u32).wrapping_mul(31);
            root = set(&mut tm, root, i, &mut Le32, &v).expect("set");
            model[i as usize] = v;
        }
        assert_eq!(all(&mut tm, root), model);
        for i in [0, len as u64 / 2, len as u64] {
            assert_eq!(
                get::<Le32>(&mut tm, root, i).expect("get"),
                model.get(i as usize).copied()
            );
        }
    }
    assert!(
        set(&mut tm, root, 2500, &mut Le32, &1).is_err(),
        "past the end"
    );
    del(&mut tm, root, &mut Le32).expect("del");
    assert_eq!(tm.meta.nr_allocated(), base, "every block let go");
}

#[test]
fn a_committed_block_is_copied_before_a_change_and_the_header_is_the_kernels() {
    let mut tm = tm();
    let mut root = empty(&mut tm, &mut Le32).expect("empty");
    root = resize(&mut tm, root, 0, 10, &mut Le32, &4).expect("resize");
    let b0 = btree::lookup::<Blocks<Le32>>(&mut tm, root, 0)
        .expect("lookup")
        .expect("block 0");
    tm.write_shadows().expect("write");
    tm.committed();
    let raw = tm.read_block(b0).expect("read");
    // struct array_block: csum, max_entries, nr_entries, value_size, blocknr.
    assert_eq!(
        (le32(&raw, 4), le32(&raw, 8), le32(&raw, 12)),
        (1018, 10, 4)
    );
    assert_eq!(le64(&raw, 16), b0);
    assert_eq!(le32(&raw, 0), !crc32c::crc32c(&raw[4..]) ^ 595846735);
    assert_eq!(le32(&raw, HEADER_SIZE + 9 * 4), 4);
    assert_eq!(
        le32(&raw, HEADER_SIZE + 10 * 4),
        0,
        "past nr_entries stays zero"
    );
    check(&raw, b0).expect("the validator takes it");
    assert!(check(&raw, b0 + 1).is_err(), "a misplaced block is refused");

    let new_root = set(&mut tm, root, 3, &mut Le32, &99).expect("set");
    let b1 = btree::lookup::<Blocks<Le32>>(&mut tm, new_root, 0)
        .expect("lookup")
        .expect("block 0");
    assert_ne!(b1, b0, "the committed block was shadowed");
    assert_eq!(
        tm.meta.get(b0),
        0,
        "the old copy is free once the tree lets go"
    );
    assert_eq!(
        le32(&tm.read_block(b0).expect("read"), HEADER_SIZE + 3 * 4),
        4,
        "the committed copy is untouched"
    );
    // A second change in the same transaction changes the copy in place.
    let again = set(&mut tm, new_root, 4, &mut Le32, &98).expect("set");
    assert_eq!(again, new_root);
    assert_eq!(get::<Le32>(&mut tm, again, 3).expect("get"), Some(99));
    assert_eq!(get::<Le32>(&mut tm, again, 4).expect("get"), Some(98));
}

#[test]
fn a_bitset_sets_tests_and_loads_its_bits() {
    let mut tm = tm();
    let base = tm.meta.nr_allocated();
    let n = 100_000u64;
    let mut root = bitset::empty(&mut tm).expect("empty");
    root = bitset::resize(&mut tm, root, 0, n, false).expect("resize");
    let marked: Vec<u64> = (0..n).filter(|b| b % 777 == 5 || *b == n - 1).collect();
    for &b in &marked {
        root = bitset::set_bit(&mut tm, root, b).expect("set");
    }
    for b in [0, 5, 6, 782, n - 1, n - 2] {
        assert_eq!(
            bitset::test_bit(&mut tm, root, b).expect("test"),
            marked.contains(&b),
            "bit {b}"
        );
    }
    assert!(bitset::test_bit(&mut tm, root, n + 64).is_err());
    let words = bitset::load(&mut tm, root, n).expect("load");
    let set: Vec<u64> = (0..n)
        .filter(|b| words[(b / 64) as usize] & (1 << (b % 64)) != 0)
        .collect();
    assert_eq!(set, marked);
    root = bitset::clear_bit(&mut tm, root, 5).expect("clear");
    assert!(!bitset::test_bit(&mut tm, root, 5).expect("test"));
    let ones = bitset::resize(&mut tm, root, n, n + 200, true).expect("grow");
    assert!(bitset::test_bit(&mut tm, ones, n + 150).expect("test"));
    bitset::del(&mut tm, ones).expect("del");
    assert_eq!(tm.meta.nr_allocated(), base);
    let _ = Le64;
}
