//! Leaf drivers: the devices at the bottom of every stack.
//!
//! `null` (null_blk-like) and `memory` (a sparse RAM disk, like brd) both
//! take optional `key=value` table args through [`args::KvArgs`], print them
//! back canonically (`table_args`) and report state (`status`) in the form
//! the mapped layer shows for `dmsetup table` / `dmsetup status`. Both go
//! through the blk-mq engine (`blkstack_mq`), whose knobs they take as
//! table args ([`engine_args`]).

pub mod args;
pub mod engine_args;
pub mod file;
pub mod memory;
pub mod null;

pub use memory::MemoryDevice;
pub use null::NullDevice;
