//! Settings every pool of the process shares, as dm-thin's module
//! parameters are shared by every pool of a kernel: `no_space_timeout`
//! (`dm_thin_pool.no_space_timeout`, seconds a pool out of data space
//! queues I/O before it fails it; 0 queues for ever). `blkstack serve
//! --thin-no-space-timeout SECS` sets it for the process. As the
//! kernel reads its parameter when a pool runs out of space, a pool reads
//! this when it checks its queue, so a change reaches running pools.

use std::sync::atomic::{AtomicU64, Ordering};

/// `NO_SPACE_TIMEOUT_SECS`.
const DEFAULT_NO_SPACE_TIMEOUT_SECS: u64 = 60;

static NO_SPACE_TIMEOUT_SECS: AtomicU64 = AtomicU64::new(DEFAULT_NO_SPACE_TIMEOUT_SECS);

/// Seconds a pool out of data space queues I/O (0: for ever).
pub fn no_space_timeout_secs() -> u64 {
    NO_SPACE_TIMEOUT_SECS.load(Ordering::Relaxed)
}

/// Set [`no_space_timeout_secs`] for every pool in the process
/// (dm-thin's `no_space_timeout` module parameter).
pub fn set_no_space_timeout_secs(secs: u64) {
    NO_SPACE_TIMEOUT_SECS.store(secs, Ordering::Relaxed);
}
