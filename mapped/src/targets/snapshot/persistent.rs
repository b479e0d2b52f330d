//! The persistent exception store (`P`, `PO`) in the on-disk format of
//! the kernel's `drivers/md/dm-snap-persistent.c` (6.12), so that a COW
//! device blkstack wrote is loaded by the kernel's dm-snapshot and the
//! reverse.
//!
//! Layout, in chunks of the snapshot's chunk size: chunk 0 is the header
//! (`disk_header`: le32 magic `SnAp`, valid, version 1, chunk size);
//! then metadata areas, each one chunk of `(le64 old_chunk, le64
//! new_chunk)` pairs (`disk_exception`), each followed by the data chunks
//! its exceptions point at (`area_location`: area `a` sits at chunk
//! `1 + a * (exceptions_per_area + 1)`). An area's list ends at the first
//! pair whose `new_chunk` is 0 (the header's chunk, never a data chunk),
//! which is why the area after a full one is zeroed before the full one
//! is written (`persistent_commit_exception`).
//!
//! Every exception is committed before the write that made it completes:
//! the area holding it is written with PREFLUSH and FUA (so the copied
//! chunk is on stable storage before the metadata naming it), as the
//! kernel commits once no other exception is in flight; here the target
//! makes exceptions one at a time, so each commits on its own.
//! Written by hand: no crate reads or writes this format.

use crate::error::{Refusal, TargetError};
use blkstack_core::sync::submit_and_wait_flags;
use blkstack_core::{AlignedBuf, BioFlags, DeviceRef, Op, Status, SECTOR_SIZE};

/// `SNAP_MAGIC`: "SnAp" as a little-endian u32.
pub(super) const SNAP_MAGIC: u32 = 0x7041_6e53;
/// `SNAPSHOT_DISK_VERSION`.
const DISK_VERSION: u32 = 1;
/// `NUM_SNAPSHOT_HDR_CHUNKS`.
const HDR_CHUNKS: u64 = 1;
/// `DM_CHUNK_SIZE_DEFAULT_SECTORS`, for a table that gives chunk size 0.
const DEFAULT_CHUNK_SECTORS: u64 = 32;
/// `sizeof(struct disk_exception)`.
const EXCEPTION_BYTES: u64 = 16;

/// What the kernel's `read_header` and `persistent_read_metadata` refuse,
/// with the errno snapshot_ctr returns for it.
#[derive(Debug, thiserror::Error)]
pub(super) enum OpenError {
    /// A header whose magic is neither 0 (a new store) nor `SnAp`
    /// (-ENXIO).
    #[error("Invalid or corrupt snapshot")]
    Corrupt,
    /// A header of another version (-EINVAL).
    #[error("unable to handle snapshot disk version {0}")]
    Version(u32),
    /// The header's chunk size is not one the table could have given.
    #[error("invalid on-disk chunk size {size}: {why}")]
    ChunkSize {
        size: u32,
        why: super::ChunkSizeError,
    },
    /// Reading or writing the COW device failed (-EIO).
    #[error("{what} failed on the COW device ({status:?})")]
    Io { what: &'static str, status: Status },
}

impl From<OpenError> for TargetError {
    fn from(e: OpenError) -> TargetError {
        let source = match e {
            OpenError::Corrupt => TargetError::Refused {
                errno: Refusal::NoAddress,
                why: e.to_string(),
            },
            e => TargetError::invalid(e.to_string()),
        };
        TargetError::In {
            context: "Failed to read snapshot metadata".into(),
            source: Box::new(source),
        }
    }
}

/// The store's state (kernel `struct pstore`).
pub(super) struct Persistent {
    cow: DeviceRef,
    chunk_sectors: u64,
    /// `exceptions_per_area`: how many pairs one chunk holds.
    per_area: u64,
    /// The next chunk to hand out, never a metadata chunk.
    next_free: u64,
    current_area: u64,
    /// How many pairs of the current area are taken.
    current_committed: u64,
    /// The current area as it is (to be) on disk.
    area: AlignedBuf,
    /// The header's `valid`.
    valid: bool,
    /// `PO`: a full COW device stops writes (`Overflow`) instead of
    /// invalidating the snapshot.
    pub(super) overflow: bool,
}

/// A store just opened: the exceptions it holds and whether its header
/// says valid (`persistent_read_metadata` returning 1 for an invalid one).
pub(super) struct Opened {
    pub(super) store: Persistent,
    pub(super) exceptions: Vec<(u64, u64)>,
    pub(super) valid: bool,
}

impl Persistent {
    /// `read_header` + `persistent_read_metadata`: a zeroed header makes a
    /// new store (header and first area written), `SnAp` reads the
    /// exceptions back. `table_chunk` is the table's chunk size in
    /// sectors, 0 for the default; a header's own chunk size wins, checked
    /// by `check_chunk` as a table's would be.
    pub(super) fn open(
        cow: DeviceRef,
        table_chunk: u64,
        overflow: bool,
        check_chunk: &dyn Fn(u64) -> Result<(), super::ChunkSizeError>,
    ) -> Result<Opened, OpenError> {
        let lbs = (cow.logical_block_size() as u64 / SECTOR_SIZE).max(1);
        let mut chunk = if table_chunk == 0 {
            DEFAULT_CHUNK_SECTORS.max(lbs)
        } else {
            table_chunk
        };
        let mut hdr = AlignedBuf::new((chunk * SECTOR_SIZE) as usize);
        io(
            &cow,
            Op::Read,
            0,
            hdr.as_mut_slice(),
            BioFlags::NONE,
            "reading the header",
        )?;
        let h = hdr.as_slice();
        let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let (magic, valid, version, disk_chunk) = (word(0), word(4), word(8), word(12));
        let new = magic == 0;
        if !new && magic != SNAP_MAGIC {
            return Err(OpenError::Corrupt);
        }
        if !new && disk_chunk as u64 != chunk {
            if table_chunk != 0 {
                tracing::warn!(
                    "snapshot: chunk size {disk_chunk} in device metadata overrides table \
                     chunk size of {table_chunk}"
                );
            }
            check_chunk(disk_chunk as u64).map_err(|why| OpenError::ChunkSize {
                size: disk_chunk,
                why,
            })?;
            chunk = disk_chunk as u64;
        }
        let cb = chunk * SECTOR_SIZE;
        let mut store = Persistent {
            cow,
            chunk_sectors: chunk,
            per_area: cb / EXCEPTION_BYTES,
            next_free: HDR_CHUNKS + 1,
            current_area: 0,
            current_committed: 0,
            area: AlignedBuf::new(cb as usize),
            valid: true,
            overflow,
        };
        if new {
            store.write_header()?;
            store.zero_disk_area(0)?;
            return Ok(Opened {
                store,
                exceptions: Vec::new(),
                valid: true,
            });
        }
        if version != DISK_VERSION {
            return Err(OpenError::Version(version));
        }
        if valid == 0 {
            store.valid = false;
            tracing::warn!("snapshot: Snapshot is marked invalid.");
            return Ok(Opened {
                store,
                exceptions: Vec::new(),
                valid: false,
            });
        }
        let exceptions = store.read_exceptions()?;
        Ok(Opened {
            store,
            exceptions,
            valid: true,
        })
    }

    /// The chunk size in sectors, as the header fixed it.
    pub(super) fn chunk_sectors(&self) -> u64 {
        self.chunk_sectors
    }

    /// `area_location`.
    fn area_location(&self, area: u64) -> u64 {
        HDR_CHUNKS + (self.per_area + 1) * area
    }

    /// `read_exceptions` / `insert_exceptions`: areas in order until one
    /// is not full; it becomes the current area.
    fn read_exceptions(&mut self) -> Result<Vec<(u64, u64)>, OpenError> {
        let cow_chunks = self.cow.size() / (self.chunk_sectors * SECTOR_SIZE);
        let mut out = Vec::new();
        let mut area = 0;
        loop {
            let at = self.area_location(area);
            if at >= cow_chunks {
                // The kernel's dm_bufio_read past the end fails.
                return Err(OpenError::Io {
                    what: "reading an area past the end",
                    status: Status::IoError,
                });
            }
            let off = at * self.chunk_sectors * SECTOR_SIZE;
            let cow = self.cow.clone();
            io(
                &cow,
                Op::Read,
                off,
                self.area.as_mut_slice(),
                BioFlags::NONE,
                "reading an area",
            )?;
            let a = self.area.as_slice();
            let mut full = true;
            for i in 0..self.per_area as usize {
                let pair = &a[i * 16..i * 16 + 16];
                let old = u64::from_le_bytes(pair[..8].try_into().unwrap_or_default());
                let new = u64::from_le_bytes(pair[8..].try_into().unwrap_or_default());
                if new == 0 {
                    self.current_committed = i as u64;
                    full = false;
                    break;
                }
                if self.next_free <= new {
                    self.next_free = new + 1;
                }
                out.push((old, new));
            }
            if !full {
                self.current_area = area;
                break;
            }
            area += 1;
        }
        self.skip_metadata();
        Ok(out)
    }

    /// `skip_metadata`: step over a metadata chunk.
    fn skip_metadata(&mut self) {
        if self.next_free % (self.per_area + 1) == HDR_CHUNKS {
            self.next_free += 1;
        }
    }

    /// `persistent_prepare_exception`: the COW chunk for a new exception,
    /// `None` when the COW device has no room.
    pub(super) fn prepare(&mut self) -> Option<u64> {
        let size = self.cow.size() / SECTOR_SIZE;
        if size < (self.next_free + 1) * self.chunk_sectors {
            return None;
        }
        let new = self.next_free;
        self.next_free += 1;
        self.skip_metadata();
        Some(new)
    }

    /// `persistent_commit_exception`: record `old -> new` in the current
    /// area and write it (after zeroing the next area if this one is now
    /// full). `false` when the store became invalid.
    pub(super) fn commit(&mut self, old: u64, new: u64) -> bool {
        let i = self.current_committed as usize;
        let a = self.area.as_mut_slice();
        a[i * 16..i * 16 + 8].copy_from_slice(&old.to_le_bytes());
        a[i * 16 + 8..i * 16 + 16].copy_from_slice(&new.to_le_bytes());
        self.current_committed += 1;
        let filled = self.current_committed == self.per_area;
        if filled && self.zero_disk_area(self.current_area + 1).is_err() {
            self.valid = false;
        }
        if self.valid {
            let off = self.area_location(self.current_area) * self.chunk_sectors * SECTOR_SIZE;
            let cow = self.cow.clone();
            let flags = BioFlags::PREFLUSH | BioFlags::FUA;
            if io(
                &cow,
                Op::Write,
                off,
                self.area.as_mut_slice(),
                flags,
                "writing an area",
            )
            .is_err()
            {
                self.valid = false;
            }
        }
        if filled {
            self.current_committed = 0;
            self.current_area += 1;
            self.area.as_mut_slice().fill(0);
        }
        self.valid
    }

    /// `persistent_prepare_merge`: the newest exception and how many
    /// before it in the same area continue it backwards (old and new
    /// chunks both one less each step), at most `max`; `None` once every
    /// exception is merged.
    pub(super) fn prepare_merge(&mut self, max: u64) -> Result<Option<(u64, u64, u64)>, ()> {
        if self.current_committed == 0 {
            if self.current_area == 0 {
                return Ok(None);
            }
            self.current_area -= 1;
            let off = self.area_location(self.current_area) * self.chunk_sectors * SECTOR_SIZE;
            let cow = self.cow.clone();
            let flags = BioFlags::NONE;
            if io(
                &cow,
                Op::Read,
                off,
                self.area.as_mut_slice(),
                flags,
                "reading an area",
            )
            .is_err()
            {
                return Err(());
            }
            self.current_committed = self.per_area;
        }
        let (old, new) = self.pair(self.current_committed - 1);
        let mut n = 1;
        while n < self.current_committed.min(max) {
            let (o, w) = self.pair(self.current_committed - 1 - n);
            if old.checked_sub(n) != Some(o) || new.checked_sub(n) != Some(w) {
                break;
            }
            n += 1;
        }
        Ok(Some((old, new, n)))
    }

    /// `persistent_commit_merge`: drop the newest `n` exceptions from the
    /// current area on disk. `false` when the write failed.
    pub(super) fn commit_merge(&mut self, n: u64) -> bool {
        for i in 0..n.min(self.current_committed) {
            let at = ((self.current_committed - 1 - i) * EXCEPTION_BYTES) as usize;
            self.area.as_mut_slice()[at..at + EXCEPTION_BYTES as usize].fill(0);
        }
        let off = self.area_location(self.current_area) * self.chunk_sectors * SECTOR_SIZE;
        let cow = self.cow.clone();
        let flags = BioFlags::PREFLUSH | BioFlags::FUA;
        if io(
            &cow,
            Op::Write,
            off,
            self.area.as_mut_slice(),
            flags,
            "writing an area",
        )
        .is_err()
        {
            return false;
        }
        self.current_committed -= n.min(self.current_committed);
        // As the kernel: only usage() reads next_free after a merge.
        self.next_free = self.area_location(self.current_area) + self.current_committed + 1;
        true
    }

    /// Pair `i` of the current area.
    fn pair(&self, i: u64) -> (u64, u64) {
        let a = &self.area.as_slice()[(i * EXCEPTION_BYTES) as usize..][..16];
        let le = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or_default());
        (le(&a[..8]), le(&a[8..]))
    }

    /// `persistent_drop_snapshot`: mark the header invalid.
    pub(super) fn drop_snapshot(&mut self) {
        self.valid = false;
        if self.write_header().is_err() {
            tracing::warn!("snapshot: write header failed");
        }
    }

    /// `persistent_usage`: (allocated, total, metadata) sectors.
    pub(super) fn usage(&self) -> (u64, u64, u64) {
        (
            self.next_free * self.chunk_sectors,
            self.cow.size() / SECTOR_SIZE,
            (self.current_area + 1 + HDR_CHUNKS) * self.chunk_sectors,
        )
    }

    /// `write_header`.
    fn write_header(&self) -> Result<(), OpenError> {
        let mut h = AlignedBuf::new((self.chunk_sectors * SECTOR_SIZE) as usize);
        let b = h.as_mut_slice();
        b[0..4].copy_from_slice(&SNAP_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&(self.valid as u32).to_le_bytes());
        b[8..12].copy_from_slice(&DISK_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(self.chunk_sectors as u32).to_le_bytes());
        let flags = BioFlags::PREFLUSH | BioFlags::FUA;
        io(&self.cow, Op::Write, 0, b, flags, "writing the header")
    }

    /// `zero_disk_area`: the area's list ends before its first pair.
    fn zero_disk_area(&self, area: u64) -> Result<(), OpenError> {
        let mut z = AlignedBuf::new((self.chunk_sectors * SECTOR_SIZE) as usize);
        let off = self.area_location(area) * self.chunk_sectors * SECTOR_SIZE;
        let flags = BioFlags::FUA;
        io(
            &self.cow,
            Op::Write,
            off,
            z.as_mut_slice(),
            flags,
            "zeroing an area",
        )
    }
}

fn io(
    dev: &DeviceRef,
    op: Op,
    off: u64,
    buf: &mut [u8],
    flags: BioFlags,
    what: &'static str,
) -> Result<(), OpenError> {
    if off + buf.len() as u64 > dev.size() {
        return Err(OpenError::Io {
            what,
            status: Status::IoError,
        });
    }
    let len = buf.len() as u64;
    match submit_and_wait_flags(&**dev, op, flags, off, len, buf) {
        Status::Ok => Ok(()),
        status => Err(OpenError::Io { what, status }),
    }
}
