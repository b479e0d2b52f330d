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
    /// The engine options were out of range.
    #[error(transparent)]
    Options(#[from] EngineOptionsError),
    /// A tag set could not be built.
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
    /// Sleeps and wakeups of the tag sets' waiters, summed over the sets.
    pub tags: SbqStats,
    /// Run and dispatch counters, summed over the hardware queues.
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

    /// [`Queue::new`] on a given kblockd pool rather than the
    /// process-wide one, so a test or benchmark can own and observe its
    /// workers.
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

    /// The options the queue was built with.
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

    /// The driver under the queue.
    pub fn driver(&self) -> &D {
        &self.inner.driver
    }

    /// The hardware queues (kernel `q->queue_hw_ctx`), in index order.
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
mod tests;
