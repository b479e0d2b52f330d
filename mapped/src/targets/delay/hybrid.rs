//! The hybrid flush (default), the maintainer's reply to the kthread
//! change carried to its end: sleep for long delays, poll for short ones,
//! chosen per bio. A worker sleeps on a CLOCK_MONOTONIC timerfd
//! ([`DeadlineTimer`]) armed for an absolute time a margin before the
//! earliest deadline, then spins (at most `spin_us`) to reach it exactly,
//! so a long delay costs one sleep and a short spin, never a long poll.
//! The margin is learnt per worker ([`WakeMargin`]): the `wake_pct`-th
//! percentile of its last 64 wakes' lateness, so it fits the machine's
//! timer latency as load changes. Bios due within one spin window of each
//! other go out in one pass with no sleep between them; before spinning on
//! after a pass the worker yields once, so the submitters it just woke on
//! its CPU resubmit first. A submitter arms the timer for its bio only
//! while the worker sleeps (an awake worker looks at the heap before it
//! sleeps), so the worker wakes once per deadline, never just to learn of
//! a bio.
//!
//! Completion affinity (`affinity=cpu`, default) follows blk-mq's
//! `rq_affinity`/`QUEUE_FLAG_SAME_COMP`: each CPU that submits gets its
//! own worker (started on its first bio), pinned to it, with its own heap
//! and timer. A submitter blocked waiting for its bio is usually asleep on
//! that CPU, so the completion wakes it locally instead of by an
//! interrupt to another, halted, CPU, which on a virtual machine costs
//! both sides far more (`lab delay` measures both). `affinity=none` keeps
//! one unpinned worker, which suits a submitter that polls for
//! completions on its own CPU.
//!
//! A submitter with an event loop may claim the held bios and send them
//! on itself (`reaper.rs`); while a claim lives the workers only back it
//! up, whatever the affinity.

use super::held::{pop_due, Held};
use super::{Flusher, Shared, WORKER_SLICE_NS};
use crate::error::TargetError;
use blkstack_core::clock;
use blkstack_core::timing::{self, DeadlineTimer, WakeMargin, WakeMarginConfig};
use parking_lot::Mutex;
use std::collections::BinaryHeap;
use std::ops::{Index, IndexMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Per-CPU workers exist for CPUs below this number; submitters on
/// higher-numbered CPUs share the unpinned worker.
const MAX_CPUS: usize = 1024;
/// Before the first sleeps have been measured, assume this wake latency.
const INITIAL_MARGIN_NS: u64 = 50_000;

pub(super) struct HybridFlusher(pub(super) Arc<Hybrid>);

pub(super) struct Hybrid {
    pub(super) sh: Arc<Shared>,
    /// The held bios of each worker, indexed like `shards`, and the
    /// claims on them.
    pub(super) lanes: Mutex<Lanes>,
    /// The workers, one per CPU that has submitted (slot `cpu`), started
    /// on first use, plus the unpinned one (last slot) that serves
    /// `affinity=none` and any CPU whose worker cannot start.
    pub(super) shards: Box<[OnceLock<Arc<Shard>>]>,
    /// Queue a bio to the worker of the CPU it was submitted on
    /// (`affinity=cpu`), else to the unpinned one.
    affinity: bool,
    /// The percentile of observed wake lateness the sleep margin covers.
    wake_pct: u32,
    /// The spin bound, and so the largest margin.
    spin_max_ns: u64,
    /// Serialises starting a CPU's worker.
    spawn_lock: Mutex<()>,
    /// Timed wakes, the sum of their lateness, and time spent spinning.
    wakes: AtomicU64,
    wake_late_ns: AtomicU64,
    spin_ns: AtomicU64,
    /// Claims on the held bios, and the timer their holders poll.
    pub(super) claim: ClaimState,
}

/// Every worker's queue, and the claims on them (`reaper.rs`).
pub(super) struct Lanes {
    lane: Vec<Lane>,
    /// The slots whose worker has started: the only lanes that hold bios.
    pub(super) used: Vec<usize>,
    /// Live claims: while any, the workers only back the claimants up.
    pub(super) claims: usize,
    /// When the claimants' timer fires (`u64::MAX`: not armed).
    pub(super) claim_armed_ns: u64,
}

impl Index<usize> for Lanes {
    type Output = Lane;
    fn index(&self, i: usize) -> &Lane {
        &self.lane[i]
    }
}

impl IndexMut<usize> for Lanes {
    fn index_mut(&mut self, i: usize) -> &mut Lane {
        &mut self.lane[i]
    }
}

/// One worker's queue.
pub(super) struct Lane {
    pub(super) heap: BinaryHeap<Held>,
    /// When its timerfd is armed to fire (`u64::MAX`: not).
    pub(super) armed_ns: u64,
    /// The worker is running (not blocked on its timer) and will look at
    /// the heap again before it sleeps, so a submitter need not arm the
    /// timer: at high queue depth that saves a timer reprogramming per bio.
    pub(super) awake: bool,
}

impl Lane {
    fn new() -> Lane {
        // An empty heap allocates nothing, so a lane per possible CPU
        // costs nothing until that CPU submits.
        Lane {
            heap: BinaryHeap::new(),
            armed_ns: u64::MAX,
            awake: true,
        }
    }
}

/// A worker: pinned to the CPU its bios were submitted on (or unpinned),
/// with its own timer and learnt margin.
pub(super) struct Shard {
    /// Its index in `shards` and `lanes`.
    pub(super) idx: usize,
    /// The CPU it runs on, `None` for the unpinned worker.
    cpu: Option<usize>,
    /// Its sleep, armed by submitters and by the worker itself (and, while
    /// claimed, by claimants: `reaper.rs`).
    pub(super) timer: DeadlineTimer,
    /// How far short of a deadline to sleep: learnt from the worker's
    /// own wake lateness.
    margin_ns: AtomicU64,
    /// The earliest deadline queued, so that a spinning worker sees a bio
    /// that arrived during its spin with an even earlier deadline.
    head_ns: AtomicU64,
}

impl HybridFlusher {
    /// Slots for every CPU the machine can have plus the unpinned one,
    /// whose worker starts now; the per-CPU ones start on first use.
    pub fn start(
        sh: &Arc<Shared>,
        spin_max_ns: u64,
        affinity: bool,
        wake_pct: u32,
        reap_backstop_ns: u64,
    ) -> Result<HybridFlusher, TargetError> {
        // SAFETY: plain call.
        let cpus = usize::try_from(unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) })
            .unwrap_or(1)
            .clamp(1, MAX_CPUS);
        let slots = cpus + 1;
        let h = Arc::new(Hybrid {
            sh: sh.clone(),
            lanes: Mutex::new(Lanes {
                lane: (0..slots).map(|_| Lane::new()).collect(),
                used: Vec::new(),
                claims: 0,
                claim_armed_ns: u64::MAX,
            }),
            shards: (0..slots).map(|_| OnceLock::new()).collect(),
            affinity,
            wake_pct,
            spin_max_ns,
            spawn_lock: Mutex::new(()),
            wakes: AtomicU64::new(0),
            wake_late_ns: AtomicU64::new(0),
            spin_ns: AtomicU64::new(0),
            claim: ClaimState::new(reap_backstop_ns),
        });
        h.start_shard(slots - 1).ok_or_else(|| {
            TargetError::invalid("cannot start the delay worker or create its timer (timerfd)")
        })?;
        Ok(HybridFlusher(h))
    }
}

impl Hybrid {
    /// The worker that takes a bio submitted now: the one pinned to this
    /// CPU (started on first use), else the unpinned one.
    fn shard_for_submitter(self: &Arc<Self>) -> usize {
        let unpinned = self.shards.len() - 1;
        if self.affinity {
            if let Some(cpu) = blkstack_core::affinity::current_cpu() {
                if cpu < unpinned
                    && (self.shards[cpu].get().is_some() || self.start_shard(cpu).is_some())
                {
                    return cpu;
                }
            }
        }
        unpinned
    }

    /// Start the worker of slot `idx` (pinned to CPU `idx` unless it is
    /// the unpinned slot). `None` if its timer or thread cannot be made;
    /// the caller then uses the unpinned worker.
    fn start_shard(self: &Arc<Self>, idx: usize) -> Option<Arc<Shard>> {
        let _g = self.spawn_lock.lock();
        if let Some(s) = self.shards[idx].get() {
            return Some(s.clone());
        }
        if self.sh.stop.load(Ordering::Acquire) {
            return None;
        }
        let cpu = (idx + 1 < self.shards.len()).then_some(idx);
        let shard = Arc::new(Shard {
            idx,
            cpu,
            timer: DeadlineTimer::new().ok()?,
            margin_ns: AtomicU64::new(INITIAL_MARGIN_NS.min(self.spin_max_ns)),
            head_ns: AtomicU64::new(u64::MAX),
        });
        let name = match cpu {
            Some(c) => format!("dly{c}-{}", self.sh.name),
            None => format!("dly-{}", self.sh.name),
        };
        let (h, sd) = (self.clone(), shard.clone());
        self.sh.spawn(name, move || h.run(&sd)).ok()?;
        let _ = self.shards[idx].set(shard.clone());
        // Before any bio can land in its lane (the caller queues only
        // once this returns).
        self.lanes.lock().used.push(idx);
        Some(shard)
    }

    /// Count a timed wake and learn the margin from its lateness.
    fn record_wake(&self, shard: &Shard, lat: &mut WakeMargin, late_ns: u64) {
        self.wakes.fetch_add(1, Ordering::Relaxed);
        self.wake_late_ns.fetch_add(late_ns, Ordering::Relaxed);
        if let Some(m) = lat.record(late_ns) {
            shard.margin_ns.store(m, Ordering::Relaxed);
        }
    }

    /// One worker, serving the bios of one lane.
    fn run(&self, shard: &Shard) {
        timing::prepare_precise_worker(WORKER_SLICE_NS);
        if let Some(cpu) = shard.cpu {
            blkstack_core::affinity::pin_current_thread(cpu);
        }
        // The margin covers the `wake_pct`-th percentile of the last 64
        // wakes' lateness, recomputed every 8 wakes, never more than the
        // spin bound.
        let mut lat = WakeMargin::new(WakeMarginConfig {
            percentile: self.wake_pct,
            window: 64,
            every: 8,
            initial_ns: INITIAL_MARGIN_NS,
            cap_ns: self.spin_max_ns,
            prefill: false,
        });
        let sh = &self.sh;
        let mut batch: Vec<Held> = Vec::with_capacity(64);
        let mut slept = false;
        // Bios went out since the last spin: their submitters may be runnable.
        let mut sent = false;
        while !sh.stop.load(Ordering::Acquire) {
            let mut lanes = self.lanes.lock();
            let claimed = lanes.claims > 0;
            let lane = &mut lanes[shard.idx];
            lane.awake = true;
            let now = clock::now_ns();
            if lane.armed_ns <= now {
                // The timer fired (a one-shot is disarmed by then); if this
                // thread was asleep on it, that is a wake-latency sample.
                if slept {
                    self.record_wake(shard, &mut lat, now - lane.armed_ns);
                }
                lane.armed_ns = u64::MAX;
            }
            slept = false;
            if claimed {
                // A claimant sends the bios on: only back it up.
                slept = self.stand_aside(shard, lanes, &mut batch);
                continue;
            }
            pop_due(sh, &mut lane.heap, now, |d| d, &mut batch);
            let head = lane.heap.peek().map(|h| h.key);
            shard
                .head_ns
                .store(head.unwrap_or(u64::MAX), Ordering::Release);
            if !batch.is_empty() {
                if head.is_none() {
                    // Nothing left: a submitter woken by these completions
                    // (which may run before this thread looks again) arms
                    // the timer for its new bio itself, as dm-delay's
                    // submitter does, rather than this worker on its behalf.
                    lane.awake = false;
                }
                drop(lanes);
                sh.send_expired_batch(&mut batch);
                sent = true;
                continue;
            }
            let Some(deadline) = head else {
                lane.awake = false;
                drop(lanes);
                // Idle until a submitter arms the timer for its bio: that
                // wake is the one sleep most bios cost, so it is measured too.
                shard.timer.wait();
                slept = true;
                continue;
            };
            let left = deadline.saturating_sub(clock::now_ns());
            if left <= self.spin_max_ns {
                drop(lanes);
                self.spin_to_head(shard, std::mem::take(&mut sent));
                continue;
            }
            // Sleep short of the deadline by the learnt margin, so that the
            // wake lands in the spin window ahead of it.
            let wake_at = deadline - shard.margin_ns.load(Ordering::Relaxed);
            if wake_at < lane.armed_ns {
                shard.timer.arm(wake_at);
                lane.armed_ns = wake_at;
            }
            lane.awake = false;
            sent = false;
            drop(lanes);
            shard.timer.wait();
            slept = true;
        }
    }

    /// The last stretch: spin to the earliest deadline (a bio that arrives
    /// meanwhile with an earlier one lowers `head_ns`). The caller then
    /// sends on everything due and keeps spinning while the next deadline
    /// is this close: bios due within one spin window go out in one pass,
    /// with no sleep, and no wake-up, between them. A spin lasts at most
    /// `spin_us`, so nothing sharing this CPU waits longer than that;
    /// yielding instead would hand the CPU to any runnable task for a whole
    /// slice and miss the deadline by far more.
    fn spin_to_head(&self, shard: &Shard, sent: bool) {
        // The submitters just woken are most likely on this CPU (that is
        // what the pinning is for): let them take their completions and
        // resubmit before spinning, rather than after.
        if sent {
            // SAFETY: plain syscall.
            unsafe { libc::sched_yield() };
        }
        let spin_start = clock::now_ns();
        let mut t = spin_start;
        while t < shard.head_ns.load(Ordering::Acquire) && !self.sh.stop.load(Ordering::Relaxed) {
            std::hint::spin_loop();
            t = clock::now_ns();
        }
        self.spin_ns.fetch_add(t - spin_start, Ordering::Relaxed);
    }
}

impl Flusher for HybridFlusher {
    fn queue_for_submitter(&self) -> usize {
        self.0.shard_for_submitter()
    }

    fn hold(&self, queue: usize, held: Held) {
        let h = &self.0;
        let deadline_ns = held.deadline_ns;
        let mut lanes = h.lanes.lock();
        lanes[queue].heap.push(held);
        // The constructor starts the unpinned worker, so a shard exists;
        // were it missing, the bio would wait for teardown, not be lost.
        let Some(shard) = h.shards[queue].get() else {
            return;
        };
        if lanes.claims > 0 {
            return h.hold_claimed(&mut lanes, shard, deadline_ns);
        }
        let lane = &mut lanes[queue];
        shard.head_ns.fetch_min(deadline_ns, Ordering::AcqRel);
        // Arm the worker's timer for this bio if it sleeps and would wake
        // later; the worker itself need not wake now.
        let wake_at = deadline_ns.saturating_sub(shard.margin_ns.load(Ordering::Relaxed));
        if !lane.awake && wake_at < lane.armed_ns {
            shard.timer.arm(wake_at);
            lane.armed_ns = wake_at;
        }
    }

    fn take_all(&self) -> Vec<Held> {
        let mut all = Vec::new();
        for lane in self.0.lanes.lock().lane.iter_mut() {
            all.extend(std::mem::take(&mut lane.heap).into_vec());
        }
        all
    }

    fn wake_for_stop(&self) {
        for s in self.0.shards.iter().filter_map(OnceLock::get) {
            s.timer.arm(1);
        }
    }

    fn reaper(&self) -> Option<Box<dyn blkstack_core::Reaper>> {
        self.0.claim()
    }

    /// `wakes=` timed wakes, `wake_late_mean_ns=` how late they were,
    /// `spin_ns_per_io=`, and `margins_ns=` each worker's current sleep
    /// margin (`cpuN:NS`, `any:NS` for the unpinned one).
    fn stats_words(&self, sent: u64) -> String {
        let h = &self.0;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let per = |x: u64, n: u64| x.checked_div(n).unwrap_or(0);
        let wakes = get(&h.wakes);
        let margins: Vec<String> = h
            .shards
            .iter()
            .filter_map(OnceLock::get)
            .map(|s| {
                let m = s.margin_ns.load(Ordering::Relaxed);
                match s.cpu {
                    Some(c) => format!("cpu{c}:{m}"),
                    None => format!("any:{m}"),
                }
            })
            .collect();
        format!(
            " wakes={wakes} wake_late_mean_ns={} spin_ns_per_io={} margins_ns={}{}",
            per(get(&h.wake_late_ns), wakes),
            per(get(&h.spin_ns), sent),
            margins.join(","),
            h.claim.stats_words()
        )
    }
}

/// What the hybrid flush keeps for its claimants (`reaper.rs` claims,
/// reaps and arms it).
pub(super) struct ClaimState {
    /// How late past its deadline a claimed bio may go unreaped before a
    /// worker sends it on.
    pub(super) backstop_ns: u64,
    /// The timer claimants poll, made at the first claim.
    pub(super) timer: OnceLock<DeadlineTimer>,
    /// Bios sent on by claimants.
    pub(super) reaped: AtomicU64,
    /// Bios sent on by a worker while claimed (left unreaped too long).
    pub(super) backstopped: AtomicU64,
}

impl ClaimState {
    pub(super) fn new(backstop_ns: u64) -> ClaimState {
        ClaimState {
            backstop_ns,
            timer: OnceLock::new(),
            reaped: AtomicU64::new(0),
            backstopped: AtomicU64::new(0),
        }
    }

    /// `reaped=` bios claimants sent on, `backstop=` bios the workers
    /// sent on while claimed.
    pub(super) fn stats_words(&self) -> String {
        format!(
            " reaped={} backstop={}",
            self.reaped.load(Ordering::Relaxed),
            self.backstopped.load(Ordering::Relaxed)
        )
    }
}
