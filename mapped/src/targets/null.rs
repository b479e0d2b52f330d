//! `null [key=value...]`: the null_blk-like driver as a table target; the
//! knobs (bs, irqmode, completion_nsec, hw_queue_depth, ...) are parsed by
//! the driver, see `blkstack_drivers::null`.

use super::leaf::{leaf_type, LeafDriver, LeafTarget};
use crate::error::TargetError;
use crate::target::{CtrContext, TargetRef, TargetType};
use blkstack_drivers::null::NullDevice;
use std::sync::Arc;

pub const TYPE: TargetType = leaf_type("null", ctr);

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    let driver = NullDevice::from_args(ctx.len_bytes(), args).map_err(TargetError::driver)?;
    Ok(Arc::new(LeafTarget { driver }))
}

/// A leaf target submitting to the engine's `Disk` the device derefs to.
impl LeafDriver for NullDevice {
    type Device = <NullDevice as std::ops::Deref>::Target;
    fn device(&self) -> &Self::Device {
        self
    }
    fn status(&self) -> String {
        NullDevice::status(self)
    }
    fn table_args(&self) -> String {
        NullDevice::table_args(self)
    }
}
