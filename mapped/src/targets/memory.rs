//! `memory [key=value...]`: a sparse RAM disk that really stores data, as
//! a table target; see `blkstack_drivers::memory`. A reload whose line
//! keeps the same start and length takes the live table's pages over
//! (`CtrContext::kept_store`), as dm keeps the underlying device.

use super::leaf::{leaf_type, LeafDriver, LeafTarget};
use crate::error::TargetError;
use crate::target::{CtrContext, TargetRef, TargetType};
use blkstack_drivers::memory::{MemoryDevice, PageStore};
use std::sync::Arc;

pub const TYPE: TargetType = leaf_type("memory", ctr);

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    let driver = MemoryDevice::from_args_with_store(ctx.len_bytes(), args, ctx.kept_store.take())
        .map_err(TargetError::driver)?;
    Ok(Arc::new(LeafTarget { driver }))
}

/// The engine's leaf disk the device derefs to.
impl LeafDriver for MemoryDevice {
    type Device = <MemoryDevice as std::ops::Deref>::Target;
    fn device(&self) -> &Self::Device {
        self
    }
    fn status(&self) -> String {
        MemoryDevice::status(self)
    }
    fn table_args(&self) -> String {
        MemoryDevice::table_args(self)
    }
    fn ram_store(&self) -> Option<Arc<PageStore>> {
        Some(self.shared_store())
    }
}
