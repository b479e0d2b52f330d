//! The transaction manager (`persistent-data/dm-transaction-manager.c`):
//! metadata blocks read through a cache, new blocks handed out by the
//! metadata space map, and the set of blocks made in this transaction
//! (`shadows`) -- the only ones that may be changed in place. Every
//! other block belongs to the last committed transaction and is copied
//! before a change (`dm_tm_shadow_block`), so a crash before the next
//! superblock write finds the old transaction whole.

use super::node::Node;
use super::space_map::SpaceMap;
use super::{FormatError, BLOCK_SIZE};
use crate::target::DevArg;
use crate::targets::thin::metadata::MetadataError;
use blkstack_core::sync::{submit_and_wait, submit_and_wait_flags};
use blkstack_core::{Bio, BioFlags, EndIo, IoBuf, Op, Status};
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

/// Block numbers hash to themselves, spread by one multiplication: the
/// node cache is looked up on every thin I/O, and SipHash's protection
/// against chosen keys buys nothing for block numbers the pool chose.
#[derive(Default)]
pub struct BlockHasher(u64);

impl Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | b as u64;
        }
    }
    fn write_u64(&mut self, n: u64) {
        // One key is itself; a pair (the mapping cache's) mixes both.
        self.0 = self.0.rotate_left(29) ^ n;
    }
}

type BlockMap<V> = HashMap<u64, V, BuildHasherDefault<BlockHasher>>;
type BlockSet = HashSet<u64, BuildHasherDefault<BlockHasher>>;

/// Writes in flight at once, counted down by their completions.
#[derive(Default)]
struct Batch {
    left: Mutex<(usize, bool)>,
    cv: Condvar,
}

impl EndIo for Batch {
    fn end_io(&self, _bio: Bio, status: Status, _private: u64) {
        let mut g = self.left.lock();
        g.0 -= 1;
        g.1 |= !status.is_ok();
        if g.0 == 0 {
            self.cv.notify_all();
        }
    }
}

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

/// The transaction manager: the metadata device, both space maps, the
/// node cache and this transaction's shadows (kernel `struct
/// dm_transaction_manager`).
pub struct Tm {
    /// The metadata device.
    pub dev: DevArg,
    /// Reference counts of the metadata blocks.
    pub meta: SpaceMap,
    /// Reference counts of the data device's blocks.
    pub data: SpaceMap,
    cache: BlockMap<Arc<Node>>,
    /// Blocks allocated in this transaction (written at commit).
    shadows: BlockSet,
    /// Other metadata blocks (bitmaps, index) to write at commit.
    pub(crate) raw_dirty: HashMap<u64, Vec<u8>>,
}

impl Tm {
    /// A transaction manager on `dev` with the given space maps, an empty
    /// cache and no shadows.
    pub fn new(dev: DevArg, meta: SpaceMap, data: SpaceMap) -> Tm {
        Tm {
            dev,
            meta,
            data,
            cache: BlockMap::default(),
            shadows: BlockSet::default(),
            raw_dirty: HashMap::new(),
        }
    }

    /// Read metadata block `b` from the device, bypassing the cache.
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

    /// Write metadata block `b` (with FUA when `fua`: the superblock).
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

    /// Flush the metadata device's cache: what a commit does before the
    /// superblock write.
    pub fn flush(&self) -> Result<(), MetadataError> {
        let st = submit_and_wait(&*self.dev.dev, Op::Flush, 0, 0, &mut []);
        io(st, "flush", 0)
    }

    /// Btree node `b`, from the cache or read and validated (kernel
    /// `dm_tm_read_lock` with the btree validator).
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

    /// Node `b` if it is in memory, without reading it.
    pub fn cached(&self, b: u64) -> Option<&Arc<Node>> {
        self.cache.get(&b)
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
        self.meta.dec(b)?;
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

    /// Add the reference a copied value of `kind` holds (the
    /// `dm_btree_value_type` `inc` hook): a data block for a mapping, a
    /// subtree's root for a subtree.
    pub fn inc_value(&mut self, kind: ValueKind, v: &[u8]) {
        match kind {
            ValueKind::Mapping => self.data.inc(u64_of(v) >> 24),
            ValueKind::Subtree => self.meta.inc(u64_of(v)),
            ValueKind::Plain => {}
        }
    }

    /// Drop the reference a deleted value of `kind` held (the
    /// `dm_btree_value_type` `dec` hook): a data block's count, or a
    /// subtree's, deleting the subtree when that was its last reference.
    pub fn dec_value(&mut self, kind: ValueKind, v: &[u8]) -> Result<(), MetadataError> {
        match kind {
            ValueKind::Mapping => {
                self.data.dec(u64_of(v) >> 24)?;
            }
            ValueKind::Subtree => self.del(u64_of(v), ValueKind::Mapping)?,
            ValueKind::Plain => {}
        }
        Ok(())
    }

    /// `dm_btree_del`: drop a reference to the tree at `root`; a node no
    /// longer referred to releases what it refers to.
    pub fn del(&mut self, root: u64, kind: ValueKind) -> Result<(), MetadataError> {
        self.del_at(root, kind, 0)
    }

    fn del_at(&mut self, root: u64, kind: ValueKind, depth: usize) -> Result<(), MetadataError> {
        if depth > 128 {
            return Err(MetadataError::corrupt(
                root,
                "btree deeper than 64 levels (a cycle?)",
            ));
        }
        if self.meta.get(root) > 1 {
            self.meta.dec(root)?;
            return Ok(());
        }
        let n = self.node(root)?;
        if n.leaf && kind != ValueKind::Plain && n.value_size != 8 {
            return Err(MetadataError::corrupt(
                root,
                "leaf of 8-byte values has another size",
            ));
        }
        for i in 0..n.len() {
            if n.leaf {
                match kind {
                    ValueKind::Subtree => {
                        self.del_at(n.value_u64(i), ValueKind::Mapping, depth + 1)?
                    }
                    _ => self.dec_value(kind, n.value(i))?,
                }
            } else {
                self.del_at(n.value_u64(i), kind, depth + 1)?;
            }
        }
        self.meta.dec(root)?;
        self.cache.remove(&root);
        self.shadows.remove(&root);
        Ok(())
    }

    /// Write every node this transaction made, and the other blocks
    /// queued for the commit, all in flight at once (before the
    /// superblock, which is written after they all completed).
    pub fn write_shadows(&mut self) -> Result<(), MetadataError> {
        let mut blocks: Vec<u64> = self.shadows.iter().copied().collect();
        blocks.sort_unstable();
        let mut writes: Vec<(u64, Vec<u8>)> = blocks
            .into_iter()
            .filter_map(|b| self.cache.get(&b).map(|n| (b, n.encode(b))))
            .collect();
        writes.extend(self.raw_dirty.drain());
        let batch = Arc::new(Batch::default());
        batch.left.lock().0 = writes.len();
        for (b, data) in writes.iter_mut() {
            // SAFETY: `writes` outlives the bios: we wait below until every
            // one has completed before it is dropped.
            let buf = unsafe { IoBuf::from_slice(data) };
            let bio = Bio::new(
                Op::Write,
                *b * BLOCK_SIZE as u64,
                BLOCK_SIZE as u64,
                buf,
                batch.clone(),
                0,
            );
            self.dev.dev.submit(bio);
        }
        let mut g = batch.left.lock();
        while g.0 > 0 {
            batch.cv.wait(&mut g);
        }
        if g.1 {
            return Err(MetadataError::Io {
                what: "write",
                block: writes.first().map(|w| w.0).unwrap_or(0),
                status: Status::IoError,
            });
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

/// The little-endian u64 at the start of a btree value.
pub fn u64_of(v: &[u8]) -> u64 {
    super::le64(v, 0)
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
