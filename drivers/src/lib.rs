//! Leaf drivers: the devices at the bottom of every stack.
//!
//! `nbd` reaches a remote export as the kernel's nbd client does (one
//! connection per hardware queue, reconnect, dead timeout); its wire
//! format module, [`nbd::proto`], is shared with the NBD server frontend.
//!
//! `null` (null_blk-like) and `memory` (a sparse RAM disk, like brd) both
//! take optional `key=value` table args through [`args::KvArgs`], print them
//! back canonically (`table_args`) and report state (`status`) in the form
//! the mapped layer shows for `dmsetup table` / `dmsetup status`. Both go
//! through the blk-mq engine (`blkstack_mq`), whose knobs they take as
//! table args ([`engine_args`]), on one emulated disk ([`emulation`]:
//! null_blk's completion modes).
//!
//! Drivers under the engine (`null`, `memory`, `nbd`) implement only its
//! `Driver` trait (kernel `blk_mq_ops`); the device is the engine's one
//! leaf `Disk`, which each driver's device type derefs to, so
//! submission, admission checks and polling are written once.
//!
//! Experiments build them from Rust with the engine options they vary and
//! read the engine's counters back:
//!
//! ```
//! use blkstack_core::{submit_and_wait, Op, Status};
//! use blkstack_drivers::emulation::{CompletionMode, CompletionOptions};
//! use blkstack_drivers::NullDevice;
//! use blkstack_mq::{EngineOptions, WakeupAlgo};
//!
//! let opts = EngineOptions {
//!     queue_depth: 8,
//!     tag_wakeup: WakeupAlgo::WaitCnt,
//!     run_dedup: false,
//!     ..EngineOptions::default()
//! };
//! let completion = CompletionOptions {
//!     mode: CompletionMode::Timer { nsec: 20_000 },
//!     ..CompletionOptions::default()
//! };
//! let dev = NullDevice::with_options(1 << 30, 4096, 0, opts, completion).unwrap();
//! let mut buf = vec![0u8; 4096];
//! assert_eq!(submit_and_wait(&*dev, Op::Read, 0, 4096, &mut buf), Status::Ok);
//! let stats = dev.engine_stats();
//! assert_eq!(stats.tags_in_use, 0);
//! println!("{} / runs posted {}", dev.status(), stats.hctx.runs_posted);
//! ```

pub mod args;
pub mod emulation;
pub mod engine_args;
pub mod error;
pub mod file;
pub mod memory;
pub mod nbd;
pub mod null;

pub use error::{ArgError, FileError, MemoryError};
pub use memory::MemoryDevice;
pub use nbd::{NbdDevice, NbdError};
pub use null::NullDevice;
