//! The sizes a job names: a byte count or a share of the device
//! ([`SizeSpec`], fio's `size=50%`), and the block sizes it issues
//! ([`BlockSizes`]: fio's `bs`, `bssplit` and `bsrange`). Apart from
//! `spec.rs` so that the value parsers (`parse.rs`) can build them without
//! depending on the whole job description.

use std::fmt;

/// A size given either in bytes or as a percentage of the device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SizeSpec {
    Bytes(u64),
    /// Percent of the device size, 0 < p <= 100.
    Percent(f64),
}

impl SizeSpec {
    /// Resolve against a device of `dev_size` bytes.
    pub fn resolve(self, dev_size: u64) -> u64 {
        match self {
            SizeSpec::Bytes(b) => b,
            SizeSpec::Percent(p) => ((dev_size as f64) * p / 100.0) as u64,
        }
    }
}

impl fmt::Display for SizeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SizeSpec::Bytes(b) => write!(f, "{b}"),
            SizeSpec::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// Block sizes: one size, fio's `bssplit` weighted list, or fio's
/// `bsrange` (any multiple of the smallest between two bounds).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSizes {
    /// `(bytes, percent)` pairs; the percents add up to 100.
    pub split: Vec<(u64, u32)>,
    /// `bsrange=MIN-MAX`: uniform over the multiples of `MIN` (of the
    /// logical block size with `blocksize_unaligned`) up to `MAX`; when set,
    /// `split` is empty.
    pub range: Option<(u64, u64)>,
}

impl BlockSizes {
    pub fn single(bytes: u64) -> BlockSizes {
        BlockSizes {
            split: vec![(bytes, 100)],
            range: None,
        }
    }

    pub fn min(&self) -> u64 {
        if let Some((lo, _)) = self.range {
            return lo;
        }
        self.split.iter().map(|s| s.0).min().unwrap_or(4096)
    }

    pub fn max(&self) -> u64 {
        if let Some((_, hi)) = self.range {
            return hi;
        }
        self.split.iter().map(|s| s.0).max().unwrap_or(4096)
    }

    /// Every size a job may issue (the bounds only, for a range).
    pub fn sizes(&self) -> Vec<u64> {
        match self.range {
            Some((lo, hi)) => vec![lo, hi],
            None => self.split.iter().map(|s| s.0).collect(),
        }
    }

    /// fio's `bs=(R) 4096B-4096B` notation (min-max).
    pub fn range_text(&self) -> String {
        format!("{}B-{}B", self.min(), self.max())
    }
}

impl Default for BlockSizes {
    /// fio's default `bs=4k`.
    fn default() -> Self {
        BlockSizes::single(4096)
    }
}
