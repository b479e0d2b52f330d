//! The hot path allocates nothing per I/O: a counting global allocator
//! (this test binary only) watches a run of reads through the queue with
//! inline, softirq and timer completion (the last also with the timer
//! thread's spin budget, and with polled bios reaped by the submitter's
//! own poll), after a warm-up that lets thread-locals and reusable buffers
//! reach their steady size.
//!
//! It has its own `main` (`harness = false`): libtest's runner thread
//! allocates while a test runs, and the counter is process-wide, so under
//! load the runner's bookkeeping landed in the measured window.

#[cfg(not(loom))]
mod hot_path {
    use blkstack_core::{AlignedBuf, Bio, BioFlags, EndIo, Op, Status};
    use blkstack_mq::queue::{CompletionMode, Driver, EngineOptions, Queue, QueueRq, Rq};
    use parking_lot::{Condvar, Mutex};
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::AtomicU64;
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;

    struct Counting;

    static ALLOCS: AtomicU64 = AtomicU64::new(0);

    // SAFETY: forwards to the system allocator; only counts.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            ALLOCS.fetch_add(1, Relaxed);
            System.alloc(l)
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            System.dealloc(p, l)
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
            ALLOCS.fetch_add(1, Relaxed);
            System.realloc(p, l, n)
        }
    }

    #[global_allocator]
    static GLOBAL: Counting = Counting;

    struct ZeroReads;

    impl Driver for ZeroReads {
        fn queue_rq(&self, rq: Rq<'_>) -> QueueRq {
            rq.bio.data_mut().fill(0);
            QueueRq::Done(Status::Ok)
        }
    }

    struct Recycle {
        free: Mutex<Vec<Bio>>,
        cv: Condvar,
    }

    impl EndIo for Recycle {
        fn end_io(&self, bio: Bio, _status: Status, _private: u64) {
            self.free.lock().push(bio);
            self.cv.notify_one();
        }
    }

    /// Take a free bio; with `polled`, reap due requests with the queue's
    /// poll while none is free, as a polling submitter does.
    fn take_free(q: &Queue<ZeroReads>, owner: &Recycle, polled: bool) -> Bio {
        let mut f = owner.free.lock();
        while f.is_empty() {
            if polled {
                drop(f);
                if q.poll() == 0 {
                    std::hint::spin_loop();
                }
                f = owner.free.lock();
            } else {
                owner.cv.wait(&mut f);
            }
        }
        f.pop().expect("free bio")
    }

    /// `batch` > 1: bios go through `submit_batch` in groups of up to that
    /// many (whatever is free when the group is built), with one reused vector.
    fn run(
        q: &Queue<ZeroReads>,
        owner: &Arc<Recycle>,
        dyn_owner: &Arc<dyn EndIo>,
        n: u64,
        batch: &mut Vec<Bio>,
        batch_max: usize,
        polled: bool,
    ) {
        let mut i = 0;
        while i < n {
            let mut bio = take_free(q, owner, polled);
            let buf = bio.buf;
            bio.rearm(dyn_owner.clone(), Op::Read, (i % 1024) * 4096, 4096, buf);
            if polled {
                bio.flags.insert(BioFlags::POLLED);
            }
            i += 1;
            if batch_max <= 1 {
                q.submit(bio);
                continue;
            }
            batch.push(bio);
            let more = !owner.free.lock().is_empty();
            if batch.len() >= batch_max || !more || i == n {
                q.submit_batch(batch);
            }
        }
    }

    fn allocations_per_io(opts: EngineOptions, batch_max: usize) -> u64 {
        const QD: usize = 64;
        let polled = opts.iopoll;
        let q = Queue::new(ZeroReads, opts).expect("queue");
        let mem = AlignedBuf::new(QD * 4096);
        let owner = Arc::new(Recycle {
            free: Mutex::new(Vec::with_capacity(QD)),
            cv: Condvar::new(),
        });
        let dyn_owner: Arc<dyn EndIo> = owner.clone();
        for i in 0..QD {
            // SAFETY: `mem` outlives the queue's use of it: every bio is back on
            // the free list before this function returns.
            let io = unsafe { mem.io_buf(i * 4096, 4096) };
            Bio::new(Op::Read, 0, 4096, io, dyn_owner.clone(), i as u64).complete(Status::Ok);
        }
        let mut batch = Vec::with_capacity(QD);
        run(&q, &owner, &dyn_owner, 5_000, &mut batch, batch_max, polled);
        let before = ALLOCS.load(Relaxed);
        run(
            &q, &owner, &dyn_owner, 20_000, &mut batch, batch_max, polled,
        );
        let after = ALLOCS.load(Relaxed);
        // Let the last completions come home before the buffers go away.
        loop {
            if owner.free.lock().len() == QD {
                break;
            }
            if polled {
                q.poll();
            }
            std::thread::yield_now();
        }
        after - before
    }

    /// The counter is process-wide, so the modes run one after another on the
    /// only thread of this process that is not the engine's.
    pub fn main() {
        let with = |completion| EngineOptions {
            completion,
            ..EngineOptions::default()
        };
        let timer = CompletionMode::Timer { nsec: 20_000 };
        for (opts, batch, what) in [
            (with(CompletionMode::Inline), 1, "inline"),
            (with(CompletionMode::Softirq), 1, "softirq"),
            (with(CompletionMode::Inline), 32, "inline, batches"),
            (with(CompletionMode::Softirq), 32, "softirq, batches"),
            (with(timer), 32, "timer, batches"),
            (
                EngineOptions {
                    timer_spin_max_ns: 50_000,
                    ..with(timer)
                },
                32,
                "timer with a spin budget, batches",
            ),
            (
                EngineOptions {
                    iopoll: true,
                    ..with(timer)
                },
                32,
                "timer, polled bios, batches",
            ),
        ] {
            assert_eq!(allocations_per_io(opts, batch), 0, "{what}");
            println!("hot path allocates nothing: {what} ... ok");
        }
    }
}

#[cfg(not(loom))]
fn main() {
    hot_path::main();
}

#[cfg(loom)]
fn main() {}
