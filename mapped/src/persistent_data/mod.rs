//! Persistent data (kernel `drivers/md/persistent-data/`): the
//! copy-on-write machinery dm-thin's metadata is built from, and dm-cache
//! and dm-era's after it: 4 KiB checksummed blocks on a metadata device
//! (`checksum.rs`), btree nodes (`node.rs`) and the btrees over them
//! (`btree.rs`), the transaction manager that shadows every committed
//! block before a change (`tm.rs`), and the space maps that count
//! references to metadata and data blocks (`space_map.rs`, on disk as
//! `bitmap.rs`).
//!
//! Layering: this module knows nothing of any target; targets build
//! their metadata (superblock, value types, trees of trees) on it, and
//! imports point only that way.

pub mod bitmap;
pub mod btree;
pub mod checksum;
pub mod node;
pub mod space_map;
pub mod tm;

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
