//! Opening (formatting or reading back) and committing a pool's metadata
//! (`dm-thin-metadata.c` `__format_metadata`, `__open_metadata`,
//! `__commit_transaction`; the space maps' `sm_ll_commit` and
//! `sm_metadata`'s self-counting index).

use super::super::format::details::{DeviceDetails, IndexEntry, SmRoot};
use super::super::format::superblock::{self, Superblock};
use super::super::format::{le32, BLOCK_SIZE};
use super::btree;
use super::space_map::SpaceMap;
use super::tm::{Tm, ValueKind};
use super::{DevState, MetadataError, PoolMetadata};
use crate::persistent_data::bitmap::{self, ENTRIES_PER_BITMAP, MAX_METADATA_BITMAPS};
use crate::target::DevArg;
use std::collections::BTreeMap;

/// Where the space maps' own structures are on disk.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct SmPlaces {
    data_index_root: u64,
    data_rc_root: u64,
    meta_index: u64,
    meta_rc_root: u64,
}

/// The metadata blocks a device of `bytes` has room for
/// (`THIN_METADATA_MAX_SECTORS` caps it at what 255 bitmaps count).
pub fn metadata_blocks_of(bytes: u64) -> u64 {
    (bytes / BLOCK_SIZE as u64).min(MAX_METADATA_BITMAPS as u64 * ENTRIES_PER_BITMAP)
}

pub(super) fn open(
    dev: DevArg,
    data_blocks: u64,
    data_block_size: u32,
) -> Result<PoolMetadata, MetadataError> {
    let nr_meta = metadata_blocks_of(dev.dev.size());
    if nr_meta < 16 {
        return Err(MetadataError::Refused(format!(
            "metadata device too small: {} bytes",
            dev.dev.size()
        )));
    }
    let tm = Tm::new(dev, SpaceMap::new(nr_meta), SpaceMap::new(data_blocks));
    let first = tm.read_block(superblock::LOCATION)?;
    if Superblock::is_blank(&first) {
        return format(tm, data_block_size);
    }
    let sb = Superblock::decode(&first, superblock::LOCATION)?;
    if sb.data_block_size != data_block_size {
        return Err(MetadataError::Refused(format!(
            "changing the data block size (from {} to {data_block_size}) is not supported",
            sb.data_block_size
        )));
    }
    load(tm, sb, data_blocks)
}

fn format(mut tm: Tm, data_block_size: u32) -> Result<PoolMetadata, MetadataError> {
    tm.meta.inc(superblock::LOCATION);
    let root = btree::build(&mut tm, &[], 8, ValueKind::Subtree)?;
    let details_root = btree::build(&mut tm, &[], DeviceDetails::SIZE, ValueKind::Plain)?;
    let mut pmd = PoolMetadata {
        tm,
        root,
        details_root,
        time: 0,
        trans_id: 0,
        held_root: 0,
        flags: 0,
        data_block_size,
        devices: BTreeMap::new(),
        sm: SmPlaces::default(),
        cache: Default::default(),
        dirty: true,
    };
    commit(&mut pmd)?;
    Ok(pmd)
}

fn load(mut tm: Tm, sb: Superblock, data_blocks: u64) -> Result<PoolMetadata, MetadataError> {
    let ms = sb.metadata_sm;
    if ms.nr_blocks > tm.meta.nr_blocks() {
        return Err(MetadataError::Refused(format!(
            "metadata device has {} blocks, its space map counts {}",
            tm.meta.nr_blocks(),
            ms.nr_blocks
        )));
    }
    // Nodes are checked against the metadata space map's size.
    tm.meta = SpaceMap::new(ms.nr_blocks);
    let n_meta = ms.nr_blocks.div_ceil(ENTRIES_PER_BITMAP) as usize;
    let index = bitmap::decode_index(&tm.read_block(ms.bitmap_root)?, ms.bitmap_root, n_meta)?;
    let meta = load_sm(&mut tm, ms, &index)?;
    let ds = sb.data_sm;
    if ds.nr_blocks > data_blocks {
        return Err(MetadataError::Refused(format!(
            "pool target ({data_blocks} blocks) too small: expected {}",
            ds.nr_blocks
        )));
    }
    let entries = btree::walk(&mut tm, ds.bitmap_root, IndexEntry::SIZE)?;
    let index: Vec<IndexEntry> = entries.iter().map(|(_, v)| IndexEntry::decode(v)).collect();
    if index.len() as u64 != ds.nr_blocks.div_ceil(ENTRIES_PER_BITMAP) {
        return Err(MetadataError::corrupt(
            ds.bitmap_root,
            "data space map index has the wrong number of bitmaps",
        ));
    }
    let mut data = load_sm(&mut tm, ds, &index)?;
    tm.meta = meta;
    if data_blocks > data.nr_blocks() {
        data.extend(data_blocks);
    }
    tm.data = data;
    let mut devices = BTreeMap::new();
    for (k, v) in btree::walk(&mut tm, sb.device_details_root, DeviceDetails::SIZE)? {
        let details = DeviceDetails::decode(&v);
        devices.insert(
            k,
            DevState {
                details,
                changed: false,
            },
        );
    }
    let dirty = tm.data.nr_blocks() != ds.nr_blocks;
    Ok(PoolMetadata {
        tm,
        root: sb.data_mapping_root,
        details_root: sb.device_details_root,
        time: sb.time,
        trans_id: sb.trans_id,
        held_root: sb.held_root,
        flags: sb.flags,
        data_block_size: sb.data_block_size,
        devices,
        cache: Default::default(),
        sm: SmPlaces {
            data_index_root: ds.bitmap_root,
            data_rc_root: ds.ref_count_root,
            meta_index: ms.bitmap_root,
            meta_rc_root: ms.ref_count_root,
        },
        dirty,
    })
}

/// Read a space map's counts from its bitmaps and reference count tree.
fn load_sm(tm: &mut Tm, root: SmRoot, index: &[IndexEntry]) -> Result<SpaceMap, MetadataError> {
    let mut counts = vec![0u32; root.nr_blocks as usize];
    let mut blocks = Vec::with_capacity(index.len());
    for (i, ie) in index.iter().enumerate() {
        let raw = tm.read_block(ie.blocknr)?;
        bitmap::check(&raw, ie.blocknr)?;
        let start = i * ENTRIES_PER_BITMAP as usize;
        let end = (start + ENTRIES_PER_BITMAP as usize).min(counts.len());
        for (j, c) in counts[start..end].iter_mut().enumerate() {
            *c = bitmap::get(&raw, j);
        }
        blocks.push(ie.blocknr);
    }
    for (b, v) in btree::walk(tm, root.ref_count_root, 4)? {
        match counts.get_mut(b as usize) {
            Some(c) if *c == 3 => *c = le32(&v, 0),
            _ => {
                return Err(MetadataError::corrupt(
                    root.ref_count_root,
                    "reference count of a block whose bitmap entry is not 3",
                ))
            }
        }
    }
    Ok(SpaceMap::loaded(counts, blocks))
}

/// Kernel `__commit_transaction` (see the module doc of `metadata`).
pub(super) fn commit(pmd: &mut PoolMetadata) -> Result<(), MetadataError> {
    write_changed_details(pmd)?;
    let data_sm = commit_data_sm(pmd)?;
    let metadata_sm = commit_metadata_sm(pmd)?;
    let tm = &mut pmd.tm;
    tm.write_shadows()?;
    tm.flush()?;
    let sb = Superblock {
        flags: pmd.flags,
        blocknr: superblock::LOCATION,
        time: pmd.time,
        trans_id: pmd.trans_id,
        held_root: pmd.held_root,
        data_sm,
        metadata_sm,
        data_mapping_root: pmd.root,
        device_details_root: pmd.details_root,
        data_block_size: pmd.data_block_size,
        metadata_nr_blocks: tm.meta.nr_blocks(),
    };
    tm.write_block(superblock::LOCATION, &mut sb.encode(), true)?;
    tm.flush()?;
    tm.committed();
    pmd.dirty = false;
    Ok(())
}

fn write_changed_details(pmd: &mut PoolMetadata) -> Result<(), MetadataError> {
    let changed: Vec<(u64, DeviceDetails)> = pmd
        .devices
        .iter()
        .filter(|(_, s)| s.changed)
        .map(|(k, s)| (*k, s.details))
        .collect();
    for (dev, d) in changed {
        let v = d.encode().to_vec();
        pmd.details_root = btree::insert(
            &mut pmd.tm,
            pmd.details_root,
            dev,
            ValueKind::Plain,
            &mut |_, _| Ok(v.clone()),
        )?;
        if let Some(s) = pmd.devices.get_mut(&dev) {
            s.changed = false;
        }
    }
    Ok(())
}

fn index_entry(sm: &SpaceMap, i: usize) -> IndexEntry {
    let counts = sm.bitmap_counts(i);
    let used = counts.iter().filter(|&&c| c > 0).count() as u32;
    let first_free = counts.iter().position(|&c| c == 0).unwrap_or(counts.len());
    IndexEntry {
        blocknr: sm.bitmap_blocks[i],
        nr_free: ENTRIES_PER_BITMAP as u32 - used,
        none_free_before: first_free as u32,
    }
}

fn sm_root(sm: &SpaceMap, bitmap_root: u64, ref_count_root: u64) -> SmRoot {
    SmRoot {
        nr_blocks: sm.nr_blocks(),
        nr_allocated: sm.nr_allocated(),
        bitmap_root,
        ref_count_root,
    }
}

fn overflow_entries(sm: &SpaceMap) -> Vec<(u64, Vec<u8>)> {
    sm.overflow()
        .into_iter()
        .map(|(b, c)| (b, c.to_le_bytes().to_vec()))
        .collect()
}

/// The data space map: changed bitmaps to new blocks, a new index tree
/// and reference count tree (`sm_disk_commit`).
fn commit_data_sm(pmd: &mut PoolMetadata) -> Result<SmRoot, MetadataError> {
    let tm = &mut pmd.tm;
    for i in 0..tm.data.nr_bitmaps() {
        if tm.data.dirty[i] || tm.data.bitmap_blocks[i] == 0 {
            let new = tm.meta.alloc().ok_or(MetadataError::NoMetadataSpace)?;
            let old = std::mem::replace(&mut tm.data.bitmap_blocks[i], new);
            if old != 0 {
                tm.meta.dec(old)?;
            }
            let raw = bitmap::encode(tm.data.bitmap_counts(i), new);
            tm.raw_dirty.insert(new, raw);
        }
    }
    let index: Vec<(u64, Vec<u8>)> = (0..tm.data.nr_bitmaps())
        .map(|i| {
            let mut v = vec![0u8; IndexEntry::SIZE];
            index_entry(&tm.data, i).encode(&mut v);
            (i as u64, v)
        })
        .collect();
    let index_root = btree::build(tm, &index, IndexEntry::SIZE, ValueKind::Plain)?;
    let rc_root = btree::build(tm, &overflow_entries(&tm.data), 4, ValueKind::Plain)?;
    for old in [pmd.sm.data_index_root, pmd.sm.data_rc_root] {
        if old != 0 {
            tm.del(old, ValueKind::Plain)?;
        }
    }
    pmd.sm.data_index_root = index_root;
    pmd.sm.data_rc_root = rc_root;
    Ok(sm_root(&tm.data, index_root, rc_root))
}

/// The metadata space map counts the blocks that hold it: new blocks
/// for its changed bitmaps are taken until taking them changes no
/// bitmap that has not got one yet.
fn commit_metadata_sm(pmd: &mut PoolMetadata) -> Result<SmRoot, MetadataError> {
    let tm = &mut pmd.tm;
    if pmd.sm.meta_rc_root != 0 {
        tm.del(pmd.sm.meta_rc_root, ValueKind::Plain)?;
    }
    if pmd.sm.meta_index != 0 {
        tm.meta.dec(pmd.sm.meta_index)?;
    }
    let rc_root = btree::build(tm, &overflow_entries(&tm.meta), 4, ValueKind::Plain)?;
    let index_block = tm.meta.alloc().ok_or(MetadataError::NoMetadataSpace)?;
    loop {
        let mut changed = false;
        for i in 0..tm.meta.nr_bitmaps() {
            if (tm.meta.dirty[i] || tm.meta.bitmap_blocks[i] == 0) && !tm.meta.fresh[i] {
                let new = tm.meta.alloc().ok_or(MetadataError::NoMetadataSpace)?;
                let old = std::mem::replace(&mut tm.meta.bitmap_blocks[i], new);
                if old != 0 {
                    tm.meta.dec(old)?;
                }
                tm.meta.fresh[i] = true;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    let mut index = Vec::with_capacity(tm.meta.nr_bitmaps());
    for i in 0..tm.meta.nr_bitmaps() {
        if tm.meta.fresh[i] {
            let b = tm.meta.bitmap_blocks[i];
            tm.raw_dirty
                .insert(b, bitmap::encode(tm.meta.bitmap_counts(i), b));
        }
        index.push(index_entry(&tm.meta, i));
    }
    tm.raw_dirty
        .insert(index_block, bitmap::encode_index(&index, index_block));
    pmd.sm.meta_index = index_block;
    pmd.sm.meta_rc_root = rc_root;
    Ok(sm_root(&tm.meta, index_block, rc_root))
}
