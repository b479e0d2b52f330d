//! The device's queue limits as the kernel's ublk driver takes them
//! (`struct ublk_params`, checked by `ublk_validate_params` and applied by
//! `ublk_dev_param_basic_apply` / `_discard_apply` in
//! drivers/block/ublk_drv.c): sizes, block sizes, the largest request,
//! discard and write-zeroes limits, the cache, FUA and read-only, all
//! from the stack's device, so `/dev/ublkbN` shows what the stack is.
//! The structure is [`crate::uapi::ublk_params`], as the 6.12 header has it.

use crate::uapi;
use blkstack_core::Device;

/// Geometry and features of the device, read once when it is exported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub size: u64,
    pub logical_block_size: u32,
    pub physical_block_size: u32,
    pub max_io_bytes: u64,
    pub features: blkstack_core::Features,
}

impl Geometry {
    pub fn of(dev: &dyn Device) -> Geometry {
        Geometry {
            size: dev.size(),
            logical_block_size: dev.logical_block_size(),
            physical_block_size: dev.physical_block_size(),
            max_io_bytes: dev.max_io_bytes(),
            features: dev.features(),
        }
    }
}

fn shift_of(bytes: u32) -> Option<u8> {
    bytes
        .is_power_of_two()
        .then(|| bytes.trailing_zeros() as u8)
}

/// A device the driver would refuse, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParamsError {
    #[error("logical block size {0} is not a power of two in 512..=4096")]
    LogicalBlockSize(u32),
    #[error("physical block size {0} is not a power of two")]
    PhysicalBlockSize(u32),
    #[error("size {size} is not a positive multiple of the logical block size {lbs}")]
    Size { size: u64, lbs: u32 },
    #[error("largest request {0} bytes is below the driver's minimum of one 4096-byte page")]
    MaxRequest(u64),
}

/// `ublk_params` for a device of `g`, given the per-tag buffer size
/// (`max_io_buf_bytes`, which bounds `max_sectors`). Refuses what the
/// driver would refuse, with the reason.
pub fn ublk_params(
    g: &Geometry,
    io_buf_bytes: u32,
    read_only: bool,
) -> Result<uapi::ublk_params, ParamsError> {
    let lbs = g.logical_block_size;
    let lshift = shift_of(lbs)
        .filter(|s| (9..=12).contains(s))
        .ok_or(ParamsError::LogicalBlockSize(lbs))?;
    let pbs = g.physical_block_size.max(lbs);
    let pshift = shift_of(pbs).ok_or(ParamsError::PhysicalBlockSize(pbs))?;
    if !g.size.is_multiple_of(lbs as u64) || g.size == 0 {
        return Err(ParamsError::Size { size: g.size, lbs });
    }
    // The largest request: the device's own limit and the buffer, in whole
    // logical blocks; the driver wants at least a page.
    let max_bytes = g.max_io_bytes.min(io_buf_bytes as u64);
    let max_bytes = max_bytes - max_bytes % lbs as u64;
    if max_bytes < 4096 {
        return Err(ParamsError::MaxRequest(max_bytes));
    }
    let f = g.features;
    let mut attrs = 0;
    if read_only || f.read_only {
        attrs |= uapi::UBLK_ATTR_READ_ONLY;
    }
    if f.flush {
        attrs |= uapi::UBLK_ATTR_VOLATILE_CACHE;
    }
    if f.fua {
        attrs |= uapi::UBLK_ATTR_FUA;
    }
    let mut p = uapi::ublk_params {
        len: std::mem::size_of::<uapi::ublk_params>() as u32,
        types: uapi::UBLK_PARAM_TYPE_BASIC,
        basic: uapi::ublk_param_basic {
            attrs,
            logical_bs_shift: lshift,
            physical_bs_shift: pshift,
            io_opt_shift: pshift,
            io_min_shift: pshift,
            max_sectors: (max_bytes >> 9) as u32,
            chunk_sectors: 0,
            dev_sectors: g.size >> 9,
            virt_boundary_mask: 0,
        },
        ..Default::default()
    };
    let writable = attrs & uapi::UBLK_ATTR_READ_ONLY == 0;
    if writable && (f.discard || f.write_zeroes) {
        p.types |= uapi::UBLK_PARAM_TYPE_DISCARD;
        p.discard = uapi::ublk_param_discard {
            discard_alignment: 0,
            discard_granularity: match f.discard_granularity {
                0 => pbs,
                g => g,
            },
            max_discard_sectors: if f.discard {
                (max_bytes >> 9) as u32
            } else {
                0
            },
            max_write_zeroes_sectors: if f.write_zeroes {
                (max_bytes >> 9) as u32
            } else {
                0
            },
            max_discard_segments: 1,
            reserved0: 0,
        };
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkstack_core::Features;

    fn geo(lbs: u32, features: Features) -> Geometry {
        Geometry {
            size: 64 << 20,
            logical_block_size: lbs,
            physical_block_size: 4096,
            max_io_bytes: 1 << 20,
            features,
        }
    }

    #[test]
    fn limits_come_from_the_device() {
        let f = Features {
            discard: true,
            write_zeroes: true,
            ..Features::default()
        };
        let p = ublk_params(&geo(4096, f), 512 << 10, false).unwrap();
        // The 6.12 driver's structure, whole: basic, discard, devt, zoned.
        assert_eq!(p.len, 112);
        assert_eq!(p.basic.logical_bs_shift, 12);
        assert_eq!(p.basic.physical_bs_shift, 12);
        assert_eq!(p.basic.dev_sectors, (64 << 20) >> 9);
        // The buffer is the smaller bound here.
        assert_eq!(p.basic.max_sectors, (512 << 10) >> 9);
        assert_ne!(p.basic.attrs & uapi::UBLK_ATTR_VOLATILE_CACHE, 0);
        assert_ne!(p.basic.attrs & uapi::UBLK_ATTR_FUA, 0);
        assert_eq!(p.basic.attrs & uapi::UBLK_ATTR_READ_ONLY, 0);
        assert_ne!(p.types & uapi::UBLK_PARAM_TYPE_DISCARD, 0);
        assert_eq!(p.discard.max_discard_segments, 1);
        assert_eq!(p.discard.max_write_zeroes_sectors, (512 << 10) >> 9);
        assert_eq!(p.discard.discard_granularity, 4096, "a physical block");
        let thin = Features {
            discard_granularity: 65536,
            ..f
        };
        let p = ublk_params(&geo(512, thin), 512 << 10, false).unwrap();
        assert_eq!(p.discard.discard_granularity, 65536, "a thin pool's block");
    }

    #[test]
    fn read_only_and_featureless_devices() {
        let f = Features {
            flush: false,
            fua: false,
            discard: true,
            ..Features::default()
        };
        let p = ublk_params(&geo(512, f), 512 << 10, true).unwrap();
        assert_ne!(p.basic.attrs & uapi::UBLK_ATTR_READ_ONLY, 0);
        assert_eq!(p.basic.attrs & uapi::UBLK_ATTR_VOLATILE_CACHE, 0);
        assert_eq!(p.basic.attrs & uapi::UBLK_ATTR_FUA, 0);
        // No discard limits on a read-only device.
        assert_eq!(p.types & uapi::UBLK_PARAM_TYPE_DISCARD, 0);
        let p = ublk_params(&geo(512, Features::default()), 512 << 10, false).unwrap();
        assert_eq!(p.types & uapi::UBLK_PARAM_TYPE_DISCARD, 0);
    }

    #[test]
    fn what_the_driver_refuses_is_refused_here() {
        let mut g = geo(8192, Features::default());
        assert!(ublk_params(&g, 512 << 10, false)
            .unwrap_err()
            .to_string()
            .contains("logical block size"));
        g.logical_block_size = 512;
        g.max_io_bytes = 2048;
        assert!(ublk_params(&g, 512 << 10, false)
            .unwrap_err()
            .to_string()
            .contains("4096-byte page"));
        g.max_io_bytes = 1 << 20;
        g.size = 1000;
        assert!(ublk_params(&g, 512 << 10, false)
            .unwrap_err()
            .to_string()
            .contains("size"));
    }
}
