//! Small fixed records of dm-thin's metadata: a thin device's details
//! (`dm-thin-metadata.c` `struct disk_device_details`), a mapping tree
//! value (`pack_block_time`: data block << 24 | time), a space map's root
//! (`dm-space-map-common.h` `struct disk_sm_root`) and a bitmap index
//! entry (`struct disk_index_entry`).

use super::{le32, le64, put32, put64};

/// A thin device's record in the device-details tree (24 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceDetails {
    pub mapped_blocks: u64,
    pub transaction_id: u64,
    pub creation_time: u32,
    pub snapshotted_time: u32,
}

impl DeviceDetails {
    pub const SIZE: usize = 24;

    pub fn encode(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        put64(&mut b, 0, self.mapped_blocks);
        put64(&mut b, 8, self.transaction_id);
        put32(&mut b, 16, self.creation_time);
        put32(&mut b, 20, self.snapshotted_time);
        b
    }

    pub fn decode(b: &[u8]) -> DeviceDetails {
        DeviceDetails {
            mapped_blocks: le64(b, 0),
            transaction_id: le64(b, 8),
            creation_time: le32(b, 16),
            snapshotted_time: le32(b, 20),
        }
    }
}

/// The largest time a mapping records (24 bits).
pub const TIME_MASK: u64 = (1 << 24) - 1;

/// `pack_block_time`.
pub fn pack_block_time(block: u64, time: u32) -> u64 {
    (block << 24) | (time as u64 & TIME_MASK)
}

/// `unpack_block_time`: (data block, time).
pub fn unpack_block_time(v: u64) -> (u64, u32) {
    (v >> 24, (v & TIME_MASK) as u32)
}

/// A space map's root as the superblock holds it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SmRoot {
    pub nr_blocks: u64,
    pub nr_allocated: u64,
    /// The index: a btree (data) or one index block (metadata).
    pub bitmap_root: u64,
    /// The btree of reference counts above 2.
    pub ref_count_root: u64,
}

impl SmRoot {
    pub fn encode(&self, b: &mut [u8]) {
        put64(b, 0, self.nr_blocks);
        put64(b, 8, self.nr_allocated);
        put64(b, 16, self.bitmap_root);
        put64(b, 24, self.ref_count_root);
    }

    pub fn decode(b: &[u8]) -> SmRoot {
        SmRoot {
            nr_blocks: le64(b, 0),
            nr_allocated: le64(b, 8),
            bitmap_root: le64(b, 16),
            ref_count_root: le64(b, 24),
        }
    }
}

/// Where one bitmap block is, and a summary of it (16 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexEntry {
    pub blocknr: u64,
    pub nr_free: u32,
    pub none_free_before: u32,
}

impl IndexEntry {
    pub const SIZE: usize = 16;

    pub fn encode(&self, b: &mut [u8]) {
        put64(b, 0, self.blocknr);
        put32(b, 8, self.nr_free);
        put32(b, 12, self.none_free_before);
    }

    pub fn decode(b: &[u8]) -> IndexEntry {
        IndexEntry {
            blocknr: le64(b, 0),
            nr_free: le32(b, 8),
            none_free_before: le32(b, 12),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let d = DeviceDetails {
            mapped_blocks: 5,
            transaction_id: 6,
            creation_time: 7,
            snapshotted_time: 8,
        };
        assert_eq!(DeviceDetails::decode(&d.encode()), d);
        assert_eq!(unpack_block_time(pack_block_time(12345, 77)), (12345, 77));
        let mut b = [0u8; 16];
        let e = IndexEntry {
            blocknr: 9,
            nr_free: 10,
            none_free_before: 11,
        };
        e.encode(&mut b);
        assert_eq!(IndexEntry::decode(&b), e);
    }
}
