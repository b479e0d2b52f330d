//! `powercut` as a crash tester uses it, over a real `memory` device:
//! writes are volatile until a flush (or their own FUA), reads see the
//! cache, each cut mode keeps what it promises (reproducibly for a
//! seed), the power stays off until `power_on`, a full cache forces its
//! oldest writes down, and bad tables and messages are refused, changing
//! nothing. The stress test cuts the power under writing, flushing and
//! reading threads and checks the crash invariant every time.

use blkstack_core::sync::{submit_and_wait, submit_and_wait_flags};
use blkstack_core::{BioFlags, Device, Op, Status};
use blkstack_mapped::Registry;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SECTORS: u64 = 16384;

fn setup(features: &str) -> (Arc<Registry>, Arc<dyn Device>, Arc<dyn Device>) {
    let reg = Registry::new();
    reg.create("m", &format!("0 {SECTORS} memory")).unwrap();
    reg.create("p", &format!("0 {SECTORS} powercut m{features}"))
        .unwrap();
    let m = reg.device("m").unwrap();
    let p = reg.device("p").unwrap();
    (reg, m, p)
}

fn write_flags(dev: &dyn Device, flags: BioFlags, off: u64, data: &[u8]) -> Status {
    let mut b = data.to_vec();
    submit_and_wait_flags(dev, Op::Write, flags, off, b.len() as u64, &mut b)
}

fn write(dev: &dyn Device, off: u64, byte: u8) -> Status {
    write_flags(dev, BioFlags::NONE, off, &[byte; 4096])
}

fn read_len(dev: &dyn Device, off: u64, len: usize) -> (Status, Vec<u8>) {
    let mut b = vec![0xEEu8; len];
    let s = submit_and_wait(dev, Op::Read, off, len as u64, &mut b);
    (s, b)
}

fn read(dev: &dyn Device, off: u64) -> (Status, Vec<u8>) {
    read_len(dev, off, 4096)
}

fn flush(dev: &dyn Device) -> Status {
    submit_and_wait(dev, Op::Flush, 0, 0, &mut [])
}

fn status(reg: &Registry) -> String {
    reg.status_text("p").unwrap()
}

fn message(reg: &Registry, words: &[&str]) -> Result<String, String> {
    reg.message("p", 0, words).map_err(|e| e.report())
}

/// The value of `key=` in the status line.
fn stat(reg: &Registry, key: &str) -> u64 {
    let s = status(reg);
    s.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {s}"))
}

#[test]
fn writes_are_volatile_until_a_flush() {
    let (reg, m, p) = setup("");
    assert_eq!(write(&*p, 0, 0xa1), Status::Ok);
    assert_eq!(
        read(&*p, 0),
        (Status::Ok, vec![0xa1; 4096]),
        "read-your-writes"
    );
    assert_eq!(read(&*m, 0).1, vec![0; 4096], "not on the device yet");
    assert_eq!(write(&*p, 0, 0xa2), Status::Ok);
    assert_eq!(stat(&reg, "cached_writes"), 1, "an overwrite replaces");
    assert_eq!(stat(&reg, "cached_bytes"), 4096);
    assert_eq!(flush(&*p), Status::Ok);
    assert_eq!(read(&*m, 0).1, vec![0xa2; 4096], "the flush wrote it down");
    assert_eq!(
        status(&reg),
        "0 16384 powercut on cached_writes=0 cached_bytes=0 flushes=1 fua_writes=0 \
         forced_writes=0 stalled_writes=0 writeback=0 cuts=0 last_cut_kept=0 \
         last_cut_lost=0 last_cut_torn=0\n"
    );
}

#[test]
fn a_preflush_write_flushes_what_came_before_it() {
    let (_reg, m, p) = setup("");
    assert_eq!(write(&*p, 0, 1), Status::Ok);
    assert_eq!(
        write_flags(&*p, BioFlags::PREFLUSH, 8192, &[2; 4096]),
        Status::Ok
    );
    assert_eq!(read(&*m, 0).1, vec![1; 4096], "flushed before the write");
    assert_eq!(
        read(&*m, 8192).1,
        vec![0; 4096],
        "the write itself is cached"
    );
    assert_eq!(read(&*p, 8192).1, vec![2; 4096]);
}

#[test]
fn fua_makes_only_its_own_write_durable() {
    let (reg, m, p) = setup("");
    assert_eq!(write(&*p, 0, 0xb1), Status::Ok);
    assert_eq!(
        write_flags(&*p, BioFlags::FUA, 8192, &[0xb2; 4096]),
        Status::Ok
    );
    assert_eq!(read(&*m, 8192).1, vec![0xb2; 4096]);
    assert_eq!(
        read(&*m, 0).1,
        vec![0; 4096],
        "the rest of the cache stays volatile"
    );
    assert_eq!(stat(&reg, "fua_writes"), 1);
    message(&reg, &["cut", "drop"]).unwrap();
    message(&reg, &["power_on"]).unwrap();
    assert_eq!(read(&*p, 8192).1, vec![0xb2; 4096], "FUA survives a cut");
    assert_eq!(read(&*p, 0).1, vec![0; 4096], "the plain write did not");
}

#[test]
fn a_drop_cut_loses_the_unflushed_and_fails_io_until_power_on() {
    let (reg, _m, p) = setup("");
    assert_eq!(write(&*p, 0, 1), Status::Ok);
    assert_eq!(flush(&*p), Status::Ok);
    assert_eq!(write(&*p, 0, 2), Status::Ok);
    assert_eq!(write(&*p, 4096, 3), Status::Ok);
    let said = message(&reg, &["cut"]).unwrap();
    assert_eq!(said, "cut drop: kept 0 of 2 cached writes (0 torn)");
    assert!(
        status(&reg).contains(" off cached_writes=0 "),
        "{}",
        status(&reg)
    );
    assert_eq!(stat(&reg, "cuts"), 1);
    assert_eq!(stat(&reg, "last_cut_lost"), 2);
    assert_eq!(read(&*p, 0).0, Status::IoError);
    assert_eq!(write(&*p, 0, 4), Status::IoError);
    assert_eq!(flush(&*p), Status::IoError);
    let mut none = [];
    assert_eq!(
        submit_and_wait(&*p, Op::Discard, 0, 4096, &mut none),
        Status::IoError
    );
    let again = message(&reg, &["cut", "reorder", "1"]).unwrap_err();
    assert!(again.contains("already off"), "{again}");
    message(&reg, &["power_on"]).unwrap();
    assert_eq!(
        read(&*p, 0),
        (Status::Ok, vec![1; 4096]),
        "flushed data kept"
    );
    assert_eq!(
        read(&*p, 4096),
        (Status::Ok, vec![0; 4096]),
        "unflushed lost"
    );
    let on = message(&reg, &["power_on"]).unwrap_err();
    assert!(on.contains("already on"), "{on}");
}

/// Blocks 0..32 written twice (first 0x10+i, then 0x80+i), then a cut;
/// the device's contents afterwards.
fn reorder_run(mode: &[&str]) -> (Vec<Vec<u8>>, String) {
    let (reg, m, p) = setup("");
    for round in [0x10u8, 0x80] {
        for i in 0..32u8 {
            assert_eq!(write(&*p, u64::from(i) * 8192, round + i), Status::Ok);
        }
    }
    let said = message(&reg, mode).unwrap();
    let blocks = (0..32u64).map(|i| read(&*m, i * 8192).1).collect();
    (blocks, said)
}

#[test]
fn reorder_keeps_a_reproducible_subset_of_last_writes() {
    let (a, said) = reorder_run(&["cut", "reorder", "7"]);
    let (b, _) = reorder_run(&["cut", "reorder", "7"]);
    assert_eq!(
        a, b,
        "the same seed on the same cache keeps the same writes"
    );
    assert!(said.starts_with("cut reorder 7: kept "), "{said}");
    let mut kept = 0;
    for (i, blk) in a.iter().enumerate() {
        let last = vec![0x80 + i as u8; 4096];
        assert!(
            *blk == last || *blk == vec![0; 4096],
            "block {i}: only the last write of a sector can survive"
        );
        kept += usize::from(*blk == last);
    }
    assert!(kept > 0 && kept < 32, "a subset: {kept} of 32 kept");
    let (c, _) = reorder_run(&["cut", "reorder", "8"]);
    assert_ne!(a, c, "another seed, another subset");
}

#[test]
fn torn_keeps_prefixes_at_the_granularity() {
    let mut tears = 0;
    for seed in 0..24u64 {
        let (reg, m, p) = setup("");
        // One 64 KiB write whose sectors say their index.
        let data: Vec<u8> = (0..128u8).flat_map(|s| [s + 1; 512]).collect();
        assert_eq!(write_flags(&*p, BioFlags::NONE, 0, &data), Status::Ok);
        message(&reg, &["cut", "torn", &seed.to_string(), "8"]).unwrap();
        let got = read_len(&*m, 0, data.len()).1;
        let new = got
            .chunks(512)
            .zip(data.chunks(512))
            .take_while(|(g, d)| g == d)
            .count();
        assert!(
            got[new * 512..].iter().all(|&b| b == 0),
            "seed {seed}: what survives is a prefix"
        );
        assert!(
            new == 0 || new == 128 || new % 8 == 0,
            "seed {seed}: torn after {new} sectors, not at an 8-sector unit"
        );
        tears += usize::from(new != 0 && new != 128);
        assert_eq!(stat(&reg, "last_cut_torn") == 1, new != 0 && new != 128);
    }
    assert!(tears > 0, "24 seeds tore nothing");
}

#[test]
fn max_dirty_forces_the_oldest_writes_down() {
    let (reg, m, p) = setup(" 2 max_dirty 16K");
    for i in 0..16u64 {
        assert_eq!(write(&*p, i * 4096, i as u8 + 1), Status::Ok);
    }
    assert!(stat(&reg, "cached_bytes") <= 16384, "{}", status(&reg));
    assert!(stat(&reg, "forced_writes") >= 12, "{}", status(&reg));
    for i in 0..12u64 {
        assert_eq!(
            read(&*m, i * 4096).1,
            vec![i as u8 + 1; 4096],
            "block {i}: the oldest writes went down first"
        );
    }
    for i in 0..16u64 {
        assert_eq!(read(&*p, i * 4096).1, vec![i as u8 + 1; 4096]);
    }
    // A write bigger than the whole cache still goes through.
    assert_eq!(
        write_flags(&*p, BioFlags::NONE, 1 << 20, &[9; 65536]),
        Status::Ok
    );
    assert_eq!(read_len(&*p, 1 << 20, 65536).1, vec![9; 65536]);
}

#[test]
fn discard_and_write_zeroes_are_cached_as_zeroes() {
    let (_reg, m, p) = setup("");
    assert_eq!(write(&*p, 0, 5), Status::Ok);
    assert_eq!(write(&*p, 8192, 6), Status::Ok);
    assert_eq!(flush(&*p), Status::Ok);
    let mut none = [];
    assert_eq!(
        submit_and_wait(&*p, Op::WriteZeroes, 0, 4096, &mut none),
        Status::Ok
    );
    assert_eq!(
        submit_and_wait(&*p, Op::Discard, 8192, 4096, &mut none),
        Status::Ok
    );
    assert_eq!(read(&*p, 0).1, vec![0; 4096]);
    assert_eq!(read(&*p, 8192).1, vec![0; 4096]);
    assert_eq!(read(&*m, 0).1, vec![5; 4096], "cached, not down yet");
    assert_eq!(flush(&*p), Status::Ok);
    assert_eq!(read(&*m, 0).1, vec![0; 4096]);
    assert_eq!(
        read(&*m, 8192).1,
        vec![0; 4096],
        "memory discards to zeroes"
    );
}

#[test]
fn a_read_lays_the_cache_over_the_device() {
    let (_reg, _m, p) = setup("");
    assert_eq!(write(&*p, 0, 1), Status::Ok);
    assert_eq!(flush(&*p), Status::Ok);
    assert_eq!(write(&*p, 4096, 2), Status::Ok);
    let (s, got) = read_len(&*p, 0, 12288);
    assert_eq!(s, Status::Ok);
    assert_eq!(&got[..4096], &[1; 4096][..]);
    assert_eq!(&got[4096..8192], &[2; 4096][..]);
    assert_eq!(&got[8192..], &[0; 4096][..]);
}

#[test]
fn table_and_status_round_trip() {
    let (reg, _m, _p) = setup("");
    assert_eq!(reg.table_text("p").unwrap(), "0 16384 powercut 253:0\n");
    reg.create("q", "0 16384 powercut m 2 max_dirty 1M")
        .unwrap();
    let t = reg.table_text("q").unwrap();
    assert_eq!(t, "0 16384 powercut 253:0 2 max_dirty 1M\n");
    reg.create("q2", t.trim()).unwrap();
    assert_eq!(reg.table_text("q2").unwrap(), t);
    reg.create("z", "0 16384 powercut m 0").unwrap();
    assert_eq!(reg.table_text("z").unwrap(), "0 16384 powercut 253:0\n");
    assert!(reg
        .status_text("q")
        .unwrap()
        .starts_with("0 16384 powercut on cached_writes=0 cached_bytes=0 flushes=0 "));
}

#[test]
fn bad_tables_are_refused_with_clear_errors() {
    let reg = Registry::new();
    reg.create("m", "0 2048 memory").unwrap();
    for (table, says) in [
        ("0 2048 powercut", "expected at least 1 argument"),
        ("0 2048 powercut nosuch", "device 'nosuch' not found"),
        ("0 4096 powercut m", "too small"),
        ("0 2048 powercut m x", "invalid number of feature args 'x'"),
        ("0 2048 powercut m 1", "1 declared, 0 given"),
        ("0 2048 powercut m 1 max_dirty 1M", "1 declared, 2 given"),
        ("0 2048 powercut m 1 max_dirty", "needs a size"),
        ("0 2048 powercut m 2 max_dirty 1X", "invalid max_dirty '1X'"),
        (
            "0 2048 powercut m 2 max_dirty 100",
            "invalid max_dirty '100'",
        ),
        (
            "0 2048 powercut m 4 max_dirty 1M max_dirty 2M",
            "given twice",
        ),
        (
            "0 2048 powercut m 1 fast",
            "unrecognised powercut feature 'fast'",
        ),
    ] {
        let err = reg.create("p", table).err().expect("refused").report();
        assert!(err.contains(says), "{table}: {err}");
        assert_eq!(
            reg.names(),
            vec!["m".to_string()],
            "{table} changed nothing"
        );
    }
}

#[test]
fn bad_messages_change_nothing() {
    let (reg, _m, p) = setup("");
    assert_eq!(write(&*p, 0, 1), Status::Ok);
    let before = status(&reg);
    for (words, says) in [
        (&["cut", "melt"][..], "unknown mode 'melt'"),
        (&["cut", "reorder"], "missing SEED"),
        (&["cut", "reorder", "x1"], "invalid SEED 'x1'"),
        (&["cut", "torn", "1", "0"], "invalid SECTORS '0'"),
        (&["cut", "drop", "now"], "unexpected 'now'"),
        (&["power_on", "now"], "takes no arguments"),
        (&["power_on"], "already on"),
        (&["explode"], "unknown powercut message 'explode'"),
    ] {
        let err = message(&reg, words).unwrap_err();
        assert!(err.contains(says), "{words:?}: {err}");
        assert_eq!(status(&reg), before, "{words:?} changed nothing");
    }
    assert_eq!(read(&*p, 0).1, vec![1; 4096]);
}

#[test]
fn a_flush_in_flight_at_a_cut_fails_and_never_hangs() {
    let (reg, m, p) = setup("");
    assert_eq!(write(&*p, 0, 7), Status::Ok);
    // The device below is suspended: the flush's writeback is held there.
    reg.suspend("m").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let p2 = p.clone();
    std::thread::spawn(move || tx.send(flush(&*p2)));
    let t0 = Instant::now();
    while !status(&reg).contains(" writeback=1 ") {
        assert!(t0.elapsed() < Duration::from_secs(30), "{}", status(&reg));
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::scope(|s| {
        let cut = s.spawn(|| message(&reg, &["cut", "reorder", "3"]));
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(30)),
            Ok(Status::IoError),
            "the flush in flight ends with EIO at the cut, before the device answers"
        );
        reg.resume("m").unwrap();
        cut.join().unwrap().unwrap();
    });
    message(&reg, &["power_on"]).unwrap();
    // The write the cache was writing down when the power failed reached
    // the device, as on a disk already writing it.
    assert_eq!(read(&*m, 0).1, vec![7; 4096]);
}

#[test]
fn a_reload_or_remove_writes_the_cache_down_first() {
    let (reg, m, p) = setup("");
    assert_eq!(write(&*p, 0, 0x31), Status::Ok);
    reg.reload("p", &format!("0 {SECTORS} powercut m 2 max_dirty 1M"))
        .unwrap();
    reg.resume("p").unwrap();
    assert_eq!(read(&*m, 0).1, vec![0x31; 4096], "an orderly power-off");
    assert_eq!(stat(&reg, "cached_writes"), 0, "the new table starts empty");
    assert_eq!(write(&*p, 4096, 0x32), Status::Ok);
    drop(p);
    reg.remove("p", false).unwrap();
    assert_eq!(read(&*m, 4096).1, vec![0x32; 4096]);
}

#[test]
fn the_example_stack_builds_and_caches() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let text = std::fs::read_to_string(dir.join("powercut.stack")).unwrap();
    let reg = Registry::new();
    reg.create_stack(&text).unwrap();
    let (pc, below) = (reg.device("pc").unwrap(), reg.device("cached").unwrap());
    assert_eq!(write(&*pc, 0, 0x41), Status::Ok);
    assert_eq!(read(&*below, 0).1, vec![0; 4096]);
    assert_eq!(flush(&*pc), Status::Ok);
    assert_eq!(read(&*below, 0).1, vec![0x41; 4096]);
}

// ---- the stress test ----

const THREADS: usize = 4;
const BLOCKS: u64 = 32;
const BLOCK_SECTORS: u64 = 8;

/// What one thread knows of its blocks, per sector: the newest version
/// it wrote, the newest acknowledged, and the floor a crash must keep.
struct Book {
    issued: Vec<u64>,
    acked: Vec<u64>,
    durable: Vec<u64>,
}

fn stamp(sector: u64, version: u64) -> [u8; 512] {
    let mut s = [0u8; 512];
    for c in s.chunks_mut(16) {
        c[..8].copy_from_slice(&sector.to_le_bytes());
        c[8..].copy_from_slice(&version.to_le_bytes());
    }
    s
}

/// The version a sector holds, or why it is garbage.
fn version_of(sector: u64, data: &[u8]) -> Result<u64, String> {
    if data.iter().all(|&b| b == 0) {
        return Ok(0);
    }
    let v = u64::from_le_bytes(data[8..16].try_into().unwrap());
    if data != stamp(sector, v) {
        return Err(format!("sector {sector} holds data never written"));
    }
    Ok(v)
}

struct Shared {
    epoch: AtomicU64,
    parked: AtomicUsize,
    stop: AtomicBool,
    writes: AtomicU64,
    flushes: AtomicU64,
}

fn park(sh: &Shared, seen: &mut u64) -> bool {
    sh.parked.fetch_add(1, Ordering::SeqCst);
    let t0 = Instant::now();
    while sh.epoch.load(Ordering::SeqCst) == *seen && !sh.stop.load(Ordering::SeqCst) {
        assert!(t0.elapsed() < Duration::from_secs(60), "never powered on");
        std::thread::sleep(Duration::from_millis(1));
    }
    *seen = sh.epoch.load(Ordering::SeqCst);
    sh.parked.fetch_sub(1, Ordering::SeqCst);
    !sh.stop.load(Ordering::SeqCst)
}

fn worker(t: usize, p: Arc<dyn Device>, sh: Arc<Shared>, book: Arc<Mutex<Book>>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(t as u64);
    let base = t as u64 * BLOCKS * BLOCK_SECTORS;
    let mut seen = sh.epoch.load(Ordering::SeqCst);
    while !sh.stop.load(Ordering::SeqCst) {
        let b = rng.gen_range(0..BLOCKS);
        let first = (b * BLOCK_SECTORS) as usize;
        let roll = rng.gen_range(0..100);
        let status = if roll < 10 {
            let s = flush(&*p);
            if s.is_ok() {
                sh.flushes.fetch_add(1, Ordering::Relaxed);
                let mut bk = book.lock().unwrap();
                bk.durable = bk.acked.clone();
            }
            s
        } else if roll < 20 {
            let (s, data) = read_len(&*p, (base + first as u64) * 512, 4096);
            if s.is_ok() {
                let bk = book.lock().unwrap();
                for (i, sec) in data.chunks(512).enumerate() {
                    let sector = base + (first + i) as u64;
                    assert_eq!(
                        version_of(sector, sec),
                        Ok(bk.acked[first + i]),
                        "thread {t}: a read sees the last acknowledged write"
                    );
                }
            }
            s
        } else {
            let fua = roll < 25;
            let v = {
                let mut bk = book.lock().unwrap();
                let v = bk.issued[first] + 1;
                bk.issued[first..first + 8].fill(v);
                v
            };
            let data: Vec<u8> = (0..BLOCK_SECTORS)
                .flat_map(|i| stamp(base + first as u64 + i, v))
                .collect();
            let flags = if fua { BioFlags::FUA } else { BioFlags::NONE };
            let s = write_flags(&*p, flags, (base + first as u64) * 512, &data);
            if s.is_ok() {
                sh.writes.fetch_add(1, Ordering::Relaxed);
                let mut bk = book.lock().unwrap();
                bk.acked[first..first + 8].fill(v);
                if fua {
                    bk.durable[first..first + 8].fill(v);
                }
            }
            s
        };
        if status == Status::IoError && !park(&sh, &mut seen) {
            return;
        }
        assert!(
            status == Status::Ok || status == Status::IoError,
            "{status:?}"
        );
    }
}

/// After a cut, every sector holds a version its thread wrote, no older
/// than what a completed flush or FUA made durable; that is the floor
/// (and what a read must see) from now on.
fn check_crash_state(m: &dyn Device, books: &[Arc<Mutex<Book>>], mode: &str) {
    for (t, book) in books.iter().enumerate() {
        let mut bk = book.lock().unwrap();
        let base = t as u64 * BLOCKS * BLOCK_SECTORS;
        let n = (BLOCKS * BLOCK_SECTORS) as usize;
        let (s, data) = read_len(m, base * 512, n * 512);
        assert_eq!(s, Status::Ok);
        for i in 0..n {
            let sector = base + i as u64;
            let v = version_of(sector, &data[i * 512..(i + 1) * 512])
                .unwrap_or_else(|e| panic!("after {mode}: {e}"));
            assert!(
                v >= bk.durable[i],
                "after {mode}: sector {sector} lost version {} acknowledged before a completed flush (holds {v})",
                bk.durable[i]
            );
            assert!(
                v <= bk.issued[i],
                "after {mode}: sector {sector} holds an unwritten version {v}"
            );
            bk.durable[i] = v;
            bk.acked[i] = v;
        }
    }
}

#[test]
fn cuts_under_concurrent_writes_and_flushes_keep_every_flushed_write() {
    // A small cache, so that full-cache writeback runs under the cuts too.
    let (reg, m, p) = setup(" 2 max_dirty 32K");
    let sh = Arc::new(Shared {
        epoch: AtomicU64::new(0),
        parked: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        writes: AtomicU64::new(0),
        flushes: AtomicU64::new(0),
    });
    let n = (BLOCKS * BLOCK_SECTORS) as usize;
    let books: Vec<Arc<Mutex<Book>>> = (0..THREADS)
        .map(|_| {
            Arc::new(Mutex::new(Book {
                issued: vec![0; n],
                acked: vec![0; n],
                durable: vec![0; n],
            }))
        })
        .collect();
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (p, sh, bk) = (p.clone(), sh.clone(), books[t].clone());
            std::thread::spawn(move || worker(t, p, sh, bk))
        })
        .collect();
    let modes: [&[&str]; 6] = [
        &["cut", "drop"],
        &["cut", "reorder", "1"],
        &["cut", "torn", "2"],
        &["cut", "reorder", "3"],
        &["cut", "torn", "4", "8"],
        &["cut"],
    ];
    for mode in modes {
        let t0 = Instant::now();
        let w0 = sh.writes.load(Ordering::SeqCst);
        // Let the threads work until they have written something.
        while sh.writes.load(Ordering::SeqCst) < w0 + 500 {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the threads stalled"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        message(&reg, mode).unwrap();
        while sh.parked.load(Ordering::SeqCst) < THREADS {
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "I/O hung after a cut"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        check_crash_state(&*m, &books, &mode.join(" "));
        message(&reg, &["power_on"]).unwrap();
        sh.epoch.fetch_add(1, Ordering::SeqCst);
    }
    sh.stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    assert!(sh.flushes.load(Ordering::SeqCst) > 0);
    assert_eq!(stat(&reg, "cuts"), 6);
}
