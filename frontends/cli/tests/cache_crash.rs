//! The cache target through `blkstack serve`, killed with `kill -9` at
//! a random point of a workload that promotes, dirties and flushes
//! (blkstack's own NBD client writing, as thin_crash.rs and
//! era_crash.rs do): the metadata left passes `cache_check`, and the
//! cache opened again (every cached block loaded dirty, as after the
//! kernel's unclean shutdown) reads back, for every block, the data of
//! its last write before a completed flush or of a write after it. The
//! cleaner then writes it all back and `cache_check` passes again.
//! Rounds come from `BLKSTACK_CACHE_CRASH_ROUNDS` (default 2).

use blkstack_core::sync::{submit_and_wait, submit_and_wait_flags};
use blkstack_core::{BioFlags, Op, Status};
use blkstack_mapped::Registry;
use blkstack_test_support::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const SECTORS: u64 = 32768;
const BLOCK: u64 = 65536;
const NR_BLOCKS: u64 = SECTORS * 512 / BLOCK;

fn stack(dir: &Path, policy: &str) -> String {
    format!(
        "meta,,,rw,0 8192 file {m} create;cdev,,,rw,0 2048 file {c} create;\
         origin,,,rw,0 {SECTORS} file {o} create;\
         c,,,rw,0 {SECTORS} cache meta cdev origin 128 0 {policy} 0",
        m = dir.join("meta").display(),
        c = dir.join("cdev").display(),
        o = dir.join("origin").display()
    )
}

fn cache_check(meta: &Path) {
    let out = Command::new(tool("cache_check"))
        .arg(meta)
        .output()
        .expect("run cache_check");
    assert!(
        out.status.success(),
        "cache_check failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// The 4 KiB written to block `b` as its `seq`th write.
fn data(b: u64, seq: u64) -> Vec<u8> {
    let mut v = vec![0u8; 4096];
    for (i, c) in v.chunks_mut(16).enumerate() {
        c[..8].copy_from_slice(&b.to_le_bytes());
        c[8..16].copy_from_slice(&(seq ^ i as u64).to_le_bytes());
    }
    v
}

fn connect(srv: &Serve) -> std::sync::Arc<Registry> {
    let reg = Registry::new();
    reg.create(
        "remote",
        &format!(
            "0 {SECTORS} nbd {} dead_timeout_ms=500 reconnect_delay_ms=50",
            srv.uri("c")
        ),
    )
    .expect("connect to the cache export");
    reg
}

#[test]
fn kill_9_mid_workload_leaves_a_cache_that_checks_and_keeps_flushed_writes() {
    let rounds: usize = std::env::var("BLKSTACK_CACHE_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let dir = tempfile::tempdir().unwrap();
    let meta = dir.path().join("meta");
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    // Per block: the value a completed flush made durable, and the ones
    // written since.
    let mut durable: BTreeMap<u64, u64> = BTreeMap::new();
    let mut seq = 0u64;
    for round in 0..rounds {
        let srv = Serve::start(&stack(dir.path(), "smq"), "c");
        let reg = connect(&srv);
        let dev = reg.device("remote").unwrap();
        // Everything durable so far reads back.
        for (&b, &s) in &durable {
            let mut buf = vec![0u8; 4096];
            let st = submit_and_wait(&*dev, Op::Read, b * BLOCK, 4096, &mut buf);
            assert_eq!(st, Status::Ok);
            assert!(
                buf == data(b, s),
                "round {round}: block {b} lost its flushed data"
            );
        }
        let pid = srv.pid();
        let run_for = Duration::from_millis(300 + next(&mut seed) % 700);
        let killer = std::thread::spawn(move || {
            std::thread::sleep(run_for);
            Command::new("kill").args(["-9", &pid.to_string()]).status()
        });
        let mut pending: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        let stop_at = Instant::now() + Duration::from_secs(30);
        'work: while Instant::now() < stop_at {
            for _ in 0..8 {
                // A hot quarter of the origin, so blocks get promoted.
                let b = next(&mut seed) % (NR_BLOCKS / 4);
                seq += 1;
                let mut buf = data(b, seq);
                pending.entry(b).or_default().push(seq);
                if submit_and_wait(&*dev, Op::Write, b * BLOCK, 4096, &mut buf) != Status::Ok {
                    break 'work;
                }
                let mut rb = vec![0u8; 4096];
                let r = next(&mut seed) % (NR_BLOCKS / 4) * BLOCK;
                if submit_and_wait(&*dev, Op::Read, r, 4096, &mut rb) != Status::Ok {
                    break 'work;
                }
            }
            let st = submit_and_wait_flags(&*dev, Op::Flush, BioFlags::NONE, 0, 0, &mut []);
            if st != Status::Ok {
                break;
            }
            for (b, s) in std::mem::take(&mut pending) {
                durable.insert(b, *s.last().unwrap());
            }
        }
        assert!(killer.join().unwrap().unwrap().success(), "kill -9");
        drop(dev);
        reg.remove_all();
        drop(srv);
        cache_check(&meta);

        // Reopened: each block holds its durable value or a later one.
        let srv = Serve::start(&stack(dir.path(), "smq"), "c");
        let reg = connect(&srv);
        let dev = reg.device("remote").unwrap();
        let blocks: Vec<u64> = durable.keys().chain(pending.keys()).copied().collect();
        for b in blocks {
            let mut buf = vec![0u8; 4096];
            let st = submit_and_wait(&*dev, Op::Read, b * BLOCK, 4096, &mut buf);
            assert_eq!(st, Status::Ok);
            let later = pending.get(&b).cloned().unwrap_or_default();
            let ok = durable.get(&b).is_some_and(|&s| buf == data(b, s))
                || later.iter().any(|&s| buf == data(b, s));
            assert!(
                ok,
                "round {round}: block {b} holds neither its flushed nor a later write"
            );
            if let Some(&s) = later.iter().find(|&&s| buf == data(b, s)) {
                durable.insert(b, s);
            }
        }
        drop(dev);
        reg.remove_all();
        drop(srv);
        cache_check(&meta);
        println!(
            "round {round}: {} blocks checked after kill -9",
            durable.len()
        );
    }
    // The cleaner writes every (crash-dirty) block back.
    let srv = Serve::start(&stack(dir.path(), "cleaner"), "c");
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
    cache_check(&meta);
    let origin = std::fs::read(dir.path().join("origin")).unwrap();
    for (&b, &s) in &durable {
        let at = (b * BLOCK) as usize;
        assert!(
            origin[at..at + 4096] == data(b, s)[..],
            "origin block {b} after cleaning"
        );
    }
}
