//! Plugged batches (`Device::submit_batch`, the bench's and ublk's path)
//! through a `linear` over a `cache`: each passes the batch on whole
//! (`map_batch`), the cache sending its fast read hits to the cache
//! device as one batch and everything else the one-bio way. Batches mix
//! hits, misses, writes, FUA writes and flushes; every read returns what
//! a model of the device says, the status counts every read and write
//! once, as the kernel's `cache_status` does, and no bio stays counted
//! in flight to its cache block: the idle writeback that follows, whose
//! migrations wait for that count to drain, cleans every dirty block.

mod thin_support;

use blkstack_core::{BioFlags, Device, Op};
use blkstack_mapped::Registry;
use std::sync::Arc;
use std::time::{Duration, Instant};
use thin_support::*;

const BS: u64 = 128;
const BLOCK_BYTES: u64 = BS * 512;
const ORIGIN_BLOCKS: u64 = 64;
const CACHE_BLOCKS: u64 = 16;
/// Blocks the linear skips at the cache's start.
const SKIP: u64 = 4;
/// The linear's blocks 0..HOT are the hot set.
const HOT: u64 = 8;
const UNIT: u64 = 4096;
const UNITS_PER_BLOCK: u64 = BLOCK_BYTES / UNIT;
const LIN_BYTES: u64 = (ORIGIN_BLOCKS - SKIP) * BLOCK_BYTES;

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
    reg.create(
        "lin",
        &format!("0 {} linear cache {}", LIN_BYTES / 512, SKIP * BS),
    )
    .unwrap();
    reg
}

/// Status fields 4..8: read hits, read misses, write hits, write misses.
fn counts(reg: &Registry) -> [u64; 4] {
    let s = status(reg, "cache");
    [4, 5, 6, 7].map(|i| s[i].parse().unwrap())
}

/// Read the linear's hot blocks one by one until the cache serves them
/// all as hits (promoted, and hit since the policy's last period).
fn warm(reg: &Registry, lin: &dyn Device, model: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let h0 = counts(reg)[0];
        for b in 0..HOT {
            let off = b * BLOCK_BYTES;
            assert!(read(lin, off, UNIT as usize) == model[off as usize..][..UNIT as usize]);
        }
        if counts(reg)[0] - h0 == HOT {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no promotions: {:?}",
            status(reg, "cache")
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn mixed_batches_through_a_linear_and_a_cache_match_a_model() {
    let reg = stack();
    let lin = reg.device("lin").unwrap();
    let mut model = vec![0u8; LIN_BYTES as usize];
    for b in 0..ORIGIN_BLOCKS - SKIP {
        let off = b * BLOCK_BYTES;
        let data = pattern(1, off, BLOCK_BYTES as usize);
        write(&*lin, off, &data);
        model[off as usize..][..data.len()].copy_from_slice(&data);
    }
    warm(&reg, &*lin, &model);
    let c0 = counts(&reg);
    let (mut reads, mut writes) = (0u64, 0u64);
    let mut x = 1u64;
    for round in 0..300u64 {
        // 24 distinct 4 KiB units: no two bios of a batch overlap, so the
        // reads see the model as it was before the batch.
        let mut units: Vec<u64> = Vec::new();
        let mut reqs: Vec<Req> = Vec::new();
        while reqs.len() < 24 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = x >> 33;
            // Mostly the hot set (hits, the fast ones batched), now and
            // then a cold block (a miss, maybe a promotion).
            let block = if r.is_multiple_of(8) {
                (r >> 3) % (ORIGIN_BLOCKS - SKIP)
            } else {
                (r >> 3) % HOT
            };
            let unit = block * UNITS_PER_BLOCK + (r >> 12) % UNITS_PER_BLOCK;
            if units.contains(&unit) {
                continue;
            }
            units.push(unit);
            let off = unit * UNIT;
            let (op, flags, buf) = match r % 16 {
                0 | 1 => (Op::Write, BioFlags::NONE, pattern(round + 2, off, 4096)),
                2 => (Op::Write, BioFlags::FUA, pattern(round + 2, off, 4096)),
                _ => (Op::Read, BioFlags::NONE, vec![0u8; 4096]),
            };
            reqs.push(Req {
                op,
                flags,
                off,
                buf,
            });
        }
        if round.is_multiple_of(4) {
            let at = (x >> 40) as usize % reqs.len();
            let flush = Req {
                op: Op::Flush,
                flags: BioFlags::NONE,
                off: 0,
                buf: Vec::new(),
            };
            reqs.insert(at, flush);
        }
        batch(&*lin, &mut reqs);
        for r in &reqs {
            let at = r.off as usize..r.off as usize + r.buf.len();
            match r.op {
                Op::Read => {
                    assert!(r.buf == model[at], "round {round}: read at {}", r.off);
                    reads += 1;
                }
                Op::Write => {
                    model[at].copy_from_slice(&r.buf);
                    writes += 1;
                }
                _ => {}
            }
        }
    }
    let c1 = counts(&reg);
    let d: Vec<u64> = (0..4).map(|i| c1[i] - c0[i]).collect();
    assert_eq!(d[0] + d[1], reads, "every read counted once: {d:?}");
    assert_eq!(d[2] + d[3], writes, "every write counted once: {d:?}");
    assert!(d[0] > reads / 2, "mostly read hits: {d:?} of {reads} reads");
    for name in ["lin", "cache"] {
        assert_eq!(reg.get(name).unwrap().inflight(), 0, "{name} in flight");
    }
    // Idle, the dirty blocks are written back: each migration waits for
    // the bios in flight to its block, so a batched hit never uncounted
    // would keep its block dirty.
    let deadline = Instant::now() + Duration::from_secs(60);
    while status(&reg, "cache")[10] != "0" {
        assert!(
            Instant::now() < deadline,
            "no writeback: {:?}",
            status(&reg, "cache")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let origin = reg.device("origin").unwrap();
    for b in 0..ORIGIN_BLOCKS - SKIP {
        let off = b * BLOCK_BYTES;
        let want = &model[off as usize..][..BLOCK_BYTES as usize];
        assert!(read(&*lin, off, BLOCK_BYTES as usize) == want, "block {b}");
        let on_origin = read(&*origin, off + SKIP * BLOCK_BYTES, BLOCK_BYTES as usize);
        assert!(on_origin == want, "block {b} on the origin");
    }
}
