//! `powercut <dev> [<#feature args> [<arg>]...]`: a disk with a volatile
//! write cache whose power can be cut. dm has no such target; the
//! semantics are those of Documentation/block/writeback_cache_control.rst
//! (a write is durable once a later `REQ_PREFLUSH` completes, or at once
//! with `REQ_FUA`), and the feature list is counted as dm-flakey's.
//!
//! - Writes, write-zeroes and discards complete as soon as they are in
//!   the cache ([`cache`]), which keeps the newest data of each sector; a
//!   read sees the cache over the device (read-your-writes). Write-zeroes
//!   and discards are cached as ranges that read as zeroes (no buffer),
//!   and reach the device as a write-zeroes or discard, as a disk queues
//!   them behind its cached writes; they are offered only if the device
//!   offers them.
//! - A flush (or `PREFLUSH`) writes the whole cache down, flushes the
//!   device, then completes; a FUA write goes down (with FUA, or followed
//!   by a device flush) with only the sectors it wrote, the rest of the
//!   cache staying volatile ([`worker`]).
//! - Feature `max_dirty SIZE` (bytes, suffix K/M/G/T, default 64M) bounds
//!   the cache: past three quarters of it the oldest writes are forced
//!   down, and a write that does not fit waits (uncopied) until they are.
//! - `message 0 cut [drop | reorder SEED | torn SEED [SECTORS]]` cuts the
//!   power ([`cut`]): the chosen survivors are written down and flushed,
//!   the rest of the cache is gone, and every request fails with EIO
//!   (those waiting in the target too) until `message 0 power_on`.
//!
//! `status`: `on|off cached_writes=N cached_bytes=N flushes=N
//! fua_writes=N forced_writes=N stalled_writes=N writeback=N cuts=N
//! last_cut_kept=N last_cut_lost=N last_cut_torn=N`. `table`: the device
//! as `253:MINOR`, then the feature count and words when given.

mod cache;
mod cut;
mod worker;
mod writeback;

use self::cache::{BufPool, Cache, Coverage, Payload, Write};
use self::cut::CutMode;
use self::writeback::WritebackError;
use crate::error::TargetError;
use crate::target::{parse_sscanf, CtrContext, DevArg, Target, TargetRef, TargetType};
use crate::targets::memory::parse_alloc_size;
use blkstack_core::{Bio, BioFlags, EndIo, Features, Op, Status, SECTOR_SHIFT};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The `powercut` target type.
pub const TYPE: TargetType = TargetType {
    name: "powercut",
    version: [1, 0, 0],
    ctr,
};

const SYNTAX: &str = "<dev> [<#feature args> [max_dirty <size>]]";

/// `max_dirty` when not given.
const DEFAULT_MAX_DIRTY: u64 = 64 << 20;

/// The bounds of `max_dirty`: a sector, and 1 TiB.
const MAX_DIRTY_RANGE: (u64, u64) = (512, 1 << 40);

/// The most freed buffers a target keeps for reuse, in bytes (and at
/// most a quarter of `max_dirty`).
const POOL_MAX: u64 = 16 << 20;

/// How long a cut waits for the device (the writeback in flight, then
/// the survivors) before it gives up and says so.
const CUT_LIMIT: Duration = Duration::from_secs(60);

/// Counters `status` shows.
#[derive(Default)]
struct Stats {
    flushes: u64,
    fua_writes: u64,
    forced: u64,
    cuts: u64,
    last_kept: u64,
    last_lost: u64,
    last_torn: u64,
}

/// What the map path, the worker and the messages share, under one lock
/// held only for bookkeeping and copies, never across device I/O.
struct State {
    cache: Cache,
    /// Power is off: every request fails.
    off: bool,
    /// Flushes and `PREFLUSH` writes waiting for the next batch.
    pending_flush: Vec<Bio>,
    /// FUA writes (cached) waiting for the next batch, with their sectors.
    pending_fua: Vec<(Bio, u64, u64)>,
    /// Writes that found the cache full, in arrival order.
    stalled: VecDeque<Bio>,
    /// The requests the batch in flight completes.
    batch_waiters: Vec<Bio>,
    /// A batch is being written down.
    in_flight: bool,
    /// Extents in that batch.
    writeback: usize,
    /// The device holds writes no device flush has covered yet.
    dev_dirty: bool,
    shutdown: bool,
    stats: Stats,
}

impl State {
    /// Every request waiting in the target, to fail at a cut.
    fn take_waiting(&mut self) -> Vec<Bio> {
        let mut all = std::mem::take(&mut self.pending_flush);
        all.extend(self.pending_fua.drain(..).map(|(b, _, _)| b));
        all.extend(self.stalled.drain(..));
        all.append(&mut self.batch_waiters);
        all
    }
}

struct Shared {
    dev: DevArg,
    /// Freed write buffers, for the next writes.
    pool: Arc<BufPool>,
    max_dirty: u64,
    /// Pieces the cache may hold (zero-length ranges cost no bytes but a
    /// map entry): one per sector of `max_dirty`.
    max_pieces: usize,
    state: Mutex<State>,
    /// The worker waits here for work.
    work: Condvar,
    /// A cut waits here for the batch in flight to end.
    idle: Condvar,
    /// Raised by every cut: a read that went to the device before it
    /// fails when it completes after it.
    generation: AtomicU64,
    /// Serialises `cut` and `power_on`.
    control: Mutex<()>,
}

/// A built `powercut` target.
pub struct PowercutTarget {
    shared: Arc<Shared>,
    /// `max_dirty`'s words as given, for `table`.
    features: Vec<String>,
    worker: Option<JoinHandle<()>>,
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    let Some(dev_arg) = args.first() else {
        return Err(TargetError::ArgCount {
            want: "at least 1".into(),
            syntax: SYNTAX,
            got: 0,
        });
    };
    let (max_dirty, features) = parse_features(&args[1..])?;
    let dev = ctx.get_device(dev_arg, 0, ctx.len)?;
    let pool = BufPool::new((max_dirty / 4).min(POOL_MAX));
    let shared = Arc::new(Shared {
        dev,
        pool: pool.clone(),
        max_dirty,
        max_pieces: usize::try_from(max_dirty >> SECTOR_SHIFT)
            .unwrap_or(usize::MAX)
            .max(16),
        state: Mutex::new(State {
            cache: Cache::new(pool),
            off: false,
            pending_flush: Vec::new(),
            pending_fua: Vec::new(),
            stalled: VecDeque::new(),
            batch_waiters: Vec::new(),
            in_flight: false,
            writeback: 0,
            dev_dirty: false,
            shutdown: false,
            stats: Stats::default(),
        }),
        work: Condvar::new(),
        idle: Condvar::new(),
        generation: AtomicU64::new(0),
        control: Mutex::new(()),
    });
    let sh = shared.clone();
    let worker = std::thread::Builder::new()
        .name(format!("powercut/{}", ctx.device_name))
        .spawn(move || worker::run(sh))
        .map_err(|source| TargetError::Io {
            what: "could not start the powercut writeback thread",
            source,
        })?;
    Ok(Arc::new(PowercutTarget {
        shared,
        features,
        worker: Some(worker),
    }))
}

/// The feature list: a count (dm-flakey's `dm_read_arg_group`), then
/// exactly that many words. Returns `max_dirty` and the words to print.
fn parse_features(args: &[&str]) -> Result<(u64, Vec<String>), TargetError> {
    let Some(count) = args.first() else {
        return Ok((DEFAULT_MAX_DIRTY, Vec::new()));
    };
    let n: u32 = parse_sscanf("number of feature args", count)?;
    let words = &args[1..];
    if n as usize != words.len() {
        return Err(TargetError::invalid(format!(
            "invalid number of feature args: {n} declared, {} given ('{SYNTAX}')",
            words.len()
        )));
    }
    let mut max_dirty = None;
    let mut it = words.iter();
    while let Some(w) = it.next() {
        match w.to_ascii_lowercase().as_str() {
            "max_dirty" => {
                if max_dirty.is_some() {
                    return Err(TargetError::invalid("feature max_dirty given twice"));
                }
                let v = it.next().ok_or_else(|| {
                    TargetError::invalid(
                        "feature max_dirty needs a size (bytes, suffix K, M, G or T)",
                    )
                })?;
                max_dirty = Some(parse_max_dirty(v)?);
            }
            other => {
                return Err(TargetError::invalid(format!(
                    "unrecognised powercut feature '{other}' (known: max_dirty SIZE)"
                )))
            }
        }
    }
    let words = if n == 0 {
        Vec::new()
    } else {
        std::iter::once(n.to_string())
            .chain(words.iter().map(|w| w.to_string()))
            .collect()
    };
    Ok((max_dirty.unwrap_or(DEFAULT_MAX_DIRTY), words))
}

fn parse_max_dirty(v: &str) -> Result<u64, TargetError> {
    let (lo, hi) = MAX_DIRTY_RANGE;
    match parse_alloc_size(v) {
        Some(n) if (lo..=hi).contains(&n) => Ok(n),
        _ => Err(TargetError::invalid(format!(
            "invalid max_dirty '{v}': a size of {lo} bytes to 1T (suffix K, M, G or T)"
        ))),
    }
}

/// The bytes a write holds in the cache: its data (zeroes and discards
/// keep none).
fn cost(bio: &Bio) -> u64 {
    if bio.op == Op::Write {
        bio.len
    } else {
        0
    }
}

/// The copy a cached write keeps of its bio.
fn payload(pool: &BufPool, bio: &Bio) -> Payload {
    match bio.op {
        Op::Write => Payload::Data(pool.copy(bio.data())),
        Op::WriteZeroes => Payload::Zeroes {
            nounmap: bio.flags.contains(BioFlags::NOUNMAP),
        },
        _ => Payload::Discard,
    }
}

impl Shared {
    fn map(self: &Arc<Self>, bio: Bio) {
        match bio.op {
            Op::Read => self.read(bio),
            Op::Flush => self.flush(bio),
            _ if bio.flags.contains(BioFlags::PREFLUSH) => self.flush(bio),
            _ => self.write(bio),
        }
    }

    fn flush(self: &Arc<Self>, mut bio: Bio) {
        let mut st = self.state.lock();
        if st.off {
            drop(st);
            return bio.complete(Status::IoError);
        }
        let nothing_volatile = st.cache.is_empty()
            && !st.in_flight
            && !st.dev_dirty
            && st.pending_flush.is_empty()
            && st.pending_fua.is_empty();
        if nothing_volatile {
            st.stats.flushes += 1;
            drop(st);
            if bio.op == Op::Flush {
                return bio.complete(Status::Ok);
            }
            bio.flags.remove(BioFlags::PREFLUSH);
            return self.write(bio);
        }
        st.pending_flush.push(bio);
        worker::kick(self, st);
    }

    fn write(self: &Arc<Self>, bio: Bio) {
        if bio.len == 0 {
            let off = self.state.lock().off;
            return bio.complete(if off { Status::IoError } else { Status::Ok });
        }
        if bio.op != Op::Write {
            let f = self.dev.dev.features();
            if (bio.op == Op::Discard && !f.discard)
                || (bio.op == Op::WriteZeroes && !f.write_zeroes)
            {
                return bio.complete(Status::NotSupported);
            }
        }
        let data = payload(&self.pool, &bio);
        let mut st = self.state.lock();
        if st.off {
            drop(st);
            return bio.complete(Status::IoError);
        }
        if !st.stalled.is_empty() || !st.cache.fits(cost(&bio), self.max_dirty, self.max_pieces) {
            st.stalled.push_back(bio);
            drop(st);
            self.work.notify_one();
            return;
        }
        let Some(done) = self.admit(&mut st, bio, data) else {
            // A FUA write: its batch may start now.
            return worker::kick(self, st);
        };
        let c = &st.cache;
        let full = c.mem > self.max_dirty / 4 * 3 || c.pieces() > self.max_pieces / 4 * 3;
        drop(st);
        if full {
            self.work.notify_one();
        }
        done.complete(Status::Ok);
    }

    /// Put a write in the cache. Returns it if it may complete now; a FUA
    /// write waits for the worker.
    fn admit(&self, st: &mut State, bio: Bio, data: Payload) -> Option<Bio> {
        let (start, len) = (bio.offset >> SECTOR_SHIFT, bio.len >> SECTOR_SHIFT);
        st.cache.insert(start, len, data);
        if bio.flags.contains(BioFlags::FUA) {
            st.pending_fua.push((bio, start, start + len));
            return None;
        }
        Some(bio)
    }

    /// Let stalled writes in while they fit, oldest first; returns those
    /// that may complete.
    fn admit_stalled(&self, st: &mut State) -> Vec<Bio> {
        let mut done = Vec::new();
        while let Some(b) = st.stalled.front() {
            if !st.cache.fits(cost(b), self.max_dirty, self.max_pieces) {
                break;
            }
            let Some(b) = st.stalled.pop_front() else {
                break;
            };
            let data = payload(&self.pool, &b);
            done.extend(self.admit(st, b, data));
        }
        if !st.pending_fua.is_empty() || !st.stalled.is_empty() {
            self.work.notify_one();
        }
        done
    }

    fn read(self: &Arc<Self>, mut bio: Bio) {
        let st = self.state.lock();
        if st.off {
            drop(st);
            return bio.complete(Status::IoError);
        }
        let start = bio.offset >> SECTOR_SHIFT;
        let end = start + (bio.len >> SECTOR_SHIFT);
        let generation = self.generation.load(Ordering::Acquire);
        match st.cache.coverage(start, end) {
            Coverage::Full => {
                st.cache.read_into(start, bio.data_mut());
                drop(st);
                bio.complete(Status::Ok);
            }
            Coverage::None => {
                drop(st);
                bio.push_end(self.clone(), generation);
                self.dev.dev.submit(bio);
            }
            Coverage::Partial => {
                let pieces = st.cache.snapshot(start, end);
                drop(st);
                let overlay = Arc::new(Overlay {
                    shared: self.clone(),
                    generation,
                    start,
                    pieces,
                });
                bio.push_end(overlay, 0);
                self.dev.dev.submit(bio);
            }
        }
    }

    /// Whether a cut came since `generation` was read.
    fn cut_since(&self, generation: u64) -> bool {
        self.generation.load(Ordering::Acquire) != generation
    }

    fn status(&self) -> String {
        let st = self.state.lock();
        let s = &st.stats;
        format!(
            "{} cached_writes={} cached_bytes={} flushes={} fua_writes={} forced_writes={} \
             stalled_writes={} writeback={} cuts={} last_cut_kept={} last_cut_lost={} last_cut_torn={}",
            if st.off { "off" } else { "on" },
            st.cache.writes,
            st.cache.bytes,
            s.flushes,
            s.fua_writes,
            s.forced,
            st.stalled.len(),
            st.writeback,
            s.cuts,
            s.last_kept,
            s.last_lost,
            s.last_torn,
        )
    }

    /// `cut MODE`: power fails now (see the module doc).
    fn cut(&self, mode: CutMode) -> Result<String, TargetError> {
        let _control = self.control.lock();
        let waiting = {
            let mut st = self.state.lock();
            if st.off {
                return Err(TargetError::invalid(
                    "cut: the power is already off; send 'power_on' first",
                ));
            }
            st.off = true;
            self.generation.fetch_add(1, Ordering::AcqRel);
            st.take_waiting()
        };
        // What waited in the target ends now, never later.
        for b in waiting {
            b.complete(Status::IoError);
        }
        let (extents, waited_out) = {
            let mut st = self.state.lock();
            let t0 = Instant::now();
            while st.in_flight && t0.elapsed() < CUT_LIMIT {
                self.idle.wait_for(&mut st, writeback::WAIT_SLICE);
            }
            let waited_out = st.in_flight;
            st.stats.cuts += 1;
            (st.cache.drain(), waited_out)
        };
        let mode = if waited_out { CutMode::Drop } else { mode };
        let outcome = cut::choose(mode, extents, device_sectors(&self.dev));
        {
            let mut st = self.state.lock();
            st.stats.last_kept = outcome.kept;
            st.stats.last_lost = outcome.lost;
            st.stats.last_torn = outcome.torn;
        }
        if waited_out {
            return Err(TargetError::invalid(format!(
                "cut: {} did not finish the writeback in flight within {}s; \
                 every cached write was dropped",
                self.dev.name,
                CUT_LIMIT.as_secs()
            )));
        }
        self.write_survivors(&outcome.survivors)?;
        self.state.lock().dev_dirty = false;
        Ok(format!(
            "cut {mode}: kept {} of {} cached writes ({} torn)",
            outcome.kept,
            outcome.kept + outcome.lost,
            outcome.torn
        ))
    }

    /// Write a cut's survivors down and flush them, within [`CUT_LIMIT`].
    fn write_survivors(&self, survivors: &[cache::Extent]) -> Result<(), TargetError> {
        let t0 = Instant::now();
        let r = writeback::submit(&self.dev.dev, survivors)
            .wait(CUT_LIMIT)
            .and_then(|()| {
                let left = CUT_LIMIT.saturating_sub(t0.elapsed());
                writeback::flush(&self.dev.dev).wait(left)
            });
        r.map_err(|e| {
            let why = match e {
                WritebackError::Failed(s) => format!("failed ({s})"),
                WritebackError::TimedOut => {
                    format!("did not complete within {}s", CUT_LIMIT.as_secs())
                }
            };
            TargetError::invalid(format!(
                "cut: writing the surviving writes to {} {why}; the power is off",
                self.dev.name
            ))
        })
    }

    fn power_on(&self) -> Result<String, TargetError> {
        let _control = self.control.lock();
        let mut st = self.state.lock();
        if !st.off {
            return Err(TargetError::invalid("power_on: the power is already on"));
        }
        st.off = false;
        Ok(String::new())
    }
}

/// The device's logical block in sectors: no tear splits one.
fn device_sectors(dev: &DevArg) -> u64 {
    (u64::from(dev.dev.logical_block_size()) >> SECTOR_SHIFT).max(1)
}

/// A read that went to the device: it fails if a cut came meanwhile.
impl EndIo for Shared {
    fn end_io(&self, bio: Bio, status: Status, generation: u64) {
        if status.is_ok() && self.cut_since(generation) {
            return bio.complete(Status::IoError);
        }
        bio.complete(status);
    }
}

/// A read partly in the cache: the cached sectors, as they were when it
/// was submitted, go over what the device returns.
struct Overlay {
    shared: Arc<Shared>,
    generation: u64,
    start: u64,
    pieces: Vec<(u64, u64, Arc<Write>)>,
}

impl EndIo for Overlay {
    fn end_io(&self, bio: Bio, status: Status, _private: u64) {
        if !status.is_ok() || self.shared.cut_since(self.generation) {
            let s = if status.is_ok() {
                Status::IoError
            } else {
                status
            };
            return bio.complete(s);
        }
        let out = bio.data_mut();
        for (sector, len, w) in &self.pieces {
            cache::copy_piece(w, *sector, *len, self.start, out);
        }
        bio.complete(Status::Ok);
    }
}

/// Waits for one internal request, with a bound.
#[derive(Default)]
struct Waiter {
    done: Mutex<Option<Status>>,
    cv: Condvar,
}

impl EndIo for Waiter {
    fn end_io(&self, _bio: Bio, status: Status, _private: u64) {
        *self.done.lock() = Some(status);
        self.cv.notify_all();
    }
}

impl PowercutTarget {
    /// Write the cache down through a flush of our own (a suspend: the
    /// table may be replaced, and the new one starts with an empty cache).
    fn write_back(&self) {
        let w = Arc::new(Waiter::default());
        let bio = Bio::new(Op::Flush, 0, 0, blkstack_core::IoBuf::empty(), w.clone(), 0);
        self.shared.flush(bio);
        let t0 = Instant::now();
        let mut done = w.done.lock();
        while done.is_none() && t0.elapsed() < CUT_LIMIT {
            w.cv.wait_for(&mut done, writeback::WAIT_SLICE);
        }
        if done.is_none() {
            tracing::warn!(device = %self.shared.dev.name, "powercut: writeback at suspend did not finish");
        }
    }
}

impl Target for PowercutTarget {
    fn map(&self, bio: Bio) {
        self.shared.map(bio);
    }

    fn status(&self) -> String {
        self.shared.status()
    }

    fn table(&self) -> String {
        let mut s = self.shared.dev.to_string();
        for w in &self.features {
            s.push(' ');
            s.push_str(w);
        }
        s
    }

    /// `cut [drop | reorder SEED | torn SEED [SECTORS]]`, `power_on`.
    fn message(&self, args: &[&str]) -> Result<String, TargetError> {
        let Some(verb) = args.first() else {
            return Err(TargetError::EmptyMessage);
        };
        match verb.to_ascii_lowercase().as_str() {
            "cut" => {
                let mode = cut::parse(&args[1..])?;
                self.shared.cut(mode)
            }
            "power_on" if args.len() == 1 => self.shared.power_on(),
            "power_on" => Err(TargetError::invalid(format!(
                "power_on takes no arguments, got '{}'",
                args[1..].join(" ")
            ))),
            _ => Err(TargetError::invalid(format!(
                "unknown powercut message '{}' (cut [drop | reorder SEED | torn SEED [SECTORS]], power_on)",
                args.join(" ")
            ))),
        }
    }

    fn postsuspend(&self) {
        self.write_back();
    }

    fn features(&self) -> Features {
        let below = self.shared.dev.dev.features();
        Features {
            flush: true,
            fua: true,
            fast_zero: below.write_zeroes,
            knows_holes: false,
            ..below
        }
    }
}

impl Drop for PowercutTarget {
    fn drop(&mut self) {
        self.shared.state.lock().shutdown = true;
        self.shared.work.notify_all();
        if let Some(t) = self.worker.take() {
            let _ = t.join();
        }
    }
}
