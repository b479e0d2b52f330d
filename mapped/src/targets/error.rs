//! `error [<dev> <offset>]`: every I/O fails (kernel dm-target.c's io_err
//! target, version 1.7). As in kernel 6.12, any argument list is
//! accepted; exactly two are taken as a backing device and start sector,
//! the way dm-linear reads them (`io_err_get_args`: "Invalid device
//! sector", "Device lookup failed"), and the device's range is checked as
//! dm-table.c's `device_area_is_invalid` does. Any other count is
//! ignored. The target has no status function in the kernel, so both
//! `table` and `status` print nothing after the target name.

use crate::error::TargetError;
use crate::target::{parse_sscanf, CtrContext, DevArg, Target, TargetRef, TargetType};
use blkstack_core::{Bio, Status};
use std::sync::Arc;

pub const TYPE: TargetType = TargetType {
    name: "error",
    version: [1, 7, 0],
    ctr,
};

pub struct ErrorTarget {
    /// The device given with two arguments, held so the table depends on
    /// it as the kernel's `dm_get_device` makes it.
    _dev: Option<DevArg>,
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    let dev = if let [dev, start] = args {
        let start: u64 = parse_sscanf("device sector", start)?;
        Some(ctx.get_device(dev, start, ctx.len)?)
    } else {
        None
    };
    Ok(Arc::new(ErrorTarget { _dev: dev }))
}

impl Target for ErrorTarget {
    fn map(&self, bio: Bio) {
        bio.complete(Status::IoError);
    }

    fn table(&self) -> String {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use crate::Registry;

    #[test]
    fn arguments_follow_kernel_6_12() {
        let reg = Registry::new();
        reg.create("z", "0 100 zero").unwrap();
        // Any count but two is ignored, and nothing is printed back.
        let d = reg.create("e3", "0 8 error a b c").unwrap();
        assert_eq!(d.table_text(), "0 8 error\n");
        reg.create("e0", "0 8 error").unwrap();
        // Two: a device and a sector, checked as dm-linear checks them.
        let d = reg.create("e2", "0 8 error z 92").unwrap();
        assert_eq!(d.table_text(), "0 8 error\n");
        for bad in [
            "0 8 error z x",
            "0 8 error z +1",
            "0 8 error nosuch 0",
            "0 8 error z 93",
        ] {
            assert!(reg.create("bad", bad).is_err(), "{bad} accepted");
        }
    }
}
