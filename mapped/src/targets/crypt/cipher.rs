//! dm-crypt's cipher specification and the sector ciphers behind it
//! (kernel drivers/md/dm-crypt.c `crypt_ctr_cipher_old`,
//! `crypt_ctr_cipher_new`, `crypt_ctr_ivmode`, `crypt_set_key`).
//!
//! Two spellings reach the same crypto API name, as in the kernel:
//! the legacy `cipher[:keycount]-chainmode-ivmode[:ivopts]`
//! (`aes-xts-plain64`, `aes-cbc-essiv:sha256`, `cipher_null-ecb`) and
//! `capi:API-ivmode[:ivopts]` (`capi:xts(aes)-plain64`). What blkstack
//! builds from the API name is `xts(aes)`, `cbc(aes)` (either under
//! `essiv(..,sha256)`) and `ecb(cipher_null)`; every other name the
//! kernel's crypto API might know is refused as not built here (the
//! kernel says "Error allocating crypto tfm" for names it lacks).
//!
//! The cryptography is RustCrypto's (`aes` with its AES-NI backend picked
//! at run time, `cbc`, `sha2`): nothing here is a cipher, only the
//! plumbing that picks one and feeds it a sector and its IV. XTS is the
//! one mode written here (xts.rs, over `aes`'s batched block API: the
//! `xts-mode` crate gives the same bytes one block at a time). Both
//! modes hand the cipher whole sectors through the batched calls
//! (`encrypt_blocks`, `decrypt_blocks_mut`), so AES-NI works on several
//! blocks at once wherever the mode allows it: XTS both ways, CBC when
//! decrypting (CBC encryption chains each block on the one before).

use super::iv::{IvGen, IvMode};
use super::xts::Xts;
use crate::error::TargetError;
use aes::cipher::consts::U16;
use aes::cipher::inout::InOutBuf;
use aes::cipher::{
    BlockCipher, BlockDecrypt, BlockDecryptMut, BlockEncrypt, BlockEncryptMut, BlockSizeUser,
    InnerIvInit, KeyInit,
};
use aes::{Aes128, Aes192, Aes256};

/// The kernel's `CRYPTO_MAX_ALG_NAME`: a longer API name is refused.
const CRYPTO_MAX_ALG_NAME: usize = 128;

/// The chaining modes built here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chain {
    /// XTS (IEEE 1619), the key holds two cipher keys.
    Xts,
    /// CBC, restarted at every sector with the sector's IV.
    Cbc,
    /// ECB: no IV (only with `cipher_null` here).
    Ecb,
}

/// The block ciphers built here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    /// AES with a 128, 192 or 256-bit key.
    Aes,
    /// The kernel's `cipher_null`: data passes unchanged, no key.
    Null,
}

/// A parsed cipher specification: what `crypt_ctr_cipher` sets up before
/// the key is known.
#[derive(Clone, Debug)]
pub struct CipherSpec {
    /// The text as given, which `table` prints back (`cc->cipher_string`).
    pub text: String,
    /// The block cipher.
    pub block: Block,
    /// Its chaining mode.
    pub chain: Chain,
    /// How each sector's IV is made ([`IvMode::None`] for ECB).
    pub iv: IvMode,
}

fn invalid(why: &str) -> TargetError {
    TargetError::Invalid(why.to_string())
}

/// ENOENT, as the kernel's crypto API answers a name it has no
/// algorithm for.
fn not_built(api: &str) -> TargetError {
    TargetError::Refused {
        errno: crate::error::Refusal::NotFound,
        why: format!(
            "Error allocating crypto tfm: cipher '{api}' is not built in blkstack \
             (xts(aes), cbc(aes), essiv(cbc(aes),sha256) and ecb(cipher_null) are)"
        ),
    }
}

/// Parse the first table argument (kernel `crypt_ctr_cipher` up to the
/// IV mode choice).
pub fn parse(text: &str) -> Result<CipherSpec, TargetError> {
    let (api, ivmode, ivopts) = match text.strip_prefix("capi:") {
        Some(rest) => split_capi(rest),
        None => split_old(text)?,
    };
    if api.len() >= CRYPTO_MAX_ALG_NAME {
        return Err(invalid("Cannot allocate cipher strings"));
    }
    if ivmode.as_deref() == Some("essiv") && ivopts.is_none() {
        return Err(invalid("Digest algorithm missing for ESSIV mode"));
    }
    let (block, chain) = match api.as_str() {
        "xts(aes)" => (Block::Aes, Chain::Xts),
        "cbc(aes)" => (Block::Aes, Chain::Cbc),
        "ecb(cipher_null)" => (Block::Null, Chain::Ecb),
        _ => return Err(not_built(&api)),
    };
    let iv = match (chain, ivmode.as_deref()) {
        // An ECB cipher has no IV: the kernel warns "Selected cipher does
        // not support IVs" and drops the mode.
        (Chain::Ecb, _) => IvMode::None,
        (_, None) => IvMode::None,
        (_, Some(m)) => IvMode::parse(m, ivopts.as_deref())?,
    };
    if let IvMode::Essiv(_) = iv {
        if chain != Chain::Cbc {
            return Err(not_built(&format!("essiv({api},sha256)")));
        }
    }
    Ok(CipherSpec {
        text: text.to_string(),
        block,
        chain,
        iv,
    })
}

/// `capi:API-ivmode:ivopts`: the IV options after the last ':', the IV
/// mode after the last '-' (kernel `crypt_ctr_cipher_new`).
fn split_capi(rest: &str) -> (String, Option<String>, Option<String>) {
    let (rest, ivopts) = match rest.rfind(':') {
        Some(i) => (&rest[..i], Some(rest[i + 1..].to_string())),
        None => (rest, None),
    };
    let (api, ivmode) = match rest.rfind('-') {
        Some(i) => (&rest[..i], Some(rest[i + 1..].to_string())),
        None => (rest, None),
    };
    (api.to_string(), ivmode, ivopts)
}

/// `cipher[:keycount]-chainmode-ivmode[:ivopts]` (kernel
/// `crypt_ctr_cipher_old`): `aes` alone means `aes-cbc-plain`.
type Split = (String, Option<String>, Option<String>);

fn split_old(text: &str) -> Result<Split, TargetError> {
    if text.contains('(') {
        return Err(invalid("Bad cipher specification"));
    }
    let mut parts = text.splitn(2, '-');
    let head = parts.next().unwrap_or("");
    let tail = parts.next();
    let (cipher, keycount) = match head.split_once(':') {
        Some((c, k)) => (c, Some(k)),
        None => (head, None),
    };
    if let Some(k) = keycount {
        let n: u32 = crate::target::parse_sscanf("key count", k)
            .map_err(|_| invalid("Bad cipher key count specification"))?;
        if !n.is_power_of_two() {
            return Err(invalid("Bad cipher key count specification"));
        }
        if n != 1 {
            return Err(invalid(
                "Bad cipher key count specification: multi-key ciphers (keycount > 1, \
                 loop-AES) are not built in blkstack",
            ));
        }
    }
    let (chain, rest) = match tail {
        Some(t) => match t.split_once('-') {
            Some((c, r)) => (Some(c), Some(r)),
            None => (Some(t), None),
        },
        None => (None, None),
    };
    let (mut ivmode, ivopts) = match rest {
        Some(r) => match r.split_once(':') {
            Some((m, o)) => (Some(m.to_string()), Some(o.to_string())),
            None => (Some(r.to_string()), None),
        },
        None => (None, None),
    };
    let chain = match chain {
        None => {
            ivmode = Some("plain".into());
            "cbc"
        }
        Some("plain") if ivmode.is_none() => {
            ivmode = Some("plain".into());
            "cbc"
        }
        Some(c) => c,
    };
    if chain != "ecb" && ivmode.is_none() {
        return Err(invalid("IV mechanism required"));
    }
    Ok((format!("{chain}({cipher})"), ivmode, ivopts))
}

/// Encrypts or decrypts one crypto sector in place, given its IV: the
/// chaining mode over a block cipher with its key set.
pub trait SectorCipher: Send + Sync {
    /// Encrypt `data` (one crypto sector) in place.
    fn encrypt(&self, data: &mut [u8], iv: &[u8; 16]);
    /// Decrypt `data` (one crypto sector) in place.
    fn decrypt(&self, data: &mut [u8], iv: &[u8; 16]);
}

struct NullCipher;

impl SectorCipher for NullCipher {
    fn encrypt(&self, _data: &mut [u8], _iv: &[u8; 16]) {}
    fn decrypt(&self, _data: &mut [u8], _iv: &[u8; 16]) {}
}

impl<C> SectorCipher for Xts<C>
where
    C: BlockEncrypt + BlockDecrypt + BlockCipher + BlockSizeUser<BlockSize = U16> + Send + Sync,
{
    fn encrypt(&self, data: &mut [u8], iv: &[u8; 16]) {
        self.encrypt_sector(data, iv);
    }
    fn decrypt(&self, data: &mut [u8], iv: &[u8; 16]) {
        self.decrypt_sector(data, iv);
    }
}

/// CBC over one sector; the expanded key is kept and cloned into a
/// chaining state per sector (a copy, no key expansion).
struct Cbc<C>(C);

impl<C> SectorCipher for Cbc<C>
where
    C: BlockEncryptMut + BlockDecryptMut + BlockCipher + Clone + Send + Sync,
    C: aes::cipher::BlockSizeUser<BlockSize = aes::cipher::consts::U16>,
{
    fn encrypt(&self, data: &mut [u8], iv: &[u8; 16]) {
        let mut enc = cbc::Encryptor::<C>::inner_iv_init(self.0.clone(), iv.into());
        let (mut blocks, _) = InOutBuf::from(data).into_chunks::<U16>();
        enc.encrypt_blocks_mut(blocks.get_out());
    }
    /// One batched call: `cbc`'s decryptor hands the cipher several
    /// blocks at once (each block's plaintext needs only its own and the
    /// previous ciphertext).
    fn decrypt(&self, data: &mut [u8], iv: &[u8; 16]) {
        let mut dec = cbc::Decryptor::<C>::inner_iv_init(self.0.clone(), iv.into());
        let (mut blocks, _) = InOutBuf::from(data).into_chunks::<U16>();
        dec.decrypt_blocks_mut(blocks.get_out());
    }
}

/// Why a key does not fit the cipher (the kernel's `crypto_skcipher_setkey`
/// returning -EINVAL, reported as "Error decoding and setting key").
fn bad_key(spec: &CipherSpec, len: usize) -> TargetError {
    let want = match (spec.block, spec.chain) {
        (Block::Null, _) => "none ('-')",
        (Block::Aes, Chain::Xts) => "32, 48 or 64 bytes (64, 96 or 128 hex digits)",
        (Block::Aes, _) => "16, 24 or 32 bytes (32, 48 or 64 hex digits)",
    };
    TargetError::Invalid(format!(
        "Error decoding and setting key: a {len}-byte key does not fit {}: it takes {want}",
        spec.text
    ))
}

/// The sector cipher for `spec` with `key` set (kernel `crypt_setkey`).
pub fn keyed(spec: &CipherSpec, key: &[u8]) -> Result<Box<dyn SectorCipher>, TargetError> {
    let b: Box<dyn SectorCipher> = match (spec.block, spec.chain) {
        (Block::Null, _) if key.is_empty() => Box::new(NullCipher),
        (Block::Aes, Chain::Xts) => {
            let h = key.len() / 2;
            let (k1, k2) = key.split_at(h);
            match key.len() {
                32 => Box::new(Xts::new(new::<Aes128>(k1), new::<Aes128>(k2))),
                48 => Box::new(Xts::new(new::<Aes192>(k1), new::<Aes192>(k2))),
                64 => Box::new(Xts::new(new::<Aes256>(k1), new::<Aes256>(k2))),
                n => return Err(bad_key(spec, n)),
            }
        }
        (Block::Aes, Chain::Cbc) => match key.len() {
            16 => Box::new(Cbc(new::<Aes128>(key))),
            24 => Box::new(Cbc(new::<Aes192>(key))),
            32 => Box::new(Cbc(new::<Aes256>(key))),
            n => return Err(bad_key(spec, n)),
        },
        _ => return Err(bad_key(spec, key.len())),
    };
    Ok(b)
}

/// A block cipher from a key whose length the caller has matched to it.
fn new<C: KeyInit>(key: &[u8]) -> C {
    C::new_from_slice(key).expect("key length matched to the cipher by the caller")
}

/// The cipher and IV generator of one key: what a crypt target holds
/// while its key is valid (`DM_CRYPT_KEY_VALID`).
pub struct Keyed {
    /// The chaining mode with the key set.
    pub cipher: Box<dyn SectorCipher>,
    /// The IV generator (with ESSIV's salt cipher).
    pub iv: IvGen,
}

impl Keyed {
    /// Set up `spec` with `key` (kernel `crypt_set_key` then the IV's
    /// `init`).
    pub fn new(spec: &CipherSpec, key: &[u8]) -> Result<Keyed, TargetError> {
        Ok(Keyed {
            cipher: keyed(spec, key)?,
            iv: IvGen::new(spec.iv.clone(), key),
        })
    }

    /// Encrypt `data` (whole crypto sectors of `sector_size` bytes) in
    /// place; the first is IV sector `iv_sector`, and each next one
    /// `step` further.
    pub fn encrypt(&self, data: &mut [u8], sector_size: usize, iv_sector: u64, step: u64) {
        for (i, s) in data.chunks_exact_mut(sector_size).enumerate() {
            let iv = self.iv.iv(iv_sector.wrapping_add(i as u64 * step));
            self.cipher.encrypt(s, &iv);
        }
    }

    /// Decrypt, as [`Keyed::encrypt`] encrypts.
    pub fn decrypt(&self, data: &mut [u8], sector_size: usize, iv_sector: u64, step: u64) {
        for (i, s) in data.chunks_exact_mut(sector_size).enumerate() {
            let iv = self.iv.iv(iv_sector.wrapping_add(i as u64 * step));
            self.cipher.decrypt(s, &iv);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn spellings_reach_the_same_cipher() {
        for (a, b) in [
            ("aes-xts-plain64", "capi:xts(aes)-plain64"),
            ("aes-cbc-essiv:sha256", "capi:cbc(aes)-essiv:sha256"),
            ("aes-xts-plain", "capi:xts(aes)-plain"),
            ("aes-cbc-plain64be", "capi:cbc(aes)-plain64be"),
            ("aes", "aes-cbc-plain"),
            ("aes-plain", "aes-cbc-plain"),
            ("cipher_null-ecb", "capi:ecb(cipher_null)"),
        ] {
            let (x, y) = (parse(a).unwrap(), parse(b).unwrap());
            assert_eq!(
                (x.block, x.chain, x.iv),
                (y.block, y.chain, y.iv),
                "{a} vs {b}"
            );
        }
        assert_eq!(parse("cipher_null-ecb-plain").unwrap().iv, IvMode::None);
    }

    #[test]
    fn refusals_name_the_kernel_error() {
        assert!(err("aes(x)-cbc-plain").contains("Bad cipher specification"));
        assert!(err("aes-cbc").contains("IV mechanism required"));
        assert!(err("aes-cbc-essiv").contains("Digest algorithm missing"));
        assert!(err("aes-cbc-foo").contains("Invalid IV mode"));
        assert!(err("aes:3-cbc-plain").contains("Bad cipher key count"));
        assert!(err("aes:x-cbc-plain").contains("Bad cipher key count"));
        assert!(err("twofish-xts-plain64").contains("Error allocating crypto tfm"));
        assert!(err("aes-xts-essiv:sha256").contains("Error allocating crypto tfm"));
        assert!(err("aes-cbc-essiv:sha1").contains("Error allocating crypto tfm"));
    }

    #[test]
    fn key_sizes() {
        let s = parse("aes-xts-plain64").unwrap();
        for n in [32, 48, 64] {
            assert!(keyed(&s, &vec![1; n]).is_ok(), "{n}");
        }
        for n in [0, 16, 31, 33, 128] {
            assert!(keyed(&s, &vec![1; n]).is_err(), "{n}");
        }
        let s = parse("aes-cbc-plain").unwrap();
        assert!(keyed(&s, &[1; 24]).is_ok());
        assert!(keyed(&s, &[1; 20]).is_err());
        let s = parse("cipher_null-ecb").unwrap();
        assert!(keyed(&s, &[]).is_ok());
        assert!(keyed(&s, &[1; 16]).is_err());
    }

    fn xts_kat(key: &str, sector: u64, pt: &[u8], ct: &str) {
        let key = hex::decode(key).unwrap();
        let k = Keyed::new(&parse("aes-xts-plain64").unwrap(), &key).unwrap();
        let mut data = pt.to_vec();
        k.encrypt(&mut data, pt.len(), sector, 1);
        assert_eq!(hex::encode(&data), ct);
        k.decrypt(&mut data, pt.len(), sector, 1);
        assert_eq!(data, pt);
    }

    /// IEEE 1619-2007 XTS-AES-128 vectors 1, 2 and 4 through
    /// `aes-xts-plain64` (the data unit number is the IV sector).
    #[test]
    fn ieee1619_vectors() {
        xts_kat(
            &"00".repeat(32),
            0,
            &[0; 32],
            "917cf69ebd68b2ec9b9fe9a3eadda692cd43d2f59598ed858c02c2652fbf922e",
        );
        xts_kat(
            &("11".repeat(16) + &"22".repeat(16)),
            0x3333333333,
            &[0x44; 32],
            "c454185e6a16936e39334038acef838bfb186fff7480adc4289382ecd6d394f0",
        );
        let key = "2718281828459045235360287471352631415926535897932384626433832795";
        let pt: Vec<u8> = (0..512).map(|i| i as u8).collect();
        let k = Keyed::new(
            &parse("aes-xts-plain64").unwrap(),
            &hex::decode(key).unwrap(),
        )
        .unwrap();
        let mut data = pt.clone();
        k.encrypt(&mut data, 512, 0, 1);
        assert_eq!(
            hex::encode(&data[..32]),
            "27a7479befa1d476489f308cd4cfa6e2a96e4bbe3208ff25287dd3819616e89c"
        );
    }

    /// CBC decryption in one batched call gives what decrypting block by
    /// block gives (`c[i-1] ^ D(c[i])`), for every key size.
    #[test]
    fn cbc_batched_decrypt_matches_block_by_block() {
        use aes::cipher::BlockDecrypt;
        for klen in [16usize, 24, 32] {
            let key: Vec<u8> = (0..klen as u8).collect();
            let k = Keyed::new(&parse("aes-cbc-plain64").unwrap(), &key).unwrap();
            let ct: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
            let mut ours = ct.clone();
            k.decrypt(&mut ours, 4096, 9, 1);
            let mut prev = k.iv.iv(9);
            let one = |b: &mut [u8]| match klen {
                16 => new::<Aes128>(&key).decrypt_block(b.into()),
                24 => new::<Aes192>(&key).decrypt_block(b.into()),
                _ => new::<Aes256>(&key).decrypt_block(b.into()),
            };
            let mut want = ct.clone();
            for (i, b) in want.chunks_exact_mut(16).enumerate() {
                one(b);
                for (x, p) in b.iter_mut().zip(prev) {
                    *x ^= p;
                }
                prev.copy_from_slice(&ct[i * 16..i * 16 + 16]);
            }
            assert_eq!(ours, want, "{klen}-byte key");
            k.encrypt(&mut ours, 4096, 9, 1);
            assert_eq!(ours, ct, "{klen}-byte key: encryption is not the inverse");
        }
    }
}
