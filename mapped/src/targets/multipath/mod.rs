//! `multipath`: several paths to the same storage, used through a path
//! selector, failed over on path errors (kernel drivers/md/dm-mpath.c,
//! bio-based).
//!
//! Table grammar, as dm-mpath's constructor (parsed in `ctr`, one
//! function per piece as dm-mpath.c's parse_features, parse_hw_handler,
//! parse_priority_group and parse_path):
//!
//! ```text
//! <#features> [feature]... <#hw_handler args> [hw_handler [arg]...]
//! <#priority groups> <initial group>
//!   [<selector> <#selector args> [arg]... <#paths> <#per-path args>
//!      [<path> [arg]...]... ]...
//! ```
//!
//! Features: `queue_if_no_path`, `pg_init_retries N` (1..=50),
//! `pg_init_delay_msecs N` (0..=60000), `retain_attached_hw_handler`,
//! `queue_mode bio|rq|mq` (rq and mq are one mode, as in current kernels;
//! `bio` implies `retain_attached_hw_handler`), and blkstack's own
//! `start_time ns|jiffies:HZ|tick:HZ`: the start time path selectors are
//! given in `end_io` (see [`start_time`]); and multipathd's settings for
//! the built-in path checker (see `checker.rs`): `checker_interval MS`
//! (1..=3600000; absent, no checker), `checker_timeout MS` (default: the
//! interval) and `no_path_retry N|queue|fail` (N needs the checker; N and
//! `queue` imply `queue_if_no_path`, `fail` contradicts it). Only
//! non-default values are printed back by `table`, so tables without them
//! are dmsetup-identical. There are no SCSI device handlers
//! here: as on the kernel's non-SCSI devices, a request-based table whose
//! hardware handler would attach to a path is refused, a bio-based one
//! ignores it, and `pg_init_*` are kept only for the table. Multipath is
//! a singleton target (alone in its table), as in dm.
//!
//! I/O: choose a group and path as `choose_pgpath` does (a switch request
//! first, then the current group, then every group in order, bypassed
//! groups last), tell the selector, push a completion frame and send the
//! bio to the path. A path error (`Status::is_path_error`) fails the path
//! and resubmits the bio, its offset restored by the frame, to another
//! path. With no usable path a bio is queued if `queue_if_no_path` is set
//! (until a path is reinstated or `fail_if_no_path` arrives), else it ends
//! with EIO. With a checker, failed paths that answer its probe are
//! reinstated by it, and active paths whose probe fails are failed before
//! user I/O meets them (a path failed by `fail_path` comes back too, as
//! under multipathd). The queue and the path-state changes share one
//! mutex, the kernel's `m->lock`; the per-I/O path choice only reads
//! atomics and the selector's own lock.
//!
//! Per-I/O state fits the frame's one word: the path index in the top 16
//! bits, the submission time's low 48 bits of nanoseconds (78 hours)
//! below; the full time is rebuilt at completion relative to the clock,
//! and only then turned into the start time the selector is given (which,
//! for `jiffies`, may lie far from the clock or even after it).
//!
//! Messages: `queue_if_no_path`, `fail_if_no_path`, `disable_group N`,
//! `enable_group N`, `switch_group N`, `fail_path DEV`,
//! `reinstate_path DEV`, and blkstack's `path_stats`, which answers one
//! line per path, `<dev> <ios> <bytes>`: I/Os and bytes that path has
//! completed (any status) since the table was loaded, for measuring how a
//! selector spreads load; once a checker has run on the table each line
//! goes on with `<probes> <ok> <fail> <reinstated>`. `checker` answers the
//! interval, timeout and `no_path_retry`, then per path its state and
//! counters; `checker_interval MS` changes the interval (0 stops the
//! checker, refused while `no_path_retry N` counts its intervals). `status` and
//! `table` print what dm-mpath's `multipath_status` prints for
//! STATUSTYPE_INFO and STATUSTYPE_TABLE: the checker changes no field of
//! `status`, so dmsetup-style parsers keep working.

mod checker;
mod ctr;
pub mod start_time;

use crate::error::TargetError;
use crate::selectors::{PathSelector, SelectorType, StatusType};
use crate::target::{DevArg, Target, TargetType, DM_MAJOR};
use blkstack_core::clock::now_ns;
use blkstack_core::{Bio, BioFlags, EndIo, Features, Status};
use checker::{Checker, CheckerConfig};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

pub use start_time::StartTime;

/// The `multipath` target type (kernel `dm-mpath.c`'s `multipath_target`).
pub const TYPE: TargetType = TargetType {
    name: "multipath",
    version: [1, 14, 0],
    ctr: ctr::ctr,
};

/// "No group" / "no path" in the atomics below.
const NONE: usize = usize::MAX;
/// The per-I/O word holds the path index in 16 bits.
const MAX_PATHS: usize = 1 << 16;
const START_BITS: u32 = 48;
const START_MASK: u64 = (1 << START_BITS) - 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QueueMode {
    /// `rq` or `mq`: request-based in the kernel; the default.
    Request,
    Bio,
}

struct PgPath {
    dev: DevArg,
    /// Owning group and index inside its selector.
    pg: usize,
    index: usize,
    /// Changed only under `Multipath::lock`.
    active: AtomicBool,
    fail_count: AtomicU32,
    /// Completions on this path, for `path_stats`.
    ios: AtomicU64,
    bytes: AtomicU64,
}

impl PgPath {
    /// `A` (active) or `F` (failed), as dm-mpath's status prints it.
    fn state_word(&self) -> &'static str {
        if self.active.load(Ordering::Acquire) {
            "A"
        } else {
            "F"
        }
    }
}

struct PriorityGroup {
    ps_type: &'static SelectorType,
    ps: Box<dyn PathSelector>,
    /// Global indices of this group's paths, in table order.
    paths: Vec<usize>,
    bypassed: AtomicBool,
}

struct Config {
    queue_mode: QueueMode,
    pg_init_retries: u32,
    pg_init_delay_msecs: Option<u32>,
    retain_attached_hw_handler: bool,
    /// A request-based table's hardware handler name (kept only by a table
    /// without paths, see `ctr::parse_hw_handler`).
    hw_handler: Option<String>,
    start_time: StartTime,
    /// `checker_interval`, `checker_timeout`, `no_path_retry`.
    checker: CheckerConfig,
}

/// Kernel `struct multipath`, shared between the target and its frames.
pub struct Multipath {
    cfg: Config,
    groups: Vec<PriorityGroup>,
    paths: Vec<PgPath>,
    nr_valid_paths: AtomicUsize,
    current_pg: AtomicUsize,
    next_pg: AtomicUsize,
    current_pgpath: AtomicUsize,
    /// MPATHF_QUEUE_IO: set until the first group switch.
    queue_io: AtomicBool,
    queue_if_no_path: AtomicBool,
    saved_queue_if_no_path: AtomicBool,
    pg_init_count: AtomicU32,
    /// Between postsuspend and resume messages are refused, as dm does.
    suspended: AtomicBool,
    /// `m->lock` and `m->queued_bios`.
    lock: Mutex<VecDeque<Bio>>,
    /// The path checker (stopped unless the table or a message asks).
    checker: Checker,
    /// This multipath itself, for resubmitting from `end_io` (which only
    /// gets `&self`).
    me: Weak<Multipath>,
}

/// A built `multipath` target: its priority groups, paths and path
/// selectors (kernel `struct multipath`).
pub struct MultipathTarget {
    m: Arc<Multipath>,
}

impl Multipath {
    /// A multipath as the constructor describes it: every path usable,
    /// no group chosen yet, `initial` (1-based, 0 for none) to switch to
    /// first.
    fn new(
        cfg: Config,
        groups: Vec<PriorityGroup>,
        paths: Vec<PgPath>,
        initial: u32,
        queue_if_no_path: bool,
    ) -> Arc<Multipath> {
        let nr_valid = paths.len();
        let next_pg = if initial == 0 {
            NONE
        } else {
            initial as usize - 1
        };
        Arc::new_cyclic(|me| Multipath {
            checker: Checker::new(cfg.checker, me, &paths),
            cfg,
            groups,
            paths,
            nr_valid_paths: AtomicUsize::new(nr_valid),
            current_pg: AtomicUsize::new(NONE),
            next_pg: AtomicUsize::new(next_pg),
            current_pgpath: AtomicUsize::new(NONE),
            queue_io: AtomicBool::new(true),
            queue_if_no_path: AtomicBool::new(queue_if_no_path),
            saved_queue_if_no_path: AtomicBool::new(queue_if_no_path),
            pg_init_count: AtomicU32::new(0),
            suspended: AtomicBool::new(false),
            lock: Mutex::new(VecDeque::new()),
            me: me.clone(),
        })
    }
}

fn pack(path: usize, submitted_ns: u64) -> u64 {
    ((path as u64) << START_BITS) | (submitted_ns & START_MASK)
}

/// The path index and the full submission time from a frame's word.
fn unpack(private: u64, now: u64) -> (usize, u64) {
    let path = (private >> START_BITS) as usize;
    let low = private & START_MASK;
    let age = (now & START_MASK).wrapping_sub(low) & START_MASK;
    (path, now.wrapping_sub(age))
}

impl Multipath {
    fn load_opt(a: &AtomicUsize) -> Option<usize> {
        match a.load(Ordering::Acquire) {
            NONE => None,
            v => Some(v),
        }
    }

    /// Kernel `__switch_pg` (no hardware handler: nothing to initialise).
    fn switch_pg(&self, pg: usize) {
        self.current_pg.store(pg, Ordering::Release);
        self.queue_io.store(false, Ordering::Release);
        self.pg_init_count.store(0, Ordering::Relaxed);
    }

    /// Kernel `choose_path_in_pg`.
    fn choose_path_in_pg(&self, pg: usize, nr_bytes: u64) -> Option<usize> {
        let g = &self.groups[pg];
        let idx = g.ps.select_path(nr_bytes)?;
        let path = g.paths[idx];
        if self.current_pg.load(Ordering::Acquire) != pg {
            let _g = self.lock.lock();
            self.current_pgpath.store(path, Ordering::Release);
            self.switch_pg(pg);
        }
        Some(path)
    }

    /// Kernel `choose_pgpath`: a requested switch first, then the current
    /// group, then every group in order skipping bypassed ones, then the
    /// bypassed ones.
    fn choose_pgpath(&self, nr_bytes: u64) -> Option<usize> {
        if self.nr_valid_paths.load(Ordering::Acquire) == 0 {
            self.queue_io.store(false, Ordering::Release);
        } else {
            if Self::load_opt(&self.next_pg).is_some() {
                let pg = {
                    let _g = self.lock.lock();
                    self.next_pg.swap(NONE, Ordering::AcqRel)
                };
                if pg != NONE {
                    if let Some(p) = self.choose_path_in_pg(pg, nr_bytes) {
                        return Some(p);
                    }
                }
            }
            if let Some(pg) = Self::load_opt(&self.current_pg) {
                if let Some(p) = self.choose_path_in_pg(pg, nr_bytes) {
                    return Some(p);
                }
            }
            for want_bypassed in [false, true] {
                for pg in 0..self.groups.len() {
                    if self.groups[pg].bypassed.load(Ordering::Acquire) != want_bypassed {
                        continue;
                    }
                    if let Some(p) = self.choose_path_in_pg(pg, nr_bytes) {
                        return Some(p);
                    }
                }
            }
        }
        let _g = self.lock.lock();
        self.current_pgpath.store(NONE, Ordering::Release);
        self.current_pg.store(NONE, Ordering::Release);
        None
    }

    /// Map a bio (target-relative offset) onto a path, queue it, or fail
    /// it. Also the resubmission after a path error and for queued bios.
    fn map_bio(self: &Arc<Self>, mut bio: Bio) {
        loop {
            let nr_bytes = bio.len;
            let queue_io = self.queue_io.load(Ordering::Acquire);
            let mut path = Self::load_opt(&self.current_pgpath);
            if path.is_none() || !queue_io {
                path = self.choose_pgpath(nr_bytes);
            }
            // dm-mpath's `__map_bio` tests MPATHF_QUEUE_IO again after
            // `choose_pgpath`, whose group switch clears it when there is
            // no hardware handler: a first bio is not queued for pg_init.
            let queue_io = self.queue_io.load(Ordering::Acquire);
            if path.is_some() && queue_io && self.cfg.queue_mode == QueueMode::Bio {
                // Bio-based dm-mpath queues this bio and runs pg_init on
                // the group; without a hardware handler that completes at
                // once (SCSI_DH_NOSYS is success) and the bio is mapped
                // again. The only trace is the counter in `status`.
                self.pg_init_count.fetch_add(1, Ordering::Relaxed);
                self.queue_io.store(false, Ordering::Release);
            }
            let Some(path) = path else {
                match self.queue_or_fail(bio) {
                    Some(b) => {
                        bio = b;
                        continue;
                    }
                    None => return,
                }
            };
            let p = &self.paths[path];
            let g = &self.groups[p.pg];
            // The submission time; the selector's view of it is derived at
            // completion (StartTime::at), like dm reading io->start_time.
            let submitted = if g.ps.needs_start_time() { now_ns() } else { 0 };
            g.ps.start_io(p.index, nr_bytes);
            bio.flags.insert(BioFlags::FAILFAST);
            bio.push_end(self.clone(), pack(path, submitted));
            p.dev.dev.submit(bio);
            return;
        }
    }

    /// No usable path: queue the bio (`queue_if_no_path`) or end it with
    /// EIO. Decided under the lock that reinstatement takes, so a bio is
    /// never queued after the queue was last drained. Gives the bio back
    /// if a path became usable meanwhile.
    fn queue_or_fail(&self, bio: Bio) -> Option<Bio> {
        let mut q = self.lock.lock();
        if self.nr_valid_paths.load(Ordering::Acquire) > 0 {
            return Some(bio);
        }
        if self.queue_if_no_path.load(Ordering::Acquire) {
            q.push_back(bio);
            return None;
        }
        drop(q);
        bio.complete(Status::IoError);
        None
    }

    /// Resubmit every queued bio (kernel `process_queued_bios`).
    fn process_queued(self: &Arc<Self>) {
        let bios = std::mem::take(&mut *self.lock.lock());
        for bio in bios {
            self.map_bio(bio);
        }
    }

    /// Kernel `fail_path`. Returns whether the path was active.
    fn fail_path(&self, path: usize) -> bool {
        let _g = self.lock.lock();
        let p = &self.paths[path];
        if !p.active.load(Ordering::Acquire) {
            return false;
        }
        self.groups[p.pg].ps.fail_path(p.index);
        p.active.store(false, Ordering::Release);
        p.fail_count.fetch_add(1, Ordering::Relaxed);
        self.nr_valid_paths.fetch_sub(1, Ordering::AcqRel);
        if self.current_pgpath.load(Ordering::Acquire) == path {
            self.current_pgpath.store(NONE, Ordering::Release);
        }
        true
    }

    /// Kernel `reinstate_path`: the first usable path releases the queue.
    /// Returns whether the path was failed.
    fn reinstate_path(self: &Arc<Self>, path: usize) -> bool {
        let run_queue = {
            let _g = self.lock.lock();
            let p = &self.paths[path];
            if p.active.load(Ordering::Acquire) {
                return false;
            }
            self.groups[p.pg].ps.reinstate_path(p.index);
            p.active.store(true, Ordering::Release);
            let n = self.nr_valid_paths.fetch_add(1, Ordering::AcqRel) + 1;
            if n == 1 {
                self.current_pgpath.store(NONE, Ordering::Release);
            }
            n == 1
        };
        if run_queue {
            self.process_queued();
        }
        true
    }

    /// Kernel `queue_if_no_path(m, queue, save_old_value)`.
    fn set_queue_if_no_path(self: &Arc<Self>, queue: bool, save_old_value: bool) {
        {
            let _g = self.lock.lock();
            let saved = if save_old_value {
                self.queue_if_no_path.load(Ordering::Acquire)
            } else {
                queue
            };
            self.saved_queue_if_no_path.store(saved, Ordering::Release);
            self.queue_if_no_path.store(queue, Ordering::Release);
        }
        if !queue {
            self.process_queued();
        }
    }

    /// Kernel `bypass_pg`.
    fn bypass_pg(&self, pg: usize, bypassed: bool) {
        let _g = self.lock.lock();
        self.groups[pg].bypassed.store(bypassed, Ordering::Release);
        self.current_pgpath.store(NONE, Ordering::Release);
        self.current_pg.store(NONE, Ordering::Release);
    }

    /// Kernel `switch_pg_num`.
    fn switch_pg_num(&self, pg: usize) {
        let _g = self.lock.lock();
        for g in &self.groups {
            g.bypassed.store(false, Ordering::Release);
        }
        self.current_pgpath.store(NONE, Ordering::Release);
        self.current_pg.store(NONE, Ordering::Release);
        self.next_pg.store(pg, Ordering::Release);
    }

    fn parse_pg_num(&self, verb: &str, s: &str) -> Result<usize, TargetError> {
        let n: usize = crate::target::parse_sscanf(verb, s).map_err(|_| {
            TargetError::invalid(format!("{verb}: invalid priority group number '{s}'"))
        })?;
        if n == 0 || n > self.groups.len() {
            return Err(TargetError::invalid(format!(
                "{verb}: invalid priority group number {n}: groups are numbered 1..={}",
                self.groups.len()
            )));
        }
        Ok(n - 1)
    }

    /// The paths a message's device argument names: the registry name,
    /// `/dev/mapper/NAME` or `MAJOR:MINOR`.
    fn paths_named(&self, arg: &str) -> Vec<usize> {
        let name = arg.strip_prefix("/dev/mapper/").unwrap_or(arg);
        (0..self.paths.len())
            .filter(|&i| {
                let d = &self.paths[i].dev;
                d.name == name || format!("{DM_MAJOR}:{}", d.minor) == arg
            })
            .collect()
    }

    /// The `path_stats` answer: `<dev> <ios> <bytes>` per path, then, once
    /// a checker has run on this table, `<probes> <ok> <fail> <reinstated>`.
    fn path_stats(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let checker = self.checker.shown();
        for (i, p) in self.paths.iter().enumerate() {
            let _ = write!(
                s,
                "{} {} {}",
                p.dev,
                p.ios.load(Ordering::Relaxed),
                p.bytes.load(Ordering::Relaxed)
            );
            if checker {
                s.push_str(&self.checker.path_stats_columns(i));
            }
            s.push('\n');
        }
        s
    }

    /// dm-mpath `multipath_status`.
    fn status_text(&self, ty: StatusType) -> String {
        use std::fmt::Write;
        let _g = self.lock.lock();
        let mut s = String::new();
        match ty {
            StatusType::Info => {
                let _ = write!(
                    s,
                    "2 {} {} ",
                    self.queue_io.load(Ordering::Acquire) as u32,
                    self.pg_init_count.load(Ordering::Relaxed)
                );
            }
            StatusType::Table => {
                let c = &self.cfg;
                let qifnp = self.queue_if_no_path.load(Ordering::Acquire);
                let n = qifnp as u32
                    + (c.pg_init_retries > 0) as u32 * 2
                    + c.pg_init_delay_msecs.is_some() as u32 * 2
                    + c.retain_attached_hw_handler as u32
                    + (c.queue_mode != QueueMode::Request) as u32 * 2
                    + (c.start_time != StartTime::Ns) as u32 * 2
                    + self.checker.feature_words().len() as u32;
                let _ = write!(s, "{n} ");
                if qifnp {
                    s.push_str("queue_if_no_path ");
                }
                if c.pg_init_retries > 0 {
                    let _ = write!(s, "pg_init_retries {} ", c.pg_init_retries);
                }
                if let Some(d) = c.pg_init_delay_msecs {
                    let _ = write!(s, "pg_init_delay_msecs {d} ");
                }
                if c.retain_attached_hw_handler {
                    s.push_str("retain_attached_hw_handler ");
                }
                if c.queue_mode == QueueMode::Bio {
                    s.push_str("queue_mode bio ");
                }
                if c.start_time != StartTime::Ns {
                    let _ = write!(s, "start_time {} ", c.start_time.table_word());
                }
                for w in self.checker.feature_words() {
                    let _ = write!(s, "{w} ");
                }
            }
        }
        match (&self.cfg.hw_handler, ty) {
            (Some(h), StatusType::Table) => {
                let _ = write!(s, "1 {h} ");
            }
            _ => s.push_str("0 "),
        }
        let pg_num = Self::load_opt(&self.next_pg)
            .or_else(|| Self::load_opt(&self.current_pg))
            .map(|g| g + 1)
            .unwrap_or(if self.groups.is_empty() { 0 } else { 1 });
        let _ = write!(s, "{} {pg_num} ", self.groups.len());
        let current = Self::load_opt(&self.current_pg);
        for (gi, g) in self.groups.iter().enumerate() {
            match ty {
                StatusType::Info => {
                    let state = if g.bypassed.load(Ordering::Acquire) {
                        'D'
                    } else if current == Some(gi) {
                        'A'
                    } else {
                        'E'
                    };
                    let _ = write!(s, "{state} ");
                    s.push_str(&g.ps.status(None, ty));
                    let _ = write!(s, "{} {} ", g.paths.len(), g.ps_type.info_args);
                    for &pi in &g.paths {
                        let p = &self.paths[pi];
                        let _ = write!(
                            s,
                            "{} {} {} ",
                            p.dev,
                            p.state_word(),
                            p.fail_count.load(Ordering::Relaxed)
                        );
                        s.push_str(&g.ps.status(Some(p.index), ty));
                    }
                }
                StatusType::Table => {
                    let _ = write!(s, "{} ", g.ps_type.name);
                    s.push_str(&g.ps.status(None, ty));
                    let _ = write!(s, "{} {} ", g.paths.len(), g.ps_type.table_args);
                    for &pi in &g.paths {
                        let p = &self.paths[pi];
                        let _ = write!(s, "{} ", p.dev);
                        s.push_str(&g.ps.status(Some(p.index), ty));
                    }
                }
            }
        }
        s
    }
}

impl EndIo for Multipath {
    /// Kernel `multipath_end_io_bio`.
    fn end_io(&self, bio: Bio, status: Status, private: u64) {
        let path = (private >> START_BITS) as usize;
        let Some(p) = self.paths.get(path) else {
            debug_assert!(
                false,
                "multipath frame names path {path} of {}",
                self.paths.len()
            );
            bio.complete(status);
            return;
        };
        p.ios.fetch_add(1, Ordering::Relaxed);
        p.bytes.fetch_add(bio.len, Ordering::Relaxed);
        let retry = !status.is_ok() && status.is_path_error();
        if retry {
            self.fail_path(path);
        }
        let ps = &self.groups[p.pg].ps;
        let start = if ps.needs_start_time() {
            self.cfg.start_time.at(unpack(private, now_ns()).1)
        } else {
            0
        };
        ps.end_io(p.index, bio.len, start);
        if !retry {
            bio.complete(status);
            return;
        }
        // Another path, the queue, or EIO: the same decision as a new bio.
        match self.me.upgrade() {
            Some(me) => me.map_bio(bio),
            None => bio.complete(Status::IoError),
        }
    }
}

impl MultipathTarget {
    /// The target over `m`, its checker started if the table asks for one.
    fn new(m: Arc<Multipath>) -> MultipathTarget {
        m.checker.start(&m.me);
        MultipathTarget { m }
    }
}

/// The table is gone: its checker goes with it, even while bios in flight
/// (which hold the multipath) keep the rest alive.
impl Drop for MultipathTarget {
    fn drop(&mut self) {
        self.m.checker.stop();
    }
}

impl Target for MultipathTarget {
    fn map(&self, bio: Bio) {
        self.m.map_bio(bio);
    }

    fn status(&self) -> String {
        self.m.status_text(StatusType::Info)
    }

    fn table(&self) -> String {
        self.m.status_text(StatusType::Table)
    }

    /// Kernel `multipath_message`.
    fn message(&self, args: &[&str]) -> Result<String, TargetError> {
        let m = &self.m;
        if m.suspended.load(Ordering::Acquire) {
            return Err(TargetError::invalid(
                "device is suspended (EBUSY): resume it first",
            ));
        }
        let verb = args.first().copied().unwrap_or("");
        let is = |s: &str| verb.eq_ignore_ascii_case(s);
        if args.len() == 1 && is("path_stats") {
            return Ok(m.path_stats());
        }
        if is("checker") || is("checker_interval") {
            return m.checker_message(args);
        }
        if args.len() == 1 {
            if is("queue_if_no_path") {
                m.set_queue_if_no_path(true, false);
                return Ok(String::new());
            }
            if is("fail_if_no_path") {
                m.set_queue_if_no_path(false, false);
                return Ok(String::new());
            }
        }
        let known = [
            "queue_if_no_path",
            "fail_if_no_path",
            "disable_group",
            "enable_group",
            "switch_group",
            "fail_path",
            "reinstate_path",
            "path_stats",
            "checker",
            "checker_interval",
        ];
        if !known.iter().any(|k| is(k)) {
            return Err(TargetError::invalid(format!(
                "unrecognised multipath message '{verb}' (known: {})",
                known.join(", ")
            )));
        }
        if args.len() != 2 {
            return Err(TargetError::invalid(format!(
                "invalid multipath message arguments: '{verb}' expects {} argument(s), got {}",
                if is("queue_if_no_path") || is("fail_if_no_path") || is("path_stats") {
                    1
                } else {
                    2
                },
                args.len()
            )));
        }
        let arg = args[1];
        if is("disable_group") {
            m.bypass_pg(m.parse_pg_num(verb, arg)?, true);
        } else if is("enable_group") {
            m.bypass_pg(m.parse_pg_num(verb, arg)?, false);
        } else if is("switch_group") {
            m.switch_pg_num(m.parse_pg_num(verb, arg)?);
        } else {
            let paths = m.paths_named(arg);
            if paths.is_empty() {
                return Err(TargetError::invalid(format!(
                    "{verb}: device '{arg}' is not a path of this multipath"
                )));
            }
            for p in paths {
                if is("fail_path") {
                    m.fail_path(p);
                } else {
                    m.reinstate_path(p);
                }
            }
        }
        Ok(String::new())
    }

    /// Suspend cannot finish while bios wait for a path: stop queueing and
    /// fail what waits (kernel `multipath_presuspend`). The checker stops
    /// first, so it cannot reinstate a path (and release the queue) while
    /// the device drains.
    fn presuspend(&self) {
        self.m.checker.stop();
        self.m.set_queue_if_no_path(false, true);
    }

    fn postsuspend(&self) {
        self.m.suspended.store(true, Ordering::Release);
    }

    /// Restore `queue_if_no_path` as it was before suspend.
    fn resume(&self) {
        let m = &self.m;
        let _g = m.lock.lock();
        m.queue_if_no_path.store(
            m.saved_queue_if_no_path.load(Ordering::Acquire),
            Ordering::Release,
        );
        m.suspended.store(false, Ordering::Release);
        drop(_g);
        m.checker.start(&m.me);
    }

    fn features(&self) -> Features {
        let mut it = self.m.paths.iter().map(|p| p.dev.dev.features());
        let first = it.next().unwrap_or_default();
        let mut f = it.fold(first, Features::intersect);
        // Which path answers an extent query is not fixed.
        f.knows_holes = false;
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_word_round_trips_path_and_start() {
        let now = 5_000_000_123_456_789u64;
        for (path, age) in [(0usize, 0u64), (7, 1), (65534, 3_600_000_000_000)] {
            let start = now - age;
            let w = pack(path, start);
            assert_eq!(unpack(w, now), (path, start));
        }
    }
}
