//! dm-thin's btree value types (`dm-thin-metadata.c`
//! `__setup_btree_details`): a mapping tree's `block << 24 | time`
//! values, which hold references to data blocks in the data space map
//! (`data_block_inc`/`data_block_dec`); the top-level tree's values, the
//! roots of each device's mapping tree (`subtree_inc`/`subtree_dec`);
//! and the device details, which refer to nothing.

use super::super::format::details::DeviceDetails;
use crate::persistent_data::sm_disk;
use crate::persistent_data::space_map::SpaceMap;
use crate::persistent_data::tm::Tm;
use crate::persistent_data::value_type::{Subtrees, ValueType};
use crate::persistent_data::{le64, PdError};

/// Mapping values: `pack_block_time(data block, time)`, each holding a
/// reference to its data block.
pub struct BlockTimes<'a> {
    /// The data space map the references are counted in.
    pub data: &'a mut SpaceMap,
}

impl ValueType for BlockTimes<'_> {
    type Value = u64;
    const SIZE: usize = 8;
    fn unpack(b: &[u8]) -> u64 {
        le64(b, 0)
    }
    fn pack(v: &u64, out: &mut [u8]) {
        out[..8].copy_from_slice(&v.to_le_bytes());
    }
    fn inc(&mut self, tm: &mut Tm, v: &u64) -> Result<(), PdError> {
        self.data.inc(v >> 24);
        sm_disk::shadow_bitmaps(tm, self.data)
    }
    fn dec(&mut self, tm: &mut Tm, v: &u64) -> Result<(), PdError> {
        self.data.dec(v >> 24)?;
        sm_disk::shadow_bitmaps(tm, self.data)
    }
    /// `data_block_equal`: the same data block, whatever the time.
    fn equal(&self, a: &u64, b: &u64) -> bool {
        a >> 24 == b >> 24
    }
}

/// The top-level tree's values: each device's mapping tree root.
pub type DeviceTrees<'a> = Subtrees<BlockTimes<'a>>;

/// The top-level tree's value type, counting data blocks in `data`.
pub fn device_trees(data: &mut SpaceMap) -> DeviceTrees<'_> {
    Subtrees(BlockTimes { data })
}

/// The device details tree's values.
pub struct Details;

impl ValueType for Details {
    type Value = DeviceDetails;
    const SIZE: usize = DeviceDetails::SIZE;
    fn unpack(b: &[u8]) -> DeviceDetails {
        DeviceDetails::decode(b)
    }
    fn pack(v: &DeviceDetails, out: &mut [u8]) {
        out[..DeviceDetails::SIZE].copy_from_slice(&v.encode());
    }
}
