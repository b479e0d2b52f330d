//! The transient exception store (`N`) of the kernel's
//! `drivers/md/dm-snap-transient.c`: exceptions live in memory only and
//! start empty at every construction, which is what crash replay wants
//! (a reload gives a fresh overlay over the same origin).

use blkstack_core::SECTOR_SIZE;

/// `struct transient_c`: the next free COW sector.
pub(super) struct Transient {
    next_free: u64,
    chunk_sectors: u64,
}

impl Transient {
    pub(super) fn new(chunk_sectors: u64) -> Transient {
        Transient {
            next_free: 0,
            chunk_sectors,
        }
    }

    /// `transient_prepare_exception`: the COW chunk for a new exception,
    /// `None` when the COW device (of `cow_bytes`) has no room.
    pub(super) fn prepare(&mut self, cow_bytes: u64) -> Option<u64> {
        if cow_bytes / SECTOR_SIZE < self.next_free + self.chunk_sectors {
            return None;
        }
        let new = self.next_free / self.chunk_sectors;
        self.next_free += self.chunk_sectors;
        Some(new)
    }

    /// `transient_usage`: (allocated, total, metadata) sectors.
    pub(super) fn usage(&self, cow_bytes: u64) -> (u64, u64, u64) {
        (self.next_free, cow_bytes / SECTOR_SIZE, 0)
    }
}
