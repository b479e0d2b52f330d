//! Small fixed records of dm-thin's metadata: a thin device's details
//! (`dm-thin-metadata.c` `struct disk_device_details`), a mapping tree
//! value (`pack_block_time`: data block << 24 | time), a space map's root
//! (`dm-space-map-common.h` `struct disk_sm_root`) and a bitmap index
//! entry (`struct disk_index_entry`).

use super::{le32, le64, put32, put64};

/// A thin device's record in the device-details tree (24 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceDetails {
    /// Blocks mapped by the device (`dmsetup status`'s mapped sectors, in
    /// pool blocks).
    pub mapped_blocks: u64,
    /// The pool transaction that last changed the device.
    pub transaction_id: u64,
    /// The pool time (snapshot count) when the device was created.
    pub creation_time: u32,
    /// The pool time when a snapshot of it was last taken: mappings older
    /// than this are shared and must be broken on write.
    pub snapshotted_time: u32,
}

impl DeviceDetails {
    /// Bytes of the record on disk.
    pub const SIZE: usize = 24;

    /// The little-endian on-disk record.
    pub fn encode(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        put64(&mut b, 0, self.mapped_blocks);
        put64(&mut b, 8, self.transaction_id);
        put32(&mut b, 16, self.creation_time);
        put32(&mut b, 20, self.snapshotted_time);
        b
    }

    /// Read a record from the first [`DeviceDetails::SIZE`] bytes of `b`.
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
    /// Blocks the space map covers.
    pub nr_blocks: u64,
    /// Blocks with a reference count above zero.
    pub nr_allocated: u64,
    /// The index: a btree (data) or one index block (metadata).
    pub bitmap_root: u64,
    /// The btree of reference counts above 2.
    pub ref_count_root: u64,
}

impl SmRoot {
    /// Write the 32-byte on-disk root into the start of `b`.
    pub fn encode(&self, b: &mut [u8]) {
        put64(b, 0, self.nr_blocks);
        put64(b, 8, self.nr_allocated);
        put64(b, 16, self.bitmap_root);
        put64(b, 24, self.ref_count_root);
    }

    /// Read a root from the start of `b`.
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
    /// The metadata block holding the bitmap.
    pub blocknr: u64,
    /// Free entries in that bitmap block.
    pub nr_free: u32,
    /// Index within the bitmap block below which no entry is free: where a
    /// search for a free block starts.
    pub none_free_before: u32,
}

impl IndexEntry {
    /// Bytes of the entry on disk.
    pub const SIZE: usize = 16;

    /// Write the on-disk entry into the start of `b`.
    pub fn encode(&self, b: &mut [u8]) {
        put64(b, 0, self.blocknr);
        put32(b, 8, self.nr_free);
        put32(b, 12, self.none_free_before);
    }

    /// Read an entry from the start of `b`.
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
