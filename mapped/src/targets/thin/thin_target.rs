//! `thin <pool dev> <dev id> [<external origin>]`: a thinly provisioned
//! device (kernel `dm-thin.c` `thin_target`): reads of unmapped blocks
//! see zeroes (or the external origin), the first write to a block, or
//! the first after a snapshot of a block it shares, gets a new data block
//! from the pool. Status `<mapped sectors> <highest mapped sector|->`.

use super::batch::BlockGeometry;
use super::discard;
use super::fill::{self, Fills};
use super::metadata::read_dev_id;
use super::pool::{Mode, Pool, PoolShared, Prepared, ThinDev};
use super::pool_table;
use crate::error::TargetError;
use crate::target::{CtrContext, DevArg, Target, TargetRef, TargetType};
use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Bio, BioFlags, Features, Op, Status};
use std::sync::Arc;

pub const TYPE: TargetType = TargetType {
    name: "thin",
    version: [1, 23, 0],
    ctr,
};

/// What the pool's worker needs to map a thin device's bios again.
pub struct ThinCore {
    pub pool: Arc<PoolShared>,
    pub dev_id: u64,
    pub origin: Option<DevArg>,
    /// Blocks being made whole before a partial write.
    fills: Arc<Fills>,
    /// The pool took discards when this device was made (dm-thin's
    /// `thin_ctr` sets `discards_supported` from the pool's features).
    pub(super) discards: bool,
    /// I/O refused because its mapping points past the data device.
    past_end: std::sync::atomic::AtomicU64,
}

pub struct ThinTarget {
    core: Arc<ThinCore>,
    /// Keeps the pool's worker alive while this device lives.
    _pool: Arc<Pool>,
    pool_dev: DevArg,
}

fn invalid(s: &str) -> TargetError {
    TargetError::Invalid(s.to_string())
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    if args.len() != 2 && args.len() != 3 {
        return Err(invalid("Invalid argument count"));
    }
    let origin = match args.get(2) {
        Some(o) if *o == args[0] => return Err(invalid("Error setting origin device")),
        Some(o) => Some(
            ctx.get_device(o, 0, 0)
                .map_err(|_| invalid("Error opening origin device"))?,
        ),
        None => None,
    };
    let pool_dev = ctx
        .get_device(args[0], 0, 0)
        .map_err(|_| invalid("Error opening pool device"))?;
    let dev_id = read_dev_id(args[1]).ok_or_else(|| invalid("Invalid device id"))?;
    let target = ctx
        .live_target_of(args[0])
        .ok_or_else(|| invalid("Couldn't get pool mapped device"))?;
    let pool = pool_table::lookup(&target).ok_or_else(|| invalid("Couldn't find pool object"))?;
    let discards = {
        let mut st = pool.shared.state.lock();
        if st.mode == Mode::Fail {
            return Err(invalid("Couldn't open thin device, Pool is in fail mode"));
        }
        if !st.md.exists(dev_id) {
            return Err(invalid("Couldn't open thin internal device"));
        }
        *st.open_thins.entry(dev_id).or_insert(0) += 1;
        st.pf.discard_enabled
    };
    Ok(Arc::new(ThinTarget {
        core: Arc::new(ThinCore {
            pool: pool.shared.clone(),
            dev_id,
            fills: Fills::new(
                pool.shared.data_dev.clone(),
                origin.clone(),
                pool.shared.block_bytes(),
            ),
            origin,
            discards,
            past_end: Default::default(),
        }),
        _pool: pool,
        pool_dev,
    }))
}

impl ThinCore {
    /// Does data block `b` lie inside the data device? A mapping that
    /// points past it is corrupt metadata: its I/O fails with EIO, as the
    /// kernel's remapped bio does in `bio_check_eod` ("attempt to access
    /// beyond end of device"), logged the first time and then once in a
    /// thousand, as a rate limit would.
    fn data_block_in_device(&self, vblock: u64, b: u64) -> bool {
        let end = b
            .checked_add(1)
            .and_then(|n| n.checked_mul(self.pool.block_bytes()));
        if end.is_some_and(|end| end <= self.pool.data_dev.dev.size()) {
            return true;
        }
        let n = self
            .past_end
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n.is_multiple_of(1000) {
            tracing::error!(
                data_dev = %self.pool.data_dev,
                thin = self.dev_id,
                vblock,
                data_block = b,
                refused = n + 1,
                "thin: attempt to access beyond end of device: the mapping points past the data device ({} bytes); failing the I/O (EIO)",
                self.pool.data_dev.dev.size()
            );
        }
        false
    }

    /// A bio from the device above: flushes and PREFLUSH go through a
    /// commit first; a FUA write completes only after one.
    pub(super) fn map_bio(self: &Arc<Self>, mut bio: Bio) {
        match bio.op {
            Op::Flush => return self.pool.defer_flush(bio),
            Op::Read | Op::Write => {}
            Op::Discard if self.discards => return self.map_rw(bio),
            _ => return bio.complete(Status::NotSupported),
        }
        if bio.flags.contains(BioFlags::PREFLUSH) {
            return self.pool.defer_preflush(bio, self.clone());
        }
        if bio.op == Op::Write && bio.flags.contains(BioFlags::FUA) {
            bio.push_end(self.pool.clone(), 0);
        }
        self.map_rw(bio);
    }

    /// Map a read, write or discard (again, for one that waited).
    fn map_rw(self: &Arc<Self>, bio: Bio) {
        if bio.len == 0 {
            return bio.complete(Status::Ok);
        }
        if bio.op == Op::Discard {
            return discard::map(&self.pool, self.clone(), self.dev_id, bio);
        }
        let bs = self.pool.block_bytes();
        let (vblock, off) = BlockGeometry::new(bs).split(bio.offset);
        let write = bio.op == Op::Write;
        let me = || self.clone() as Arc<dyn ThinDev>;
        // Counted before the lookup, so a discard that unmaps the block
        // after it waits for this I/O (see deferred.rs); a pool that
        // ignores discards never waits, and counts nothing.
        let epoch = self.discards.then(|| self.pool.all_io.enter());
        let (prepared, bio_back) = self.pool.prepare(&me, self.dev_id, vblock, bio, write);
        if let Some(e) = epoch.filter(|_| !matches!(prepared, Prepared::Mapped(_))) {
            self.pool.all_io.exit(e);
        }
        let Some(mut bio) = bio_back else {
            return;
        };
        match prepared {
            Prepared::Queued => debug_assert!(false, "a queued bio came back"),
            Prepared::Fail(st) => bio.complete(st),
            Prepared::Mapped(b) if !self.data_block_in_device(vblock, b) => {
                if let Some(e) = epoch {
                    self.pool.all_io.exit(e);
                }
                bio.complete(Status::IoError)
            }
            Prepared::Mapped(b) => {
                if let Some(e) = epoch {
                    self.pool.all_io.track(&mut bio, e);
                }
                bio.offset = b * bs + off;
                self.pool.data_dev.dev.submit(bio);
            }
            Prepared::Unmapped => self.read_unmapped(bio),
            Prepared::Provision {
                block,
                id,
                copy_from,
                zero,
            } => {
                bio.push_end(self.pool.clone(), id);
                if !(off == 0 && bio.len == bs) {
                    let origin = self.origin.as_ref();
                    if let Some(src) = fill::source(bs, origin, vblock, copy_from, zero) {
                        return self.fills.start(bio, block, off, src);
                    }
                }
                bio.offset = block * bs + off;
                self.pool.data_dev.dev.submit(bio);
            }
        }
    }

    /// An unmapped read: the external origin's data where it has some,
    /// zeroes elsewhere.
    fn read_unmapped(&self, bio: Bio) {
        let Some(origin) = &self.origin else {
            bio.data_mut().fill(0);
            return bio.complete(Status::Ok);
        };
        let size = origin.dev.size();
        if bio.end() <= size {
            return origin.dev.submit(bio);
        }
        let buf = bio.data_mut();
        buf.fill(0);
        let mut st = Status::Ok;
        if bio.offset < size {
            let n = (size - bio.offset) as usize;
            st = submit_and_wait(&*origin.dev, Op::Read, bio.offset, n as u64, &mut buf[..n]);
        }
        bio.complete(st);
    }
}

impl ThinDev for ThinCore {
    fn dev_id(&self) -> u64 {
        self.dev_id
    }

    fn map(self: Arc<Self>, bio: Bio) {
        self.map_bio(bio);
    }

    fn map_io(self: Arc<Self>, bio: Bio) {
        self.map_rw(bio);
    }
}

impl Target for ThinTarget {
    fn map(&self, bio: Bio) {
        self.core.map_bio(bio);
    }

    /// A plugged batch: see `batch.rs`.
    fn map_batch(&self, bios: &mut Vec<Bio>) {
        self.core.map_batch(bios);
    }

    fn max_io_len(&self, offset: u64) -> u64 {
        let bs = self.core.pool.block_bytes();
        bs - BlockGeometry::new(bs).split(offset).1
    }

    fn max_discard_len(&self, offset: u64) -> u64 {
        discard::max_discard_len(self.core.pool.block_bytes(), offset)
    }

    fn status(&self) -> String {
        let mut st = self.core.pool.state.lock();
        if st.mode == Mode::Fail {
            return "Fail".into();
        }
        let spb = self.core.pool.block_sectors;
        let dev = self.core.dev_id;
        let Some(mapped) = st.md.mapped_blocks(dev) else {
            return "-".into();
        };
        match st.md.highest_mapped(dev) {
            Ok(Some(h)) => format!("{} {}", mapped * spb, (h + 1) * spb - 1),
            Ok(None) => format!("{} -", mapped * spb),
            Err(_) => "Error".into(),
        }
    }

    fn table(&self) -> String {
        let mut s = format!("{} {}", self.pool_dev, self.core.dev_id);
        if let Some(o) = &self.core.origin {
            s.push_str(&format!(" {o}"));
        }
        s
    }

    /// A suspended thin device's writes are committed (dm suspends with
    /// a flush unless told not to).
    fn postsuspend(&self) {
        let pool = &self.core.pool;
        let mut st = pool.state.lock();
        if st.md.is_dirty() {
            let _ = pool.commit(&mut st);
        }
    }

    fn features(&self) -> Features {
        Features {
            discard: self.core.discards,
            // `thin_io_hints`: a discard frees whole pool blocks.
            discard_granularity: self.core.pool.block_bytes() as u32,
            write_zeroes: false,
            fast_zero: false,
            knows_holes: false,
            ..Features::default()
        }
    }
}

impl Drop for ThinTarget {
    fn drop(&mut self) {
        let mut st = self.core.pool.state.lock();
        if let Some(n) = st.open_thins.get_mut(&self.core.dev_id) {
            *n -= 1;
            if *n == 0 {
                st.open_thins.remove(&self.core.dev_id);
            }
        }
    }
}
