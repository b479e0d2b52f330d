//! Checking a completed read against the hash tree (kernel
//! dm-verity-target.c `verity_verify_io`, `verity_hash_for_block`,
//! `verity_verify_level`, `verity_recheck`), and the worker pool that does
//! it when hash blocks must be read first (the kernel's `kverityd`
//! workqueue).
//!
//! The check runs in two places. On the thread that completed the data
//! read it may not wait for I/O: a hash block not in the cache, or a
//! digest that fails (whose handling re-reads the block), hands the bio
//! to a worker with the index of the block to go on from, as 6.12's
//! bottom-half path returns -EAGAIN to its workqueue. The queue holds
//! only bios in flight, which the tag sets above bound.

use super::{BlockType, Verity};
use crate::targets::verity::tree::HashBlock;
use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Bio, Status};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::{Arc, Weak};

/// Where checking a bio got to.
pub(super) enum Outcome {
    /// Complete the bio with this status.
    Done(Status),
    /// Go on from this block index of the bio on a worker.
    Defer(u64),
}

/// Why a digest could not be found or checked.
enum Stop {
    /// A leg's read failed.
    Io(Status),
    /// A corrupt block the mode says fails the read.
    Corrupt,
    /// The caller may not block, and this needs to.
    WouldBlock,
}

/// Bios waiting for a worker.
pub(super) struct WorkQueue {
    state: Mutex<QueueState>,
    cv: Condvar,
}

struct QueueState {
    items: VecDeque<(Weak<Verity>, Bio, u64)>,
    stop: bool,
}

impl WorkQueue {
    pub(super) fn new() -> Arc<WorkQueue> {
        Arc::new(WorkQueue {
            state: Mutex::new(QueueState {
                items: VecDeque::new(),
                stop: false,
            }),
            cv: Condvar::new(),
        })
    }

    /// Queue `bio` for `v`, to be checked from block index `from`.
    pub(super) fn push_for(&self, v: Weak<Verity>, bio: Bio, from: u64) {
        let mut g = self.state.lock();
        if g.stop {
            // No worker is left to take it (the target is gone).
            drop(g);
            bio.complete(Status::IoError);
            return;
        }
        g.items.push_back((v, bio, from));
        drop(g);
        self.cv.notify_one();
    }

    /// Let the workers finish what is queued and exit.
    pub(super) fn shut_down(&self) {
        self.state.lock().stop = true;
        self.cv.notify_all();
    }

    /// A worker's loop.
    pub(super) fn run(&self) {
        loop {
            let item = {
                let mut g = self.state.lock();
                loop {
                    if let Some(it) = g.items.pop_front() {
                        break Some(it);
                    }
                    if g.stop {
                        break None;
                    }
                    self.cv.wait(&mut g);
                }
            };
            let Some((v, bio, from)) = item else { return };
            match v.upgrade() {
                Some(v) => match v.verify_bio(&bio, from, true) {
                    Outcome::Done(st) => bio.complete(st),
                    // A blocking check always finishes.
                    Outcome::Defer(_) => bio.complete(Status::IoError),
                },
                // The target is gone; its bios cannot be (they hold it).
                None => bio.complete(Status::IoError),
            }
        }
    }
}

impl Verity {
    /// Queue `bio` for a worker, from block index `from`.
    pub(super) fn defer(&self, bio: Bio, from: u64) {
        self.queue.push_for(self.me.clone(), bio, from);
    }

    /// Kernel `verity_verify_io` over the bio's blocks from index `from`.
    pub(super) fn verify_bio(&self, bio: &Bio, from: u64, may_block: bool) -> Outcome {
        let bs = self.block_bytes();
        let first = bio.offset / bs;
        let n = bio.len / bs;
        let ds = self.geo.digest_size;
        let mut want = [0u8; 64];
        let mut real = [0u8; 64];
        for i in from..n {
            let b = first + i;
            if self.is_validated(b) {
                continue;
            }
            let is_zero = match self.hash_for_block(b, &mut want[..ds], may_block) {
                Ok(z) => z,
                Err(Stop::WouldBlock) => return Outcome::Defer(i),
                Err(Stop::Io(st)) => return Outcome::Done(self.io_error(st)),
                Err(Stop::Corrupt) => return Outcome::Done(Status::IoError),
            };
            let lo = (i * bs) as usize;
            let data = &mut bio.data_mut()[lo..lo + bs as usize];
            if is_zero {
                data.fill(0);
                continue;
            }
            self.hasher.hash(data, &mut real[..ds]);
            if real[..ds] == want[..ds] {
                self.set_validated(b);
                continue;
            }
            if !may_block {
                return Outcome::Defer(i);
            }
            if self.recheck(b, data, &want[..ds]) {
                self.set_validated(b);
                continue;
            }
            if self.handle_err(BlockType::Data, b) {
                return Outcome::Done(Status::IoError);
            }
        }
        Outcome::Done(Status::Ok)
    }

    /// Kernel `verity_recheck`: read the block again from the data device
    /// (it may have changed while in flight); if that copy matches, it is
    /// the one returned.
    fn recheck(&self, b: u64, data: &mut [u8], want: &[u8]) -> bool {
        let mut buf = vec![0u8; data.len()];
        let st = submit_and_wait(
            &*self.data.dev,
            blkstack_core::Op::Read,
            b * self.block_bytes(),
            buf.len() as u64,
            &mut buf,
        );
        if !st.is_ok() {
            return false;
        }
        let mut real = [0u8; 64];
        let ds = want.len();
        self.hasher.hash(&buf, &mut real[..ds]);
        if real[..ds] == *want {
            data.copy_from_slice(&buf);
            true
        } else {
            false
        }
    }

    /// Kernel `verity_hash_for_block`: data block `b`'s digest into
    /// `want`, from a verified level-0 block if cached, else by walking
    /// from the root. Returns whether it is the zero block's digest.
    fn hash_for_block(&self, b: u64, want: &mut [u8], may_block: bool) -> Result<bool, Stop> {
        let mut done = false;
        if self.geo.levels > 0 {
            done = self.verify_level(b, 0, true, want, may_block)?;
        }
        if !done {
            want.copy_from_slice(&self.root);
            for level in (0..self.geo.levels).rev() {
                self.verify_level(b, level, false, want, may_block)?;
            }
        }
        Ok(self.zero_digest.as_deref().is_some_and(|z| z == want))
    }

    /// Kernel `verity_verify_level`: the hash block holding `b`'s digest
    /// at `level`, checked against `want` unless verified before; `want`
    /// becomes the digest it holds. With `skip_unverified`, an unverified
    /// block returns `Ok(false)` and changes nothing.
    fn verify_level(
        &self,
        b: u64,
        level: usize,
        skip_unverified: bool,
        want: &mut [u8],
        may_block: bool,
    ) -> Result<bool, Stop> {
        let (hb, off) = self.geo.hash_at_level(b, level);
        let blk = match self.cache.get(hb) {
            Some(blk) => blk,
            None if !may_block => return Err(Stop::WouldBlock),
            None => self.read_hash_block(hb)?,
        };
        if !blk.is_verified() {
            if skip_unverified {
                return Ok(false);
            }
            let mut real = [0u8; 64];
            let ds = want.len();
            self.hasher.hash(&blk.data, &mut real[..ds]);
            if real[..ds] == *want {
                blk.set_verified();
            } else if !may_block {
                return Err(Stop::WouldBlock);
            } else if self.handle_err(BlockType::Metadata, hb) {
                return Err(Stop::Corrupt);
            }
        }
        want.copy_from_slice(&blk.data[off..off + want.len()]);
        Ok(true)
    }

    /// Read hash block `hb` into the cache (dm-bufio's `dm_bufio_read`).
    fn read_hash_block(&self, hb: u64) -> Result<Arc<HashBlock>, Stop> {
        let bs = u64::from(self.geo.hash_block_size);
        let mut buf = vec![0u8; bs as usize];
        let st = submit_and_wait(
            &*self.hash.dev,
            blkstack_core::Op::Read,
            hb * bs,
            bs,
            &mut buf,
        );
        if !st.is_ok() {
            return Err(Stop::Io(st));
        }
        Ok(self
            .cache
            .insert(hb, Arc::new(HashBlock::new(buf.into_boxed_slice()))))
    }
}
