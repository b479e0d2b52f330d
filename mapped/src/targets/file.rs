//! `file PATH [direct] [iopoll|hybrid_iopoll] [create] [queue_depth=N]
//! [engine=uring|psync]`: a file (or block device node) as a table target,
//! served through io_uring like the kernel's loop driver with direct I/O;
//! see `blkstack_drivers::file` for the semantics and the fallbacks.

use super::leaf::{leaf_type, LeafDriver, LeafTarget};
use crate::error::TargetError;
use crate::target::{CtrContext, TargetRef, TargetType};
use blkstack_drivers::file::FileDevice;
use std::sync::Arc;

pub const TYPE: TargetType = leaf_type("file", ctr);

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    let driver = FileDevice::from_args(ctx.len_bytes(), args).map_err(TargetError::driver)?;
    Ok(Arc::new(LeafTarget { driver }))
}

impl LeafDriver for FileDevice {
    type Device = FileDevice;
    fn device(&self) -> &Self::Device {
        self
    }
    fn status(&self) -> String {
        FileDevice::status(self)
    }
    fn table_args(&self) -> String {
        FileDevice::table_args(self)
    }
}
