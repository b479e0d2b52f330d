//! Making room in a full non-root node during an insert, as
//! `persistent-data/dm-btree.c` (6.12) does in `rebalance_or_split`:
//! entries move to a sibling with at least `SPACE_THRESHOLD` free
//! entries that is not shared (left first, then right), else the node
//! splits -- two nodes into three when it has a sibling on each side
//! and neither is shared, one into two otherwise (the first or last
//! child, a parent of two, a shared sibling: a monotonic run of inserts
//! keeps filling one end). Siblings are shadowed and new nodes
//! allocated in the kernel's order, so the same inserts leave the same
//! nodes in the same blocks.

use super::btree::shadow;
use super::node::Node;
use super::tm::Tm;
use super::value_type::ValueType;
use super::PdError;

/// `SPACE_THRESHOLD`: the free entries a sibling needs to take some.
const SPACE_THRESHOLD: usize = 8;

/// `rebalance_or_split`: make room in child `i` of `parent` (both made in
/// this transaction, the child full) for `key`; returns the node the
/// insert goes on into.
pub(super) fn rebalance_or_split<V: ValueType>(
    tm: &mut Tm,
    vt: &mut V,
    parent: u64,
    i: usize,
    key: u64,
) -> Result<u64, PdError> {
    let p = tm.node(parent)?;
    let nr_parent = p.len();
    let (mut left_shared, mut right_shared) = (false, false);
    if i > 0 {
        let left = p.value_u64(i - 1);
        left_shared = tm.meta.get(left) > 1;
        if !left_shared && free_space(tm, left)? >= SPACE_THRESHOLD {
            return rebalance_left(tm, vt, parent, i, key);
        }
    }
    if i + 1 < nr_parent {
        let right = p.value_u64(i + 1);
        right_shared = tm.meta.get(right) > 1;
        if !right_shared && free_space(tm, right)? >= SPACE_THRESHOLD {
            return rebalance_right(tm, vt, parent, i, key);
        }
    }
    if left_shared || right_shared || nr_parent <= 2 || i == 0 || i + 1 == nr_parent {
        split_one_into_two(tm, parent, i, key)
    } else {
        split_two_into_three(tm, vt, parent, i, key)
    }
}

/// `get_node_free_space`.
fn free_space(tm: &mut Tm, b: u64) -> Result<usize, PdError> {
    let n = tm.node(b)?;
    Ok(n.max().saturating_sub(n.len()))
}

/// `shadow_child`: shadow child `i` of `parent` and point the parent at
/// the copy.
fn shadow_child<V: ValueType>(
    tm: &mut Tm,
    vt: &mut V,
    parent: u64,
    i: usize,
) -> Result<u64, PdError> {
    let b = tm.node(parent)?.value_u64(i);
    let copy = shadow(tm, b, vt)?;
    tm.node_mut(parent).set_value(i, &copy.to_le_bytes());
    Ok(copy)
}

/// The entries of `nodes`, in order, cut into runs of `sizes` entries
/// (`redistribute2`, `redistribute3`: each node keeps its block and
/// kind, the entries shift across).
fn redistribute(tm: &mut Tm, nodes: &[u64], sizes: &[usize]) -> Result<(), PdError> {
    let mut all = tm.node(nodes[0])?.as_ref().clone();
    for &b in &nodes[1..] {
        let n = tm.node(b)?;
        all.keys.extend_from_slice(&n.keys);
        all.values.extend_from_slice(&n.values);
    }
    let mut rest = all;
    for (k, &b) in nodes.iter().enumerate() {
        let tail = rest.split_off(sizes[k].min(rest.len()));
        *tm.node_mut(b) = rest;
        rest = tail;
    }
    Ok(())
}

fn len_of(tm: &mut Tm, b: u64) -> Result<usize, PdError> {
    Ok(tm.node(b)?.len())
}

fn first_key(tm: &mut Tm, b: u64) -> Result<u64, PdError> {
    tm.node(b)?
        .keys
        .first()
        .copied()
        .ok_or_else(|| PdError::corrupt(b, "btree node emptied by a split"))
}

/// `redistribute2` over `left` and `right`: the left gets half,
/// rounded down.
fn redistribute2(tm: &mut Tm, left: u64, right: u64) -> Result<(), PdError> {
    let total = len_of(tm, left)? + len_of(tm, right)?;
    let l = total / 2;
    redistribute(tm, &[left, right], &[l, total - l])
}

/// `rebalance_left`: share the node's entries with its left sibling.
fn rebalance_left<V: ValueType>(
    tm: &mut Tm,
    vt: &mut V,
    parent: u64,
    i: usize,
    key: u64,
) -> Result<u64, PdError> {
    let sib = shadow_child(tm, vt, parent, i - 1)?;
    let cur = tm.node(parent)?.value_u64(i);
    redistribute2(tm, sib, cur)?;
    let rk = first_key(tm, cur)?;
    tm.node_mut(parent).keys[i] = rk;
    Ok(if key < rk { sib } else { cur })
}

/// `rebalance_right`: share the node's entries with its right sibling.
fn rebalance_right<V: ValueType>(
    tm: &mut Tm,
    vt: &mut V,
    parent: u64,
    i: usize,
    key: u64,
) -> Result<u64, PdError> {
    let sib = shadow_child(tm, vt, parent, i + 1)?;
    let cur = tm.node(parent)?.value_u64(i);
    redistribute2(tm, cur, sib)?;
    let rk = first_key(tm, sib)?;
    tm.node_mut(parent).keys[i + 1] = rk;
    Ok(if key < rk { cur } else { sib })
}

/// An empty node of `b`'s kind.
fn empty_like(tm: &mut Tm, b: u64) -> Result<Node, PdError> {
    let n = tm.node(b)?;
    Ok(if n.leaf {
        Node::empty_leaf(n.value_size)
    } else {
        Node::internal()
    })
}

/// `split_one_into_two`: a new right sibling takes the upper half.
fn split_one_into_two(tm: &mut Tm, parent: u64, i: usize, key: u64) -> Result<u64, PdError> {
    let cur = tm.node(parent)?.value_u64(i);
    let empty = empty_like(tm, cur)?;
    let right = tm.new_node(empty)?;
    redistribute2(tm, cur, right)?;
    let rk = first_key(tm, right)?;
    tm.node_mut(parent)
        .insert_at(i + 1, rk, &right.to_le_bytes());
    Ok(if key < rk { cur } else { right })
}

/// `split_two_into_three`: the node and a sibling (the right one for
/// the first child, else the left) share their entries with a new node
/// between them, a third each.
fn split_two_into_three<V: ValueType>(
    tm: &mut Tm,
    vt: &mut V,
    parent: u64,
    i: usize,
    key: u64,
) -> Result<u64, PdError> {
    let cur = tm.node(parent)?.value_u64(i);
    let (middle_index, left, right) = if i == 0 {
        (1, cur, shadow_child(tm, vt, parent, i + 1)?)
    } else {
        (i, shadow_child(tm, vt, parent, i - 1)?, cur)
    };
    let empty = empty_like(tm, left)?;
    let middle = tm.new_node(empty)?;
    let total = len_of(tm, left)? + len_of(tm, right)?;
    let l = total / 3;
    let c = (total - l) / 2;
    redistribute(tm, &[left, middle, right], &[l, c, total - l - c])?;
    let (mk, rk) = (first_key(tm, middle)?, first_key(tm, right)?);
    let pn = tm.node_mut(parent);
    pn.keys[middle_index] = rk;
    pn.insert_at(middle_index, mk, &middle.to_le_bytes());
    Ok(if key < mk {
        left
    } else if key < rk {
        middle
    } else {
        right
    })
}
