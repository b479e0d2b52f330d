//! Small fixed records of dm-thin's metadata: a thin device's details
//! (`dm-thin-metadata.c` `struct disk_device_details`) and a mapping tree
//! value (`pack_block_time`: data block << 24 | time). The space maps'
//! records are persistent-data's (`persistent_data/bitmap.rs`).

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
    }
}
