//! The pool's superblock at metadata block 0 (`dm-thin-metadata.c`
//! `struct thin_disk_superblock`): where the trees and space maps of the
//! last committed transaction start. Writing it is the commit; everything
//! it points to was written and flushed before.

use super::{le32, le64, put32, put64, FormatError, BLOCK_SIZE};
use crate::persistent_data::bitmap::SmRoot;
use crate::persistent_data::checksum::{check_block, seal};

/// `dm-thin-metadata.c` SUPERBLOCK_CSUM_XOR.
pub const SUPERBLOCK_XOR: u32 = 160774;
/// `THIN_SUPERBLOCK_MAGIC`.
pub const MAGIC: u64 = 27022010;
/// `THIN_VERSION`.
pub const VERSION: u32 = 2;
/// `THIN_METADATA_NEEDS_CHECK_FLAG`.
pub const NEEDS_CHECK: u32 = 1;
/// The superblock's location.
pub const LOCATION: u64 = 0;

const DATA_SM_ROOT: usize = 64;
const META_SM_ROOT: usize = 192;

/// The superblock's fields (kernel `struct thin_disk_superblock`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Superblock {
    /// Superblock flags: [`NEEDS_CHECK`] or none.
    pub flags: u32,
    /// The block this copy lives at (0, or a held metadata snapshot's).
    pub blocknr: u64,
    /// The pool's time: incremented by each snapshot, recorded in mappings
    /// so a write can tell whether its block is shared.
    pub time: u32,
    /// The transaction id userspace sets (`set_transaction_id` message).
    pub trans_id: u64,
    /// The metadata snapshot's superblock copy, 0 if none.
    pub held_root: u64,
    /// The data device's space map.
    pub data_sm: SmRoot,
    /// The metadata device's own space map.
    pub metadata_sm: SmRoot,
    /// Root of the two-level mapping tree: device id, then virtual block to
    /// (data block, time).
    pub data_mapping_root: u64,
    /// Root of the device-details tree: device id to [`super::details::DeviceDetails`].
    pub device_details_root: u64,
    /// In 512-byte sectors.
    pub data_block_size: u32,
    /// Blocks on the metadata device.
    pub metadata_nr_blocks: u64,
}

impl Superblock {
    /// The superblock as metadata block 0 (or a held copy's block), sealed
    /// with its checksum.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; BLOCK_SIZE];
        put32(&mut b, 4, self.flags);
        put64(&mut b, 8, self.blocknr);
        put64(&mut b, 32, MAGIC);
        put32(&mut b, 40, VERSION);
        put32(&mut b, 44, self.time);
        put64(&mut b, 48, self.trans_id);
        put64(&mut b, 56, self.held_root);
        self.data_sm.encode(&mut b[DATA_SM_ROOT..DATA_SM_ROOT + 32]);
        self.metadata_sm
            .encode(&mut b[META_SM_ROOT..META_SM_ROOT + 32]);
        put64(&mut b, 320, self.data_mapping_root);
        put64(&mut b, 328, self.device_details_root);
        put32(&mut b, 336, self.data_block_size);
        put32(&mut b, 340, (BLOCK_SIZE / 512) as u32);
        put64(&mut b, 344, self.metadata_nr_blocks);
        seal(&mut b, SUPERBLOCK_XOR);
        b
    }

    /// Decode and validate as the kernel's `sb_check` does (location,
    /// checksum, magic) plus the version and feature flags it refuses.
    pub fn decode(b: &[u8], at: u64) -> Result<Superblock, FormatError> {
        let what = "superblock";
        check_block(b, at, SUPERBLOCK_XOR, what)?;
        let invalid = |why: String| FormatError::Invalid {
            what,
            block: at,
            why,
        };
        if le64(b, 32) != MAGIC {
            return Err(invalid(format!("magic {} is not {MAGIC}", le64(b, 32))));
        }
        let version = le32(b, 40);
        if !(1..=VERSION).contains(&version) {
            return Err(invalid(format!("unsupported version {version}")));
        }
        let (incompat, ro) = (le32(b, 360), le32(b, 356));
        if incompat != 0 || ro != 0 {
            return Err(invalid(format!(
                "unsupported features: incompat {incompat:#x} compat_ro {ro:#x}"
            )));
        }
        if le32(b, 340) as usize != BLOCK_SIZE / 512 {
            return Err(invalid(format!(
                "metadata block size {} sectors",
                le32(b, 340)
            )));
        }
        Ok(Superblock {
            flags: le32(b, 4),
            blocknr: at,
            time: le32(b, 44),
            trans_id: le64(b, 48),
            held_root: le64(b, 56),
            data_sm: SmRoot::decode(&b[DATA_SM_ROOT..DATA_SM_ROOT + 32]),
            metadata_sm: SmRoot::decode(&b[META_SM_ROOT..META_SM_ROOT + 32]),
            data_mapping_root: le64(b, 320),
            device_details_root: le64(b, 328),
            data_block_size: le32(b, 336),
            metadata_nr_blocks: le64(b, 344),
        })
    }

    /// Whether the superblock's block is all zeroes
    /// (`__superblock_all_zeroes`): only such a metadata device is
    /// formatted; anything else must decode.
    pub fn is_blank(b: &[u8]) -> bool {
        b.iter().all(|&x| x == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn superblock_round_trips_and_refuses_damage() {
        let sb = Superblock {
            flags: 0,
            blocknr: 0,
            time: 3,
            trans_id: 9,
            held_root: 0,
            data_sm: SmRoot {
                nr_blocks: 100,
                nr_allocated: 4,
                bitmap_root: 7,
                ref_count_root: 8,
            },
            metadata_sm: SmRoot::default(),
            data_mapping_root: 11,
            device_details_root: 12,
            data_block_size: 128,
            metadata_nr_blocks: 1024,
        };
        let mut b = sb.encode();
        assert_eq!(Superblock::decode(&b, 0), Ok(sb));
        assert!(Superblock::decode(&b, 5).is_err(), "wrong location");
        b[300] ^= 1;
        assert!(Superblock::decode(&b, 0).is_err(), "checksum");
    }
}
