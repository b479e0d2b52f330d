//! "blk-mq: avoid repeatedly scheduling the same work to run hardware
//! queue" in miniature: IOPS against queue depth when every completion
//! runs the hardware queues asynchronously (as SCSI did) and the driver
//! pushes back above a fixed number in flight, with the queued bit
//! (`run_dedup`) on and off. Prints one line per configuration; the full
//! experiment, with the patch's published table beside it, is
//! `blkstack lab mq-run`.
//!
//! `cargo bench -p blkstack-mq --bench mq_run` (about 10 s).

use blkstack_core::clock::now_ns;
use blkstack_core::{Bio, EndIo, IoBuf, Op, Status};
use blkstack_mq::queue::{Driver, EngineOptions, Queue, QueueRq, Rq};

#[path = "../tests/common/mod.rs"]
mod common;
use blkstack_mq::sbitmap::{SbitmapQueue, WaitIndex, WakeupAlgo};
use common::Deferred;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// A device that holds at most `limit` requests (a SCSI LUN's queue).
struct LimitedNull {
    limit: u32,
    inflight: AtomicU32,
}

impl Driver for LimitedNull {
    fn queue_rq(&self, _rq: Rq<'_>) -> QueueRq {
        if self.inflight.load(Relaxed) >= self.limit {
            return QueueRq::Busy;
        }
        self.inflight.fetch_add(1, Relaxed);
        QueueRq::Done(Status::Ok)
    }

    fn complete(&self, _rq: Rq<'_>, status: Status) -> Status {
        self.inflight.fetch_sub(1, Relaxed);
        status
    }
}

struct Job {
    free: Mutex<Vec<Bio>>,
    cv: Condvar,
}

impl EndIo for Job {
    fn end_io(&self, bio: Bio, _status: Status, _private: u64) {
        let mut f = self.free.lock();
        f.push(bio);
        if f.len() == 1 {
            self.cv.notify_one();
        }
    }
}

fn run(dedup: bool, qd: usize, jobs: usize, secs: f64) -> (f64, String) {
    let opts = EngineOptions {
        queue_depth: 4096,
        run_dedup: dedup,
        run_on_completion: true,
        ..EngineOptions::default()
    };
    let q = Arc::new(
        // Ended from a completion thread, as null's irqmode=1 does.
        Queue::new(
            Deferred::new(LimitedNull {
                limit: 32,
                inflight: AtomicU32::new(0),
            }),
            opts,
        )
        .expect("queue"),
    );
    let end = now_ns() + (secs * 1e9) as u64;
    let handles: Vec<_> = (0..jobs)
        .map(|_| {
            let q = q.clone();
            std::thread::spawn(move || {
                let job = Arc::new(Job {
                    free: Mutex::new(Vec::with_capacity(qd)),
                    cv: Condvar::new(),
                });
                let owner: Arc<dyn EndIo> = job.clone();
                for i in 0..qd {
                    Bio::new(Op::Write, 0, 0, IoBuf::empty(), owner.clone(), i as u64)
                        .complete(Status::Ok);
                }
                let mut done = 0u64;
                let mut batch = Vec::with_capacity(qd);
                while now_ns() < end {
                    {
                        let mut f = job.free.lock();
                        while f.is_empty() {
                            job.cv.wait(&mut f);
                        }
                        std::mem::swap(&mut *f, &mut batch);
                    }
                    for mut bio in batch.drain(..) {
                        done += 1;
                        bio.rearm(owner.clone(), Op::Write, 0, 0, IoBuf::empty());
                        q.submit(bio);
                    }
                }
                // Drain: wait for every bio to come home.
                let mut f = job.free.lock();
                while f.len() < qd {
                    job.cv
                        .wait_for(&mut f, std::time::Duration::from_millis(10));
                }
                done
            })
        })
        .collect();
    let t0 = now_ns();
    let total: u64 = handles.into_iter().map(|h| h.join().expect("job")).sum();
    let elapsed = (now_ns() - t0) as f64 / 1e9;
    (total as f64 / elapsed, q.status())
}

/// "sbitmap: Use single per-bitmap counting to wake up queued tags" in
/// miniature: `threads` threads each hold a tag for about
/// `hold_ns`, then free it, on a bitmap of `depth` bits: tags per second
/// with each wakeup algorithm.
fn sbitmap_contention(algo: WakeupAlgo, depth: u32, threads: usize, secs: f64) -> (f64, u64) {
    let q = Arc::new(SbitmapQueue::new(depth, false, algo).with_rescue_timeout_ns(1_000_000_000));
    let end = now_ns() + (secs * 1e9) as u64;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let q = q.clone();
            std::thread::spawn(move || {
                let idx = WaitIndex::new();
                for _ in 0..t {
                    q.wait_ptr(&idx);
                }
                let mut n = 0u64;
                while now_ns() < end {
                    let tag = q.get_blocking(&idx, || {});
                    std::hint::black_box(tag);
                    q.clear(tag);
                    n += 1;
                }
                n
            })
        })
        .collect();
    let total: u64 = handles.into_iter().map(|h| h.join().expect("thread")).sum();
    (total as f64 / secs, q.stats().rescued)
}

/// CPU time (this thread's, so other tenants of a shared machine do not
/// count) per 4 KiB read through the queue with inline completion, as the
/// criterion bench `null_submit_4k_randread_qd64_inline` measures it in
/// wall time.
fn null_submit_cpu_ns(ios: u64) -> f64 {
    struct Recycle(Mutex<Vec<Bio>>);
    impl EndIo for Recycle {
        fn end_io(&self, bio: Bio, _s: Status, _p: u64) {
            self.0.lock().push(bio);
        }
    }
    struct ZeroReads;
    impl Driver for ZeroReads {
        fn queue_rq(&self, rq: Rq<'_>) -> QueueRq {
            rq.bio.data_mut().fill(0);
            QueueRq::Done(Status::Ok)
        }
    }
    let q = Queue::new(ZeroReads, EngineOptions::default()).expect("queue");
    let mem = blkstack_core::AlignedBuf::new(64 * 4096);
    let owner = Arc::new(Recycle(Mutex::new(Vec::with_capacity(64))));
    let dyn_owner: Arc<dyn EndIo> = owner.clone();
    for i in 0..64 {
        // SAFETY: `mem` outlives every request; completion is inline, so
        // all are home when this function returns.
        let io = unsafe { mem.io_buf(i * 4096, 4096) };
        Bio::new(Op::Read, 0, 4096, io, dyn_owner.clone(), i as u64).complete(Status::Ok);
    }
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let t0 = blkstack_core::cpu::thread_cpu();
    for _ in 0..ios {
        let mut bio = owner.0.lock().pop().expect("free bio");
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let buf = bio.buf;
        bio.rearm(
            dyn_owner.clone(),
            Op::Read,
            (x % (1 << 18)) * 4096,
            4096,
            buf,
        );
        q.submit(bio);
    }
    let cpu = blkstack_core::cpu::thread_cpu().since(t0);
    cpu.total_ns() as f64 / ios as f64
}

fn main() {
    let ns = null_submit_cpu_ns(5_000_000);
    println!(
        "null submit, irqmode=0, 4k randread: {ns:.0} ns CPU per I/O ({:.2} M IOPS per core)",
        1e3 / ns
    );
    println!("sbitmap: 4 threads get/clear, tags per second (rescued = lost wakeups)");
    for depth in [2u32, 4, 8, 16, 32, 64] {
        let (c, cr) = sbitmap_contention(WakeupAlgo::Counter, depth, 4, 0.5);
        let (w, wr) = sbitmap_contention(WakeupAlgo::WaitCnt, depth, 4, 0.5);
        println!(
            "depth={depth:3} counter={c:>10.0} (rescued {cr})  wait_cnt={w:>10.0} (rescued {wr})"
        );
    }
    // `cargo bench` passes `--bench`; a filter argument is not supported.
    let jobs = 2;
    println!("mq_run: {jobs} jobs, driver limit 32, completion thread, run_on_completion=1");
    for qd in [16usize, 64, 256, 1024] {
        for dedup in [true, false] {
            let (iops, status) = run(dedup, qd, jobs, 1.0);
            println!(
                "qd={qd:5} run_dedup={:3} iops={:>10.0}  [{status}]",
                if dedup { "on" } else { "off" },
                iops
            );
        }
    }
}
