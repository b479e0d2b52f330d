//! The ublk frontend: a blkstack device as a real kernel block device,
//! `/dev/ublkbN`, through the kernel's ublk driver
//! (drivers/block/ublk_drv.c), spoken directly: its user API
//! (include/uapi/linux/ublk_cmd.h) is written out by hand in [`uapi`] and
//! its io_uring commands go through the `io-uring` crate, so the build
//! needs no bindgen and no libclang.
//!
//! - [`uapi`]: the 6.12 header's structures, commands and flags.
//! - [`ctrl`]: the control commands on /dev/ublk-control.
//! - [`params`]: the stack's geometry and features as `ublk_params`.
//! - [`queue`]: one thread per ublk queue, requests to bios and back.
//! - [`export`]: one device's life (add, start, recover, stop, delete).
//! - [`export_driver`]: ublk as one of `serve`'s export frontends: its
//!   flags, and the set of ublk exports of a `serve`, which the control
//!   socket's `export --ublk` / `unexport` drive.
//!
//! Each ublk queue is one hardware queue of ours: its depth is the tag
//! count (the kernel never sends more than the queue's depth), and its
//! thread submits into the stack as an NBD connection's reader does.

pub mod ctrl;
pub mod error;
pub mod export;
pub mod export_driver;
pub mod options;
pub mod params;
pub mod queue;
pub mod uapi;

pub use error::{check_control, Errno, UblkError, CONTROL_PATH};
pub use export::UblkExport;
pub use export_driver::{UblkArgs, UblkHost};
pub use options::UblkOptions;
