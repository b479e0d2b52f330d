//! The file ring's backstop while a claim lives and nothing is in flight:
//! it parks for good after `IDLE_TICKS` idle ticks (an idle VM's device
//! costs no wake-ups), and every submission after that is still
//! completed by it when the claimant reaps nothing (no lost wake).

use super::ring::IDLE_TICKS;
use super::{Backend, FileDevice};
use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Device, Op, Status};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

const SIZE: u64 = 1 << 20;

/// Submit a 4 KiB write at `off` from another thread; its status, or
/// `None` if it did not complete within the bound (a lost wake).
fn write_bounded(dev: &Arc<FileDevice>, off: u64) -> Option<Status> {
    let (tx, rx) = mpsc::channel();
    let d = dev.clone();
    std::thread::spawn(move || {
        let mut buf = vec![(off / 4096) as u8; 4096];
        let _ = tx.send(submit_and_wait(&*d, Op::Write, off, 4096, &mut buf));
    });
    rx.recv_timeout(Duration::from_secs(20)).ok()
}

fn wait_parked(dev: &FileDevice) -> bool {
    let Backend::Uring { normal, .. } = &dev.backend else {
        panic!("the file device runs io_uring here");
    };
    let until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < until {
        if normal.shared.idle_parked.load(Ordering::SeqCst) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

fn ticks(dev: &FileDevice) -> u64 {
    let Backend::Uring { normal, .. } = &dev.backend else {
        panic!("the file device runs io_uring here");
    };
    normal.shared.backstop_ticks.load(Ordering::Relaxed)
}

#[test]
fn idle_claim_parks_and_every_submission_still_completes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("disk");
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(SIZE))
        .expect("backing file");
    let p = path.to_string_lossy().into_owned();
    let dev = match FileDevice::from_args(SIZE, &[&p, "reap_backstop_ms=2"]) {
        Ok(d) => Arc::new(d),
        Err(e) => panic!("file device: {e}"),
    };
    if !matches!(dev.backend, Backend::Uring { .. }) {
        // io_uring refused by this kernel: the psync pool has no backstop.
        assert!(
            std::env::var_os("CI").is_none(),
            "io_uring unavailable under CI"
        );
        println!("skipped: io_uring unavailable, the file device runs psync");
        return;
    }
    // A claimant that never reaps: only the backstop completes I/O.
    let claim = dev.reaper().expect("an interrupt ring offers a reaper");
    for round in 0..20u64 {
        assert_eq!(
            write_bounded(&dev, round * 4096),
            Some(Status::Ok),
            "round {round}"
        );
        assert!(
            wait_parked(&dev),
            "round {round}: the backstop never parked while idle"
        );
        // Parked for good: no ticks while nothing is submitted, whatever
        // the load (a late thread ticks less, never more).
        let t0 = ticks(&dev);
        std::thread::sleep(Duration::from_millis(2 * IDLE_TICKS as u64 + round % 7));
        assert_eq!(
            ticks(&dev),
            t0,
            "round {round}: an idle backstop kept ticking"
        );
    }
    drop(claim);
    // Back to waiting in the ring: completes with no claim at all.
    assert_eq!(write_bounded(&dev, 0), Some(Status::Ok));
}
