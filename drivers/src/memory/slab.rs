//! Pages for the memory store, carved from large anonymous mappings
//! (`brd` takes its pages from the kernel's page allocator one at a time;
//! a userspace store needs its own): one `mmap` per [`REGION_PAGES`]
//! pages, a free list for pages given back, and every mapping unmapped
//! at once when the store goes.
//!
//! Why not `Box<[u8; 4096]>`: the allocator's per-thread arenas grow
//! their heap by one `mprotect` per page when pages are allocated one by
//! one, so every first write into a fresh region paid a system call and
//! a VMA update, and dropping a large store freed pages one by one.
//! Fresh mappings read as zeroes, so a new page needs no clearing; a page
//! from the free list is cleared before it is handed out again.
//!
//! Memory given back by a discard stays in the free list (and in the
//! process's resident set) until the store is dropped, as pages freed to
//! the allocator did before.

use super::PAGE_SIZE;
use std::ptr::NonNull;

/// Pages per mapping (1 MiB): few enough that a small device's shards
/// reserve little address space, many enough that `mmap` is rare.
const REGION_PAGES: usize = 256;
const PAGE: usize = PAGE_SIZE as usize;

/// One page of a [`PageSlab`]. It is only made by a slab, is never
/// copied, and lives in the same shard as its slab, so it never outlives
/// the mapping it points into.
pub struct SlabPage(NonNull<[u8; PAGE]>);

// SAFETY: a `SlabPage` is a unique handle to its page (no `Clone`), like
// a `Box`; the page is plain bytes.
unsafe impl Send for SlabPage {}
// SAFETY: shared access only reads through `&self`.
unsafe impl Sync for SlabPage {}

impl std::ops::Deref for SlabPage {
    type Target = [u8; PAGE];
    fn deref(&self) -> &[u8; PAGE] {
        // SAFETY: the page lies in a live mapping of its slab (see the
        // type's doc) and this handle is its only owner.
        unsafe { self.0.as_ref() }
    }
}

impl std::ops::DerefMut for SlabPage {
    fn deref_mut(&mut self) -> &mut [u8; PAGE] {
        // SAFETY: as in `deref`; `&mut self` makes the access unique.
        unsafe { self.0.as_mut() }
    }
}

struct Region(NonNull<u8>);

// SAFETY: the mapping belongs to the region alone.
unsafe impl Send for Region {}
// SAFETY: the region itself is never read or written through `&Region`.
unsafe impl Sync for Region {}

impl Region {
    fn map() -> Option<Region> {
        let len = REGION_PAGES * PAGE;
        // SAFETY: a fresh private anonymous mapping, no file, no address
        // hint; the result is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            tracing::warn!(
                "memory: mmap of a page region failed: {}",
                std::io::Error::last_os_error()
            );
            return None;
        }
        // Random 4 KiB writes must not fault in 2 MiB each.
        // SAFETY: advice on the mapping just made; failure is harmless.
        unsafe { libc::madvise(p, len, libc::MADV_NOHUGEPAGE) };
        NonNull::new(p.cast()).map(Region)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; the slab that
        // owns it is going, and with it every page handed out of it.
        unsafe { libc::munmap(self.0.as_ptr().cast(), REGION_PAGES * PAGE) };
    }
}

/// The pages of one shard of a store. Fields drop in order: the store's
/// maps (holding `SlabPage`s) must drop before the slab.
#[derive(Default)]
pub struct PageSlab {
    regions: Vec<Region>,
    /// Pages of the last region not handed out yet.
    fresh: usize,
    free: Vec<SlabPage>,
}

impl PageSlab {
    /// A zeroed page (`None` if no mapping could be made).
    pub fn alloc(&mut self) -> Option<SlabPage> {
        if let Some(mut p) = self.free.pop() {
            p.fill(0);
            return Some(p);
        }
        if self.fresh == 0 {
            self.regions.push(Region::map()?);
            self.fresh = REGION_PAGES;
        }
        let region = self.regions.last()?;
        let at = (REGION_PAGES - self.fresh) * PAGE;
        self.fresh -= 1;
        // SAFETY: `at` is a page boundary inside the region's mapping,
        // and each one is handed out once (`fresh` only goes down).
        let p = unsafe { region.0.as_ptr().add(at) };
        NonNull::new(p.cast()).map(SlabPage)
    }

    /// Give back a page this slab made.
    pub fn free(&mut self, p: SlabPage) {
        self.free.push(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_distinct_zeroed_and_reused_zeroed() {
        let mut slab = PageSlab::default();
        let mut pages: Vec<SlabPage> = (0..REGION_PAGES + 3)
            .map(|_| slab.alloc().expect("a page"))
            .collect();
        assert_eq!(slab.regions.len(), 2);
        for (i, p) in pages.iter_mut().enumerate() {
            assert!(p.iter().all(|&b| b == 0));
            p.fill(i as u8);
        }
        for (i, p) in pages.iter().enumerate() {
            assert!(p.iter().all(|&b| b == i as u8), "page {i} was overwritten");
        }
        let p = pages.pop().expect("a page");
        slab.free(p);
        let again = slab.alloc().expect("a page");
        assert!(again.iter().all(|&b| b == 0), "a reused page is cleared");
        assert_eq!(slab.regions.len(), 2);
    }
}
