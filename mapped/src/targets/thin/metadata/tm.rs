//! The transaction manager (`persistent-data/dm-transaction-manager.c`):
//! metadata blocks read through a cache, new blocks handed out by the
//! metadata space map, and the set of blocks made in this transaction
//! (`shadows`) -- the only ones that may be changed in place. Every
//! other block belongs to the last committed transaction and is copied
//! before a change (`dm_tm_shadow_block`), so a crash before the next
//! superblock write finds the old transaction whole.

use super::super::format::node::Node;
use super::super::format::{FormatError, BLOCK_SIZE};
use super::space_map::SpaceMap;
use super::MetadataError;
use crate::target::DevArg;
use blkstack_core::sync::{submit_and_wait, submit_and_wait_flags};
use blkstack_core::{BioFlags, Op, Status};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Clean nodes kept in memory before the cache drops them (dirty ones
/// stay until the commit writes them).
const CACHE_CLEAN_LIMIT: usize = 16384;

/// What a btree's values are, for the reference counts a copy or a
/// deletion must adjust (the `dm_btree_value_type` inc/dec hooks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueKind {
    /// `block << 24 | time`: a data block.
    Mapping,
    /// A metadata block: the root of a device's mapping tree.
    Subtree,
    /// Values that refer to nothing.
    Plain,
}

pub struct Tm {
    pub dev: DevArg,
    pub meta: SpaceMap,
    pub data: SpaceMap,
    cache: HashMap<u64, Arc<Node>>,
    /// Blocks allocated in this transaction (written at commit).
    shadows: HashSet<u64>,
    /// Other metadata blocks (bitmaps, index) to write at commit.
    pub(super) raw_dirty: HashMap<u64, Vec<u8>>,
}

impl Tm {
    pub fn new(dev: DevArg, meta: SpaceMap, data: SpaceMap) -> Tm {
        Tm {
            dev,
            meta,
            data,
            cache: HashMap::new(),
            shadows: HashSet::new(),
            raw_dirty: HashMap::new(),
        }
    }

    pub fn read_block(&self, b: u64) -> Result<Vec<u8>, MetadataError> {
        let mut buf = vec![0u8; BLOCK_SIZE];
        let st = submit_and_wait(
            &*self.dev.dev,
            Op::Read,
            b * BLOCK_SIZE as u64,
            BLOCK_SIZE as u64,
            &mut buf,
        );
        io(st, "read", b)?;
        Ok(buf)
    }

    pub fn write_block(&self, b: u64, data: &mut [u8], fua: bool) -> Result<(), MetadataError> {
        let flags = if fua { BioFlags::FUA } else { BioFlags::NONE };
        let st = submit_and_wait_flags(
            &*self.dev.dev,
            Op::Write,
            flags,
            b * BLOCK_SIZE as u64,
            BLOCK_SIZE as u64,
            data,
        );
        io(st, "write", b)
    }

    pub fn flush(&self) -> Result<(), MetadataError> {
        let st = submit_and_wait(&*self.dev.dev, Op::Flush, 0, 0, &mut []);
        io(st, "flush", 0)
    }

    pub fn node(&mut self, b: u64) -> Result<Arc<Node>, MetadataError> {
        if let Some(n) = self.cache.get(&b) {
            return Ok(n.clone());
        }
        if b >= self.meta.nr_blocks() {
            return Err(MetadataError::Format(FormatError::Invalid {
                what: "btree node",
                block: b,
                why: format!(
                    "beyond the metadata device's {} blocks",
                    self.meta.nr_blocks()
                ),
            }));
        }
        let raw = self.read_block(b)?;
        let n = Arc::new(Node::decode(&raw, b)?);
        if self.cache.len() >= CACHE_CLEAN_LIMIT {
            let shadows = &self.shadows;
            self.cache.retain(|k, _| shadows.contains(k));
        }
        self.cache.insert(b, n.clone());
        Ok(n)
    }

    /// A node made in this transaction, to change in place.
    pub fn node_mut(&mut self, b: u64) -> &mut Node {
        debug_assert!(self.shadows.contains(&b));
        Arc::make_mut(
            self.cache
                .entry(b)
                .or_insert_with(|| Arc::new(Node::internal())),
        )
    }

    /// A new block holding `n`.
    pub fn new_node(&mut self, n: Node) -> Result<u64, MetadataError> {
        let b = self.meta.alloc().ok_or(MetadataError::NoMetadataSpace)?;
        self.shadows.insert(b);
        self.cache.insert(b, Arc::new(n));
        Ok(b)
    }

    /// `dm_tm_shadow_block` for a btree node: the block itself if this
    /// transaction made it and nothing else refers to it, else a copy
    /// (whose children gain a reference when the original was shared).
    pub fn shadow(&mut self, b: u64, kind: ValueKind) -> Result<u64, MetadataError> {
        let count = self.meta.get(b);
        if self.shadows.contains(&b) && count == 1 {
            return Ok(b);
        }
        let n = self.node(b)?;
        let copy = self.new_node((*n).clone())?;
        if count > 1 {
            self.inc_children(&n, kind);
        }
        self.meta.dec(b);
        Ok(copy)
    }

    fn inc_children(&mut self, n: &Node, kind: ValueKind) {
        for i in 0..n.len() {
            if !n.leaf {
                self.meta.inc(n.value_u64(i));
            } else {
                self.inc_value(kind, n.value(i));
            }
        }
    }

    pub fn inc_value(&mut self, kind: ValueKind, v: &[u8]) {
        match kind {
            ValueKind::Mapping => self.data.inc(u64_of(v) >> 24),
            ValueKind::Subtree => self.meta.inc(u64_of(v)),
            ValueKind::Plain => {}
        }
    }

    pub fn dec_value(&mut self, kind: ValueKind, v: &[u8]) -> Result<(), MetadataError> {
        match kind {
            ValueKind::Mapping => {
                self.data.dec(u64_of(v) >> 24);
            }
            ValueKind::Subtree => self.del(u64_of(v), ValueKind::Mapping)?,
            ValueKind::Plain => {}
        }
        Ok(())
    }

    /// `dm_btree_del`: drop a reference to the tree at `root`; a node no
    /// longer referred to releases what it refers to.
    pub fn del(&mut self, root: u64, kind: ValueKind) -> Result<(), MetadataError> {
        if self.meta.get(root) > 1 {
            self.meta.dec(root);
            return Ok(());
        }
        let n = self.node(root)?;
        for i in 0..n.len() {
            if n.leaf {
                self.dec_value(kind, n.value(i))?;
            } else {
                self.del(n.value_u64(i), kind)?;
            }
        }
        self.meta.dec(root);
        self.cache.remove(&root);
        self.shadows.remove(&root);
        Ok(())
    }

    /// Write every node this transaction made (before the superblock).
    pub fn write_shadows(&mut self) -> Result<(), MetadataError> {
        let mut blocks: Vec<u64> = self.shadows.iter().copied().collect();
        blocks.sort_unstable();
        for b in blocks {
            if let Some(n) = self.cache.get(&b) {
                let mut raw = n.encode(b);
                self.write_block(b, &mut raw, false)?;
            }
        }
        let mut raw: Vec<(u64, Vec<u8>)> = self.raw_dirty.drain().collect();
        raw.sort_unstable_by_key(|(b, _)| *b);
        for (b, mut data) in raw {
            self.write_block(b, &mut data, false)?;
        }
        Ok(())
    }

    /// The transaction is on disk.
    pub fn committed(&mut self) {
        self.shadows.clear();
        self.meta.committed();
        self.data.committed();
    }

    /// Forget everything not committed (the kernel's abort): the caller
    /// reloads the space maps from disk.
    pub fn drop_cache(&mut self) {
        self.cache.clear();
        self.shadows.clear();
        self.raw_dirty.clear();
    }
}

pub fn u64_of(v: &[u8]) -> u64 {
    super::super::format::le64(v, 0)
}

fn io(st: Status, what: &'static str, block: u64) -> Result<(), MetadataError> {
    if st.is_ok() {
        Ok(())
    } else {
        Err(MetadataError::Io {
            what,
            block,
            status: st,
        })
    }
}
