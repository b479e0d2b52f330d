//! The space maps' on-disk records (`persistent-data/dm-space-map-common.h`
//! and `.c`): bitmap blocks, two bits per block (0, 1, 2, or 3 meaning
//! "see the reference count tree"), in 64-bit little-endian words, the
//! high bit of each pair first (`sm_lookup_bitmap`); the index entries
//! that say where each bitmap is (`struct disk_index_entry`), in a btree
//! for a disk space map or in one index block for the metadata space
//! map (`struct disk_metadata_index`); and a space map's root as a
//! superblock holds it (`struct disk_sm_root`).

use super::checksum::{check_block, seal, BITMAP_XOR, INDEX_XOR};
use super::{le32, le64, put32, put64, FormatError, BLOCK_SIZE};

const HEADER: usize = 16;

/// Blocks one bitmap block counts.
pub const ENTRIES_PER_BITMAP: u64 = ((BLOCK_SIZE - HEADER) * 4) as u64;

/// `MAX_METADATA_BITMAPS`: the metadata index block's capacity.
pub const MAX_METADATA_BITMAPS: usize = 255;

/// The 2-bit value of entry `i` of a bitmap block.
pub fn get(b: &[u8], i: usize) -> u32 {
    let w = le64(b, HEADER + (i / 32) * 8);
    let bit = (i % 32) * 2;
    let hi = (w >> bit) & 1;
    let lo = (w >> (bit + 1)) & 1;
    ((hi << 1) | lo) as u32
}

/// Build a bitmap block at `blocknr` from up to [`ENTRIES_PER_BITMAP`]
/// reference counts (counts above 2 are stored as 3).
pub fn encode(counts: &[u32], blocknr: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK_SIZE];
    put64(&mut b, 8, blocknr);
    for (wi, chunk) in counts.chunks(32).enumerate() {
        let mut w = 0u64;
        for (j, &c) in chunk.iter().enumerate() {
            let v = c.min(3) as u64;
            let bit = j * 2;
            w |= ((v >> 1) & 1) << bit;
            w |= (v & 1) << (bit + 1);
        }
        put64(&mut b, HEADER + wi * 8, w);
    }
    seal(&mut b, BITMAP_XOR);
    b
}

/// Check a bitmap block read from `at`.
pub fn check(b: &[u8], at: u64) -> Result<(), FormatError> {
    check_block(b, at, BITMAP_XOR, "space map bitmap")
}

/// The metadata space map's index block (`struct disk_metadata_index`).
pub fn encode_index(entries: &[IndexEntry], blocknr: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK_SIZE];
    put64(&mut b, 8, blocknr);
    for (i, e) in entries.iter().take(MAX_METADATA_BITMAPS).enumerate() {
        let at = HEADER + i * IndexEntry::SIZE;
        e.encode(&mut b[at..at + IndexEntry::SIZE]);
    }
    seal(&mut b, INDEX_XOR);
    b
}

/// Read the first `n` entries of a metadata index block at `at`.
pub fn decode_index(b: &[u8], at: u64, n: usize) -> Result<Vec<IndexEntry>, FormatError> {
    check_block(b, at, INDEX_XOR, "metadata space map index")?;
    if n > MAX_METADATA_BITMAPS {
        return Err(FormatError::Invalid {
            what: "metadata space map index",
            block: at,
            why: format!("{n} bitmaps, at most {MAX_METADATA_BITMAPS}"),
        });
    }
    Ok((0..n)
        .map(|i| {
            let at = HEADER + i * IndexEntry::SIZE;
            IndexEntry::decode(&b[at..at + IndexEntry::SIZE])
        })
        .collect())
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
    fn bitmap_entries_round_trip_high_bit_first() {
        let counts: Vec<u32> = (0..100).map(|i| i % 5).collect();
        let b = encode(&counts, 4);
        check(&b, 4).unwrap();
        for (i, &c) in counts.iter().enumerate() {
            assert_eq!(get(&b, i), c.min(3), "entry {i}");
        }
        // Entry 0 with count 1 sets bit 1 of the first word (the low bit
        // of the pair comes second), as sm_set_bitmap does.
        let b = encode(&[1], 0);
        assert_eq!(le64(&b, HEADER), 2);
        let b = encode(&[2], 0);
        assert_eq!(le64(&b, HEADER), 1);
    }

    #[test]
    fn index_entries_round_trip() {
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
