//! Leaf drivers as table targets: the line's length is the device size,
//! the optional `key=value` arguments go to the driver, and `map` submits
//! straight to it (the line-relative offset is the device offset). Shared
//! by `null`, `memory` and any other driver-backed target.

use crate::error::TargetError;
use crate::target::{Target, TargetType};
use blkstack_core::device::Extent;
use blkstack_core::{Bio, Device, Features, QueueShape};

/// What a leaf driver shows through `status`, `table` and `message`, and
/// the device it submits to (for the drivers under the engine, the
/// engine's one leaf `Disk`).
pub trait LeafDriver: Send + Sync + 'static {
    type Device: Device;
    fn device(&self) -> &Self::Device;
    fn status(&self) -> String;
    fn table_args(&self) -> String;
    fn message(&self, args: &[&str]) -> Result<String, TargetError> {
        Err(TargetError::invalid(format!(
            "message '{}' not supported",
            args.join(" ")
        )))
    }
}

pub struct LeafTarget<D: LeafDriver> {
    pub driver: D,
}

impl<D: LeafDriver> Target for LeafTarget<D> {
    fn map(&self, bio: Bio) {
        self.driver.device().submit(bio);
    }

    fn map_batch(&self, bios: &mut Vec<Bio>) {
        self.driver.device().submit_batch(bios);
    }

    fn status(&self) -> String {
        self.driver.status()
    }

    fn table(&self) -> String {
        self.driver.table_args()
    }

    fn message(&self, args: &[&str]) -> Result<String, TargetError> {
        self.driver.message(args)
    }

    fn features(&self) -> Features {
        self.driver.device().features()
    }

    fn queue_shape(&self) -> Option<QueueShape> {
        self.driver.device().queue_shape()
    }

    fn extents(&self, offset: u64, len: u64) -> Option<Vec<Extent>> {
        self.driver.device().extents(offset, len)
    }

    fn poll_devices<'a>(&'a self, f: &mut dyn FnMut(&'a dyn Device)) {
        f(self.driver.device());
    }
}

/// Shorthand to declare a leaf target type.
pub const fn leaf_type(
    name: &'static str,
    ctr: fn(
        &mut crate::target::CtrContext<'_>,
        &[&str],
    ) -> Result<crate::target::TargetRef, TargetError>,
) -> TargetType {
    TargetType {
        name,
        version: [1, 0, 0],
        ctr,
    }
}
