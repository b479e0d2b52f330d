//! The bottom layer of blkstack: what every other layer speaks.
//!
//! A [`Bio`] is one block I/O request (kernel `struct bio`), a [`Device`] is
//! anything that accepts bios and completes each exactly once (kernel
//! `struct block_device` + `submit_bio`), [`Status`] is `blk_status_t`, and
//! [`clock`] is the single monotonic nanosecond clock plus the emulated
//! jiffies and timer wheel of the legacy mechanisms upstream replaced, and
//! [`timing`] holds every precise wait (parker, deadline timer, learnt
//! wake margin, sleep-then-spin, timer slack).
//!
//! Nothing here knows about queues, tables or frontends: imports only point
//! down, and this is the floor.

#![warn(missing_docs)]

pub mod affinity;
pub mod bio;
pub mod clock;
pub mod comp_batch;
pub mod cpu;
pub mod device;
pub mod plug;
pub mod status;
pub mod sync;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod timing;

pub use bio::{AlignedBuf, Bio, BioFlags, EndIo, IoBuf, Op};
pub use device::{Device, DeviceRef, Features, QueueShape, Reaper};
pub use status::Status;
pub use sync::{submit_and_wait, Completion};

/// Sector size used by device-mapper tables: lengths and starts are in
/// 512-byte units whatever the device's logical block size is.
pub const SECTOR_SIZE: u64 = 512;
/// `log2(SECTOR_SIZE)`: sectors to bytes by shifting, as the kernel's
/// `SECTOR_SHIFT`.
pub const SECTOR_SHIFT: u32 = 9;
