//! blk-mq engine: tag sets over scalable bitmap queues, hardware queues,
//! queue runs (inline or posted to a small "kblockd" worker pool), and the
//! driver trait leaf drivers implement (kernel `block/blk-mq*.c`,
//! `lib/sbitmap.c`).
//!
//! - [`sbitmap`]: the bitmap allocator and its wait queues, with both
//!   wakeup algorithms of "sbitmap: Use single per-bitmap counting to wake
//!   up queued tags" and the per-waitqueue countdown before it
//!   ([`WakeupAlgo`]).
//! - [`tags`]: tag sets, reserved tags, fair sharing between hardware queues.
//! - [`hwqueue`], [`runstate`], [`kblockd`]: dispatch lists, queue-run
//!   state (the queued bit of "blk-mq: avoid repeatedly scheduling the
//!   same work to run hardware queue", the restart handshake), the worker
//!   pool runs are posted to.
//! - [`options`]: the engine's options ([`EngineOptions`]): tags, queues
//!   and runs.
//! - [`driver`]: what a leaf driver implements ([`Driver`]) and how it ends
//!   requests ([`RequestCompleter`], and [`CompleterRef`] from its poll).
//! - [`queue`]: [`Queue`] over a [`Driver`]. How a driver completes
//!   (null_blk's completion modes, timers, poll lists) is the driver's, in
//!   `blkstack-drivers`.
//! - [`disk`]: [`Disk`], the one leaf `Device` (a queue over a driver,
//!   with the geometry the driver gave it): drivers implement [`Driver`]
//!   only, as blk-mq drivers write only their `blk_mq_ops`.
//!
//! Under `--cfg loom` only the sbitmap queue, the run state and their
//! primitives are built, for the model checks in `tests/loom_sbitmap.rs`
//! and `tests/loom_runstate.rs`.

#![warn(missing_docs)]

pub mod runstate;
pub mod sbitmap;
mod sync;

#[cfg(not(loom))]
pub mod disk;
#[cfg(not(loom))]
pub mod driver;
#[cfg(not(loom))]
pub mod hwqueue;
#[cfg(not(loom))]
pub mod kblockd;
#[cfg(not(loom))]
pub mod options;
#[cfg(not(loom))]
pub mod queue;
#[cfg(not(loom))]
pub mod tags;

pub use sbitmap::{SbitmapQueue, SbqStats, SbqWait, WaitIndex, WakeupAlgo};

#[cfg(not(loom))]
pub use disk::{Disk, DiskLimits};
#[cfg(not(loom))]
pub use driver::{CompleterRef, Driver, HeldCompleter, QueueRq, RequestCompleter, Rq};
#[cfg(not(loom))]
pub use hwqueue::HctxStats;
#[cfg(not(loom))]
pub use kblockd::Kblockd;
#[cfg(not(loom))]
pub use options::{EngineOptions, EngineOptionsError, KblockdKind, MAX_HW_QUEUES};
#[cfg(not(loom))]
pub use queue::{Queue, QueueError, QueueStats};
#[cfg(not(loom))]
pub use tags::{Tags, TagsConfig, TagsError};
