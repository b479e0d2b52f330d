//! LUKS1 and LUKS2 headers, read and unlocked (cryptsetup's on-disk
//! formats: lib/luks1/luks.h and the LUKS2 specification, lib/luks2/).
//! A library concern, as DESIGN.md puts formats: the CLI only reads a
//! passphrase and hands the table this module builds to the registry.
//!
//! What is read: the binary header (LUKS1's `phdr`; LUKS2's two binary
//! headers, the one with a valid SHA-256 checksum and the higher sequence
//! id, and its JSON area), the keyslots (PBKDF2, argon2i, argon2id), the
//! anti-forensic stripes ([`af`]), the volume key digest, and the data
//! segment. Unlocking gives the volume key and a `crypt` table the kernel
//! would load for the same volume (cryptsetup's `dmsetup table
//! --showkeys`).
//!
//! Every field is bounded before use: sizes, offsets, stripes, KDF costs
//! and JSON length are checked against the format's limits and the image
//! size, so a hostile header gets a [`LuksError`] naming the field, never
//! a panic, a huge allocation or a read past the image.
//!
//! Formatting new volumes (luksFormat) and changing keyslots stays with
//! cryptsetup, which does both on an image file without root.

pub mod af;
pub mod fuzz;
mod luks1;
mod luks2;

use crate::targets::crypt::cipher::{self as ccipher, Keyed};
use af::Hash;
use std::fmt::Write as _;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use thiserror::Error;
use zeroize::Zeroizing;

/// The largest key a keyslot may hold (cryptsetup: 512 bytes).
const MAX_KEY: usize = 512;
/// The largest AF stripe count accepted (cryptsetup writes 4000).
const MAX_STRIPES: usize = 65536;
/// Largest keyslot material read (key size × stripes).
const MAX_MATERIAL: usize = 64 << 20;
/// argon2 memory cost ceiling in KiB (cryptsetup's 4 GiB).
const MAX_ARGON_MEMORY: u32 = 4 << 20;
/// argon2 time cost ceiling.
const MAX_ARGON_TIME: u32 = 1 << 16;
/// argon2 work ceiling, time cost × memory cost in KiB: 128 GiB of
/// memory passes, several times what cryptsetup's benchmark picks for a
/// 2 s unlock with 4 GiB, so only a hostile header meets it (it would
/// otherwise run for hours before the passphrase is known to be wrong).
const MAX_ARGON_WORK: u64 = 128 << 20;
/// PBKDF2 iteration ceiling (keyslots and the volume key digest): far
/// above what cryptsetup's benchmark picks for a 2 s unlock, far below a
/// header that would keep `luks open` busy for hours.
const MAX_PBKDF2_ITERATIONS: u32 = 1 << 25;
/// LUKS1's binary header (`struct luks_phdr`): key material and data
/// must start after it.
const LUKS1_PHDR: u64 = 592;
/// argon2 lanes ceiling (cryptsetup's parallel maximum).
const MAX_ARGON_CPUS: u32 = 4;

/// Why a LUKS image cannot be read or unlocked.
#[derive(Debug, Error)]
pub enum LuksError {
    /// Reading the image failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being read.
        what: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// Not a LUKS header at all.
    #[error("not a LUKS device (no LUKS magic at offset 0)")]
    NotLuks,
    /// A header field outside what the format allows.
    #[error("corrupt LUKS header: {0}")]
    Corrupt(String),
    /// A valid header using something blkstack has not built.
    #[error("unsupported LUKS volume: {0}")]
    Unsupported(String),
    /// No keyslot opens with this passphrase.
    #[error("no key available with this passphrase")]
    BadPassphrase,
}

fn corrupt(s: impl Into<String>) -> LuksError {
    LuksError::Corrupt(s.into())
}

/// How a keyslot's key is derived from the passphrase.
#[derive(Clone, Debug)]
pub enum Kdf {
    /// PBKDF2-HMAC.
    Pbkdf2 {
        /// Its hash.
        hash: Hash,
        /// Iterations.
        iterations: u32,
        /// Salt.
        salt: Vec<u8>,
    },
    /// argon2i or argon2id.
    Argon2 {
        /// `argon2i` or `argon2id`.
        id: bool,
        /// Time cost (passes).
        time: u32,
        /// Memory cost in KiB.
        memory: u32,
        /// Lanes.
        cpus: u32,
        /// Salt.
        salt: Vec<u8>,
    },
}

impl Kdf {
    fn derive(&self, pass: &[u8], out: &mut [u8]) -> Result<(), LuksError> {
        match self {
            Kdf::Pbkdf2 {
                hash,
                iterations,
                salt,
            } => pbkdf2(*hash, pass, salt, *iterations, out),
            Kdf::Argon2 {
                id,
                time,
                memory,
                cpus,
                salt,
            } => {
                use argon2::{Algorithm, Argon2, Params, Version};
                let params = Params::new(*memory, *time, *cpus, Some(out.len()))
                    .map_err(|e| corrupt(format!("argon2 parameters: {e}")))?;
                let alg = if *id {
                    Algorithm::Argon2id
                } else {
                    Algorithm::Argon2i
                };
                Argon2::new(alg, Version::V0x13, params)
                    .hash_password_into(pass, salt, out)
                    .map_err(|e| corrupt(format!("argon2: {e}")))?;
            }
        }
        Ok(())
    }
}

fn pbkdf2(hash: Hash, pass: &[u8], salt: &[u8], iterations: u32, out: &mut [u8]) {
    match hash {
        Hash::Sha1 => pbkdf2::pbkdf2_hmac::<sha1::Sha1>(pass, salt, iterations, out),
        Hash::Sha256 => pbkdf2::pbkdf2_hmac::<sha2::Sha256>(pass, salt, iterations, out),
        Hash::Sha512 => pbkdf2::pbkdf2_hmac::<sha2::Sha512>(pass, salt, iterations, out),
    }
}

/// One active keyslot.
#[derive(Clone, Debug)]
pub struct Keyslot {
    /// Its number.
    pub id: u32,
    /// The volume key size it holds, in bytes.
    pub key_size: usize,
    /// Passphrase to slot key.
    pub kdf: Kdf,
    /// AF stripes.
    pub stripes: usize,
    /// AF hash.
    pub af_hash: Hash,
    /// Key material offset in the image, bytes.
    pub area_offset: u64,
    /// Key material area size, bytes.
    pub area_size: u64,
    /// The cipher the material is encrypted with (`aes-xts-plain64`).
    pub encryption: String,
    /// The slot key's size (LUKS2 `area.key_size`; LUKS1: the volume key's).
    pub area_key_size: usize,
    /// LUKS2 priority (`normal` unless set).
    pub priority: String,
}

/// The volume key digest (LUKS1 `mkDigest`; LUKS2 `digests`).
#[derive(Clone, Debug)]
pub struct KeyDigest {
    /// PBKDF2 hash.
    pub hash: Hash,
    /// The hash's name as the header spells it.
    pub hash_name: String,
    /// Iterations.
    pub iterations: u32,
    /// Salt.
    pub salt: Vec<u8>,
    /// The digest itself.
    pub digest: Vec<u8>,
}

impl KeyDigest {
    fn matches(&self, key: &[u8]) -> bool {
        let mut out = Zeroizing::new(vec![0u8; self.digest.len()]);
        pbkdf2(self.hash, key, &self.salt, self.iterations, &mut out);
        *out == self.digest
    }
}

/// The encrypted data segment.
#[derive(Clone, Debug)]
pub struct Segment {
    /// Where the ciphertext starts in the image, bytes.
    pub offset: u64,
    /// Its length in bytes; `None` for the rest of the device.
    pub size: Option<u64>,
    /// Added to the IV sector (LUKS2 `iv_tweak`).
    pub iv_tweak: u64,
    /// dm-crypt cipher specification.
    pub encryption: String,
    /// Encryption sector size.
    pub sector_size: u32,
}

/// A parsed LUKS header.
#[derive(Clone, Debug)]
pub struct Header {
    /// 1 or 2.
    pub version: u16,
    /// The volume's UUID.
    pub uuid: String,
    /// LUKS2 label and subsystem (empty for LUKS1).
    pub label: String,
    /// LUKS2 subsystem.
    pub subsystem: String,
    /// LUKS2 sequence id (cryptsetup's "Epoch").
    pub epoch: u64,
    /// LUKS2 metadata (binary + JSON) size, bytes.
    pub hdr_size: u64,
    /// LUKS2 keyslots area size, bytes.
    pub keyslots_size: u64,
    /// Active keyslots.
    pub keyslots: Vec<Keyslot>,
    /// LUKS1: the 8 slot states, for the dump.
    pub luks1_slots: Vec<bool>,
    /// The volume key digest.
    pub digest: KeyDigest,
    /// The data segment.
    pub segment: Segment,
    /// The volume key size, bytes.
    pub key_size: usize,
}

/// An unlocked volume: its header and volume key.
pub struct Unlocked {
    /// The header.
    pub header: Header,
    /// The volume key.
    pub key: Zeroizing<Vec<u8>>,
    /// The keyslot that opened.
    pub slot: u32,
}

/// Where a LUKS header is read from: an image file, or an image held in
/// memory (the fuzz target and its regression test).
pub trait Image {
    /// The image's size in bytes.
    fn size(&self) -> u64;
    /// Fill `buf` from byte `off`; an error if that runs past the end.
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()>;
}

/// An image file and its size.
struct FileImage {
    file: File,
    size: u64,
}

impl Image for FileImage {
    fn size(&self) -> u64 {
        self.size
    }
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        self.file.read_exact_at(buf, off)
    }
}

impl FileImage {
    fn open(path: &Path) -> Result<FileImage, LuksError> {
        let file = File::open(path).map_err(|e| LuksError::Io {
            what: format!("opening {}", path.display()),
            source: e,
        })?;
        let size = file
            .metadata()
            .map_err(|e| LuksError::Io {
                what: format!("stat {}", path.display()),
                source: e,
            })?
            .len();
        Ok(FileImage { file, size })
    }
}

/// An image in memory: `bytes` at its start and zeros after them up to
/// `size` bytes, so a header's few KiB can stand for a whole volume.
pub struct MemImage<'a> {
    /// The image's first bytes.
    pub bytes: &'a [u8],
    /// The image's size (at least `bytes.len()`).
    pub size: u64,
}

impl Image for MemImage<'_> {
    fn size(&self) -> u64 {
        self.size.max(self.bytes.len() as u64)
    }
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        let end = off.checked_add(buf.len() as u64);
        if end.is_none_or(|e| e > self.size()) {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.fill(0);
        if let Ok(start) = usize::try_from(off) {
            if let Some(have) = self.bytes.get(start..) {
                let n = have.len().min(buf.len());
                buf[..n].copy_from_slice(&have[..n]);
            }
        }
        Ok(())
    }
}

fn read_at(f: &dyn Image, off: u64, len: usize, what: &str) -> Result<Vec<u8>, LuksError> {
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, off).map_err(|e| LuksError::Io {
        what: format!("reading {what} ({len} bytes at {off})"),
        source: e,
    })?;
    Ok(buf)
}

/// Read the header of the LUKS image at `path`.
pub fn read_header(path: &Path) -> Result<Header, LuksError> {
    parse_image(&FileImage::open(path)?)
}

/// Read and check the header of `img`.
pub fn parse_image(img: &dyn Image) -> Result<Header, LuksError> {
    let size = img.size();
    if size < 4096 {
        return Err(LuksError::NotLuks);
    }
    let first = read_at(img, 0, 4096, "the binary header")?;
    if first[..6] != *b"LUKS\xba\xbe" {
        return Err(LuksError::NotLuks);
    }
    let h = match u16::from_be_bytes([first[6], first[7]]) {
        1 => luks1::parse(&first)?,
        2 => luks2::parse(img, &first, size)?,
        v => return Err(LuksError::Unsupported(format!("LUKS version {v}"))),
    };
    check_bounds(&h, size)?;
    Ok(h)
}

/// The checks common to both versions: key sizes, stripes, areas inside
/// the image, KDF costs, the segment inside the image.
fn check_bounds(h: &Header, size: u64) -> Result<(), LuksError> {
    if h.key_size == 0 || h.key_size > MAX_KEY {
        return Err(corrupt(format!("volume key size {} bytes", h.key_size)));
    }
    check_segment(h, size)?;
    for s in &h.keyslots {
        check_keyslot(h, s, size)?;
    }
    if h.digest.iterations == 0 || h.digest.digest.is_empty() || h.digest.digest.len() > 64 {
        return Err(corrupt("volume key digest"));
    }
    if h.digest.iterations > MAX_PBKDF2_ITERATIONS {
        return Err(corrupt(format!(
            "volume key digest: {} PBKDF2 iterations (at most {MAX_PBKDF2_ITERATIONS} are run)",
            h.digest.iterations
        )));
    }
    Ok(())
}

/// Where the metadata ends: LUKS1's binary header, LUKS2's two header
/// copies and the keyslots area after them.
fn metadata_end(h: &Header) -> Result<u64, LuksError> {
    match h.version {
        1 => Ok(LUKS1_PHDR),
        _ => h
            .hdr_size
            .checked_mul(2)
            .and_then(|m| m.checked_add(h.keyslots_size))
            .ok_or_else(|| corrupt(format!("keyslots_size {}", h.keyslots_size))),
    }
}

fn check_segment(h: &Header, size: u64) -> Result<(), LuksError> {
    let seg = &h.segment;
    if !matches!(seg.sector_size, 512 | 1024 | 2048 | 4096) {
        return Err(corrupt(format!("segment sector size {}", seg.sector_size)));
    }
    if !seg.offset.is_multiple_of(512) || seg.offset >= size {
        return Err(corrupt(format!(
            "segment offset {} (image of {size} bytes)",
            seg.offset
        )));
    }
    let meta = metadata_end(h)?;
    if seg.offset < meta {
        return Err(corrupt(format!(
            "segment offset {} inside the metadata (which ends at {meta}; detached \
             headers are not supported)",
            seg.offset
        )));
    }
    if let Some(len) = seg.size {
        if seg.offset.checked_add(len).is_none_or(|e| e > size) {
            return Err(corrupt(format!(
                "segment {}+{len} past the image",
                seg.offset
            )));
        }
    }
    ccipher::parse(&seg.encryption)
        .map_err(|e| LuksError::Unsupported(format!("segment cipher: {e}")))?;
    Ok(())
}

/// A keyslot's sizes, its area inside the metadata (LUKS2's keyslots
/// area; LUKS1: after the header, before the data), and its KDF costs,
/// all checked before any key is derived.
fn check_keyslot(h: &Header, s: &Keyslot, size: u64) -> Result<(), LuksError> {
    let what = format!("keyslot {}", s.id);
    if s.stripes == 0 || s.stripes > MAX_STRIPES {
        return Err(corrupt(format!("{what}: {} AF stripes", s.stripes)));
    }
    if s.key_size != h.key_size {
        return Err(corrupt(format!(
            "{what}: key size {} (the volume key has {})",
            s.key_size, h.key_size
        )));
    }
    // Both are bounded by now (MAX_KEY × MAX_STRIPES fits in usize).
    let material = s.key_size * s.stripes;
    if material > MAX_MATERIAL {
        return Err(corrupt(format!("{what}: key material of {material} bytes")));
    }
    if s.area_key_size == 0 || s.area_key_size > MAX_KEY {
        return Err(corrupt(format!(
            "{what}: area key size {}",
            s.area_key_size
        )));
    }
    // The material is read in whole 512-byte sectors.
    let padded = material.div_ceil(512) as u64 * 512;
    let (lo, hi) = match h.version {
        1 => (LUKS1_PHDR, h.segment.offset),
        _ => (h.hdr_size * 2, metadata_end(h)?),
    };
    let end = s.area_offset.checked_add(s.area_size);
    if padded > s.area_size
        || s.area_offset < lo
        || end.is_none_or(|e| e > hi || e > size)
        || s.area_offset.checked_add(padded).is_none_or(|e| e > size)
    {
        return Err(corrupt(format!(
            "{what}: key material {}+{padded} outside its area {}+{} or outside the keyslots \
             area {lo}..{hi} or the image ({size} bytes)",
            s.area_offset, s.area_offset, s.area_size
        )));
    }
    check_kdf(&what, &s.kdf)
}

/// KDF costs are refused by name before anything runs: a hostile header
/// must not buy hours of CPU or gigabytes of memory.
fn check_kdf(what: &str, kdf: &Kdf) -> Result<(), LuksError> {
    match kdf {
        Kdf::Pbkdf2 { iterations, .. }
            if *iterations == 0 || *iterations > MAX_PBKDF2_ITERATIONS =>
        {
            Err(corrupt(format!(
                "{what}: {iterations} PBKDF2 iterations (1..={MAX_PBKDF2_ITERATIONS} are run)"
            )))
        }
        Kdf::Argon2 {
            time, memory, cpus, ..
        } if *time == 0
            || *time > MAX_ARGON_TIME
            || *memory < 8
            || *memory > MAX_ARGON_MEMORY
            || *cpus == 0
            || *cpus > MAX_ARGON_CPUS
            || u64::from(*time) * u64::from(*memory) > MAX_ARGON_WORK =>
        {
            Err(corrupt(format!(
                "{what}: argon2 cost time {time} memory {memory} KiB threads {cpus} (at most \
                 time {MAX_ARGON_TIME}, memory {MAX_ARGON_MEMORY} KiB, threads \
                 {MAX_ARGON_CPUS}, time × memory {MAX_ARGON_WORK} KiB are run)"
            )))
        }
        _ => Ok(()),
    }
}

/// Try every keyslot with `pass`; the first whose key passes the digest
/// opens the volume (cryptsetup's `LUKS_open_key_with_hdr`).
pub fn unlock(path: &Path, pass: &[u8]) -> Result<Unlocked, LuksError> {
    unlock_image(&FileImage::open(path)?, pass)
}

/// [`unlock`] of an image already open (or in memory).
pub fn unlock_image(img: &dyn Image, pass: &[u8]) -> Result<Unlocked, LuksError> {
    let header = parse_image(img)?;
    for s in &header.keyslots {
        if let Some(key) = try_slot(img, s, &header.digest, pass)? {
            return Ok(Unlocked {
                slot: s.id,
                header,
                key,
            });
        }
    }
    Err(LuksError::BadPassphrase)
}

fn try_slot(
    f: &dyn Image,
    s: &Keyslot,
    digest: &KeyDigest,
    pass: &[u8],
) -> Result<Option<Zeroizing<Vec<u8>>>, LuksError> {
    let spec = ccipher::parse(&s.encryption)
        .map_err(|e| LuksError::Unsupported(format!("keyslot {} cipher: {e}", s.id)))?;
    let mut slot_key = Zeroizing::new(vec![0u8; s.area_key_size]);
    s.kdf.derive(pass, &mut slot_key)?;
    let keyed = Keyed::new(&spec, &slot_key)
        .map_err(|e| LuksError::Unsupported(format!("keyslot {}: {e}", s.id)))?;
    let len = s.key_size * s.stripes;
    // The material is encrypted in 512-byte sectors from IV 0; the area
    // is whole sectors.
    let padded = len.div_ceil(512) * 512;
    let mut material = Zeroizing::new(read_at(f, s.area_offset, padded, "keyslot material")?);
    keyed.decrypt(&mut material, 512, 0, 1);
    let key = Zeroizing::new(af::merge(
        &material[..len],
        s.key_size,
        s.stripes,
        s.af_hash,
    ));
    Ok(digest.matches(&key).then_some(key))
}

impl Unlocked {
    /// The data segment's length in 512-byte sectors for an image of
    /// `image_size` bytes, whole encryption sectors.
    pub fn sectors(&self, image_size: u64) -> u64 {
        let seg = &self.header.segment;
        let len = seg.size.unwrap_or(image_size.saturating_sub(seg.offset));
        let len = len - len % seg.sector_size as u64;
        len / 512
    }

    /// The `crypt` table line (without start and length) cryptsetup
    /// would load over `dev`: the segment cipher, the key, IV offset,
    /// the segment offset, and `sector_size` when not 512.
    pub fn crypt_args(&self, dev: &str) -> String {
        let seg = &self.header.segment;
        let mut s = format!(
            "{} {} {} {dev} {}",
            seg.encryption,
            hex::encode(&*self.key),
            seg.iv_tweak,
            seg.offset / 512
        );
        if seg.sector_size != 512 {
            let _ = write!(s, " 1 sector_size:{}", seg.sector_size);
        }
        s
    }
}

/// Why a `NAME: --luks IMAGE KEY_FILE` stack line gives no devices.
#[derive(Debug, Error)]
pub enum StackLineError {
    /// Not two words after `--luks` (how many there were).
    #[error("expected 'NAME: --luks IMAGE KEY_FILE', got {0} word(s)")]
    Words(usize),
    /// The key file could not be read.
    #[error("key file {path}: {err}")]
    KeyFile {
        /// The key file as the line names it.
        path: String,
        /// The system's error.
        err: std::io::Error,
    },
    /// The image does not unlock with the key file.
    #[error("{}: {err}", image.display())]
    Unlock {
        /// The image as the line names it.
        image: PathBuf,
        /// Why it does not open.
        err: LuksError,
    },
    /// The image's size could not be read.
    #[error("{}: {err}", image.display())]
    ImageSize {
        /// The image as the line names it.
        image: PathBuf,
        /// The system's error.
        err: std::io::Error,
    },
}

/// The two devices a `NAME: --luks IMAGE KEY_FILE` stack line stands
/// for: `NAME_raw` (a `file` leaf over the image) and `NAME` (its crypt
/// table), as (name, table) pairs.
pub fn stack_lines(name: &str, args: &str) -> Result<Vec<(String, String)>, StackLineError> {
    let words: Vec<&str> = args.split_whitespace().collect();
    let [image, key_file] = words[..] else {
        return Err(StackLineError::Words(words.len()));
    };
    let pass =
        std::fs::read(key_file)
            .map(Zeroizing::new)
            .map_err(|err| StackLineError::KeyFile {
                path: key_file.to_string(),
                err,
            })?;
    let image = Path::new(image);
    let u = unlock(image, &pass).map_err(|err| StackLineError::Unlock {
        image: image.to_path_buf(),
        err,
    })?;
    let size = std::fs::metadata(image)
        .map_err(|err| StackLineError::ImageSize {
            image: image.to_path_buf(),
            err,
        })?
        .len();
    let raw = format!("{name}_raw");
    Ok(vec![
        (
            raw.clone(),
            format!("0 {} file {}", size / 512, image.display()),
        ),
        (
            name.to_string(),
            format!("0 {} crypt {}", u.sectors(size), u.crypt_args(&raw)),
        ),
    ])
}

/// Hex bytes, 16 per line, as cryptsetup's luksDump prints them; later
/// lines start with `indent`.
fn hex_lines(bytes: &[u8], indent: &str) -> String {
    let mut s = String::new();
    for (i, chunk) in bytes.chunks(16).enumerate() {
        if i > 0 {
            s.push('\n');
            s.push_str(indent);
        }
        for b in chunk {
            let _ = write!(s, "{b:02x} ");
        }
    }
    s
}

/// What `cryptsetup luksDump` prints for the fields blkstack reads.
pub fn dump(h: &Header) -> String {
    match h.version {
        1 => luks1::dump(h),
        _ => luks2::dump(h),
    }
}
