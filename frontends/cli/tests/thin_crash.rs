//! A thin pool survives `kill -9` of the process serving it: a writer
//! writes 4 KiB blocks (each carrying its own sequence number) through
//! NBD into a thin device of `blkstack serve`, flushing every few writes,
//! until the server is killed at a random moment; one operation in eight
//! discards the whole pool block around its slot instead (unmapping it,
//! freeing and passing down its data block), which later reads as
//! zeroes, the tag 0 of its 16 slots. Then `thin_check`
//! passes on the metadata file as the kill left it, and a new server over
//! the same files reads every block back as it was at the last completed
//! flush, or as a write issued after that flush left it. Rounds come from
//! `BLKSTACK_THIN_CRASH_ROUNDS` (default 4; `make thin-crash` runs more).

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Device, Op, Status};
use blkstack_mapped::Registry;
use blkstack_test_support::*;
use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

const DATA_SECTORS: u64 = 131072;
const THIN_SECTORS: u64 = 262144;
const SLOTS: u64 = 4096;
const BS: usize = 4096;
/// The pool's data block (128 sectors).
const POOL_BLOCK: usize = 65536;

fn block(tag: u64) -> Vec<u8> {
    let mut b = vec![0u8; BS];
    if tag != 0 {
        for c in b.chunks_mut(8) {
            c.copy_from_slice(&tag.to_le_bytes());
        }
    }
    b
}

fn tag_of(b: &[u8]) -> Option<u64> {
    let t = u64::from_le_bytes(b[..8].try_into().ok()?);
    (block(t) == b).then_some(t)
}

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn client(srv: &Serve) -> std::sync::Arc<Registry> {
    let reg = Registry::new();
    reg.create(
        "remote",
        &format!(
            "0 {THIN_SECTORS} nbd {} dead_timeout_ms=500 reconnect_delay_ms=50",
            srv.uri("thin")
        ),
    )
    .expect("connect to the thin export");
    reg
}

/// One write through the client: (slot, tag) in issue order; the count
/// of writes that had completed when the last flush completed.
struct Round {
    writes: Vec<(u64, u64)>,
    durable: usize,
}

fn workload(dev: &dyn Device, seed: &mut u64, tag0: u64, stop_at: Instant) -> Round {
    let mut r = Round {
        writes: Vec::new(),
        durable: 0,
    };
    let mut tag = tag0;
    let per_block = (POOL_BLOCK / BS) as u64;
    while Instant::now() < stop_at {
        let slot = next(seed) % SLOTS;
        tag += 1;
        let st = if next(seed).is_multiple_of(8) {
            let first = slot / per_block * per_block;
            r.writes.extend((first..first + per_block).map(|s| (s, 0)));
            let at = first * BS as u64;
            submit_and_wait(dev, Op::Discard, at, POOL_BLOCK as u64, &mut [])
        } else {
            r.writes.push((slot, tag));
            let mut b = block(tag);
            submit_and_wait(dev, Op::Write, slot * BS as u64, BS as u64, &mut b)
        };
        if st != Status::Ok {
            return r;
        }
        if tag.is_multiple_of(8) {
            let done = r.writes.len();
            if submit_and_wait(dev, Op::Flush, 0, 0, &mut []) != Status::Ok {
                return r;
            }
            r.durable = done;
        }
    }
    r
}

#[test]
fn kill_9_mid_workload_leaves_a_pool_that_checks_and_keeps_flushed_writes() {
    let rounds: usize = std::env::var("BLKSTACK_THIN_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let dir = tempfile::tempdir().unwrap();
    let (meta, data) = (dir.path().join("meta"), dir.path().join("data"));
    let stack = format!(
        "meta,,,rw,0 8192 file {m} create;data,,,rw,0 {DATA_SECTORS} file {d} create;\
         pool,,,rw,0 {DATA_SECTORS} thin-pool meta data 128 0;thin,,,rw,0 {THIN_SECTORS} thin pool 1",
        m = meta.display(),
        d = data.display()
    );
    {
        // The pool and its thin device, made once.
        let reg = Registry::new();
        let pre = stack.rsplit_once(';').unwrap().0;
        reg.create_concise(pre).unwrap();
        reg.message("pool", 0, &["create_thin", "1"]).unwrap();
        reg.remove_all();
    }
    // What each slot holds for sure (tag 0: never written).
    let mut known: HashMap<u64, u64> = HashMap::new();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut tag = 0u64;
    let mut checked = 0;
    for round in 0..rounds {
        let srv = Serve::start(&stack, "thin");
        let reg = client(&srv);
        let dev = reg.device("remote").unwrap();
        let run_for = Duration::from_millis(300 + next(&mut seed) % 700);
        let pid = srv.pid();
        let killer = std::thread::spawn(move || {
            std::thread::sleep(run_for);
            Command::new("kill").args(["-9", &pid.to_string()]).status()
        });
        let r = workload(
            &*dev,
            &mut seed,
            tag,
            Instant::now() + Duration::from_secs(30),
        );
        assert!(killer.join().unwrap().unwrap().success(), "kill -9");
        tag = r.writes.last().map(|w| w.1).unwrap_or(tag);
        drop(dev);
        reg.remove_all();
        drop(srv);
        thin_check(&meta);

        // Acceptable contents per slot: the last durable value, or any
        // value written after it.
        let mut accept: HashMap<u64, Vec<u64>> = HashMap::new();
        for (i, &(slot, t)) in r.writes.iter().enumerate() {
            if i < r.durable {
                known.insert(slot, t);
                accept.remove(&slot);
            } else {
                accept.entry(slot).or_default().push(t);
            }
        }
        let srv = Serve::start(&stack, "thin");
        let reg = client(&srv);
        let dev = reg.device("remote").unwrap();
        let slots: Vec<u64> = known.keys().chain(accept.keys()).copied().collect();
        for slot in slots {
            let mut b = vec![0u8; BS];
            let st = submit_and_wait(&*dev, Op::Read, slot * BS as u64, BS as u64, &mut b);
            assert_eq!(st, Status::Ok);
            let got = tag_of(&b).unwrap_or_else(|| panic!("round {round}: slot {slot} is torn"));
            let base = known.get(&slot).copied().unwrap_or(0);
            let ok = got == base || accept.get(&slot).is_some_and(|v| v.contains(&got));
            assert!(
                ok,
                "round {round}: slot {slot} reads tag {got}; durable {base}, later {:?}",
                accept.get(&slot)
            );
            known.insert(slot, got);
            checked += 1;
        }
        println!(
            "round {round}: {} writes, {} before the last flush, {checked} slot reads checked",
            r.writes.len(),
            r.durable
        );
        drop(dev);
        reg.remove_all();
        drop(srv);
        thin_check(&meta);
    }
}
