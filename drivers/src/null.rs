//! `null`: a device that does nothing, quickly (Linux `null_blk`).
//!
//! Reads return zeroes, writes are dropped, every request completes with
//! `Ok`. It exists to measure the stack above it, the way the seeds measure
//! blk-mq against null_blk. Optional table args: `bs=` (logical block
//! size, a power of two in 512..=4096).

use crate::args::{check_size, KvArgs};
use blkstack_core::device::{check_bio, Extent};
use blkstack_core::{Bio, Device, Features, Op, Status};

pub struct NullDevice {
    size: u64,
    block_size: u32,
}

impl NullDevice {
    /// Build from a table line's length (in bytes) and its optional
    /// `key=value` args.
    pub fn from_args(size_bytes: u64, args: &[&str]) -> Result<Self, String> {
        let mut kv = KvArgs::parse("null", args)?;
        let block_size = kv.take_block_size("bs")?;
        kv.finish()?;
        check_size("null", size_bytes, block_size)?;
        Ok(NullDevice {
            size: size_bytes,
            block_size,
        })
    }

    /// The args as `dmsetup table` prints them: only non-defaults, in a fixed
    /// order, so that parsing them again gives the same device.
    pub fn table_args(&self) -> String {
        if self.block_size != 512 {
            format!("bs={}", self.block_size)
        } else {
            String::new()
        }
    }

    pub fn status(&self) -> String {
        format!("bs={}", self.block_size)
    }
}

impl Device for NullDevice {
    fn submit(&self, bio: Bio) {
        if let Err(st) = check_bio(self, &bio) {
            bio.complete(st);
            return;
        }
        if bio.op == Op::Read {
            bio.data_mut().fill(0);
        }
        bio.complete(Status::Ok);
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn logical_block_size(&self) -> u32 {
        self.block_size
    }

    fn features(&self) -> Features {
        Features {
            discard: true,
            write_zeroes: true,
            fast_zero: true,
            knows_holes: true,
            ..Features::default()
        }
    }

    /// Everything reads as zeroes and nothing is stored: one hole.
    fn extents(&self, offset: u64, len: u64) -> Option<Vec<Extent>> {
        let end = offset.saturating_add(len).min(self.size);
        if offset >= end {
            return Some(Vec::new());
        }
        Some(vec![Extent {
            offset,
            len: end - offset,
            hole: true,
        }])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkstack_core::submit_and_wait;

    #[test]
    fn reads_zero_writes_dropped() {
        let d = NullDevice::from_args(1 << 20, &[]).unwrap();
        let mut buf = vec![0xabu8; 4096];
        assert_eq!(
            submit_and_wait(&d, Op::Write, 0, 4096, &mut buf),
            Status::Ok
        );
        assert_eq!(submit_and_wait(&d, Op::Read, 0, 4096, &mut buf), Status::Ok);
        assert!(buf.iter().all(|&b| b == 0));
        assert_eq!(submit_and_wait(&d, Op::Flush, 0, 0, &mut []), Status::Ok);
        assert_eq!(
            submit_and_wait(&d, Op::Discard, 0, 8192, &mut []),
            Status::Ok
        );
    }

    #[test]
    fn bad_bios_are_refused() {
        let d = NullDevice::from_args(1 << 20, &["bs=4096"]).unwrap();
        let mut buf = vec![0u8; 512];
        assert_eq!(
            submit_and_wait(&d, Op::Read, 0, 512, &mut buf),
            Status::Invalid
        );
        let mut buf = vec![0u8; 4096];
        assert_eq!(
            submit_and_wait(&d, Op::Read, 1 << 20, 4096, &mut buf),
            Status::Invalid
        );
    }

    #[test]
    fn args_round_trip_and_errors() {
        let d = NullDevice::from_args(1 << 20, &["bs=4096"]).unwrap();
        assert_eq!(d.logical_block_size(), 4096);
        let printed = d.table_args();
        let again: Vec<&str> = printed.split_whitespace().collect();
        let d2 = NullDevice::from_args(1 << 20, &again).unwrap();
        assert_eq!(d2.table_args(), d.table_args());
        assert_eq!(
            NullDevice::from_args(1 << 20, &[]).unwrap().table_args(),
            ""
        );
        assert!(NullDevice::from_args(1 << 20, &["bs=3000"])
            .err()
            .unwrap()
            .contains("bs"));
        assert!(NullDevice::from_args(1 << 20, &["x=1"])
            .err()
            .unwrap()
            .contains("'x'"));
        assert!(NullDevice::from_args(1000, &[]).is_err());
    }
}
