//! dm-thin's on-disk metadata format, one file per structure: the
//! superblock (`dm-thin-metadata.c`), btree nodes
//! (`persistent-data/dm-btree-internal.h`), space map bitmaps and index
//! entries (`persistent-data/dm-space-map-common.h`), device details and
//! mapping values (`dm-thin-metadata.c`), and the checksums
//! (`dm_bm_checksum` with each structure's xor salt).
//!
//! Hand-written: no crate reads or writes this format (the Rust
//! thin-provisioning-tools are a program, not a library with a stable
//! API), and it is small and fixed. Every block is 4096 bytes, every
//! integer little-endian. `thin_check` and the kernel's dm-thin-pool are
//! its judges (mapped/tests/thin_tools.rs, frontends/cli/tests/kernel_thin.rs).

pub mod bitmap;
pub mod checksum;
pub mod details;
pub mod node;
pub mod superblock;

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
