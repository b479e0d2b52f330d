//! Tests of [`super`] (`memory.rs`), kept apart so that file stays short.

use super::*;
use blkstack_core::sync::submit_and_wait_flags;
use blkstack_core::{submit_and_wait, Device};
use std::sync::Arc;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn stores_and_reads_back_across_pages() {
    for irq in ["irqmode=0", "irqmode=1"] {
        stores_and_reads_back(MemoryDevice::from_args(1 << 20, &[irq]).unwrap());
    }
}

fn stores_and_reads_back(d: MemoryDevice) {
    let mut w = pattern(8192 + 1024, 7);
    assert_eq!(
        submit_and_wait(&*d, Op::Write, 3584, w.len() as u64, &mut w),
        Status::Ok
    );
    let mut r = vec![0xffu8; w.len()];
    assert_eq!(
        submit_and_wait(&*d, Op::Read, 3584, r.len() as u64, &mut r),
        Status::Ok
    );
    assert_eq!(r, w);
    // Never written: zeroes.
    let mut r = vec![0xffu8; 4096];
    assert_eq!(
        submit_and_wait(&*d, Op::Read, 65536, 4096, &mut r),
        Status::Ok
    );
    assert!(r.iter().all(|&b| b == 0));
}

#[test]
fn discard_frees_and_nounmap_zeroes() {
    let d = MemoryDevice::from_args(1 << 20, &[]).unwrap();
    let mut w = pattern(16384, 1);
    submit_and_wait(&*d, Op::Write, 0, 16384, &mut w);
    assert_eq!(d.store().allocated_pages(), 4);
    // Discard 512..12800: page 0 and 3 partly zeroed, pages 1-2 freed.
    assert_eq!(
        submit_and_wait(&*d, Op::Discard, 512, 12288, &mut []),
        Status::Ok
    );
    assert_eq!(d.store().allocated_pages(), 2);
    let mut r = vec![0u8; 16384];
    submit_and_wait(&*d, Op::Read, 0, 16384, &mut r);
    assert_eq!(&r[..512], &w[..512]);
    assert!(r[512..12800].iter().all(|&b| b == 0));
    assert_eq!(&r[12800..], &w[12800..]);
    let ext = d.extents(0, 16384).unwrap();
    assert_eq!(
        ext,
        vec![
            Extent {
                offset: 0,
                len: 4096,
                hole: false
            },
            Extent {
                offset: 4096,
                len: 8192,
                hole: true
            },
            Extent {
                offset: 12288,
                len: 4096,
                hole: false
            },
        ]
    );
    // NOUNMAP write-zeroes keeps (allocates) the pages.
    let st = submit_and_wait_flags(&*d, Op::WriteZeroes, BioFlags::NOUNMAP, 0, 16384, &mut []);
    assert_eq!(st, Status::Ok);
    assert_eq!(d.store().allocated_pages(), 4);
    submit_and_wait(&*d, Op::Read, 0, 16384, &mut r);
    assert!(r.iter().all(|&b| b == 0));
    // A range inside one page zeroes just that part.
    let mut w = pattern(4096, 9);
    submit_and_wait(&*d, Op::Write, 0, 4096, &mut w);
    assert_eq!(
        submit_and_wait(&*d, Op::Discard, 1024, 1024, &mut []),
        Status::Ok
    );
    let mut r = vec![0u8; 4096];
    submit_and_wait(&*d, Op::Read, 0, 4096, &mut r);
    assert_eq!(&r[..1024], &w[..1024]);
    assert!(r[1024..2048].iter().all(|&b| b == 0));
    assert_eq!(&r[2048..], &w[2048..]);
    // Plain write-zeroes frees them.
    assert_eq!(
        submit_and_wait(&*d, Op::WriteZeroes, 0, 16384, &mut []),
        Status::Ok
    );
    assert_eq!(d.store().allocated_pages(), 0);
    assert_eq!(
        d.extents(0, 1 << 20).unwrap(),
        vec![Extent {
            offset: 0,
            len: 1 << 20,
            hole: true
        }]
    );
}

#[test]
fn huge_sparse_device_extents_and_discard() {
    let size = 1u64 << 40;
    let d = MemoryDevice::from_args(size, &["bs=4096"]).unwrap();
    let mut w = pattern(4096, 3);
    submit_and_wait(&*d, Op::Write, size / 2, 4096, &mut w);
    let ext = d.extents(0, size).unwrap();
    assert_eq!(ext.len(), 3);
    assert_eq!(
        ext[1],
        Extent {
            offset: size / 2,
            len: 4096,
            hole: false
        }
    );
    assert_eq!(
        submit_and_wait(&*d, Op::Discard, 0, size, &mut []),
        Status::Ok
    );
    assert_eq!(d.store().allocated_pages(), 0);
}

#[test]
fn bad_bios_and_args() {
    let d = MemoryDevice::from_args(1 << 20, &["bs=4096"]).unwrap();
    let mut b = vec![0u8; 512];
    assert_eq!(
        submit_and_wait(&*d, Op::Write, 0, 512, &mut b),
        Status::Invalid
    );
    let mut b = vec![0u8; 4096];
    assert_eq!(
        submit_and_wait(&*d, Op::Write, 1 << 20, 4096, &mut b),
        Status::Invalid
    );
    assert_eq!(d.store().allocated_pages(), 0);
    assert_eq!(d.table_args(), "bs=4096");
    let d = MemoryDevice::from_args(1 << 20, &["bs=4096", "irqmode=1", "submit_queues=2"]).unwrap();
    assert_eq!(d.table_args(), "bs=4096 irqmode=1 submit_queues=2");
    assert!(d.status().contains("tags=0/128"), "{}", d.status());
    assert!(MemoryDevice::from_args(1 << 20, &["bs=8192"])
        .err()
        .unwrap()
        .to_string()
        .contains("bs"));
    assert!(MemoryDevice::from_args(1 << 20, &["foo=1"])
        .err()
        .unwrap()
        .to_string()
        .contains("foo"));
}

#[test]
fn writes_past_max_alloc_fail_with_no_space_until_pages_are_freed() {
    let d = MemoryDevice::from_args(1 << 20, &["max_alloc=8K"]).unwrap();
    assert_eq!(d.table_args(), "max_alloc=8192");
    assert!(
        d.status()
            .contains("allocated_bytes=0 max_alloc_bytes=8192 "),
        "{}",
        d.status()
    );
    let mut w = pattern(8192, 5);
    assert_eq!(submit_and_wait(&*d, Op::Write, 0, 8192, &mut w), Status::Ok);
    // Rewriting allocated pages needs no new page.
    assert_eq!(
        submit_and_wait(&*d, Op::Write, 0, 4096, &mut w[..4096]),
        Status::Ok
    );
    let mut w3 = pattern(4096, 6);
    assert_eq!(
        submit_and_wait(&*d, Op::Write, 65536, 4096, &mut w3),
        Status::NoSpace
    );
    assert_eq!(
        submit_and_wait_flags(
            &*d,
            Op::WriteZeroes,
            BioFlags::NOUNMAP,
            65536,
            4096,
            &mut []
        ),
        Status::NoSpace
    );
    assert_eq!(d.store().allocated_pages(), 2);
    assert!(d
        .status()
        .contains("allocated_bytes=8192 max_alloc_bytes=8192 "));
    // The data already held is intact.
    let mut r = vec![0u8; 8192];
    submit_and_wait(&*d, Op::Read, 0, 8192, &mut r);
    assert_eq!(r, w);
    // Discarding a page makes room again.
    assert_eq!(
        submit_and_wait(&*d, Op::Discard, 0, 4096, &mut []),
        Status::Ok
    );
    assert_eq!(
        submit_and_wait(&*d, Op::Write, 65536, 4096, &mut w3),
        Status::Ok
    );
    for bad in [
        "max_alloc=0",
        "max_alloc=100",
        "max_alloc=1X",
        "max_alloc=99999999999T",
    ] {
        let e = MemoryDevice::from_args(1 << 20, &[bad])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("max_alloc"), "{bad}: {e}");
    }
    let d = MemoryDevice::from_args(1 << 20, &["max_alloc=2M", "bs=4096"]).unwrap();
    assert_eq!(d.table_args(), "bs=4096 max_alloc=2097152");
}

#[test]
fn the_budget_bounds_every_store_charged_to_it_and_is_returned_on_drop() {
    let budget: &'static AllocBudget = Box::leak(Box::new(AllocBudget::new(3 * PAGE_SIZE)));
    let a = PageStore::with_budget(budget);
    let b = PageStore::with_budget(budget);
    let page = vec![7u8; PAGE_SIZE as usize];
    assert_eq!(a.write(0, &page, u64::MAX), Status::Ok);
    assert_eq!(b.write(0, &page, u64::MAX), Status::Ok);
    assert_eq!(b.write(PAGE_SIZE, &page, u64::MAX), Status::Ok);
    assert_eq!(a.write(PAGE_SIZE, &page, u64::MAX), Status::NoSpace);
    assert_eq!(budget.used_bytes(), 3 * PAGE_SIZE);
    assert_eq!(a.allocated_pages(), 1);
    drop(b);
    assert_eq!(budget.used_bytes(), PAGE_SIZE);
    assert_eq!(a.write(PAGE_SIZE, &page, u64::MAX), Status::Ok);
    budget.set_limit_bytes(PAGE_SIZE);
    assert_eq!(a.write(2 * PAGE_SIZE, &page, u64::MAX), Status::NoSpace);
    // The process budget comes from MemAvailable, below it.
    let avail = mem_available().expect("/proc/meminfo MemAvailable");
    assert!(process_budget().limit_bytes() < avail);
    assert!(process_budget().limit_bytes() > 0);
}

#[test]
fn concurrent_writers_distinct_blocks() {
    let d = Arc::new(MemoryDevice::from_args(8 << 20, &[]).unwrap());
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let d = d.clone();
            std::thread::spawn(move || {
                for i in 0..256u64 {
                    let off = (i * 4 + t as u64) * 2048;
                    let mut w = pattern(2048, t.wrapping_add(i as u8));
                    assert_eq!(
                        submit_and_wait(&**d, Op::Write, off, 2048, &mut w),
                        Status::Ok
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for t in 0..4u8 {
        for i in 0..256u64 {
            let off = (i * 4 + t as u64) * 2048;
            let mut r = vec![0u8; 2048];
            submit_and_wait(&**d, Op::Read, off, 2048, &mut r);
            assert_eq!(r, pattern(2048, t.wrapping_add(i as u8)));
        }
    }
}

#[test]
fn a_fully_written_device_has_no_holes_until_one_is_punched() {
    let d = MemoryDevice::from_args(65536, &[]).unwrap();
    let mut w = pattern(65536 - 4096, 3);
    submit_and_wait(&*d, Op::Write, 0, 65536 - 4096, &mut w);
    // One page never written: its hole is reported.
    let ext = d.extents(0, 65536).unwrap();
    assert_eq!(ext.last().map(|e| (e.offset, e.hole)), Some((61440, true)));
    let mut last = pattern(4096, 4);
    submit_and_wait(&*d, Op::Write, 61440, 4096, &mut last);
    // All pages allocated: "all data", without a map.
    assert_eq!(d.extents(0, 65536), None);
    assert_eq!(
        submit_and_wait(&*d, Op::Discard, 8192, 4096, &mut []),
        Status::Ok
    );
    let ext = d.extents(0, 65536).unwrap();
    assert!(ext.contains(&Extent {
        offset: 8192,
        len: 4096,
        hole: true
    }));
}

/// The chunked store against a byte-array model: random writes, discards
/// and NOUNMAP zeroings that straddle pages and chunks, then every byte,
/// the allocated page count and the hole map must agree with the model.
#[test]
fn page_store_matches_a_flat_model_under_random_operations() {
    const PAGES: u64 = 80; // five chunks
    let size = PAGES * PAGE_SIZE;
    let store = PageStore::new();
    let mut model = vec![0u8; size as usize];
    let mut present = vec![false; PAGES as usize];
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut rnd = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for step in 0..3000u64 {
        let off = rnd(size);
        let len = (1 + rnd(3 * 16 * PAGE_SIZE)).min(size - off);
        let (first, last) = (off / PAGE_SIZE, (off + len - 1) / PAGE_SIZE);
        match rnd(3) {
            0 => {
                let data: Vec<u8> = (0..len).map(|i| (i ^ step) as u8 | 1).collect();
                assert_eq!(store.write(off, &data, u64::MAX), Status::Ok);
                model[off as usize..(off + len) as usize].copy_from_slice(&data);
                present[first as usize..=last as usize].fill(true);
            }
            kind => {
                let keep = kind == 2;
                assert_eq!(store.zero_range(off, len, keep, u64::MAX), Status::Ok);
                model[off as usize..(off + len) as usize].fill(0);
                for p in first..=last {
                    let whole = p * PAGE_SIZE >= off && (p + 1) * PAGE_SIZE <= off + len;
                    if keep {
                        present[p as usize] = true;
                    } else if whole {
                        present[p as usize] = false;
                    }
                }
            }
        }
    }
    let mut back = vec![0xAAu8; size as usize];
    store.read(0, &mut back);
    assert!(back == model, "contents differ from the model");
    let held = present.iter().filter(|&&p| p).count() as u64;
    assert_eq!(store.allocated_pages(), held);
    for e in store.extents(0, size) {
        for p in e.offset / PAGE_SIZE..(e.offset + e.len) / PAGE_SIZE {
            assert_eq!(present[p as usize], !e.hole, "page {p}");
        }
    }
}

/// Submits `n` polled 4 KiB writes of `fill` and polls until they are all
/// done, from a little before they are due; returns how many the poll
/// ended (the completion thread, the backstop, would end the others).
fn polled_writes_reaped(d: &MemoryDevice, n: u64, due_ns: u64, fill: u8) -> usize {
    use blkstack_core::clock::now_ns;
    use blkstack_core::testing::CompletionRecorder;
    use blkstack_core::IoBuf;
    let rec = CompletionRecorder::new();
    let mut mem = vec![fill; (n * 4096) as usize];
    let t0 = now_ns();
    for i in 0..n {
        // SAFETY: `mem` outlives the bios: every one is waited for below.
        let buf = unsafe { IoBuf::from_raw(mem.as_mut_ptr().add(i as usize * 4096), 4096) };
        let mut bio = Bio::new(Op::Write, i * 4096, 4096, buf, rec.clone(), i);
        bio.flags.insert(BioFlags::POLLED);
        d.submit(bio);
    }
    // Not due yet: polling ends nothing and nothing else does either.
    assert_eq!(d.poll(), 0);
    assert_eq!(rec.count(), 0);
    std::thread::sleep(std::time::Duration::from_nanos(due_ns / 2));
    let mut by_poll = 0;
    while rec.count() < n as usize {
        let ended = d.poll();
        if ended > 0 {
            assert!(now_ns() - t0 >= due_ns, "completed early");
        }
        by_poll += ended;
        assert!(now_ns() - t0 < 10_000_000_000, "never completed");
    }
    assert!(rec.completions().iter().all(|c| c.status == Status::Ok));
    by_poll
}

#[test]
fn iopoll_leaves_polled_bios_to_the_submitters_poll() {
    // A backstop of a minute: only the poll can end them, however long a
    // loaded machine deschedules this thread.
    let d = MemoryDevice::from_args(
        1 << 20,
        &[
            "irqmode=2",
            "completion_nsec=100000000",
            "iopoll=1",
            "poll_backstop_ms=60000",
        ],
    )
    .unwrap();
    assert!(d.polls());
    assert_eq!(polled_writes_reaped(&d, 4, 100_000_000, 0x40), 4);
    let mut r = vec![0u8; 4 * 4096];
    assert_eq!(
        submit_and_wait(&*d, Op::Read, 0, r.len() as u64, &mut r),
        Status::Ok
    );
    assert!(r.iter().all(|&b| b == 0x40), "polled writes not stored");
}

#[test]
fn without_iopoll_memory_does_not_poll() {
    let d = MemoryDevice::from_args(1 << 20, &["irqmode=2", "completion_nsec=1000"]).unwrap();
    assert!(!d.polls());
    assert_eq!(d.poll(), 0);
}
