//! Discards to a thin device (dm-thin.c `process_discard_bio`,
//! `break_up_discard_bio`, `process_prepared_discard_passdown_pt1/pt2`
//! and `process_prepared_discard_no_passdown`, as of Linux 6.12).
//!
//! Only whole pool blocks are unmapped: the range is rounded inwards
//! (`get_bio_block_range`), and a discard inside one block completes
//! with nothing done. The unmapping drops one reference to each data
//! block; a block a snapshot still maps keeps its data. Every block
//! unmapped is held (counted once more, as the kernel's
//! `dm_pool_inc_data_range`) until every read and write that looked
//! them up before the discard is done (the pool's `all_io` set), then,
//! unless `no_discard_passdown`, the ones nothing else maps (looked up
//! through the data space map's index entry cache, as
//! `dm_pool_block_is_shared`) are discarded on the data device, and
//! only then all let go, so no block is handed out again while old I/O
//! or the passdown may still reach it. A commit meanwhile writes them as free:
//! a crash finds them unmapped and free, as after the kernel's pt2.
//!
//! A discard that meets a block being provisioned in its range waits for
//! it (the kernel's virtual cell); in a read-only pool discards succeed
//! and change nothing (`process_bio_success`), in a failed one they fail.

use super::pool::{Mode, PoolShared, ThinDev};
use blkstack_core::{Bio, EndIo, IoBuf, Op, Status};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// `BIO_PRISON_MAX_RANGE`: the most pool blocks one discard unmaps (a
/// thin device's `max_discard_sectors` is this many blocks).
pub const MAX_RANGE_BLOCKS: u64 = 1024;

/// The longest discard a thin device takes at `offset` (bytes), kept
/// inside one aligned run of [`MAX_RANGE_BLOCKS`].
pub fn max_discard_len(block_bytes: u64, offset: u64) -> u64 {
    let run = block_bytes * MAX_RANGE_BLOCKS;
    run - offset % run
}

/// Handle a discard to thin device `dev` (offset relative to it).
pub fn map(pool: &Arc<PoolShared>, thin: Arc<dyn ThinDev>, dev: u64, bio: Bio) {
    let bs = pool.block_bytes();
    let (begin, end) = (bio.offset.div_ceil(bs), bio.end() / bs);
    if begin >= end {
        return bio.complete(Status::Ok);
    }
    let mut st = pool.state.lock();
    match st.mode {
        Mode::Fail => return bio.complete(Status::IoError),
        Mode::ReadOnly | Mode::OutOfMetadataSpace => return bio.complete(Status::Ok),
        Mode::Write | Mode::OutOfDataSpace => {}
    }
    let Some(bio) = st.wait_behind_provisioning(dev, begin, end, bio, &thin) else {
        return;
    };
    let removed = match st.md.remove_range(dev, begin, end) {
        Ok(r) => r,
        Err(e) => {
            pool.metadata_failed(&mut st, "dm_thin_remove_range", &e);
            drop(st);
            return bio.complete(Status::IoError);
        }
    };
    let mut held = removed;
    held.sort_unstable();
    held.dedup();
    let passdown = st.pf.discard_passdown;
    let unshared = match hold_and_check(&mut st.md, &held, passdown) {
        Ok(u) => u,
        Err(e) => {
            pool.metadata_failed(&mut st, "dm_pool_inc_data_range", &e);
            drop(st);
            return bio.complete(Status::IoError);
        }
    };
    let id = st.next_id();
    let generation = st.generation();
    st.discard_holds.insert(id, (held, generation));
    drop(st);
    let p = pool.clone();
    pool.all_io.add_work(Box::new(move || {
        let q = p.clone();
        p.defer_work(Box::new(move || quiesced(&q, id, bio, unshared)));
    }));
}

/// `dm_pool_inc_data_range` of every block unmapped, then, when passing
/// down, `passdown_double_checking_shared_status`: the blocks counted
/// once (nothing but the hold refers to them), each looked up through
/// the data space map's index entry cache as the kernel's
/// `dm_pool_block_is_shared` does.
fn hold_and_check(
    md: &mut super::metadata::PoolMetadata,
    held: &[u64],
    passdown: bool,
) -> Result<Vec<u64>, super::metadata::MetadataError> {
    for &b in held {
        md.hold_data_block(b)?;
    }
    let mut unshared = Vec::new();
    if passdown {
        for &b in held {
            if !md.data_block_is_shared(b)? {
                unshared.push(b);
            }
        }
    }
    Ok(unshared)
}

/// The I/O from before the discard is done: pass the unshared blocks
/// down (pt1), or let the blocks go at once.
fn quiesced(pool: &Arc<PoolShared>, id: u64, bio: Bio, unshared: Vec<u64>) {
    let blocks = match pool.state.lock().discard_holds.get(&id) {
        Some(_) => unshared,
        None => Vec::new(),
    };
    if blocks.is_empty() {
        return release(pool, id, bio);
    }
    let bs = pool.block_bytes();
    let max = pool.data_dev.dev.max_io_bytes().max(bs) / bs * bs;
    let mut pieces = Vec::new();
    for (b, n) in runs(&blocks) {
        let (mut at, end) = (b * bs, (b + n) * bs);
        while at < end {
            let len = (end - at).min(max);
            pieces.push((at, len));
            at += len;
        }
    }
    let pd = Arc::new(Passdown {
        pool: pool.clone(),
        id,
        bio: Mutex::new(Some(bio)),
        left: AtomicUsize::new(pieces.len()),
    });
    for (at, len) in pieces {
        let d = Bio::new(Op::Discard, at, len, IoBuf::empty(), pd.clone(), 0);
        pool.data_dev.dev.submit(d);
    }
}

/// (first block, count) of each run of consecutive blocks in `sorted`.
fn runs(sorted: &[u64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &b in sorted {
        match out.last_mut() {
            Some((s, n)) if *s + *n == b => *n += 1,
            _ => out.push((b, 1)),
        }
    }
    out
}

/// Let the held blocks go (pt2) and complete the discard.
fn release(pool: &PoolShared, id: u64, bio: Bio) {
    let mut st = pool.state.lock();
    let status = match st.discard_holds.remove(&id) {
        Some((blocks, generation)) if generation == st.generation() => {
            for b in blocks {
                if let Err(e) = st.md.free_data_block(b) {
                    pool.metadata_failed(&mut st, "dm_pool_free_data_block", &e);
                    break;
                }
            }
            if st.mode == Mode::Fail {
                Status::IoError
            } else {
                Status::Ok
            }
        }
        // The transaction was aborted: the unmapping is gone with it.
        _ => Status::IoError,
    };
    drop(st);
    bio.complete(status);
}

/// The data device's discards of one thin discard in flight.
struct Passdown {
    pool: Arc<PoolShared>,
    id: u64,
    bio: Mutex<Option<Bio>>,
    left: AtomicUsize,
}

impl EndIo for Passdown {
    /// `passdown_endio`: whether the data device discarded or not, the
    /// blocks are unmapped; they go once every piece is back.
    fn end_io(&self, _bio: Bio, status: Status, _private: u64) {
        if !status.is_ok() {
            tracing::debug!(pool = %self.pool.data_dev.name, ?status, "thin-pool: discard passdown failed");
        }
        if self.left.fetch_sub(1, Ordering::SeqCst) != 1 {
            return;
        }
        let Some(bio) = self.bio.lock().take() else {
            return;
        };
        let (pool, id) = (self.pool.clone(), self.id);
        self.pool
            .defer_work(Box::new(move || release(&pool, id, bio)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_consecutive_blocks() {
        assert_eq!(runs(&[]), vec![]);
        assert_eq!(runs(&[3, 4, 5, 9, 11, 12]), vec![(3, 3), (9, 1), (11, 2)]);
    }

    #[test]
    fn discards_stop_at_aligned_runs_of_1024_blocks() {
        let bs = 65536;
        assert_eq!(max_discard_len(bs, 0), 1024 * bs);
        assert_eq!(max_discard_len(bs, 1024 * bs - 512), 512);
        assert_eq!(max_discard_len(bs, 1500 * bs), 548 * bs);
    }
}
