//! dm-cache's metadata (`drivers/md/dm-cache-metadata.c`), formats 1
//! and 2, on [`crate::persistent_data`]: the superblock, the mapping
//! array (cache block -> `oblock << 16 | flags`), the policy's hint
//! array, the discard bitset and, in format 2, the dirty bitset (format 1
//! keeps the dirty bit in the mapping's flags).
//!
//! As the kernel: opening clears `CLEAN_SHUTDOWN` in the superblock at
//! once, so after a crash every mapped block is loaded dirty; dirty bits,
//! discards and hints are written only at a clean shutdown
//! (`sync_metadata`), whose commit sets the flag again. Commits are
//! copy-on-write (`__commit_transaction`): space map, new blocks, flush,
//! superblock with FUA.

use crate::persistent_data::bitmap::SmRoot;
use crate::persistent_data::block_manager::BlockManager;
use crate::persistent_data::checksum::{seal, verify};
use crate::persistent_data::tm::Tm;
use crate::persistent_data::value_type::{Le32, Le64};
use crate::persistent_data::{
    self, array, bitset, le32, le64, metadata_blocks_of, put32, put64, FormatError, PdError,
    BLOCK_SIZE,
};
use blkstack_core::DeviceRef;

/// `CACHE_SUPERBLOCK_MAGIC` (06142003, octal in the kernel's source).
pub const MAGIC: u64 = 0o6142003;
/// `SUPERBLOCK_CSUM_XOR`.
pub const SB_CSUM_XOR: u32 = 9031977;
/// `CACHE_SUPERBLOCK_LOCATION`.
pub const LOCATION: u64 = 0;
/// `CLEAN_SHUTDOWN` flag bit.
pub const CLEAN_SHUTDOWN: u32 = 1 << 0;
/// `NEEDS_CHECK` flag bit.
pub const NEEDS_CHECK: u32 = 1 << 1;
/// `M_VALID`.
pub const M_VALID: u64 = 1;
/// `M_DIRTY` (format 1 only).
pub const M_DIRTY: u64 = 2;
const POLICY_NAME_SIZE: usize = 16;

/// Why cache metadata could not be opened or changed.
#[derive(Debug, thiserror::Error)]
pub enum CacheMdError {
    /// The persistent-data layer failed (I/O, a corrupt block, no space).
    #[error(transparent)]
    Pd(#[from] PdError),
    /// Refused as the kernel refuses it (`-EINVAL`).
    #[error("{0}")]
    Refused(String),
}

impl From<FormatError> for CacheMdError {
    fn from(e: FormatError) -> CacheMdError {
        CacheMdError::Pd(PdError::Format(e))
    }
}

/// The counters the superblock keeps (`struct dm_cache_statistics`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Reads served by the cache device.
    pub read_hits: u32,
    /// Reads sent to the origin.
    pub read_misses: u32,
    /// Writes to cached blocks.
    pub write_hits: u32,
    /// Writes to uncached blocks.
    pub write_misses: u32,
}

/// `struct cache_disk_superblock`, decoded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Superblock {
    /// `CLEAN_SHUTDOWN`, `NEEDS_CHECK`.
    pub flags: u32,
    /// 1 or 2.
    pub version: u32,
    /// The policy that wrote the hints.
    pub policy_name: String,
    /// Its version.
    pub policy_version: [u32; 3],
    /// Bytes per hint (0: no hint array).
    pub policy_hint_size: u32,
    /// The metadata space map's root, as stored.
    pub sm_root: SmRoot,
    /// The mapping array.
    pub mapping_root: u64,
    /// The hint array, 0 for none.
    pub hint_root: u64,
    /// The discard bitset.
    pub discard_root: u64,
    /// Sectors per discard block.
    pub discard_block_size: u64,
    /// Discard blocks tracked.
    pub discard_nr_blocks: u64,
    /// Sectors per cache block.
    pub data_block_size: u32,
    /// Cache blocks.
    pub cache_blocks: u32,
    /// `incompat_flags`.
    pub incompat_flags: u32,
    /// `compat_ro_flags`.
    pub compat_ro_flags: u32,
    /// Hit and miss counters.
    pub stats: Stats,
    /// Format 2's dirty bitset.
    pub dirty_root: u64,
}

impl Superblock {
    /// The sealed block for location `at` (`sb_prepare_for_write`).
    pub fn encode(&self, at: u64) -> Vec<u8> {
        let mut b = vec![0u8; BLOCK_SIZE];
        put32(&mut b, 4, self.flags);
        put64(&mut b, 8, at);
        put64(&mut b, 32, MAGIC);
        put32(&mut b, 40, self.version);
        let name = self.policy_name.as_bytes();
        let n = name.len().min(POLICY_NAME_SIZE - 1);
        b[44..44 + n].copy_from_slice(&name[..n]);
        put32(&mut b, 60, self.policy_hint_size);
        self.sm_root.encode(&mut b[64..192]);
        put64(&mut b, 192, self.mapping_root);
        put64(&mut b, 200, self.hint_root);
        put64(&mut b, 208, self.discard_root);
        put64(&mut b, 216, self.discard_block_size);
        put64(&mut b, 224, self.discard_nr_blocks);
        put32(&mut b, 232, self.data_block_size);
        put32(&mut b, 236, (BLOCK_SIZE / 512) as u32);
        put32(&mut b, 240, self.cache_blocks);
        put32(&mut b, 248, self.compat_ro_flags);
        put32(&mut b, 252, self.incompat_flags);
        put32(&mut b, 256, self.stats.read_hits);
        put32(&mut b, 260, self.stats.read_misses);
        put32(&mut b, 264, self.stats.write_hits);
        put32(&mut b, 268, self.stats.write_misses);
        for (i, v) in self.policy_version.iter().enumerate() {
            put32(&mut b, 272 + 4 * i, *v);
        }
        if self.version >= 2 {
            put64(&mut b, 284, self.dirty_root);
        }
        seal(&mut b, SB_CSUM_XOR);
        b
    }

    /// `sb_check`, then the fields.
    pub fn decode(b: &[u8], at: u64) -> Result<Superblock, FormatError> {
        let invalid = |why: String| FormatError::Invalid {
            what: "cache superblock",
            block: at,
            why,
        };
        let says = le64(b, 8);
        if says != at {
            return Err(FormatError::Location {
                what: "cache superblock",
                block: at,
                says,
            });
        }
        if le64(b, 32) != MAGIC {
            return Err(invalid(format!("magic {}: wanted {MAGIC}", le64(b, 32))));
        }
        verify(b, SB_CSUM_XOR, "cache superblock", at)?;
        let version = le32(b, 40);
        if !(1..=2).contains(&version) {
            return Err(invalid(format!(
                "Cache metadata version {version} found, but only versions between 1 and 2 supported."
            )));
        }
        let name_end = b[44..60].iter().position(|&c| c == 0).unwrap_or(16);
        let sm_root = SmRoot::decode(&b[64..]);
        Ok(Superblock {
            flags: le32(b, 4),
            version,
            policy_name: String::from_utf8_lossy(&b[44..44 + name_end]).into_owned(),
            policy_version: [le32(b, 272), le32(b, 276), le32(b, 280)],
            policy_hint_size: le32(b, 60),
            sm_root,
            mapping_root: le64(b, 192),
            hint_root: le64(b, 200),
            discard_root: le64(b, 208),
            discard_block_size: le64(b, 216),
            discard_nr_blocks: le64(b, 224),
            data_block_size: le32(b, 232),
            cache_blocks: le32(b, 240),
            compat_ro_flags: le32(b, 248),
            incompat_flags: le32(b, 252),
            stats: Stats {
                read_hits: le32(b, 256),
                read_misses: le32(b, 260),
                write_hits: le32(b, 264),
                write_misses: le32(b, 268),
            },
            dirty_root: if version >= 2 { le64(b, 284) } else { 0 },
        })
    }
}

/// A mapping as loaded (`load_mapping_fn`'s arguments).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    /// The cache block.
    pub cblock: u32,
    /// The origin block it holds.
    pub oblock: u64,
    /// Whether the cache's copy differs from the origin's (always true
    /// after an unclean shutdown).
    pub dirty: bool,
    /// The policy's hint, when the hints are valid.
    pub hint: Option<u32>,
}

/// One cache's metadata (`struct dm_cache_metadata`).
pub struct CacheMetadata {
    tm: Tm,
    sb: Superblock,
    clean_when_opened: bool,
    changed: bool,
    /// Commits since it was opened (the kernel's `stats.commit_count`).
    commits: u64,
}

/// What status shows of the metadata device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// Metadata blocks in use.
    pub used: u64,
    /// Metadata blocks in all.
    pub total: u64,
}

impl CacheMetadata {
    /// `dm_cache_metadata_open`: format a device whose first block is all
    /// zeroes (as `version`), else read it; the block size must not
    /// change. The superblock's `CLEAN_SHUTDOWN` is cleared on disk.
    pub fn open(
        dev: DeviceRef,
        block_size: u32,
        version: u32,
    ) -> Result<CacheMetadata, CacheMdError> {
        let nr_meta = metadata_blocks_of(dev.size());
        if nr_meta < 8 {
            return Err(CacheMdError::Refused(format!(
                "metadata device too small: {} bytes",
                dev.size()
            )));
        }
        let first = BlockManager::new(dev.clone()).read_block(LOCATION)?;
        if first.iter().all(|&x| x == 0) {
            // `__format_metadata`: the space map bootstrapped with the
            // superblock counted, as `dm_sm_metadata_create` does.
            let mut tm = persistent_data::format(dev, nr_meta);
            let mapping_root = array::empty(&mut tm, &mut Le64)?;
            let dirty_root = if version >= 2 {
                bitset::empty(&mut tm)?
            } else {
                0
            };
            let discard_root = bitset::empty(&mut tm)?;
            let sb = Superblock {
                version,
                mapping_root,
                dirty_root,
                discard_root,
                data_block_size: block_size,
                ..Superblock::default()
            };
            let mut md = CacheMetadata {
                tm,
                sb,
                clean_when_opened: true,
                changed: true,
                commits: 0,
            };
            md.commit(false)?;
            return Ok(md);
        }
        let mut sb = Superblock::decode(&first, LOCATION)?;
        if sb.data_block_size != block_size {
            return Err(CacheMdError::Refused(format!(
                "changing the data block size (from {} to {block_size}) is not supported",
                sb.data_block_size
            )));
        }
        if sb.incompat_flags != 0 || sb.compat_ro_flags != 0 {
            return Err(CacheMdError::Refused(format!(
                "could not access metadata due to unsupported optional features ({:x}).",
                sb.incompat_flags | sb.compat_ro_flags
            )));
        }
        let root = sb.sm_root;
        if root.nr_blocks > nr_meta {
            return Err(CacheMdError::Refused(format!(
                "metadata device has {nr_meta} blocks, its space map counts {}",
                root.nr_blocks
            )));
        }
        let tm = persistent_data::open(dev, root)?;
        let clean_when_opened = sb.flags & CLEAN_SHUTDOWN != 0;
        // `__begin_transaction_flags(cmd, clear_clean_shutdown)`.
        sb.flags &= !CLEAN_SHUTDOWN;
        tm.write_block(LOCATION, &mut sb.encode(LOCATION), true)?;
        tm.flush()?;
        Ok(CacheMetadata {
            tm,
            sb,
            clean_when_opened,
            changed: false,
            commits: 0,
        })
    }

    /// The format version (1 or 2) on disk.
    pub fn version(&self) -> u32 {
        self.sb.version
    }

    /// Cache blocks the metadata covers.
    pub fn cache_blocks(&self) -> u32 {
        self.sb.cache_blocks
    }

    /// Whether the last shutdown was clean.
    pub fn clean_when_opened(&self) -> bool {
        self.clean_when_opened
    }

    /// The counters saved at the last clean shutdown.
    pub fn stats(&self) -> Stats {
        self.sb.stats
    }

    /// `dm_cache_metadata_set_stats`.
    pub fn set_stats(&mut self, s: Stats) {
        self.sb.stats = s;
    }

    /// `NEEDS_CHECK` is set.
    pub fn needs_check(&self) -> bool {
        self.sb.flags & NEEDS_CHECK != 0
    }

    /// `dm_cache_changed_this_transaction`.
    pub fn changed(&self) -> bool {
        self.changed
    }

    /// Commits since it was opened.
    pub fn commits(&self) -> u64 {
        self.commits
    }

    /// Metadata blocks used / in all.
    pub fn usage(&self) -> Usage {
        Usage {
            // `dm_cache_get_free_metadata_block_count`: free as the
            // metadata space map counts it (free at the last commit, less
            // what was handed out since).
            used: self.tm.meta.nr_blocks() - self.tm.meta.nr_free(),
            total: self.tm.meta.nr_blocks(),
        }
    }

    fn mapping(&mut self, cblock: u32) -> Result<u64, CacheMdError> {
        array::get::<Le64>(&mut self.tm, self.sb.mapping_root, cblock as u64)?.ok_or_else(|| {
            CacheMdError::Refused(format!("cache block {cblock} is past the mapping array"))
        })
    }

    /// `dm_cache_resize`: cover `new_size` cache blocks; shrinking over a
    /// dirty mapped block is refused.
    pub fn resize(&mut self, new_size: u32) -> Result<(), CacheMdError> {
        let old = self.sb.cache_blocks;
        if new_size < old {
            let dirty = self.dirty_words()?;
            for cb in new_size..old {
                let v = self.mapping(cb)?;
                let d = if self.sb.version >= 2 {
                    dirty
                        .get(cb as usize / 64)
                        .is_some_and(|w| w & (1 << (cb % 64)) != 0)
                } else {
                    v & M_DIRTY != 0
                };
                if v & M_VALID != 0 && d {
                    return Err(CacheMdError::Refused(format!(
                        "unable to shrink cache due to dirty blocks (cache block {cb} is dirty)"
                    )));
                }
            }
        }
        self.sb.mapping_root = array::resize(
            &mut self.tm,
            self.sb.mapping_root,
            old,
            new_size,
            &mut Le64,
            &0,
        )?;
        if self.sb.version >= 2 {
            self.sb.dirty_root = bitset::resize(
                &mut self.tm,
                self.sb.dirty_root,
                old as u64,
                new_size as u64,
                false,
            )?;
        }
        self.sb.cache_blocks = new_size;
        self.changed = true;
        Ok(())
    }

    fn dirty_words(&mut self) -> Result<Vec<u64>, CacheMdError> {
        if self.sb.version < 2 {
            return Ok(Vec::new());
        }
        Ok(bitset::load(
            &mut self.tm,
            self.sb.dirty_root,
            self.sb.cache_blocks as u64,
        )?)
    }

    /// `dm_cache_insert_mapping`: `cblock` holds `oblock` (clean).
    pub fn insert(&mut self, cblock: u32, oblock: u64) -> Result<(), CacheMdError> {
        self.set_mapping(cblock, (oblock << 16) | M_VALID)
    }

    /// `dm_cache_remove_mapping`.
    pub fn remove(&mut self, cblock: u32) -> Result<(), CacheMdError> {
        self.set_mapping(cblock, 0)
    }

    fn set_mapping(&mut self, cblock: u32, v: u64) -> Result<(), CacheMdError> {
        if cblock >= self.sb.cache_blocks {
            return Err(CacheMdError::Refused(format!(
                "cache block {cblock} is past the mapping array"
            )));
        }
        self.sb.mapping_root = array::set(
            &mut self.tm,
            self.sb.mapping_root,
            cblock as u64,
            &mut Le64,
            &v,
        )?;
        self.changed = true;
        Ok(())
    }

    /// `dm_cache_load_mappings`: every valid mapping, dirty as the last
    /// clean shutdown left it (all dirty after a crash), with hints when
    /// the policy that wrote them is `policy` at the same major version.
    pub fn load_mappings(
        &mut self,
        policy: &str,
        major: u32,
        hint_size: u32,
    ) -> Result<Vec<Mapping>, CacheMdError> {
        let n = self.sb.cache_blocks as u64;
        if n == 0 {
            return Ok(Vec::new());
        }
        let hints_valid = self.clean_when_opened
            && self.sb.policy_name == policy
            && self.sb.policy_version[0] == major
            && self.sb.policy_hint_size == hint_size
            && self.sb.hint_root != 0;
        let mut values = Vec::with_capacity(n as usize);
        array::walk::<Le64>(&mut self.tm, self.sb.mapping_root, n, &mut |_, v| {
            values.push(v)
        })?;
        let mut hints = Vec::new();
        if hints_valid {
            let walked = array::walk::<Le32>(&mut self.tm, self.sb.hint_root, n, &mut |_, v| {
                hints.push(v)
            });
            if walked.is_err() {
                hints.clear();
            }
        }
        let dirty = self.dirty_words()?;
        let mut out = Vec::new();
        for (cb, v) in values.into_iter().enumerate() {
            if v & M_VALID == 0 {
                continue;
            }
            let flagged = if self.sb.version >= 2 {
                dirty
                    .get(cb / 64)
                    .is_some_and(|w| w & (1 << (cb % 64)) != 0)
            } else {
                v & M_DIRTY != 0
            };
            out.push(Mapping {
                cblock: cb as u32,
                oblock: v >> 16,
                dirty: !self.clean_when_opened || flagged,
                hint: hints.get(cb).copied(),
            });
        }
        Ok(out)
    }

    /// `dm_cache_set_dirty_bits`: the dirty bit of every cache block, from
    /// `dirty` (one bool per cache block).
    pub fn set_dirty_bits(&mut self, dirty: &[bool]) -> Result<(), CacheMdError> {
        let n = self.sb.cache_blocks;
        if dirty.len() != n as usize {
            return Err(CacheMdError::Refused("dirty bitset is wrong size".into()));
        }
        if self.sb.version >= 2 {
            bitset::del(&mut self.tm, self.sb.dirty_root)?;
            let mut root = bitset::empty(&mut self.tm)?;
            root = bitset::resize(&mut self.tm, root, 0, n as u64, false)?;
            for (w, chunk) in dirty.chunks(64).enumerate() {
                let word = chunk
                    .iter()
                    .enumerate()
                    .fold(0u64, |acc, (i, &d)| acc | ((d as u64) << i));
                if word != 0 {
                    root = array::set(&mut self.tm, root, w as u64, &mut Le64, &word)?;
                }
            }
            self.sb.dirty_root = root;
        } else {
            for (cb, &d) in dirty.iter().enumerate() {
                let v = self.mapping(cb as u32)?;
                if (v & M_DIRTY != 0) == d {
                    continue;
                }
                let v = (v & !M_DIRTY) | if d { M_DIRTY } else { 0 };
                self.set_mapping(cb as u32, v)?;
            }
        }
        self.changed = true;
        Ok(())
    }

    /// `dm_cache_discard_bitset_resize` + `dm_cache_set_discard` for every
    /// discard block: the discard bitset becomes `discarded`.
    pub fn write_discards(
        &mut self,
        block_size: u64,
        discarded: &[bool],
    ) -> Result<(), CacheMdError> {
        let old = self.sb.discard_nr_blocks;
        let new = discarded.len() as u64;
        let mut root = bitset::resize(&mut self.tm, self.sb.discard_root, old, new, false)?;
        for (b, &d) in discarded.iter().enumerate() {
            root = if d {
                bitset::set_bit(&mut self.tm, root, b as u64)?
            } else {
                bitset::clear_bit(&mut self.tm, root, b as u64)?
            };
        }
        self.sb.discard_root = root;
        self.sb.discard_block_size = block_size;
        self.sb.discard_nr_blocks = new;
        self.changed = true;
        Ok(())
    }

    /// `dm_cache_load_discards`: the discard block size and bits saved at
    /// a clean shutdown (none after a crash).
    pub fn load_discards(&mut self) -> Result<(u64, Vec<bool>), CacheMdError> {
        let n = self.sb.discard_nr_blocks;
        if n == 0 || !self.clean_when_opened {
            return Ok((self.sb.discard_block_size, vec![false; n as usize]));
        }
        let words = bitset::load(&mut self.tm, self.sb.discard_root, n)?;
        let bits = (0..n)
            .map(|b| words[(b / 64) as usize] & (1 << (b % 64)) != 0)
            .collect();
        Ok((self.sb.discard_block_size, bits))
    }

    /// `dm_cache_write_hints`: a new hint array of one `u32` per cache
    /// block, and the policy that wrote it.
    pub fn write_hints(
        &mut self,
        policy: &str,
        version: [u32; 3],
        hints: &[u32],
    ) -> Result<(), CacheMdError> {
        self.sb.policy_name = policy.to_string();
        self.sb.policy_version = version;
        self.sb.policy_hint_size = 4;
        if self.sb.hint_root != 0 {
            array::del(&mut self.tm, self.sb.hint_root, &mut Le32)?;
        }
        let mut root = array::empty(&mut self.tm, &mut Le32)?;
        root = array::resize(&mut self.tm, root, 0, hints.len() as u32, &mut Le32, &0)?;
        for (cb, &h) in hints.iter().enumerate() {
            if h != 0 {
                root = array::set(&mut self.tm, root, cb as u64, &mut Le32, &h)?;
            }
        }
        self.sb.hint_root = root;
        self.changed = true;
        Ok(())
    }

    /// `dm_cache_commit`: the transaction made durable; the superblock
    /// says `CLEAN_SHUTDOWN` only when `clean_shutdown`.
    pub fn commit(&mut self, clean_shutdown: bool) -> Result<(), CacheMdError> {
        if clean_shutdown {
            self.sb.flags |= CLEAN_SHUTDOWN;
        } else {
            self.sb.flags &= !CLEAN_SHUTDOWN;
        }
        let sb = &mut self.sb;
        persistent_data::commit(&mut self.tm, |sm_root| {
            sb.sm_root = sm_root;
            sb.encode(LOCATION)
        })?;
        self.sb.flags &= !CLEAN_SHUTDOWN;
        self.changed = false;
        self.commits += 1;
        Ok(())
    }
}
