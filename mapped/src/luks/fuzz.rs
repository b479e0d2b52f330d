//! The `luks_header` fuzz entry point (fuzz/fuzz_targets/luks_header.rs,
//! and the stable replay in mapped/tests/luks_header.rs): a LUKS1 or
//! LUKS2 image from bytes through the header parser, the JSON, the
//! keyslot and segment checks, `luksDump`'s printer and, when the KDF
//! costs are tiny, an unlock attempt (keyslot material, AF merge, digest).
//!
//! Input: one flag byte, the image's size as 8 little-endian bytes, then
//! the image's first bytes ([`MemImage`]: zeros after them), so a few
//! KiB of header stand for a volume of any size. Flag bit 0 repairs the
//! LUKS2 header checksums first: random bytes almost never carry a valid
//! SHA-256, which would stop every mutation of the JSON at the checksum
//! gate (the gate itself stays fuzzed with the bit clear).

use super::{dump, parse_image, unlock_image, Header, Kdf, MemImage};
use sha2::{Digest, Sha256};

/// The passphrase the corpus images were made with (so a seed unlocks
/// and the fuzzer starts on the whole path).
pub const PASSPHRASE: &[u8] = b"correct horse";

/// How far into the input a header whose checksum is repaired may reach.
const REPAIR_LIMIT: usize = 1 << 20;

/// How far an input got.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Shorter than the flag byte and the size.
    TooShort,
    /// The parser refused it, with this message.
    Refused(String),
    /// The header parsed (and did not unlock, or was not tried).
    Parsed,
    /// It unlocked with [`PASSPHRASE`].
    Unlocked,
}

/// Parse the image the input stands for; then print it and, if cheap,
/// try to unlock it. Errors are the answer for hostile input; a panic, a
/// hang or a huge allocation is the bug.
pub fn luks_header(input: &[u8]) -> Outcome {
    if input.len() < 9 {
        return Outcome::TooShort;
    }
    let flags = input[0];
    let mut size = [0u8; 8];
    size.copy_from_slice(&input[1..9]);
    let size = u64::from_le_bytes(size);
    let mut bytes = input[9..].to_vec();
    if flags & 1 != 0 {
        repair_checksums(&mut bytes);
    }
    let img = MemImage {
        bytes: &bytes,
        size,
    };
    let h = match parse_image(&img) {
        Ok(h) => h,
        Err(e) => return Outcome::Refused(e.to_string()),
    };
    assert!(!dump(&h).is_empty(), "an empty luksDump");
    if cheap(&h) {
        if let Ok(u) = unlock_image(&img, PASSPHRASE) {
            assert_eq!(u.key.len(), h.key_size, "unlocked key of the wrong size");
            assert!(u.crypt_args("dev").contains(&h.segment.encryption));
            return Outcome::Unlocked;
        }
    }
    Outcome::Parsed
}

/// Every KDF tiny and the key material small: an unlock costs
/// milliseconds.
fn cheap(h: &Header) -> bool {
    h.digest.iterations <= 1000
        && h.keyslots.iter().all(|s| {
            s.key_size * s.stripes <= 1 << 20
                && match s.kdf {
                    Kdf::Pbkdf2 { iterations, .. } => iterations <= 1000,
                    Kdf::Argon2 { time, memory, .. } => time <= 4 && memory <= 64,
                }
        })
}

/// Give each LUKS2 binary header in `bytes` (at 0 and where the first
/// says the second is) the SHA-256 its contents have, extending `bytes`
/// with the zeros the image would read there.
pub fn repair_checksums(bytes: &mut Vec<u8>) {
    let be64 = |b: &[u8], o: usize| -> Option<u64> {
        Some(u64::from_be_bytes(b.get(o..o + 8)?.try_into().ok()?))
    };
    let Some(second) = be64(bytes, 8) else {
        return;
    };
    for off in [0u64, second] {
        let Ok(off) = usize::try_from(off) else {
            continue;
        };
        if off > REPAIR_LIMIT || bytes.len() < off + 16 {
            continue;
        }
        let Some(len) = be64(bytes, off + 8).and_then(|l| usize::try_from(l).ok()) else {
            continue;
        };
        if !(4096..=REPAIR_LIMIT).contains(&len) || off + len > REPAIR_LIMIT {
            continue;
        }
        if bytes.len() < off + len {
            bytes.resize(off + len, 0);
        }
        let hdr = &mut bytes[off..off + len];
        hdr[448..512].fill(0);
        let sum = Sha256::digest(&*hdr);
        hdr[448..480].copy_from_slice(&sum);
    }
}
