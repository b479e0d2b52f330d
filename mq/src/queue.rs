//! The request queue: bios in, driver calls out, completions back (kernel
//! `block/blk-mq.c`: `blk_mq_submit_bio`, `blk_mq_run_hw_queue`,
//! `blk_mq_dispatch_rq_list`, `blk_mq_end_request`, `blk_mq_poll`).
//!
//! Submission: pick the submitting thread's hardware queue, take a tag
//! (sleeping if none is free), store the bio in the tag's slot, and issue
//! directly to the driver unless requests are already waiting on the
//! dispatch list. A driver that says busy gets the request back on the
//! dispatch list's head and the queue's restart bit set; the next
//! completion runs the queue again.
//!
//! Queue runs are inline (on the caller's thread) or posted to kblockd,
//! optionally delayed. With `run_dedup` (default; upstream "blk-mq: avoid
//! repeatedly scheduling the same work to run hardware queue") a zero-delay
//! post is skipped while one is pending (`BLK_MQ_S_WORK_QUEUED`), and a
//! delayed post clears the bit so it never stands in for an immediate run;
//! without it every asynchronous run pays the pool's lock, as before that
//! change. `run_on_completion` runs every hardware queue asynchronously on
//! each completion, as SCSI's `scsi_end_request` did.
//!
//! Completion is the driver's: it ends a request at once from `queue_rq`,
//! later through its [`RequestCompleter`], or from [`Queue::poll`], which
//! calls the driver's poll hook as `blk_mq_poll` calls `mq_ops->poll`.
//! The queue knows nothing of how a driver keeps time (null_blk's
//! completion modes are in `drivers/`).
//!
//! The hot path allocates nothing: tags index preallocated slots, the
//! dispatch list keeps its capacity, and every lock taken per I/O is per
//! hardware queue (none is global).

use crate::driver::EndRequest;
// The queue's vocabulary, importable from here as before the split.
pub use crate::driver::{CompleterRef, Driver, HeldCompleter, QueueRq, RequestCompleter, Rq};
use crate::hwqueue::{HctxStats, HwQueue};
use crate::kblockd::{DelayedWork, Kblockd};
pub use crate::options::{EngineOptions, EngineOptionsError, KblockdKind, MAX_HW_QUEUES};
use crate::sbitmap::SbqStats;
use crate::tags::{Tags, TagsConfig, TagsError};
use blkstack_core::clock::{now_ns, sleep_until_ns};
use blkstack_core::{Bio, BioFlags, Status};
use std::cell::Cell;
use std::mem::MaybeUninit;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};

/// Kernel `BLK_MQ_RESOURCE_DELAY`: retry a busy queue with nothing in
/// flight after 3 ms.
pub const RESOURCE_DELAY_NS: u64 = 3_000_000;

/// Fruitless poll rounds a polled submitter spins through, waiting for a
/// tag, before it naps between rounds ([`POLLED_TAG_NAP_NS`]).
const POLLED_TAG_SPINS: u32 = 64;
/// A polled submitter's nap between poll rounds while its tag set is
/// full: long enough to hand the CPU to another runnable poller, short
/// against the completion times of devices worth polling.
const POLLED_TAG_NAP_NS: u64 = 5_000;

/// How often a shared tag set checks for hardware queues gone idle (the
/// kernel's check rides on its request timeout work; what matters is that
/// an idle queue's share returns to the others within a fraction of a
/// second).
pub const IDLE_CHECK_NS: u64 = 100_000_000;

/// Why a queue could not be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    #[error(transparent)]
    Options(#[from] EngineOptionsError),
    #[error(transparent)]
    Tags(#[from] TagsError),
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
}

struct QueueInner<D: Driver> {
    driver: D,
    opts: EngineOptions,
    hctxs: Box<[HwQueue]>,
    kblockd: Arc<Kblockd>,
    /// Shared tag sets: the periodic idle check (kernel timeout work).
    idle_work: OnceLock<Arc<DelayedWork>>,
}

/// A blk-mq request queue over driver `D`.
pub struct Queue<D: Driver> {
    inner: Arc<QueueInner<D>>,
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
    /// Build a queue on the process-wide
    /// kblockd pool.
    pub fn new(driver: D, opts: EngineOptions) -> Result<Queue<D>, QueueError> {
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
    ) -> Result<Queue<D>, QueueError> {
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
        let inner = Arc::new(QueueInner {
            driver,
            opts: opts.clone(),
            hctxs: hctxs.into_boxed_slice(),
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
        Ok(Queue { inner })
    }

    pub fn options(&self) -> &EngineOptions {
        &self.inner.opts
    }

    /// Whether submitters may poll for their completions (kernel
    /// `BLK_FEAT_POLL`): the driver's [`Driver::polls`].
    pub fn polls(&self) -> bool {
        self.inner.driver.polls()
    }

    /// Let the driver end, on the calling thread, the polled requests that
    /// are ready (kernel `blk_mq_poll` calling `mq_ops->poll`). Returns
    /// how many.
    pub fn poll(&self) -> usize {
        let completer = CompleterRef {
            inner: &*self.inner,
        };
        self.inner.driver.poll(&completer)
    }

    /// The driver's [`Driver::poll_sleeps`].
    pub fn poll_sleeps(&self) -> bool {
        self.inner.driver.poll_sleeps()
    }

    /// [`Queue::poll`] that may sleep in the driver (see
    /// [`Driver::poll_wait`]).
    pub fn poll_wait(&self, ready: &dyn Fn() -> bool) -> usize {
        let completer = CompleterRef {
            inner: &*self.inner,
        };
        self.inner.driver.poll_wait(&completer, ready)
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
        )
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
    }
}

impl<D: Driver> EndRequest for QueueInner<D> {
    #[inline]
    fn end(&self, hctx: u32, tag: u32, status: Status) {
        self.end_request(&self.hctxs[hctx as usize], tag, status);
    }
}

impl<D: Driver> QueueInner<D> {
    /// The submitting thread's hardware queue of the type the bio needs
    /// (kernel `blk_mq_map_queue`: `REQ_POLLED` bios map to the
    /// `HCTX_TYPE_POLL` queues, the last `poll_queues`, when there are any).
    #[inline]
    fn hctx_for(&self, polled: bool) -> &HwQueue {
        let n = self.hctxs.len();
        let p = self.opts.poll_queues as usize;
        match (p, polled) {
            (0, _) => &self.hctxs[thread_hctx(n)],
            (_, true) => &self.hctxs[n - p + thread_hctx(p)],
            (_, false) => &self.hctxs[thread_hctx(n - p)],
        }
    }

    #[inline]
    fn submit(&self, bio: Bio) {
        self.submit_want(bio, 1)
    }

    /// [`Self::submit`] for the first of `want` bios the caller submits in
    /// a row (its plug): what a tag sleep declares to the wakeup.
    #[inline]
    fn submit_want(&self, bio: Bio, want: u32) {
        let polled = bio.flags.contains(BioFlags::POLLED);
        let h = self.hctx_for(polled);
        let was_inactive = h.tags.has_fair_share() && !h.tag_state.is_active();
        let tag = if polled && self.driver.polls() {
            self.polled_tag(h)
        } else {
            h.tags.get(&h.tag_state, false, &h.wait_index, want, || {
                self.run_hw_queue(h, false)
            })
        };
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

    /// A tag for a polled bio. The requests that hold the tags end only
    /// when someone polls, and their submitters are the pollers, so a
    /// submitter asleep in the tag wait may be waiting for requests that
    /// nobody will end (every poller asleep there once the pollers' depth
    /// exceeds the tags). The kernel's polled submitters never sleep there
    /// either: io_uring submits polled I/O with REQ_NOWAIT, takes -EAGAIN
    /// from a full tag set and reaps before it submits again. So: poll and
    /// retry, spinning a little, then napping between fruitless rounds so
    /// that other pollers on this CPU get it.
    fn polled_tag(&self, h: &HwQueue) -> u32 {
        let mut idle = 0u32;
        loop {
            if let Some(tag) = h.tags.try_get_now(&h.tag_state, false) {
                return tag;
            }
            self.run_hw_queue(h, false);
            let completer = CompleterRef { inner: self };
            if self.driver.poll(&completer) > 0 {
                idle = 0;
                continue;
            }
            idle += 1;
            if idle < POLLED_TAG_SPINS {
                std::hint::spin_loop();
            } else {
                sleep_until_ns(now_ns() + POLLED_TAG_NAP_NS);
            }
        }
    }

    /// Kernel `blk_mq_submit_bio` for a plugged list, with batched tag
    /// allocation and completion. Tag sets with a fair share take the
    /// one-by-one path (each tag must pass the fair-share check, and the
    /// kernel does not batch them either); so does a bio for which no word has free tags,
    /// after ending what this batch finished (its tags may be the ones the
    /// allocation would wait for).
    fn submit_batch(&self, bios: &mut Vec<Bio>) {
        let polled = |b: &Bio| b.flags.contains(BioFlags::POLLED);
        let first = bios.first().is_some_and(polled);
        let h = self.hctx_for(first);
        let mixed = self.opts.poll_queues > 0 && bios.iter().any(|b| polled(b) != first);
        if h.tags.has_fair_share() || mixed {
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

    /// [`Self::issue`]; with `finished`, a request the driver ends inline
    /// is collected there to be ended with the rest of its batch.
    #[inline]
    fn issue_to(&self, h: &HwQueue, tag: u32, finished: Option<&mut Finished>) -> bool {
        h.run.enter_driver();
        let rq = Rq {
            tag,
            hctx: h.index,
            bio: h.tags.slot(tag).bio(),
        };
        match self.driver.queue_rq(rq) {
            QueueRq::Done(status) => {
                match finished {
                    Some(f) => f.push(tag, status),
                    None => self.end_request(h, tag, status),
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
    /// is skipped while a restart is armed with a request in flight (see
    /// `RunState::inline_run_allowed`).
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

    /// Kernel `__blk_mq_delay_run_hw_queue`'s async half, with the queued
    /// bit.
    fn post_run(&self, h: &HwQueue, delay_ns: u64) {
        if self.opts.run_dedup {
            if delay_ns == 0 {
                if !h.run.claim_immediate_post() {
                    h.counters.runs_deduped.fetch_add(1, Relaxed);
                    return;
                }
            } else {
                // A delayed run must not stand in for the next immediate
                // one (v2 of the queued-bit patch).
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

#[cfg(test)]
mod tests {
    use super::*;
    use blkstack_core::clock::now_ns;
    use blkstack_core::testing::CompletionRecorder;
    use blkstack_core::{IoBuf, Op};
    use std::sync::atomic::AtomicBool;
    use std::sync::atomic::Ordering::SeqCst;
    use std::time::Duration;

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

    fn write_bio(owner: &Arc<CompletionRecorder>) -> Bio {
        Bio::new(Op::Write, 0, 0, IoBuf::empty(), owner.clone(), 0)
    }

    fn wait_done(d: &CompletionRecorder, n: usize, within_ns: u64) {
        d.wait(n, Duration::from_nanos(within_ns));
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

    /// A queue on a held pool whose driver refused the one request
    /// submitted: it waits on the dispatch list with nothing in flight.
    fn refused_on_held_pool() -> (
        Queue<Gate>,
        Arc<Kblockd>,
        Arc<AtomicBool>,
        Arc<CompletionRecorder>,
    ) {
        let (pool, gate) = held_pool();
        let q =
            Queue::with_kblockd(Gate::default(), EngineOptions::default(), pool.clone()).unwrap();
        q.driver().refuse.store(true, SeqCst);
        let done = CompletionRecorder::new();
        q.submit(write_bio(&done));
        (q, pool, gate, done)
    }

    #[test]
    fn queued_bit_dedups_immediate_runs_and_delayed_runs_never_stand_in() {
        let (q, pool, gate, done) = refused_on_held_pool();
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
        let done = CompletionRecorder::new();
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

    /// A restart armed with nothing in flight has no completion to honour
    /// it: once its resource-delay run is gone (cancelled here by a stop;
    /// in the `lab mq-run` hang, run while the list was empty), the
    /// restart bit must not veto the next inline run, or the request waits
    /// on the dispatch list for ever.
    #[test]
    fn restart_with_nothing_in_flight_vetoes_no_inline_run() {
        let (q, pool, gate, done) = refused_on_held_pool();
        let h = &q.hw_queues()[0];
        assert_eq!((h.dispatch_len(), h.in_driver()), (1, 0));
        // The resource-delay run is pending on the held worker; the stop
        // cancels it, and the restart bit stays set.
        q.stop_hw_queue(0);
        q.driver().refuse.store(false, SeqCst);
        q.start_hw_queue(0, false);
        assert_eq!(done.count(), 1, "the inline run was vetoed: {}", q.status());
        assert_eq!(q.stats().tags_in_use, 0);
        release(&gate);
        drop(q);
        pool.shutdown();
    }

    #[test]
    fn stopped_queue_holds_requests_until_started() {
        let q = Queue::new(Gate::default(), EngineOptions::default()).unwrap();
        let done = CompletionRecorder::new();
        q.stop_hw_queue(0);
        q.submit(write_bio(&done));
        q.submit(write_bio(&done));
        assert_eq!(done.count(), 0);
        assert_eq!(q.hw_queues()[0].dispatch_len(), 2);
        q.start_hw_queue(0, false);
        assert_eq!(done.count(), 2);
        assert_eq!(q.stats().tags_in_use, 0);
    }

    #[test]
    fn blocking_driver_runs_only_from_kblockd() {
        let opts = EngineOptions {
            blocking: true,
            ..EngineOptions::default()
        };
        let q = Queue::new(Gate::default(), opts).unwrap();
        let done = CompletionRecorder::new();
        q.stop_hw_queue(0);
        q.submit(write_bio(&done));
        q.start_hw_queue(0, false);
        wait_done(&done, 1, 2_000_000_000);
        let s = q.hw_queues()[0].stats();
        assert_eq!(s.runs_inline, 0);
        assert!(s.runs_from_work >= 1);
    }

    /// Keeps every request it is given until polled or ended through
    /// its completer.
    #[derive(Default)]
    struct Holder {
        held: parking_lot::Mutex<Vec<(u32, u32)>>,
        completer: OnceLock<RequestCompleter>,
    }

    impl Driver for Holder {
        fn queue_rq(&self, rq: Rq<'_>) -> QueueRq {
            self.held.lock().push((rq.hctx, rq.tag));
            QueueRq::Issued
        }

        fn attach(&self, completer: RequestCompleter) {
            let _ = self.completer.set(completer);
        }

        fn polls(&self) -> bool {
            true
        }

        fn poll(&self, completer: &CompleterRef<'_>) -> usize {
            let held = std::mem::take(&mut *self.held.lock());
            for &(hctx, tag) in &held {
                completer.end_request(hctx, tag, Status::Ok);
            }
            held.len()
        }
    }

    #[test]
    fn poll_calls_the_drivers_poll_which_ends_its_requests() {
        let q = Queue::new(Holder::default(), EngineOptions::default()).unwrap();
        assert!(q.polls());
        let done = CompletionRecorder::new();
        for _ in 0..3 {
            q.submit(write_bio(&done));
        }
        assert_eq!(done.count(), 0);
        assert_eq!(q.stats().in_driver, 3);
        assert_eq!(q.poll(), 3);
        assert_eq!(done.count(), 3);
        assert_eq!(q.poll(), 0);
        let s = q.stats();
        assert_eq!((s.tags_in_use, s.in_driver), (0, 0));
        // A driver without a poll hook polls nothing.
        let g = Queue::new(Gate::default(), EngineOptions::default()).unwrap();
        assert!(!g.polls());
        assert_eq!(g.poll(), 0);
    }

    /// A polled submitter whose tag set is full polls for the requests
    /// holding the tags instead of sleeping in the tag wait, where nothing
    /// would end them (`Holder` ends requests only when polled). It slept
    /// there for ever before, and with more polling jobs than tags the
    /// bench's pollers waited on each other.
    #[test]
    fn a_polled_submitter_with_no_free_tag_polls_instead_of_sleeping() {
        let opts = EngineOptions {
            queue_depth: 2,
            ..EngineOptions::default()
        };
        let q = Arc::new(Queue::new(Holder::default(), opts).unwrap());
        let done = Arc::new(CompletionRecorder::new());
        let (tx, rx) = std::sync::mpsc::channel();
        let (q2, d2) = (q.clone(), done.clone());
        std::thread::spawn(move || {
            for _ in 0..8 {
                let mut b = write_bio(&d2);
                b.flags.insert(BioFlags::POLLED);
                q2.submit(b);
            }
            let _ = tx.send(());
        });
        rx.recv_timeout(Duration::from_secs(20))
            .expect("the submitter slept in the tag wait with every tag held by a polled request");
        assert_eq!(done.count() + q.stats().in_driver as usize, 8);
        q.poll();
        assert_eq!(done.count(), 8);
    }

    #[test]
    fn polled_bios_map_to_the_poll_queues_and_the_rest_to_the_others() {
        let opts = EngineOptions {
            hw_queues: 3,
            poll_queues: 1,
            ..EngineOptions::default()
        };
        let q = Queue::new(Holder::default(), opts).unwrap();
        let done = CompletionRecorder::new();
        let mut batch = Vec::new();
        for i in 0..6 {
            let mut b = write_bio(&done);
            if i % 2 == 0 {
                b.flags.insert(BioFlags::POLLED);
            }
            batch.push(b);
        }
        q.submit(write_bio(&done));
        // A mixed batch is split by type, not sent to the first bio's queue.
        q.submit_batch(&mut batch);
        let held = q.driver().held.lock().clone();
        assert_eq!(held.len(), 7);
        assert_eq!(held.iter().filter(|&&(h, _)| h == 2).count(), 3, "{held:?}");
        assert_eq!(q.poll(), 7);
        assert_eq!(done.count(), 7);
    }

    #[test]
    fn a_completer_ends_requests_from_another_thread_and_outlives_the_queue() {
        let q = Queue::new(Holder::default(), EngineOptions::default()).unwrap();
        let done = CompletionRecorder::new();
        q.submit(write_bio(&done));
        q.submit(write_bio(&done));
        let completer = q.driver().completer.get().cloned().expect("attached");
        let held = std::mem::take(&mut *q.driver().held.lock());
        let (first, second) = (held[0], held[1]);
        let c = completer.clone();
        std::thread::spawn(move || c.end_request(first.0, first.1, Status::IoError))
            .join()
            .expect("completing thread");
        let h = completer.hold().expect("queue alive");
        h.end_request(second.0, second.1, Status::Ok);
        drop(h);
        // The thread was joined before the second end: completion order.
        assert_eq!(done.statuses(), [Status::IoError, Status::Ok]);
        assert_eq!(q.stats().tags_in_use, 0);
        drop(q);
        // The queue is gone: nothing to hold, and ending is a no-op.
        assert!(completer.hold().is_none());
        completer.end_request(0, 0, Status::Ok);
        assert_eq!(done.count(), 2);
    }
}
