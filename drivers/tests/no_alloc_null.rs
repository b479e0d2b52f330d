//! null's completion paths allocate nothing per I/O: a counting global
//! allocator (this test binary only) watches a run of reads through a
//! `null` device completing on its softirq thread, on its timer (also with
//! the spin budget), and with polled bios reaped by the submitter's own
//! poll, after a warm-up that lets thread-locals and reusable buffers
//! reach their steady size. The engine's own paths are checked the same
//! way in `mq/tests/no_alloc.rs`.
//!
//! It has its own `main` (`harness = false`): libtest's runner thread
//! allocates while a test runs, and the counter is process-wide.

use blkstack_core::testing::{BioFreeList, CountingAlloc};
use blkstack_core::{AlignedBuf, Bio, BioFlags, Device, EndIo, Op};
use blkstack_drivers::NullDevice;
use std::sync::Arc;

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// Take a free bio; with `polled`, reap due requests with the device's
/// poll while none is free, as a polling submitter does.
fn take_free(d: &NullDevice, owner: &BioFreeList, polled: bool) -> Bio {
    let mut reap = || {
        if d.poll() == 0 {
            std::hint::spin_loop();
        }
    };
    owner.take(polled.then_some(&mut reap as &mut dyn FnMut()))
}

/// Submit `n` reads, in groups of up to `batch_max` through
/// `submit_batch` (whatever is free when the group is built).
fn run(
    d: &NullDevice,
    owner: &Arc<BioFreeList>,
    dyn_owner: &Arc<dyn EndIo>,
    n: u64,
    batch: &mut Vec<Bio>,
    batch_max: usize,
    polled: bool,
) {
    let mut i = 0;
    while i < n {
        let mut bio = take_free(d, owner, polled);
        let buf = bio.buf;
        bio.rearm(dyn_owner.clone(), Op::Read, (i % 256) * 4096, 4096, buf);
        if polled {
            bio.flags.insert(BioFlags::POLLED);
        }
        i += 1;
        batch.push(bio);
        let more = !owner.is_empty();
        if batch.len() >= batch_max || !more || i == n {
            d.submit_batch(batch);
        }
    }
}

/// Allocations during a measured run, and the backtraces of the first.
fn allocations_per_io(args: &[&str], batch_max: usize) -> (u64, Vec<String>) {
    const QD: usize = 64;
    let d = NullDevice::from_args(1 << 20, args).expect("null device");
    let polled = d.polls();
    let mem = AlignedBuf::new(QD * 4096);
    let owner = BioFreeList::new(QD);
    let dyn_owner: Arc<dyn EndIo> = owner.clone();
    // SAFETY: every bio is back on the list before this function
    // returns and `mem` goes away.
    unsafe { owner.prime(&mem, QD, 4096) };
    let mut batch = Vec::with_capacity(QD);
    run(&d, &owner, &dyn_owner, 5_000, &mut batch, batch_max, polled);
    CountingAlloc::trace_start();
    let before = CountingAlloc::count();
    run(
        &d, &owner, &dyn_owner, 20_000, &mut batch, batch_max, polled,
    );
    let after = CountingAlloc::count();
    let traces = CountingAlloc::trace_take();
    // Let the last completions come home before the buffers go away.
    while owner.len() != QD {
        if polled {
            d.poll();
        }
        std::thread::yield_now();
    }
    (after - before, traces)
}

/// The counter is process-wide, so the modes run one after another on the
/// only thread of this process that is not the device's.
fn main() {
    let timer = ["irqmode=2", "completion_nsec=20000", "zero_reads=0"];
    let spin = [&timer[..], &["timer_spin_ns=50000"]].concat();
    let polled = [&timer[..], &["iopoll=1"]].concat();
    for (args, batch, what) in [
        (&["irqmode=1", "zero_reads=0"][..], 1, "softirq"),
        (&["irqmode=1", "zero_reads=0"][..], 32, "softirq, batches"),
        (&timer[..], 32, "timer, batches"),
        (&spin[..], 32, "timer with a spin budget, batches"),
        (&polled[..], 32, "timer, polled bios, batches"),
    ] {
        let (n, traces) = allocations_per_io(args, batch);
        assert_eq!(
            n,
            0,
            "{what}: allocated; the first ones:\n{}",
            traces.join("\n---\n")
        );
        println!("null hot path allocates nothing: {what} ... ok");
    }
}
