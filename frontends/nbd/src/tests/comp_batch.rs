//! Replies completed inside a completion batch
//! (`blkstack_core::comp_batch`, the kernel's `io_comp_batch`) leave in
//! one send when the batch ends: every one of them must still arrive.

use super::{req, serve};
use crate::proto::*;
use crate::Export;
use blkstack_core::{Bio, Device, Op, Status};
use parking_lot::Mutex;
use std::sync::Arc;

/// Holds reads until `n` have arrived, then ends them all from another
/// thread inside one completion batch, as a delay worker's pass does;
/// anything else (the stop's flush) ends at once.
struct BatchDev {
    held: Mutex<Vec<Bio>>,
    n: usize,
}

impl Device for BatchDev {
    fn submit(&self, bio: Bio) {
        if bio.op != Op::Read {
            bio.complete(Status::Ok);
            return;
        }
        bio.data_mut().fill(0x5a);
        let mut held = self.held.lock();
        held.push(bio);
        if held.len() == self.n {
            let bios = std::mem::take(&mut *held);
            std::thread::spawn(move || {
                let _batch = blkstack_core::comp_batch::CompletionBatch::start();
                for b in bios {
                    b.complete(Status::Ok);
                }
            });
        }
    }
    fn size(&self) -> u64 {
        1 << 20
    }
}

#[test]
fn replies_deferred_to_the_end_of_a_completion_batch_all_arrive() {
    let dev = Arc::new(BatchDev {
        held: Mutex::new(Vec::new()),
        n: 8,
    });
    let run = serve(vec![Export::new("a", dev, false)]);
    let (mut c, _, _) = run.client("a", false);
    for h in 0..8u64 {
        c.request(&req(CMD_READ, 0, h, h * 4096, 512), &[]).unwrap();
    }
    let mut seen = Vec::new();
    for _ in 0..8 {
        let r = c.simple_reply().expect("every reply of the batch arrives");
        assert_eq!(r.error, 0);
        let mut b = [0u8; 512];
        std::io::Read::read_exact(&mut c.s, &mut b).unwrap();
        assert!(
            b.iter().all(|&x| x == 0x5a),
            "read data of handle {}",
            r.handle
        );
        seen.push(r.handle);
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..8).collect::<Vec<_>>());
    run.stop();
}
