//! The emulated disk: null_blk's completion machinery, shared by `null`
//! and `memory` (Linux `drivers/block/null_blk/main.c`: `irqmode`,
//! `completion_nsec`, the hrtimer completion and `null_poll`).
//!
//! A driver that finishes its work inside `queue_rq` (null does nothing,
//! memory copies pages) runs under [`EmulatedDisk`], which completes its
//! requests the way the table's completion knobs say ([`completion`]):
//! at once, on a per-hardware-queue completion thread, or on that thread
//! after `completion_nsec` ([`timer`]), with timer-mode `POLLED` bios left
//! on a poll list for the submitter's own poll ([`poll`]). As in Linux,
//! where this lives with null_blk and blk-mq knows nothing of it, the
//! engine only sees a driver that ends its requests later.

pub mod completion;
pub mod disk;
pub mod poll;
pub mod timer;

pub use crate::error::EmulatedQueueError;
pub use completion::{CompletionArgs, CompletionMode, CompletionOptions};
pub use disk::{Emulated, EmulatedDisk};
pub use timer::TimerStats;
