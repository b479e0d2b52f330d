//! The request queue: bios in, driver calls out, completions back (kernel
//! `block/blk-mq.c`: `blk_mq_submit_bio`, `blk_mq_run_hw_queue`,
//! `blk_mq_dispatch_rq_list`, `blk_mq_end_request`).
//!
//! Submission: pick the submitting thread's hardware queue, take a tag
//! (sleeping if none is free), store the bio in the tag's slot, and issue
//! directly to the driver unless requests are already waiting on the
//! dispatch list. A driver that says busy gets the request back on the
//! dispatch list's head and the queue's restart bit set; the next
//! completion runs the queue again.
//!
//! Queue runs are inline (on the caller's thread) or posted to kblockd,
//! optionally delayed. With `run_dedup` (default, seed 001) a zero-delay
//! post is skipped while one is pending (`BLK_MQ_S_WORK_QUEUED`), and a
//! delayed post clears the bit so it never stands in for an immediate run;
//! without it every asynchronous run pays the pool's lock, as before the
//! seed. `run_on_completion` runs every hardware queue asynchronously on
//! each completion, as SCSI's `scsi_end_request` did in the seed.
//!
//! Completion follows null_blk's `irqmode`: inline in whoever issued the
//! request (0), on a per-hardware-queue completion thread (1, "softirq"),
//! or on that thread after `completion_nsec` measured from issue with a
//! precise absolute sleep (2, "timer"). With `iopoll`, timer-mode requests
//! whose bio is `POLLED` wait on a poll list instead, for the submitter's
//! own [`Queue::poll`] to end them once due (kernel poll queues and
//! io_uring IOPOLL), with the completion thread as a backstop.
//!
//! The hot path allocates nothing: tags index preallocated slots, the
//! dispatch list and completion queues keep their capacity, and every lock
//! taken per I/O is per hardware queue (none is global).

use crate::hwqueue::{HctxStats, HwQueue};
use crate::kblockd::{DelayedWork, Kblockd};
use crate::sbitmap::{SbqStats, WakeWeight, WakeupAlgo, MAX_DEPTH};
use crate::tags::{Tags, TagsConfig};
use blkstack_core::clock::{now_ns, set_thread_timer_slack_ns, sleep_until_ns};
use blkstack_core::cpu::thread_cpu_ns;
use blkstack_core::{Bio, BioFlags, Status};
use parking_lot::Mutex;
use std::cell::Cell;
use std::collections::VecDeque;
use std::mem::MaybeUninit;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::JoinHandle;

/// Where a request the driver finished is completed (null_blk `irqmode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CompletionMode {
    /// 0: at once, on the thread that issued it.
    Inline,
    /// 1: on the hardware queue's completion thread.
    Softirq,
    /// 2: on the completion thread, `nsec` after issue.
    Timer { nsec: u64 },
}

impl CompletionMode {
    /// null_blk's `irqmode` number.
    pub fn irqmode(self) -> u32 {
        match self {
            CompletionMode::Inline => 0,
            CompletionMode::Softirq => 1,
            CompletionMode::Timer { .. } => 2,
        }
    }
}

/// Largest number of hardware queues.
pub const MAX_HW_QUEUES: u32 = 256;
/// Kernel `BLK_MQ_RESOURCE_DELAY`: retry a busy queue with nothing in
/// flight after 3 ms.
pub const RESOURCE_DELAY_NS: u64 = 3_000_000;

/// A polled request (timer mode) nobody has polled for this long past its
/// deadline is completed by the completion thread instead, so a submitter
/// that stops polling never leaves it behind.
pub const POLL_BACKSTOP_NS: u64 = 1_000_000;
/// How often an idle completion thread looks for such requests.
const POLL_BACKSTOP_CHECK: std::time::Duration = std::time::Duration::from_millis(10);
/// Largest `timer_spin_max_ns`: a spin is only meant to cover a late wake.
pub const MAX_TIMER_SPIN_NS: u64 = 1_000_000;

/// How often a shared tag set checks for hardware queues gone idle (the
/// kernel's check rides on its request timeout work; what matters is that
/// an idle queue's share returns to the others within a fraction of a
/// second).
pub const IDLE_CHECK_NS: u64 = 100_000_000;

/// Options of a queue (the engine-level knobs a leaf driver exposes as
/// `key=value` table args).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineOptions {
    /// Hardware queues (`submit_queues`), 1..=256.
    pub hw_queues: u32,
    /// Tags per hardware queue, or in total when shared (`hw_queue_depth`).
    pub queue_depth: u32,
    /// Of which reserved.
    pub reserved_tags: u32,
    /// One tag set shared by all hardware queues.
    pub shared_tags: bool,
    /// With `shared_tags`: a fair share of it per active hardware queue
    /// (see `tags`).
    pub tag_fair_share: bool,
    /// The driver may sleep in `queue_rq`: queue runs always go to kblockd.
    pub blocking: bool,
    pub completion: CompletionMode,
    pub tag_wakeup: WakeupAlgo,
    /// What a woken tag sleeper counts for (`WakeWeight`).
    pub tag_wake_weight: WakeWeight,
    /// Seed 001's queued bit (true) or post every time (false).
    pub run_dedup: bool,
    /// Run all hardware queues asynchronously on every completion.
    pub run_on_completion: bool,
    /// Tags in order (`BLK_MQ_F_TAG_RR`).
    pub round_robin_tags: bool,
    /// See `SbitmapQueue::with_rescue_timeout_ns` (0: never).
    pub rescue_timeout_ns: u64,
    /// Which process-wide kblockd pool posted queue runs go to.
    pub kblockd: KblockdKind,
    /// Timer mode only: submitters may poll for `POLLED` bios (see
    /// [`Queue::polls`]).
    pub iopoll: bool,
    /// Timer mode only: the most the completion thread spins before a
    /// deadline (0 = it only sleeps, as null_blk's hrtimer). See
    /// [`DeadlineClock`].
    pub timer_spin_max_ns: u64,
}

/// The kblockd pool a queue posts its runs to (see `kblockd`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KblockdKind {
    /// One worker bound to each CPU; a run goes to the poster's CPU, as
    /// the kernel's kblockd (a per-CPU workqueue) does.
    #[default]
    PerCpu,
    /// Two unbound workers, any of them woken for any post.
    Unbound,
}

impl KblockdKind {
    pub fn name(self) -> &'static str {
        match self {
            KblockdKind::PerCpu => "percpu",
            KblockdKind::Unbound => "unbound",
        }
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            hw_queues: 1,
            queue_depth: 64,
            reserved_tags: 0,
            shared_tags: false,
            tag_fair_share: false,
            blocking: false,
            completion: CompletionMode::Inline,
            tag_wakeup: WakeupAlgo::Counter,
            tag_wake_weight: WakeWeight::Plug,
            run_dedup: true,
            run_on_completion: false,
            round_robin_tags: false,
            rescue_timeout_ns: 0,
            kblockd: KblockdKind::PerCpu,
            iopoll: false,
            timer_spin_max_ns: 0,
        }
    }
}

impl EngineOptions {
    pub fn validate(&self) -> Result<(), String> {
        if self.hw_queues == 0 || self.hw_queues > MAX_HW_QUEUES {
            return Err(format!(
                "submit_queues={} is out of range 1..={MAX_HW_QUEUES}",
                self.hw_queues
            ));
        }
        if self.queue_depth == 0 || self.queue_depth > MAX_DEPTH {
            return Err(format!(
                "hw_queue_depth={} is out of range 1..={MAX_DEPTH}",
                self.queue_depth
            ));
        }
        if self.timer_spin_max_ns > MAX_TIMER_SPIN_NS {
            return Err(format!(
                "timer_spin_ns={} is out of range 0..={MAX_TIMER_SPIN_NS}",
                self.timer_spin_max_ns
            ));
        }
        if self.timer_spin_max_ns > 0 && !matches!(self.completion, CompletionMode::Timer { .. }) {
            return Err(
                "timer_spin_ns needs irqmode=2 (it times the timer completions)".to_string(),
            );
        }
        if self.iopoll && !matches!(self.completion, CompletionMode::Timer { .. }) {
            return Err(
                "iopoll=1 needs irqmode=2 (a timer completion the poller can reap)".to_string(),
            );
        }
        if self.reserved_tags >= self.queue_depth {
            return Err(format!(
                "reserved_tags={} must be below hw_queue_depth={}",
                self.reserved_tags, self.queue_depth
            ));
        }
        Ok(())
    }
}

/// What the driver did with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueRq {
    /// Finished with this status; the engine completes it per the
    /// completion mode.
    Done(Status),
    /// Accepted; the driver will call [`RequestCompleter::end_request`].
    Issued,
    /// Cannot take it now (kernel `BLK_STS_RESOURCE`): requeue.
    Busy,
}

/// A request as the driver sees it.
#[derive(Clone, Copy)]
pub struct Rq<'a> {
    pub tag: u32,
    pub hctx: u32,
    pub bio: &'a Bio,
}

/// A leaf driver under the engine (kernel `struct blk_mq_ops`).
pub trait Driver: Send + Sync + 'static {
    /// Start a request (kernel `queue_rq`).
    fn queue_rq(&self, rq: Rq<'_>) -> QueueRq;

    /// Finish a request in completion context (kernel `complete`); may
    /// change the status.
    fn complete(&self, _rq: Rq<'_>, status: Status) -> Status {
        status
    }

    /// Called once with a handle for completing [`QueueRq::Issued`]
    /// requests later.
    fn attach(&self, _completer: RequestCompleter) {}
}

/// Completes requests a driver accepted with [`QueueRq::Issued`].
#[derive(Clone)]
pub struct RequestCompleter {
    inner: Weak<dyn EndRequest>,
}

impl RequestCompleter {
    /// Complete the request `tag` of hardware queue `hctx` (kernel
    /// `blk_mq_complete_request`): goes through the completion mode.
    pub fn end_request(&self, hctx: u32, tag: u32, status: Status) {
        if let Some(q) = self.inner.upgrade() {
            q.finish(hctx, tag, status);
        }
    }
}

trait EndRequest: Send + Sync {
    fn finish(&self, hctx: u32, tag: u32, status: Status);
}

/// Everything an experiment reads about a queue.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Tags in use now, over all tag sets.
    pub tags_in_use: u32,
    /// Total tags over all tag sets.
    pub tags_total: u32,
    pub tags: SbqStats,
    pub hctx: HctxStats,
    /// Requests waiting on dispatch lists now.
    pub dispatch_waiting: u32,
    /// Requests accepted by the driver and not completed.
    pub in_driver: u32,
    /// Timer mode (irqmode=2): completions, and their summed lateness past
    /// the asked `completion_nsec`.
    pub timer_completions: u64,
    pub timer_late_ns: u64,
    /// Timer mode with `timer_spin_max_ns`: the completion threads' CPU
    /// time spent spinning towards deadlines (the emulated disk keeping
    /// time, which a real disk does without the host's CPU).
    pub timer_spin_cpu_ns: u64,
}

/// Per-hardware-queue completion thread state (irqmode 1 and 2).
struct Completer {
    /// Timer mode: completions done, and their total lateness past the
    /// deadline (how precise the timer is, wakeup latency included).
    timer_done: AtomicU64,
    timer_late_ns: AtomicU64,
    timer_spin_cpu_ns: AtomicU64,
    queue: Mutex<Vec<(u64, u32, Status)>>,
    /// Timer mode: requests whose bio is `POLLED`, in deadline order, for
    /// the submitter's poll to complete (see [`Queue::poll`]).
    polled: Mutex<VecDeque<(u64, u32, Status)>>,
    sleeping: AtomicBool,
    shutdown: AtomicBool,
    thread: OnceLock<std::thread::Thread>,
}

impl Completer {
    fn new(depth: usize) -> Completer {
        Completer {
            timer_done: AtomicU64::new(0),
            timer_late_ns: AtomicU64::new(0),
            timer_spin_cpu_ns: AtomicU64::new(0),
            queue: Mutex::new(Vec::with_capacity(depth)),
            polled: Mutex::new(VecDeque::with_capacity(depth)),
            sleeping: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            thread: OnceLock::new(),
        }
    }

    #[inline]
    fn push(&self, deadline: u64, tag: u32, status: Status) {
        self.queue.lock().push((deadline, tag, status));
        if self.sleeping.load(SeqCst) {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
    }

    fn wake(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }
}

struct QueueInner<D: Driver> {
    driver: D,
    opts: EngineOptions,
    hctxs: Box<[HwQueue]>,
    completers: Box<[Completer]>,
    kblockd: Arc<Kblockd>,
    /// Shared tag sets: the periodic idle check (kernel timeout work).
    idle_work: OnceLock<Arc<DelayedWork>>,
}

/// A blk-mq request queue over driver `D`.
pub struct Queue<D: Driver> {
    inner: Arc<QueueInner<D>>,
    threads: Vec<JoinHandle<()>>,
}

/// The submitting thread's hardware queue index (the kernel maps CPUs;
/// threads are numbered in the order they first submit).
#[inline]
fn thread_hctx(nr: usize) -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static ID: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    if nr == 1 {
        return 0;
    }
    ID.with(|c| {
        let mut v = c.get();
        if v == usize::MAX {
            v = NEXT.fetch_add(1, Relaxed);
            c.set(v);
        }
        v % nr
    })
}

impl<D: Driver> Queue<D> {
    /// Build a queue (and its completion threads) on the process-wide
    /// kblockd pool.
    pub fn new(driver: D, opts: EngineOptions) -> Result<Queue<D>, String> {
        let pool = match opts.kblockd {
            KblockdKind::PerCpu => Kblockd::global(),
            KblockdKind::Unbound => Kblockd::global_unbound(),
        };
        Self::with_kblockd(driver, opts, pool)
    }

    pub fn with_kblockd(
        driver: D,
        opts: EngineOptions,
        kblockd: Arc<Kblockd>,
    ) -> Result<Queue<D>, String> {
        opts.validate()?;
        let tags_cfg = TagsConfig {
            depth: opts.queue_depth,
            reserved: opts.reserved_tags,
            wakeup: opts.tag_wakeup,
            wake_weight: opts.tag_wake_weight,
            round_robin: opts.round_robin_tags,
            shared: opts.shared_tags && opts.hw_queues > 1,
            fair_share: opts.tag_fair_share,
            rescue_timeout_ns: opts.rescue_timeout_ns,
        };
        let shared = if tags_cfg.shared {
            Some(Arc::new(Tags::new(tags_cfg)?))
        } else {
            None
        };
        let mut hctxs = Vec::with_capacity(opts.hw_queues as usize);
        for i in 0..opts.hw_queues {
            let tags = match &shared {
                Some(t) => t.clone(),
                None => Arc::new(Tags::new(tags_cfg)?),
            };
            hctxs.push(HwQueue::new(i, tags));
        }
        let completers = (0..opts.hw_queues)
            .map(|_| Completer::new(opts.queue_depth as usize))
            .collect();
        let inner = Arc::new(QueueInner {
            driver,
            opts: opts.clone(),
            hctxs: hctxs.into_boxed_slice(),
            completers,
            kblockd,
            idle_work: OnceLock::new(),
        });
        if tags_cfg.shared && tags_cfg.fair_share {
            let weak = Arc::downgrade(&inner);
            let work = DelayedWork::new(move || {
                if let Some(q) = weak.upgrade() {
                    q.idle_sweep();
                }
            });
            let _ = inner.idle_work.set(work);
        }
        for h in inner.hctxs.iter() {
            let weak = Arc::downgrade(&inner);
            let idx = h.index as usize;
            let work = DelayedWork::new(move || {
                if let Some(q) = weak.upgrade() {
                    q.run_work_fn(&q.hctxs[idx]);
                }
            });
            let _ = h.run_work.set(work);
        }
        let dyn_inner: Arc<dyn EndRequest> = inner.clone();
        inner.driver.attach(RequestCompleter {
            inner: Arc::downgrade(&dyn_inner),
        });
        let mut threads = Vec::new();
        if opts.completion != CompletionMode::Inline {
            for i in 0..opts.hw_queues as usize {
                let q = inner.clone();
                let h = std::thread::Builder::new()
                    .name(format!("blkmq-cpl/{i}"))
                    .spawn(move || q.completion_thread(i))
                    .map_err(|e| format!("cannot start completion thread: {e}"))?;
                let _ = inner.completers[i].thread.set(h.thread().clone());
                threads.push(h);
            }
        }
        Ok(Queue { inner, threads })
    }

    pub fn options(&self) -> &EngineOptions {
        &self.inner.opts
    }

    /// Whether submitters may poll for their completions (kernel
    /// `BLK_FEAT_POLL`; option `iopoll`, timer mode only): a `POLLED` bio
    /// is then completed not by the timer thread but by [`Self::poll`] once
    /// its time has come, like a request on a poll queue that the
    /// submitter reaps itself (io_uring IOPOLL). Unlike null_blk's poll
    /// queues, which complete on the first poll, the service time is kept.
    pub fn polls(&self) -> bool {
        self.inner.opts.iopoll
    }

    /// Complete, on the calling thread, the polled requests whose deadline
    /// has passed (kernel `blk_mq_poll`). Returns how many. A queue
    /// another thread is polling at the moment is skipped.
    pub fn poll(&self) -> usize {
        self.inner.poll_due(0)
    }

    pub fn driver(&self) -> &D {
        &self.inner.driver
    }

    pub fn hw_queues(&self) -> &[HwQueue] {
        &self.inner.hctxs
    }

    /// Submit a bio that the caller has already validated.
    #[inline]
    pub fn submit(&self, bio: Bio) {
        self.inner.submit(bio)
    }

    /// Submit several validated bios at once (a plug being flushed): tags
    /// are taken a word at a time, and requests the driver finishes
    /// inline are ended together, their tags freed with one atomic per
    /// bitmap word (kernel `blk_mq_get_tags`, `blk_mq_end_request_batch`).
    /// `bios` is left empty with its capacity.
    #[inline]
    pub fn submit_batch(&self, bios: &mut Vec<Bio>) {
        self.inner.submit_batch(bios)
    }

    /// Run hardware queue `i` (kernel `blk_mq_run_hw_queue`).
    pub fn run_hw_queue(&self, i: usize, async_run: bool) {
        self.inner.run_hw_queue(&self.inner.hctxs[i], async_run)
    }

    /// Run every hardware queue (kernel `blk_mq_run_hw_queues`).
    pub fn run_hw_queues(&self, async_run: bool) {
        self.inner.run_hw_queues(async_run)
    }

    /// Post a run of queue `i` after `delay_ns` (kernel
    /// `blk_mq_delay_run_hw_queue`).
    pub fn delay_run_hw_queue(&self, i: usize, delay_ns: u64) {
        self.inner.post_run(&self.inner.hctxs[i], delay_ns)
    }

    /// Kernel `blk_mq_stop_hw_queue`: no dispatch until started again.
    pub fn stop_hw_queue(&self, i: usize) {
        let h = &self.inner.hctxs[i];
        if let Some(w) = h.run_work.get() {
            self.inner.kblockd.cancel(w);
        }
        h.run.stop();
    }

    /// Kernel `blk_mq_start_hw_queue` + run.
    pub fn start_hw_queue(&self, i: usize, async_run: bool) {
        let h = &self.inner.hctxs[i];
        h.run.start();
        self.inner.run_hw_queue(h, async_run);
    }

    /// Counters summed over all hardware queues (tag sets counted once).
    pub fn stats(&self) -> QueueStats {
        let mut s = QueueStats::default();
        let mut seen: Vec<*const Tags> = Vec::new();
        for h in self.inner.hctxs.iter() {
            let p = Arc::as_ptr(&h.tags);
            if !seen.contains(&p) {
                seen.push(p);
                s.tags_in_use += h.tags.in_use();
                s.tags_total += h.tags.depth();
                let t = h.tags.stats();
                s.tags.waits += t.waits;
                s.tags.woken += t.woken;
                s.tags.wake_batches += t.wake_batches;
                s.tags.dropped_credits += t.dropped_credits;
                s.tags.rescued += t.rescued;
                s.tags.wasted_wakeups += t.wasted_wakeups;
            }
            let c = h.stats();
            s.hctx.runs_inline += c.runs_inline;
            s.hctx.runs_posted += c.runs_posted;
            s.hctx.runs_deduped += c.runs_deduped;
            s.hctx.runs_from_work += c.runs_from_work;
            s.hctx.requeues += c.requeues;
            s.hctx.dispatched_from_list += c.dispatched_from_list;
            s.hctx.restarts += c.restarts;
            s.hctx.runs_skipped_restart += c.runs_skipped_restart;
            let c = &self.inner.completers[h.index as usize];
            s.timer_completions += c.timer_done.load(Relaxed);
            s.timer_late_ns += c.timer_late_ns.load(Relaxed);
            s.timer_spin_cpu_ns += c.timer_spin_cpu_ns.load(Relaxed);
            s.dispatch_waiting += h.dispatch_len();
            s.in_driver += h.in_driver();
        }
        s
    }

    /// The engine part of a `dmsetup status` line.
    pub fn status(&self) -> String {
        let s = self.stats();
        format!(
            "tags={}/{} tag_waits={} tag_wakeups={} wake_batches={} dropped_credits={} \
             rescued={} wasted_wakeups={} runs_inline={} runs_posted={} runs_deduped={} requeues={} restarts={} \
             dispatch_waiting={} in_driver={}",
            s.tags_in_use,
            s.tags_total,
            s.tags.waits,
            s.tags.woken,
            s.tags.wake_batches,
            s.tags.dropped_credits,
            s.tags.rescued,
            s.tags.wasted_wakeups,
            s.hctx.runs_inline,
            s.hctx.runs_posted,
            s.hctx.runs_deduped,
            s.hctx.requeues,
            s.hctx.restarts,
            s.dispatch_waiting,
            s.in_driver
        ) + &timer_status(&s)
    }
}

impl<D: Driver> Drop for Queue<D> {
    fn drop(&mut self) {
        if let Some(w) = self.inner.idle_work.get() {
            self.inner.kblockd.cancel(w);
        }
        for h in self.inner.hctxs.iter() {
            if let Some(w) = h.run_work.get() {
                self.inner.kblockd.cancel(w);
            }
            h.tags.wake_all();
        }
        for c in self.inner.completers.iter() {
            c.shutdown.store(true, SeqCst);
            c.wake();
        }
        let me = std::thread::current().id();
        for t in self.threads.drain(..) {
            // The last owner may drop the device from a completion callback
            // running on one of these threads: that one exits by itself.
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}

impl<D: Driver> EndRequest for QueueInner<D> {
    fn finish(&self, hctx: u32, tag: u32, status: Status) {
        self.finish_request(
            &self.hctxs[hctx as usize],
            tag,
            status,
            now_ns_if_timer(self.opts.completion),
        );
    }
}

impl<D: Driver> QueueInner<D> {
    #[inline]
    fn submit(&self, bio: Bio) {
        self.submit_want(bio, 1)
    }

    /// [`Self::submit`] for the first of `want` bios the caller submits in
    /// a row (its plug): what a tag sleep declares to the wakeup.
    #[inline]
    fn submit_want(&self, bio: Bio, want: u32) {
        let h = &self.hctxs[thread_hctx(self.hctxs.len())];
        let was_inactive = h.tags.has_fair_share() && !h.tag_state.is_active();
        let tag = h.tags.get(&h.tag_state, false, &h.wait_index, want, || {
            self.run_hw_queue(h, false)
        });
        if was_inactive {
            self.arm_idle_check();
        }
        h.tags.slot(tag).fill(bio, h.index);
        if h.has_pending() || h.is_stopped() {
            h.push_tail(tag);
            self.run_hw_queue(h, self.opts.blocking);
            return;
        }
        self.issue(h, tag);
    }

    /// Kernel `blk_mq_submit_bio` for a plugged list, with batched tag
    /// allocation and completion. Tag sets with a fair share take the
    /// one-by-one path (each tag must pass the fair-share check, and the
    /// kernel does not batch them either); so does a bio for which no word has free tags,
    /// after ending what this batch finished (its tags may be the ones the
    /// allocation would wait for).
    fn submit_batch(&self, bios: &mut Vec<Bio>) {
        let h = &self.hctxs[thread_hctx(self.hctxs.len())];
        if h.tags.has_fair_share() {
            let mut left = bios.len() as u32;
            for bio in bios.drain(..) {
                self.submit_want(bio, left);
                left -= 1;
            }
            return;
        }
        let mut finished = Finished::new();
        let mut left = bios.len();
        let (mut mask, mut offset) = (0u64, 0u32);
        for bio in bios.drain(..) {
            if mask == 0 {
                match h.tags.get_batch(left.min(Tags::MAX_BATCH) as u32) {
                    Some((m, o)) => (mask, offset) = (m, o),
                    None => {
                        self.end_requests(h, &mut finished);
                        self.submit_want(bio, left as u32);
                        left -= 1;
                        continue;
                    }
                }
            }
            let tag = offset + mask.trailing_zeros();
            mask &= mask - 1;
            left -= 1;
            h.tags.slot(tag).fill(bio, h.index);
            if h.has_pending() || h.is_stopped() {
                h.push_tail(tag);
                self.run_hw_queue(h, self.opts.blocking);
                continue;
            }
            self.issue_to(h, tag, Some(&mut finished));
            if finished.len == Tags::MAX_BATCH {
                self.end_requests(h, &mut finished);
            }
        }
        debug_assert_eq!(mask, 0, "more tags taken than bios");
        self.end_requests(h, &mut finished);
    }

    /// Hand one request to the driver. Returns false if it was busy (the
    /// request is then back on the dispatch list's head).
    #[inline]
    fn issue(&self, h: &HwQueue, tag: u32) -> bool {
        self.issue_to(h, tag, None)
    }

    /// [`Self::issue`]; with `finished`, a request the driver ends inline in
    /// inline completion mode is collected there to be ended with the
    /// rest of its batch.
    #[inline]
    fn issue_to(&self, h: &HwQueue, tag: u32, finished: Option<&mut Finished>) -> bool {
        let issue_ns = now_ns_if_timer(self.opts.completion);
        h.run.enter_driver();
        let rq = Rq {
            tag,
            hctx: h.index,
            bio: h.tags.slot(tag).bio(),
        };
        match self.driver.queue_rq(rq) {
            QueueRq::Done(status) => {
                match finished {
                    Some(f) if self.opts.completion == CompletionMode::Inline => {
                        f.push(tag, status)
                    }
                    _ => self.finish_request(h, tag, status, issue_ns),
                }
                true
            }
            QueueRq::Issued => true,
            QueueRq::Busy => {
                h.counters.requeues.fetch_add(1, Relaxed);
                h.push_head(tag);
                // Nothing in flight will complete and restart us: retry
                // later, as the kernel does after BLK_STS_RESOURCE.
                if h.run.requeued_busy() {
                    self.post_run(h, RESOURCE_DELAY_NS);
                }
                false
            }
        }
    }

    /// Route a finished request through the completion mode.
    #[inline]
    fn finish_request(&self, h: &HwQueue, tag: u32, status: Status, issue_ns: u64) {
        match self.opts.completion {
            CompletionMode::Inline => self.end_request(h, tag, status),
            CompletionMode::Softirq => self.completers[h.index as usize].push(0, tag, status),
            CompletionMode::Timer { nsec } => {
                let c = &self.completers[h.index as usize];
                if self.opts.iopoll && h.tags.slot(tag).bio().flags.contains(BioFlags::POLLED) {
                    c.polled.lock().push_back((issue_ns + nsec, tag, status));
                } else {
                    c.push(issue_ns + nsec, tag, status)
                }
            }
        }
    }

    /// The real end of a request (kernel `blk_mq_end_request`): free the
    /// tag first, so that an owner who resubmits from its completion
    /// callback finds one, then complete the bio.
    #[inline]
    fn end_request(&self, h: &HwQueue, tag: u32, status: Status) {
        let slot = h.tags.slot(tag);
        let bio = slot.take();
        let owner = &self.hctxs[slot.hctx() as usize];
        let status = self.driver.complete(
            Rq {
                tag,
                hctx: owner.index,
                bio: &bio,
            },
            status,
        );
        owner.tags.put(&owner.tag_state, tag);
        if owner.run.left_driver(1) {
            owner.counters.restarts.fetch_add(1, Relaxed);
            self.run_hw_queue(owner, true);
        }
        if self.opts.run_on_completion {
            self.run_hw_queues(true);
        }
        bio.complete(status);
    }

    /// [`Self::end_request`] for every request in `f`, all of hardware
    /// queue `h`'s own (unshared) tags (kernel `blk_mq_end_request_batch`):
    /// bios out of their slots, the in-driver count dropped and the tags
    /// freed once for all, then the bios completed in issue order.
    fn end_requests(&self, h: &HwQueue, f: &mut Finished) {
        let n = f.len;
        if n == 0 {
            return;
        }
        f.len = 0;
        let mut bios: [MaybeUninit<Bio>; Tags::MAX_BATCH] =
            [const { MaybeUninit::uninit() }; Tags::MAX_BATCH];
        for (i, out) in bios.iter_mut().enumerate().take(n) {
            let tag = f.tags[i];
            let slot = h.tags.slot(tag);
            debug_assert_eq!(slot.hctx(), h.index, "batched tag of another queue");
            let bio = slot.take();
            f.status[i] = self.driver.complete(
                Rq {
                    tag,
                    hctx: h.index,
                    bio: &bio,
                },
                f.status[i],
            );
            out.write(bio);
        }
        h.tags.put_batch(&h.tag_state, &f.tags[..n]);
        if h.run.left_driver(n as u32) {
            h.counters.restarts.fetch_add(1, Relaxed);
            self.run_hw_queue(h, true);
        }
        if self.opts.run_on_completion {
            for _ in 0..n {
                self.run_hw_queues(true);
            }
        }
        for (bio, &status) in bios.iter().take(n).zip(&f.status[..n]) {
            // SAFETY: the first `n` entries were written above and each is
            // read out exactly once here.
            unsafe { bio.assume_init_read() }.complete(status);
        }
    }

    fn arm_idle_check(&self) {
        if let Some(w) = self.idle_work.get() {
            self.kblockd.post(w, IDLE_CHECK_NS);
        }
    }

    /// Let hardware queues that stopped issuing give up their share of a
    /// shared tag set; re-arms while any queue is still active.
    fn idle_sweep(&self) {
        let mut any_active = false;
        for h in self.hctxs.iter() {
            any_active |= h.tags.idle_check(&h.tag_state);
        }
        if any_active {
            self.arm_idle_check();
        }
    }

    fn run_hw_queues(&self, async_run: bool) {
        for h in self.hctxs.iter() {
            self.run_hw_queue(h, async_run);
        }
    }

    /// Kernel `blk_mq_run_hw_queue`: nothing to do without pending
    /// requests; inline unless asked (or the driver blocks). An inline run
    /// is skipped while the restart bit is set.
    #[inline]
    fn run_hw_queue(&self, h: &HwQueue, async_run: bool) {
        if !h.has_pending() || h.is_stopped() {
            return;
        }
        if async_run || self.opts.blocking {
            self.post_run(h, 0);
        } else if !h.run.inline_run_allowed() {
            h.counters.runs_skipped_restart.fetch_add(1, Relaxed);
        } else {
            h.counters.runs_inline.fetch_add(1, Relaxed);
            self.dispatch(h);
        }
    }

    /// Kernel `__blk_mq_delay_run_hw_queue`'s async half, with seed 001.
    fn post_run(&self, h: &HwQueue, delay_ns: u64) {
        if self.opts.run_dedup {
            if delay_ns == 0 {
                if !h.run.claim_immediate_post() {
                    h.counters.runs_deduped.fetch_add(1, Relaxed);
                    return;
                }
            } else {
                // A delayed run must not stand in for the next immediate
                // one (seed 001 v2).
                h.run.before_delayed_post();
            }
        }
        h.counters.runs_posted.fetch_add(1, Relaxed);
        if let Some(w) = h.run_work.get() {
            self.kblockd.post(w, delay_ns);
        }
    }

    /// Kernel `blk_mq_run_work_fn`.
    fn run_work_fn(&self, h: &HwQueue) {
        if !h.run.begin_work() {
            return;
        }
        h.counters.runs_from_work.fetch_add(1, Relaxed);
        self.dispatch(h);
    }

    /// Issue what waits on the dispatch list until it is empty or the
    /// driver is busy (kernel `blk_mq_dispatch_rq_list`).
    fn dispatch(&self, h: &HwQueue) {
        while !h.is_stopped() {
            let Some(tag) = h.pop() else { break };
            h.counters.dispatched_from_list.fetch_add(1, Relaxed);
            if !self.issue(h, tag) {
                break;
            }
        }
    }

    /// End the polled requests due at least `grace_ns` ago, a few at a
    /// time so the list's lock is not held while requests end.
    fn poll_due(&self, grace_ns: u64) -> usize {
        const CHUNK: usize = 32;
        let mut done = 0;
        for (c, h) in self.completers.iter().zip(self.hctxs.iter()) {
            loop {
                let mut due = [(0u32, Status::Ok); CHUNK];
                let (mut n, mut late) = (0, 0u64);
                let now = now_ns();
                {
                    let Some(mut list) = c.polled.try_lock() else {
                        break;
                    };
                    while n < CHUNK {
                        match list.front() {
                            Some(&(deadline, tag, status))
                                if deadline.saturating_add(grace_ns) <= now =>
                            {
                                list.pop_front();
                                due[n] = (tag, status);
                                late += now - deadline;
                                n += 1;
                            }
                            _ => break,
                        }
                    }
                }
                if n > 0 {
                    c.timer_done.fetch_add(n as u64, Relaxed);
                    c.timer_late_ns.fetch_add(late, Relaxed);
                }
                for &(tag, status) in &due[..n] {
                    self.end_request(h, tag, status);
                }
                done += n;
                if n < CHUNK {
                    break;
                }
            }
        }
        done
    }

    /// At teardown: end every polled request of completer `i`, each no
    /// earlier than its deadline.
    fn drain_polled(&self, i: usize) {
        let (c, h) = (&self.completers[i], &self.hctxs[i]);
        loop {
            let Some((deadline, tag, status)) = c.polled.lock().pop_front() else {
                return;
            };
            if now_ns() < deadline {
                sleep_until_ns(deadline);
            }
            self.end_request(h, tag, status);
        }
    }

    fn completion_thread(&self, i: usize) {
        set_thread_timer_slack_ns(1);
        let c = &self.completers[i];
        let h = &self.hctxs[i];
        let polls = self.opts.iopoll;
        let mut clock = DeadlineClock::new(self.opts.timer_spin_max_ns);
        let mut local: Vec<(u64, u32, Status)> = Vec::with_capacity(self.opts.queue_depth as usize);
        loop {
            std::mem::swap(&mut *c.queue.lock(), &mut local);
            if local.is_empty() {
                if c.shutdown.load(SeqCst) {
                    self.drain_polled(i);
                    return;
                }
                c.sleeping.store(true, SeqCst);
                if c.queue.lock().is_empty() && !c.shutdown.load(SeqCst) {
                    if polls {
                        std::thread::park_timeout(POLL_BACKSTOP_CHECK);
                    } else {
                        std::thread::park();
                    }
                }
                c.sleeping.store(false, SeqCst);
                if polls {
                    self.poll_due(POLL_BACKSTOP_NS);
                }
                continue;
            }
            for &(deadline, tag, status) in local.iter() {
                if deadline != 0 {
                    clock.wait_until(deadline, &c.timer_spin_cpu_ns);
                    let late = now_ns().saturating_sub(deadline);
                    c.timer_done.fetch_add(1, Relaxed);
                    c.timer_late_ns.fetch_add(late, Relaxed);
                }
                self.end_request(h, tag, status);
            }
            local.clear();
        }
    }
}

/// Requests of one batch that the driver finished inline, waiting to be
/// ended together.
struct Finished {
    tags: [u32; Tags::MAX_BATCH],
    status: [Status; Tags::MAX_BATCH],
    len: usize,
}

impl Finished {
    fn new() -> Finished {
        Finished {
            tags: [0; Tags::MAX_BATCH],
            status: [Status::Ok; Tags::MAX_BATCH],
            len: 0,
        }
    }

    #[inline]
    fn push(&mut self, tag: u32, status: Status) {
        self.tags[self.len] = tag;
        self.status[self.len] = status;
        self.len += 1;
    }
}

fn timer_status(s: &QueueStats) -> String {
    if s.timer_completions == 0 {
        return String::new();
    }
    format!(
        " timer_late_avg_ns={} timer_spin_cpu_ns={}",
        s.timer_late_ns / s.timer_completions,
        s.timer_spin_cpu_ns
    )
}

/// How the timer-mode completion thread reaches a deadline.
///
/// null_blk arms an hrtimer, and on bare metal an idle CPU leaves its
/// C-state for it in a few µs. On this VM an idle vCPU halts and the host
/// wakes it 30-150 µs late (more when the host is busy), so a disk that
/// only sleeps completes later whenever the submitters let the vCPUs idle
/// (`interrupt`, `hybrid`) than when they spin (`poll`): the emulated
/// disk, not the wait, then decides the comparison (`lab hybrid-poll`,
/// `timer_late_avg_ns`). With a spin budget the thread models a disk whose
/// clock keeps running whatever the host does: it sleeps until a margin
/// before the deadline, the 90th percentile of how late its recent sleeps
/// woke (at most the budget), then spins the rest. The spin is bounded by
/// the deadline, so it never holds a vCPU longer than the budget, and its
/// CPU time is counted apart (`timer_spin_cpu_ns`) so that a measurement
/// can leave the disk's timekeeping out of the host's cost.
struct DeadlineClock {
    max_spin_ns: u64,
    margin_ns: u64,
    /// How late recent sleeps woke, newest at `next`.
    overshoot_ns: [u64; DeadlineClock::HISTORY],
    next: usize,
}

impl DeadlineClock {
    const HISTORY: usize = 32;

    fn new(max_spin_ns: u64) -> DeadlineClock {
        DeadlineClock {
            max_spin_ns,
            margin_ns: max_spin_ns,
            overshoot_ns: [max_spin_ns; Self::HISTORY],
            next: 0,
        }
    }

    fn wait_until(&mut self, deadline: u64, spin_cpu_ns: &AtomicU64) {
        let now = now_ns();
        if now >= deadline {
            return;
        }
        if self.max_spin_ns == 0 {
            sleep_until_ns(deadline);
            return;
        }
        if deadline - now > self.margin_ns {
            let target = deadline - self.margin_ns;
            sleep_until_ns(target);
            self.learn(now_ns().saturating_sub(target));
        }
        if now_ns() < deadline {
            let t0 = thread_cpu_ns();
            while now_ns() < deadline {
                std::hint::spin_loop();
            }
            spin_cpu_ns.fetch_add(thread_cpu_ns().saturating_sub(t0), Relaxed);
        }
    }

    fn learn(&mut self, overshoot_ns: u64) {
        self.overshoot_ns[self.next] = overshoot_ns;
        self.next = (self.next + 1) % Self::HISTORY;
        let mut sorted = self.overshoot_ns;
        sorted.sort_unstable();
        self.margin_ns = sorted[Self::HISTORY * 9 / 10].min(self.max_spin_ns);
    }
}

#[inline]
fn now_ns_if_timer(mode: CompletionMode) -> u64 {
    match mode {
        CompletionMode::Timer { .. } => now_ns(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkstack_core::{EndIo, IoBuf, Op};

    /// Busy while `refuse` is set; counts completions.
    #[derive(Default)]
    struct Gate {
        refuse: AtomicBool,
    }

    impl Driver for Gate {
        fn queue_rq(&self, _rq: Rq<'_>) -> QueueRq {
            if self.refuse.load(SeqCst) {
                QueueRq::Busy
            } else {
                QueueRq::Done(Status::Ok)
            }
        }
    }

    #[derive(Default)]
    struct Done(AtomicU64);

    impl EndIo for Done {
        fn end_io(&self, bio: Bio, _status: Status, _private: u64) {
            self.0.fetch_add(1, SeqCst);
            drop(bio);
        }
    }

    fn write_bio(owner: &Arc<Done>) -> Bio {
        Bio::new(Op::Write, 0, 0, IoBuf::empty(), owner.clone(), 0)
    }

    fn wait_done(d: &Done, n: u64, within_ns: u64) {
        let deadline = now_ns() + within_ns;
        while d.0.load(SeqCst) < n {
            assert!(now_ns() < deadline, "not completed in time");
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// A pool whose only worker is held until `release`, so posted runs
    /// stay pending while the test looks at them.
    fn held_pool() -> (Arc<Kblockd>, Arc<AtomicBool>) {
        let pool = Kblockd::new(1);
        let go = Arc::new(AtomicBool::new(false));
        let go2 = go.clone();
        let blocker = DelayedWork::new(move || {
            while !go2.load(SeqCst) {
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
        });
        pool.post(&blocker, 0);
        (pool, go)
    }

    fn release(go: &AtomicBool) {
        go.store(true, SeqCst);
    }

    #[test]
    fn queued_bit_dedups_immediate_runs_and_delayed_runs_never_stand_in() {
        let (pool, gate) = held_pool();
        let q =
            Queue::with_kblockd(Gate::default(), EngineOptions::default(), pool.clone()).unwrap();
        q.driver().refuse.store(true, SeqCst);
        let done = Arc::new(Done::default());
        q.submit(write_bio(&done));
        let h = &q.hw_queues()[0];
        assert_eq!(h.dispatch_len(), 1);
        // Busy with nothing in flight: a delayed (3 ms) run was posted and
        // the queued bit is clear.
        assert_eq!(h.stats().runs_posted, 1);
        assert!(!h.work_queued());
        q.run_hw_queue(0, true);
        assert!(h.work_queued());
        q.run_hw_queue(0, true);
        q.run_hw_queue(0, true);
        assert_eq!(h.stats().runs_posted, 2);
        assert_eq!(h.stats().runs_deduped, 2);
        // A delayed run clears the bit, so the next immediate one posts.
        q.delay_run_hw_queue(0, 5_000_000_000);
        assert!(!h.work_queued());
        q.run_hw_queue(0, true);
        assert_eq!(h.stats().runs_posted, 4);
        // ...and the pending work is not postponed by the 5 s delay.
        q.driver().refuse.store(false, SeqCst);
        let t0 = now_ns();
        release(&gate);
        wait_done(&done, 1, 2_000_000_000);
        assert!(now_ns() - t0 < 2_000_000_000);
        assert_eq!(q.stats().tags_in_use, 0);
        drop(q);
        pool.shutdown();
    }

    #[test]
    fn without_dedup_every_async_run_is_posted() {
        let (pool, gate) = held_pool();
        let opts = EngineOptions {
            run_dedup: false,
            ..EngineOptions::default()
        };
        let q = Queue::with_kblockd(Gate::default(), opts, pool.clone()).unwrap();
        q.driver().refuse.store(true, SeqCst);
        let done = Arc::new(Done::default());
        q.submit(write_bio(&done));
        for _ in 0..5 {
            q.run_hw_queue(0, true);
        }
        let s = q.hw_queues()[0].stats();
        assert_eq!(s.runs_posted, 6);
        assert_eq!(s.runs_deduped, 0);
        q.driver().refuse.store(false, SeqCst);
        release(&gate);
        wait_done(&done, 1, 2_000_000_000);
        drop(q);
        pool.shutdown();
    }

    #[test]
    fn stopped_queue_holds_requests_until_started() {
        let q = Queue::new(Gate::default(), EngineOptions::default()).unwrap();
        let done = Arc::new(Done::default());
        q.stop_hw_queue(0);
        q.submit(write_bio(&done));
        q.submit(write_bio(&done));
        assert_eq!(done.0.load(SeqCst), 0);
        assert_eq!(q.hw_queues()[0].dispatch_len(), 2);
        q.start_hw_queue(0, false);
        assert_eq!(done.0.load(SeqCst), 2);
        assert_eq!(q.stats().tags_in_use, 0);
    }

    #[test]
    fn blocking_driver_runs_only_from_kblockd() {
        let opts = EngineOptions {
            blocking: true,
            ..EngineOptions::default()
        };
        let q = Queue::new(Gate::default(), opts).unwrap();
        let done = Arc::new(Done::default());
        q.stop_hw_queue(0);
        q.submit(write_bio(&done));
        q.start_hw_queue(0, false);
        wait_done(&done, 1, 2_000_000_000);
        let s = q.hw_queues()[0].stats();
        assert_eq!(s.runs_inline, 0);
        assert!(s.runs_from_work >= 1);
    }

    #[test]
    fn queue_dropped_from_its_own_completion_thread() {
        struct DropOnEnd {
            q: Mutex<Option<Arc<Queue<Gate>>>>,
            done: AtomicBool,
        }
        impl EndIo for DropOnEnd {
            fn end_io(&self, bio: Bio, _status: Status, _private: u64) {
                drop(bio);
                let last = self.q.lock().take();
                drop(last);
                self.done.store(true, SeqCst);
            }
        }
        let opts = EngineOptions {
            completion: CompletionMode::Softirq,
            ..EngineOptions::default()
        };
        let q = Arc::new(Queue::new(Gate::default(), opts).unwrap());
        let owner = Arc::new(DropOnEnd {
            q: Mutex::new(Some(q.clone())),
            done: AtomicBool::new(false),
        });
        q.submit(Bio::new(Op::Write, 0, 0, IoBuf::empty(), owner.clone(), 0));
        drop(q);
        let deadline = now_ns() + 2_000_000_000;
        while !owner.done.load(SeqCst) {
            assert!(now_ns() < deadline, "completion never ran");
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    #[test]
    fn options_are_validated() {
        let bad = [
            EngineOptions {
                hw_queues: 0,
                ..EngineOptions::default()
            },
            EngineOptions {
                queue_depth: MAX_DEPTH + 1,
                ..EngineOptions::default()
            },
            EngineOptions {
                reserved_tags: 64,
                ..EngineOptions::default()
            },
            // A spin budget only times timer completions.
            EngineOptions {
                timer_spin_max_ns: 1000,
                ..EngineOptions::default()
            },
            EngineOptions {
                completion: CompletionMode::Timer { nsec: 1000 },
                timer_spin_max_ns: MAX_TIMER_SPIN_NS + 1,
                ..EngineOptions::default()
            },
        ];
        for o in bad {
            assert!(Queue::new(Gate::default(), o).is_err());
        }
    }

    #[test]
    fn deadline_clock_is_never_early_and_spins_only_within_its_budget() {
        set_thread_timer_slack_ns(1);
        let spun = AtomicU64::new(0);
        let mut clock = DeadlineClock::new(200_000);
        for _ in 0..50 {
            let deadline = now_ns() + 300_000;
            clock.wait_until(deadline, &spun);
            assert!(now_ns() >= deadline);
            assert!(clock.margin_ns <= 200_000, "margin {}", clock.margin_ns);
        }
        // It starts with the whole budget as its margin, so unless every
        // one of 50 sleeps woke more than 200 µs late, it spun.
        assert!(spun.load(Relaxed) > 0);

        // Without a budget it only sleeps.
        let spun = AtomicU64::new(0);
        let mut clock = DeadlineClock::new(0);
        for _ in 0..10 {
            let deadline = now_ns() + 100_000;
            clock.wait_until(deadline, &spun);
            assert!(now_ns() >= deadline);
        }
        assert_eq!(spun.load(Relaxed), 0);
    }

    #[test]
    fn timer_completions_with_a_spin_budget_end_on_time_and_report_the_spin() {
        #[derive(Default)]
        struct Stamped {
            early: AtomicU64,
            done: AtomicU64,
        }
        impl EndIo for Stamped {
            fn end_io(&self, bio: Bio, _status: Status, private: u64) {
                if now_ns() < private {
                    self.early.fetch_add(1, SeqCst);
                }
                drop(bio);
                self.done.fetch_add(1, SeqCst);
            }
        }
        const NSEC: u64 = 300_000;
        let opts = EngineOptions {
            completion: CompletionMode::Timer { nsec: NSEC },
            timer_spin_max_ns: 200_000,
            ..EngineOptions::default()
        };
        let q = Queue::new(Gate::default(), opts).unwrap();
        let owner = Arc::new(Stamped::default());
        for i in 0..20u64 {
            // The bio carries the earliest time it may complete.
            let due = now_ns() + NSEC;
            q.submit(Bio::new(
                Op::Write,
                i,
                0,
                IoBuf::empty(),
                owner.clone(),
                due,
            ));
            std::thread::sleep(std::time::Duration::from_micros(700));
        }
        let give_up = now_ns() + 5_000_000_000;
        while owner.done.load(SeqCst) < 20 {
            assert!(now_ns() < give_up, "completions never ran");
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        assert_eq!(owner.early.load(SeqCst), 0);
        let s = q.stats();
        assert_eq!(s.timer_completions, 20);
        assert!(q.status().contains("timer_spin_cpu_ns="), "{}", q.status());
    }

    fn timer_queue(nsec: u64, iopoll: bool) -> Queue<Gate> {
        let opts = EngineOptions {
            completion: CompletionMode::Timer { nsec },
            iopoll,
            ..EngineOptions::default()
        };
        Queue::new(Gate::default(), opts).unwrap()
    }

    fn polled_bio(owner: &Arc<Done>) -> Bio {
        let mut b = write_bio(owner);
        b.flags.insert(BioFlags::POLLED);
        b
    }

    #[test]
    fn polled_bios_complete_from_poll_on_time_and_never_early() {
        // 200 ms, so that the 10 ms nap below, however much a loaded test
        // machine stretches it, ends long before the requests are due.
        let q = timer_queue(200_000_000, true);
        assert!(q.polls());
        let d = Arc::new(Done::default());
        let t0 = now_ns();
        for _ in 0..4 {
            q.submit(polled_bio(&d));
        }
        // Not due: polling completes nothing, and the timer thread does
        // not complete them either.
        assert_eq!(q.poll(), 0);
        std::thread::sleep(std::time::Duration::from_millis(10));
        assert_eq!(d.0.load(SeqCst), 0);
        // Poll until all are done. They are all due at once, so one poll
        // normally ends them all; if this thread is descheduled for more
        // than the backstop's 1 ms past the deadline (a loaded machine),
        // the completion thread may end some instead.
        let mut by_poll = 0;
        while d.0.load(SeqCst) < 4 {
            let n = q.poll();
            if n > 0 {
                assert!(now_ns() - t0 >= 200_000_000, "completed early");
            }
            by_poll += n;
            assert!(now_ns() - t0 < 5_000_000_000, "never became due");
        }
        assert!(now_ns() - t0 >= 200_000_000, "completed early");
        assert!(by_poll <= 4);
        assert_eq!(q.stats().timer_completions, 4);
    }

    #[test]
    fn a_polled_bio_nobody_polls_is_completed_by_the_backstop() {
        let q = timer_queue(1_000_000, true);
        let d = Arc::new(Done::default());
        q.submit(polled_bio(&d));
        // Due after 1 ms, left to the completion thread 1 ms later, which
        // looks every 10 ms when idle.
        wait_done(&d, 1, 2_000_000_000);
    }

    #[test]
    fn dropping_the_queue_ends_its_polled_bios() {
        let d = Arc::new(Done::default());
        {
            let q = timer_queue(5_000_000, true);
            q.submit(polled_bio(&d));
            q.submit(polled_bio(&d));
        }
        assert_eq!(d.0.load(SeqCst), 2);
    }

    #[test]
    fn without_iopoll_a_polled_bio_completes_on_the_timer_thread() {
        let q = timer_queue(1_000_000, false);
        assert!(!q.polls());
        let d = Arc::new(Done::default());
        q.submit(polled_bio(&d));
        assert_eq!(q.poll(), 0);
        wait_done(&d, 1, 2_000_000_000);
        assert_eq!(q.poll(), 0);
        let inline = EngineOptions {
            iopoll: true,
            ..EngineOptions::default()
        };
        assert!(Queue::new(Gate::default(), inline)
            .err()
            .is_some_and(|e| e.contains("irqmode=2")));
    }
}
