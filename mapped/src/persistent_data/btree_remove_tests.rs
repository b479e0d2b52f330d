//! Removal in place (`btree_remove.rs`) against a model: random
//! inserts, removals, range removals, tree copies (a second reference
//! to a root, as a snapshot takes) and commits, after each of which
//! every tree walks to its model, every node but a root holds a third
//! of its maximum at least (what `thin_check` asks), and the metadata
//! space map's counts and the values' counts are exactly the references
//! a full walk of the live trees finds: nothing leaked, nothing freed
//! twice.

use super::block_manager::BlockManager;
use super::btree;
use super::btree_remove::{self, Removed};
use super::space_map::SpaceMap;
use super::tm::Tm;
use super::value_type::ValueType;
use super::{le64, PdError};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashSet};

const META_BLOCKS: u64 = 16384;

fn tm() -> Tm {
    let reg = crate::Registry::new();
    let dev = reg
        .create("meta", &format!("0 {} memory", META_BLOCKS * 8))
        .expect("a memory device");
    Tm::new(BlockManager::new(dev), SpaceMap::new(META_BLOCKS))
}

/// Values of `N` bytes that are ids whose references are counted here
/// (64-byte ones make leaves of 54 entries, so trees grow deep fast).
struct Counted<const N: usize>(BTreeMap<u64, i64>);

impl<const N: usize> ValueType for Counted<N> {
    type Value = u64;
    const SIZE: usize = N;
    fn unpack(b: &[u8]) -> u64 {
        le64(b, 0)
    }
    fn pack(v: &u64, out: &mut [u8]) {
        out[..8].copy_from_slice(&v.to_le_bytes());
        out[8..N].fill(0);
    }
    fn inc(&mut self, _tm: &mut Tm, v: &u64) -> Result<(), PdError> {
        *self.0.entry(*v).or_default() += 1;
        Ok(())
    }
    fn dec(&mut self, _tm: &mut Tm, v: &u64) -> Result<(), PdError> {
        let c = self.0.entry(*v).or_default();
        assert!(*c > 0, "value {v} freed twice");
        *c -= 1;
        Ok(())
    }
}

/// The references a full walk finds: per metadata block, and per value.
#[derive(Default)]
struct Refs {
    blocks: BTreeMap<u64, i64>,
    values: BTreeMap<u64, i64>,
    seen: HashSet<u64>,
}

/// Walk the tree at `root` (one more reference to it), checking each
/// node's shape: keys ascending and inside what the parent sends there,
/// at least a third full unless the root, leaves all at one depth.
/// Returns the tree's depth.
fn check_tree<const N: usize>(tm: &mut Tm, root: u64, refs: &mut Refs) -> usize {
    *refs.blocks.entry(root).or_default() += 1;
    let mut leaf_depth = None;
    check_node::<N>(tm, root, 0, (0, u64::MAX), refs, &mut leaf_depth);
    leaf_depth.unwrap_or(0) + 1
}

fn check_node<const N: usize>(
    tm: &mut Tm,
    b: u64,
    depth: usize,
    (lo, hi): (u64, u64),
    refs: &mut Refs,
    leaf_depth: &mut Option<usize>,
) {
    let n = tm.node(b).expect("a node");
    assert!(n.len() <= n.max(), "block {b}: {} entries", n.len());
    if depth > 0 {
        assert!(
            n.len() >= n.max() / 3,
            "block {b} at depth {depth}: {} entries, fewer than a third of {}",
            n.len(),
            n.max()
        );
    }
    assert!(
        n.keys.windows(2).all(|w| w[0] < w[1]),
        "block {b}: key order"
    );
    assert!(
        n.keys.iter().all(|&k| lo <= k && k < hi),
        "block {b}: keys outside {lo}..{hi}"
    );
    if n.leaf {
        assert_eq!(n.value_size, N);
        assert_eq!(
            *leaf_depth.get_or_insert(depth),
            depth,
            "leaves at one depth"
        );
    } else {
        assert!(!n.is_empty(), "block {b}: an empty internal node");
    }
    // A node shared by several trees holds its references once.
    if !refs.seen.insert(b) {
        return;
    }
    for i in 0..n.len() {
        if n.leaf {
            *refs.values.entry(n.value_u64(i)).or_default() += 1;
        } else {
            let child = n.value_u64(i);
            *refs.blocks.entry(child).or_default() += 1;
            let next = n.keys.get(i + 1).copied().unwrap_or(hi);
            check_node::<N>(tm, child, depth + 1, (n.keys[i], next), refs, leaf_depth);
        }
    }
}

/// Every tree in `roots` (one entry per reference held) is well formed,
/// and the counts kept are exactly the references found. Returns the
/// deepest tree's depth.
fn check_all<const N: usize>(tm: &mut Tm, roots: &[u64], vt: &Counted<N>) -> usize {
    let mut refs = Refs::default();
    let depth = roots
        .iter()
        .map(|&r| check_tree::<N>(tm, r, &mut refs))
        .max()
        .unwrap_or(0);
    for (b, &count) in tm.meta.counts().iter().enumerate() {
        let want = refs.blocks.get(&(b as u64)).copied().unwrap_or(0);
        assert_eq!(i64::from(count), want, "metadata block {b}'s count");
    }
    let kept: BTreeMap<u64, i64> =
        vt.0.iter()
            .filter(|e| *e.1 != 0)
            .map(|(&v, &c)| (v, c))
            .collect();
    assert_eq!(kept, refs.values, "value reference counts");
    depth
}

#[derive(Clone, Debug)]
enum Step {
    Insert(u64),
    InsertRun(u64, u64),
    Remove(u64),
    RemoveRange(u64, u64),
    Copy,
    DropCopy,
    Commit,
}

fn step() -> impl Strategy<Value = Step> {
    let key = 0u64..12_000;
    prop_oneof![
        4 => key.clone().prop_map(Step::Insert),
        3 => (key.clone(), 1u64..2500).prop_map(|(k, n)| Step::InsertRun(k, n)),
        4 => key.clone().prop_map(Step::Remove),
        4 => (key, 1u64..3000).prop_map(|(k, n)| Step::RemoveRange(k, n)),
        1 => Just(Step::Copy),
        1 => Just(Step::DropCopy),
        2 => Just(Step::Commit),
    ]
}

type Model = BTreeMap<u64, u64>;

/// A tree under test, its model, and the copies of it still held.
struct World<const N: usize> {
    tm: Tm,
    vt: Counted<N>,
    root: u64,
    model: Model,
    copies: Vec<(u64, Model)>,
    next_value: u64,
}

impl<const N: usize> World<N> {
    fn new() -> Self {
        let mut tm = tm();
        let mut vt = Counted(BTreeMap::new());
        let root = btree::build(&mut tm, &[], &mut vt).expect("empty tree");
        World {
            tm,
            vt,
            root,
            model: Model::new(),
            copies: Vec::new(),
            next_value: 1,
        }
    }

    fn insert(&mut self, k: u64) {
        let v = self.next_value;
        self.next_value += 1;
        // The caller's reference, which the tree takes over.
        self.vt.inc(&mut self.tm, &v).expect("inc");
        self.root =
            btree::insert_value(&mut self.tm, self.root, k, &mut self.vt, v).expect("insert");
        self.model.insert(k, v);
    }

    fn remove_range(&mut self, begin: u64, end: u64) -> Removed {
        let mut seen = Vec::new();
        let done = btree_remove::remove_range(
            &mut self.tm,
            self.root,
            begin,
            end,
            &mut self.vt,
            &mut |k, v| seen.push((k, v)),
        )
        .expect("remove range");
        let want: Vec<(u64, u64)> = self
            .model
            .range(begin..end)
            .map(|(&k, &v)| (k, v))
            .collect();
        assert_eq!(seen, want, "removed {begin}..{end}");
        self.model.retain(|k, _| !(begin..end).contains(k));
        self.root = done.root;
        done
    }

    fn apply(&mut self, s: &Step) {
        match *s {
            Step::Insert(k) => self.insert(k),
            Step::InsertRun(k, n) => (k..k + n).for_each(|k| self.insert(k)),
            Step::Remove(k) => {
                let (root, v) =
                    btree_remove::remove(&mut self.tm, self.root, k, &mut self.vt).expect("remove");
                self.root = root;
                assert_eq!(v, self.model.remove(&k), "removed {k}");
            }
            Step::RemoveRange(k, n) => {
                self.remove_range(k, k + n);
            }
            Step::Copy if self.copies.len() < 2 => {
                self.tm.meta.inc(self.root);
                self.copies.push((self.root, self.model.clone()));
            }
            Step::Copy => {}
            Step::DropCopy => {
                if let Some((root, _)) = self.copies.pop() {
                    btree::del(&mut self.tm, root, &mut self.vt).expect("del");
                }
            }
            Step::Commit => {
                self.tm.write_shadows().expect("write");
                self.tm.committed();
            }
        }
    }

    /// Every tree walks to its model; shapes and counts hold. Returns
    /// the deepest tree's depth.
    fn check(&mut self) -> usize {
        let walked = btree::walk::<Counted<N>>(&mut self.tm, self.root).expect("walk");
        assert_eq!(
            walked,
            self.model.iter().map(|(&k, &v)| (k, v)).collect::<Vec<_>>()
        );
        for (root, model) in &self.copies {
            let walked = btree::walk::<Counted<N>>(&mut self.tm, *root).expect("walk");
            assert!(
                walked
                    .iter()
                    .copied()
                    .eq(model.iter().map(|(&k, &v)| (k, v))),
                "a copy changed"
            );
        }
        let mut roots = vec![self.root];
        roots.extend(self.copies.iter().map(|(r, _)| *r));
        check_all(&mut self.tm, &roots, &self.vt)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn removals_keep_the_model_the_shape_and_the_counts(
        steps in proptest::collection::vec(step(), 1..40)
    ) {
        let mut w = World::<64>::new();
        for s in &steps {
            w.apply(s);
            w.check();
        }
        // Everything goes, and with the copies dropped nothing is left
        // but the empty root.
        w.remove_range(0, u64::MAX);
        while let Some((root, _)) = w.copies.pop() {
            btree::del(&mut w.tm, root, &mut w.vt).expect("del");
        }
        w.check();
        prop_assert_eq!(w.tm.meta.nr_allocated(), 1);
        prop_assert!(w.vt.0.values().all(|&c| c == 0));
    }
}

/// A three-level tree of 8-byte values (the thin mapping trees' shape),
/// shared with a copy across a commit, loses ranges and single keys:
/// the copy keeps everything, and shapes and counts hold throughout.
#[test]
fn ranges_leave_a_three_level_shared_tree() {
    let mut w = World::<8>::new();
    (0..70_000).for_each(|k| w.insert(k * 2));
    w.apply(&Step::Commit);
    w.apply(&Step::Copy);
    assert_eq!(w.check(), 3, "three levels");
    let removed = w.remove_range(10_000, 60_000);
    assert_eq!(removed.count, 25_000);
    w.check();
    for k in (60_000..140_000).step_by(7) {
        w.apply(&Step::Remove(k));
    }
    w.check();
    w.apply(&Step::Commit);
    w.remove_range(0, 139_000);
    w.check();
    w.apply(&Step::DropCopy);
    w.check();
}

/// `dm_btree_remove_leaves` stops where the run of keys stops; the
/// range removal goes on past gaps; a key not there changes nothing.
#[test]
fn runs_stop_at_gaps_and_ranges_do_not() {
    let mut w = World::<8>::new();
    for k in (0..100).chain(200..300) {
        w.insert(k);
    }
    let mut seen = 0;
    let (run, next) =
        btree_remove::remove_leaves(&mut w.tm, w.root, 50, 250, &mut w.vt, &mut |_, _| seen += 1)
            .expect("remove leaves");
    w.root = run.root;
    assert_eq!((run.count, seen, next), (50, 50, 100));
    w.model.retain(|&k, _| !(50..100).contains(&k));
    w.check();
    let (root, v) = btree_remove::remove(&mut w.tm, w.root, 150, &mut w.vt).expect("remove");
    w.root = root;
    assert_eq!(v, None);
    w.check();
    assert_eq!(w.remove_range(0, 1000).count, 150);
    w.check();
}
