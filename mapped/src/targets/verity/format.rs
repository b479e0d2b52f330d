//! Building and checking a dm-verity hash tree on a hash device, and the
//! 512-byte superblock veritysetup writes in front of it, so that
//! `blkstack verity format` makes what `veritysetup format` makes (the
//! same tree, byte for byte, for the same parameters and salt) and
//! `blkstack verity verify` checks what either made.
//!
//! Follows cryptsetup's lib/verity/verity_hash.c (`create_or_verify`,
//! `VERITY_create_or_verify_hash`: each level hashed from the one below,
//! the top level first on the device, digests padded with zeroes to a
//! power of two in version 1 and the rest of each hash block zeroed) and
//! lib/verity/verity.c (`struct verity_sb`, `VERITY_read_sb`,
//! `VERITY_write_sb`, `VERITY_hash_offset_block`). Written by hand: no
//! crate builds dm-verity trees.

use super::tree::{Geometry, GeometryError, HashAlg, Hasher};
use std::io;

/// Bytes of veritysetup's superblock (`struct verity_sb`).
pub const SB_SIZE: usize = 512;
const SB_SIGNATURE: &[u8; 8] = b"verity\0\0";
/// The largest salt the superblock holds.
pub const MAX_SALT: usize = 256;
/// Bytes read from the data or lower level at a time while building.
const CHUNK: usize = 1 << 20;
/// The largest byte offset a tree may reach (2^62: room for the tree
/// after the data without overflow).
const MAX_OFFSET: u64 = 1 << 62;

/// Reads and writes at byte offsets: a file, a block device, or a
/// blkstack device in tests.
pub trait BlockIo {
    /// Fill `buf` from `off`.
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()>;
    /// Write all of `buf` at `off`.
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()>;
}

impl BlockIo for std::fs::File {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(self, buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(self, buf, off)
    }
}

/// What is wrong with a superblock, a parameter or a tree.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// Reading or writing a device failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// A parameter veritysetup would refuse.
    #[error("{0}")]
    Param(String),
    /// The tree's layout is impossible.
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    /// No superblock at the hash offset.
    #[error("no verity superblock at hash offset {0} (signature missing)")]
    NoSuperblock(u64),
    /// A superblock field out of what veritysetup writes.
    #[error("verity superblock: {0}")]
    BadSuperblock(String),
    /// A digest on the hash device is not the one its blocks give.
    #[error("Verification failed at position {0}.")]
    Mismatch(u64),
    /// A hash block's spare area is not zeroes.
    #[error("Spare area is not zeroed at position {0}.")]
    Spare(u64),
    /// The root digest is not the one given.
    #[error("Verification of root hash failed.")]
    Root,
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> FormatError {
    let what = what.into();
    move |source| FormatError::Io { what, source }
}

/// The parameters of one tree (cryptsetup's `struct crypt_params_verity`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Params {
    /// Format version (hash type): 0 or 1.
    pub version: u32,
    /// The digest.
    pub alg: HashAlg,
    /// Bytes per data block.
    pub data_block_size: u32,
    /// Bytes per hash block.
    pub hash_block_size: u32,
    /// Data blocks covered.
    pub data_blocks: u64,
    /// Byte offset of the superblock (or, without one, of the tree) on the
    /// hash device.
    pub hash_offset: u64,
    /// The salt (empty for none).
    pub salt: Vec<u8>,
    /// The superblock's UUID, `None` without a superblock.
    pub uuid: Option<[u8; 16]>,
}

impl Params {
    /// Check the sizes veritysetup checks (`VERITY_create`,
    /// `crypt_format`'s verity checks).
    pub fn check(&self) -> Result<(), FormatError> {
        let ok_size = |s: u32| s.is_power_of_two() && (512..=512 * 1024).contains(&s);
        if !ok_size(self.data_block_size) || !ok_size(self.hash_block_size) {
            return Err(FormatError::Param(format!(
                "Invalid block size (data {}, hash {}): a power of two from 512 to 524288",
                self.data_block_size, self.hash_block_size
            )));
        }
        if self.version > 1 {
            return Err(FormatError::Param(format!(
                "Unsupported VERITY hash type {}.",
                self.version
            )));
        }
        if self.salt.len() > MAX_SALT {
            return Err(FormatError::Param(format!(
                "Salt of {} bytes is longer than {MAX_SALT}",
                self.salt.len()
            )));
        }
        if self.hash_offset > MAX_OFFSET {
            return Err(FormatError::Param(format!(
                "hash offset {} is past {MAX_OFFSET}",
                self.hash_offset
            )));
        }
        if self
            .data_blocks
            .checked_mul(u64::from(self.data_block_size))
            .is_none_or(|b| b > MAX_OFFSET)
        {
            return Err(FormatError::Param(format!(
                "{} data blocks of {} bytes is past {MAX_OFFSET} bytes",
                self.data_blocks, self.data_block_size
            )));
        }
        if self.uuid.is_some() && !self.hash_offset.is_multiple_of(512) {
            return Err(FormatError::Param(
                "Unsupported VERITY hash offset: not a multiple of 512".into(),
            ));
        }
        if self.uuid.is_none()
            && !self
                .hash_offset
                .is_multiple_of(u64::from(self.hash_block_size))
        {
            return Err(FormatError::Param(
                "Unsupported VERITY hash offset: not a multiple of the hash block size".into(),
            ));
        }
        Ok(())
    }

    /// The tree's first hash block: after the superblock when there is
    /// one (veritysetup's `VERITY_hash_offset_block`). This is the
    /// table's `HASH_START`.
    pub fn hash_start(&self) -> u64 {
        let bs = u64::from(self.hash_block_size);
        match self.uuid {
            None => self.hash_offset / bs,
            Some(_) => (self.hash_offset + SB_SIZE as u64).div_ceil(bs),
        }
    }

    /// The tree's layout.
    pub fn geometry(&self) -> Result<Geometry, FormatError> {
        Ok(Geometry::new(
            self.version,
            self.data_block_size,
            self.hash_block_size,
            self.data_blocks,
            self.hash_start(),
            self.alg.digest_size(),
        )?)
    }

    /// The 512-byte superblock (`struct verity_sb`, little-endian).
    pub fn superblock(&self) -> [u8; SB_SIZE] {
        let mut b = [0u8; SB_SIZE];
        b[0..8].copy_from_slice(SB_SIGNATURE);
        b[8..12].copy_from_slice(&1u32.to_le_bytes());
        b[12..16].copy_from_slice(&self.version.to_le_bytes());
        b[16..32].copy_from_slice(&self.uuid.unwrap_or_default());
        let name = self.alg.name().as_bytes();
        b[32..32 + name.len()].copy_from_slice(name);
        b[64..68].copy_from_slice(&self.data_block_size.to_le_bytes());
        b[68..72].copy_from_slice(&self.hash_block_size.to_le_bytes());
        b[72..80].copy_from_slice(&self.data_blocks.to_le_bytes());
        b[80..82].copy_from_slice(&(self.salt.len() as u16).to_le_bytes());
        b[88..88 + self.salt.len()].copy_from_slice(&self.salt);
        b
    }

    /// Read the superblock at `hash_offset` (veritysetup's
    /// `VERITY_read_sb`): every field checked, nothing trusted.
    pub fn read_superblock(hash: &dyn BlockIo, hash_offset: u64) -> Result<Params, FormatError> {
        let mut b = [0u8; SB_SIZE];
        hash.read_at(&mut b, hash_offset)
            .map_err(io_err(format!("reading the superblock at {hash_offset}")))?;
        if &b[0..8] != SB_SIGNATURE {
            return Err(FormatError::NoSuperblock(hash_offset));
        }
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let bad = |m: String| Err(FormatError::BadSuperblock(m));
        if u32_at(8) != 1 {
            return bad(format!("unsupported superblock version {}", u32_at(8)));
        }
        let version = u32_at(12);
        let name_end = b[32..64].iter().position(|&c| c == 0).unwrap_or(32);
        let name = String::from_utf8_lossy(&b[32..32 + name_end]).to_ascii_lowercase();
        let Some(alg) = HashAlg::parse(&name) else {
            return bad(format!("hash algorithm '{name}' is not built"));
        };
        let mut data_blocks = [0u8; 8];
        data_blocks.copy_from_slice(&b[72..80]);
        let salt_len = u16::from_le_bytes([b[80], b[81]]) as usize;
        if salt_len > MAX_SALT {
            return bad(format!("salt size {salt_len} is over {MAX_SALT}"));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[16..32]);
        let p = Params {
            version,
            alg,
            data_block_size: u32_at(64),
            hash_block_size: u32_at(68),
            data_blocks: u64::from_le_bytes(data_blocks),
            hash_offset,
            salt: b[88..88 + salt_len].to_vec(),
            uuid: Some(uuid),
        };
        p.check()
            .map_err(|e| FormatError::BadSuperblock(e.to_string()))?;
        Ok(p)
    }
}

/// Build the tree of `data` on `hash` (and the superblock, if `p` has a
/// UUID); returns the root digest.
pub fn format(p: &Params, data: &dyn BlockIo, hash: &dyn BlockIo) -> Result<Vec<u8>, FormatError> {
    p.check()?;
    if p.uuid.is_some() {
        // The superblock and zeroes up to the tree's first block.
        let start = p.hash_start() * u64::from(p.hash_block_size);
        let mut head = vec![0u8; (start - p.hash_offset) as usize];
        head[..SB_SIZE].copy_from_slice(&p.superblock());
        hash.write_at(&head, p.hash_offset)
            .map_err(io_err("writing the superblock"))?;
    }
    walk(p, data, hash, false)
}

/// Check the tree of `data` on `hash` against `root` (veritysetup
/// `verify`): every level recomputed and compared, spare areas zero.
pub fn verify(
    p: &Params,
    data: &dyn BlockIo,
    hash: &dyn BlockIo,
    root: &[u8],
) -> Result<(), FormatError> {
    p.check()?;
    let got = walk(p, data, hash, true)?;
    if got != root {
        return Err(FormatError::Root);
    }
    Ok(())
}

/// `VERITY_create_or_verify_hash`: level 0 from the data, each level
/// above from the one below, the root from the top block (or from the
/// only data block).
fn walk(
    p: &Params,
    data: &dyn BlockIo,
    hash: &dyn BlockIo,
    check: bool,
) -> Result<Vec<u8>, FormatError> {
    let g = p.geometry()?;
    let h = Hasher::new(p.alg, p.version, &p.salt);
    let hbs = u64::from(p.hash_block_size);
    for level in 0..g.levels {
        let (src, src_bs, src_start, count): (&dyn BlockIo, u64, u64, u64) = if level == 0 {
            (data, u64::from(p.data_block_size), 0, p.data_blocks)
        } else {
            (hash, hbs, g.level_block[level - 1], g.level_len(level - 1))
        };
        let dst = g.level_block[level] * hbs;
        level_pass(&g, &h, src, src_bs, src_start, count, hash, dst, check)?;
    }
    let mut root = vec![0u8; g.digest_size];
    let (src, bs, off) = if g.levels > 0 {
        (hash, hbs, g.level_block[g.levels - 1] * hbs)
    } else {
        (data, u64::from(p.data_block_size), 0)
    };
    let mut block = vec![0u8; bs as usize];
    src.read_at(&mut block, off)
        .map_err(io_err(format!("reading the top block at byte {off}")))?;
    h.hash(&block, &mut root);
    Ok(root)
}

/// Digest `count` blocks of `src_bs` bytes from block `src_start` of
/// `src` into the hash blocks at byte `dst` of `dst_dev`, or compare
/// with what is there (veritysetup's `create_or_verify`).
#[allow(clippy::too_many_arguments)]
fn level_pass(
    g: &Geometry,
    h: &Hasher,
    src: &dyn BlockIo,
    src_bs: u64,
    src_start: u64,
    count: u64,
    dst_dev: &dyn BlockIo,
    dst: u64,
    check: bool,
) -> Result<(), FormatError> {
    let hbs = g.hash_block_size as usize;
    let per = 1usize << g.hash_per_block_bits;
    let stride = g.digest_stride();
    let per_chunk = (CHUNK / src_bs as usize).max(per) / per * per;
    let mut inbuf = vec![0u8; per_chunk * src_bs as usize];
    let mut out = vec![0u8; per_chunk / per * hbs];
    let mut have = vec![0u8; out.len()];
    let mut done = 0u64;
    while done < count {
        let n = (count - done).min(per_chunk as u64) as usize;
        let in_len = n * src_bs as usize;
        let at = (src_start + done) * src_bs;
        src.read_at(&mut inbuf[..in_len], at)
            .map_err(io_err(format!("reading {in_len} bytes at byte {at}")))?;
        let blocks_out = n.div_ceil(per);
        let out = &mut out[..blocks_out * hbs];
        out.fill(0);
        for (i, blk) in inbuf[..in_len].chunks(src_bs as usize).enumerate() {
            let o = (i / per) * hbs + (i % per) * stride;
            h.hash(blk, &mut out[o..o + g.digest_size]);
        }
        let out_at = dst + (done / per as u64) * hbs as u64;
        if check {
            let have = &mut have[..out.len()];
            dst_dev
                .read_at(have, out_at)
                .map_err(io_err(format!("reading hash blocks at byte {out_at}")))?;
            compare(g, out, have, out_at, n)?;
        } else {
            dst_dev
                .write_at(out, out_at)
                .map_err(io_err(format!("writing hash blocks at byte {out_at}")))?;
        }
        done += n as u64;
    }
    Ok(())
}

/// Name the first digest (or spare area) that differs, by its byte
/// position on the hash device, as veritysetup does.
fn compare(g: &Geometry, want: &[u8], have: &[u8], at: u64, n: usize) -> Result<(), FormatError> {
    let hbs = g.hash_block_size as usize;
    let per = 1usize << g.hash_per_block_bits;
    let stride = g.digest_stride();
    for i in 0..n {
        let o = (i / per) * hbs + (i % per) * stride;
        if want[o..o + g.digest_size] != have[o..o + g.digest_size] {
            return Err(FormatError::Mismatch(at + o as u64));
        }
    }
    if let Some(o) = want.iter().zip(have).position(|(a, b)| a != b) {
        return Err(FormatError::Spare(at + o as u64));
    }
    Ok(())
}

/// Hex digits of `b`, lower case.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Bytes of a hex string, `None` if it is not one (odd length, or a
/// character that is not a hex digit: kernel `hex2bin`).
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A UUID as text (8-4-4-4-12).
pub fn uuid_text(u: &[u8; 16]) -> String {
    let h = hex(u);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// What `veritysetup format` (and `dump`, without the root) prints
/// (cryptsetup's `VERITY_dump`), `name` being the hash device as given.
pub fn report(p: &Params, name: &str, root: Option<&[u8]>) -> Result<String, FormatError> {
    let g = p.geometry()?;
    let mut s = format!("VERITY header information for {name}\n");
    let uuid = p.uuid.as_ref().map(uuid_text).unwrap_or_default();
    s += &format!("UUID:            \t{uuid}\n");
    s += &format!("Hash type:       \t{}\n", p.version);
    s += &format!("Data blocks:     \t{}\n", p.data_blocks);
    s += &format!("Data block size: \t{}\n", p.data_block_size);
    s += &format!("Hash blocks:     \t{}\n", g.hash_blocks());
    s += &format!("Hash block size: \t{}\n", p.hash_block_size);
    s += &format!("Hash algorithm:  \t{}\n", p.alg.name());
    let salt = if p.salt.is_empty() {
        "-".to_string()
    } else {
        hex(&p.salt)
    };
    s += &format!("Salt:            \t{salt}\n");
    if let Some(r) = root {
        s += &format!("Root hash:      \t{}\n", hex(r));
    }
    if p.hash_offset == 0 {
        s += &format!(
            "Hash device size: \t{} [bytes]\n",
            g.hash_end * u64::from(p.hash_block_size)
        );
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A growable image in memory.
    #[derive(Default)]
    pub struct Mem(pub RefCell<Vec<u8>>);
    impl BlockIo for Mem {
        fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
            let v = self.0.borrow();
            let end = off as usize + buf.len();
            if end > v.len() {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            buf.copy_from_slice(&v[off as usize..end]);
            Ok(())
        }
        fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
            let mut v = self.0.borrow_mut();
            let end = off as usize + buf.len();
            if end > v.len() {
                v.resize(end, 0);
            }
            v[off as usize..end].copy_from_slice(buf);
            Ok(())
        }
    }

    fn params(blocks: u64) -> Params {
        Params {
            version: 1,
            alg: HashAlg::Sha256,
            data_block_size: 4096,
            hash_block_size: 4096,
            data_blocks: blocks,
            hash_offset: 0,
            salt: vec![0, 0x11, 0x22, 0x33],
            uuid: Some([7; 16]),
        }
    }

    #[test]
    fn a_tree_verifies_and_a_flipped_byte_is_named() {
        let data = Mem(RefCell::new(
            (0..256 * 4096u32).map(|i| (i * 7 % 251) as u8).collect(),
        ));
        let hash = Mem::default();
        let p = params(256);
        let root = format(&p, &data, &hash).unwrap();
        assert_eq!(hash.0.borrow().len(), 4 * 4096);
        assert_eq!(Params::read_superblock(&hash, 0).unwrap(), p);
        verify(&p, &data, &hash, &root).unwrap();
        data.0.borrow_mut()[5000] ^= 1;
        // Data block 1's digest is the second of level 0 (block 2).
        assert!(matches!(
            verify(&p, &data, &hash, &root),
            Err(FormatError::Mismatch(x)) if x == 2 * 4096 + 32
        ));
        data.0.borrow_mut()[5000] ^= 1;
        hash.0.borrow_mut()[4096 + 100] ^= 1;
        assert!(matches!(
            verify(&p, &data, &hash, &root),
            Err(FormatError::Spare(_))
        ));
    }

    #[test]
    fn a_bad_superblock_is_refused_by_name() {
        let hash = Mem::default();
        hash.write_at(&params(8).superblock(), 0).unwrap();
        hash.0.borrow_mut()[32..38].copy_from_slice(b"md5\0\0\0");
        let e = Params::read_superblock(&hash, 0).unwrap_err().to_string();
        assert!(e.contains("'md5' is not built"), "{e}");
        hash.0.borrow_mut()[0] = b'x';
        assert!(matches!(
            Params::read_superblock(&hash, 0),
            Err(FormatError::NoSuperblock(0))
        ));
        // Sizes that would wrap are refused before anything is read.
        let huge = Params {
            hash_offset: u64::MAX - 100,
            ..params(8)
        };
        assert!(matches!(huge.check(), Err(FormatError::Param(_))));
        let huge = Params {
            data_blocks: u64::MAX / 8,
            ..params(8)
        };
        assert!(matches!(
            format(&huge, &Mem::default(), &Mem::default()),
            Err(FormatError::Param(_))
        ));
    }
}
