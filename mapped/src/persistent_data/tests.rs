//! The btree over value types other than thin's: 4-byte values in a
//! tree three levels deep, and a value type whose references are
//! counted, through a shared root's shadowing (the kernel's
//! `inc_children`), an overwrite, and the deletion of a tree copy.

use super::block_manager::BlockManager;
use super::btree;
use super::space_map::SpaceMap;
use super::tm::Tm;
use super::value_type::{Le32, ValueType};
use super::{le64, PdError};
use std::collections::BTreeMap;

fn tm() -> Tm {
    let reg = crate::Registry::new();
    let dev = reg
        .create("meta", "0 65536 memory")
        .expect("a memory device");
    Tm::new(BlockManager::new(dev), SpaceMap::new(8192))
}

#[test]
fn small_values_in_a_deep_tree() {
    let mut tm = tm();
    let mut root = btree::build(&mut tm, &[], &mut Le32).expect("empty");
    // 336 values a leaf, 252 children an internal node: 3 levels.
    let n = 60_000u32;
    for k in (0..n).rev() {
        root = btree::insert_value(&mut tm, root, k as u64 * 2, &mut Le32, k).expect("insert");
    }
    for k in [0, 1, 2, 777, 2 * n as u64 - 2, 2 * n as u64] {
        let want = (k % 2 == 0 && k < 2 * n as u64).then_some(k as u32 / 2);
        assert_eq!(
            btree::lookup::<Le32>(&mut tm, root, k).expect("lookup"),
            want
        );
    }
    assert_eq!(
        btree::highest_key(&mut tm, root).expect("highest"),
        Some(2 * n as u64 - 2)
    );
    assert_eq!(
        btree::first_key_from(&mut tm, root, 777).expect("next"),
        Some(778)
    );
    let all = btree::walk::<Le32>(&mut tm, root).expect("walk");
    assert_eq!(all.len(), n as usize);
    assert!(all
        .iter()
        .enumerate()
        .all(|(i, &(k, v))| k == i as u64 * 2 && v == i as u32));
    // A leaf of 4-byte values is not read as 8-byte ones.
    assert!(btree::lookup::<super::value_type::Le64>(&mut tm, root, 0).is_err());
}

/// Values that are ids whose references are counted here.
struct Counted(BTreeMap<u64, i64>);

impl ValueType for Counted {
    type Value = u64;
    const SIZE: usize = 8;
    fn unpack(b: &[u8]) -> u64 {
        le64(b, 0)
    }
    fn pack(v: &u64, out: &mut [u8]) {
        out[..8].copy_from_slice(&v.to_le_bytes());
    }
    fn inc(&mut self, _tm: &mut Tm, v: &u64) -> Result<(), PdError> {
        *self.0.entry(*v).or_default() += 1;
        Ok(())
    }
    fn dec(&mut self, _tm: &mut Tm, v: &u64) -> Result<(), PdError> {
        *self.0.entry(*v).or_default() -= 1;
        Ok(())
    }
}

#[test]
fn shared_nodes_count_their_values_once_per_copy() {
    let mut tm = tm();
    let mut vt = Counted(BTreeMap::new());
    let entries: Vec<(u64, u64)> = (0..1000).map(|k| (k, 10_000 + k)).collect();
    let root = btree::build(&mut tm, &entries, &mut vt).expect("build");
    assert!(vt.0.values().all(|&c| c == 1));
    tm.write_shadows().expect("write");
    tm.committed();
    // A second reference to the tree (a snapshot), then a change to one
    // copy: the leaf on the changed path is copied, and its values gain
    // a reference each; the overwritten value loses the one it had here.
    tm.meta.inc(root);
    let changed = btree::insert_value(&mut tm, root, 5, &mut vt, 99).expect("insert");
    assert_ne!(changed, root, "a shared root is shadowed");
    assert_eq!(
        vt.0.get(&99),
        None,
        "the new value's reference is the caller's"
    );
    assert_eq!(vt.0[&10_005], 1, "the snapshot still holds the old value");
    let copied = vt.0.values().filter(|&&c| c == 2).count();
    assert!(
        copied > 0 && copied < 1000,
        "one leaf's values were copied: {copied}"
    );
    // Dropping the snapshot releases what only it held.
    btree::del(&mut tm, root, &mut vt).expect("del");
    assert_eq!(vt.0[&10_005], 0);
    assert!(vt
        .0
        .iter()
        .all(|(&v, &c)| c == i64::from(v != 10_005 && v != 99)));
    assert_eq!(
        btree::lookup::<Counted>(&mut tm, changed, 5).expect("lookup"),
        Some(99)
    );
    assert_eq!(tm.meta.get(root), 0, "the old root is free");
}

/// The layering the module documentation promises: nothing here uses
/// the target layer, so cache and era can build on it as thin does.
#[test]
fn persistent_data_imports_no_target() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/persistent_data");
    // Built so this file does not match its own needles.
    let needles = [
        ["crate", "::target"].concat(),
        ["super", "::super"].concat(),
    ];
    let mut files = 0;
    for entry in std::fs::read_dir(&dir).expect("the module's directory") {
        let path = entry.expect("an entry").path();
        let text = std::fs::read_to_string(&path).expect("a source file");
        files += 1;
        for (i, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            assert!(
                !needles.iter().any(|n| line.contains(n.as_str())),
                "{}:{}: persistent_data must not import the target layer: {line}",
                path.display(),
                i + 1
            );
        }
    }
    assert!(files >= 10, "read {files} files of {}", dir.display());
}
