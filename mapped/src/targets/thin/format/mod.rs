//! dm-thin's own on-disk records, one file per structure: the superblock
//! and the device details and mapping values (`dm-thin-metadata.c`).
//! The blocks, btree nodes, space map bitmaps and checksums they sit in
//! are persistent-data's (`crate::persistent_data`).
//!
//! Hand-written: no crate reads or writes this format (the Rust
//! thin-provisioning-tools are a program, not a library with a stable
//! API), and it is small and fixed. Every block is 4096 bytes, every
//! integer little-endian. `thin_check` and the kernel's dm-thin-pool are
//! its judges (mapped/tests/thin_tools.rs, frontends/cli/tests/kernel_thin.rs).

pub mod details;
pub mod superblock;

pub(crate) use crate::persistent_data::{le32, le64, put32, put64};
pub use crate::persistent_data::{FormatError, BLOCK_SIZE};
