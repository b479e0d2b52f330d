//! dm-era's metadata (`dm-era-target.c`'s "On disk metadata layout" and
//! "High level metadata interface"): the superblock, the writeset tree
//! (era -> archived writeset, a bitset of the blocks written in that
//! era), the era array (block -> the last era it was written in, filled
//! by digesting archived writesets) and the current era's writeset, all
//! on [`crate::persistent_data`]. Committed copy-on-write as
//! `metadata_commit` does: space map, new blocks, flush, superblock.

use crate::persistent_data::bitmap::SmRoot;
use crate::persistent_data::block_manager::BlockManager;
use crate::persistent_data::checksum::{seal, verify};
use crate::persistent_data::tm::Tm;
use crate::persistent_data::value_type::{Le32, ValueType};
use crate::persistent_data::{
    self, array, bitset, btree, le32, le64, put32, put64, FormatError, PdError, BLOCK_SIZE,
};
use blkstack_core::DeviceRef;

/// `SUPERBLOCK_MAGIC`.
pub const MAGIC: u64 = 2126579579;
/// `SUPERBLOCK_CSUM_XOR`.
pub const SB_CSUM_XOR: u32 = 146538381;
/// `MAX_ERA_VERSION` (and the only one).
pub const VERSION: u32 = 1;
/// `SUPERBLOCK_LOCATION`; also the "no writeset" root
/// (`INVALID_WRITESET_ROOT`) and the "no metadata snapshot" location.
pub const LOCATION: u64 = 0;
/// Archived writesets digested into the era array per step (the
/// kernel's `INSERTS_PER_STEP` counts bits looked at; this counts bits
/// set, so a sparse writeset digests in few steps).
const SETS_PER_STEP: usize = 1024;

/// Why era metadata could not be opened or changed.
#[derive(Debug, thiserror::Error)]
pub enum EraError {
    /// The persistent-data layer failed (I/O, a corrupt block, no space).
    #[error(transparent)]
    Pd(#[from] PdError),
    /// The operation is refused as the kernel refuses it (`-EINVAL`).
    #[error("{0}")]
    Refused(String),
}

impl From<FormatError> for EraError {
    fn from(e: FormatError) -> EraError {
        EraError::Pd(PdError::Format(e))
    }
}

/// `struct writeset_metadata` / `writeset_disk` (12 bytes packed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Writeset {
    /// Bits (origin blocks) it covers.
    pub nr_bits: u32,
    /// Its bitset's root; [`LOCATION`] for none.
    pub root: u64,
}

/// The writeset tree's values (`ws_inc`, `ws_dec`, `ws_eq`): a copy
/// refers to the bitset once more; the last one gone deletes it.
pub struct Writesets;

impl ValueType for Writesets {
    type Value = Writeset;
    const SIZE: usize = 12;
    fn unpack(b: &[u8]) -> Writeset {
        Writeset {
            nr_bits: le32(b, 0),
            root: le64(b, 4),
        }
    }
    fn pack(v: &Writeset, out: &mut [u8]) {
        put32(out, 0, v.nr_bits);
        put64(out, 4, v.root);
    }
    fn inc(&mut self, tm: &mut Tm, v: &Writeset) -> Result<(), PdError> {
        tm.inc(v.root)
    }
    fn dec(&mut self, tm: &mut Tm, v: &Writeset) -> Result<(), PdError> {
        bitset::del(tm, v.root)
    }
}

/// `struct superblock_disk`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Superblock {
    /// The metadata space map's root.
    pub metadata_sm: SmRoot,
    /// Origin block size, in sectors.
    pub data_block_size: u32,
    /// Origin blocks tracked.
    pub nr_blocks: u32,
    /// The era writes go to now.
    pub current_era: u32,
    /// The current era's writeset.
    pub current_writeset: Writeset,
    /// Era -> archived writeset.
    pub writeset_tree_root: u64,
    /// Block -> era last written.
    pub era_array_root: u64,
    /// A held copy of the superblock, [`LOCATION`] for none.
    pub metadata_snap: u64,
}

impl Superblock {
    /// The sealed block, for location `at`.
    pub fn encode(&self, at: u64) -> Vec<u8> {
        let mut b = vec![0u8; BLOCK_SIZE];
        put64(&mut b, 8, at);
        put64(&mut b, 32, MAGIC);
        put32(&mut b, 40, VERSION);
        self.metadata_sm.encode(&mut b[44..172]);
        put32(&mut b, 172, self.data_block_size);
        put32(&mut b, 176, (BLOCK_SIZE / 512) as u32);
        put32(&mut b, 180, self.nr_blocks);
        put32(&mut b, 184, self.current_era);
        Writesets::pack(&self.current_writeset, &mut b[188..200]);
        put64(&mut b, 200, self.writeset_tree_root);
        put64(&mut b, 208, self.era_array_root);
        put64(&mut b, 216, self.metadata_snap);
        seal(&mut b, SB_CSUM_XOR);
        b
    }

    /// `sb_check`, then the fields.
    pub fn decode(b: &[u8], at: u64) -> Result<Superblock, FormatError> {
        let invalid = |why: String| FormatError::Invalid {
            what: "era superblock",
            block: at,
            why,
        };
        let says = le64(b, 8);
        if says != at {
            return Err(FormatError::Location {
                what: "era superblock",
                block: at,
                says,
            });
        }
        if le64(b, 32) != MAGIC {
            return Err(invalid(format!("magic {}: wanted {MAGIC}", le64(b, 32))));
        }
        verify(b, SB_CSUM_XOR, "era superblock", at)?;
        let version = le32(b, 40);
        if version != VERSION {
            return Err(invalid(format!(
                "Era metadata version {version} found, but only versions between 1 and 1 supported."
            )));
        }
        Ok(Superblock {
            metadata_sm: SmRoot::decode(&b[44..]),
            data_block_size: le32(b, 172),
            nr_blocks: le32(b, 180),
            current_era: le32(b, 184),
            current_writeset: Writesets::unpack(&b[188..]),
            writeset_tree_root: le64(b, 200),
            era_array_root: le64(b, 208),
            metadata_snap: le64(b, 216),
        })
    }
}

/// An archived writeset being folded into the era array (`struct
/// digest`).
struct Digest {
    era: u32,
    words: Vec<u64>,
    nr_bits: u32,
    next_bit: u32,
}

/// What `status` shows (`struct metadata_stats`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stats {
    /// Metadata blocks in use.
    pub used: u64,
    /// Metadata blocks in all.
    pub total: u64,
    /// The current era.
    pub era: u32,
    /// The held metadata snapshot's location, [`LOCATION`] for none.
    pub snap: u64,
}

/// One era device's metadata (`struct era_metadata`).
pub struct EraMetadata {
    tm: Tm,
    block_size: u32,
    nr_blocks: u32,
    current_era: u32,
    ws: Writeset,
    writeset_tree_root: u64,
    era_array_root: u64,
    metadata_snap: u64,
    archived: bool,
    digest: Option<Digest>,
}

/// Metadata blocks a device of `bytes` holds, capped at what the
/// metadata space map counts (`DM_SM_METADATA_MAX_BLOCKS`).
pub fn metadata_blocks_of(bytes: u64) -> u64 {
    persistent_data::metadata_blocks_of(bytes)
}

impl EraMetadata {
    /// `metadata_open`: format a device whose first block is all zeroes,
    /// else read it back; the data block size must not change.
    pub fn open(dev: DeviceRef, block_size: u32) -> Result<EraMetadata, EraError> {
        let nr_meta = metadata_blocks_of(dev.size());
        if nr_meta < 8 {
            return Err(EraError::Refused(format!(
                "metadata device too small: {} bytes",
                dev.size()
            )));
        }
        let probe = BlockManager::new(dev.clone());
        let first = probe.read_block(LOCATION)?;
        if first.iter().all(|&x| x == 0) {
            // `create_fresh_metadata`.
            let mut tm = persistent_data::format(dev, nr_meta);
            let writeset_tree_root = btree::build(&mut tm, &[], &mut Writesets)?;
            let era_array_root = array::empty(&mut tm, &mut Le32)?;
            let mut md = EraMetadata::new(tm, block_size);
            md.writeset_tree_root = writeset_tree_root;
            md.era_array_root = era_array_root;
            md.commit()?;
            return Ok(md);
        }
        let sb = Superblock::decode(&first, LOCATION)?;
        if sb.data_block_size != block_size {
            return Err(EraError::Refused(format!(
                "changing the data block size (from {} to {block_size}) is not supported",
                sb.data_block_size
            )));
        }
        let ms = sb.metadata_sm;
        if ms.nr_blocks > nr_meta {
            return Err(EraError::Refused(format!(
                "metadata device has {nr_meta} blocks, its space map counts {}",
                ms.nr_blocks
            )));
        }
        let tm = persistent_data::open(dev, ms)?;
        let mut md = EraMetadata::new(tm, block_size);
        md.nr_blocks = sb.nr_blocks;
        md.current_era = sb.current_era;
        md.ws = sb.current_writeset;
        md.writeset_tree_root = sb.writeset_tree_root;
        md.era_array_root = sb.era_array_root;
        md.metadata_snap = sb.metadata_snap;
        md.archived = true;
        Ok(md)
    }

    fn new(tm: Tm, block_size: u32) -> EraMetadata {
        EraMetadata {
            tm,
            block_size,
            nr_blocks: 0,
            current_era: 0,
            ws: Writeset::default(),
            writeset_tree_root: 0,
            era_array_root: 0,
            metadata_snap: LOCATION,
            archived: false,
            digest: None,
        }
    }

    /// Origin blocks tracked.
    pub fn nr_blocks(&self) -> u32 {
        self.nr_blocks
    }

    /// The current era.
    pub fn current_era(&self) -> u32 {
        self.current_era
    }

    /// `metadata_get_stats`.
    pub fn stats(&self) -> Stats {
        Stats {
            used: self.tm.meta.nr_blocks() - self.tm.meta.nr_free(),
            total: self.tm.meta.nr_blocks(),
            era: self.current_era,
            snap: self.metadata_snap,
        }
    }

    /// `metadata_resize`: track `new_size` origin blocks (the era array
    /// grows with era 0 for the new blocks).
    pub fn resize(&mut self, new_size: u64) -> Result<(), EraError> {
        if new_size >= 1 << 31 {
            return Err(EraError::Refused(format!(
                "Invalid number of origin blocks {new_size}"
            )));
        }
        let new_size = new_size as u32;
        self.era_array_root = array::resize(
            &mut self.tm,
            self.era_array_root,
            self.nr_blocks,
            new_size,
            &mut Le32,
            &0,
        )?;
        self.nr_blocks = new_size;
        Ok(())
    }

    /// `metadata_era_archive`: the current writeset goes into the
    /// writeset tree under the current era (nothing if there is none).
    pub fn archive(&mut self) -> Result<(), EraError> {
        if self.ws.root == LOCATION {
            return Ok(());
        }
        self.writeset_tree_root = btree::insert_value(
            &mut self.tm,
            self.writeset_tree_root,
            self.current_era as u64,
            &mut Writesets,
            self.ws,
        )?;
        self.ws.root = LOCATION;
        self.archived = true;
        Ok(())
    }

    /// `metadata_era_rollover`: archive, then a new empty writeset for
    /// the next era. The caller clears its in-core bits.
    pub fn rollover(&mut self) -> Result<(), EraError> {
        self.archive()?;
        let root = bitset::empty(&mut self.tm)?;
        let root = bitset::resize(&mut self.tm, root, 0, self.nr_blocks as u64, false)?;
        self.ws = Writeset {
            nr_bits: self.nr_blocks,
            root,
        };
        self.current_era += 1;
        Ok(())
    }

    /// Mark `block` in the current writeset on disk (the in-core test is
    /// the caller's: `writeset_test_and_set`).
    pub fn mark(&mut self, block: u64) -> Result<(), EraError> {
        if self.ws.root == LOCATION || block >= self.ws.nr_bits as u64 {
            return Err(EraError::Refused(format!(
                "block {block} is outside the current writeset"
            )));
        }
        self.ws.root = bitset::set_bit(&mut self.tm, self.ws.root, block)?;
        Ok(())
    }

    /// `metadata_commit`.
    pub fn commit(&mut self) -> Result<(), EraError> {
        let sb = Superblock {
            metadata_sm: SmRoot::default(),
            data_block_size: self.block_size,
            nr_blocks: self.nr_blocks,
            current_era: self.current_era,
            current_writeset: self.ws,
            writeset_tree_root: self.writeset_tree_root,
            era_array_root: self.era_array_root,
            metadata_snap: self.metadata_snap,
        };
        persistent_data::commit(&mut self.tm, |metadata_sm| {
            Superblock { metadata_sm, ..sb }.encode(LOCATION)
        })?;
        Ok(())
    }

    /// `metadata_take_snap`: roll over, commit, then a copy of the
    /// superblock holding the writeset tree and era array as they are.
    pub fn take_snap(&mut self) -> Result<(), EraError> {
        if self.metadata_snap != LOCATION {
            return Err(EraError::Refused(
                "metadata_take_snap: metadata snapshot already exists".into(),
            ));
        }
        self.rollover()?;
        self.commit()?;
        let mut raw = self.tm.read_block(LOCATION)?;
        let clone = self.tm.copy_superblock(LOCATION)?;
        put64(&mut raw, 8, clone);
        seal(&mut raw, SB_CSUM_XOR);
        self.tm.queue_raw(clone, raw);
        self.tm.inc(self.writeset_tree_root)?;
        self.tm.inc(self.era_array_root)?;
        self.metadata_snap = clone;
        Ok(())
    }

    /// `metadata_drop_snap`.
    pub fn drop_snap(&mut self) -> Result<(), EraError> {
        let snap = self.metadata_snap;
        if snap == LOCATION {
            return Err(EraError::Refused(
                "metadata_drop_snap: no snap to drop".into(),
            ));
        }
        let raw = self
            .tm
            .raw_block(snap, &|b, at| Superblock::decode(b, at).map(|_| ()))?;
        let sb = Superblock::decode(&raw, snap)?;
        self.metadata_snap = LOCATION;
        btree::del(&mut self.tm, sb.writeset_tree_root, &mut Writesets)?;
        array::del(&mut self.tm, sb.era_array_root, &mut Le32)?;
        self.tm.unqueue_raw(snap);
        self.tm.dec(snap)?;
        Ok(())
    }

    /// One step of folding archived writesets into the era array
    /// (`kick_off_digest` + `process_old_eras`); `true` while there is
    /// more to do.
    pub fn digest_step(&mut self) -> Result<bool, EraError> {
        if self.archived {
            self.archived = false;
            if self.digest.is_none() {
                self.digest = self.next_digest()?;
            }
        }
        let Some(mut d) = self.digest.take() else {
            return Ok(false);
        };
        let mut sets = 0;
        while d.next_bit < d.nr_bits && sets < SETS_PER_STEP {
            let b = d.next_bit;
            d.next_bit += 1;
            if d.words[(b / 64) as usize] & (1 << (b % 64)) != 0 {
                self.era_array_root = array::set(
                    &mut self.tm,
                    self.era_array_root,
                    b as u64,
                    &mut Le32,
                    &d.era,
                )?;
                sets += 1;
            }
        }
        if d.next_bit < d.nr_bits {
            self.digest = Some(d);
            return Ok(true);
        }
        self.writeset_tree_root = btree::remove(
            &mut self.tm,
            self.writeset_tree_root,
            d.era as u64,
            &mut Writesets,
        )?;
        self.digest = self.next_digest()?;
        Ok(self.digest.is_some())
    }

    /// `metadata_digest_lookup_writeset`: the oldest archived writeset.
    fn next_digest(&mut self) -> Result<Option<Digest>, EraError> {
        let Some(era) = btree::first_key_from(&mut self.tm, self.writeset_tree_root, 0)? else {
            return Ok(None);
        };
        let Some(ws) = btree::lookup::<Writesets>(&mut self.tm, self.writeset_tree_root, era)?
        else {
            return Ok(None);
        };
        let nr_bits = ws.nr_bits.min(self.nr_blocks);
        let words = bitset::load(&mut self.tm, ws.root, ws.nr_bits as u64)?;
        Ok(Some(Digest {
            era: era as u32,
            words,
            nr_bits,
            next_bit: 0,
        }))
    }
}

#[cfg(test)]
mod tests;
