//! XTS (IEEE 1619, the kernel's crypto/xts.c as dm-crypt's `xts(aes)`
//! uses it) over a block cipher's batched API.
//!
//! This is a chaining mode, not a cipher: the block cipher is RustCrypto's
//! `aes` (AES-NI picked at run time), called through
//! `encrypt_blocks`/`decrypt_blocks`, which let its backend work on
//! several blocks at once (eight in flight with AES-NI). The `xts-mode`
//! crate gives the same bytes but calls the cipher one 16-byte block at
//! a time, which leaves AES-NI's pipeline mostly idle; that is why the
//! mode is written here, over the well-kept cipher crate, rather than
//! taken from `xts-mode`. Equality with `xts-mode` (random keys, sector
//! sizes, IVs, the three AES key sizes) is a proptest below; the kernel VM
//! test (frontends/cli/tests/kernel_crypt.rs) shows the ciphertext is
//! the kernel's, byte for byte.
//!
//! Ciphertext stealing is not built: dm-crypt's sectors are 512..=4096
//! bytes, whole blocks, and the crypt target only hands whole sectors in.

use aes::cipher::consts::U16;
use aes::cipher::generic_array::GenericArray;
use aes::cipher::inout::InOutBuf;
use aes::cipher::{BlockCipher, BlockDecrypt, BlockEncrypt, BlockSizeUser};

/// Blocks whose tweaks are kept at once: the cipher sees this many per
/// call (a multiple of every backend's parallel width), and the tweaks
/// fit in a small stack array.
const BATCH: usize = 32;

/// One AES block.
type Block = GenericArray<u8, U16>;

/// XTS with its two keys set: `data` encrypts the blocks, `tweak` the
/// sector's IV into the first tweak.
pub struct Xts<C> {
    data: C,
    tweak: C,
}

impl<C> Xts<C>
where
    C: BlockEncrypt + BlockDecrypt + BlockCipher + BlockSizeUser<BlockSize = U16>,
{
    /// XTS from its data key's cipher and its tweak key's cipher (the
    /// first and second halves of a dm-crypt `xts(aes)` key).
    pub fn new(data: C, tweak: C) -> Xts<C> {
        Xts { data, tweak }
    }

    /// Encrypt `sector` (whole 16-byte blocks) in place under `iv`.
    pub fn encrypt_sector(&self, sector: &mut [u8], iv: &[u8; 16]) {
        self.run(sector, iv, true);
    }

    /// Decrypt `sector` (whole 16-byte blocks) in place under `iv`.
    pub fn decrypt_sector(&self, sector: &mut [u8], iv: &[u8; 16]) {
        self.run(sector, iv, false);
    }

    fn run(&self, sector: &mut [u8], iv: &[u8; 16], encrypt: bool) {
        debug_assert_eq!(sector.len() % 16, 0, "XTS sectors are whole blocks here");
        let mut t = Block::clone_from_slice(iv);
        self.tweak.encrypt_block(&mut t);
        let mut t = u128::from_le_bytes(t.into());
        let (mut blocks, _) = InOutBuf::from(sector).into_chunks::<U16>();
        for chunk in blocks.get_out().chunks_mut(BATCH) {
            let mut tweaks = [0u128; BATCH];
            for (b, slot) in chunk.iter_mut().zip(tweaks.iter_mut()) {
                *slot = t;
                xor(b, t);
                t = mul_x(t);
            }
            if encrypt {
                self.data.encrypt_blocks(chunk);
            } else {
                self.data.decrypt_blocks(chunk);
            }
            for (b, t) in chunk.iter_mut().zip(tweaks.iter()) {
                xor(b, *t);
            }
        }
    }
}

/// The tweak times x in GF(2^128), little-endian as IEEE 1619 and the
/// kernel's `gf128mul_x_ble` hold it: shift left one bit, and fold the
/// bit shifted out back in with the polynomial x^7 + x^2 + x + 1.
fn mul_x(t: u128) -> u128 {
    (t << 1) ^ ((t >> 127) * 0x87)
}

fn xor(b: &mut Block, t: u128) {
    let v = u128::from_le_bytes((*b).into()) ^ t;
    b.copy_from_slice(&v.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use aes::cipher::KeyInit;
    use aes::{Aes128, Aes192, Aes256};
    use proptest::prelude::*;
    use xts_mode::Xts128;

    fn check<C>(key: &[u8], len: usize, iv: [u8; 16], data: &[u8])
    where
        C: BlockEncrypt + BlockDecrypt + BlockCipher + BlockSizeUser<BlockSize = U16> + KeyInit,
    {
        let (k1, k2) = key.split_at(key.len() / 2);
        let ours = Xts::new(
            C::new_from_slice(k1).unwrap(),
            C::new_from_slice(k2).unwrap(),
        );
        let theirs = Xts128::new(
            C::new_from_slice(k1).unwrap(),
            C::new_from_slice(k2).unwrap(),
        );
        let mut a = data[..len].to_vec();
        let mut b = a.clone();
        ours.encrypt_sector(&mut a, &iv);
        theirs.encrypt_sector(&mut b, iv);
        assert_eq!(a, b, "ciphertext differs from xts-mode's");
        ours.decrypt_sector(&mut a, &iv);
        assert_eq!(
            a,
            &data[..len],
            "decryption does not give the plaintext back"
        );
        // Decrypting arbitrary bytes must match too (the read path).
        let mut a = data[..len].to_vec();
        let mut b = a.clone();
        ours.decrypt_sector(&mut a, &iv);
        theirs.decrypt_sector(&mut b, iv);
        assert_eq!(a, b, "decryption differs from xts-mode's");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        #[test]
        fn same_bytes_as_xts_mode(
            key in proptest::collection::vec(any::<u8>(), 64),
            shift in 0u32..=3,
            blocks_more in 0usize..=3,
            iv in any::<[u8; 16]>(),
            data in proptest::collection::vec(any::<u8>(), 4096 + 48),
            aes_bits in 0usize..3,
        ) {
            // dm-crypt's sector sizes, plus a few lengths that are not a
            // multiple of the batch, so the partial last batch is covered.
            let len = (512usize << shift) + 16 * blocks_more;
            match aes_bits {
                0 => check::<Aes128>(&key[..32], len, iv, &data),
                1 => check::<Aes192>(&key[..48], len, iv, &data),
                _ => check::<Aes256>(&key, len, iv, &data),
            }
        }
    }

    #[test]
    fn mul_x_carries_into_the_polynomial() {
        assert_eq!(mul_x(1), 2);
        assert_eq!(mul_x(1 << 63), 1 << 64);
        assert_eq!(mul_x(1 << 127), 0x87);
    }
}
