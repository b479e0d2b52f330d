//! Data verification as fio's `verify=crc32c` does it: the unit header,
//! the per-unit write log and the failure descriptions
//! ([`crate::verify_algo`] adds fio's other checksums, `meta` and
//! `pattern` on the same header).
//!
//! Every written block (a "unit": the smallest block size of the job, fio's
//! `verify_interval` default) starts with a header naming what should be
//! there: a magic number, the unit's length, its device offset, the write's
//! sequence number, and a crc32c over the header and the pattern that fills
//! the rest. The job remembers, per unit, the sequence number of the last
//! write that completed there (fio's `io_hist` log). After the I/O phase
//! the verify phase reads every written unit back and checks magic, length,
//! offset, sequence and checksum; a device that corrupts, misplaces, drops
//! or serves stale data fails one of them. A read-only job with verify
//! checks what it reads is self-consistent (fio's behaviour for `rw=read`).
//!
//! Unlike fio (which warns that `norandommap` with `iodepth > 1` may give
//! false failures), the engine never has two overlapping writes in flight
//! in verify mode, so the last completed write is the expected content.

use std::fmt;

/// "BKSV" little-endian: marks a verify header.
pub const VERIFY_MAGIC: u32 = 0x5653_4b42;
/// Bytes of header at the start of every unit.
pub const HEADER_LEN: usize = 32;
const VERIFY_TYPE_CRC32C: u32 = 1;
const CRC_AT: usize = 28;

/// Fill `unit` (one verify unit of a write) with header + pattern.
pub fn fill_unit(unit: &mut [u8], offset: u64, seq: u64) {
    let len = unit.len();
    debug_assert!(len >= HEADER_LEN);
    unit[0..4].copy_from_slice(&VERIFY_MAGIC.to_le_bytes());
    unit[4..8].copy_from_slice(&(len as u32).to_le_bytes());
    unit[8..16].copy_from_slice(&offset.to_le_bytes());
    unit[16..24].copy_from_slice(&seq.to_le_bytes());
    unit[24..28].copy_from_slice(&VERIFY_TYPE_CRC32C.to_le_bytes());
    // xorshift64* pattern seeded by where and when: cheap, and different in
    // every unit and every write, so stale or misplaced data cannot match.
    let mut x = offset ^ seq.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15;
    if x == 0 {
        x = 1;
    }
    for chunk in unit[HEADER_LEN..].chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    let crc = unit_crc(unit);
    unit[CRC_AT..HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
}

fn unit_crc(unit: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&unit[..CRC_AT]), &unit[HEADER_LEN..])
}

/// The header's crc32c: over header and data (`whole`), or the header only
/// (when a digest of the data follows it).
fn header_crc(unit: &[u8], whole: bool) -> u32 {
    if whole {
        unit_crc(unit)
    } else {
        crc32c::crc32c(&unit[..CRC_AT])
    }
}

/// Write the header of a unit whose data (and digest) are in place.
pub fn write_header(unit: &mut [u8], offset: u64, seq: u64, kind: u32, whole_crc: bool) {
    let len = unit.len();
    unit[0..4].copy_from_slice(&VERIFY_MAGIC.to_le_bytes());
    unit[4..8].copy_from_slice(&(len as u32).to_le_bytes());
    unit[8..16].copy_from_slice(&offset.to_le_bytes());
    unit[16..24].copy_from_slice(&seq.to_le_bytes());
    unit[24..28].copy_from_slice(&kind.to_le_bytes());
    let crc = header_crc(unit, whole_crc);
    unit[CRC_AT..HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// Why a unit failed verification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VerifyFailure {
    BadMagic {
        found: u32,
    },
    BadLength {
        found: u32,
        wanted: u32,
    },
    BadOffset {
        found: u64,
    },
    /// The data is from another write than the last one that completed.
    StaleWrite {
        found: u64,
        wanted: u64,
    },
    BadCrc {
        found: u32,
        computed: u32,
    },
    /// The data's digest (`verify=md5|sha256|...`) does not match.
    BadDigest {
        algo: &'static str,
    },
    /// `verify=pattern`: byte `at` differs.
    BadPattern {
        at: usize,
        found: u8,
        wanted: u8,
    },
}

impl VerifyFailure {
    /// fio-like one-line description for the unit at `offset`.
    pub fn describe(&self, device: &str, offset: u64, len: usize) -> String {
        let what = match self {
            VerifyFailure::BadMagic { found } => {
                format!("bad magic header {found:x}, wanted {VERIFY_MAGIC:x}")
            }
            VerifyFailure::BadLength { found, wanted } => {
                format!("bad header length {found}, wanted {wanted}")
            }
            VerifyFailure::BadOffset { found } => {
                format!("bad header offset {found}, wanted {offset}")
            }
            VerifyFailure::StaleWrite { found, wanted } => {
                format!("stale data: write number {found}, wanted {wanted}")
            }
            VerifyFailure::BadCrc { found, computed } => {
                format!("bad crc32c {found:08x}, computed {computed:08x}")
            }
            VerifyFailure::BadDigest { algo } => format!("bad {algo} digest"),
            VerifyFailure::BadPattern { at, found, wanted } => {
                format!("bad pattern at byte {at}: {found:02x}, wanted {wanted:02x}")
            }
        };
        format!("verify: {what} at file {device} offset {offset}, length {len}")
    }
}

impl fmt::Display for VerifyFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe("?", 0, 0))
    }
}

/// Check one unit read back from `offset`. `want_seq` is the write that
/// should be there, or `None` when any intact header will do.
pub fn check_unit(unit: &[u8], offset: u64, want_seq: Option<u64>) -> Result<(), VerifyFailure> {
    unit_header(unit, offset, want_seq, true)
}

/// Check a unit's header (magic, length, offset, crc32c, write number);
/// `whole_crc` as in [`write_header`].
pub fn unit_header(
    unit: &[u8],
    offset: u64,
    want_seq: Option<u64>,
    whole_crc: bool,
) -> Result<(), VerifyFailure> {
    let magic = le32(&unit[0..4]);
    if magic != VERIFY_MAGIC {
        return Err(VerifyFailure::BadMagic { found: magic });
    }
    let len = le32(&unit[4..8]);
    if len as usize != unit.len() {
        return Err(VerifyFailure::BadLength {
            found: len,
            wanted: unit.len() as u32,
        });
    }
    let off = le64(&unit[8..16]);
    if off != offset {
        return Err(VerifyFailure::BadOffset { found: off });
    }
    let stored = le32(&unit[CRC_AT..HEADER_LEN]);
    let computed = header_crc(unit, whole_crc);
    if stored != computed {
        return Err(VerifyFailure::BadCrc {
            found: stored,
            computed,
        });
    }
    let seq = le64(&unit[16..24]);
    if let Some(w) = want_seq {
        if seq != w {
            return Err(VerifyFailure::StaleWrite {
                found: seq,
                wanted: w,
            });
        }
    }
    Ok(())
}

/// Per-unit record of the last completed write (0 = never written): a
/// dense array for regions up to [`DENSE_UNITS`] units, beyond that an
/// ordered map of the units written, like fio's `io_hist` tree, so a job
/// over a large device logs only what it wrote.
pub struct WriteLog {
    pub start: u64,
    pub unit: u64,
    units: u64,
    seqs: Seqs,
    next_seq: u64,
}

enum Seqs {
    Dense(Vec<u64>),
    Sparse(std::collections::BTreeMap<u64, u64>),
}

/// Regions of more units than this (8 bytes each: 256 MiB of log) keep a
/// sparse log.
const DENSE_UNITS: u64 = 1 << 25;

impl WriteLog {
    pub fn new(start: u64, len: u64, unit: u64) -> anyhow::Result<WriteLog> {
        let units = len / unit;
        let seqs = if units > DENSE_UNITS {
            Seqs::Sparse(Default::default())
        } else {
            Seqs::Dense(vec![0; units as usize])
        };
        Ok(WriteLog {
            start,
            unit,
            units,
            seqs,
            next_seq: 1,
        })
    }

    /// A fresh sequence number for a write about to be issued.
    #[inline]
    pub fn next_seq(&mut self) -> u64 {
        let s = self.next_seq;
        self.next_seq += 1;
        s
    }

    #[inline]
    pub fn index(&self, offset: u64) -> usize {
        ((offset - self.start) / self.unit) as usize
    }

    /// A write of `len` bytes at `offset` with `seq` completed (`seq` 0:
    /// the write failed, its units are no longer expected to hold anything).
    pub fn written(&mut self, offset: u64, len: u64, seq: u64) {
        let first = self.index(offset);
        let n = (len / self.unit) as usize;
        match &mut self.seqs {
            Seqs::Dense(v) => v[first..first + n].fill(seq),
            Seqs::Sparse(m) => {
                for i in first as u64..(first + n) as u64 {
                    if seq == 0 {
                        m.remove(&i);
                    } else {
                        m.insert(i, seq);
                    }
                }
            }
        }
    }

    pub fn seq_at(&self, idx: usize) -> u64 {
        match &self.seqs {
            Seqs::Dense(v) => v[idx],
            Seqs::Sparse(m) => m.get(&(idx as u64)).copied().unwrap_or(0),
        }
    }

    pub fn units(&self) -> usize {
        self.units as usize
    }

    /// The first written unit at or after `from`.
    fn next_written(&self, from: usize) -> Option<usize> {
        match &self.seqs {
            Seqs::Dense(v) => (from..v.len()).find(|&i| v[i] != 0),
            Seqs::Sparse(m) => m.range(from as u64..).next().map(|(&i, _)| i as usize),
        }
    }

    /// The next run of written units at or after `*cursor`, at most
    /// `max_units` long: `(offset, len)` to read back. Advances the cursor.
    pub fn next_run(&self, cursor: &mut usize, max_units: usize) -> Option<(u64, u64)> {
        let first = self.next_written(*cursor)?;
        *cursor = first;
        while *cursor < self.units() && self.seq_at(*cursor) != 0 && *cursor - first < max_units {
            *cursor += 1;
        }
        Some((
            self.start + first as u64 * self.unit,
            (*cursor - first) as u64 * self.unit,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filled_units_check_and_damage_is_caught() {
        let mut u = vec![0u8; 4096];
        fill_unit(&mut u, 8192, 7);
        assert_eq!(check_unit(&u, 8192, Some(7)), Ok(()));
        assert_eq!(check_unit(&u, 8192, None), Ok(()));
        assert!(matches!(
            check_unit(&u, 4096, Some(7)),
            Err(VerifyFailure::BadOffset { .. })
        ));
        assert!(matches!(
            check_unit(&u, 8192, Some(8)),
            Err(VerifyFailure::StaleWrite { .. })
        ));
        let mut bad = u.clone();
        bad[1000] ^= 1;
        assert!(matches!(
            check_unit(&bad, 8192, Some(7)),
            Err(VerifyFailure::BadCrc { .. })
        ));
        let zero = vec![0u8; 4096];
        assert!(matches!(
            check_unit(&zero, 8192, None),
            Err(VerifyFailure::BadMagic { found: 0 })
        ));
        let mut other = vec![0u8; 4096];
        fill_unit(&mut other, 8192, 8);
        assert_ne!(
            u[HEADER_LEN..],
            other[HEADER_LEN..],
            "each write has its own pattern"
        );
    }

    #[test]
    fn write_log_runs() {
        let mut log = WriteLog::new(4096, 10 * 4096, 4096).unwrap();
        let s1 = log.next_seq();
        log.written(4096, 8192, s1);
        let s2 = log.next_seq();
        log.written(4096 + 5 * 4096, 4096, s2);
        let mut c = 0;
        assert_eq!(log.next_run(&mut c, 16), Some((4096, 8192)));
        assert_eq!(log.next_run(&mut c, 16), Some((4096 + 5 * 4096, 4096)));
        assert_eq!(log.next_run(&mut c, 16), None);
        let mut c = 0;
        assert_eq!(log.next_run(&mut c, 1), Some((4096, 4096)));
        assert_eq!(log.seq_at(5), s2);
    }
}
