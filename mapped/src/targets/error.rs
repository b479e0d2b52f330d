//! `error`: every I/O fails (kernel dm-target.c's io_err target). Useful
//! to punch failing ranges into a table and to test error paths above.

use crate::error::TargetError;
use crate::target::{expect_args, CtrContext, Target, TargetRef, TargetType};
use blkstack_core::{Bio, Status};
use std::sync::Arc;

pub const TYPE: TargetType = TargetType {
    name: "error",
    version: [1, 6, 0],
    ctr,
};

pub struct ErrorTarget;

fn ctr(_ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    expect_args(args, &[0], "")?;
    Ok(Arc::new(ErrorTarget))
}

impl Target for ErrorTarget {
    fn map(&self, bio: Bio) {
        bio.complete(Status::IoError);
    }

    fn table(&self) -> String {
        String::new()
    }
}
