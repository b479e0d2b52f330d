//! blk-mq engine: tag sets over scalable bitmap queues, hardware queues,
//! queue runs (inline or posted to a small "kblockd" worker pool), and the
//! driver trait leaf drivers implement (kernel `block/blk-mq*.c`,
//! `lib/sbitmap.c`).
//!
//! - [`sbitmap`]: the bitmap allocator and its wait queues, with both
//!   wakeup algorithms of seed 003 ([`WakeupAlgo`]).
//! - [`tags`]: tag sets, reserved tags, fair sharing between hardware queues.
//! - [`hwqueue`], [`runstate`], [`kblockd`]: dispatch lists, queue-run
//!   state (seed 001's queued bit, the restart handshake), the worker pool
//!   runs are posted to.
//! - [`queue`]: [`Queue`] over a [`Driver`], with null_blk's completion
//!   modes and the engine options ([`EngineOptions`]).
//!
//! Under `--cfg loom` only the sbitmap queue, the run state and their
//! primitives are built, for the model checks in `tests/loom_sbitmap.rs`
//! and `tests/loom_runstate.rs`.

pub mod runstate;
pub mod sbitmap;
mod sync;

#[cfg(not(loom))]
pub mod hwqueue;
#[cfg(not(loom))]
pub mod kblockd;
#[cfg(not(loom))]
pub mod queue;
#[cfg(not(loom))]
pub mod tags;

pub use sbitmap::{SbitmapQueue, SbqStats, SbqWait, WaitIndex, WakeupAlgo};

#[cfg(not(loom))]
pub use hwqueue::HctxStats;
#[cfg(not(loom))]
pub use kblockd::Kblockd;
#[cfg(not(loom))]
pub use queue::{
    CompletionMode, Driver, EngineOptions, Queue, QueueRq, QueueStats, RequestCompleter, Rq,
};
#[cfg(not(loom))]
pub use tags::{Tags, TagsConfig};
