//! The `Device` trait: anything bios can be submitted to.
//!
//! Mirrors the kernel's `submit_bio` contract: submission never fails
//! synchronously; every bio handed to `submit` is completed exactly once,
//! possibly before `submit` returns (a device completing inline, like
//! null_blk with `irqmode=0`), possibly later on another thread.

use crate::bio::Bio;
use crate::status::Status;
use std::sync::Arc;

/// What a device can do, as advertised to the layers and clients above
/// (NBD transmission flags are derived from this).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    /// Has a volatile cache: FLUSH does something.
    pub flush: bool,
    /// Honours FUA.
    pub fua: bool,
    /// Accepts `Op::Discard`.
    pub discard: bool,
    /// Discards are only acted on in whole units of this many bytes (the
    /// kernel's `discard_granularity`); 0 when the device states none,
    /// and a frontend then offers its physical block size.
    pub discard_granularity: u32,
    /// Accepts `Op::WriteZeroes`.
    pub write_zeroes: bool,
    /// Write-zeroes is cheap (no data written), so FAST_ZERO can succeed.
    pub fast_zero: bool,
    /// Refuses writes (they complete with `Status::Permission`).
    pub read_only: bool,
    /// A flush from any submitter covers writes completed for every
    /// submitter (true for devices with one shared state): NBD's
    /// CAN_MULTI_CONN is offered only then.
    pub flush_is_global: bool,
    /// The device can tell where it has holes (reads of zeroes that cost
    /// nothing): see [`Device::extents`].
    pub knows_holes: bool,
}

impl Default for Features {
    fn default() -> Self {
        Features {
            flush: true,
            fua: true,
            discard: false,
            discard_granularity: 0,
            write_zeroes: false,
            fast_zero: false,
            read_only: false,
            flush_is_global: true,
            knows_holes: false,
        }
    }
}

impl Features {
    /// The features a stack of devices offers: what every member offers.
    pub fn intersect(self, o: Features) -> Features {
        Features {
            flush: self.flush || o.flush,
            fua: self.fua && o.fua,
            discard: self.discard && o.discard,
            // The coarsest member decides what a discard can free.
            discard_granularity: self.discard_granularity.max(o.discard_granularity),
            write_zeroes: self.write_zeroes && o.write_zeroes,
            fast_zero: self.fast_zero && o.fast_zero,
            read_only: self.read_only || o.read_only,
            flush_is_global: self.flush_is_global && o.flush_is_global,
            knows_holes: self.knows_holes && o.knows_holes,
        }
    }
}

/// The blk-mq tag set a device's requests land in (kernel `struct
/// blk_mq_tag_set`'s `nr_hw_queues` and `queue_depth`): how many hardware
/// queues take ordinary (unpolled) bios and how many requests each holds
/// at once. A frontend that is itself a blk-mq driver (ublk) takes its
/// queues and depth from it, so the kernel never queues more on one of
/// its queues than one of ours can take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueShape {
    /// Hardware queues (kernel `nr_hw_queues`).
    pub hw_queues: u32,
    /// Tags per hardware queue (a shared tag set's fair share of it).
    pub depth: u32,
}

impl QueueShape {
    /// The wider of two shapes, member by member: a stack is as parallel
    /// as the most parallel device below it (dm-table.c's limits are the
    /// members' combined the same way, one field at a time).
    pub fn widest(a: Option<QueueShape>, b: Option<QueueShape>) -> Option<QueueShape> {
        match (a, b) {
            (Some(a), Some(b)) => Some(QueueShape {
                hw_queues: a.hw_queues.max(b.hw_queues),
                depth: a.depth.max(b.depth),
            }),
            (a, None) => a,
            (None, b) => b,
        }
    }
}

/// A run of bytes that is either data or a hole (reads as zeroes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Byte offset where the run starts.
    pub offset: u64,
    /// Length of the run in bytes.
    pub len: u64,
    /// Whether the run is a hole (reads as zeroes) rather than data.
    pub hole: bool,
}

/// A block device: bios go in, each comes back completed exactly once
/// (kernel `struct block_device` with `submit_bio`; see the module
/// documentation for the contract). Leaf drivers, mapped devices and the
/// frontends' clients all meet at this trait.
pub trait Device: Send + Sync {
    /// Hand a bio to the device. It will be completed exactly once.
    fn submit(&self, bio: Bio);

    /// Hand several bios to the device at once (the kernel's plugging:
    /// `blk_start_plug` .. `blk_finish_plug`, then `queue_rqs`). Every bio
    /// in `bios` is taken, in order, and completed exactly once, as if each
    /// had been passed to [`Device::submit`]; completions may run before
    /// this returns. `bios` is left empty with its capacity, so a caller
    /// that keeps the vector allocates nothing per batch. Devices override
    /// this to pay their per-submission costs (table loads, tag
    /// allocation, counters) once per batch.
    fn submit_batch(&self, bios: &mut Vec<Bio>) {
        for bio in bios.drain(..) {
            self.submit(bio);
        }
    }

    /// Size in bytes.
    fn size(&self) -> u64;

    /// The smallest unit a request may address, in bytes (kernel
    /// `logical_block_size`); offsets and lengths must be multiples of it.
    fn logical_block_size(&self) -> u32 {
        512
    }

    /// The unit the device writes atomically and efficiently (kernel
    /// `physical_block_size`); at least the logical block size, and a page
    /// unless the device says otherwise.
    fn physical_block_size(&self) -> u32 {
        self.logical_block_size().max(4096)
    }

    /// Largest single request the device accepts, in bytes: 64 MiB, as
    /// nbdkit's and nbd-server's limit, so a stack re-exported over NBD
    /// takes what those servers take.
    fn max_io_bytes(&self) -> u64 {
        64 << 20
    }

    /// What the device can do (flush, FUA, discard, ...), which the layers
    /// above and the NBD handshake advertise.
    fn features(&self) -> Features {
        Features::default()
    }

    /// The tag set below this device, if it has one (a leaf driver's
    /// engine queue, or the widest of those under a stack); `None` for a
    /// device that queues nothing (`zero`, `error`).
    fn queue_shape(&self) -> Option<QueueShape> {
        None
    }

    /// Whether this device may leave a [`crate::BioFlags::POLLED`] bio's
    /// completion to [`Device::poll`] (kernel: `QUEUE_FLAG_POLL` /
    /// `BLK_FEAT_POLL`). A submitter that sets the flag on a device that
    /// says no still gets an ordinary completion.
    fn polls(&self) -> bool {
        false
    }

    /// Complete, on the calling thread, the polled bios this device holds
    /// that are ready (kernel `bio_poll` / `->iopoll`). Returns how many it
    /// completed (or sent on). Cheap when nothing is ready: pollers call it
    /// in a loop.
    fn poll(&self) -> usize {
        0
    }

    /// Whether [`Device::poll_wait`] sleeps in the device's own wait (a
    /// socket read) until a polled bio completes. A submitter at low depth
    /// then reaps its own completions without a spin and without a wake
    /// from another thread (as a libnbd program reads its replies on the
    /// thread that sent the requests). Such devices take the `POLLED` bios
    /// of a submitter that does not spin; the others leave it to their
    /// completion threads.
    fn poll_sleeps(&self) -> bool {
        false
    }

    /// [`Device::poll`] that, when nothing is ready, sleeps in the device
    /// until it completes at least one polled bio, or until `ready()` says
    /// the caller already has what it waits for (another poller may have
    /// reaped it). Returns how many it completed; 0 when no polled bio is
    /// in flight or the device cannot read now (a lost connection), after
    /// which the caller waits for an ordinary completion, with a bound.
    fn poll_wait(&self, _ready: &dyn Fn() -> bool) -> usize {
        self.poll()
    }

    /// Data/hole map of `offset..offset+len`, if the device knows one
    /// (`features().knows_holes`). `None` means "all data, as far as I know".
    fn extents(&self, _offset: u64, _len: u64) -> Option<Vec<Extent>> {
        None
    }

    /// Let the caller reap this device's completions on its own thread
    /// (see [`Reaper`]), if the device has a completion queue a thread
    /// can wait on; `None` (the default) when completions only come from
    /// the device's own threads or inline.
    fn reaper(&self) -> Option<Box<dyn Reaper>> {
        None
    }
}

/// A claim on a device's completions by a submitter with an event loop
/// of its own (a vhost-user queue's thread): it waits for [`Reaper::fd`]
/// to poll readable beside its other descriptors and then calls
/// [`Reaper::reap`], so a request is submitted and completed on one
/// thread, without a wake of the device's completion thread. This is
/// qemu's block/io_uring.c, which hands its ring's descriptor to the
/// AioContext that submits. While a claim lives, the device's own
/// completion thread stands aside and reaps only as a backstop, what a
/// claimant has left waiting a while (a busy or stalled claimant never
/// holds completions back without bound); dropping the claim gives the
/// completions back to that thread at once. Several claims may live at
/// once: any claimant's `reap` completes every bio that is ready,
/// whoever submitted it.
pub trait Reaper: Send + Sync {
    /// A descriptor that polls readable (level-triggered) while
    /// completions wait to be reaped.
    fn fd(&self) -> std::os::fd::RawFd;

    /// Complete, on the calling thread, every completion ready now; how
    /// many bios it completed or continued. Never blocks for I/O.
    fn reap(&self) -> usize;
}

/// A shared handle to a device: how tables, stacks and frontends hold
/// the devices below them.
pub type DeviceRef = Arc<dyn Device>;

/// Common admission check for a bio against a device's geometry: the range
/// must lie inside the device and be aligned to its logical block size; data
/// ops must carry a buffer of exactly `len` bytes. Devices call this first
/// and complete with the returned status on failure.
pub fn check_bio(dev: &dyn Device, bio: &Bio) -> Result<(), Status> {
    check_bio_geometry(dev.size(), dev.logical_block_size(), bio)
}

/// [`check_bio`] against a size and logical block size the caller already
/// has (a mapped device checks against the table it is about to map with).
pub fn check_bio_geometry(size: u64, logical_block_size: u32, bio: &Bio) -> Result<(), Status> {
    let lbs = logical_block_size as u64;
    if bio.op == crate::Op::Flush {
        return Ok(());
    }
    let end = bio.offset.checked_add(bio.len).ok_or(Status::Invalid)?;
    if end > size {
        return Err(Status::Invalid);
    }
    if !bio.offset.is_multiple_of(lbs) || !bio.len.is_multiple_of(lbs) {
        return Err(Status::Invalid);
    }
    if bio.op.has_data() && bio.buf.len() as u64 != bio.len {
        return Err(Status::Invalid);
    }
    Ok(())
}
