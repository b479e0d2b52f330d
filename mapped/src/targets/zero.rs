//! `zero`: reads return zeroes, writes and discards are dropped (kernel
//! dm-zero.c). Everything is a hole, so NBD clients can skip it.

use crate::error::TargetError;
use crate::target::{expect_args, CtrContext, Target, TargetRef, TargetType};
use blkstack_core::device::Extent;
use blkstack_core::{Bio, Features, Op, Status};
use std::sync::Arc;

pub const TYPE: TargetType = TargetType {
    name: "zero",
    version: [1, 2, 0],
    ctr,
};

pub struct ZeroTarget;

fn ctr(_ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    expect_args(args, &[0], "")?;
    Ok(Arc::new(ZeroTarget))
}

impl Target for ZeroTarget {
    fn map(&self, bio: Bio) {
        if bio.op == Op::Read {
            bio.data_mut().fill(0);
        }
        bio.complete(Status::Ok);
    }

    fn table(&self) -> String {
        String::new()
    }

    fn features(&self) -> Features {
        Features {
            flush: false,
            fua: true,
            discard: true,
            discard_granularity: 0,
            write_zeroes: true,
            fast_zero: true,
            read_only: false,
            flush_is_global: true,
            knows_holes: true,
        }
    }

    fn extents(&self, offset: u64, len: u64) -> Option<Vec<Extent>> {
        Some(vec![Extent {
            offset,
            len,
            hole: true,
        }])
    }
}
