//! Opening (formatting or reading back) and committing a pool's metadata
//! (`dm-thin-metadata.c` `__format_metadata`, `__open_metadata`,
//! `__commit_transaction`), in the order dm-thin does it; the space
//! maps' own commits are persistent-data's (`sm_disk`, `sm_metadata`).

use super::super::format::details::DeviceDetails;
use super::super::format::superblock::{self, Superblock};
use super::values::Details;
use super::{DevState, MetadataError, PoolMetadata};
use crate::persistent_data::block_manager::BlockManager;
use crate::persistent_data::space_map::SpaceMap;
use crate::persistent_data::tm::Tm;
use crate::persistent_data::value_type::Le64;
use crate::persistent_data::{self, btree, sm_disk, sm_metadata};
use crate::target::DevArg;
use std::collections::BTreeMap;

/// The metadata blocks a device of `bytes` has room for
/// (`THIN_METADATA_MAX_SECTORS` caps it at what 255 bitmaps count).
pub fn metadata_blocks_of(bytes: u64) -> u64 {
    crate::persistent_data::metadata_blocks_of(bytes)
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
    let tm = Tm::new(BlockManager::new(dev.dev.clone()), SpaceMap::new(nr_meta));
    let first = tm.read_block(superblock::LOCATION)?;
    if Superblock::is_blank(&first) {
        let tm = persistent_data::format(dev.dev, nr_meta);
        return format(tm, data_blocks, data_block_size);
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

/// `__format_metadata` and the first `pool_preresume`: the data space
/// map made empty (`dm_sm_disk_create(tm, 0)`), the mapping and details
/// trees, a commit; then the data space map grown to the data device
/// (`dm_pool_resize_data_dev`) and committed again, so the blocks in use
/// are the kernel's after `dmsetup create` of a fresh pool.
fn format(
    mut tm: Tm,
    data_blocks: u64,
    data_block_size: u32,
) -> Result<PoolMetadata, MetadataError> {
    let data = sm_disk::create(&mut tm, 0)?;
    let root = btree::build(&mut tm, &[], &mut Le64)?;
    let details_root = btree::build(&mut tm, &[], &mut Details)?;
    let mut pmd = PoolMetadata {
        tm,
        data,
        root,
        details_root,
        time: 0,
        trans_id: 0,
        held_root: 0,
        flags: 0,
        data_block_size,
        devices: BTreeMap::new(),
        cache: Default::default(),
        dirty: true,
    };
    commit(&mut pmd)?;
    pmd.data.extend(data_blocks);
    sm_disk::shadow_bitmaps(&mut pmd.tm, &mut pmd.data)?;
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
    let meta = sm_metadata::open(&mut tm, ms)?;
    let ds = sb.data_sm;
    if ds.nr_blocks > data_blocks {
        return Err(MetadataError::Refused(format!(
            "pool target ({data_blocks} blocks) too small: expected {}",
            ds.nr_blocks
        )));
    }
    let mut data = sm_disk::open(&mut tm, ds)?;
    tm.meta = meta;
    if data_blocks > data.nr_blocks() {
        data.extend(data_blocks);
    }
    let mut devices = BTreeMap::new();
    for (k, details) in btree::walk::<Details>(&mut tm, sb.device_details_root)? {
        devices.insert(
            k,
            DevState {
                details,
                changed: false,
            },
        );
    }
    let dirty = data.nr_blocks() != ds.nr_blocks;
    Ok(PoolMetadata {
        tm,
        data,
        root: sb.data_mapping_root,
        details_root: sb.device_details_root,
        time: sb.time,
        trans_id: sb.trans_id,
        held_root: sb.held_root,
        flags: sb.flags,
        data_block_size: sb.data_block_size,
        devices,
        cache: Default::default(),
        dirty,
    })
}

/// Kernel `__commit_transaction` (see the module doc of `metadata`).
pub(super) fn commit(pmd: &mut PoolMetadata) -> Result<(), MetadataError> {
    write_changed_details(pmd)?;
    let data_sm = sm_disk::commit(&mut pmd.tm, &mut pmd.data)?;
    let sb = Superblock {
        flags: pmd.flags,
        blocknr: superblock::LOCATION,
        time: pmd.time,
        trans_id: pmd.trans_id,
        held_root: pmd.held_root,
        data_sm,
        metadata_sm: Default::default(),
        data_mapping_root: pmd.root,
        device_details_root: pmd.details_root,
        data_block_size: pmd.data_block_size,
        metadata_nr_blocks: pmd.tm.meta.nr_blocks(),
    };
    persistent_data::commit(&mut pmd.tm, |metadata_sm| {
        Superblock { metadata_sm, ..sb }.encode()
    })?;
    pmd.data.committed();
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
        pmd.details_root =
            btree::insert_value(&mut pmd.tm, pmd.details_root, dev, &mut Details, d)?;
        if let Some(s) = pmd.devices.get_mut(&dev) {
            s.changed = false;
        }
    }
    Ok(())
}
