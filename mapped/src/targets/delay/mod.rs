//! `delay <dev> <offset> <delay_ms> [<wdev> <woffset> <wdelay_ms> [<fdev>
//! <foffset> <fdelay_ms>]] [key=value...]`: hold each bio for a while, then
//! send it on (kernel dm-delay.c), in dm-delay's shape: a constructor that
//! builds one [`DelayClass`] per op class (`delay_class_ctr`), `map`
//! (`delay_map`), `status`, `message`, and presuspend/resume; the bios
//! held are sent on by one of three flush mechanisms behind `Flusher`.
//!
//! # dm-delay compatibility
//!
//! Three op classes as in dm-delay 1.4+: reads, writes, and flushes (a write
//! with `PREFLUSH`, and here also an empty [`Op::Flush`]); discards and
//! write-zeroes are writes (`bio_data_dir == WRITE`). With 3 arguments all
//! classes use the first set; with 6 flushes use the write set. A class
//! with delay 0 passes bios straight through, as does a suspended target
//! (presuspend flushes everything held and stops delaying until resume).
//! `status` is dm's `<reads> <writes> <flushes>` held right now; `table`
//! prints the device as `253:MINOR`, the sector and the delay per class,
//! 3, 6 or 9 of them as given. Argument errors follow the kernel's wording
//! ("Invalid device sector", "Invalid delay", "Device lookup failed"),
//! naming the class and the offending text.
//!
//! Beyond dm: delays take fractions of a millisecond (`0.25`), and trailing
//! `key=value` options ([`options`], printed back by `table` only when not
//! default):
//!
//! * `mode=timer|kthread|hybrid` (default `hybrid`) and `hz=N` (default
//!   250, used by `timer`); for hybrid `spin_us=N` (the spin bound and so
//!   the largest sleep margin, default 100), `wake_pct=P` (the percentile
//!   of observed wake lateness the margin covers, default 80) and
//!   `affinity=cpu|none` (a worker per submitting CPU, default, or one
//!   unpinned worker), and `reap_backstop_ms=MS` (default 4: how late a
//!   bio may go, unreaped by a claimant, before a worker sends it on).
//! * `p99=MS`, `read_p99=MS`, `write_p99=MS`, `flush_p99=MS` and
//!   `load_k=K`, `read_load_k=K`, ...: the latency models of [`latency`].
//!   `inflight` for the load model is the number of I/Os accepted by this
//!   target and not yet completed (held here or in flight below) when the
//!   bio arrives, not counting itself.
//!
//! `message`: `set <read|write|flush|all>[_p99|_load_k] <value|off>`
//! changes a class at run time (`dmsetup message dev 0 set read 1.5`);
//! bios already held keep the deadline they got on arrival. `stats`
//! reports how late bios went out and what the hybrid sleeps and spins
//! cost.
//!
//! # Flush mechanisms
//!
//! Every bio gets `deadline = arrival + delay` on [`clock::now_ns`] and is
//! never sent on before it, by any mechanism (tests check each bio):
//! [`timer`] (dm-delay's timer and workqueue before upstream 'dm: delay:
//! use kthread instead of timers and wq'), [`kthread`] (that change) and
//! [`hybrid`] (default; the maintainer's sleep-for-long, poll-for-short
//! reply, with a worker per submitting CPU). Each keeps a deadline-ordered
//! heap, so the per-bio cost is a lock, a push and a pop, plus a timer
//! re-arm or a wake only when the worker would otherwise look too late.
//! Submitters never block beyond that lock. Workers set their timer slack
//! to 1 ns and ask the scheduler for a short slice (EEVDF
//! `sched_runtime`) so that a busy CPU does not hold their wake-up for a
//! whole default slice (`core::timing::prepare_precise_worker`).
//!
//! A submitter with an event loop may claim the hybrid mechanism's held
//! bios ([`Target::reaper`], `reaper.rs`) and send them on itself, on its
//! own thread, at their deadlines; the workers then only back it up.

mod held;
pub mod hybrid;
pub mod kthread;
pub mod latency;
pub mod options;
mod reaper;
pub mod timer;

use self::held::Held;
use self::hybrid::HybridFlusher;
use self::kthread::KthreadFlusher;
use self::latency::{Latency, LatencyModel};
use self::options::{parse_load_k, split_options, Options, SYNTAX};
use self::timer::TimerFlusher;
use crate::error::TargetError;
use crate::target::{
    extents_from, parse_sscanf, CtrContext, DevArg, Target, TargetRef, TargetType,
};
use blkstack_core::clock;
use blkstack_core::comp_batch::CompletionBatch;
use blkstack_core::device::Extent;
use blkstack_core::{Bio, BioFlags, EndIo, Features, Op, Status, SECTOR_SIZE};
use parking_lot::Mutex;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

pub use self::options::{format_ms, parse_ms, DEFAULT_HZ, DEFAULT_SPIN_US, DEFAULT_WAKE_PCT};

/// The `delay` target type (kernel `dm-delay.c`'s `delay_target`).
pub const TYPE: TargetType = TargetType {
    name: "delay",
    version: [1, 5, 0],
    ctr,
};

/// dm-delay takes an unsigned int of milliseconds.
const MAX_DELAY_NS: u64 = u32::MAX as u64 * 1_000_000;
/// `stats` counts a bio as late when it went out this long after its
/// deadline.
const LATE_NS: u64 = 10_000;
/// The scheduler slice the workers ask for (EEVDF's minimum).
const WORKER_SLICE_NS: u64 = 100_000;

const READ: usize = 0;
const WRITE: usize = 1;
const FLUSH: usize = 2;
const CLASS_NAMES: [&str; 3] = ["read", "write", "flush"];

/// dm-delay's class choice: writes with PREFLUSH (and empty flushes) are
/// flushes, every other op that writes is a write.
fn class_of(bio: &Bio) -> usize {
    if bio.op == Op::Flush || (bio.op.is_write() && bio.flags.contains(BioFlags::PREFLUSH)) {
        FLUSH
    } else if bio.op.is_write() {
        WRITE
    } else {
        READ
    }
}

/// Which flush mechanism sends held bios on. See the module documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// dm-delay before upstream "dm: delay: use kthread instead of timers and
    /// wq": an emulated-jiffies timer wakes a worker, so delays round up to
    /// ticks of `hz`.
    Timer,
    /// That upstream change: one worker polls the held bios while any is
    /// held (accurate, but a busy CPU per device) and sleeps otherwise.
    Kthread,
    /// The default, the maintainer's hybrid: sleep for long delays, then poll
    /// for the last short stretch, with a worker per submitting CPU.
    Hybrid,
}

impl Mode {
    /// The option value naming this mode (`mode=`).
    pub fn name(self) -> &'static str {
        match self {
            Mode::Timer => "timer",
            Mode::Kthread => "kthread",
            Mode::Hybrid => "hybrid",
        }
    }

    fn parse(s: &str) -> Result<Mode, TargetError> {
        match s {
            "timer" => Ok(Mode::Timer),
            "kthread" => Ok(Mode::Kthread),
            "hybrid" => Ok(Mode::Hybrid),
            _ => Err(TargetError::invalid(format!(
                "invalid mode '{s}' (timer, kthread or hybrid)"
            ))),
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// dm-delay's `struct delay_class`: the lower device of one op class and
/// how many of its bios are held now. Its delay, which `message` may
/// change, is in the target's `LatencyModel`.
pub struct DelayClass {
    dev: DevArg,
    /// Start on `dev`, in sectors.
    start: u64,
    /// Held bios, dm-delay's `class->ops`.
    ops: AtomicU32,
}

/// What `message <dev> 0 stats` reports for every mechanism: how far past
/// their deadlines bios went out.
#[derive(Default)]
struct Stats {
    /// Bios sent on at or after their deadline by a worker.
    sent: AtomicU64,
    /// The sum of how long after its deadline each was sent on.
    late_ns: AtomicU64,
    /// How many of them were more than [`LATE_NS`] late.
    late: AtomicU64,
}

/// What the target and its flush workers share.
struct Shared {
    classes: [DelayClass; 3],
    /// I/Os accepted and not completed, counted while a load model is on.
    inflight: AtomicU64,
    stats: Stats,
    /// Set at teardown: every worker exits.
    stop: AtomicBool,
    /// The device name (first 8 characters), for thread names.
    name: String,
    /// Every worker thread, joined on drop.
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Shared {
    fn send_on(&self, h: Held) {
        self.classes[h.class as usize].dev.dev.submit(h.bio);
    }

    /// Send on a bio whose deadline has passed, counting how late it is.
    fn send_expired(&self, h: Held) {
        let late = clock::now_ns().saturating_sub(h.deadline_ns);
        self.stats.sent.fetch_add(1, Ordering::Relaxed);
        self.stats.late_ns.fetch_add(late, Ordering::Relaxed);
        if late > LATE_NS {
            self.stats.late.fetch_add(1, Ordering::Relaxed);
        }
        self.send_on(h);
    }

    /// Send on a pass of bios now due, inside one completion batch
    /// (`blkstack_core::comp_batch`): a completer above that answers each
    /// (an NBD connection's reply) does its per-batch work once.
    fn send_expired_batch(&self, batch: &mut Vec<Held>) {
        let _batch = CompletionBatch::start();
        for h in batch.drain(..) {
            self.send_expired(h);
        }
    }

    /// Start a flush worker, joined when the target is dropped.
    fn spawn(&self, name: String, f: impl FnOnce() + Send + 'static) -> Result<(), TargetError> {
        let h = std::thread::Builder::new()
            .name(name)
            .spawn(f)
            .map_err(|source| TargetError::Io {
                what: "cannot start the delay worker",
                source,
            })?;
        self.threads.lock().push(h);
        Ok(())
    }
}

impl EndIo for Shared {
    fn end_io(&self, bio: Bio, status: Status, _private: u64) {
        self.inflight.fetch_sub(1, Ordering::Relaxed);
        bio.complete(status);
    }
}

/// A flush mechanism: holds bios and sends each on at its deadline
/// ([`Shared::send_expired`]), taking it off its class's held count.
trait Flusher: Send + Sync {
    /// Which of its queues takes a bio submitted on this thread now. It
    /// may start that queue's worker, so `map` asks before taking the
    /// target's lock.
    fn queue_for_submitter(&self) -> usize {
        0
    }

    /// The key held bios are ordered and released by: the nanosecond
    /// deadline, or the timer mechanism's jiffies expiry.
    fn key(&self, now_ns: u64, delay_ns: u64) -> u64 {
        now_ns + delay_ns
    }

    /// Hold a bio until its deadline. Called under the target's lock, so
    /// that presuspend never misses a bio being held.
    fn hold(&self, queue: usize, held: Held);

    /// Take every held bio (presuspend, teardown).
    fn take_all(&self) -> Vec<Held>;

    /// Wake every worker so that it sees [`Shared::stop`].
    fn wake_for_stop(&self);

    /// Mechanism counters appended to `stats`, given the bios sent on.
    fn stats_words(&self, _sent: u64) -> String {
        String::new()
    }

    /// A claim on the held bios for a submitter that sends them on
    /// itself (`reaper.rs`); `None` for a mechanism that keeps that to
    /// its own workers.
    fn reaper(&self) -> Option<Box<dyn blkstack_core::Reaper>> {
        None
    }
}

/// What `map` reads and `message` and suspend change.
struct Settings {
    latency: LatencyModel,
    /// dm-delay's `may_delay`: cleared by presuspend, set by resume.
    may_delay: bool,
    /// Arrival order of held bios.
    seq: u64,
}

/// A built `delay` target: its per-class delays and the flush mechanism
/// holding its bios (kernel `struct delay_c`).
pub struct DelayTarget {
    shared: Arc<Shared>,
    settings: Mutex<Settings>,
    flusher: Box<dyn Flusher>,
    opts: Options,
    /// How many positional arguments the table had (3, 6 or 9).
    argc: usize,
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    let (pos, opts) = split_options(args)?;
    if ![3, 6, 9].contains(&pos.len()) {
        return Err(TargetError::invalid(format!(
            "requires exactly 3, 6 or 9 arguments '{SYNTAX}', got {}",
            pos.len()
        )));
    }
    let (classes, mut latency) = delay_classes_ctr(ctx, &pos)?;
    let mut o = Options::default();
    for (k, v) in &opts {
        o.apply(&mut latency, k, v)?;
    }
    let shared = Arc::new(Shared {
        classes,
        inflight: AtomicU64::new(0),
        stats: Stats::default(),
        stop: AtomicBool::new(false),
        name: ctx.device_name.chars().take(8).collect(),
        threads: Mutex::new(Vec::new()),
    });
    let flusher: Box<dyn Flusher> = match o.mode {
        Mode::Timer => Box::new(TimerFlusher::start(&shared, o.hz)?),
        Mode::Kthread => Box::new(KthreadFlusher::start(&shared)?),
        // The per-CPU workers start when their CPU first submits.
        Mode::Hybrid => Box::new(HybridFlusher::start(
            &shared,
            o.spin_us * 1000,
            o.affinity,
            o.wake_pct,
            o.reap_backstop_ns,
        )?),
    };
    Ok(Arc::new(DelayTarget {
        shared,
        settings: Mutex::new(Settings {
            latency: LatencyModel::new(latency),
            may_delay: true,
            seq: 0,
        }),
        flusher,
        opts: o,
        argc: pos.len(),
    }))
}

/// dm-delay's `delay_class_ctr` for each class given (sector, delay, then
/// the device lookup); the classes not given use the previous set, as
/// dm-delay does.
fn delay_classes_ctr(
    ctx: &mut CtrContext<'_>,
    pos: &[&str],
) -> Result<([DelayClass; 3], [Latency; 3]), TargetError> {
    let mut devs: Vec<(DevArg, u64)> = Vec::with_capacity(3);
    let mut latency = [Latency::plain(0); 3];
    for class in 0..pos.len() / 3 {
        let a = &pos[class * 3..class * 3 + 3];
        let (what, cap) = match class {
            READ => ("", "Device"),
            WRITE => ("write ", "Write device"),
            _ => ("flush ", "Flush device"),
        };
        let start: u64 = parse_sscanf("sector", a[1])
            .map_err(|_| TargetError::invalid(format!("Invalid {what}device sector '{}'", a[1])))?;
        let delay =
            parse_ms(a[2]).map_err(|e| e.within(format!("Invalid {what}delay '{}'", a[2])))?;
        let dev = ctx
            .get_device(a[0], start, ctx.len)
            .map_err(|e| e.within(format!("{cap} lookup failed")))?;
        devs.push((dev, start));
        latency[class] = Latency::plain(delay);
    }
    for c in devs.len()..3 {
        devs.push(devs[c - 1].clone());
        latency[c] = latency[c - 1];
    }
    let mut it = devs.into_iter().map(|(dev, start)| DelayClass {
        dev,
        start,
        ops: AtomicU32::new(0),
    });
    match (it.next(), it.next(), it.next()) {
        (Some(r), Some(w), Some(f)) => Ok(([r, w, f], latency)),
        _ => Err(TargetError::invalid(
            "internal error: delay classes not built",
        )),
    }
}

impl Target for DelayTarget {
    /// dm-delay's `delay_map`: a bio of a class with a delay is held until
    /// `arrival + delay`, the others go straight down.
    fn map(&self, mut bio: Bio) {
        let sh = &self.shared;
        let class = class_of(&bio);
        // Which worker takes it (a hybrid worker for this CPU starts here,
        // outside the lock, on its first bio).
        let queue = self.flusher.queue_for_submitter();
        let now = clock::now_ns();
        let mut st = self.settings.lock();
        let counted = st.latency.load_model_on();
        let inflight = if counted {
            sh.inflight.fetch_add(1, Ordering::Relaxed)
        } else {
            0
        };
        let delay = if st.may_delay {
            st.latency.delay_for(class, inflight)
        } else {
            0
        };
        if counted {
            bio.push_end(sh.clone(), 0);
        }
        let dc = &sh.classes[class];
        bio.offset += dc.start * SECTOR_SIZE;
        if delay == 0 {
            drop(st);
            dc.dev.dev.submit(bio);
            return;
        }
        let seq = st.seq;
        st.seq += 1;
        dc.ops.fetch_add(1, Ordering::Relaxed);
        let held = Held {
            key: self.flusher.key(now, delay),
            deadline_ns: now + delay,
            seq,
            class: class as u8,
            bio,
        };
        self.flusher.hold(queue, held);
    }

    /// dm-delay: `<reads> <writes> <flushes>` held now.
    fn status(&self) -> String {
        let ops = |c: usize| self.shared.classes[c].ops.load(Ordering::Relaxed);
        format!("{} {} {}", ops(READ), ops(WRITE), ops(FLUSH))
    }

    fn table(&self) -> String {
        let sh = &self.shared;
        let st = self.settings.lock();
        let t = &st.latency.classes;
        let c = &sh.classes;
        let same_dev =
            |a: usize, b: usize| c[a].dev.name == c[b].dev.name && c[a].start == c[b].start;
        let differs = |a: usize, b: usize| t[a].delay_ns != t[b].delay_ns || !same_dev(a, b);
        // As given, unless a message made classes differ that the given
        // form shares: then print the longer form so it reads back.
        let mut argc = self.argc;
        if argc == 3 && (differs(READ, WRITE) || differs(READ, FLUSH)) {
            argc = 6;
        }
        if argc == 6 && differs(WRITE, FLUSH) {
            argc = 9;
        }
        let mut parts: Vec<String> = (0..argc / 3)
            .map(|i| format!("{} {} {}", c[i].dev, c[i].start, format_ms(t[i].delay_ns)))
            .collect();
        self.opts.table_words(&mut parts);
        let per_class = |parts: &mut Vec<String>, key: &str, vals: [Option<String>; 3]| {
            if vals[0].is_some() && vals.iter().all(|v| *v == vals[0]) {
                parts.push(format!("{key}={}", vals[0].clone().unwrap_or_default()));
            } else {
                for (c, v) in vals.iter().enumerate() {
                    if let Some(v) = v {
                        parts.push(format!("{}_{key}={v}", CLASS_NAMES[c]));
                    }
                }
            }
        };
        per_class(&mut parts, "p99", t.map(|x| x.p99_ns.map(format_ms)));
        per_class(
            &mut parts,
            "load_k",
            t.map(|x| x.load_k.map(|k| k.to_string())),
        );
        parts.join(" ")
    }

    /// `set <read|write|flush|all>[_p99|_load_k] <value|off>`, or `stats`.
    fn message(&self, args: &[&str]) -> Result<String, TargetError> {
        if args == ["stats"] {
            return Ok(self.stats_text());
        }
        let [verb, key, value] = args else {
            return Err(TargetError::invalid(format!("delay: {USAGE}")));
        };
        if *verb != "set" {
            return Err(TargetError::invalid(format!(
                "delay: unknown message '{verb}'; {USAGE}"
            )));
        }
        self.set(key, value)?;
        Ok(String::new())
    }

    /// dm-delay's presuspend: stop delaying and send on everything held.
    fn presuspend(&self) {
        let held = {
            let mut st = self.settings.lock();
            st.may_delay = false;
            self.take_all()
        };
        for h in held {
            self.shared.send_on(h);
        }
    }

    fn resume(&self) {
        self.settings.lock().may_delay = true;
    }

    fn features(&self) -> Features {
        let c = &self.shared.classes;
        c[READ]
            .dev
            .dev
            .features()
            .intersect(c[WRITE].dev.dev.features())
            .intersect(c[FLUSH].dev.dev.features())
    }

    fn extents(&self, offset: u64, len: u64) -> Option<Vec<Extent>> {
        let dc = &self.shared.classes[READ];
        extents_from(&dc.dev, dc.start, offset, len)
    }

    /// `hybrid` lets a submitter send on the bios it holds (`reaper.rs`);
    /// `timer` and `kthread` keep to their workers, as dm-delay does.
    fn reaper(&self) -> Option<Box<dyn blkstack_core::Reaper>> {
        self.flusher.reaper()
    }
}

const USAGE: &str = "usage: set <read|write|flush|all>[_p99|_load_k] <value|off>, or stats";

impl DelayTarget {
    /// The flush mechanism this target runs.
    pub fn mode(&self) -> Mode {
        self.opts.mode
    }

    /// Every held bio, in arrival order as dm-delay walks its list
    /// (`flush_delayed_bios(dc, true)`), off the held counts.
    fn take_all(&self) -> Vec<Held> {
        let mut all = self.flusher.take_all();
        for c in &self.shared.classes {
            c.ops.store(0, Ordering::Relaxed);
        }
        all.sort_unstable_by_key(|h| h.seq);
        all
    }

    /// `message set KEY VALUE`: a class's delay, p99 or load_k.
    fn set(&self, key: &str, value: &str) -> Result<(), TargetError> {
        let (class, field) = match key.split_once('_') {
            Some((c, f)) => (c, f),
            None => (key, "delay"),
        };
        let classes: Vec<usize> = match class {
            "all" => vec![READ, WRITE, FLUSH],
            _ => match CLASS_NAMES.iter().position(|c| *c == class) {
                Some(i) => vec![i],
                None => {
                    return Err(TargetError::invalid(format!(
                        "delay: unknown class '{class}'; {USAGE}"
                    )))
                }
            },
        };
        let mut st = self.settings.lock();
        let t = &mut st.latency.classes;
        match field {
            "delay" => {
                let ns = parse_ms(value)
                    .map_err(|e| e.within(format!("delay: invalid delay '{value}'")))?;
                classes.iter().for_each(|&c| t[c].delay_ns = ns);
            }
            "p99" => {
                let v = if value == "off" {
                    None
                } else {
                    Some(
                        parse_ms(value)
                            .map_err(|e| e.within(format!("delay: invalid p99 '{value}'")))?,
                    )
                };
                classes.iter().for_each(|&c| t[c].p99_ns = v);
            }
            "load_k" => {
                let v = if value == "off" {
                    None
                } else {
                    Some(parse_load_k(value).map_err(|e| e.within("delay"))?)
                };
                classes.iter().for_each(|&c| t[c].load_k = v);
            }
            _ => {
                return Err(TargetError::invalid(format!(
                    "delay: unknown setting '{key}'; {USAGE}"
                )))
            }
        }
        Ok(())
    }

    /// `message <dev> 0 stats`: `sent=` bios sent on after their delay,
    /// `late_mean_ns=` how long after the deadline on average,
    /// `late_10us=` how many more than 10 µs after it; the hybrid
    /// mechanism adds its sleep and spin counters.
    fn stats_text(&self) -> String {
        let st = &self.shared.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let sent = get(&st.sent);
        let draws = self.settings.lock().latency.p99_draws;
        let mut out = format!(
            "sent={sent} late_mean_ns={} late_10us={} p99_draws={draws}",
            get(&st.late_ns).checked_div(sent).unwrap_or(0),
            get(&st.late)
        );
        out.push_str(&self.flusher.stats_words(sent));
        out
    }
}

impl Drop for DelayTarget {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.flusher.wake_for_stop();
        let me = std::thread::current().id();
        let threads = std::mem::take(&mut *self.shared.threads.lock());
        for h in threads {
            // A table dropped from a completion running on its own worker
            // cannot wait for that worker; it exits on `stop` by itself.
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
        for h in self.take_all() {
            self.shared.send_on(h);
        }
    }
}
