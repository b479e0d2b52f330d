//! dm-thin's `shared_read_ds`: a write that breaks the sharing of a
//! snapshot's block is mapped only once the reads of that block counted
//! before it are done. Without the wait, the block it lets go could be
//! freed (the snapshot deleted), handed out after the next commit and
//! written by another device while the old read is still on its way, and
//! that read would return the other device's data.
//!
//! The data device is a `delay` target that holds reads (not writes), so
//! the read is in flight across the write, the deletion, the commit and
//! the new device's write; the pool has two data blocks, so the new
//! device's block is the one let go whenever it is free.

mod thin_support;

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Op, Status};
use blkstack_mapped::Registry;
use thin_support::*;

/// How long the data device holds a read: long enough that the steps
/// after it run while it is held (a slower host only shortens the window
/// the test looks into, it cannot make the test fail).
const READ_DELAY_MS: u64 = 2000;

#[test]
fn a_block_read_before_its_sharing_breaks_is_not_reused_under_the_read() {
    let f = files();
    let reg = Registry::new();
    reg.create("meta", &format!("0 8192 file {} create", f.meta.display()))
        .unwrap();
    reg.create("data", &format!("0 256 file {} create", f.data.display()))
        .unwrap();
    reg.create(
        "ddata",
        &format!("0 256 delay data 0 {READ_DELAY_MS} data 0 0"),
    )
    .unwrap();
    reg.create(
        "pool",
        "0 256 thin-pool meta ddata 128 0 1 error_if_no_space",
    )
    .unwrap();
    let (a, c, z) = (
        pattern(1, 0, BLOCK as usize),
        pattern(2, 0, BLOCK as usize),
        pattern(3, 0, BLOCK as usize),
    );
    msg(&reg, "create_thin 1");
    reg.create("t1", "0 512 thin pool 1").unwrap();
    let t1 = reg.device("t1").unwrap();
    write(&*t1, 0, &a);
    flush(&*t1);
    msg(&reg, "create_snap 2 1");
    // A read of the shared block, held by the data device.
    let reader = {
        let t1 = t1.clone();
        std::thread::spawn(move || {
            let mut b = vec![0u8; BLOCK as usize];
            let st = submit_and_wait(&*t1, Op::Read, 0, BLOCK, &mut b);
            (st, b)
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(300));
    // Thin 1 gets its own block; the shared one keeps only thin 2's
    // reference, which the deletion drops; the commit makes it free.
    write(&*t1, 0, &c);
    msg(&reg, "delete 2");
    flush(&*t1);
    msg(&reg, "create_thin 3");
    reg.create("t3", "0 512 thin pool 3").unwrap();
    let t3 = reg.device("t3").unwrap();
    let mut zb = z.clone();
    let st = submit_and_wait(&*t3, Op::Write, 0, BLOCK, &mut zb);
    assert!(
        matches!(st, Status::Ok | Status::NoSpace),
        "thin 3's write: {st:?}"
    );
    let (st, got) = reader.join().unwrap();
    assert_eq!(st, Status::Ok);
    assert!(
        got != z,
        "the read returned thin 3's data, written to a block reused under it"
    );
    assert!(
        got == a || got == c,
        "the read returned neither thin 1's old nor new data"
    );
    drop((t1, t3));
    reg.remove_all();
    thin_check(&f.meta);
}
