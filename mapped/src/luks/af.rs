//! LUKS's anti-forensic splitter, merge side (cryptsetup lib/luks1/af.c
//! `AF_merge` and `diffuse`): a key is stored as `stripes` blocks whose
//! XOR, diffused by a hash after each block, gives it back, so erasing
//! any one block destroys the key. Written by hand: a dozen lines over
//! `sha2`/`sha1`, and no crate implements it.

use super::LuksError;
use sha1::Sha1;
use sha2::{Digest, Sha256, Sha512};

/// The hashes LUKS headers name for the splitter (and PBKDF2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hash {
    /// `sha1` (LUKS1's old default).
    Sha1,
    /// `sha256`.
    Sha256,
    /// `sha512`.
    Sha512,
}

impl Hash {
    /// The hash a header names, or why not.
    pub fn parse(name: &str) -> Result<Hash, LuksError> {
        match name.to_ascii_lowercase().as_str() {
            "sha1" => Ok(Hash::Sha1),
            "sha256" => Ok(Hash::Sha256),
            "sha512" => Ok(Hash::Sha512),
            _ => Err(LuksError::Unsupported(format!(
                "hash '{name}' (sha1, sha256 and sha512 are built)"
            ))),
        }
    }

    /// The name headers and luksDump use.
    pub fn name(self) -> &'static str {
        match self {
            Hash::Sha1 => "sha1",
            Hash::Sha256 => "sha256",
            Hash::Sha512 => "sha512",
        }
    }

    fn len(self) -> usize {
        match self {
            Hash::Sha1 => 20,
            Hash::Sha256 => 32,
            Hash::Sha512 => 64,
        }
    }

    /// hash(be32(iv) || data), as af.c's `hash_buf`.
    fn hash_buf(self, iv: u32, data: &[u8]) -> Vec<u8> {
        fn h<D: Digest>(iv: u32, data: &[u8]) -> Vec<u8> {
            let mut d = D::new();
            d.update(iv.to_be_bytes());
            d.update(data);
            d.finalize().to_vec()
        }
        match self {
            Hash::Sha1 => h::<Sha1>(iv, data),
            Hash::Sha256 => h::<Sha256>(iv, data),
            Hash::Sha512 => h::<Sha512>(iv, data),
        }
    }
}

/// af.c's `diffuse`, in place.
fn diffuse(buf: &mut [u8], hash: Hash) {
    let n = hash.len();
    for (i, chunk) in buf.chunks_mut(n).enumerate() {
        let d = hash.hash_buf(i as u32, chunk);
        let len = chunk.len();
        chunk.copy_from_slice(&d[..len]);
    }
}

/// Merge `stripes` blocks of `key_len` bytes from `src` into the key.
pub fn merge(src: &[u8], key_len: usize, stripes: usize, hash: Hash) -> Vec<u8> {
    debug_assert_eq!(src.len(), key_len * stripes);
    let mut acc = vec![0u8; key_len];
    for (i, block) in src.chunks_exact(key_len).enumerate() {
        acc.iter_mut().zip(block).for_each(|(a, b)| *a ^= b);
        if i + 1 < stripes {
            diffuse(&mut acc, hash);
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Split as af.c's `AF_split` does (random blocks but the last), then
    /// merge: the key comes back, and a changed block loses it.
    #[test]
    fn merge_undoes_split() {
        let key: Vec<u8> = (0..64u8).collect();
        let stripes = 7;
        let mut src = vec![0u8; key.len() * stripes];
        let mut acc = vec![0u8; key.len()];
        for i in 0..stripes - 1 {
            let block = &mut src[i * 64..(i + 1) * 64];
            block
                .iter_mut()
                .enumerate()
                .for_each(|(j, b)| *b = (i * 7 + j * 3) as u8);
            acc.iter_mut().zip(block.iter()).for_each(|(a, b)| *a ^= b);
            diffuse(&mut acc, Hash::Sha256);
        }
        let last: Vec<u8> = acc.iter().zip(&key).map(|(a, k)| a ^ k).collect();
        src[(stripes - 1) * 64..].copy_from_slice(&last);
        assert_eq!(merge(&src, 64, stripes, Hash::Sha256), key);
        src[5] ^= 1;
        assert_ne!(merge(&src, 64, stripes, Hash::Sha256), key);
    }
}
