//! A thin device's plugged batches (`Device::submit_batch`, the path the
//! bench and the ublk frontend use): bios that need only a remap go to
//! the data device together, and everything else in the same batch
//! (writes breaking a snapshot's sharing, provisioning writes, FUA, a
//! flush, a discard) still gets what the one-bio path gives it. What the
//! batches wrote is read back one bio at a time on the origin and the
//! snapshot, the pool's counts are the kernel's, and `thin_check` passes.

mod thin_support;

use blkstack_core::clock::now_ns;
use blkstack_core::{Bio, BioFlags, Device, EndIo, IoBuf, Op, Status};
use parking_lot::Mutex;
use std::sync::Arc;
use thin_support::*;

/// Records each bio's status by its cookie.
struct Done {
    status: Mutex<Vec<Option<Status>>>,
}

impl EndIo for Done {
    fn end_io(&self, bio: Bio, status: Status, _private: u64) {
        let mut s = self.status.lock();
        assert!(s[bio.cookie as usize].is_none(), "bio {} twice", bio.cookie);
        s[bio.cookie as usize] = Some(status);
    }
}

/// One request of a batch, with the buffer it lends.
struct Req {
    op: Op,
    flags: BioFlags,
    off: u64,
    buf: Vec<u8>,
}

fn req(op: Op, off: u64, buf: Vec<u8>) -> Req {
    Req {
        op,
        flags: BioFlags::NONE,
        off,
        buf,
    }
}

/// Submit `reqs` as one batch and wait for every bio; reads land in
/// their `buf`.
fn batch(dev: &dyn Device, reqs: &mut [Req]) {
    let done = Arc::new(Done {
        status: Mutex::new(vec![None; reqs.len()]),
    });
    let mut bios: Vec<Bio> = reqs
        .iter_mut()
        .enumerate()
        .map(|(i, r)| {
            let len = if r.op == Op::Discard {
                BLOCK
            } else {
                r.buf.len() as u64
            };
            // SAFETY: each buffer outlives its bio: this function waits
            // below for every bio to complete before `reqs` can be touched.
            let buf = unsafe { IoBuf::from_slice(&mut r.buf) };
            let mut b = Bio::new(r.op, r.off, len, buf, done.clone(), i as u64);
            b.flags = r.flags;
            b
        })
        .collect();
    dev.submit_batch(&mut bios);
    let deadline = now_ns() + 30_000_000_000;
    loop {
        let s = done.status.lock().clone();
        if s.iter().all(Option::is_some) {
            for (i, st) in s.iter().enumerate() {
                assert_eq!(*st, Some(Status::Ok), "bio {i} ({:?})", reqs[i].op);
            }
            return;
        }
        assert!(now_ns() < deadline, "batch not done: {s:?}");
        std::thread::sleep(std::time::Duration::from_millis(1));
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
