//! A pool's mode and features (dm-thin.c's `enum pool_mode` and
//! `struct pool_features`): what the pool lets through, and what its
//! table's feature words asked for. Kept apart from the running pool
//! (`pool.rs`), which re-exports them.

/// `enum pool_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Normal operation: bios are mapped and blocks provisioned (`PM_WRITE`).
    Write,
    /// No free data block: bios needing one are queued until the data
    /// device grows or the no-space timeout fails them
    /// (`PM_OUT_OF_DATA_SPACE`).
    OutOfDataSpace,
    /// No metadata space beyond the reserve: nothing new is provisioned
    /// until the metadata device grows (kernel PM_OUT_OF_METADATA_SPACE).
    OutOfMetadataSpace,
    /// Metadata may not change: mapped reads and writes still go through,
    /// anything needing a new mapping fails (`PM_READ_ONLY`).
    ReadOnly,
    /// Every bio fails: the metadata could not be read or committed
    /// (`PM_FAIL`).
    Fail,
}

impl Mode {
    /// Modes in which nothing may change the metadata.
    pub fn is_read_only(self) -> bool {
        matches!(self, Mode::OutOfMetadataSpace | Mode::ReadOnly | Mode::Fail)
    }
}

/// `struct pool_features`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolFeatures {
    /// Zero a newly provisioned block before a partial write (off with
    /// the `skip_block_zeroing` table feature).
    pub zero_new_blocks: bool,
    /// Discards are handled (off with `ignore_discard`).
    pub discard_enabled: bool,
    /// Discards freeing whole data blocks are passed down to the data
    /// device (off with `no_discard_passdown`).
    pub discard_passdown: bool,
    /// The pool was asked to be read-only (`read_only` feature).
    pub read_only: bool,
    /// Fail bios at once when out of data space instead of queueing them
    /// (`error_if_no_space`).
    pub error_if_no_space: bool,
}

impl Default for PoolFeatures {
    fn default() -> Self {
        PoolFeatures {
            zero_new_blocks: true,
            discard_enabled: true,
            discard_passdown: true,
            read_only: false,
            error_if_no_space: false,
        }
    }
}
