//! A persistent-data btree node (`persistent-data/dm-btree-internal.h`):
//! a 32-byte header, `max_entries` keys, then `max_entries` values of
//! `value_size` bytes. Internal nodes hold 8-byte child block numbers;
//! each key is the lowest key below its child.

use super::checksum::{check_block, seal, BTREE_XOR};
use super::{le32, le64, put32, put64, FormatError, BLOCK_SIZE};

const HEADER: usize = 32;
const INTERNAL_NODE: u32 = 1;
const LEAF_NODE: u32 = 2;

/// `calc_max_entries`: as many entries as fit, rounded down to a multiple
/// of three (so a node split in two, or three merged into two, stays
/// within the 1/3 fill `thin_check` expects of non-root nodes).
pub fn max_entries(value_size: usize) -> usize {
    let n = (BLOCK_SIZE - HEADER) / (8 + value_size);
    n / 3 * 3
}

/// One btree node in memory: its kind, keys and packed values, encoded
/// to and decoded from one metadata block (kernel `struct btree_node`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// A leaf (values are the tree's values) or internal (values are child
    /// block numbers); kernel `LEAF_NODE`/`INTERNAL_NODE`.
    pub leaf: bool,
    /// Bytes per value (8 for internal nodes).
    pub value_size: usize,
    /// The keys, ascending.
    pub keys: Vec<u64>,
    /// `keys.len() * value_size` bytes.
    pub values: Vec<u8>,
}

impl Node {
    /// A leaf with no entries whose values are `value_size` bytes.
    pub fn empty_leaf(value_size: usize) -> Node {
        Node {
            leaf: true,
            value_size,
            keys: Vec::new(),
            values: Vec::new(),
        }
    }

    /// An internal node with no entries.
    pub fn internal() -> Node {
        Node {
            leaf: false,
            value_size: 8,
            keys: Vec::new(),
            values: Vec::new(),
        }
    }

    /// Entries in the node (kernel `nr_entries`).
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the node has no entries.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The most entries a node of this value size holds (kernel
    /// `max_entries`).
    pub fn max(&self) -> usize {
        max_entries(self.value_size)
    }

    /// The value of entry `i`.
    pub fn value(&self, i: usize) -> &[u8] {
        &self.values[i * self.value_size..(i + 1) * self.value_size]
    }

    /// An 8-byte value (a child, a subtree root, a mapping).
    pub fn value_u64(&self, i: usize) -> u64 {
        le64(&self.values, i * self.value_size)
    }

    /// Overwrite the value of entry `i`.
    pub fn set_value(&mut self, i: usize, v: &[u8]) {
        let vs = self.value_size;
        self.values[i * vs..(i + 1) * vs].copy_from_slice(v);
    }

    /// Insert `key` with value `v` as entry `i`, shifting the later ones up.
    pub fn insert_at(&mut self, i: usize, key: u64, v: &[u8]) {
        let vs = self.value_size;
        self.keys.insert(i, key);
        let at = i * vs;
        self.values.splice(at..at, v.iter().copied());
    }

    /// Remove entry `i`, shifting the later ones down.
    pub fn remove_at(&mut self, i: usize) {
        let vs = self.value_size;
        self.keys.remove(i);
        self.values.drain(i * vs..(i + 1) * vs);
    }

    /// Move entries `at..` into a new node of the same kind.
    pub fn split_off(&mut self, at: usize) -> Node {
        Node {
            leaf: self.leaf,
            value_size: self.value_size,
            keys: self.keys.split_off(at),
            values: self.values.split_off(at * self.value_size),
        }
    }

    /// `lower_bound`: the index of the last key <= `key`, if any.
    pub fn lower_bound(&self, key: u64) -> Option<usize> {
        match self.keys.binary_search(&key) {
            Ok(i) => Some(i),
            Err(0) => None,
            Err(i) => Some(i - 1),
        }
    }

    /// The node as metadata block `blocknr`: header, keys and values, sealed
    /// with its checksum.
    pub fn encode(&self, blocknr: u64) -> Vec<u8> {
        let mut b = vec![0u8; BLOCK_SIZE];
        let max = self.max();
        debug_assert!(self.len() <= max);
        put32(&mut b, 4, if self.leaf { LEAF_NODE } else { INTERNAL_NODE });
        put64(&mut b, 8, blocknr);
        put32(&mut b, 16, self.len() as u32);
        put32(&mut b, 20, max as u32);
        put32(&mut b, 24, self.value_size as u32);
        for (i, k) in self.keys.iter().enumerate() {
            put64(&mut b, HEADER + i * 8, *k);
        }
        let at = HEADER + max * 8;
        b[at..at + self.values.len()].copy_from_slice(&self.values);
        seal(&mut b, BTREE_XOR);
        b
    }

    /// Decode and validate as `btree_node_validator` does, plus key order.
    pub fn decode(b: &[u8], at: u64) -> Result<Node, FormatError> {
        let what = "btree node";
        check_block(b, at, BTREE_XOR, what)?;
        let invalid = |why: String| FormatError::Invalid {
            what,
            block: at,
            why,
        };
        let flags = le32(b, 4);
        let nr = le32(b, 16) as usize;
        let max = le32(b, 20) as usize;
        let value_size = le32(b, 24) as usize;
        let leaf = match flags {
            LEAF_NODE => true,
            INTERNAL_NODE => false,
            f => return Err(invalid(format!("flags {f:#x}"))),
        };
        if value_size == 0 || HEADER + max * (8 + value_size) > BLOCK_SIZE || nr > max {
            return Err(invalid(format!(
                "{nr} entries, max {max}, value size {value_size}"
            )));
        }
        if !leaf && nr == 0 {
            return Err(invalid("internal node with no entries".into()));
        }
        if !leaf && value_size != 8 {
            return Err(invalid(format!("internal node value size {value_size}")));
        }
        let keys: Vec<u64> = (0..nr).map(|i| le64(b, HEADER + i * 8)).collect();
        if keys.windows(2).any(|w| w[0] >= w[1]) {
            return Err(invalid("keys out of order".into()));
        }
        let at_v = HEADER + max * 8;
        Ok(Node {
            leaf,
            value_size,
            keys,
            values: b[at_v..at_v + nr * value_size].to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_entries_match_the_kernel() {
        assert_eq!(max_entries(8), 252);
        assert_eq!(max_entries(24), 126);
        assert_eq!(max_entries(16), 168);
        assert_eq!(max_entries(4), 336);
    }

    #[test]
    fn node_round_trips() {
        let mut n = Node::empty_leaf(8);
        for k in [5u64, 1, 9] {
            let i = n.keys.partition_point(|&x| x < k);
            n.insert_at(i, k, &(k * 100).to_le_bytes());
        }
        let b = n.encode(42);
        let m = Node::decode(&b, 42).unwrap();
        assert_eq!(m, n);
        assert_eq!(m.keys, vec![1, 5, 9]);
        assert_eq!(m.value_u64(2), 900);
        assert_eq!(m.lower_bound(6), Some(1));
        assert_eq!(m.lower_bound(0), None);
    }
}
