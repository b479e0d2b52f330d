//! Block checksums as persistent-data computes them
//! (`dm-block-manager.c` `dm_bm_checksum`): the kernel's `crc32c(~0, ..)`
//! (no final inversion) over the block after its checksum field, xored
//! with a salt per structure (a target's superblock brings its own).

use super::{le32, put32, FormatError, BLOCK_SIZE};

/// `dm-btree-spine.c` BTREE_CSUM_XOR.
pub const BTREE_XOR: u32 = 121107;
/// `dm-space-map-common.c` BITMAP_CSUM_XOR.
pub const BITMAP_XOR: u32 = 240779;
/// `dm-space-map-common.c` INDEX_CSUM_XOR.
pub const INDEX_XOR: u32 = 160478;

/// `dm_bm_checksum(data, len, xor)`: the crc32c crate finishes with an
/// inversion the kernel's `crc32c()` does not, so undo it.
pub fn checksum(data: &[u8], xor: u32) -> u32 {
    !crc32c::crc32c(data) ^ xor
}

/// Fill in the checksum of a block whose first four bytes hold it.
pub fn seal(block: &mut [u8], xor: u32) {
    let c = checksum(&block[4..BLOCK_SIZE], xor);
    put32(block, 0, c);
}

/// Check a block sealed by [`seal`].
pub fn verify(block: &[u8], xor: u32, what: &'static str, at: u64) -> Result<(), FormatError> {
    let want = checksum(&block[4..BLOCK_SIZE], xor);
    let found = le32(block, 0);
    if found != want {
        return Err(FormatError::Checksum {
            what,
            block: at,
            found,
            want,
        });
    }
    Ok(())
}

/// Check a sealed block read from `at` that records its own location at
/// byte 8 (every persistent-data block does), then its checksum.
pub fn check_block(b: &[u8], at: u64, xor: u32, what: &'static str) -> Result<(), FormatError> {
    let says = super::le64(b, 8);
    if says != at {
        return Err(FormatError::Location {
            what,
            block: at,
            says,
        });
    }
    verify(b, xor, what, at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_is_the_kernels_crc32c_without_final_inversion() {
        // crc32c("123456789") is 0xe3069283 with the final inversion.
        assert_eq!(checksum(b"123456789", 0), !0xe306_9283);
        assert_eq!(checksum(b"123456789", 5), !0xe306_9283 ^ 5);
        let mut b = vec![7u8; BLOCK_SIZE];
        seal(&mut b, BTREE_XOR);
        assert!(verify(&b, BTREE_XOR, "node", 0).is_ok());
        b[100] ^= 1;
        assert!(verify(&b, BTREE_XOR, "node", 0).is_err());
    }
}
