//! Copy-on-write btree operations over the transaction manager
//! (`persistent-data/dm-btree.c`): lookup, insert with top-down splits
//! (every node on the path is shadowed first, as `shadow_step` does),
//! whole-tree deletion, and a bulk builder used for the small trees that
//! are rewritten whole (space map indexes, reference count trees, and
//! the device trees after a removal).

use super::node::{max_entries, Node};
use super::tm::{Tm, ValueKind};
use crate::targets::thin::metadata::mapping_cache::LeafSpan;
use crate::targets::thin::metadata::MetadataError;

/// Deeper than any tree of 2^64 keys can be: a path longer than this is
/// a cycle in corrupt metadata, refused instead of followed forever.
const MAX_DEPTH: usize = 64;

fn too_deep(b: u64) -> MetadataError {
    MetadataError::corrupt(b, "btree deeper than 64 levels (a cycle?)")
}

/// The value stored under `key`, if any.
pub fn lookup(tm: &mut Tm, root: u64, key: u64) -> Result<Option<Vec<u8>>, MetadataError> {
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let n = tm.node(b)?;
        if n.leaf {
            return Ok(n.keys.binary_search(&key).ok().map(|i| n.value(i).to_vec()));
        }
        match n.lower_bound(key) {
            Some(i) => b = n.value_u64(i),
            None => return Ok(None),
        }
    }
    Err(too_deep(root))
}

/// The 8-byte value stored under `key` (a mapping, a subtree root),
/// without copying it out.
pub fn lookup_u64(tm: &mut Tm, root: u64, key: u64) -> Result<Option<u64>, MetadataError> {
    Ok(leaf_span(tm, root, key)?.value(key))
}

/// The leaf a lookup of `key` in a tree of 8-byte values ends in, with
/// the range of keys whose lookup ends there too (each internal node
/// sends `[keys[i], keys[i + 1])` to child `i`, and keys below its first
/// to no child at all).
pub fn leaf_span(tm: &mut Tm, root: u64, key: u64) -> Result<LeafSpan, MetadataError> {
    let (mut lo, mut hi) = (0u64, u64::MAX);
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let n = tm.node(b)?;
        if n.leaf {
            if n.value_size != 8 {
                return Err(MetadataError::corrupt(
                    b,
                    "leaf of 8-byte values has another size",
                ));
            }
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
pub fn insert_path_cached(tm: &Tm, root: u64, key: u64) -> Option<Option<u64>> {
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let n = tm.cached(b)?;
        if n.leaf {
            if n.value_size != 8 {
                return None;
            }
            return Some(n.keys.binary_search(&key).ok().map(|i| n.value_u64(i)));
        }
        // As `insert` descends: keys below the first go to child 0.
        b = n.value_u64(n.lower_bound(key).unwrap_or(0));
    }
    None
}

/// The highest key in the tree (`dm_btree_find_highest_key`).
pub fn highest_key(tm: &mut Tm, root: u64) -> Result<Option<u64>, MetadataError> {
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

/// Every (key, value) in key order, from a tree whose values are
/// `value_size` bytes.
pub fn walk(
    tm: &mut Tm,
    root: u64,
    value_size: usize,
) -> Result<Vec<(u64, Vec<u8>)>, MetadataError> {
    let mut out = Vec::new();
    walk_into(tm, root, value_size, &mut out, 0)?;
    Ok(out)
}

fn walk_into(
    tm: &mut Tm,
    b: u64,
    value_size: usize,
    out: &mut Vec<(u64, Vec<u8>)>,
    depth: usize,
) -> Result<(), MetadataError> {
    if depth > MAX_DEPTH {
        return Err(too_deep(b));
    }
    let n = tm.node(b)?;
    if n.leaf && n.value_size != value_size {
        return Err(MetadataError::corrupt(
            b,
            &format!(
                "leaf values of {} bytes, expected {value_size}",
                n.value_size
            ),
        ));
    }
    for i in 0..n.len() {
        if n.leaf {
            out.push((n.keys[i], n.value(i).to_vec()));
        } else {
            walk_into(tm, n.value_u64(i), value_size, out, depth + 1)?;
        }
    }
    Ok(())
}

/// The value to store under a key, given the one there now; it may
/// adjust reference counts (drop the old value's, take the new one's).
pub type Update<'a> = dyn FnMut(&mut Tm, Option<&[u8]>) -> Result<Vec<u8>, MetadataError> + 'a;

/// Insert or replace `key`; returns the new root. `kind` says what
/// copies of shared nodes must reference again.
pub fn insert(
    tm: &mut Tm,
    root: u64,
    key: u64,
    kind: ValueKind,
    update: &mut Update<'_>,
) -> Result<u64, MetadataError> {
    let root = tm.shadow(root, kind)?;
    if tm.node(root)?.len() >= tm.node(root)?.max() {
        split_beneath(tm, root)?;
    }
    let mut cur = root;
    for _ in 0..MAX_DEPTH {
        let n = tm.node(cur)?;
        if n.leaf {
            let (i, old) = match n.keys.binary_search(&key) {
                Ok(i) => (i, Some(n.value(i).to_vec())),
                Err(i) => (i, None),
            };
            let v = update(tm, old.as_deref())?;
            if v.len() != n.value_size {
                return Err(MetadataError::corrupt(cur, "leaf values of another size"));
            }
            let node = tm.node_mut(cur);
            if old.is_some() {
                node.set_value(i, &v);
            } else {
                node.insert_at(i, key, &v);
            }
            return Ok(root);
        }
        let i = n.lower_bound(key).unwrap_or(0);
        let child = tm.shadow(n.value_u64(i), kind)?;
        {
            let node = tm.node_mut(cur);
            if key < node.keys[i] {
                node.keys[i] = key;
            }
            node.set_value(i, &child.to_le_bytes());
        }
        let c = tm.node(child)?;
        if c.len() >= c.max() {
            let right = split_one_into_two(tm, child)?;
            let right_key = tm.node(right)?.keys[0];
            tm.node_mut(cur)
                .insert_at(i + 1, right_key, &right.to_le_bytes());
            cur = if key >= right_key { right } else { child };
        } else {
            cur = child;
        }
    }
    Err(too_deep(root))
}

/// `split_one_into_two`: move the upper half of `b` (made in this
/// transaction) into a new sibling; returns the sibling.
fn split_one_into_two(tm: &mut Tm, b: u64) -> Result<u64, MetadataError> {
    let node = tm.node_mut(b);
    let half = node.len() / 2;
    let right = node.split_off(half);
    tm.new_node(right)
}

/// `btree_split_beneath`: a full root moves its entries into two new
/// children and becomes an internal node over them, keeping its block.
fn split_beneath(tm: &mut Tm, root: u64) -> Result<(), MetadataError> {
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
pub fn build(
    tm: &mut Tm,
    entries: &[(u64, Vec<u8>)],
    value_size: usize,
    kind: ValueKind,
) -> Result<u64, MetadataError> {
    for (_, v) in entries {
        tm.inc_value(kind, v);
    }
    let mut level: Vec<(u64, u64)> = Vec::new();
    for chunk in even_chunks(entries.len(), max_entries(value_size)) {
        let mut n = Node::empty_leaf(value_size);
        for (k, v) in &entries[chunk] {
            n.insert_at(n.len(), *k, v);
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

/// Remove `key` by rewriting the tree without it (the trees this is used
/// on hold one entry per thin device); the removed value loses its
/// reference. Returns the new root.
pub fn remove(
    tm: &mut Tm,
    root: u64,
    key: u64,
    value_size: usize,
    kind: ValueKind,
) -> Result<u64, MetadataError> {
    let mut entries = walk(tm, root, value_size)?;
    entries.retain(|(k, _)| *k != key);
    let new = build(tm, &entries, value_size, kind)?;
    tm.del(root, kind)?;
    Ok(new)
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
