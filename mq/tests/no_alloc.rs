//! The engine's hot path allocates nothing per I/O: a counting global
//! allocator (this test binary only) watches a run of reads through the
//! queue with requests ended inline and from a completion thread, one by
//! one and in batches, after a warm-up that lets thread-locals and
//! reusable buffers reach their steady size. null's own completion modes
//! (timer, spin budget, poll list) are checked the same way in
//! `drivers/tests/no_alloc_null.rs`.
//!
//! It has its own `main` (`harness = false`): libtest's runner thread
//! allocates while a test runs, and the counter is process-wide, so under
//! load the runner's bookkeeping landed in the measured window.

#[cfg(not(loom))]
mod common;

#[cfg(not(loom))]
mod hot_path {
    use super::common::Deferred;
    use blkstack_core::testing::{BioFreeList, CountingAlloc};
    use blkstack_core::{AlignedBuf, Bio, EndIo, Op, Status};
    use blkstack_mq::queue::{Driver, EngineOptions, Queue, QueueRq, Rq};
    use std::sync::Arc;

    #[global_allocator]
    static GLOBAL: CountingAlloc = CountingAlloc;

    struct ZeroReads;

    impl Driver for ZeroReads {
        fn queue_rq(&self, rq: Rq<'_>) -> QueueRq {
            rq.bio.data_mut().fill(0);
            QueueRq::Done(Status::Ok)
        }
    }

    /// `batch` > 1: bios go through `submit_batch` in groups of up to that
    /// many (whatever is free when the group is built), with one reused vector.
    fn run<D: Driver>(
        q: &Queue<D>,
        owner: &Arc<BioFreeList>,
        dyn_owner: &Arc<dyn EndIo>,
        n: u64,
        batch: &mut Vec<Bio>,
        batch_max: usize,
    ) {
        let mut i = 0;
        while i < n {
            let mut bio = owner.take(None);
            let buf = bio.buf;
            bio.rearm(dyn_owner.clone(), Op::Read, (i % 1024) * 4096, 4096, buf);
            i += 1;
            if batch_max <= 1 {
                q.submit(bio);
                continue;
            }
            batch.push(bio);
            let more = !owner.is_empty();
            if batch.len() >= batch_max || !more || i == n {
                q.submit_batch(batch);
            }
        }
    }

    /// Allocations during a measured run; the first ones' backtraces are
    /// printed when there are any.
    fn allocations_per_io<D: Driver>(driver: D, batch_max: usize) -> u64 {
        const QD: usize = 64;
        let q = Queue::new(driver, EngineOptions::default()).expect("queue");
        let mem = AlignedBuf::new(QD * 4096);
        let owner = BioFreeList::new(QD);
        let dyn_owner: Arc<dyn EndIo> = owner.clone();
        // SAFETY: every bio is back on the list before this function
        // returns and `mem` goes away.
        unsafe { owner.prime(&mem, QD, 4096) };
        let mut batch = Vec::with_capacity(QD);
        run(&q, &owner, &dyn_owner, 5_000, &mut batch, batch_max);
        CountingAlloc::trace_start();
        let before = CountingAlloc::count();
        run(&q, &owner, &dyn_owner, 20_000, &mut batch, batch_max);
        let after = CountingAlloc::count();
        for t in CountingAlloc::trace_take() {
            println!("allocated at:\n{t}");
        }
        // Let the last completions come home before the buffers go away.
        loop {
            if owner.len() == QD {
                break;
            }
            std::thread::yield_now();
        }
        after - before
    }

    /// The counter is process-wide, so the modes run one after another on the
    /// only thread of this process that is not the engine's.
    pub fn main() {
        for (batch, what) in [(1, ""), (32, ", batches")] {
            assert_eq!(allocations_per_io(ZeroReads, batch), 0, "inline{what}");
            println!("hot path allocates nothing: inline{what} ... ok");
            let deferred = Deferred::new(ZeroReads);
            assert_eq!(
                allocations_per_io(deferred, batch),
                0,
                "completion thread{what}"
            );
            println!("hot path allocates nothing: completion thread{what} ... ok");
        }
    }
}

#[cfg(not(loom))]
fn main() {
    hot_path::main();
}

#[cfg(loom)]
fn main() {}
