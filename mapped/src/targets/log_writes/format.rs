//! dm-log-writes' on-disk log, written by hand because no crate has it:
//! the layout of Linux `drivers/md/dm-log-writes.c` (`struct
//! log_write_super`, `struct log_write_entry`, the `LOG_*_FLAG` bits), which
//! xfstests' `replay-log` reads.
//!
//! The log device starts with the super block in its first logical block;
//! then, for each entry, one block holding the entry (and, for a mark, its
//! text) followed by the entry's data, `nr_sectors` logical blocks of it
//! for a write (none for a flush, a discard or a mark). All integers are
//! little-endian; "sectors" in the entries are in the data device's
//! logical block size, which the super records.

/// The entry is (or ends with) a cache flush: everything logged before it
/// was on stable storage when it completed.
pub const LOG_FLUSH_FLAG: u64 = 1 << 0;
/// A FUA write: on stable storage when it completed.
pub const LOG_FUA_FLAG: u64 = 1 << 1;
/// A discard of the entry's range; no data follows the entry.
pub const LOG_DISCARD_FLAG: u64 = 1 << 2;
/// A mark from `message ... mark TEXT`; the text follows the entry.
pub const LOG_MARK_FLAG: u64 = 1 << 3;
/// Set by filesystems on metadata writes in the kernel (`REQ_META`);
/// written by nothing here but kept so logs decode alike.
pub const LOG_METADATA_FLAG: u64 = 1 << 4;

/// The log format version the kernel writes and this reads.
pub const WRITE_LOG_VERSION: u64 = 1;
/// The super block's magic, as in dm-log-writes.c.
pub const WRITE_LOG_MAGIC: u64 = 0x006a_7366_7773_6872;

/// Bytes of an entry header (four little-endian u64).
pub const ENTRY_LEN: usize = 32;
/// Bytes of the super block's fields.
pub const SUPER_LEN: usize = 28;
/// The largest log block size read: a logical block size larger than
/// the block layer's (`BLK_MAX_BLOCK_SIZE`, 64 KiB) cannot have been
/// recorded by a kernel, and the reader allocates one such block.
pub const MAX_SECTORSIZE: u32 = 64 << 10;

/// The log's first block (kernel `struct log_write_super`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogSuper {
    /// Entries in the log after the super block.
    pub nr_entries: u64,
    /// The data device's logical block size in bytes.
    pub sectorsize: u32,
}

/// One entry's header (kernel `struct log_write_entry`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogEntry {
    /// First logical block written, in `sectorsize` units.
    pub sector: u64,
    /// Logical blocks the entry covers: written for a write (its data
    /// follows), discarded for a discard; 0 for a flush or a mark.
    pub nr_sectors: u64,
    /// The `LOG_*_FLAG` bits saying what the entry is.
    pub flags: u64,
    /// Bytes of inline data after the header: a mark's text length.
    pub data_len: u64,
}

/// Why a block is not a log's super block.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    /// The first block does not start with [`WRITE_LOG_MAGIC`].
    #[error("not a dm-log-writes log: magic {0:#x}, want {WRITE_LOG_MAGIC:#x}")]
    Magic(u64),
    /// The super block has a version other than [`WRITE_LOG_VERSION`].
    #[error("dm-log-writes log version {0} (this reads version {WRITE_LOG_VERSION})")]
    Version(u64),
    /// The super block's logical block size is out of range.
    #[error("log block size {0} is not a power of two in 512..=65536")]
    SectorSize(u32),
    /// The block read was shorter than a super block or entry header.
    #[error("short block: {0} bytes")]
    Short(usize),
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

impl LogSuper {
    /// The super block as the kernel writes it, zero-padded to `block`.
    pub fn encode(&self, block: usize) -> Vec<u8> {
        let mut b = vec![0u8; block.max(SUPER_LEN)];
        b[0..8].copy_from_slice(&WRITE_LOG_MAGIC.to_le_bytes());
        b[8..16].copy_from_slice(&WRITE_LOG_VERSION.to_le_bytes());
        b[16..24].copy_from_slice(&self.nr_entries.to_le_bytes());
        b[24..28].copy_from_slice(&self.sectorsize.to_le_bytes());
        b
    }

    /// Read the super block from the log's first block, checking magic,
    /// version and block size.
    pub fn decode(b: &[u8]) -> Result<LogSuper, FormatError> {
        if b.len() < SUPER_LEN {
            return Err(FormatError::Short(b.len()));
        }
        let magic = le64(b, 0);
        if magic != WRITE_LOG_MAGIC {
            return Err(FormatError::Magic(magic));
        }
        let version = le64(b, 8);
        if version != WRITE_LOG_VERSION {
            return Err(FormatError::Version(version));
        }
        let mut w = [0u8; 4];
        w.copy_from_slice(&b[24..28]);
        let sectorsize = u32::from_le_bytes(w);
        if !(512..=MAX_SECTORSIZE).contains(&sectorsize) || !sectorsize.is_power_of_two() {
            return Err(FormatError::SectorSize(sectorsize));
        }
        Ok(LogSuper {
            nr_entries: le64(b, 16),
            sectorsize,
        })
    }
}

impl LogEntry {
    /// The entry block: header, then `inline` (a mark's text), zero-padded
    /// to `block`.
    pub fn encode(&self, inline: &[u8], block: usize) -> Vec<u8> {
        let mut b = vec![0u8; block.max(ENTRY_LEN + inline.len())];
        b[0..8].copy_from_slice(&self.sector.to_le_bytes());
        b[8..16].copy_from_slice(&self.nr_sectors.to_le_bytes());
        b[16..24].copy_from_slice(&self.flags.to_le_bytes());
        b[24..32].copy_from_slice(&self.data_len.to_le_bytes());
        b[ENTRY_LEN..ENTRY_LEN + inline.len()].copy_from_slice(inline);
        b
    }

    /// Read an entry header from the start of its block.
    pub fn decode(b: &[u8]) -> Result<LogEntry, FormatError> {
        if b.len() < ENTRY_LEN {
            return Err(FormatError::Short(b.len()));
        }
        Ok(LogEntry {
            sector: le64(b, 0),
            nr_sectors: le64(b, 8),
            flags: le64(b, 16),
            data_len: le64(b, 24),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn super_and_entry_round_trip_in_the_kernels_layout() {
        let s = LogSuper {
            nr_entries: 7,
            sectorsize: 4096,
        };
        let b = s.encode(4096);
        assert_eq!(b.len(), 4096);
        // "rhswfsj\0": the magic's bytes as the kernel lays them down.
        assert_eq!(&b[0..8], &[0x72, 0x68, 0x73, 0x77, 0x66, 0x73, 0x6a, 0]);
        assert_eq!(LogSuper::decode(&b), Ok(s));
        let e = LogEntry {
            sector: 8,
            nr_sectors: 2,
            flags: LOG_FUA_FLAG,
            data_len: 0,
        };
        assert_eq!(LogEntry::decode(&e.encode(b"", 512)), Ok(e));
        let m = e.encode(b"mark1", 512);
        assert_eq!(&m[32..37], b"mark1");
        assert!(m[37..].iter().all(|&x| x == 0));
    }

    #[test]
    fn a_block_that_is_not_a_super_is_named() {
        assert_eq!(LogSuper::decode(&[0u8; 512]), Err(FormatError::Magic(0)));
        let mut b = LogSuper {
            nr_entries: 0,
            sectorsize: 512,
        }
        .encode(512);
        b[8] = 2;
        assert_eq!(LogSuper::decode(&b), Err(FormatError::Version(2)));
        assert_eq!(LogSuper::decode(&b[..10]), Err(FormatError::Short(10)));
    }
}
