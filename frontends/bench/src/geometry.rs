//! Where a job runs on its device ([`Geometry`]): the region from
//! `offset`, `offset_increment` and `size`, checked against the device's
//! size and logical block size before any thread starts, as fio's
//! `setup_files` does, so that mistakes are reported up front.

use crate::spec::{JobSpec, VerifyMode};
use blkstack_core::DeviceRef;

/// Where a job runs, resolved against its device before any thread starts,
/// so that geometry mistakes are reported up front.
#[derive(Clone, Debug)]
pub struct Geometry {
    /// First byte of the job's region.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
    pub dev_size: u64,
    /// Verify unit: the smallest block size.
    pub unit: u64,
    pub max_bs: u64,
    /// The device's logical block size.
    pub lbs: u64,
    /// Bytes of I/O to do when not time based.
    pub io_limit: u64,
}

impl Geometry {
    /// The region of clone `clone_index` (0-based) of `spec` on `dev`.
    pub fn resolve(
        spec: &JobSpec,
        dev: &DeviceRef,
        dev_name: &str,
        clone_index: u32,
    ) -> anyhow::Result<Geometry> {
        use anyhow::bail;
        let dev_size = dev.size();
        let lbs = dev.logical_block_size().max(1) as u64;
        let (min_bs, max_bs) = spec.bs_bounds();
        let unit = Self::check_block_sizes(spec, dev, dev_name, lbs, min_bs)?;
        let mut start = spec.offset.resolve(dev_size);
        if matches!(spec.offset, crate::spec::SizeSpec::Percent(_)) {
            // fio aligns percentage offsets down to the block size.
            start -= start % min_bs;
        }
        // fio's offset_increment: clone k starts k increments further.
        let incr = spec.offset_increment.resolve(dev_size);
        start = start.saturating_add(incr.saturating_mul(clone_index as u64));
        if !start.is_multiple_of(lbs) {
            bail!(
                "job '{}': offset {start} is not a multiple of {dev_name}'s logical block size {lbs}",
                spec.name
            );
        }
        if start >= dev_size {
            bail!(
                "job '{}': offset {start} is at or past the end of {dev_name} ({dev_size} bytes)",
                spec.name
            );
        }
        let size = match spec.filesize.or(spec.size) {
            Some(s) => s.resolve(dev_size),
            None => dev_size - start,
        };
        if start.checked_add(size).is_none_or(|e| e > dev_size) {
            bail!(
                "job '{}': offset {start} + size {size} is past the end of {dev_name} ({dev_size} bytes)",
                spec.name
            );
        }
        // Whole blocks only, as fio trims a region to the block size.
        let size = size - size % min_bs;
        if size < max_bs {
            bail!(
                "job '{}': region of {size} bytes is smaller than the block size {max_bs}",
                spec.name
            );
        }
        let end = start + size;
        // Whole blocks here too, so the last (clipped) I/O stays aligned.
        let io_limit = match (spec.filesize, spec.size, spec.io_size) {
            // With filesize the region is the file; size bounds the I/O.
            (Some(_), Some(total), None) => {
                total.resolve(dev_size).saturating_mul(spec.loops as u64)
            }
            _ => spec.io_limit(size, dev_size),
        };
        let io_limit = (io_limit - io_limit % min_bs).max(min_bs);
        Ok(Geometry {
            start,
            end,
            dev_size,
            unit: if spec.verify == VerifyMode::None {
                min_bs
            } else {
                unit
            },
            lbs,
            max_bs,
            io_limit,
        })
    }

    /// Every block size fits the device (multiple of its logical block
    /// size, at most its largest request) and verify's unit; returns the
    /// verify unit.
    fn check_block_sizes(
        spec: &JobSpec,
        dev: &DeviceRef,
        dev_name: &str,
        lbs: u64,
        min_bs: u64,
    ) -> anyhow::Result<u64> {
        use anyhow::bail;
        // Trims larger than a request are split; data I/O is not.
        let data_dirs: &[usize] = match (spec.rw.reads(), spec.rw.writes()) {
            (true, true) => &[0, 1],
            (true, false) => &[0],
            (false, true) => &[1],
            (false, false) => &[],
        };
        let sizes: Vec<u64> = data_dirs
            .iter()
            .flat_map(|&d| spec.bs_for(d).sizes())
            .collect();
        let trim_sizes = if spec.rw.trims() {
            spec.bs_for(2).sizes()
        } else {
            Vec::new()
        };
        for &b in &trim_sizes {
            if !b.is_multiple_of(lbs) {
                bail!(
                    "job '{}': trim size {b} is not a multiple of {dev_name}'s logical block size {lbs}",
                    spec.name
                );
            }
        }
        for &b in &sizes {
            if !b.is_multiple_of(lbs) {
                bail!(
                    "job '{}': block size {b} is not a multiple of {dev_name}'s logical block size {lbs}",
                    spec.name
                );
            }
            if b > dev.max_io_bytes() {
                bail!(
                    "job '{}': block size {b} exceeds {dev_name}'s largest request ({} bytes)",
                    spec.name,
                    dev.max_io_bytes()
                );
            }
            if spec.verify != VerifyMode::None && !b.is_multiple_of(min_bs) {
                bail!(
                    "job '{}': with verify, every block size must be a multiple of the smallest ({min_bs}); {b} is not",
                    spec.name
                );
            }
        }
        let unit = spec.verify_interval.unwrap_or(min_bs);
        let min_unit =
            crate::verify_algo::Verifier::new(spec.verify, &spec.verify_pattern).min_unit();
        if spec.verify != VerifyMode::None {
            if (unit as usize) < min_unit {
                bail!(
                    "job '{}': verify={} needs blocks (verify_interval) of at least {min_unit} bytes",
                    spec.name,
                    spec.verify.name()
                );
            }
            if !min_bs.is_multiple_of(unit) || !unit.is_multiple_of(lbs) {
                bail!(
                    "job '{}': verify_interval {unit} must divide the smallest block size {min_bs} and be a multiple of {lbs}",
                    spec.name
                );
            }
            if spec.bs_unaligned {
                bail!(
                    "job '{}': verify needs aligned block sizes (blocksize_unaligned is set)",
                    spec.name
                );
            }
        }
        Ok(unit)
    }
}
