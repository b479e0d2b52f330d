//! The transaction manager (`persistent-data/dm-transaction-manager.c`):
//! metadata blocks read through a cache, new blocks handed out by the
//! metadata space map, and the set of blocks made in this transaction
//! (`shadows`) -- the only ones that may be changed in place. Every
//! other block belongs to the last committed transaction and is copied
//! before a change (`dm_tm_shadow_block`), so a crash before the next
//! superblock write finds the old transaction whole.

use super::block_manager::BlockManager;
use super::node::Node;
use super::space_map::SpaceMap;
use super::{FormatError, PdError};
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

/// Block numbers hash to themselves, spread by one multiplication: the
/// node cache is looked up on every metadata lookup, and SipHash's protection
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

/// A validator for a non-btree block: its contents and where it was
/// read from (the kernel's `dm_block_validator` `check`).
pub type BlockCheck = dyn Fn(&[u8], u64) -> Result<(), FormatError>;

/// Clean nodes kept in memory before the cache drops them (dirty ones
/// stay until the commit writes them).
const CACHE_CLEAN_LIMIT: usize = 16384;

/// The transaction manager: the metadata device's blocks, the metadata
/// space map, the node cache and this transaction's shadows (kernel
/// `struct dm_transaction_manager`).
pub struct Tm {
    /// The metadata device.
    pub bm: BlockManager,
    /// Reference counts of the metadata blocks.
    pub meta: SpaceMap,
    cache: BlockMap<Arc<Node>>,
    /// Blocks allocated in this transaction (written at commit).
    shadows: BlockSet,
    /// Other metadata blocks (bitmaps, index, superblock copies) to
    /// write at commit.
    raw_dirty: HashMap<u64, Vec<u8>>,
    /// The metadata space map's reference count tree changes are being
    /// made (`sm_metadata::flush_rc`): the blocks they take do not start
    /// another round.
    rc_flushing: bool,
}

impl Tm {
    /// A transaction manager on `bm` with the metadata space map `meta`,
    /// an empty cache and no shadows.
    pub fn new(bm: BlockManager, meta: SpaceMap) -> Tm {
        Tm {
            bm,
            meta,
            cache: BlockMap::default(),
            shadows: BlockSet::default(),
            raw_dirty: HashMap::new(),
            rc_flushing: false,
        }
    }

    /// Start making the metadata space map's reference count tree
    /// changes; false when they are being made already.
    pub(super) fn begin_rc_flush(&mut self) -> bool {
        !std::mem::replace(&mut self.rc_flushing, true)
    }

    /// The reference count tree changes are made.
    pub(super) fn end_rc_flush(&mut self) {
        self.rc_flushing = false;
    }

    /// A new metadata block (`dm_sm_new_block`,
    /// `sm_metadata_new_block_`): the first free one from the cursor,
    /// counted as [`Self::inc`] counts.
    pub fn alloc(&mut self) -> Result<u64, PdError> {
        if !self.meta.is_self_counting() {
            super::sm_metadata::flush_rc(self)?;
            return self.meta.alloc().ok_or(PdError::NoMetadataSpace);
        }
        let b = self.meta.find_new().ok_or(PdError::NoMetadataSpace)?;
        self.sm_change(b, true)?;
        Ok(b)
    }

    /// One more reference to metadata block `b` (`dm_tm_inc`,
    /// `sm_metadata_inc_block`).
    pub fn inc(&mut self, b: u64) -> Result<(), PdError> {
        self.sm_change(b, true).map(|_| ())
    }

    /// One reference less to metadata block `b` (`dm_tm_dec`,
    /// `sm_metadata_dec_block`); returns the count left. A block whose
    /// count is 0 is refused ([`super::space_map::RefCountError`]).
    pub fn dec(&mut self, b: u64) -> Result<u32, PdError> {
        self.sm_change(b, false)
    }

    /// A count change of the metadata space map as the kernel makes it.
    /// Outside any other change (`in()`), the bitmap entry changes and a
    /// count above 2 changes in the reference count tree at once; the
    /// blocks that tree change and the bitmap's copy take and let go are
    /// counted after it, in order (`out()`, `apply_bops`), each of those
    /// changes made the same way. Inside another change (the tree's own
    /// node copies), the change waits in that queue (`add_bop`). So a
    /// block freed after a change is never one the change's tree nodes
    /// could take.
    fn sm_change(&mut self, b: u64, inc: bool) -> Result<u32, PdError> {
        if !self.meta.is_self_counting() {
            // A bare map (tests): no tree to change.
            let left = if inc {
                self.meta.inc(b);
                self.meta.get(b)
            } else {
                self.meta.dec(b)?
            };
            super::sm_metadata::flush_rc(self)?;
            return Ok(left);
        }
        if !self.meta.enter() {
            return Ok(self.meta.add_bop(b, inc)?);
        }
        let r = self.ll_change(b, inc).and_then(|_| {
            while let Some((b, inc)) = self.meta.pop_bop() {
                self.ll_change(b, inc)?;
            }
            Ok(())
        });
        self.meta.leave();
        r?;
        Ok(self.meta.get(b))
    }

    /// `sm_ll_inc`/`sm_ll_dec` of one metadata block, inside a change:
    /// the bitmap, then the reference count tree.
    fn ll_change(&mut self, b: u64, inc: bool) -> Result<(), PdError> {
        if let Some(op) = self.meta.ll_change(b, inc)? {
            let root = self.meta.rc_root;
            self.meta.rc_root = super::sm_metadata::apply_rc(self, root, op)?;
        }
        Ok(())
    }

    /// Read metadata block `b` from the device, bypassing the cache.
    pub fn read_block(&self, b: u64) -> Result<Vec<u8>, PdError> {
        self.bm.read_block(b)
    }

    /// Write metadata block `b` (with FUA when `fua`: the superblock).
    pub fn write_block(&self, b: u64, data: &mut [u8], fua: bool) -> Result<(), PdError> {
        self.bm.write_block(b, data, fua)
    }

    /// Flush the metadata device's cache: what a commit does before the
    /// superblock write.
    pub fn flush(&self) -> Result<(), PdError> {
        self.bm.flush()
    }

    /// Queue block `b`'s whole contents (not a btree node: a bitmap, an
    /// index, a superblock copy) for the commit's writes.
    pub fn queue_raw(&mut self, b: u64, data: Vec<u8>) {
        self.raw_dirty.insert(b, data);
    }

    /// What [`Self::queue_raw`] queued for `b`, if it is still queued.
    pub fn queued_raw(&self, b: u64) -> Option<&[u8]> {
        self.raw_dirty.get(&b).map(|v| v.as_slice())
    }

    /// Drop what [`Self::queue_raw`] queued for `b`.
    pub fn unqueue_raw(&mut self, b: u64) {
        self.raw_dirty.remove(&b);
    }

    /// A block that is not a btree node (an array block, a superblock
    /// copy) as this transaction sees it: what is queued for the commit,
    /// else read from the device and checked by `check` (the kernel's
    /// `dm_tm_read_lock` with that structure's validator).
    pub fn raw_block(&self, b: u64, check: &BlockCheck) -> Result<Vec<u8>, PdError> {
        if let Some(q) = self.raw_dirty.get(&b) {
            return Ok(q.clone());
        }
        self.check_in_range(b, "block")?;
        let raw = self.read_block(b)?;
        check(&raw, b)?;
        Ok(raw)
    }

    /// A queued non-btree block's contents, to change in place (the
    /// caller seals it again).
    pub fn raw_mut(&mut self, b: u64) -> Option<&mut Vec<u8>> {
        self.raw_dirty.get_mut(&b)
    }

    /// `dm_tm_new_block` for a non-btree block: a new block holding
    /// `data`, written at commit.
    pub fn new_raw(&mut self, data: Vec<u8>) -> Result<u64, PdError> {
        let b = self.alloc()?;
        self.raw_dirty.insert(b, data);
        Ok(b)
    }

    /// `dm_tm_shadow_block` for a non-btree block: `b` itself if this
    /// transaction made it and nothing else refers to it, else a copy
    /// (queued, its location still to be sealed in by the caller). The
    /// flag says the original was shared, as [`Self::shadow`]'s does.
    pub fn shadow_raw(&mut self, b: u64, check: &BlockCheck) -> Result<(u64, bool), PdError> {
        let count = self.meta.get(b);
        if self.raw_dirty.contains_key(&b) && count == 1 {
            return Ok((b, false));
        }
        let data = self.raw_block(b, check)?;
        let copy = self.new_raw(data)?;
        if self.dec(b)? == 0 {
            self.raw_dirty.remove(&b);
        }
        Ok((copy, count > 1))
    }

    fn check_in_range(&self, b: u64, what: &'static str) -> Result<(), PdError> {
        if b >= self.meta.nr_blocks() {
            return Err(PdError::Format(FormatError::Invalid {
                what,
                block: b,
                why: format!(
                    "beyond the metadata device's {} blocks",
                    self.meta.nr_blocks()
                ),
            }));
        }
        Ok(())
    }

    /// Btree node `b`, from the cache or read and validated (kernel
    /// `dm_tm_read_lock` with the btree validator).
    pub fn node(&mut self, b: u64) -> Result<Arc<Node>, PdError> {
        if let Some(n) = self.cache.get(&b) {
            return Ok(n.clone());
        }
        if b >= self.meta.nr_blocks() {
            return Err(PdError::Format(FormatError::Invalid {
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

    /// Block `b`, already counted and made in this transaction (the
    /// bootstrap's), holds `n`.
    pub fn adopt_node(&mut self, b: u64, n: Node) {
        self.shadows.insert(b);
        self.cache.insert(b, Arc::new(n));
    }

    /// A new block holding `n`.
    pub fn new_node(&mut self, n: Node) -> Result<u64, PdError> {
        let b = self.alloc()?;
        self.shadows.insert(b);
        self.cache.insert(b, Arc::new(n));
        Ok(b)
    }

    /// `dm_tm_shadow_block` for a btree node: the block itself if this
    /// transaction made it and nothing else refers to it, else a copy.
    /// The flag says the original was shared, so what the copy refers to
    /// has one more referrer now (the caller, who knows what the values
    /// are, adds those references: `dm-btree-spine.c` `inc_children`).
    pub fn shadow(&mut self, b: u64) -> Result<(u64, bool), PdError> {
        let count = self.meta.get(b);
        if self.shadows.contains(&b) && count == 1 {
            return Ok((b, false));
        }
        let n = self.node(b)?;
        let copy = self.new_node((*n).clone())?;
        self.dec(b)?;
        Ok((copy, count > 1))
    }

    /// `dm_tm_shadow_block` of a superblock at `at` held once more (a
    /// metadata snapshot, `__reserve_metadata_snap`,
    /// `metadata_take_snap`): the reference taken first, then the copy's
    /// block, then the reference dropped, as the kernel does. Returns the
    /// copy's block; the caller queues its contents.
    pub fn copy_superblock(&mut self, at: u64) -> Result<u64, PdError> {
        self.inc(at)?;
        let copy = self.alloc()?;
        self.dec(at)?;
        Ok(copy)
    }

    /// Block `b` was freed: forget its node.
    pub fn forget(&mut self, b: u64) {
        self.cache.remove(&b);
        self.shadows.remove(&b);
    }

    /// Write every node this transaction made, and the other blocks
    /// queued for the commit, all in flight at once (before the
    /// superblock, which is written after they all completed).
    pub fn write_shadows(&mut self) -> Result<(), PdError> {
        let mut blocks: Vec<u64> = self.shadows.iter().copied().collect();
        blocks.sort_unstable();
        let mut writes: Vec<(u64, Vec<u8>)> = blocks
            .into_iter()
            .filter_map(|b| self.cache.get(&b).map(|n| (b, n.encode(b))))
            .collect();
        writes.extend(self.raw_dirty.drain());
        self.bm.write_all(&mut writes)
    }

    /// The transaction is on disk (the caller commits any other space
    /// map it keeps, such as a data space map).
    pub fn committed(&mut self) {
        self.shadows.clear();
        self.meta.committed();
    }

    /// Forget everything not committed (the kernel's abort): the caller
    /// reloads the space maps from disk.
    pub fn drop_cache(&mut self) {
        self.rc_flushing = false;
        self.cache.clear();
        self.shadows.clear();
        self.raw_dirty.clear();
    }
}
