//! `nbd URI [connections=N] [queue_depth=N] [timeout_ms=N]
//! [reconnect_delay_ms=N] [dead_timeout_ms=N] [poll_us=N] [poll_queues=N]`:
//! a remote NBD
//! export as a table target, the userspace counterpart of the kernel's nbd client;
//! see `blkstack_drivers::nbd`. The table load connects and negotiates, so
//! an unreachable server or an export shorter than the line fails the
//! load and changes nothing.

use super::leaf::{leaf_type, LeafDriver, LeafTarget};
use crate::error::TargetError;
use crate::target::{CtrContext, TargetRef, TargetType};
use blkstack_drivers::nbd::NbdDevice;
use std::sync::Arc;

/// The NBD wire format, the client leaf's, shared with the NBD server
/// frontend (which reaches the leaf drivers only through this crate).
pub use blkstack_drivers::nbd::proto;

/// The `nbd` target type: a leaf device that is an NBD client of a remote
/// export, from `blkstack-drivers`.
pub const TYPE: TargetType = leaf_type("nbd", ctr);

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    let driver = NbdDevice::from_args(ctx.len_bytes(), args).map_err(TargetError::driver)?;
    Ok(Arc::new(LeafTarget { driver }))
}

/// A leaf target submitting to the engine's `Disk` the device derefs to.
impl LeafDriver for NbdDevice {
    type Device = <NbdDevice as std::ops::Deref>::Target;
    fn device(&self) -> &Self::Device {
        self
    }
    fn status(&self) -> String {
        NbdDevice::status(self)
    }
    fn table_args(&self) -> String {
        NbdDevice::table_args(self)
    }
}
