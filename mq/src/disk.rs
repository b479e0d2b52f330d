//! The one leaf [`Device`]: a request queue over a driver, with the
//! geometry and features the driver gave it when it built it (kernel
//! `struct gendisk` with its `queue_limits`, and `blk_mq_submit_bio`).
//!
//! In Linux a blk-mq driver such as null_blk writes only its
//! `blk_mq_ops` and fills in a disk's capacity and limits; submission,
//! the admission checks and polling are blk-mq's, the same for every
//! driver. So here: a leaf driver implements [`Driver`] only and owns a
//! [`Disk`] over it, and every leaf device submits, checks and polls
//! through this one impl.

use crate::driver::Driver;
use crate::queue::{EngineOptions, Queue, QueueError};
use blkstack_core::device::{check_bio_geometry, Extent};
use blkstack_core::{Bio, Device, Features, QueueShape, Status};

/// What a driver tells its disk about itself when it builds it (kernel
/// `set_capacity` and `struct queue_limits`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskLimits {
    /// Size in bytes.
    pub size: u64,
    /// Smallest addressable unit in bytes (kernel `logical_block_size`).
    pub logical_block_size: u32,
    /// Unit the medium writes atomically, in bytes (kernel
    /// `physical_block_size`).
    pub physical_block_size: u32,
    /// What the disk offers to the layers above (flush, FUA, discard, ...).
    pub features: Features,
}

impl DiskLimits {
    /// A disk of `size` bytes in blocks of `logical_block_size`, with the
    /// default physical block size (the logical one, at least 4 KiB).
    pub fn new(size: u64, logical_block_size: u32, features: Features) -> DiskLimits {
        DiskLimits {
            size,
            logical_block_size,
            physical_block_size: logical_block_size.max(4096),
            features,
        }
    }
}

/// A leaf block device: driver `D` under a blk-mq [`Queue`].
pub struct Disk<D: Driver> {
    queue: Queue<D>,
    limits: DiskLimits,
}

impl<D: Driver> Disk<D> {
    /// A disk over `driver` with engine options `opts` (kernel
    /// `blk_mq_alloc_disk`).
    pub fn new(driver: D, opts: EngineOptions, limits: DiskLimits) -> Result<Disk<D>, QueueError> {
        Ok(Disk {
            queue: Queue::new(driver, opts)?,
            limits,
        })
    }

    /// The request queue (run/stop queues, counters).
    pub fn queue(&self) -> &Queue<D> {
        &self.queue
    }

    /// The driver under the queue.
    pub fn driver(&self) -> &D {
        self.queue.driver()
    }

    /// The geometry the driver gave the disk when it was built.
    pub fn limits(&self) -> &DiskLimits {
        &self.limits
    }
}

impl<D: Driver> Device for Disk<D> {
    #[inline]
    fn submit(&self, bio: Bio) {
        let l = &self.limits;
        if let Err(st) = check_bio_geometry(l.size, l.logical_block_size, &bio) {
            bio.complete(st);
            return;
        }
        self.queue.submit(bio);
    }

    /// Bios that fail the admission check are completed at once; the rest
    /// go to the engine as one batch.
    fn submit_batch(&self, bios: &mut Vec<Bio>) {
        let (size, lbs) = (self.limits.size, self.limits.logical_block_size);
        for bio in bios.extract_if(.., |b| check_bio_geometry(size, lbs, b).is_err()) {
            let st = check_bio_geometry(size, lbs, &bio)
                .err()
                .unwrap_or(Status::Invalid);
            bio.complete(st);
        }
        self.queue.submit_batch(bios);
    }

    fn size(&self) -> u64 {
        self.limits.size
    }

    fn logical_block_size(&self) -> u32 {
        self.limits.logical_block_size
    }

    fn physical_block_size(&self) -> u32 {
        self.limits.physical_block_size
    }

    fn features(&self) -> Features {
        self.limits.features
    }

    fn queue_shape(&self) -> Option<QueueShape> {
        Some(self.queue.options().queue_shape())
    }

    fn polls(&self) -> bool {
        self.queue.polls()
    }

    fn poll(&self) -> usize {
        self.queue.poll()
    }

    fn poll_sleeps(&self) -> bool {
        self.queue.poll_sleeps()
    }

    fn poll_wait(&self, ready: &dyn Fn() -> bool) -> usize {
        self.queue.poll_wait(ready)
    }

    fn extents(&self, offset: u64, len: u64) -> Option<Vec<Extent>> {
        let end = offset.saturating_add(len).min(self.limits.size);
        self.queue.driver().extents(offset, end)
    }
}
