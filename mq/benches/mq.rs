//! Criterion benches of the engine's hot paths: one tag get+put on the
//! sbitmap queue and on a tag set, and one 4 KiB read submitted to a
//! null-like driver through the whole queue with inline completion (the
//! in-process `irqmode=0` case), keeping 64 requests' bios in
//! circulation as a QD64 job would. Per-iteration time is per I/O; its
//! inverse is the IOPS one submitting thread can reach. The batch variant
//! submits the 64 bios with one `submit_batch` per iteration.

use blkstack_core::{AlignedBuf, Bio, EndIo, IoBuf, Op, Status};
use blkstack_mq::queue::{Driver, EngineOptions, Queue, QueueRq, Rq};
use blkstack_mq::sbitmap::{SbitmapQueue, WakeupAlgo};
use blkstack_mq::tags::{HctxTagState, Tags, TagsConfig};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use parking_lot::Mutex;
use std::hint::black_box;
use std::sync::Arc;

fn bench_sbitmap(c: &mut Criterion) {
    let mut g = c.benchmark_group("sbitmap_get_clear");
    for algo in [WakeupAlgo::Counter, WakeupAlgo::WaitCnt] {
        for depth in [64u32, 1024] {
            let q = SbitmapQueue::new(depth, false, algo);
            // Keep half the map busy so searches are not trivially at bit 0.
            let held: Vec<u32> = (0..depth / 2).filter_map(|_| q.get()).collect();
            g.bench_function(BenchmarkId::new(algo.name(), depth), |b| {
                b.iter(|| {
                    let t = q.get().expect("free bit");
                    q.clear(black_box(t));
                })
            });
            for t in held {
                q.clear(t);
            }
        }
    }
    g.finish();
}

fn bench_tags(c: &mut Criterion) {
    let t = Tags::new(TagsConfig {
        depth: 64,
        ..TagsConfig::default()
    })
    .expect("tags");
    let hs = HctxTagState::default();
    c.bench_function("tags_get_put_depth64", |b| {
        b.iter(|| {
            let tag = t.get_nowait(&hs, false).expect("tag");
            t.put(&hs, black_box(tag));
        })
    });
}

/// null_blk with `irqmode=0`: reads are zero-filled, done at once.
struct NullLike;

impl Driver for NullLike {
    fn queue_rq(&self, rq: Rq<'_>) -> QueueRq {
        if rq.bio.op == Op::Read {
            rq.bio.data_mut().fill(0);
        }
        QueueRq::Done(Status::Ok)
    }
}

/// The owner: completed bios go back on a free list for reuse.
struct Recycle {
    free: Mutex<Vec<Bio>>,
}

impl EndIo for Recycle {
    fn end_io(&self, bio: Bio, status: Status, _private: u64) {
        debug_assert_eq!(status, Status::Ok);
        self.free.lock().push(bio);
    }
}

const QD: usize = 64;
const BS: usize = 4096;
/// 1 GiB of 4 KiB blocks.
const SIZE_BLOCKS: u64 = 1 << 18;

/// A null-like queue and `QD` bios on the owner's free list, each with its
/// own `BS` range of the returned buffer.
fn null_queue_with_free_bios() -> (Queue<NullLike>, AlignedBuf, Arc<Recycle>, Arc<dyn EndIo>) {
    let q = Queue::new(NullLike, EngineOptions::default()).expect("queue");
    let buf = AlignedBuf::new(QD * BS);
    let owner = Arc::new(Recycle {
        free: Mutex::new(Vec::with_capacity(QD)),
    });
    let dyn_owner: Arc<dyn EndIo> = owner.clone();
    for i in 0..QD {
        // SAFETY: the caller holds `buf` (returned beside the queue) for as
        // long as it submits; `NullLike` completes inline, so no bio is in
        // flight when the caller's locals go; each bio owns its range.
        let io = unsafe { buf.io_buf(i * BS, BS) };
        // Completing it at once puts it on the free list, ready for reuse.
        Bio::new(Op::Read, 0, BS as u64, io, dyn_owner.clone(), i as u64).complete(Status::Ok);
    }
    (q, buf, owner, dyn_owner)
}

/// xorshift64: the next random 4 KiB-aligned offset.
fn next_offset(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    (*x % SIZE_BLOCKS) * BS as u64
}

fn bench_null_submit(c: &mut Criterion) {
    let (q, _buf, owner, dyn_owner) = null_queue_with_free_bios();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    c.bench_function("null_submit_4k_randread_qd64_inline", |b| {
        b.iter(|| {
            let mut bio = owner.free.lock().pop().expect("a free bio");
            let off = next_offset(&mut x);
            let io: IoBuf = bio.buf;
            bio.rearm(dyn_owner.clone(), Op::Read, off, BS as u64, io);
            q.submit(bio);
        })
    });
    println!("engine after bench: {}", q.status());
}

/// The same I/O, submitted as the bench's plug does: all 64 free bios in
/// one `submit_batch` (tags a word at a time, inline completions ended
/// together). One iteration is 64 I/Os (criterion's throughput line gives
/// the per-I/O rate).
fn bench_null_submit_batch(c: &mut Criterion) {
    let (q, _buf, owner, dyn_owner) = null_queue_with_free_bios();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut plug: Vec<Bio> = Vec::with_capacity(QD);
    let mut g = c.benchmark_group("null_submit_batch");
    g.throughput(Throughput::Elements(QD as u64));
    g.bench_function("4k_randread_qd64_inline_batch64", |b| {
        b.iter(|| {
            std::mem::swap(&mut *owner.free.lock(), &mut plug);
            for bio in plug.iter_mut() {
                let off = next_offset(&mut x);
                let io: IoBuf = bio.buf;
                bio.rearm(dyn_owner.clone(), Op::Read, off, BS as u64, io);
            }
            q.submit_batch(&mut plug);
        })
    });
    g.finish();
    println!("engine after batch bench: {}", q.status());
}

criterion_group!(
    benches,
    bench_sbitmap,
    bench_tags,
    bench_null_submit,
    bench_null_submit_batch
);
criterion_main!(benches);
