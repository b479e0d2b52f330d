//! Copy-on-write btree operations over the transaction manager
//! (`persistent-data/dm-btree.c`), generic over the tree's value type
//! (`value_type.rs`): lookup, insert making room top-down (every node on
//! the path is shadowed first, as `shadow_step` does; a full non-root
//! node is made room in by `btree_split.rs`), whole-tree
//! deletion, and a bulk builder used for the small trees that are
//! rewritten whole (space map indexes, reference count trees). Removal
//! in place, with the kernel's rebalancing, is `btree_remove.rs`.
//!
//! A lookup allocates nothing: it walks the transaction manager's
//! cached nodes (reading a block only on a miss) and returns the value
//! by copy.

use super::node::{max_entries, Node};
use super::tm::Tm;
use super::value_type::{ValueType, MAX_VALUE_SIZE};
use super::PdError;
use std::sync::Arc;

/// Deeper than any tree of 2^64 keys can be: a path longer than this is
/// a cycle in corrupt metadata, refused instead of followed forever.
pub(super) const MAX_DEPTH: usize = 64;

pub(super) fn too_deep(b: u64) -> PdError {
    PdError::corrupt(b, "btree deeper than 64 levels (a cycle?)")
}

/// Refuse a leaf whose values are not `V`'s size: unpacking them would
/// read past or short of each value.
pub(super) fn check_leaf<V: ValueType>(n: &Node, b: u64) -> Result<(), PdError> {
    if n.value_size != V::SIZE {
        return Err(PdError::corrupt(
            b,
            &format!("leaf of {}-byte values has another size", V::SIZE),
        ));
    }
    Ok(())
}

/// Entry `i` of leaf `n`, unpacked.
pub(super) fn value_of<V: ValueType>(n: &Node, i: usize) -> V::Value {
    V::unpack(n.value(i))
}

/// The value stored under `key`, if any (`dm_btree_lookup`), by copy.
pub fn lookup<V: ValueType>(tm: &mut Tm, root: u64, key: u64) -> Result<Option<V::Value>, PdError> {
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let n = tm.node(b)?;
        if n.leaf {
            check_leaf::<V>(&n, b)?;
            return Ok(n
                .keys
                .binary_search(&key)
                .ok()
                .map(|i| value_of::<V>(&n, i)));
        }
        match n.lower_bound(key) {
            Some(i) => b = n.value_u64(i),
            None => return Ok(None),
        }
    }
    Err(too_deep(root))
}

/// The leaf a lookup of a key ends in, and the keys `[lo, hi)` whose own
/// lookup ends there too: the leaf answers for all of them. `leaf` is
/// `None` when the walk ended above the leaves (every key in the range is
/// absent).
pub struct LeafSpan {
    /// The leaf the walk ended in, `None` if it ended above the leaves.
    pub leaf: Option<Arc<Node>>,
    /// First key the leaf answers for.
    pub lo: u64,
    /// The key after the last the leaf answers for.
    pub hi: u64,
}

impl LeafSpan {
    /// The value `key` has in this span's leaf (whose values
    /// [`leaf_span`] checked are `V`'s size).
    pub fn value<V: ValueType>(&self, key: u64) -> Option<V::Value> {
        let leaf = self.leaf.as_ref()?;
        leaf.keys
            .binary_search(&key)
            .ok()
            .map(|i| value_of::<V>(leaf, i))
    }
}

/// The leaf a lookup of `key` ends in, with the range of keys whose
/// lookup ends there too (each internal node sends `[keys[i], keys[i +
/// 1])` to child `i`, and keys below its first to no child at all).
pub fn leaf_span<V: ValueType>(tm: &mut Tm, root: u64, key: u64) -> Result<LeafSpan, PdError> {
    let (mut lo, mut hi) = (0u64, u64::MAX);
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let n = tm.node(b)?;
        if n.leaf {
            check_leaf::<V>(&n, b)?;
            return Ok(LeafSpan {
                leaf: Some(n),
                lo,
                hi,
            });
        }
        match n.lower_bound(key) {
            Some(i) => {
                lo = lo.max(n.keys[i]);
                if let Some(&next) = n.keys.get(i + 1) {
                    hi = hi.min(next);
                }
                b = n.value_u64(i);
            }
            None => {
                if let Some(&first) = n.keys.first() {
                    hi = hi.min(first);
                }
                return Ok(LeafSpan { leaf: None, lo, hi });
            }
        }
    }
    Err(too_deep(root))
}

/// Whether [`insert`] of `key` would find every node on its way down in
/// memory (it then reads nothing from the metadata device), and the
/// value `key` has now if so.
pub fn insert_path_cached<V: ValueType>(tm: &Tm, root: u64, key: u64) -> Option<Option<V::Value>> {
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let n = tm.cached(b)?;
        if n.leaf {
            if n.value_size != V::SIZE {
                return None;
            }
            return Some(n.keys.binary_search(&key).ok().map(|i| value_of::<V>(n, i)));
        }
        // As `insert` descends: keys below the first go to child 0.
        b = n.value_u64(n.lower_bound(key).unwrap_or(0));
    }
    None
}

/// The highest key in the tree (`dm_btree_find_highest_key`).
pub fn highest_key(tm: &mut Tm, root: u64) -> Result<Option<u64>, PdError> {
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let n = tm.node(b)?;
        if n.is_empty() {
            return Ok(None);
        }
        if n.leaf {
            return Ok(n.keys.last().copied());
        }
        b = n.value_u64(n.len() - 1);
    }
    Err(too_deep(root))
}

/// The first key at or after `key` in the tree at `root`
/// (`dm_btree_lookup_next`'s key).
pub fn first_key_from(tm: &mut Tm, root: u64, key: u64) -> Result<Option<u64>, PdError> {
    first_key_at(tm, root, key, 0)
}

fn first_key_at(tm: &mut Tm, b: u64, key: u64, depth: usize) -> Result<Option<u64>, PdError> {
    if depth > MAX_DEPTH {
        return Err(too_deep(b));
    }
    let n = tm.node(b)?;
    if n.leaf {
        let i = n.keys.partition_point(|&k| k < key);
        return Ok(n.keys.get(i).copied());
    }
    // The child holding `key`, else (all its keys below) the next one's
    // first, found at once.
    for i in n.lower_bound(key).unwrap_or(0)..n.len() {
        if let Some(k) = first_key_at(tm, n.value_u64(i), key, depth + 1)? {
            return Ok(Some(k));
        }
    }
    Ok(None)
}

/// Every (key, value) in key order.
pub fn walk<V: ValueType>(tm: &mut Tm, root: u64) -> Result<Vec<(u64, V::Value)>, PdError> {
    let mut out = Vec::new();
    walk_into::<V>(tm, root, &mut out, 0)?;
    Ok(out)
}

fn walk_into<V: ValueType>(
    tm: &mut Tm,
    b: u64,
    out: &mut Vec<(u64, V::Value)>,
    depth: usize,
) -> Result<(), PdError> {
    if depth > MAX_DEPTH {
        return Err(too_deep(b));
    }
    let n = tm.node(b)?;
    if n.leaf && n.value_size != V::SIZE {
        return Err(PdError::corrupt(
            b,
            &format!(
                "leaf values of {} bytes, expected {}",
                n.value_size,
                V::SIZE
            ),
        ));
    }
    for i in 0..n.len() {
        if n.leaf {
            out.push((n.keys[i], value_of::<V>(&n, i)));
        } else {
            walk_into::<V>(tm, n.value_u64(i), out, depth + 1)?;
        }
    }
    Ok(())
}

/// `shadow_step`: shadow `b`, and when it was shared give everything the
/// copy refers to one more reference (`inc_children`).
pub(super) fn shadow<V: ValueType>(tm: &mut Tm, b: u64, vt: &mut V) -> Result<u64, PdError> {
    let (copy, shared) = tm.shadow(b)?;
    if shared {
        let n = tm.node(copy)?;
        inc_children(tm, &n, copy, vt)?;
    }
    Ok(copy)
}

/// `inc_children`: one more node (block `b`, now `n`'s copy) refers to
/// everything `n` refers to: its children, or a leaf's values.
pub(super) fn inc_children<V: ValueType>(
    tm: &mut Tm,
    n: &Node,
    b: u64,
    vt: &mut V,
) -> Result<(), PdError> {
    if n.leaf {
        check_leaf::<V>(n, b)?;
    }
    for i in 0..n.len() {
        if n.leaf {
            vt.inc(tm, &value_of::<V>(n, i))?;
        } else {
            tm.inc(n.value_u64(i))?;
        }
    }
    Ok(())
}

/// The value to store under a key, given the one there now; it may
/// adjust reference counts (drop the old value's, take the new one's)
/// through the value type it is handed.
pub type Update<'a, V, E> = dyn FnMut(&mut Tm, &mut V, Option<<V as ValueType>::Value>) -> Result<<V as ValueType>::Value, E>
    + 'a;

/// Insert or replace `key`; returns the new root. `vt` gives what copies
/// of shared nodes must reference again; `update` the value.
///
/// `btree_insert_raw`: every node on the way down is shadowed, and one
/// with no room for the key (a full node, unless a leaf that holds the
/// key already) is made room in before going on: the root is split
/// beneath itself, any other node moves entries to a sibling or splits
/// (`rebalance_or_split`).
pub fn insert<V: ValueType, E: From<PdError>>(
    tm: &mut Tm,
    root: u64,
    key: u64,
    vt: &mut V,
    update: &mut Update<'_, V, E>,
) -> Result<u64, E> {
    const { assert!(V::SIZE <= MAX_VALUE_SIZE) };
    let root = shadow(tm, root, vt)?;
    let top = tm.node(root)?;
    if !has_space_for_insert(&top, key) {
        split_beneath(tm, root)?;
    }
    let mut cur = root;
    for _ in 0..MAX_DEPTH {
        let n = tm.node(cur)?;
        if n.leaf {
            if n.value_size != V::SIZE {
                return Err(PdError::corrupt(cur, "leaf values of another size").into());
            }
            let (i, old) = match n.keys.binary_search(&key) {
                Ok(i) => (i, Some(value_of::<V>(&n, i))),
                Err(i) => (i, None),
            };
            let v = update(tm, vt, old)?;
            let mut packed = [0u8; MAX_VALUE_SIZE];
            V::pack(&v, &mut packed);
            let node = tm.node_mut(cur);
            if old.is_some() {
                node.set_value(i, &packed[..V::SIZE]);
            } else {
                node.insert_at(i, key, &packed[..V::SIZE]);
            }
            return Ok(root);
        }
        let i = n.lower_bound(key).unwrap_or(0);
        let child = shadow(tm, n.value_u64(i), vt)?;
        {
            let node = tm.node_mut(cur);
            if key < node.keys[i] {
                node.keys[i] = key;
            }
            node.set_value(i, &child.to_le_bytes());
        }
        let c = tm.node(child)?;
        cur = if has_space_for_insert(&c, key) {
            child
        } else {
            super::btree_split::rebalance_or_split(tm, vt, cur, i, key)?
        };
    }
    Err(too_deep(root).into())
}

/// `btree_get_overwrite_leaf` and a write into it: shadow the path to
/// `key`'s leaf without making room in any node (nothing is inserted)
/// and store `value` over the one there. A key not in the tree is
/// corrupt metadata (`dm-space-map-common.c`: "overflow btree is
/// missing an entry"). Returns the new root.
pub fn overwrite<V: ValueType>(
    tm: &mut Tm,
    root: u64,
    key: u64,
    vt: &mut V,
    value: V::Value,
) -> Result<u64, PdError> {
    const { assert!(V::SIZE <= MAX_VALUE_SIZE) };
    let missing = |b| PdError::corrupt(b, "overflow btree is missing an entry");
    let root = shadow(tm, root, vt)?;
    let mut cur = root;
    for _ in 0..MAX_DEPTH {
        let n = tm.node(cur)?;
        let i = n.lower_bound(key).ok_or_else(|| missing(cur))?;
        if n.leaf {
            check_leaf::<V>(&n, cur)?;
            if n.keys[i] != key {
                return Err(missing(cur));
            }
            let mut packed = [0u8; MAX_VALUE_SIZE];
            V::pack(&value, &mut packed);
            tm.node_mut(cur).set_value(i, &packed[..V::SIZE]);
            return Ok(root);
        }
        let child = shadow(tm, n.value_u64(i), vt)?;
        tm.node_mut(cur).set_value(i, &child.to_le_bytes());
        cur = child;
    }
    Err(too_deep(root))
}

/// `has_space_for_insert`: a node has room for `key` unless it is full,
/// and a full leaf that holds `key` has room for its overwrite.
fn has_space_for_insert(n: &Node, key: u64) -> bool {
    n.len() < n.max() || (n.leaf && n.keys.binary_search(&key).is_ok())
}

/// `dm_btree_insert`: store `value` under `key`, which takes over the
/// caller's reference; a value it replaces loses its reference unless
/// it is equal. Returns the new root.
pub fn insert_value<V: ValueType>(
    tm: &mut Tm,
    root: u64,
    key: u64,
    vt: &mut V,
    value: V::Value,
) -> Result<u64, PdError> {
    insert(tm, root, key, vt, &mut |tm, vt, old| {
        if let Some(old) = old {
            if !vt.equal(&old, &value) {
                vt.dec(tm, &old)?;
            }
        }
        Ok::<_, PdError>(value)
    })
}

/// `btree_split_beneath`: a full root moves its entries into two new
/// children and becomes an internal node over them, keeping its block.
fn split_beneath(tm: &mut Tm, root: u64) -> Result<(), PdError> {
    let mut all = tm.node(root)?.as_ref().clone();
    let half = all.len() / 2;
    let right = all.split_off(half);
    let (lk, rk) = (all.keys[0], right.keys[0]);
    let l = tm.new_node(all)?;
    let r = tm.new_node(right)?;
    let mut top = Node::internal();
    top.insert_at(0, lk, &l.to_le_bytes());
    top.insert_at(1, rk, &r.to_le_bytes());
    *tm.node_mut(root) = top;
    Ok(())
}

/// A new tree holding `entries` (sorted by key), taking a reference to
/// each value; returns its root.
pub fn build<V: ValueType>(
    tm: &mut Tm,
    entries: &[(u64, V::Value)],
    vt: &mut V,
) -> Result<u64, PdError> {
    const { assert!(V::SIZE <= MAX_VALUE_SIZE) };
    for (_, v) in entries {
        vt.inc(tm, v)?;
    }
    let mut level: Vec<(u64, u64)> = Vec::new();
    let mut packed = [0u8; MAX_VALUE_SIZE];
    for chunk in even_chunks(entries.len(), max_entries(V::SIZE)) {
        let mut n = Node::empty_leaf(V::SIZE);
        for (k, v) in &entries[chunk] {
            V::pack(v, &mut packed);
            n.insert_at(n.len(), *k, &packed[..V::SIZE]);
        }
        let first = n.keys.first().copied().unwrap_or(0);
        level.push((first, tm.new_node(n)?));
    }
    while level.len() > 1 {
        let mut up = Vec::new();
        for chunk in even_chunks(level.len(), max_entries(8)) {
            let mut n = Node::internal();
            for (k, b) in &level[chunk] {
                n.insert_at(n.len(), *k, &b.to_le_bytes());
            }
            up.push((n.keys[0], tm.new_node(n)?));
        }
        level = up;
    }
    Ok(level[0].1)
}

/// Ranges cutting `n` items into the fewest runs of at most `max`, as
/// even as can be (so each holds at least a third of `max`); one empty
/// run for no items.
fn even_chunks(n: usize, max: usize) -> Vec<std::ops::Range<usize>> {
    let runs = n.div_ceil(max).max(1);
    (0..runs)
        .map(|r| (r * n / runs)..((r + 1) * n / runs))
        .collect()
}

/// `dm_btree_remove`: remove `key` in place, rebalancing on the way
/// down (`btree_remove.rs`); the removed value loses its reference. A
/// key that is not there changes nothing the tree holds. Returns the
/// new root.
pub fn remove<V: ValueType>(tm: &mut Tm, root: u64, key: u64, vt: &mut V) -> Result<u64, PdError> {
    Ok(super::btree_remove::remove(tm, root, key, vt)?.0)
}

/// `dm_btree_del`: drop a reference to the tree at `root`; a node no
/// longer referred to releases what it refers to.
pub fn del<V: ValueType>(tm: &mut Tm, root: u64, vt: &mut V) -> Result<(), PdError> {
    del_at(tm, root, vt, 0)
}

fn del_at<V: ValueType>(tm: &mut Tm, root: u64, vt: &mut V, depth: usize) -> Result<(), PdError> {
    if depth > MAX_DEPTH {
        return Err(too_deep(root));
    }
    if tm.meta.get(root) > 1 {
        tm.dec(root)?;
        return Ok(());
    }
    let n = tm.node(root)?;
    if n.leaf {
        check_leaf::<V>(&n, root)?;
    }
    for i in 0..n.len() {
        if n.leaf {
            vt.dec(tm, &value_of::<V>(&n, i))?;
        } else {
            del_at(tm, n.value_u64(i), vt, depth + 1)?;
        }
    }
    tm.dec(root)?;
    tm.forget(root);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_chunks_keep_a_third() {
        assert_eq!(even_chunks(0, 252), vec![0..0]);
        assert_eq!(even_chunks(252, 252), vec![0..252]);
        let c = even_chunks(253, 252);
        assert_eq!(c, vec![0..126, 126..253]);
        for n in 1..2000 {
            let c = even_chunks(n, 252);
            assert!(c.iter().all(|r| r.len() <= 252));
            if c.len() > 1 {
                assert!(c.iter().all(|r| r.len() >= 84), "{n}");
            }
        }
    }
}
