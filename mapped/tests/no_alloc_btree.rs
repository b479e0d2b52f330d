//! A persistent-data btree lookup allocates nothing once the nodes on
//! its path are in the transaction manager's cache: it walks the cached
//! nodes and returns the value by copy (`persistent_data/btree.rs`). A
//! counting global allocator (this test binary only) watches lookups of
//! present and absent keys in a three-level tree read back from its
//! device, and thin's `find_block` (the mapping cache, and the btrees
//! behind it) after a warm-up pass. Removal in place
//! (`persistent_data/btree_remove.rs`) allocates nothing once the nodes
//! it changes were shadowed, and a long range removal allocates per node
//! it first changes, not per key.
//!
//! It has its own `main` (`harness = false`), as `mq/tests/no_alloc.rs`:
//! the counter is process-wide, and libtest's runner thread allocates
//! while a test runs.

use blkstack_core::testing::CountingAlloc;
use blkstack_mapped::persistent_data::block_manager::BlockManager;
use blkstack_mapped::persistent_data::btree;
use blkstack_mapped::persistent_data::btree_remove;
use blkstack_mapped::persistent_data::space_map::SpaceMap;
use blkstack_mapped::persistent_data::tm::Tm;
use blkstack_mapped::persistent_data::value_type::Le64;
use blkstack_mapped::targets::thin::metadata::PoolMetadata;
use blkstack_mapped::{DevArg, Registry};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// Metadata device size: 32 MiB, 8192 blocks.
const META_SECTORS: u64 = 65536;
/// Keys in the tree: more than one internal level of 8-byte values
/// holds (252 per node, a third full at least), so lookups go three deep.
const KEYS: u64 = 100_000;

fn metadata_dev(reg: &Registry, name: &str) -> DevArg {
    let dev = reg
        .create(name, &format!("0 {META_SECTORS} memory"))
        .expect("a memory device");
    DevArg {
        name: name.into(),
        minor: 0,
        dev,
    }
}

/// Allocations made by `f`; the first ones' backtraces are printed.
fn allocations(f: impl FnOnce()) -> u64 {
    CountingAlloc::trace_start();
    let before = CountingAlloc::count();
    f();
    let after = CountingAlloc::count();
    for t in CountingAlloc::trace_take() {
        println!("allocated at:\n{t}");
    }
    after - before
}

/// Every other key of `0..2 * KEYS`, each mapped to `key * 3`, written
/// to the device, then the cache dropped: the first pass reads every
/// node back, the second finds them all cached.
fn btree_lookups(reg: &Registry) {
    let arg = metadata_dev(reg, "btree");
    let mut tm = Tm::new(BlockManager::new(arg.dev), SpaceMap::new(META_SECTORS / 8));
    let mut root = btree::build(&mut tm, &[], &mut Le64).expect("empty tree");
    for k in 0..KEYS {
        root = btree::insert_value(&mut tm, root, k * 2, &mut Le64, k * 6).expect("insert");
    }
    tm.write_shadows().expect("write the nodes");
    tm.committed();
    tm.drop_cache();
    let pass = |tm: &mut Tm| {
        let mut found = 0u64;
        for k in 0..2 * KEYS {
            let v = btree::lookup::<Le64>(tm, root, k).expect("lookup");
            match v {
                Some(v) => {
                    assert_eq!(v, k * 3, "key {k}");
                    found += 1;
                }
                None => assert!(k % 2 == 1, "key {k} is in the tree"),
            }
        }
        let span = btree::leaf_span::<Le64>(tm, root, KEYS).expect("leaf span");
        assert_eq!(span.value::<Le64>(KEYS), Some(KEYS * 3));
        assert_eq!(found, KEYS);
    };
    pass(&mut tm);
    assert_eq!(allocations(|| pass(&mut tm)), 0, "btree lookups");
    println!("btree lookup allocates nothing ... ok");
}

/// The tree of [`btree_lookups`], committed; then removals. The first
/// shadows the path to its leaf and that leaf's and its parent's
/// siblings; more keys from the middle of the same leaf move entries
/// among those nodes only. A range of half the keys then shadows each
/// leaf it empties once.
fn btree_removals(reg: &Registry) {
    let arg = metadata_dev(reg, "removal");
    let mut tm = Tm::new(BlockManager::new(arg.dev), SpaceMap::new(META_SECTORS / 8));
    let mut root = btree::build(&mut tm, &[], &mut Le64).expect("empty tree");
    for k in 0..KEYS {
        root = btree::insert_value(&mut tm, root, k * 2, &mut Le64, k * 6).expect("insert");
    }
    tm.write_shadows().expect("write the nodes");
    tm.committed();
    // Ascending inserts leave leaves of 126 keys: this is the middle of
    // the 41st.
    let middle = 252 * 40 + 126;
    let (r, v) = btree_remove::remove(&mut tm, root, middle, &mut Le64).expect("remove");
    assert_eq!(v, Some(middle * 3));
    root = r;
    let n = allocations(|| {
        for k in 1..=20 {
            let key = middle + 2 * k;
            let (r, v) = btree_remove::remove(&mut tm, root, key, &mut Le64).expect("remove");
            assert_eq!(v, Some(key * 3));
            root = r;
        }
    });
    assert_eq!(n, 0, "removals from shadowed nodes");
    println!("btree removal from shadowed nodes allocates nothing ... ok");
    let (begin, end) = (KEYS / 5, KEYS * 6 / 5);
    // Counted without backtraces: some allocations are expected here.
    let before = CountingAlloc::count();
    let done = btree_remove::remove_range(&mut tm, root, begin, end, &mut Le64, &mut |_, _| {})
        .expect("remove range");
    let n = CountingAlloc::count() - before;
    let (removed, root) = (done.count, done.root);
    assert_eq!(removed, (end - begin) / 2);
    assert!(n * 10 < removed, "{n} allocations to remove {removed} keys");
    assert_eq!(
        btree::first_key_from(&mut tm, root, begin).expect("next"),
        Some(end)
    );
    println!("btree range removal allocates per node, not per key ({n} for {removed}) ... ok");
}

/// A thin device with `KEYS / 4` mapped blocks and a snapshot of it:
/// `find_block` on both, mapped and unmapped blocks, after a warm pass.
fn thin_find_block(reg: &Registry) {
    let arg = metadata_dev(reg, "thin");
    let mut md = PoolMetadata::open(arg, 1 << 20, 128).expect("format");
    md.create_thin(1).expect("create");
    for v in 0..KEYS / 4 {
        let b = md.alloc_data_block().expect("space");
        md.insert_block(1, v * 3, b).expect("insert");
    }
    md.create_snap(2, 1).expect("snapshot");
    md.commit().expect("commit");
    let pass = |md: &mut PoolMetadata| {
        let mut mapped = 0u64;
        for dev in [1, 2] {
            for v in 0..KEYS * 3 / 4 {
                if md.find_block(dev, v).expect("lookup").is_some() {
                    mapped += 1;
                }
            }
        }
        assert_eq!(mapped, KEYS / 2);
    };
    pass(&mut md);
    assert_eq!(allocations(|| pass(&mut md)), 0, "thin find_block");
    println!("thin find_block allocates nothing ... ok");
}

/// The counter is process-wide, so the cases run one after another on
/// the only thread of this process.
fn main() {
    let reg = Registry::new();
    btree_lookups(&reg);
    btree_removals(&reg);
    thin_find_block(&reg);
    reg.remove_all();
}
