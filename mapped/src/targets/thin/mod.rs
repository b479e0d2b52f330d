//! Thin provisioning and snapshots (kernel `drivers/md/dm-thin.c` and
//! `dm-thin-metadata.c`): the `thin-pool` target (`pool_target.rs`), the
//! `thin` target (`thin_target.rs`), the running pool they share
//! (`pool.rs`), and the kernel's on-disk metadata: thin's own records
//! (`format/`) and trees (`metadata/`), built on the copy-on-write
//! btrees, transaction manager and space maps of
//! [`crate::persistent_data`], thin's first user.
//!
//! The metadata format is hand-written because no crate implements it;
//! Debian's `thin_check`/`thin_dump` and the kernel's own dm-thin-pool
//! read what blkstack writes (mapped/tests/thin_tools.rs,
//! frontends/cli/tests/kernel_thin.rs).

mod batch;
mod deferred;
mod discard;
mod fill;
pub mod format;
pub mod metadata;
mod mode;
mod params;
pub mod pool;
mod pool_table;
pub(crate) mod pool_target;
pub(crate) mod thin_target;

pub use params::{no_space_timeout_secs, set_no_space_timeout_secs};
