//! The hot path allocates nothing per I/O: a run of 64x more I/Os makes
//! (almost) no more heap allocations than a short one. Counted with a
//! global allocator wrapper, in its own test binary so nothing else runs
//! concurrently in this process.

use blkstack_bench::{run_on_device, JobSpec, RunOptions, RwMode, SizeSpec};
use blkstack_core::{Bio, Device, DeviceRef, Op, Status};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator, only counting calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `alloc` above with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract for `realloc`, passed on.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Completes inline and touches no heap: reads fill a byte pattern.
struct PatternDev;

impl Device for PatternDev {
    fn submit(&self, bio: Bio) {
        if bio.op == Op::Read {
            bio.data_mut().fill(0x5a);
        }
        bio.complete(Status::Ok);
    }
    fn size(&self) -> u64 {
        256 << 20
    }
}

fn allocations_for(bytes: u64, rw: RwMode) -> (u64, u64) {
    let dev: DeviceRef = Arc::new(PatternDev);
    let job = JobSpec {
        rw,
        iodepth: 8,
        io_size: Some(SizeSpec::Bytes(bytes)),
        ..JobSpec::default()
    };
    let before = ALLOCS.load(Ordering::Relaxed);
    let r = run_on_device(dev, "pattern", &[job], &RunOptions::default()).unwrap();
    let after = ALLOCS.load(Ordering::Relaxed);
    let ios = r.jobs[0].read.total_ios + r.jobs[0].write.total_ios;
    (after - before, ios)
}

#[test]
fn per_io_path_does_not_allocate() {
    for rw in [RwMode::RandRead, RwMode::RandRw, RwMode::Write] {
        let (small, small_ios) = allocations_for(1 << 20, rw);
        let (large, large_ios) = allocations_for(64 << 20, rw);
        assert_eq!(large_ios, 64 * small_ios);
        // A few allocations may differ (report formatting of longer
        // numbers, thread bookkeeping), never one per I/O.
        assert!(
            large <= small + 32,
            "{rw:?}: {small} allocations for {small_ios} I/Os, {large} for {large_ios}"
        );
    }
}
