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

pub mod details;
pub mod superblock;

pub(crate) use crate::persistent_data::{le32, le64, put32, put64};
pub use crate::persistent_data::{FormatError, BLOCK_SECTORS, BLOCK_SIZE};
