//! Removing entries from a btree in place, as the kernel does
//! (`persistent-data/dm-btree-remove.c`): `dm_btree_remove` for one
//! key, `dm_btree_remove_leaves` for a run of keys, and the loop
//! `dm-thin-metadata.c` `__remove_range` wraps around it for a range
//! with gaps.
//!
//! No node but the root may hold fewer than a third of its maximum
//! entries (`thin_check` refuses one that does). A removal keeps that
//! true top-down: walking from the root to the leaf, every node on the
//! path is shadowed (`shadow_step`), and before it steps into a child
//! the child is rebalanced with its siblings, so that it holds at least
//! one entry more than the minimum and can lose one: with its only
//! sibling (`rebalance2`: merge the two, or share their entries evenly)
//! or with both (`rebalance3`: fold the middle one into the others, or
//! share out evenly among the three). A root left with one child takes
//! that child's entries. Siblings are shadowed before they change, and a
//! shared one's copy takes a reference to everything it refers to
//! (`inc_children`); a node merged away loses its block's reference but
//! not its children's, which its sibling holds now. The removed value
//! loses its reference through the value type's `dec`.
//!
//! Where this differs from the kernel: after a root takes over its only
//! child's entries, the kernel steps into the grandchild without
//! rebalancing it, and a removal from a grandchild already at the
//! minimum leaves it one below; here the new root's children are
//! rebalanced first, as any other node's are.
//!
//! Nodes are changed by taking them out of the transaction manager's
//! cache and putting them back, entries moved between `Vec`s with room
//! for a full node, so a removal whose nodes were shadowed already
//! allocates nothing.

use super::btree::{check_leaf, inc_children, shadow, too_deep, value_of, MAX_DEPTH};
use super::node::Node;
use super::tm::Tm;
use super::value_type::ValueType;
use super::PdError;

/// `merge_threshold`: the fewest entries a node other than the root
/// holds.
fn merge_threshold(n: &Node) -> usize {
    n.max() / 3
}

/// Node `b` (made in this transaction) out of the cache, with room for
/// a full node; [`put`] puts it back.
fn take(tm: &mut Tm, b: u64) -> Node {
    let mut n = std::mem::replace(tm.node_mut(b), Node::internal());
    let room = n.max().saturating_sub(n.len());
    n.keys.reserve(room);
    n.values.reserve(room * n.value_size);
    n
}

fn put(tm: &mut Tm, b: u64, n: Node) {
    *tm.node_mut(b) = n;
}

/// Drop a reference to node `b`; the last one frees it (its children
/// are referred to elsewhere by now).
fn dec_node(tm: &mut Tm, b: u64) -> Result<(), PdError> {
    if tm.dec(b)? == 0 {
        tm.forget(b);
    }
    Ok(())
}

/// The kernel's `shift`: a positive `count` moves `left`'s last `count`
/// entries to the front of `right`, a negative one `right`'s first
/// `-count` entries to the end of `left`.
fn shift(left: &mut Node, right: &mut Node, count: isize) {
    let vs = left.value_size;
    if count > 0 {
        let at = left.len() - count as usize;
        right.keys.splice(0..0, left.keys.drain(at..));
        right.values.splice(0..0, left.values.drain(at * vs..));
    } else if count < 0 {
        let n = count.unsigned_abs();
        left.keys.extend(right.keys.drain(..n));
        left.values.extend(right.values.drain(..n * vs));
    }
}

/// Shadow child `i` of node `parent` (made in this transaction) and
/// point the parent at the copy (`init_child`); returns the copy.
fn shadow_child<V: ValueType>(
    tm: &mut Tm,
    parent: u64,
    i: usize,
    vt: &mut V,
) -> Result<u64, PdError> {
    let b = tm.node(parent)?.value_u64(i);
    let copy = shadow(tm, b, vt)?;
    if copy != b {
        tm.node_mut(parent).set_value(i, &copy.to_le_bytes());
    }
    Ok(copy)
}

/// Siblings must be nodes of one kind to trade entries.
fn check_siblings(nodes: &[&Node], b: u64) -> Result<(), PdError> {
    let first = nodes[0];
    if nodes
        .iter()
        .any(|n| n.leaf != first.leaf || n.value_size != first.value_size || n.is_empty())
    {
        return Err(PdError::corrupt(b, "children of one node differ in kind"));
    }
    Ok(())
}

/// `__rebalance2`: merge `left` and `right` (child `r` of `parent`)
/// when together they are few, else share their entries evenly. Returns
/// whether they merged (the right node is then unused).
fn rebalance2_nodes(parent: &mut Node, left: &mut Node, right: &mut Node, r: usize) -> bool {
    let (nl, nr) = (left.len(), right.len());
    // Each keeps at least a third and one more, so the child the removal
    // steps into can lose one (the kernel's threshold since 5.5).
    let threshold = 2 * (merge_threshold(left) + 1);
    if nl + nr < threshold {
        shift(left, right, -(nr as isize));
        parent.remove_at(r);
        true
    } else {
        let target_left = (nl + nr) / 2;
        shift(left, right, nl as isize - target_left as isize);
        parent.keys[r] = right.keys[0];
        false
    }
}

/// `rebalance2`: children `l` and `l + 1` of `parent`.
fn rebalance2<V: ValueType>(tm: &mut Tm, parent: u64, l: usize, vt: &mut V) -> Result<(), PdError> {
    let lb = shadow_child(tm, parent, l, vt)?;
    let rb = shadow_child(tm, parent, l + 1, vt)?;
    let mut p = take(tm, parent);
    let mut left = take(tm, lb);
    let mut right = take(tm, rb);
    let ok = check_siblings(&[&left, &right], parent);
    let merged = ok.is_ok() && rebalance2_nodes(&mut p, &mut left, &mut right, l + 1);
    put(tm, parent, p);
    put(tm, lb, left);
    put(tm, rb, right);
    ok?;
    if merged {
        dec_node(tm, rb)?;
    }
    Ok(())
}

/// `delete_center_node`: as many of `center`'s entries as fit go to
/// `left`, the rest to `right`, then the two are rebalanced. Returns
/// whether `right` merged into `left` too.
fn delete_center(parent: &mut Node, [left, center, right]: [&mut Node; 3], c: usize) -> bool {
    let to_left = (left.max() - left.len()).min(center.len());
    shift(left, center, -(to_left as isize));
    let rest = center.len();
    shift(center, right, rest as isize);
    parent.keys[c + 1] = right.keys[0];
    parent.remove_at(c);
    rebalance2_nodes(parent, left, right, c)
}

/// `redistribute3`: share the entries of three siblings out evenly
/// (the left one takes the remainder).
fn redistribute3(parent: &mut Node, [left, center, right]: [&mut Node; 3], c: usize) {
    let (mut nl, nc, mut nr) = (
        left.len() as isize,
        center.len() as isize,
        right.len() as isize,
    );
    let total = nl + nc + nr;
    let target_right = total / 3;
    let target_left = target_right + isize::from(target_right * 3 != total);
    if nl < nr {
        let mut s = nl - target_left;
        if s < 0 && nc < -s {
            // Not enough in the center node.
            shift(left, center, -nc);
            s += nc;
            shift(left, right, s);
            nr += s;
        } else {
            shift(left, center, s);
        }
        shift(center, right, target_right - nr);
    } else {
        let mut s = target_right - nr;
        if s > 0 && nc < s {
            shift(center, right, nc);
            s -= nc;
            shift(left, right, s);
            nl -= s;
        } else {
            shift(center, right, s);
        }
        shift(left, center, nl - target_left);
    }
    parent.keys[c] = center.keys[0];
    parent.keys[c + 1] = right.keys[0];
}

/// `rebalance3`: children `l`, `l + 1` and `l + 2` of `parent`.
fn rebalance3<V: ValueType>(tm: &mut Tm, parent: u64, l: usize, vt: &mut V) -> Result<(), PdError> {
    let lb = shadow_child(tm, parent, l, vt)?;
    let cb = shadow_child(tm, parent, l + 1, vt)?;
    let rb = shadow_child(tm, parent, l + 2, vt)?;
    let mut p = take(tm, parent);
    let (mut left, mut center, mut right) = (take(tm, lb), take(tm, cb), take(tm, rb));
    let ok = check_siblings(&[&left, &center, &right], parent);
    let (mut center_gone, mut right_gone) = (false, false);
    if ok.is_ok() {
        let total = left.len() + center.len() + right.len();
        let threshold = merge_threshold(&left) * 4 + 1;
        let nodes = [&mut left, &mut center, &mut right];
        if total < threshold {
            center_gone = true;
            right_gone = delete_center(&mut p, nodes, l + 1);
        } else {
            redistribute3(&mut p, nodes, l + 1);
        }
    }
    put(tm, parent, p);
    put(tm, lb, left);
    put(tm, cb, center);
    put(tm, rb, right);
    ok?;
    if center_gone {
        dec_node(tm, cb)?;
    }
    if right_gone {
        dec_node(tm, rb)?;
    }
    Ok(())
}

/// What `rebalance_children` did.
enum Rebalanced {
    /// The child holding the key was rebalanced with its siblings.
    Children,
    /// The node had one child and took over its entries.
    Collapsed,
    /// The key is below every key of the node: not in the tree.
    NoData,
}

/// `rebalance_children` of internal node `b` (made in this
/// transaction), around the child `key` is under.
fn rebalance_children<V: ValueType>(
    tm: &mut Tm,
    b: u64,
    key: u64,
    vt: &mut V,
) -> Result<Rebalanced, PdError> {
    let n = tm.node(b)?;
    if n.len() == 1 {
        let child_b = n.value_u64(0);
        drop(n);
        let shared = tm.meta.get(child_b) > 1;
        let child = tm.node(child_b)?;
        if shared {
            inc_children(tm, &child, child_b, vt)?;
        } else if child.leaf {
            check_leaf::<V>(&child, child_b)?;
        }
        let copy = (*child).clone();
        drop(child);
        put(tm, b, copy);
        dec_node(tm, child_b)?;
        return Ok(Rebalanced::Collapsed);
    }
    let Some(i) = n.lower_bound(key) else {
        return Ok(Rebalanced::NoData);
    };
    let nr = n.len();
    drop(n);
    if i == 0 {
        rebalance2(tm, b, 0, vt)?;
    } else if i == nr - 1 {
        rebalance2(tm, b, i - 1, vt)?;
    } else {
        rebalance3(tm, b, i - 1, vt)?;
    }
    Ok(Rebalanced::Children)
}

/// `remove_raw` / `remove_nearest`: shadow the path from `root` to the
/// leaf `key` is under, rebalancing each node's children on the way.
/// Returns the new root and the leaf, `None` when an internal node has
/// no child for `key`.
fn descend<V: ValueType>(
    tm: &mut Tm,
    root: u64,
    key: u64,
    vt: &mut V,
) -> Result<(u64, Option<u64>), PdError> {
    let new_root = shadow(tm, root, vt)?;
    let mut cur = new_root;
    for _ in 0..MAX_DEPTH {
        let n = tm.node(cur)?;
        if n.leaf {
            check_leaf::<V>(&n, cur)?;
            return Ok((new_root, Some(cur)));
        }
        drop(n);
        match rebalance_children(tm, cur, key, vt)? {
            Rebalanced::NoData => return Ok((new_root, None)),
            // The node is the root again, with the child's entries: its
            // children are rebalanced before the walk goes on.
            Rebalanced::Collapsed => continue,
            Rebalanced::Children => {}
        }
        let n = tm.node(cur)?;
        let Some(i) = n.lower_bound(key) else {
            return Ok((new_root, None));
        };
        drop(n);
        cur = shadow_child(tm, cur, i, vt)?;
    }
    Err(too_deep(root))
}

/// `dm_btree_remove`: remove `key` from the tree at `root`; the value
/// removed (returned) loses its reference. Returns the new root, which
/// holds the same entries when `key` was not there (though the nodes on
/// its path were shadowed and rebalanced).
pub fn remove<V: ValueType>(
    tm: &mut Tm,
    root: u64,
    key: u64,
    vt: &mut V,
) -> Result<(u64, Option<V::Value>), PdError> {
    let (root, leaf) = descend(tm, root, key, vt)?;
    let Some(leaf) = leaf else {
        return Ok((root, None));
    };
    let Ok(i) = tm.node(leaf)?.keys.binary_search(&key) else {
        return Ok((root, None));
    };
    Ok((root, Some(remove_entry(tm, leaf, i, vt)?)))
}

/// Entry `i` of `leaf` goes; its value loses its reference.
fn remove_entry<V: ValueType>(
    tm: &mut Tm,
    leaf: u64,
    i: usize,
    vt: &mut V,
) -> Result<V::Value, PdError> {
    let v = value_of::<V>(&*tm.node(leaf)?, i);
    vt.dec(tm, &v)?;
    tm.node_mut(leaf).remove_at(i);
    Ok(v)
}

/// What [`remove_leaves`] and [`remove_range`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Removed {
    /// The tree's new root.
    pub root: u64,
    /// Entries removed.
    pub count: u64,
}

/// `dm_btree_remove_leaves`: remove the run of keys from `begin` (which
/// should be present) up to `end`, one descent from the root each
/// (`remove_one`), stopping where the run stops. `removed` sees each
/// key and value removed, after the value lost its reference. Returns
/// the new root, the entries removed, and the key after the last one.
pub fn remove_leaves<V: ValueType>(
    tm: &mut Tm,
    root: u64,
    begin: u64,
    end: u64,
    vt: &mut V,
    removed: &mut dyn FnMut(u64, V::Value),
) -> Result<(Removed, u64), PdError> {
    let (mut root, mut key, mut count) = (root, begin, 0);
    while key < end {
        let (r, leaf) = descend(tm, root, key, vt)?;
        root = r;
        let Some(leaf) = leaf else { break };
        let n = tm.node(leaf)?;
        // `remove_nearest`: the entry at or below `key`, else the first.
        let i = n.lower_bound(key).unwrap_or(0);
        let Some(&k) = n.keys.get(i) else { break };
        drop(n);
        if k < key || k >= end {
            break;
        }
        let v = remove_entry(tm, leaf, i, vt)?;
        removed(k, v);
        count += 1;
        key = match k.checked_add(1) {
            Some(next) => next,
            None => break,
        };
    }
    Ok((Removed { root, count }, key))
}

/// Every key in `begin..end` goes (`__remove_range`'s loop: find the
/// next key present with a lookup, remove the run that starts there,
/// and again). `removed` sees each key and value removed.
pub fn remove_range<V: ValueType>(
    tm: &mut Tm,
    root: u64,
    begin: u64,
    end: u64,
    vt: &mut V,
    removed: &mut dyn FnMut(u64, V::Value),
) -> Result<Removed, PdError> {
    let mut done = Removed { root, count: 0 };
    let mut key = begin;
    while key < end {
        let Some(k) = super::btree::first_key_from(tm, done.root, key)? else {
            break;
        };
        if k >= end {
            break;
        }
        let (run, next) = remove_leaves(tm, done.root, k, end, vt, removed)?;
        done = Removed {
            root: run.root,
            count: done.count + run.count,
        };
        if run.count == 0 {
            // The lookup found `k` but the removal did not: the tree
            // contradicts itself.
            return Err(PdError::corrupt(done.root, "a key found is not removable"));
        }
        key = next;
    }
    Ok(done)
}
