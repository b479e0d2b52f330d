//! The cache target through `blkstack serve`, killed with `kill -9`
//! mid-workload (blkstack's own NBD client writing, reading and
//! flushing a hot quarter of the origin, so blocks are promoted, dirtied
//! and committed, as thin_crash.rs and era_crash.rs do), in metadata
//! formats 1 and 2. The kill points go round: inside a metadata commit
//! with a metadata write held, inside one with a metadata flush held
//! (cache_crash_support: the metadata sits on a `delay` target), and
//! after a random time. Each time the metadata left passes
//! `cache_check`, and the cache opened again (every cached block loaded
//! dirty, as after the kernel's unclean shutdown) reads back, for every
//! block, the data of its last write before a completed flush or of a
//! write after it. The cleaner then writes it all back and `cache_check`
//! passes again. Rounds per format come from `BLKSTACK_CACHE_CRASH_ROUNDS`
//! (default 3: one of each kill point); kernel_cache.rs has the guest's
//! dm-cache activate what such kills left.

mod cache_crash_support;

use blkstack_test_support::*;
use cache_crash_support::*;
use std::time::{Duration, Instant};

fn crash_rounds(features: &str, mut seed: u64, rounds: usize) {
    let dir = tempfile::tempdir().unwrap();
    let mut crash = Crash::new(dir.path(), features, seed);
    for round in 0..rounds {
        let at = KillAt::nth(round, &mut seed);
        let k = crash.round(at);
        println!(
            "{features}: round {round}: killed at {:?}{} after {} flushes ({}), {} blocks flushed so far",
            k.at,
            if k.by_suspend { " (suspend asked for)" } else { "" },
            k.flushes,
            k.status,
            crash.flushed_blocks()
        );
    }
    // The last kill's leftovers read back (as every round's did at its
    // start), then the cleaner writes every (crash-dirty) block back.
    let reg = crash.open_here("smq 2 migration_threshold 0");
    let dev = reg.device("c").unwrap();
    crash.settle("after the last kill", |b| read_4k(&*dev, b).expect("read"));
    drop(dev);
    reg.remove_all();
    cache_check(&crash.meta());
    let srv = Serve::start(&crash.stack("cleaner"), "c");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = srv.ok("status", &["c"]);
        let dirty = st.split_whitespace().nth(13).unwrap_or("").to_string();
        if dirty == "0" {
            break;
        }
        assert!(Instant::now() < deadline, "not cleaned: {st}");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(srv);
    cache_check(&crash.meta());
    let origin = std::fs::read(dir.path().join("origin")).unwrap();
    for b in crash.blocks() {
        let at = (b * BLOCK) as usize;
        assert!(
            crash.accepts(b, &origin[at..at + 4096]),
            "{features}: origin block {b} after cleaning"
        );
    }
}

fn rounds() -> usize {
    std::env::var("BLKSTACK_CACHE_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
}

#[test]
fn kill_9_mid_workload_leaves_a_format_1_cache_that_checks_and_keeps_flushed_writes() {
    crash_rounds("0", 0x2545_f491_4f6c_dd1d, rounds());
}

#[test]
fn kill_9_mid_workload_leaves_a_format_2_cache_that_checks_and_keeps_flushed_writes() {
    crash_rounds("1 metadata2", 0x9e37_79b9_7f4a_7c15, rounds());
}
