//! fio's verify algorithms (`verify=crc32c|crc64|md5|sha1|sha256|sha512|
//! meta|pattern`) over blkstack's verify unit.
//!
//! Every mode but `pattern` starts a unit with the 32-byte header of
//! [`crate::verify`] (magic, length, offset, write number, type). For
//! `crc32c` the header's last word is the crc32c of header and data, as
//! before; for the other checksums it is a crc32c of the header alone and
//! the digest of the data follows the header, as fio's `verify_header`
//! is followed by a per-algorithm `vhdr_*` block. `meta` checks the header
//! only (fio's "meta" verifies offset, length and write number). `pattern`
//! writes `verify_pattern` over the whole unit and checks every byte, as
//! fio does without a header. The data after the header is
//! `verify_pattern` when one is given, else a pseudo-random fill seeded by
//! offset and write number, so stale or misplaced data cannot match.

use crate::spec::VerifyMode;
use crate::verify::{fill_unit, unit_header, write_header, VerifyFailure, HEADER_LEN};
use md5::Md5;
use sha1::Sha1;
use sha2::{Digest, Sha256, Sha512};

/// fio's crc64 is the ECMA-182 polynomial.
const CRC64: crc::Crc<u64> = crc::Crc::<u64>::new(&crc::CRC_64_ECMA_182);

/// Fills and checks units for one verify mode.
#[derive(Clone, Debug)]
pub struct Verifier {
    mode: VerifyMode,
    pattern: Vec<u8>,
}

impl Verifier {
    pub fn new(mode: VerifyMode, pattern: &[u8]) -> Verifier {
        Verifier {
            mode,
            pattern: pattern.to_vec(),
        }
    }

    /// Bytes of the digest that follows the header.
    fn digest_len(&self) -> usize {
        match self.mode {
            VerifyMode::Crc64 => 8,
            VerifyMode::Md5 => 16,
            VerifyMode::Sha1 => 20,
            VerifyMode::Sha256 => 32,
            VerifyMode::Sha512 => 64,
            _ => 0,
        }
    }

    /// The smallest unit this mode can fill.
    pub fn min_unit(&self) -> usize {
        match self.mode {
            VerifyMode::Pattern => self.pattern.len().max(1),
            _ => HEADER_LEN + self.digest_len(),
        }
    }

    fn digest(&self, data: &[u8], out: &mut [u8]) {
        match self.mode {
            VerifyMode::Crc64 => out.copy_from_slice(&CRC64.checksum(data).to_le_bytes()),
            VerifyMode::Md5 => out.copy_from_slice(&Md5::digest(data)),
            VerifyMode::Sha1 => out.copy_from_slice(&Sha1::digest(data)),
            VerifyMode::Sha256 => out.copy_from_slice(&Sha256::digest(data)),
            VerifyMode::Sha512 => out.copy_from_slice(&Sha512::digest(data)),
            _ => {}
        }
    }

    fn fill_pattern(&self, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = self.pattern[i % self.pattern.len()];
        }
    }

    /// Fill one unit of a write at `offset` with write number `seq`.
    pub fn fill(&self, unit: &mut [u8], offset: u64, seq: u64) {
        match self.mode {
            VerifyMode::None => {}
            VerifyMode::Pattern => self.fill_pattern(unit),
            VerifyMode::Crc32c if self.pattern.is_empty() => fill_unit(unit, offset, seq),
            _ => {
                let dl = self.digest_len();
                // The seeded fill first (it writes a crc32c header that
                // write_header replaces), then the pattern if given.
                fill_unit(unit, offset, seq);
                if !self.pattern.is_empty() {
                    let p = self.pattern.clone();
                    for (i, b) in unit[HEADER_LEN + dl..].iter_mut().enumerate() {
                        *b = p[i % p.len()];
                    }
                }
                let (head, rest) = unit.split_at_mut(HEADER_LEN + dl);
                self.digest(rest, &mut head[HEADER_LEN..]);
                let whole_crc = self.mode == VerifyMode::Crc32c;
                write_header(unit, offset, seq, self.mode as u32, whole_crc);
            }
        }
    }

    /// Check one unit read back from `offset`; `want_seq` as in
    /// [`crate::verify::check_unit`].
    pub fn check(
        &self,
        unit: &[u8],
        offset: u64,
        want_seq: Option<u64>,
    ) -> Result<(), VerifyFailure> {
        match self.mode {
            VerifyMode::None => Ok(()),
            VerifyMode::Pattern => {
                for (i, &b) in unit.iter().enumerate() {
                    let want = self.pattern[i % self.pattern.len()];
                    if b != want {
                        return Err(VerifyFailure::BadPattern {
                            at: i,
                            found: b,
                            wanted: want,
                        });
                    }
                }
                Ok(())
            }
            VerifyMode::Crc32c if self.pattern.is_empty() => {
                crate::verify::check_unit(unit, offset, want_seq)
            }
            _ => {
                let whole_crc = self.mode == VerifyMode::Crc32c;
                unit_header(unit, offset, want_seq, whole_crc)?;
                let dl = self.digest_len();
                if dl > 0 {
                    let mut d = [0u8; 64];
                    self.digest(&unit[HEADER_LEN + dl..], &mut d[..dl]);
                    if d[..dl] != unit[HEADER_LEN..HEADER_LEN + dl] {
                        return Err(VerifyFailure::BadDigest {
                            algo: self.mode.name(),
                        });
                    }
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_algorithm_catches_damage_and_misplacement() {
        for mode in [
            VerifyMode::Crc32c,
            VerifyMode::Crc64,
            VerifyMode::Md5,
            VerifyMode::Sha1,
            VerifyMode::Sha256,
            VerifyMode::Sha512,
            VerifyMode::Meta,
        ] {
            let v = Verifier::new(mode, &[]);
            let mut u = vec![0u8; 512];
            v.fill(&mut u, 4096, 7);
            v.check(&u, 4096, Some(7)).unwrap();
            assert!(v.check(&u, 8192, Some(7)).is_err(), "{mode:?} misplaced");
            assert!(v.check(&u, 4096, Some(8)).is_err(), "{mode:?} stale");
            if mode != VerifyMode::Meta {
                u[300] ^= 1;
                assert!(v.check(&u, 4096, Some(7)).is_err(), "{mode:?} damage");
            }
        }
        let v = Verifier::new(VerifyMode::Pattern, &[0xaa, 0x55, 0x5a, 0xa5]);
        let mut u = vec![0u8; 512];
        v.fill(&mut u, 0, 1);
        assert_eq!(&u[4..8], &[0xaa, 0x55, 0x5a, 0xa5]);
        v.check(&u, 0, None).unwrap();
        u[100] = 0;
        assert!(matches!(
            v.check(&u, 0, None),
            Err(VerifyFailure::BadPattern { at: 100, .. })
        ));
        let v = Verifier::new(VerifyMode::Md5, b"xy");
        let mut u = vec![0u8; 512];
        v.fill(&mut u, 0, 1);
        assert_eq!(&u[48..52], b"xyxy");
        v.check(&u, 0, Some(1)).unwrap();
    }
}
