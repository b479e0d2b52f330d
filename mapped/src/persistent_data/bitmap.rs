//! Space map bitmap blocks and the metadata space map's index block
//! (`persistent-data/dm-space-map-common.c`): two bits per block (0, 1,
//! 2, or 3 meaning "see the reference count tree"), in 64-bit
//! little-endian words, the high bit of each pair first
//! (`sm_lookup_bitmap`).

use super::checksum::{check_block, seal, BITMAP_XOR, INDEX_XOR};
use super::{le64, put64, FormatError, BLOCK_SIZE};
use crate::targets::thin::format::details::IndexEntry;

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
}
