//! A thin device's plugged batches (`Device::submit_batch`, the path the
//! bench and the ublk frontend use): bios that need only a remap go to
//! the data device together, and everything else in the same batch
//! (writes breaking a snapshot's sharing, provisioning writes, FUA, a
//! flush, a discard) still gets what the one-bio path gives it. What the
//! batches wrote is read back one bio at a time on the origin and the
//! snapshot, the pool's counts are the kernel's, and `thin_check` passes.

mod thin_support;

use blkstack_core::{BioFlags, Op};
use thin_support::*;

fn req(op: Op, off: u64, buf: Vec<u8>) -> Req {
    Req {
        op,
        flags: BioFlags::NONE,
        off,
        buf,
    }
}

#[test]
fn mixed_batches_land_as_single_bios_would() {
    let f = files();
    let reg = pool(&f, 1024 * 128, "");
    msg(&reg, "create_thin 1");
    reg.create("thin", "0 8192 thin pool 1").unwrap();
    let thin = reg.device("thin").unwrap();
    // Blocks 0..32 written (4 KiB at 4 KiB into each), then shared with
    // a snapshot.
    let at = |b: u64| b * BLOCK + 4096;
    for b in 0..32 {
        write(&*thin, at(b), &pattern(1, at(b), 4096));
    }
    msg(&reg, "create_snap 2 1");
    reg.create("snap", "0 8192 thin pool 2").unwrap();
    let snap = reg.device("snap").unwrap();

    // One batch: writes breaking sharing (0..8), reads of shared blocks
    // (8..16), a FUA write to a shared block (16), a flush, provisioning
    // writes to unmapped blocks (40..48), a discard of a shared block (20).
    let mut reqs: Vec<Req> = (0..8)
        .map(|b| req(Op::Write, b * BLOCK, pattern(2, b * BLOCK, 4096)))
        .collect();
    reqs.extend((8..16).map(|b| req(Op::Read, at(b), vec![0; 4096])));
    let mut fua = req(Op::Write, at(16), pattern(2, at(16), 4096));
    fua.flags = BioFlags::FUA;
    reqs.push(fua);
    reqs.push(req(Op::Flush, 0, Vec::new()));
    reqs.extend((40..48).map(|b| req(Op::Write, b * BLOCK, pattern(2, b * BLOCK, 8192))));
    reqs.push(req(Op::Discard, 20 * BLOCK, Vec::new()));
    batch(&*thin, &mut reqs);
    for (i, b) in (8..16).enumerate() {
        assert!(
            reqs[8 + i].buf == pattern(1, at(b), 4096),
            "batched read of block {b}"
        );
    }

    // A second batch: the blocks now this device's own are overwritten
    // (a remap only) and read in the same batch.
    let mut reqs: Vec<Req> = (0..8)
        .map(|b| req(Op::Write, at(b) + 4096, pattern(3, at(b) + 4096, 4096)))
        .collect();
    reqs.extend((40..48).map(|b| req(Op::Read, b * BLOCK, vec![0; 8192])));
    batch(&*thin, &mut reqs);
    for (i, b) in (40..48).enumerate() {
        assert!(
            reqs[8 + i].buf == pattern(2, b * BLOCK, 8192),
            "batched read of block {b}"
        );
    }

    // Read back one bio at a time: the origin's blocks whole, as a copy
    // of the shared block with each write laid over it.
    for b in 0..32u64 {
        let mut want = vec![0u8; BLOCK as usize];
        if b != 20 {
            want[4096..8192].copy_from_slice(&pattern(1, at(b), 4096));
        }
        if b < 8 {
            want[..4096].copy_from_slice(&pattern(2, b * BLOCK, 4096));
            want[8192..12288].copy_from_slice(&pattern(3, at(b) + 4096, 4096));
        }
        if b == 16 {
            want[4096..8192].copy_from_slice(&pattern(2, at(16), 4096));
        }
        assert!(
            read(&*thin, b * BLOCK, BLOCK as usize) == want,
            "origin block {b}"
        );
        assert!(
            read(&*snap, at(b), 4096) == pattern(1, at(b), 4096),
            "snapshot block {b}"
        );
    }
    // The origin maps 0..32 but 20, and 40..48; 9 blocks were copied
    // and 8 provisioned besides the 32 the two share.
    assert_eq!(status(&reg, "thin")[0], (39 * 128).to_string());
    assert_eq!(status(&reg, "pool")[2], "49/1024");
    drop((thin, snap));
    reg.remove_all();
    thin_check(&f.meta);
}

/// A batch longer than the entries the batch loads ahead, on a pool whose
/// block size (192 KiB) is not a power of two, so offsets are split by
/// division: overwrites and reads past the look-ahead find their blocks
/// as the first ones do, a second device's batch sees only its own
/// mappings, and every byte reads back where a single bio put it.
#[test]
fn long_batches_on_a_block_size_not_a_power_of_two() {
    const BS: u64 = 384 * 512;
    let f = files();
    let data_sectors = 1024 * 384;
    let reg = files_registry(&f, data_sectors);
    reg.create(
        "pool",
        &format!("0 {data_sectors} thin-pool meta data 384 0"),
    )
    .unwrap();
    msg(&reg, "create_thin 1");
    msg(&reg, "create_thin 2");
    reg.create("a", "0 49152 thin pool 1").unwrap();
    reg.create("b", "0 49152 thin pool 2").unwrap();
    let (a, b) = (reg.device("a").unwrap(), reg.device("b").unwrap());
    // 4 KiB at a different place in each of 96 blocks: 12 KiB into
    // block n, plus 4 KiB per n (wrapping inside the block).
    let at = |n: u64| n * BS + (12 * 1024 + n * 4096) % BS;
    for n in 0..96 {
        write(&*a, at(n), &pattern(1, at(n), 4096));
    }
    // b maps the even blocks only, provisioned by one long batch.
    let mut reqs: Vec<Req> = (0..96)
        .step_by(2)
        .map(|n| req(Op::Write, at(n), pattern(2, at(n), 4096)))
        .collect();
    batch(&*b, &mut reqs);
    // One batch of 96 overwrites of a's blocks (remaps only), then one
    // of 96 reads of b: even blocks hold b's data, odd ones zeroes.
    let mut reqs: Vec<Req> = (0..96)
        .rev()
        .map(|n| req(Op::Write, at(n), pattern(3, at(n), 4096)))
        .collect();
    batch(&*a, &mut reqs);
    let mut reqs: Vec<Req> = (0..96)
        .map(|n| req(Op::Read, at(n), vec![1; 4096]))
        .collect();
    batch(&*b, &mut reqs);
    for (n, r) in reqs.iter().enumerate() {
        let n = n as u64;
        let want = if n.is_multiple_of(2) {
            pattern(2, at(n), 4096)
        } else {
            vec![0; 4096]
        };
        assert!(r.buf == want, "b's block {n} read in a batch");
    }
    for n in 0..96 {
        assert!(
            read(&*a, at(n), 4096) == pattern(3, at(n), 4096),
            "a's block {n}"
        );
    }
    assert_eq!(status(&reg, "a")[0], (96 * 384).to_string());
    assert_eq!(status(&reg, "b")[0], (48 * 384).to_string());
    drop((a, b));
    reg.remove_all();
    thin_check(&f.meta);
}
