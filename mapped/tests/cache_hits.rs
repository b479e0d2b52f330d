//! The cache target's read hits from several threads at once, most of
//! them served without the policy lock (`cache/hits.rs`), beside misses,
//! promotions, writes and idle writebacks: every read returns the data
//! written, and the status counts every read once, as a hit or a miss,
//! as the kernel's `cache_status` does.

mod thin_support;

use blkstack_core::Device;
use blkstack_mapped::Registry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thin_support::*;

const BS: u64 = 128;
const BLOCK_BYTES: u64 = BS * 512;
const ORIGIN_BLOCKS: u64 = 64;
const CACHE_BLOCKS: u64 = 16;
const HOT: u64 = 8;

fn stack() -> Arc<Registry> {
    let reg = Registry::new();
    let origin = ORIGIN_BLOCKS * BS;
    for (name, sectors) in [
        ("meta", 8192),
        ("cdev", CACHE_BLOCKS * BS),
        ("origin", origin),
    ] {
        reg.create(name, &format!("0 {sectors} memory")).unwrap();
    }
    reg.create(
        "cache",
        &format!("0 {origin} cache meta cdev origin {BS} 1 writeback smq 0"),
    )
    .unwrap();
    reg
}

/// Read hits and read misses so far (status fields 4 and 5).
fn reads(reg: &Registry) -> (u64, u64) {
    let s = status(reg, "cache");
    (s[4].parse().unwrap(), s[5].parse().unwrap())
}

fn check(dev: &dyn Device, off: u64) {
    assert_eq!(read(dev, off, 4096), pattern(1, off, 4096), "read at {off}");
}

#[test]
fn concurrent_hits_read_the_right_data_and_are_all_counted() {
    let reg = stack();
    let dev = reg.device("cache").unwrap();
    for b in 0..ORIGIN_BLOCKS {
        write(
            &*dev,
            b * BLOCK_BYTES,
            &pattern(1, b * BLOCK_BYTES, BLOCK_BYTES as usize),
        );
    }
    // Warm the hot set: each block read until the cache serves it.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (h0, _) = reads(&reg);
        for b in 0..HOT {
            check(&*dev, b * BLOCK_BYTES);
        }
        if reads(&reg).0 - h0 == HOT {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no promotions: {:?}",
            status(&reg, "cache")
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let (h0, m0) = reads(&reg);
    let issued = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..3u64)
        .map(|t| {
            let (dev, issued) = (dev.clone(), issued.clone());
            std::thread::spawn(move || {
                let mut x = t + 1;
                for i in 0..4_000u64 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    // Mostly the hot set, now and then a cold block (a miss,
                    // maybe a promotion); thread 0 also rewrites hot blocks
                    // with the same data (write hits, dirty blocks).
                    let b = if i % 16 == 0 {
                        (x >> 33) % ORIGIN_BLOCKS
                    } else {
                        (x >> 33) % HOT
                    };
                    let off = b * BLOCK_BYTES + (x >> 13) % (BLOCK_BYTES / 4096) * 4096;
                    if t == 0 && i % 64 == 0 {
                        write(&*dev, off, &pattern(1, off, 4096));
                    } else {
                        check(&*dev, off);
                        issued.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let (h1, m1) = reads(&reg);
    let n = issued.load(Ordering::Relaxed);
    assert_eq!((h1 - h0) + (m1 - m0), n, "every read counted once");
    assert!(h1 - h0 > n / 2, "mostly hits: {} of {n}", h1 - h0);
    // Idle, the dirty blocks are written back (each pending meanwhile);
    // the hits that follow still read the same data.
    let deadline = Instant::now() + Duration::from_secs(60);
    while status(&reg, "cache")[10] != "0" {
        assert!(
            Instant::now() < deadline,
            "no writeback: {:?}",
            status(&reg, "cache")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for b in 0..ORIGIN_BLOCKS {
        check(&*dev, b * BLOCK_BYTES);
    }
    let origin = reg.device("origin").unwrap();
    for b in 0..ORIGIN_BLOCKS {
        check(&*origin, b * BLOCK_BYTES);
    }
}
