//! A cache under `blkstack serve` killed with SIGKILL mid-workload, for
//! cache_crash.rs (many rounds, judged on the host) and kernel_cache.rs
//! (the guest's dm-cache activates what one kill left). The workload is
//! blkstack's own NBD client writing, reading and flushing a hot quarter
//! of the origin, so blocks are promoted, dirtied and committed (from
//! the second round on, the next quarter, once the idle cache wrote its
//! dirty blocks back, so promotions demote); the history keeps, per
//! block, the write a completed flush made durable and the ones written
//! since.
//!
//! The metadata device sits on a `delay` target with no delay, so a
//! kill can be put inside a metadata commit on purpose: `set write` (or
//! `set flush`) to a minute holds the next metadata write (or flush),
//! which only a commit issues (`__commit_transaction` in
//! `drivers/md/dm-cache-metadata.c`: shadows, flush, superblock, flush),
//! and once the delay's status shows it held the process is killed with
//! that commit half done (a flush's after promotions, a demotion's, or
//! the periodic one; once the cache is full of hot dirty blocks nothing
//! migrates, and a `blkstack suspend` brings its clean-shutdown commit).
//! A kill after a random time is the third kind.

#![allow(dead_code)] // each test file uses a different part

use blkstack_core::sync::{submit_and_wait, submit_and_wait_flags};
use blkstack_core::{BioFlags, Device, Op, Status};
use blkstack_mapped::Registry;
use blkstack_test_support::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const META_SECTORS: u64 = 8192;
pub const CACHE_SECTORS: u64 = 2048;
pub const ORIGIN_SECTORS: u64 = 32768;
pub const BLOCK: u64 = 65536;
/// The hot quarter of the origin the workload writes.
pub const HOT_BLOCKS: u64 = ORIGIN_SECTORS * 512 / BLOCK / 4;
/// The longest any wait of a round may take.
const LIMIT: Duration = Duration::from_secs(60);

/// Where a round kills the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KillAt {
    /// After this long of workload.
    After(Duration),
    /// With a metadata write held (a commit writing its shadows).
    HeldWrite,
    /// With a metadata flush held (a commit between its shadows and its
    /// superblock, or between the superblock and its flush).
    HeldFlush,
}

impl KillAt {
    /// The round-robin of kill points a crash loop goes through.
    pub fn nth(round: usize, seed: &mut u64) -> KillAt {
        match round % 3 {
            0 => KillAt::HeldWrite,
            1 => KillAt::HeldFlush,
            _ => KillAt::After(Duration::from_millis(300 + next(seed) % 700)),
        }
    }
}

pub fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// The 4 KiB written to block `b` as its `seq`th write.
pub fn data(b: u64, seq: u64) -> Vec<u8> {
    let mut v = vec![0u8; 4096];
    for (i, c) in v.chunks_mut(16).enumerate() {
        c[..8].copy_from_slice(&b.to_le_bytes());
        c[8..16].copy_from_slice(&(seq ^ i as u64).to_le_bytes());
    }
    v
}

pub fn cache_check(meta: &Path) {
    pdata_tool_ok("cache_check", &[], meta);
}

/// What the workload wrote, per block.
#[derive(Default)]
struct History {
    /// The write a completed flush made durable.
    durable: BTreeMap<u64, u64>,
    /// Writes since the last completed flush.
    pending: BTreeMap<u64, Vec<u64>>,
    seq: u64,
    seed: u64,
    /// The first block of the quarter of the origin written now.
    base: u64,
    /// Rounds run.
    rounds: u64,
}

impl History {
    /// Writes, reads and flushes until an I/O fails (the kill).
    fn run(&mut self, dev: &dyn Device, flushes: &AtomicU64) {
        let stop_at = Instant::now() + LIMIT;
        while Instant::now() < stop_at {
            for _ in 0..8 {
                let b = self.base + next(&mut self.seed) % HOT_BLOCKS;
                self.seq += 1;
                let mut buf = data(b, self.seq);
                // One write in four covers its whole block (the rest
                // zeroes, as the others leave it): a miss so is promoted
                // at once while the cache has free blocks, so migrations,
                // and so metadata changes for the flushes to commit, keep
                // coming.
                if next(&mut self.seed).is_multiple_of(4) {
                    buf.resize(BLOCK as usize, 0);
                }
                self.pending.entry(b).or_default().push(self.seq);
                let len = buf.len() as u64;
                if submit_and_wait(dev, Op::Write, b * BLOCK, len, &mut buf) != Status::Ok {
                    return;
                }
                let mut rb = vec![0u8; 4096];
                let r = (self.base + next(&mut self.seed) % HOT_BLOCKS) * BLOCK;
                if submit_and_wait(dev, Op::Read, r, 4096, &mut rb) != Status::Ok {
                    return;
                }
            }
            let st = submit_and_wait_flags(dev, Op::Flush, BioFlags::NONE, 0, 0, &mut []);
            if st != Status::Ok {
                return;
            }
            for (b, s) in std::mem::take(&mut self.pending) {
                if let Some(&last) = s.last() {
                    self.durable.insert(b, last);
                }
            }
            flushes.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One cache (metadata, cache and origin files in `dir`) and what was
/// written to it across kills.
pub struct Crash {
    pub dir: PathBuf,
    /// The table's features (`0`, `1 metadata2`, ...).
    pub features: String,
    history: History,
}

/// What one kill hit.
#[derive(Debug)]
pub struct Killed {
    /// The kill point.
    pub at: KillAt,
    /// Flushes the workload completed before the kill.
    pub flushes: u64,
    /// No migration or flush had committed within a second of arming,
    /// so `blkstack suspend` was asked for (the held commit is its
    /// clean-shutdown commit, or one that came just before it).
    pub by_suspend: bool,
    /// The status line of the cache when the kill was armed (a status
    /// commits, as the kernel's does, so it would wait for a held one).
    pub status: String,
}

impl Crash {
    pub fn new(dir: &Path, features: &str, seed: u64) -> Crash {
        Crash {
            dir: dir.to_path_buf(),
            features: features.to_string(),
            history: History {
                seed,
                ..History::default()
            },
        }
    }

    pub fn meta(&self) -> PathBuf {
        self.dir.join("meta")
    }

    /// `serve --concise` stack: the metadata behind a `delay` of 0.
    pub fn stack(&self, policy: &str) -> String {
        let f = |n: &str| self.dir.join(n).display().to_string();
        format!(
            "metaf,,,rw,0 {META_SECTORS} file {m} create;\
             meta,,,rw,0 {META_SECTORS} delay metaf 0 0 metaf 0 0 metaf 0 0;\
             cdev,,,rw,0 {CACHE_SECTORS} file {c} create;\
             origin,,,rw,0 {ORIGIN_SECTORS} file {o} create;\
             c,,,rw,0 {ORIGIN_SECTORS} cache meta cdev origin 128 {feat} {policy} 0",
            m = f("meta"),
            c = f("cdev"),
            o = f("origin"),
            feat = self.features
        )
    }

    /// The cache over these files in a registry of this process, as
    /// device `c`, with `policy` (e.g. `smq 2 migration_threshold 0`).
    pub fn open_here(&self, policy: &str) -> Arc<Registry> {
        self.open_in(&self.dir, policy)
    }

    /// As [`Crash::open_here`], over the files of the same names in
    /// `dir` (a copy).
    pub fn open_in(&self, dir: &Path, policy: &str) -> Arc<Registry> {
        let reg = Registry::new();
        for (dev, sectors) in [
            ("meta", META_SECTORS),
            ("cdev", CACHE_SECTORS),
            ("origin", ORIGIN_SECTORS),
        ] {
            let p = dir.join(dev);
            reg.create(dev, &format!("0 {sectors} file {}", p.display()))
                .unwrap();
        }
        reg.create(
            "c",
            &format!(
                "0 {ORIGIN_SECTORS} cache meta cdev origin 128 {} {policy}",
                self.features
            ),
        )
        .expect("open the cache");
        reg
    }

    /// Every block written so far.
    pub fn blocks(&self) -> Vec<u64> {
        let h = &self.history;
        let mut v: Vec<u64> = h.durable.keys().chain(h.pending.keys()).copied().collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The data of every block that must read back after a kill: its
    /// flushed write, or one written after it.
    pub fn accepts(&self, b: u64, got: &[u8]) -> bool {
        let h = &self.history;
        h.durable.get(&b).is_some_and(|&s| got == data(b, s))
            || h.pending
                .get(&b)
                .is_some_and(|l| l.iter().any(|&s| got == data(b, s)))
    }

    /// Judges what `read` returns for every written block after a kill
    /// (`accepts`) and makes it the durable value (panics naming `what`).
    pub fn settle(&mut self, what: &str, mut read: impl FnMut(u64) -> Vec<u8>) {
        for b in self.blocks() {
            let got = read(b);
            assert!(
                self.accepts(b, &got),
                "{what}: block {b} holds neither its flushed write nor a later one"
            );
            let h = &mut self.history;
            let later = h.pending.get(&b).cloned().unwrap_or_default();
            if let Some(&s) = later.iter().find(|&&s| got == data(b, s)) {
                h.durable.insert(b, s);
            }
        }
        self.history.pending.clear();
    }

    /// Blocks with a flushed write.
    pub fn flushed_blocks(&self) -> usize {
        self.history.durable.len()
    }

    /// `blkstack serve` over the cache, every durable write read back
    /// first, then the workload until the kill at `at`; `cache_check`
    /// passes on what is left.
    pub fn round(&mut self, at: KillAt) -> Killed {
        self.round_after(at, 8)
    }

    /// As [`Crash::round`], the kill armed once the workload completed
    /// `min_flushes` flushes (and two blocks are cached): a fresh cache
    /// armed early still has free blocks, so the commit held carries a
    /// promotion (committed by the next flush, as the kernel's).
    pub fn round_after(&mut self, at: KillAt, min_flushes: u64) -> Killed {
        let srv = Serve::start(&self.stack("smq"), "c");
        let reg = connect(&srv);
        let dev = reg.device("remote").unwrap();
        self.settle("reopened after the last kill", |b| {
            read_4k(&*dev, b).expect("read back")
        });
        if self.history.rounds > 0 {
            self.make_room(&srv);
        }
        self.history.rounds += 1;
        let flushes = Arc::new(AtomicU64::new(0));
        let mut history = std::mem::take(&mut self.history);
        let worker = {
            let (dev, flushes) = (dev.clone(), flushes.clone());
            std::thread::spawn(move || {
                history.run(&*dev, &flushes);
                history
            })
        };
        // Some flushes and promotions first, so there is committed
        // metadata with cached (after the kill: dirty) blocks.
        let deadline = Instant::now() + LIMIT;
        let mut status = srv.ok("status", &["c"]).trim().to_string();
        while flushes.load(Ordering::Relaxed) < min_flushes || resident(&status) < 2 {
            assert!(
                Instant::now() < deadline && !worker.is_finished(),
                "no workload: {status}"
            );
            std::thread::sleep(Duration::from_millis(10));
            status = srv.ok("status", &["c"]).trim().to_string();
        }
        let suspend = match at {
            KillAt::After(d) => {
                std::thread::sleep(d);
                None
            }
            KillAt::HeldWrite => hold_a_commit(&srv, "write", deadline),
            KillAt::HeldFlush => hold_a_commit(&srv, "flush", deadline),
        };
        // Writes in flight behind the held commit.
        let jitter = flushes.load(Ordering::Relaxed) % 20;
        std::thread::sleep(Duration::from_millis(jitter));
        let killed = Command::new("kill")
            .args(["-9", &srv.pid().to_string()])
            .status()
            .expect("kill");
        assert!(killed.success(), "kill -9");
        let by_suspend = suspend.is_some();
        if let Some(mut c) = suspend {
            wait_bounded(&mut c, LIMIT, "blkstack suspend");
        }
        self.history = worker.join().expect("workload");
        drop(dev);
        reg.remove_all();
        drop(srv);
        cache_check(&self.meta());
        Killed {
            at,
            flushes: flushes.load(Ordering::Relaxed),
            status,
            by_suspend,
        }
    }
}

impl Crash {
    /// After a kill the cache is full of dirty blocks (all are loaded
    /// dirty), which smq does not demote, so nothing would migrate: the
    /// target left idle writes them all back (as the kernel's smq does
    /// when idle), and the workload moves to the next quarter of the
    /// origin, whose promotions demote the old quarter's blocks (those
    /// on the lower levels: after an unclean shutdown the levels are
    /// random, there being no hints).
    fn make_room(&mut self, srv: &Serve) {
        let deadline = Instant::now() + LIMIT;
        loop {
            let st = srv.ok("status", &["c"]);
            if st.split_whitespace().nth(13) == Some("0") {
                break;
            }
            assert!(Instant::now() < deadline, "no idle writeback: {st}");
            std::thread::sleep(Duration::from_millis(50));
        }
        let h = &mut self.history;
        h.base = (h.base + HOT_BLOCKS) % (ORIGIN_SECTORS * 512 / BLOCK);
    }
}

/// Holds the metadata's next `class` (`write` or `flush`) bio, which
/// only a commit issues, and returns once one is held, with what issued
/// it, the workload still running (its writes in flight, its next flush
/// waiting for the commit). A commit comes after each demotion and on a
/// flush or the periodic commit after any migration; but once the cache
/// is full of dirty blocks the workload keeps hitting, nothing migrates (as in the kernel: smq
/// writes back only blocks not hit for a while, or when idle, and
/// demotes only clean ones) and so nothing commits. If none comes in a
/// second, `blkstack suspend` does: its clean-shutdown commit (dirty
/// bits, hints) is held, the suspend waits, the workload's writes queue.
fn hold_a_commit(srv: &Serve, class: &str, deadline: Instant) -> Option<Child> {
    let field = if class == "write" { 4 } else { 5 };
    srv.ok("message", &["meta", "0", "set", class, "60000"]);
    let migrations_until = Instant::now() + Duration::from_secs(1);
    let mut suspend = None;
    loop {
        let d = srv.ok("status", &["meta"]);
        if d.split_whitespace().nth(field).unwrap_or("0") != "0" {
            return suspend;
        }
        if suspend.is_none() && Instant::now() > migrations_until {
            let child = Command::new(blkstack_bin())
                .arg("suspend")
                .arg("--control")
                .arg(&srv.control)
                .arg("c")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("blkstack suspend");
            suspend = Some(child);
        }
        assert!(Instant::now() < deadline, "no metadata {class}: {d}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// RESIDENT of `RESIDENT/CACHE_BLOCKS` in a cache status line.
pub fn resident(status: &str) -> u64 {
    let w = status.split_whitespace().nth(6).unwrap_or("");
    w.split('/')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The first 4 KiB of block `b`.
pub fn read_4k(dev: &dyn Device, b: u64) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 4096];
    let st = submit_and_wait(dev, Op::Read, b * BLOCK, 4096, &mut buf);
    (st == Status::Ok).then_some(buf)
}

fn connect(srv: &Serve) -> Arc<Registry> {
    let reg = Registry::new();
    reg.create(
        "remote",
        &format!(
            "0 {ORIGIN_SECTORS} nbd {} dead_timeout_ms=500 reconnect_delay_ms=50",
            srv.uri("c")
        ),
    )
    .expect("connect to the cache export");
    reg
}
