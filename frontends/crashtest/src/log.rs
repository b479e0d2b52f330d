//! Reading a dm-log-writes log (its format is the kernel's, in
//! `blkstack_mapped::targets::log_writes::format`) entry by entry, as
//! xfstests' `src/log-writes/log-writes.c` walks it: the super block, then
//! for each entry one block of header (and a mark's text), then its data
//! unless it is a discard. Every read is bounded by the log's own size, so
//! a log that lies about its entry count or lengths ends in an error that
//! names the entry, never in a huge allocation or a read past the end; the
//! log block is at most 64 KiB and no larger than the log; and an entry's
//! byte range on the device (`sector` and `nr_sectors` times the block
//! size) is computed with checked arithmetic, so a range that does not fit
//! in 64 bits is a malformed entry, never one that wraps to byte 0.

use blkstack_mapped::targets::log_writes::format::{
    FormatError, LogEntry, LogSuper, ENTRY_LEN, LOG_DISCARD_FLAG, LOG_MARK_FLAG,
};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Why a log cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("cannot open the log {path}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}")]
    Super { path: String, source: FormatError },
    #[error("reading the log at byte {at}")]
    Read { at: u64, source: std::io::Error },
    #[error("the log ends inside entry {entry} (at byte {at}, log is {size} bytes): truncated")]
    Truncated { entry: u64, at: u64, size: u64 },
    #[error("malformed entry {entry} at log block {block}")]
    Malformed { entry: u64, block: u64 },
    #[error(
        "entry {entry} covers device bytes {at}..{at}+{len}, which do not fit in 64 bits: malformed"
    )]
    Range { entry: u64, at: u64, len: u64 },
    #[error("the log's block size {sectorsize} is larger than the log itself ({size} bytes)")]
    BlockLargerThanLog { sectorsize: u32, size: u64 },
}

/// One entry of the log, with where its data is.
#[derive(Clone, Debug)]
pub struct Entry {
    /// Its number, from 0.
    pub index: u64,
    /// Log block (in the log's block size) of its header.
    pub block: u64,
    pub header: LogEntry,
    /// A mark's text (empty for the others).
    pub mark: String,
    /// Byte offset in the log of its data, and the data's length.
    pub data_at: u64,
    pub data_len: u64,
    /// The device bytes it covers (written, or discarded): `sector` and
    /// `nr_sectors` in bytes, checked to fit in 64 bits.
    pub dev_at: u64,
    pub dev_len: u64,
}

impl Entry {
    pub fn is(&self, flag: u64) -> bool {
        self.header.flags & flag != 0
    }
}

pub struct LogReader {
    file: File,
    size: u64,
    pub sup: LogSuper,
    /// Byte offset of the next entry's header, and its number.
    pos: u64,
    next: u64,
}

impl LogReader {
    pub fn open(path: &Path) -> Result<LogReader, LogError> {
        let shown = path.display().to_string();
        let file = File::open(path).map_err(|source| LogError::Open {
            path: shown.clone(),
            source,
        })?;
        let size = device_size(&file).map_err(|source| LogError::Open {
            path: shown.clone(),
            source,
        })?;
        let mut head = [0u8; 512];
        read_exact_at(&file, &mut head, 0, size, 0)?;
        let sup = LogSuper::decode(&head).map_err(|source| LogError::Super {
            path: shown,
            source,
        })?;
        if sup.sectorsize as u64 > size {
            return Err(LogError::BlockLargerThanLog {
                sectorsize: sup.sectorsize,
                size,
            });
        }
        Ok(LogReader {
            file,
            size,
            pos: sup.sectorsize as u64,
            next: 0,
            sup,
        })
    }

    fn bs(&self) -> u64 {
        self.sup.sectorsize as u64
    }

    /// The next entry, or `None` after the last one the super block counts.
    pub fn next_entry(&mut self) -> Result<Option<Entry>, LogError> {
        if self.next >= self.sup.nr_entries {
            return Ok(None);
        }
        let bs = self.bs();
        let mut block = vec![0u8; bs as usize];
        read_exact_at(&self.file, &mut block, self.pos, self.size, self.next)?;
        let header = LogEntry::decode(&block).map_err(|_| self.malformed())?;
        // xfstests' log_entry_valid: an all-zero header, or bytes after a
        // non-mark header, is not an entry.
        let mark = header.flags & LOG_MARK_FLAG != 0;
        if (header.flags == 0 && header.nr_sectors == 0) || (!mark && block[ENTRY_LEN] != 0) {
            return Err(self.malformed());
        }
        let text_len = (header.data_len as usize).min(bs as usize - ENTRY_LEN);
        let text = if mark {
            let raw = &block[ENTRY_LEN..ENTRY_LEN + text_len];
            let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
            String::from_utf8_lossy(&raw[..end]).into_owned()
        } else {
            String::new()
        };
        let data_len = if header.flags & LOG_DISCARD_FLAG != 0 || mark {
            0
        } else {
            header
                .nr_sectors
                .checked_mul(bs)
                .ok_or_else(|| self.malformed())?
        };
        let (dev_at, dev_len) = match (
            header.sector.checked_mul(bs),
            header.nr_sectors.checked_mul(bs),
        ) {
            (Some(at), Some(len)) if at.checked_add(len).is_some() => (at, len),
            _ => {
                return Err(LogError::Range {
                    entry: self.next,
                    at: header.sector.saturating_mul(bs),
                    len: header.nr_sectors.saturating_mul(bs),
                })
            }
        };
        let data_at = self.pos + bs;
        let end = data_at
            .checked_add(data_len)
            .ok_or_else(|| self.malformed())?;
        if end > self.size {
            return Err(LogError::Truncated {
                entry: self.next,
                at: data_at,
                size: self.size,
            });
        }
        let e = Entry {
            index: self.next,
            block: self.pos / bs,
            header,
            mark: text,
            data_at,
            data_len,
            dev_at,
            dev_len,
        };
        self.pos = end;
        self.next += 1;
        Ok(Some(e))
    }

    /// The number of the entry `next_entry` reads next.
    pub fn position(&self) -> u64 {
        self.next
    }

    /// Read `len` bytes of an entry's data starting `skip` bytes into it.
    pub fn read_data(&self, e: &Entry, skip: u64, buf: &mut [u8]) -> Result<(), LogError> {
        read_exact_at(&self.file, buf, e.data_at + skip, self.size, e.index)
    }

    fn malformed(&self) -> LogError {
        LogError::Malformed {
            entry: self.next,
            block: self.pos / self.bs(),
        }
    }
}

fn read_exact_at(f: &File, buf: &mut [u8], at: u64, size: u64, entry: u64) -> Result<(), LogError> {
    if at.saturating_add(buf.len() as u64) > size {
        return Err(LogError::Truncated { entry, at, size });
    }
    f.read_exact_at(buf, at)
        .map_err(|source| LogError::Read { at, source })
}

/// Bytes in a regular file or a block device.
pub fn device_size(f: &File) -> std::io::Result<u64> {
    use std::os::unix::fs::FileTypeExt;
    let md = f.metadata()?;
    if md.file_type().is_block_device() {
        let mut bytes: u64 = 0;
        // SAFETY: BLKGETSIZE64 writes one u64 through the pointer.
        let r = unsafe {
            libc::ioctl(
                std::os::fd::AsRawFd::as_raw_fd(f),
                BLKGETSIZE64,
                &mut bytes as *mut u64,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(bytes)
    } else {
        Ok(md.len())
    }
}

/// `_IOR(0x12, 114, size_t)`.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
