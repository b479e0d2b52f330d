//! dm-crypt's IV generators (kernel drivers/md/dm-crypt.c
//! `crypt_iv_*_gen`, and crypto/essiv.c for ESSIV): the 16-byte IV each
//! crypto sector is encrypted with, made from its IV sector number.
//!
//! `plain` is the sector's low 32 bits little-endian, `plain64` all 64
//! bits little-endian, `plain64be` big-endian in the IV's last 8 bytes,
//! `null` zero, and `essiv:sha256` the `plain64` IV encrypted with AES
//! under the SHA-256 of the volume key (crypto/essiv.c hashes the whole
//! key given to the skcipher). ESSIV over another hash is refused: the
//! salt must be an AES key, which only a 16- or 32-byte digest is, and
//! blkstack builds SHA-256 (cryptsetup's only ESSIV hash in practice).
//! `benbi`, `lmk`, `tcw`, `eboiv`, `elephant` and `random` (loop-AES,
//! TrueCrypt, BitLocker, dm-integrity) are refused as not built here.

use crate::error::TargetError;
use aes::cipher::{BlockEncrypt, KeyInit};
use aes::Aes256;
use sha2::{Digest, Sha256};

/// An IV mode as the cipher specification names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IvMode {
    /// No IV (ECB).
    None,
    /// `plain`: 32-bit little-endian sector.
    Plain,
    /// `plain64`: 64-bit little-endian sector.
    Plain64,
    /// `plain64be`: 64-bit big-endian sector at the IV's end.
    Plain64Be,
    /// `essiv:HASH`: the plain64 IV encrypted under HASH(key); the hash's
    /// name as given.
    Essiv(String),
    /// `null`: always zero.
    Null,
}

impl IvMode {
    /// The IV mode `mode` with options `opts` (kernel `crypt_ctr_ivmode`,
    /// then the mode's `ctr`).
    pub fn parse(mode: &str, opts: Option<&str>) -> Result<IvMode, TargetError> {
        Ok(match mode {
            "plain" => IvMode::Plain,
            "plain64" => IvMode::Plain64,
            "plain64be" => IvMode::Plain64Be,
            "null" => IvMode::Null,
            "essiv" => {
                let hash = opts.unwrap_or_default();
                if hash != "sha256" {
                    // ENOENT: the kernel fails to allocate essiv(..,HASH).
                    return Err(TargetError::Refused {
                        errno: crate::error::Refusal::NotFound,
                        why: format!(
                            "Error allocating crypto tfm: ESSIV hash '{hash}' is not built in \
                             blkstack (essiv:sha256 is)"
                        ),
                    });
                }
                IvMode::Essiv(hash.to_string())
            }
            "benbi" | "lmk" | "tcw" | "random" | "eboiv" | "elephant" => {
                return Err(TargetError::Invalid(format!(
                    "Error creating IV: IV mode '{mode}' is not built in blkstack \
                     (plain, plain64, plain64be, essiv:sha256 and null are)"
                )))
            }
            _ => return Err(TargetError::Invalid("Invalid IV mode".to_string())),
        })
    }
}

/// Makes IVs for one key.
pub struct IvGen {
    mode: IvMode,
    /// ESSIV's salt cipher: AES-256 keyed with SHA-256(volume key).
    essiv: Option<Aes256>,
}

impl IvGen {
    /// The generator for `mode` under volume key `key` (ESSIV's `init`
    /// hashes the key here).
    pub fn new(mode: IvMode, key: &[u8]) -> IvGen {
        let essiv = match mode {
            IvMode::Essiv(_) => {
                let salt = Sha256::digest(key);
                Some(Aes256::new(&salt))
            }
            _ => None,
        };
        IvGen { mode, essiv }
    }

    /// The IV of IV sector `sector`.
    pub fn iv(&self, sector: u64) -> [u8; 16] {
        let mut iv = [0u8; 16];
        match self.mode {
            IvMode::None | IvMode::Null => {}
            IvMode::Plain => iv[..4].copy_from_slice(&(sector as u32).to_le_bytes()),
            IvMode::Plain64 => iv[..8].copy_from_slice(&sector.to_le_bytes()),
            IvMode::Plain64Be => iv[8..].copy_from_slice(&sector.to_be_bytes()),
            IvMode::Essiv(_) => {
                iv[..8].copy_from_slice(&sector.to_le_bytes());
                if let Some(c) = &self.essiv {
                    c.encrypt_block((&mut iv).into());
                }
            }
        }
        iv
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_ivs() {
        let s = 0x1_2345_6789u64;
        let g = |m| IvGen::new(m, &[0; 32]).iv(s);
        assert_eq!(
            &g(IvMode::Plain)[..],
            &[0x89, 0x67, 0x45, 0x23, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            &g(IvMode::Plain64)[..9],
            &[0x89, 0x67, 0x45, 0x23, 1, 0, 0, 0, 0]
        );
        assert_eq!(
            &g(IvMode::Plain64Be)[7..],
            &[0, 0, 0, 0, 1, 0x23, 0x45, 0x67, 0x89]
        );
        assert_eq!(g(IvMode::Null), [0; 16]);
    }

    #[test]
    fn essiv_encrypts_the_plain64_iv_under_the_key_hash() {
        let key = [7u8; 16];
        let g = IvGen::new(IvMode::Essiv("sha256".into()), &key);
        let mut want = [0u8; 16];
        want[..8].copy_from_slice(&5u64.to_le_bytes());
        Aes256::new(&Sha256::digest(key)).encrypt_block((&mut want).into());
        assert_eq!(g.iv(5), want);
        assert_ne!(g.iv(5), g.iv(6));
    }
}
