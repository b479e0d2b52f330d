//! The dm-verity hash tree: its geometry (where each level starts on the
//! hash device and where a block's digest sits), the salted digest, and
//! the walk from the root digest down to a data block's digest with a
//! bounded cache of hash blocks already verified.
//!
//! Follows drivers/md/dm-verity-target.c (Linux 6.12): `verity_ctr`'s
//! level layout, `verity_hash_at_level`, `verity_hash_init`/`_final`
//! (version 1 hashes the salt first, version 0 last) and
//! `verity_hash_for_block`/`verity_verify_level`, where a verified hash
//! block (dm-bufio's `hash_verified` aux flag) lets a read stop at level
//! 0 instead of walking the tree again. veritysetup's
//! lib/verity/verity_hash.c lays the tree out the same way, top level
//! first. The digests come from RustCrypto's `sha1`/`sha2` crates.

use parking_lot::Mutex;
use sha2::Digest;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// The most levels a tree may have (kernel `DM_VERITY_MAX_LEVELS`,
/// veritysetup's `VERITY_MAX_LEVELS`).
pub const MAX_LEVELS: usize = 63;

/// A digest algorithm the kernel's crypto API would find by this name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashAlg {
    /// `sha1` (20-byte digests).
    Sha1,
    /// `sha224`.
    Sha224,
    /// `sha256`: veritysetup's default.
    Sha256,
    /// `sha384`.
    Sha384,
    /// `sha512`.
    Sha512,
}

impl HashAlg {
    /// The algorithm a table or `--hash` names, if built (kernel
    /// `crypto_alloc_ahash`, which fails with "Cannot initialize hash
    /// function" otherwise).
    pub fn parse(name: &str) -> Option<HashAlg> {
        Some(match name {
            "sha1" => HashAlg::Sha1,
            "sha224" => HashAlg::Sha224,
            "sha256" => HashAlg::Sha256,
            "sha384" => HashAlg::Sha384,
            "sha512" => HashAlg::Sha512,
            _ => return None,
        })
    }

    /// The name as tables print it.
    pub fn name(self) -> &'static str {
        match self {
            HashAlg::Sha1 => "sha1",
            HashAlg::Sha224 => "sha224",
            HashAlg::Sha256 => "sha256",
            HashAlg::Sha384 => "sha384",
            HashAlg::Sha512 => "sha512",
        }
    }

    /// Bytes in one digest.
    pub fn digest_size(self) -> usize {
        match self {
            HashAlg::Sha1 => 20,
            HashAlg::Sha224 => 28,
            HashAlg::Sha256 => 32,
            HashAlg::Sha384 => 48,
            HashAlg::Sha512 => 64,
        }
    }
}

/// A hash state, cloned for every block so that version 1's salt is
/// hashed once (as 6.12's precomputed `initial_hashstate`).
#[derive(Clone)]
enum State {
    Sha1(sha1::Sha1),
    Sha224(sha2::Sha224),
    Sha256(sha2::Sha256),
    Sha384(sha2::Sha384),
    Sha512(sha2::Sha512),
}

macro_rules! each_state {
    ($s:expr, $h:ident => $e:expr) => {
        match $s {
            State::Sha1($h) => $e,
            State::Sha224($h) => $e,
            State::Sha256($h) => $e,
            State::Sha384($h) => $e,
            State::Sha512($h) => $e,
        }
    };
}

/// The salted block digest of one tree (kernel `verity_hash`).
#[derive(Clone)]
pub struct Hasher {
    alg: HashAlg,
    version: u32,
    salt: Vec<u8>,
    /// The state after `init` (and, for version 1, the salt).
    init: State,
}

impl Hasher {
    /// The digest of `alg` salted with `salt` the way format `version`
    /// (0 or 1) salts it.
    pub fn new(alg: HashAlg, version: u32, salt: &[u8]) -> Hasher {
        let mut init = match alg {
            HashAlg::Sha1 => State::Sha1(sha1::Sha1::new()),
            HashAlg::Sha224 => State::Sha224(sha2::Sha224::new()),
            HashAlg::Sha256 => State::Sha256(sha2::Sha256::new()),
            HashAlg::Sha384 => State::Sha384(sha2::Sha384::new()),
            HashAlg::Sha512 => State::Sha512(sha2::Sha512::new()),
        };
        if version >= 1 && !salt.is_empty() {
            each_state!(&mut init, h => h.update(salt));
        }
        Hasher {
            alg,
            version,
            salt: salt.to_vec(),
            init,
        }
    }

    /// The algorithm.
    pub fn alg(&self) -> HashAlg {
        self.alg
    }

    /// Bytes in one digest.
    pub fn digest_size(&self) -> usize {
        self.alg.digest_size()
    }

    /// The salt (empty for none).
    pub fn salt(&self) -> &[u8] {
        &self.salt
    }

    /// Digest `data` into `out` (`digest_size` bytes).
    pub fn hash(&self, data: &[u8], out: &mut [u8]) {
        let mut s = self.init.clone();
        each_state!(&mut s, h => h.update(data));
        if self.version == 0 && !self.salt.is_empty() {
            each_state!(&mut s, h => h.update(&self.salt));
        }
        each_state!(s, h => out.copy_from_slice(&h.finalize()));
    }
}

/// Why a tree's geometry is impossible (kernel `verity_ctr`'s
/// `ti->error`s for the level layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    /// More than [`MAX_LEVELS`] levels.
    #[error("Too many tree levels")]
    TooManyLevels,
    /// The hash blocks would run past the end of a 64-bit block number.
    #[error("Hash device offset overflow")]
    Overflow,
    /// A hash block holds fewer than two digests.
    #[error("Digest size too big")]
    DigestTooBig,
}

/// Where the tree's blocks are (kernel `struct dm_verity`'s geometry).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Format version: 0 (Chrome OS: digests packed, salt hashed last) or
    /// 1 (digests padded to a power of two, salt hashed first).
    pub version: u32,
    /// Bytes per data block.
    pub data_block_size: u32,
    /// Bytes per hash block.
    pub hash_block_size: u32,
    /// Data blocks the tree covers.
    pub data_blocks: u64,
    /// The first hash block of the tree (its top level), in hash blocks.
    pub hash_start: u64,
    /// Bytes per digest.
    pub digest_size: usize,
    /// log2 of the digests one hash block holds.
    pub hash_per_block_bits: u32,
    /// Levels below the root digest (0 when there is one data block).
    pub levels: usize,
    /// The first hash block of each level, level 0 (the data's digests)
    /// first.
    pub level_block: Vec<u64>,
    /// The hash block after the tree's last (kernel `hash_blocks`).
    pub hash_end: u64,
}

impl Geometry {
    /// The layout `verity_ctr` (and veritysetup) computes.
    pub fn new(
        version: u32,
        data_block_size: u32,
        hash_block_size: u32,
        data_blocks: u64,
        hash_start: u64,
        digest_size: usize,
    ) -> Result<Geometry, GeometryError> {
        if (hash_block_size as usize) < digest_size * 2 {
            return Err(GeometryError::DigestTooBig);
        }
        let per_block = hash_block_size as usize / digest_size;
        let bits = usize::BITS - 1 - per_block.leading_zeros();
        let mut levels = 0usize;
        if data_blocks > 0 {
            while (bits as usize) * levels < 64
                && (data_blocks - 1) >> (bits as usize * levels) != 0
            {
                levels += 1;
            }
        }
        if levels > MAX_LEVELS {
            return Err(GeometryError::TooManyLevels);
        }
        let mut level_block = vec![0u64; levels];
        let mut pos = hash_start;
        for i in (0..levels).rev() {
            level_block[i] = pos;
            let shift = (i as u32 + 1) * bits;
            let s = if shift >= 64 {
                1
            } else {
                // (data_blocks + 2^shift - 1) >> shift without overflow.
                (data_blocks >> shift) + u64::from(data_blocks & ((1u64 << shift) - 1) != 0)
            };
            pos = pos.checked_add(s).ok_or(GeometryError::Overflow)?;
        }
        Ok(Geometry {
            version,
            data_block_size,
            hash_block_size,
            data_blocks,
            hash_start,
            digest_size,
            hash_per_block_bits: bits,
            levels,
            level_block,
            hash_end: pos,
        })
    }

    /// Hash blocks in the tree.
    pub fn hash_blocks(&self) -> u64 {
        self.hash_end - self.hash_start
    }

    /// Hash blocks in `level` (kernel: the blocks between its start and
    /// the next level's).
    pub fn level_len(&self, level: usize) -> u64 {
        let end = if level == 0 {
            self.hash_end
        } else {
            self.level_block[level - 1]
        };
        end - self.level_block[level]
    }

    /// Bytes one digest takes in a hash block: packed in version 0,
    /// padded to a power of two in version 1 (kernel
    /// `verity_hash_at_level`'s offset).
    pub fn digest_stride(&self) -> usize {
        if self.version == 0 {
            self.digest_size
        } else {
            (self.hash_block_size >> self.hash_per_block_bits) as usize
        }
    }

    /// The hash block holding data block `block`'s digest at `level`, and
    /// the digest's byte offset in it (kernel `verity_hash_at_level`).
    pub fn hash_at_level(&self, block: u64, level: usize) -> (u64, usize) {
        let shift = level as u32 * self.hash_per_block_bits;
        let position = if shift >= 64 { 0 } else { block >> shift };
        let hash_block = self.level_block[level] + (position >> self.hash_per_block_bits);
        let idx = (position & ((1u64 << self.hash_per_block_bits) - 1)) as usize;
        (hash_block, idx * self.digest_stride())
    }
}

/// One hash block read from the hash device, and whether its digest has
/// been checked against its parent (dm-bufio's buffer with verity's
/// `buffer_aux.hash_verified`).
pub struct HashBlock {
    /// The block's bytes.
    pub data: Box<[u8]>,
    verified: std::sync::atomic::AtomicBool,
}

impl HashBlock {
    /// A block just read, not verified yet.
    pub fn new(data: Box<[u8]>) -> HashBlock {
        HashBlock {
            data,
            verified: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether its digest matched its parent's entry.
    pub fn is_verified(&self) -> bool {
        self.verified.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Mark it verified; never reset (as `hash_verified`).
    pub fn set_verified(&self) {
        self.verified
            .store(true, std::sync::atomic::Ordering::Release);
    }
}

/// A bounded cache of hash blocks by block number (the part of dm-bufio
/// verity uses): the oldest block inserted goes first when it is full,
/// which keeps a sequential read's current level-0 block and the levels
/// above it, since those were inserted last.
pub struct BlockCache {
    capacity: usize,
    inner: Mutex<CacheInner>,
}

struct CacheInner {
    map: HashMap<u64, Arc<HashBlock>>,
    order: VecDeque<u64>,
}

impl BlockCache {
    /// A cache holding at most `capacity` blocks (at least one).
    pub fn new(capacity: usize) -> BlockCache {
        BlockCache {
            capacity: capacity.max(1),
            inner: Mutex::new(CacheInner {
                map: HashMap::new(),
                order: VecDeque::new(),
            }),
        }
    }

    /// The cached block, if held.
    pub fn get(&self, block: u64) -> Option<Arc<HashBlock>> {
        self.inner.lock().map.get(&block).cloned()
    }

    /// Hold `b` as block `block`; a block read meanwhile by another reader
    /// wins (its verified flag may be set already).
    pub fn insert(&self, block: u64, b: Arc<HashBlock>) -> Arc<HashBlock> {
        let mut g = self.inner.lock();
        if let Some(have) = g.map.get(&block) {
            return have.clone();
        }
        while g.map.len() >= self.capacity {
            match g.order.pop_front() {
                Some(old) => {
                    g.map.remove(&old);
                }
                None => break,
            }
        }
        g.map.insert(block, b.clone());
        g.order.push_back(block);
        b
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_matches_veritysetups_layout() {
        // 256 data blocks, sha256 in 4 KiB: 128 digests a block, two
        // levels; the top level first, right after the superblock's block.
        let g = Geometry::new(1, 4096, 4096, 256, 1, 32).unwrap();
        assert_eq!(g.levels, 2);
        assert_eq!(g.level_block, vec![2, 1]);
        assert_eq!(g.hash_blocks(), 3);
        assert_eq!(g.hash_at_level(129, 0), (3, 32));
        assert_eq!(g.hash_at_level(129, 1), (1, 32));
        // One data block: no levels, the root is the block's digest.
        let g = Geometry::new(1, 4096, 4096, 1, 0, 32).unwrap();
        assert_eq!((g.levels, g.hash_blocks()), (0, 0));
        // sha1 version 0 packs 20-byte digests, 128 to a block.
        let g = Geometry::new(0, 4096, 4096, 100, 0, 20).unwrap();
        assert_eq!(g.hash_per_block_bits, 7);
        assert_eq!(g.hash_at_level(3, 0), (0, 60));
        assert_eq!(
            Geometry::new(1, 4096, 32, 8, 0, 32),
            Err(GeometryError::DigestTooBig)
        );
        // 2^64 - 1 blocks, two digests a hash block: 64 levels.
        assert_eq!(
            Geometry::new(1, 512, 64, u64::MAX, 0, 32),
            Err(GeometryError::TooManyLevels)
        );
        assert_eq!(
            Geometry::new(1, 4096, 4096, 1 << 20, u64::MAX - 2, 32),
            Err(GeometryError::Overflow)
        );
    }

    #[test]
    fn salt_goes_first_in_version_1_and_last_in_version_0() {
        let mut out1 = [0u8; 32];
        let mut out0 = [0u8; 32];
        Hasher::new(HashAlg::Sha256, 1, b"salt").hash(b"data", &mut out1);
        Hasher::new(HashAlg::Sha256, 0, b"salt").hash(b"data", &mut out0);
        assert_eq!(
            out1.as_slice(),
            sha2::Sha256::digest(b"saltdata").as_slice()
        );
        assert_eq!(
            out0.as_slice(),
            sha2::Sha256::digest(b"datasalt").as_slice()
        );
    }

    #[test]
    fn the_cache_stays_within_its_capacity() {
        let c = BlockCache::new(2);
        for b in 0..5u64 {
            c.insert(b, Arc::new(HashBlock::new(vec![b as u8].into())));
        }
        assert_eq!(c.len(), 2);
        assert!(c.get(4).is_some() && c.get(3).is_some() && c.get(0).is_none());
    }
}
