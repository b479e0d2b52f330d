//! `memory [key=value...]`: a sparse RAM disk that really stores data, as
//! a table target; see `blkstack_drivers::memory`.

use super::leaf::{leaf_type, LeafDriver, LeafTarget};
use crate::error::TargetError;
use crate::target::{CtrContext, TargetRef, TargetType};
use blkstack_drivers::memory::MemoryDevice;
use std::sync::Arc;

pub const TYPE: TargetType = leaf_type("memory", ctr);

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    let driver = MemoryDevice::from_args(ctx.len_bytes(), args)?;
    Ok(Arc::new(LeafTarget { driver }))
}

impl LeafDriver for MemoryDevice {
    fn status(&self) -> String {
        MemoryDevice::status(self)
    }
    fn table_args(&self) -> String {
        MemoryDevice::table_args(self)
    }
}
