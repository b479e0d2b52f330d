//! Guest memory that the VMM can take away: a guard that turns the
//! SIGBUS of a vanished page into a failed request instead of the death
//! of `serve` (issue 35, item 1).
//!
//! The guest's RAM reaches us as memfds (or tmpfs/hugetlbfs files) the
//! VMM sends with SET_MEM_TABLE; vm-memory maps them shared. Two things
//! can leave a mapped page without a file page behind it, and touching
//! it raises SIGBUS, whose default action kills the whole process with
//! every export in it:
//!
//! - a region declared larger than its file. This one is refused up
//!   front: [`check_files`] compares each region with its file's size
//!   (fstat) at SET_MEM_TABLE, and the message is refused.
//! - a file shrunk (ftruncate) after the table was accepted. No check at
//!   SET_MEM_TABLE can see it coming, so every access must survive it.
//!
//! For the second, two designs were weighed. Copying guest memory with
//! pread/pwrite on the region's fd would make a shrunk file a short read,
//! but the virtqueues themselves (descriptor table, avail and used rings)
//! are read and written by rust-vmm's `virtio-queue` through the mapping,
//! so it would mean replacing vm-memory's `GuestMemory` under the whole
//! queue code. qemu's backends instead guard the accesses with a SIGBUS
//! handler and sigsetjmp; a longjmp out of Rust frames is undefined
//! behaviour, so this guard does not jump: its handler ([`on_sigbus`])
//! finds the faulting address in a fixed table of the regions we mapped
//! and replaces that whole region, in place, with anonymous zeroed
//! memory (`mmap(MAP_FIXED)`, a system call the kernel allows in a
//! signal handler), marks the region poisoned, and returns. The faulting
//! instruction runs again and now succeeds on the zero page; the code
//! that made the access checks [`Regions::poisoned`] before it trusts
//! what it read (a write's data is never submitted from a poisoned
//! region), fails the request, and the connection is shut down. A SIGBUS
//! at any address not in the table goes to the handler that was there
//! before (Rust's own stack-overflow handler, then the default action),
//! so unrelated faults still behave as they did.
//!
//! Bounds: the table has [`SLOTS`] entries; a memory table that would
//! need more than are free is refused like a bad one. An entry is freed
//! only once nothing but the guard still holds that guest memory (its
//! mapping is then unmapped right after), so the handler never remaps an
//! address that some other mapping has reused.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Once, OnceLock};
use vm_memory::{FileOffset, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

/// Regions the guard watches at once, over every connection.
pub const SLOTS: usize = 256;

struct Slot {
    /// `start == 0` means the slot is free. Written only under the
    /// registry's lock; read (atomically) by the signal handler.
    start: AtomicUsize,
    end: AtomicUsize,
    poisoned: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    poisoned: AtomicBool::new(false),
};
static TABLE: [Slot; SLOTS] = [FREE; SLOTS];

/// The SIGBUS action that was installed before ours.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();
static INSTALL: Once = Once::new();

/// Guest memory held (and so kept mapped) until the guard lets it go.
type Held = Arc<GuestMemoryMmap<()>>;
static HELD: parking_lot::Mutex<Vec<(Held, Vec<usize>)>> = parking_lot::Mutex::new(Vec::new());

#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("memory region {index} (guest address {gpa:#x}): declares {size} bytes at file offset {offset}, but its file holds {file_len} bytes")]
    BeyondFile {
        index: usize,
        gpa: u64,
        size: u64,
        offset: u64,
        file_len: u64,
    },
    #[error("memory region {index} (guest address {gpa:#x}): not backed by a file")]
    NoFile { index: usize, gpa: u64 },
    #[error("memory region {index}: cannot stat its file: {err}")]
    Stat { index: usize, err: std::io::Error },
    #[error("more than {SLOTS} guest memory regions mapped at once")]
    Full,
    #[error("cannot install the SIGBUS guard: {0}")]
    Install(std::io::Error),
}

/// Refuse a memory table with a region larger than what its file holds
/// from the region's offset on: touching that tail would raise SIGBUS.
pub fn check_files(mem: &GuestMemoryMmap<()>) -> Result<(), GuardError> {
    for (index, r) in mem.iter().enumerate() {
        let gpa = r.start_addr().0;
        let Some(fo): Option<&FileOffset> = r.file_offset() else {
            return Err(GuardError::NoFile { index, gpa });
        };
        let file_len = fo
            .file()
            .metadata()
            .map_err(|err| GuardError::Stat { index, err })?
            .len();
        let size = r.len();
        let fits = fo
            .start()
            .checked_add(size)
            .is_some_and(|need| need <= file_len);
        if !fits {
            return Err(GuardError::BeyondFile {
                index,
                gpa,
                size,
                offset: fo.start(),
                file_len,
            });
        }
    }
    Ok(())
}

/// The regions of one memory table, watched by the guard.
pub struct Regions {
    slots: Vec<usize>,
}

impl Regions {
    /// Has any of these regions lost its file pages (and been replaced
    /// by zeroes)? Then nothing read from it may be trusted.
    pub fn poisoned(&self) -> bool {
        self.slots
            .iter()
            .any(|&i| TABLE[i].poisoned.load(Ordering::SeqCst))
    }
}

/// Watch every region of `mem` until nothing else holds it.
pub fn watch(mem: Held) -> Result<Regions, GuardError> {
    install()?;
    let mut held = HELD.lock();
    reap(&mut held);
    let ranges: Vec<(usize, usize)> = mem
        .iter()
        .map(|r| {
            let start = r.as_ptr() as usize;
            (start, start + r.len() as usize)
        })
        .collect();
    let free: Vec<usize> = (0..SLOTS)
        .filter(|&i| TABLE[i].start.load(Ordering::SeqCst) == 0)
        .take(ranges.len())
        .collect();
    if free.len() < ranges.len() {
        return Err(GuardError::Full);
    }
    for (&i, &(start, end)) in free.iter().zip(&ranges) {
        TABLE[i].poisoned.store(false, Ordering::SeqCst);
        TABLE[i].end.store(end, Ordering::SeqCst);
        TABLE[i].start.store(start, Ordering::SeqCst);
    }
    held.push((mem, free.clone()));
    Ok(Regions { slots: free })
}

/// Let go of the guest memory nobody else holds any more: clear its
/// slots first, then drop it (which unmaps it).
pub fn release_unused() {
    reap(&mut HELD.lock());
}

fn reap(held: &mut Vec<(Held, Vec<usize>)>) {
    held.retain(|(mem, slots)| {
        if Arc::strong_count(mem) > 1 {
            return true;
        }
        for &i in slots {
            TABLE[i].start.store(0, Ordering::SeqCst);
            TABLE[i].end.store(0, Ordering::SeqCst);
        }
        false
    });
}

fn install() -> Result<(), GuardError> {
    let mut err = None;
    INSTALL.call_once(|| {
        // SAFETY: a zeroed sigaction is a valid "no action" value that
        // sigaction(2) overwrites with the current one.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: as above; then filled in before use.
        let mut new: libc::sigaction = unsafe { std::mem::zeroed() };
        new.sa_sigaction = on_sigbus as *const () as usize;
        new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // SAFETY: sa_mask is a valid sigset_t owned by `new`.
        unsafe { libc::sigemptyset(&mut new.sa_mask) };
        // SAFETY: read the current action without changing it.
        if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) } != 0 {
            err = Some(std::io::Error::last_os_error());
            return;
        }
        // Set before the handler can run, so it always finds it.
        let _ = PREVIOUS.set(old);
        // SAFETY: `new` is a fully initialised action whose handler is
        // async-signal-safe (atomics and mmap/sigaction system calls).
        if unsafe { libc::sigaction(libc::SIGBUS, &new, std::ptr::null_mut()) } != 0 {
            err = Some(std::io::Error::last_os_error());
        }
    });
    match err {
        Some(e) => Err(GuardError::Install(e)),
        None => Ok(()),
    }
}

/// The SIGBUS handler: see the module doc. Only atomics and system
/// calls, no allocation, no lock.
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for an SA_SIGINFO
    // handler; si_addr is the faulting address for SIGBUS.
    let addr = unsafe { (*info).si_addr() } as usize;
    for slot in TABLE.iter() {
        let start = slot.start.load(Ordering::SeqCst);
        let end = slot.end.load(Ordering::SeqCst);
        if start == 0 || addr < start || addr >= end {
            continue;
        }
        // SAFETY: [start, end) is a mapping of guest memory that the
        // guard keeps alive (its slot is cleared before it is unmapped);
        // replacing it with private anonymous memory only changes what
        // its pages hold.
        let p = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                end - start,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            slot.poisoned.store(true, Ordering::SeqCst);
            return;
        }
        break;
    }
    // Not ours (or it could not be replaced): give the fault back to the
    // action that was there before; the instruction faults again.
    if let Some(prev) = PREVIOUS.get() {
        // SAFETY: restoring an action the kernel gave us.
        unsafe { libc::sigaction(sig, prev, std::ptr::null_mut()) };
    } else {
        // SAFETY: a zeroed sigaction with SIG_DFL (0) is the default.
        let dfl: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: installing the default action.
        unsafe { libc::sigaction(sig, &dfl, std::ptr::null_mut()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress};

    /// Guest memory of `len` bytes over a temporary file of `file_len`.
    fn over_file(len: usize, file_len: u64) -> (GuestMemoryMmap<()>, std::fs::File) {
        let f = tempfile::tempfile().expect("tempfile");
        f.set_len(file_len).expect("set_len");
        let fo = FileOffset::new(f.try_clone().expect("clone"), 0);
        let mem = GuestMemoryMmap::<()>::from_ranges_with_files([(GuestAddress(0), len, Some(fo))])
            .expect("map");
        (mem, f)
    }

    #[test]
    fn a_region_beyond_its_file_is_named_and_one_within_passes() {
        let (mem, _f) = over_file(1 << 20, 64 << 10);
        let e = check_files(&mem).expect_err("beyond its file");
        assert!(matches!(
            e,
            GuardError::BeyondFile {
                index: 0,
                size: 1048576,
                file_len: 65536,
                ..
            }
        ));
        let (mem, _f) = over_file(64 << 10, 64 << 10);
        check_files(&mem).expect("fits");
    }

    #[test]
    fn a_file_shrunk_under_a_watched_region_poisons_it_instead_of_killing_us() {
        let (mem, f) = over_file(64 << 10, 64 << 10);
        let mem = Arc::new(mem);
        mem.write_slice(&[7u8; 16], GuestAddress(0x8000))
            .expect("write");
        let regions = watch(mem.clone()).expect("watch");
        assert!(!regions.poisoned());
        f.set_len(0x1000).expect("shrink");
        // Past the new end: SIGBUS without the guard.
        let mut back = [1u8; 16];
        mem.read_slice(&mut back, GuestAddress(0x8000))
            .expect("read");
        assert!(regions.poisoned(), "the fault was not seen");
        assert_eq!(back, [0u8; 16], "a vanished page reads as zeroes");
        drop(regions);
        drop(mem);
        release_unused();
    }
}
