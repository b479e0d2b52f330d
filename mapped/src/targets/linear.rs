//! `linear <dev> <offset>`: remap onto a range of another device (kernel
//! dm-linear.c). The bio is passed down as is with its offset moved: no
//! completion frame, no per-I/O cost beyond an add.
//!
//! Polled bios pass through when the device below polls, as Linux dm lets
//! a bio with REQ_POLLED through targets whose devices all support polling
//! (`dm_table_supports_poll`), and `poll` reaps on that device.

use crate::error::TargetError;
use crate::target::{
    expect_args, extents_from, parse_sscanf, CtrContext, DevArg, Target, TargetRef, TargetType,
};
use blkstack_core::device::Extent;
use blkstack_core::{Bio, Device, Features, SECTOR_SIZE};
use std::sync::Arc;

pub const TYPE: TargetType = TargetType {
    name: "linear",
    version: [1, 4, 0],
    ctr,
};

pub struct LinearTarget {
    dev: DevArg,
    /// Start on `dev`, in sectors.
    start: u64,
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    expect_args(args, &[2], "<dev> <offset>")?;
    let start: u64 = parse_sscanf("device sector", args[1])?;
    let dev = ctx.get_device(args[0], start, ctx.len)?;
    Ok(Arc::new(LinearTarget { dev, start }))
}

impl Target for LinearTarget {
    fn map(&self, mut bio: Bio) {
        bio.offset += self.start * SECTOR_SIZE;
        self.dev.dev.submit(bio);
    }

    /// The whole batch moves by the same offset and goes down as one, so
    /// the device below pays its per-submission costs once per batch (dm
    /// maps each bio of a plug, whose requests the block layer then
    /// dispatches together).
    fn map_batch(&self, bios: &mut Vec<Bio>) {
        let by = self.start * SECTOR_SIZE;
        for bio in bios.iter_mut() {
            bio.offset += by;
        }
        self.dev.dev.submit_batch(bios);
    }

    fn table(&self) -> String {
        format!("{} {}", self.dev, self.start)
    }

    fn features(&self) -> Features {
        self.dev.dev.features()
    }

    fn poll_devices<'a>(&'a self, f: &mut dyn FnMut(&'a dyn Device)) {
        f(&*self.dev.dev);
    }

    fn extents(&self, offset: u64, len: u64) -> Option<Vec<Extent>> {
        extents_from(&self.dev, self.start, offset, len)
    }
}
