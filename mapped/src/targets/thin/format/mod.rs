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
    #[error("{what} at block {block}: checksum {found:#x}, expected {want:#x}")]
    Checksum {
        what: &'static str,
        block: u64,
        found: u32,
        want: u32,
    },
    #[error("{what} at block {block} says it is block {says}")]
    Location {
        what: &'static str,
        block: u64,
        says: u64,
    },
    #[error("{what} at block {block}: {why}")]
    Invalid {
        what: &'static str,
        block: u64,
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
