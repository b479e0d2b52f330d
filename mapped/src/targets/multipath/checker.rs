//! The path checker: what multipathd does beside dm-mpath, built into the
//! target so failover and failback need no daemon and no human.
//!
//! multipathd's `directio` checker reads one block of each path with
//! `O_DIRECT` every `polling_interval`, straight to the path device, not
//! through the map; a read that errors, or that has not answered within
//! `checker_timeout`, marks the path down (`fail_path` message), one that
//! succeeds on a failed path reinstates it (`reinstate_path`). Active
//! paths are probed too, so a dead path is failed before user I/O has to
//! hit it. A probe still outstanding is never doubled: multipathd's
//! asynchronous directio checker keeps one `io_submit` per path and only
//! looks again for its result. Here each path has one [`ProbeSlot`] (its
//! buffer and a three-state word: idle, in flight, timed out) that is the
//! probe bio's owner, so a probe that hangs for ever costs one buffer and
//! keeps nothing else alive.
//!
//! `no_path_retry N` is multipathd's mapping of queueing onto checker
//! ticks: the table keeps `queue_if_no_path`, and once the checker has
//! seen no usable path on N+1 consecutive ticks (so at least N full
//! intervals) it turns queueing off, failing the queue with EIO
//! (`fail_if_no_path`); when a path is usable again it turns queueing back
//! on, as multipathd does on `reinstate_path`. `queue` never turns it off,
//! `fail` (or 0) never queues.
//!
//! One thread per multipath table that has a checker, sleeping on a
//! [`Parker`] until its next tick or the next probe deadline: each table
//! has its own interval and its own lifetime (presuspend stops it, resume
//! and the `checker_interval` message start it), a parked thread costs
//! nothing between ticks, and a table's thread exits with it without a
//! registry of tables to keep in step. The thread holds only a `Weak` to
//! the multipath, upgraded for the length of one tick, so it never keeps
//! a removed device alive.

use super::{Multipath, PgPath};
use crate::error::TargetError;
use blkstack_core::clock::now_ns;
use blkstack_core::timing::Parker;
use blkstack_core::{AlignedBuf, Bio, BioFlags, EndIo, Op, Status};
use parking_lot::Mutex;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

/// Longest interval or timeout a table or message may ask for: one hour.
pub(super) const MAX_CHECKER_MS: u32 = 3_600_000;
/// Largest `no_path_retry` count: a million intervals.
pub(super) const MAX_NO_PATH_RETRY: u32 = 1_000_000;

const NS_PER_MS: u64 = 1_000_000;

/// multipathd's `no_path_retry`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NoPathRetry {
    /// `queue`: queue for ever (the same as `queue_if_no_path` alone).
    Queue,
    /// `fail` or 0: never queue.
    Fail,
    /// Queue for this many checker intervals, then fail the queue.
    Count(u32),
}

impl NoPathRetry {
    /// `queue`, `fail` or a count (0 is `fail`, as in multipath.conf).
    pub(super) fn parse(s: &str) -> Result<NoPathRetry, TargetError> {
        if s.eq_ignore_ascii_case("queue") {
            return Ok(NoPathRetry::Queue);
        }
        if s.eq_ignore_ascii_case("fail") {
            return Ok(NoPathRetry::Fail);
        }
        let n: u32 = s.parse().map_err(|_| TargetError::InvalidArg {
            what: "no_path_retry (queue, fail or a count of checker intervals)".to_string(),
            value: s.to_string(),
        })?;
        if n > MAX_NO_PATH_RETRY {
            return Err(TargetError::OutOfRange {
                what: "no_path_retry".to_string(),
                value: n.into(),
                min: 0,
                max: MAX_NO_PATH_RETRY.into(),
            });
        }
        Ok(if n == 0 {
            NoPathRetry::Fail
        } else {
            NoPathRetry::Count(n)
        })
    }

    /// The word `table` prints, which [`Self::parse`] reads back.
    pub(super) fn table_word(self) -> String {
        match self {
            NoPathRetry::Queue => "queue".to_string(),
            NoPathRetry::Fail => "fail".to_string(),
            NoPathRetry::Count(n) => n.to_string(),
        }
    }
}

/// The checker's part of the table: all off by default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct CheckerConfig {
    /// `checker_interval MS`; 0 (absent) means no checker.
    pub interval_ms: u32,
    /// `checker_timeout MS`; `None` means the interval.
    pub timeout_ms: Option<u32>,
    pub no_path_retry: Option<NoPathRetry>,
}

/// A millisecond feature value in `1..=MAX_CHECKER_MS`.
pub(super) fn parse_ms(what: &str, s: &str) -> Result<u32, TargetError> {
    let v: u32 = s.parse().map_err(|_| TargetError::InvalidArg {
        what: format!("{what} (milliseconds)"),
        value: s.to_string(),
    })?;
    if v == 0 || v > MAX_CHECKER_MS {
        return Err(TargetError::OutOfRange {
            what: format!("{what} (milliseconds)"),
            value: v.into(),
            min: 1,
            max: MAX_CHECKER_MS.into(),
        });
    }
    Ok(v)
}

const IDLE: u8 = 0;
const IN_FLIGHT: u8 = 1;
/// Still outstanding, but already counted as a failure.
const TIMED_OUT: u8 = 2;

/// One path's probe: its buffer, its state and its counters. It owns the
/// probe bio (it is the bio's [`EndIo`]), so the buffer lives as long as
/// the probe does, even past the multipath.
pub(super) struct ProbeSlot {
    m: Weak<Multipath>,
    path: usize,
    buf: AlignedBuf,
    state: AtomicU8,
    issued_ns: AtomicU64,
    probes: AtomicU64,
    ok: AtomicU64,
    fail: AtomicU64,
    reinstated: AtomicU64,
    /// Times this checker failed the path (on an error or a timeout).
    failed: AtomicU64,
}

impl ProbeSlot {
    /// Issue a probe unless one is outstanding (in flight or timed out).
    fn issue(self: &Arc<Self>, p: &PgPath) {
        if self
            .state
            .compare_exchange(IDLE, IN_FLIGHT, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        self.issued_ns.store(now_ns(), Ordering::Release);
        self.probes.fetch_add(1, Ordering::Relaxed);
        let len = self.buf.len();
        // SAFETY: the buffer lives in this slot, which the bio owns until
        // it completes; only one probe (one bio) uses it at a time.
        let buf = unsafe { self.buf.io_buf(0, len) };
        let bio =
            Bio::new(Op::Read, 0, len as u64, buf, self.clone(), 0).with_flags(BioFlags::FAILFAST);
        p.dev.dev.submit(bio);
    }

    /// The deadline of the outstanding probe, if it has not timed out yet.
    fn deadline(&self, timeout_ns: u64) -> Option<u64> {
        (self.state.load(Ordering::Acquire) == IN_FLIGHT)
            .then(|| self.issued_ns.load(Ordering::Acquire) + timeout_ns)
    }

    /// Count a probe that has not answered in time as a failure, once.
    fn expire(&self, m: &Multipath, now: u64, timeout_ns: u64) {
        let Some(deadline) = self.deadline(timeout_ns) else {
            return;
        };
        if now < deadline {
            return;
        }
        if self
            .state
            .compare_exchange(IN_FLIGHT, TIMED_OUT, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            tracing::debug!(path = %m.paths[self.path].dev, "multipath checker: probe timed out");
            self.probe_failed(m);
        }
    }

    fn probe_failed(&self, m: &Multipath) {
        self.fail.fetch_add(1, Ordering::Relaxed);
        if !m.suspended.load(Ordering::Acquire) && m.fail_path(self.path) {
            self.failed.fetch_add(1, Ordering::Relaxed);
            tracing::info!(path = %m.paths[self.path].dev, "multipath checker: path failed");
        }
    }
}

impl EndIo for ProbeSlot {
    fn end_io(&self, bio: Bio, status: Status, _private: u64) {
        // The slot owns the bio: nothing above it waits.
        drop(bio);
        if self.state.swap(IDLE, Ordering::AcqRel) != IN_FLIGHT {
            // Answered after its timeout was counted: the next probe decides.
            return;
        }
        let Some(m) = self.m.upgrade() else {
            return;
        };
        if !status.is_ok() {
            self.probe_failed(&m);
            return;
        }
        self.ok.fetch_add(1, Ordering::Relaxed);
        if !m.suspended.load(Ordering::Acquire) && m.reinstate_path(self.path) {
            self.reinstated.fetch_add(1, Ordering::Relaxed);
            tracing::info!(path = %m.paths[self.path].dev, "multipath checker: path reinstated");
        }
    }
}

/// A running checker thread and what stops it.
struct Running {
    stop: Arc<AtomicBool>,
    parker: Arc<Parker>,
    handle: JoinHandle<()>,
}

/// The checker of one multipath table.
pub(super) struct Checker {
    interval_ms: AtomicU32,
    timeout_ms: Option<u32>,
    pub(super) no_path_retry: Option<NoPathRetry>,
    slots: Vec<Arc<ProbeSlot>>,
    /// Consecutive ticks that saw no usable path.
    no_path_ticks: AtomicU32,
    /// `no_path_retry` ran out and turned queueing off.
    retry_expired: AtomicBool,
    /// A checker ran on this table: `path_stats` shows its counters.
    ever_ran: AtomicBool,
    running: Mutex<Option<Running>>,
}

impl Checker {
    /// A stopped checker for `paths`, each with a probe buffer of one
    /// logical block of its device.
    pub(super) fn new(cfg: CheckerConfig, m: &Weak<Multipath>, paths: &[PgPath]) -> Checker {
        let slots = paths
            .iter()
            .enumerate()
            .map(|(path, p)| {
                Arc::new(ProbeSlot {
                    m: m.clone(),
                    path,
                    buf: AlignedBuf::new(p.dev.dev.logical_block_size() as usize),
                    state: AtomicU8::new(IDLE),
                    issued_ns: AtomicU64::new(0),
                    probes: AtomicU64::new(0),
                    ok: AtomicU64::new(0),
                    fail: AtomicU64::new(0),
                    reinstated: AtomicU64::new(0),
                    failed: AtomicU64::new(0),
                })
            })
            .collect();
        Checker {
            interval_ms: AtomicU32::new(cfg.interval_ms),
            timeout_ms: cfg.timeout_ms,
            no_path_retry: cfg.no_path_retry,
            slots,
            no_path_ticks: AtomicU32::new(0),
            retry_expired: AtomicBool::new(false),
            ever_ran: AtomicBool::new(false),
            running: Mutex::new(None),
        }
    }

    /// The table's view: the current interval (a message may have changed
    /// it), so a reload of the printed table keeps it.
    pub(super) fn config(&self) -> CheckerConfig {
        CheckerConfig {
            interval_ms: self.interval_ms.load(Ordering::Acquire),
            timeout_ms: self.timeout_ms,
            no_path_retry: self.no_path_retry,
        }
    }

    fn timeout_ns(&self, interval_ms: u32) -> u64 {
        u64::from(self.timeout_ms.unwrap_or(interval_ms)) * NS_PER_MS
    }

    /// The feature words `table` prints (nothing when the checker was
    /// never configured), in the order [`super::ctr`] reads them back.
    pub(super) fn feature_words(&self) -> Vec<String> {
        let c = self.config();
        let mut w = Vec::new();
        if c.interval_ms > 0 {
            w.extend(["checker_interval".to_string(), c.interval_ms.to_string()]);
        }
        if let Some(t) = c.timeout_ms {
            w.extend(["checker_timeout".to_string(), t.to_string()]);
        }
        if let Some(n) = c.no_path_retry {
            w.extend(["no_path_retry".to_string(), n.table_word()]);
        }
        w
    }

    /// Start the thread if an interval is set and none runs.
    pub(super) fn start(&self, m: &Weak<Multipath>) {
        if self.interval_ms.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut running = self.running.lock();
        if running.is_some() {
            return;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let parker = Arc::new(Parker::new());
        let (m, s, p) = (m.clone(), stop.clone(), parker.clone());
        let spawned = std::thread::Builder::new()
            .name("mpath-checker".to_string())
            .spawn(move || run(&m, &s, &p));
        match spawned {
            Ok(handle) => {
                self.ever_ran.store(true, Ordering::Release);
                *running = Some(Running {
                    stop,
                    parker,
                    handle,
                });
            }
            Err(e) => tracing::error!(error = %e, "multipath checker thread could not start"),
        }
    }

    /// Stop the thread and wait for it (unless this is that thread, when a
    /// completion it drove dropped the table).
    pub(super) fn stop(&self) {
        let Some(r) = self.running.lock().take() else {
            return;
        };
        r.stop.store(true, Ordering::Release);
        r.parker.unpark();
        if r.handle.thread().id() != std::thread::current().id() {
            let _ = r.handle.join();
        }
    }

    /// The `checker_interval MS` message: 0 stops the checker.
    pub(super) fn set_interval(&self, m: &Weak<Multipath>, ms: u32) {
        self.interval_ms.store(ms, Ordering::Release);
        if ms == 0 {
            self.stop();
            return;
        }
        if let Some(r) = &*self.running.lock() {
            r.parker.unpark();
            return;
        }
        self.start(m);
    }

    /// Whether `path_stats` lines carry the checker's counters.
    pub(super) fn shown(&self) -> bool {
        self.ever_ran.load(Ordering::Acquire)
    }

    /// ` <probes> <ok> <fail> <reinstated>` for `path_stats`.
    pub(super) fn path_stats_columns(&self, path: usize) -> String {
        let c = &self.slots[path];
        format!(
            " {} {} {} {}",
            c.probes.load(Ordering::Relaxed),
            c.ok.load(Ordering::Relaxed),
            c.fail.load(Ordering::Relaxed),
            c.reinstated.load(Ordering::Relaxed)
        )
    }

    /// The `checker` message's answer.
    pub(super) fn report(&self, paths: &[PgPath]) -> String {
        let interval = self.interval_ms.load(Ordering::Acquire);
        let mut s = format!(
            "interval_ms {interval} timeout_ms {} no_path_retry {} running {}\n",
            self.timeout_ns(interval) / NS_PER_MS,
            self.no_path_retry
                .map(NoPathRetry::table_word)
                .unwrap_or_else(|| "none".to_string()),
            self.running.lock().is_some() as u32
        );
        for (c, p) in self.slots.iter().zip(paths) {
            let _ = writeln!(
                s,
                "{} {} probes {} ok {} fail {} reinstated {} failed {}",
                p.dev,
                p.state_word(),
                c.probes.load(Ordering::Relaxed),
                c.ok.load(Ordering::Relaxed),
                c.fail.load(Ordering::Relaxed),
                c.reinstated.load(Ordering::Relaxed),
                c.failed.load(Ordering::Relaxed)
            );
        }
        s
    }

    /// One tick: count down `no_path_retry`, then probe every path.
    fn tick(&self, m: &Arc<Multipath>) {
        self.count_no_path(m);
        for (slot, p) in self.slots.iter().zip(&m.paths) {
            slot.issue(p);
        }
    }

    /// multipathd's `no_path_retry` countdown, one step per tick.
    fn count_no_path(&self, m: &Arc<Multipath>) {
        let Some(NoPathRetry::Count(n)) = self.no_path_retry else {
            return;
        };
        if m.nr_valid_paths.load(Ordering::Acquire) > 0 {
            self.no_path_ticks.store(0, Ordering::Release);
            if self.retry_expired.swap(false, Ordering::AcqRel) {
                tracing::info!("multipath checker: a path is back, queueing again");
                m.set_queue_if_no_path(true, false);
            }
            return;
        }
        if !m.queue_if_no_path.load(Ordering::Acquire) {
            return;
        }
        // The first tick that sees no path may come just after the last
        // path failed; N more make at least N whole intervals.
        let seen = self.no_path_ticks.fetch_add(1, Ordering::AcqRel);
        if seen >= n {
            tracing::warn!(
                intervals = n,
                "multipath checker: no path for no_path_retry intervals, failing queued I/O"
            );
            self.retry_expired.store(true, Ordering::Release);
            self.no_path_ticks.store(0, Ordering::Release);
            m.set_queue_if_no_path(false, false);
        }
    }

    /// Count timed-out probes and return the earliest pending deadline.
    fn expire(&self, m: &Multipath, now: u64, timeout_ns: u64) -> Option<u64> {
        for slot in &self.slots {
            slot.expire(m, now, timeout_ns);
        }
        self.slots
            .iter()
            .filter_map(|s| s.deadline(timeout_ns))
            .min()
    }
}

impl Multipath {
    /// The `checker` message (the report) and `checker_interval MS` (0
    /// stops the checker, unless `no_path_retry N` counts its intervals; a
    /// new interval takes effect at once).
    pub(super) fn checker_message(&self, args: &[&str]) -> Result<String, TargetError> {
        let verb = args[0];
        if verb.eq_ignore_ascii_case("checker") {
            if args.len() != 1 {
                return Err(TargetError::invalid(format!(
                    "invalid multipath message arguments: 'checker' expects 1 argument(s), got {}",
                    args.len()
                )));
            }
            return Ok(self.checker.report(&self.paths));
        }
        let [_, ms] = args else {
            return Err(TargetError::invalid(format!(
                "invalid multipath message arguments: 'checker_interval' expects 2 argument(s) (checker_interval MS), got {}",
                args.len()
            )));
        };
        let ms = if ms.parse::<u32>() == Ok(0) {
            0
        } else {
            parse_ms("checker_interval", ms)?
        };
        if let (0, Some(NoPathRetry::Count(n))) = (ms, self.checker.no_path_retry) {
            // The table would no longer parse back: a count needs a checker.
            return Err(TargetError::invalid(format!(
                "checker_interval 0: the table's 'no_path_retry {n}' counts checker intervals, so the checker cannot stop; reload the table without it"
            )));
        }
        self.checker.set_interval(&self.me, ms);
        Ok(String::new())
    }
}

/// The checker thread: tick every interval, wake earlier for a probe's
/// deadline or when the interval changes or the checker stops.
fn run(m: &Weak<Multipath>, stop: &AtomicBool, parker: &Parker) {
    let mut last_tick: Option<u64> = None;
    loop {
        let seen = parker.seen();
        if stop.load(Ordering::Acquire) {
            return;
        }
        let Some(mp) = m.upgrade() else {
            return;
        };
        let c = &mp.checker;
        let interval_ms = c.interval_ms.load(Ordering::Acquire);
        if interval_ms == 0 {
            return;
        }
        let interval_ns = u64::from(interval_ms) * NS_PER_MS;
        let timeout_ns = c.timeout_ns(interval_ms);
        let now = now_ns();
        if last_tick.is_none_or(|t| now >= t + interval_ns) {
            last_tick = Some(now);
            c.tick(&mp);
        }
        let next_tick = last_tick.map_or(now, |t| t + interval_ns);
        let wake = c
            .expire(&mp, now_ns(), timeout_ns)
            .map_or(next_tick, |d| d.min(next_tick));
        drop(mp);
        parker.park(seen, Some(wake));
    }
}
