//! Persistent data (kernel `drivers/md/persistent-data/`, and
//! thin-provisioning-tools' `src/pdata/`): the copy-on-write machinery
//! dm-thin's metadata is built from, and dm-cache's and dm-era's after
//! it. 4 KiB checksummed blocks on a metadata device
//! (`block_manager.rs`, `checksum.rs`); btree nodes (`node.rs`) and the
//! btrees over them (`btree.rs`, `btree_split.rs` for the room an insert makes in a
//! full node, and `btree_remove.rs` for removal in place), generic over what their values are
//! (`value_type.rs`, the kernel's `dm_btree_value_type`); the
//! transaction manager that shadows every committed block before a
//! change (`tm.rs`); and the space maps that count references to
//! metadata and data blocks (`space_map.rs` in memory, `bitmap.rs` their
//! on-disk bitmaps and index entries, `sm_disk.rs` and `sm_metadata.rs`
//! how each kind is read back and committed);
//! and arrays of packed values under a btree (`array.rs`, the kernel's
//! `dm-array.c`) with bitsets on them (`bitset.rs`, `dm-bitset.c`).
//!
//! Layering: this module knows nothing of any target. A target's
//! metadata (its superblock, its value types, the order of its commit)
//! is built on it -- thin's in `targets/thin/metadata/` -- and imports
//! point only that way: nothing here may use `crate::targets` or
//! `crate::target`. The block manager takes a bare `DeviceRef`.
//!
//! A target's metadata starts from [`format`] (a fresh device: the
//! metadata space map bootstrapped around the superblock at block 0) or
//! [`open`] (the space map root its superblock holds), changes blocks
//! through the [`tm::Tm`] it gets, and makes each transaction durable
//! with [`commit`] (space map, new blocks, flush, superblock with FUA).
//! Blocks are handed out in the kernel's order (`space_map.rs`), so the
//! same steps use the same blocks as the kernel.
//!
//! Hand-written: no crate reads or writes these formats (the Rust
//! thin-provisioning-tools are a program, not a library with a stable
//! API). `thin_check` and the kernel are their judges.

pub mod array;
pub mod bitmap;
pub mod bitset;
pub mod block_manager;
pub mod btree;
pub mod btree_remove;
mod btree_split;
pub mod checksum;
pub mod node;
pub mod sm_disk;
pub mod sm_metadata;
pub mod space_map;
pub mod tm;
pub mod value_type;

#[cfg(test)]
mod array_tests;
#[cfg(test)]
mod btree_remove_tests;
#[cfg(test)]
mod order_tests;
#[cfg(test)]
mod tests;

use blkstack_core::{DeviceRef, Status};
use tm::Tm;

/// Why a persistent-data operation failed.
#[derive(Debug, thiserror::Error)]
pub enum PdError {
    /// Reading, writing or flushing the metadata device failed.
    #[error("metadata {what} of block {block} failed: {status:?}")]
    Io {
        /// The operation (`read`, `write`, `flush`).
        what: &'static str,
        /// The metadata block it was for.
        block: u64,
        /// How the device completed it.
        status: Status,
    },
    /// A block read does not decode as the structure expected.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// A block decodes but its contents contradict the rest of the
    /// metadata (a tree's shape, a count).
    #[error("metadata block {block} is corrupt: {why}")]
    Corrupt {
        /// The metadata block.
        block: u64,
        /// What is wrong with it.
        why: String,
    },
    /// No free metadata block for the change (kernel `-ENOSPC` from the
    /// metadata space map).
    #[error("out of metadata space")]
    NoMetadataSpace,
    /// A reference count would go below zero: the metadata is corrupt.
    #[error(transparent)]
    RefCount(#[from] space_map::RefCountError),
}

impl PdError {
    /// [`PdError::Corrupt`] for `block`, saying `why`.
    pub fn corrupt(block: u64, why: &str) -> PdError {
        PdError::Corrupt {
            block,
            why: why.to_string(),
        }
    }
}

/// The metadata block size, in bytes (`THIN_METADATA_BLOCK_SIZE` is 8
/// sectors).
pub const BLOCK_SIZE: usize = 4096;

/// 512-byte sectors in a metadata block.
pub const BLOCK_SECTORS: u64 = (BLOCK_SIZE / 512) as u64;

/// Why a metadata block could not be read as the structure asked for.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    /// The block's crc32c does not match its contents (the kernel's
    /// validators: "checksum failed").
    #[error("{what} at block {block}: checksum {found:#x}, expected {want:#x}")]
    Checksum {
        /// The structure read (`superblock`, `btree node`, `bitmap`).
        what: &'static str,
        /// The metadata block it was read from.
        block: u64,
        /// The checksum stored in the block.
        found: u32,
        /// The checksum its contents have.
        want: u32,
    },
    /// The block's own location field names another block: a misdirected
    /// write or a stale copy (the validators' `blocknr` check).
    #[error("{what} at block {block} says it is block {says}")]
    Location {
        /// The structure read.
        what: &'static str,
        /// The metadata block it was read from.
        block: u64,
        /// The block it says it is.
        says: u64,
    },
    /// Anything else the structure's checks refuse (magic, version, entry
    /// counts, key order).
    #[error("{what} at block {block}: {why}")]
    Invalid {
        /// The structure read.
        what: &'static str,
        /// The metadata block it was read from.
        block: u64,
        /// Which check failed.
        why: String,
    },
}

/// The metadata blocks a device of `bytes` holds, capped at what the
/// metadata space map's one index block counts
/// (`DM_SM_METADATA_MAX_BLOCKS`).
pub fn metadata_blocks_of(bytes: u64) -> u64 {
    (bytes / BLOCK_SIZE as u64)
        .min(bitmap::MAX_METADATA_BITMAPS as u64 * bitmap::ENTRIES_PER_BITMAP)
}

/// Start metadata on a fresh device of `nr_blocks` blocks
/// (`dm_tm_create_with_sm` + `dm_sm_metadata_create`): block 0 is the
/// superblock, blocks 1 and 2 the metadata space map's index and
/// reference count tree, then its bitmaps, all counted once and made in
/// this transaction. The caller builds its structures through the
/// returned transaction manager and writes its superblock with
/// [`commit`].
pub fn format(dev: DeviceRef, nr_blocks: u64) -> Tm {
    let (meta, _, rc_root) = space_map::SpaceMap::bootstrap(nr_blocks, SUPERBLOCK);
    let mut tm = Tm::new(block_manager::BlockManager::new(dev), meta);
    // The reference count tree's root: an empty leaf (`dm_btree_empty`).
    tm.adopt_node(rc_root, node::Node::empty_leaf(4));
    tm
}

/// Open the metadata whose superblock holds the metadata space map root
/// `root` (`dm_tm_open_with_sm`).
pub fn open(dev: DeviceRef, root: bitmap::SmRoot) -> Result<Tm, PdError> {
    let mut tm = Tm::new(
        block_manager::BlockManager::new(dev),
        space_map::SpaceMap::new(root.nr_blocks),
    );
    tm.meta = sm_metadata::open(&mut tm, root)?;
    Ok(tm)
}

/// Make the transaction durable (`dm_tm_pre_commit` + `dm_tm_commit`):
/// commit the metadata space map (any other space map is committed by
/// the caller first), write every block made in the transaction, flush,
/// then write `superblock(the metadata space map's root)` at
/// [`SUPERBLOCK`] with FUA, and flush.
pub fn commit(
    tm: &mut Tm,
    superblock: impl FnOnce(bitmap::SmRoot) -> Vec<u8>,
) -> Result<(), PdError> {
    let root = sm_metadata::commit(tm)?;
    tm.write_shadows()?;
    tm.flush()?;
    tm.write_block(SUPERBLOCK, &mut superblock(root), true)?;
    tm.flush()?;
    tm.committed();
    Ok(())
}

/// Where every target's superblock is (`THIN_SUPERBLOCK_LOCATION`,
/// dm-era's and dm-cache's `SUPERBLOCK_LOCATION`).
pub const SUPERBLOCK: u64 = 0;

pub(crate) fn le32(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

pub(crate) fn le64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

pub(crate) fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
