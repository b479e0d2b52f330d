//! The wait side of the scalable bitmap queue (kernel `struct
//! sbitmap_queue`, `sbq_wake_up`, `sbitmap_queue_clear`): the wait queues
//! submitters sleep on when no bit is free, and the wakeup algorithms
//! (the per-bitmap counters of upstream 4f8126bb2308 "sbitmap: Use single
//! per-bitmap counting to wake up queued tags", and the `wait_cnt` one it
//! replaced) that wake them in batches. The bitmap itself is the parent
//! module; see its documentation for why both look the way they do.

use super::*;

/// A sleeping (or about to sleep) thread on a wait queue: kernel
/// `wait_queue_entry` with `autoremove_wake_function`.
pub struct Waiter {
    woken: AtomicBool,
    queued: AtomicBool,
    /// Tags this sleeper will take once woken (see [`WakeWeight`]).
    want: AtomicU32,
    parker: Parker,
}

impl Waiter {
    fn new() -> Arc<Waiter> {
        Arc::new(Waiter {
            woken: AtomicBool::new(false),
            queued: AtomicBool::new(false),
            want: AtomicU32::new(1),
            parker: Parker::for_current_thread(),
        })
    }

    /// Has a waker taken this waiter off its queue and woken it?
    pub fn is_woken(&self) -> bool {
        self.woken.load(Acquire)
    }

    /// This thread's waiter, made once per thread: waiting allocates
    /// nothing in steady state.
    #[cfg(not(loom))]
    fn for_current_thread() -> Arc<Waiter> {
        thread_local! {
            static WAITER: Arc<Waiter> = Waiter::new();
        }
        WAITER.with(|w| w.clone())
    }

    #[cfg(loom)]
    fn for_current_thread() -> Arc<Waiter> {
        Waiter::new()
    }
}

/// One wait queue (kernel `struct sbq_wait_state`).
struct WaitState {
    /// `WaitCnt` only: completions left before this queue wakes a batch.
    wait_cnt: AtomicI32,
    /// Entries on `list`, readable without the lock (`waitqueue_active`).
    nr_waiters: AtomicU32,
    list: Lock<VecDeque<Arc<Waiter>>>,
}

/// A thread's registration as a waiter (kernel `struct sbq_wait`).
pub struct SbqWait {
    waiter: Arc<Waiter>,
    /// Counted in `ws_active` (kernel: `sbq_wait->sbq != NULL`).
    active: bool,
    ws: Option<usize>,
    /// Tags the caller will take once woken, at least 1.
    want: u32,
    /// Has this wait been prepared before (a retry of the same wait)?
    prepared: bool,
    /// It was woken by a completion, and is now preparing to sleep again:
    /// if it does sleep, that wakeup was wasted.
    rewait_after_wake: bool,
}

impl SbqWait {
    /// A wait entry for the calling thread.
    pub fn new() -> SbqWait {
        SbqWait {
            waiter: Waiter::for_current_thread(),
            active: false,
            ws: None,
            want: 1,
            prepared: false,
            rewait_after_wake: false,
        }
    }

    /// A wait entry with its own waiter (not the thread's shared one), for
    /// models that register several waiters from one thread.
    pub fn new_detached() -> SbqWait {
        SbqWait {
            waiter: Waiter::new(),
            active: false,
            ws: None,
            want: 1,
            prepared: false,
            rewait_after_wake: false,
        }
    }

    /// Whether a waker has woken this entry since it was last prepared.
    pub fn is_woken(&self) -> bool {
        self.waiter.is_woken()
    }

    /// How many tags the caller will take once woken (its plug); counts
    /// under [`WakeWeight::Plug`]. Takes effect at the next
    /// [`SbitmapQueue::prepare_to_wait`].
    pub fn set_want(&mut self, want: u32) {
        self.want = want.max(1);
    }
}

impl Default for SbqWait {
    fn default() -> Self {
        Self::new()
    }
}

/// Round-robin choice of wait queue, one per hardware queue (kernel
/// `hctx->wait_index`).
#[derive(Default)]
pub struct WaitIndex(AtomicU32);

impl WaitIndex {
    /// A choice that starts at wait queue 0.
    pub fn new() -> WaitIndex {
        WaitIndex(AtomicU32::new(0))
    }
}

/// Counters of the waiting side, for `status` and the lab.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SbqStats {
    /// Times a thread went to sleep waiting for a bit.
    pub waits: u64,
    /// Threads woken by completions.
    pub woken: u64,
    /// Wakeup batches issued (calls that woke or tried to wake a queue).
    pub wake_batches: u64,
    /// `WaitCnt`: completions whose wakeup credit found no queue to go to
    /// while a thread slept on one whose countdown was mid-reset (the
    /// lost wakeup the counter change removed; each may or may not be made up by later
    /// completions).
    pub dropped_credits: u64,
    /// Sleeps ended by the rescue timeout instead of a wakeup.
    pub rescued: u64,
    /// Wasted wakeups: a thread woken by a completion that found no free
    /// bit on its retries and went back to sleep. Counted on that second
    /// sleep, so it costs nothing on the fast path.
    pub wasted_wakeups: u64,
}

#[derive(Default)]
struct StatCounters {
    waits: std::sync::atomic::AtomicU64,
    woken: std::sync::atomic::AtomicU64,
    wake_batches: std::sync::atomic::AtomicU64,
    dropped_credits: std::sync::atomic::AtomicU64,
    rescued: std::sync::atomic::AtomicU64,
    wasted_wakeups: std::sync::atomic::AtomicU64,
}

#[cfg(test)]
type NestedHook = Box<dyn FnOnce() + Send>;

/// A bitmap with wait queues (kernel `struct sbitmap_queue`).
pub struct SbitmapQueue {
    sb: Sbitmap,
    algo: WakeupAlgo,
    weight: WakeWeight,
    wake_batch: AtomicU32,
    wake_index: CachePadded<AtomicU32>,
    ws_active: CachePadded<AtomicU32>,
    completion_cnt: CachePadded<AtomicU32>,
    wakeup_cnt: CachePadded<AtomicU32>,
    min_shallow_depth: AtomicU32,
    ws: Box<[CachePadded<WaitState>]>,
    rescue_timeout_ns: u64,
    /// Written on slow paths only; padded so it never shares a line with
    /// the fields every wakeup reads.
    stats: CachePadded<StatCounters>,
    /// Test-only: run once between a waker's first atomic step and its
    /// wakeup, to model a nested completion.
    #[cfg(test)]
    nested_hook: Lock<Option<NestedHook>>,
}

#[inline]
fn sbq_index_inc(i: u32) -> u32 {
    (i + 1) & (SBQ_WAIT_QUEUES as u32 - 1)
}

impl SbitmapQueue {
    /// A queue of `depth` bits (kernel `sbitmap_queue_init_node`).
    ///
    /// # Panics
    /// If `depth` exceeds [`MAX_DEPTH`]; callers validate user input first.
    pub fn new(depth: u32, round_robin: bool, algo: WakeupAlgo) -> SbitmapQueue {
        assert!(depth <= MAX_DEPTH, "sbitmap depth {depth} > {MAX_DEPTH}");
        let sb = Sbitmap::new(depth, None, round_robin);
        let mut q = SbitmapQueue {
            sb,
            algo,
            weight: WakeWeight::default(),
            wake_batch: AtomicU32::new(1),
            wake_index: CachePadded::new(AtomicU32::new(0)),
            ws_active: CachePadded::new(AtomicU32::new(0)),
            completion_cnt: CachePadded::new(AtomicU32::new(0)),
            wakeup_cnt: CachePadded::new(AtomicU32::new(0)),
            min_shallow_depth: AtomicU32::new(u32::MAX),
            ws: Box::new([]),
            rescue_timeout_ns: 0,
            stats: CachePadded::new(StatCounters::default()),
            #[cfg(test)]
            nested_hook: Lock::new(None),
        };
        let batch = q.calc_wake_batch(depth);
        q.wake_batch = AtomicU32::new(batch);
        q.ws = (0..SBQ_WAIT_QUEUES)
            .map(|_| {
                CachePadded::new(WaitState {
                    wait_cnt: AtomicI32::new(batch as i32),
                    nr_waiters: AtomicU32::new(0),
                    list: Lock::new(VecDeque::new()),
                })
            })
            .collect();
        q
    }

    /// Wake a sleeper that has waited `ns` without a wakeup (0: never; the
    /// kernel's behaviour). See the module documentation.
    pub fn with_rescue_timeout_ns(mut self, ns: u64) -> SbitmapQueue {
        self.rescue_timeout_ns = ns;
        self
    }

    /// Count wakeups as [`WakeWeight`] says (default [`WakeWeight::Plug`]).
    pub fn with_wake_weight(mut self, weight: WakeWeight) -> SbitmapQueue {
        self.weight = weight;
        self
    }

    /// The wakeup algorithm this queue runs.
    pub fn algo(&self) -> WakeupAlgo {
        self.algo
    }

    /// What one woken sleeper counts for against a wake batch.
    pub fn wake_weight(&self) -> WakeWeight {
        self.weight
    }

    /// The bitmap the tags are allocated from.
    pub fn sbitmap(&self) -> &Sbitmap {
        &self.sb
    }

    /// Usable tags now (the bitmap's depth).
    pub fn depth(&self) -> u32 {
        self.sb.depth()
    }

    /// Frees that make one wakeup (kernel `wake_batch`).
    pub fn wake_batch(&self) -> u32 {
        self.wake_batch.load(Relaxed)
    }

    /// Threads currently registered as waiting (kernel `ws_active`).
    pub fn ws_active(&self) -> u32 {
        self.ws_active.load(Relaxed)
    }

    /// `CompletionCnt`: frees counted so far; only grows (the batched
    /// algorithm's first counter).
    pub fn completion_cnt(&self) -> u32 {
        self.completion_cnt.load(Relaxed)
    }

    /// `WakeupCnt`: wakeups issued so far, in batch units; only grows (the
    /// batched algorithm's second counter).
    pub fn wakeup_cnt(&self) -> u32 {
        self.wakeup_cnt.load(Relaxed)
    }

    /// `WaitCnt`: the countdown of wait queue `i`.
    pub fn wait_cnt(&self, i: usize) -> i32 {
        self.ws[i].wait_cnt.load(Relaxed)
    }

    /// Threads on wait queue `i`.
    pub fn waiters_on(&self, i: usize) -> u32 {
        self.ws[i].nr_waiters.load(Relaxed)
    }

    /// A snapshot of the wait and wake counters.
    pub fn stats(&self) -> SbqStats {
        SbqStats {
            waits: self.stats.waits.load(Relaxed),
            woken: self.stats.woken.load(Relaxed),
            wake_batches: self.stats.wake_batches.load(Relaxed),
            dropped_credits: self.stats.dropped_credits.load(Relaxed),
            rescued: self.stats.rescued.load(Relaxed),
            wasted_wakeups: self.stats.wasted_wakeups.load(Relaxed),
        }
    }

    #[cfg(test)]
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn set_nested_hook(&self, f: NestedHook) {
        *self.nested_hook.lock() = Some(f);
    }

    #[inline]
    fn run_nested_hook(&self) {
        #[cfg(test)]
        {
            let hook = self.nested_hook.lock().take();
            if let Some(f) = hook {
                f();
            }
        }
    }

    /// Kernel `sbq_calc_wake_batch`: a batch such that every wait queue can
    /// be woken even when only `min_shallow_depth` bits per word are usable.
    fn calc_wake_batch(&self, depth: u32) -> u32 {
        let shift = self.sb.shift;
        let shallow = (1u32 << shift).min(self.min_shallow_depth.load(Relaxed));
        let usable = (depth >> shift) * shallow + (depth & ((1 << shift) - 1)).min(shallow);
        (usable / SBQ_WAIT_QUEUES as u32).clamp(1, SBQ_WAKE_BATCH)
    }

    fn set_wake_batch(&self, wake_batch: u32) {
        if self.wake_batch.load(Relaxed) == wake_batch {
            return;
        }
        self.wake_batch.store(wake_batch, Relaxed);
        if self.algo == WakeupAlgo::WaitCnt {
            // Old `__sbitmap_queue_update_wake_batch`: the batch is visible
            // before the counts are reset, and the counts restart at 1 so
            // the next completion on each queue re-arms it.
            fence(SeqCst);
            for ws in self.ws.iter() {
                ws.wait_cnt.store(1, Relaxed);
            }
        }
    }

    /// Kernel `sbitmap_queue_resize`.
    pub fn resize(&self, depth: u32) {
        let depth = depth.min(self.sb.capacity());
        self.set_wake_batch(self.calc_wake_batch(depth));
        self.sb.resize(depth);
    }

    /// Kernel `sbitmap_queue_min_shallow_depth`.
    pub fn set_min_shallow_depth(&self, min_shallow_depth: u32) {
        self.min_shallow_depth.store(min_shallow_depth, Relaxed);
        self.set_wake_batch(self.calc_wake_batch(self.sb.depth()));
    }

    /// Kernel `sbitmap_queue_recalculate_wake_batch`, with b5fcf7871acb:
    /// the batch for `users` queues sharing this bitmap is computed from
    /// each one's fair share and clamped to 1..=8 (the old clamp to at least
    /// 4 could exceed what a small share can ever complete: IO hung).
    pub fn recalculate_wake_batch(&self, users: u32) {
        if users == 0 {
            return;
        }
        let depth = self.sb.depth().div_ceil(users);
        let wake_batch = (depth / SBQ_WAIT_QUEUES as u32).clamp(1, SBQ_WAKE_BATCH);
        self.set_wake_batch(wake_batch);
    }

    /// Allocate a bit without waiting (kernel `__sbitmap_queue_get`).
    #[inline]
    pub fn get(&self) -> Option<u32> {
        self.sb.get()
    }

    /// Kernel `sbitmap_queue_get_shallow`.
    pub fn get_shallow(&self, shallow_depth: u32) -> Option<u32> {
        self.sb.get_shallow(shallow_depth)
    }

    /// Kernel `__sbitmap_queue_get_batch`: see [`Sbitmap::get_batch`].
    #[inline]
    pub fn get_batch(&self, nr: u32) -> Option<(u64, u32)> {
        self.sb.get_batch(nr)
    }

    /// Free several bits and wake waiters once for all of them (kernel
    /// `sbitmap_queue_clear_batch`): one atomic per bitmap word touched
    /// instead of one per bit.
    pub fn clear_batch(&self, nrs: &[u32]) {
        let Some(&last) = nrs.last() else { return };
        let shift = self.sb.shift;
        let mut index = nrs[0] >> shift;
        let mut mask = 0u64;
        for &nr in nrs {
            if nr >> shift != index {
                self.sb.clear_word_mask(index, mask);
                index = nr >> shift;
                mask = 0;
            }
            mask |= 1u64 << (nr & ((1 << shift) - 1));
        }
        self.sb.clear_word_mask(index, mask);
        #[cfg(loom)]
        fence(SeqCst);
        self.wake_up(nrs.len() as u32);
        self.sb.update_hint_after_clear(last);
    }

    /// Free bit `nr` and wake waiters if a batch is due (kernel
    /// `sbitmap_queue_clear`).
    #[inline]
    pub fn clear(&self, nr: u32) {
        self.sb.clear_bit(nr);
        // Either the waiter's retry sees the bit free, or we see the waiter
        // registered: `clear_bit` is a SeqCst read-modify-write and
        // `wake_up` starts with a SeqCst load, against the waiter's SeqCst
        // increment and fence. Loom models SeqCst accesses only as
        // acquire/release, so its build adds the explicit fence that the
        // C++20 rules make unnecessary here.
        #[cfg(loom)]
        fence(SeqCst);
        self.wake_up(1);
        self.sb.update_hint_after_clear(nr);
    }

    /// Account `nr` freed bits and wake waiters (kernel
    /// `sbitmap_queue_wake_up`).
    #[inline]
    pub fn wake_up(&self, nr: u32) {
        if self.ws_active.load(SeqCst) == 0 {
            return;
        }
        match self.algo {
            WakeupAlgo::Counter | WakeupAlgo::CounterFirstQueue => self.wake_up_counter(nr),
            WakeupAlgo::WaitCnt => self.wake_up_wait_cnt(nr),
        }
    }

    fn wake_up_counter(&self, nr: u32) {
        let wake_batch = self.wake_batch.load(Relaxed);
        self.completion_cnt.fetch_add(nr, SeqCst);
        let mut wakeups = self.wakeup_cnt.load(SeqCst);
        loop {
            if self.completion_cnt.load(SeqCst).wrapping_sub(wakeups) < wake_batch {
                return;
            }
            match self.wakeup_cnt.compare_exchange(
                wakeups,
                wakeups.wrapping_add(wake_batch),
                SeqCst,
                SeqCst,
            ) {
                Ok(_) => break,
                Err(seen) => wakeups = seen,
            }
        }
        self.run_nested_hook();
        self.wake_across_queues(wake_batch);
    }

    /// Kernel `__sbitmap_queue_wake_up` (today's): wake `nr` waiters,
    /// visiting the queues round-robin from `wake_index`, which advances
    /// past each queue tried so no queue has to drain before the next one
    /// gets a turn.
    fn wake_across_queues(&self, mut nr: u32) {
        if self.ws_active.load(Relaxed) == 0 {
            return;
        }
        self.stats.wake_batches.fetch_add(1, Relaxed);
        let mut wake_index = self.wake_index.load(Relaxed);
        for _ in 0..SBQ_WAIT_QUEUES {
            let i = wake_index as usize;
            wake_index = sbq_index_inc(wake_index);
            if self.waitqueue_active(i) {
                let woken = self.wake_up_nr(i, nr);
                // Before the 2023 fix: "it is sufficient to wake up at
                // least one waiter to guarantee forward progress".
                if woken == nr || (woken > 0 && self.algo == WakeupAlgo::CounterFirstQueue) {
                    break;
                }
                nr -= woken;
            }
        }
        if wake_index != self.wake_index.load(Relaxed) {
            self.wake_index.store(wake_index, Relaxed);
        }
    }

    /// Old `sbitmap_queue_wake_up`: `while (__sbq_wake_up(sbq, &nr));`.
    fn wake_up_wait_cnt(&self, nr: u32) {
        let mut nr = nr as i32;
        let mut dropped = false;
        while self.sbq_wake_up_old(&mut nr, &mut dropped) {}
        if dropped {
            self.stats
                .dropped_credits
                .fetch_add(nr.max(0) as u64, Relaxed);
        }
    }

    /// Old `sbq_wake_ptr`: the first active queue whose countdown is not at
    /// zero, from `wake_index`.
    fn sbq_wake_ptr_old(&self) -> Option<usize> {
        if self.ws_active.load(Relaxed) == 0 {
            return None;
        }
        let mut wake_index = self.wake_index.load(SeqCst);
        for _ in 0..SBQ_WAIT_QUEUES {
            let i = wake_index as usize;
            if self.waitqueue_active(i) && self.ws[i].wait_cnt.load(SeqCst) != 0 {
                if wake_index != self.wake_index.load(SeqCst) {
                    self.wake_index.store(wake_index, SeqCst);
                }
                return Some(i);
            }
            wake_index = sbq_index_inc(wake_index);
        }
        None
    }

    /// Old `__sbq_wake_up`, step for step (v6.1-rc2). Returns whether the
    /// caller should try again.
    /// `dropped` (not in the kernel, for the counters) is set when the
    /// credit finds no queue to go to although a thread sleeps on one.
    fn sbq_wake_up_old(&self, nr: &mut i32, dropped: &mut bool) -> bool {
        if *nr <= 0 {
            return false;
        }
        let Some(i) = self.sbq_wake_ptr_old() else {
            // Someone sleeps on a queue, but every queue with sleepers has
            // its countdown at zero (mid-reset by another completion).
            *dropped = (0..SBQ_WAIT_QUEUES).any(|q| self.waitqueue_active(q));
            return false;
        };
        *dropped = false;
        let ws = &self.ws[i];
        let mut cur = ws.wait_cnt.load(SeqCst);
        let (wait_cnt, sub) = loop {
            // A concurrent caller is between its decrement to zero and its
            // reset: try again, on a different queue.
            if cur == 0 {
                return true;
            }
            let sub = (*nr).min(cur);
            match ws.wait_cnt.compare_exchange(cur, cur - sub, SeqCst, SeqCst) {
                Ok(_) => break (cur - sub, sub),
                Err(seen) => cur = seen,
            }
        };
        // If we decremented a queue without waiters, retry to avoid lost
        // wakeups.
        if wait_cnt > 0 {
            return !self.waitqueue_active(i);
        }
        *nr -= sub;
        // At zero we are responsible for resetting wait_cnt whether or not
        // anyone was woken; if nobody was, the caller must retry.
        let ret = !self.waitqueue_active(i);
        let wake_batch = self.wake_batch.load(Relaxed);
        self.stats.wake_batches.fetch_add(1, Relaxed);
        self.wake_up_nr(i, wake_batch);
        // The window the counter change describes: wait_cnt is zero and not yet reset.
        self.run_nested_hook();
        fence(SeqCst);
        // Move wake_index on before re-arming, so that concurrent callers do
        // not see a valid wait_cnt on the old queue.
        let old = self.wake_index.load(SeqCst);
        let _ = self
            .wake_index
            .compare_exchange(old, sbq_index_inc(old), SeqCst, SeqCst);
        ws.wait_cnt.store(wake_batch as i32, SeqCst);
        ret || *nr != 0
    }

    #[inline]
    pub(super) fn waitqueue_active(&self, i: usize) -> bool {
        self.ws[i].nr_waiters.load(SeqCst) != 0
    }

    /// Kernel `wake_up_nr` on an exclusive wait queue: take waiters off the
    /// front and wake them until `nr` wakeups are issued, each counting as
    /// one or as its want ([`WakeWeight`]). Returns the wakeups issued.
    ///
    /// Waiters are taken off under the lock but woken after it is dropped,
    /// a few at a time, so a woken thread does not run straight into the
    /// lock its waker still holds.
    pub(super) fn wake_up_nr(&self, i: usize, nr: u32) -> u32 {
        const CHUNK: usize = 8;
        let ws = &self.ws[i];
        let mut issued = 0u32;
        let mut threads = 0u64;
        loop {
            let mut taken: [Option<Arc<Waiter>>; CHUNK] = Default::default();
            let mut n = 0;
            {
                let mut list = ws.list.lock();
                while n < CHUNK && issued < nr {
                    let Some(w) = list.pop_front() else { break };
                    ws.nr_waiters.fetch_sub(1, SeqCst);
                    issued = issued.saturating_add(match self.weight {
                        WakeWeight::One => 1,
                        WakeWeight::Plug => w.want.load(Relaxed).clamp(1, nr - issued),
                    });
                    w.queued.store(false, Release);
                    w.woken.store(true, Release);
                    taken[n] = Some(w);
                    n += 1;
                }
            }
            for w in taken.iter().take(n).flatten() {
                w.parker.unpark();
            }
            threads += n as u64;
            if n < CHUNK || issued >= nr {
                break;
            }
        }
        self.stats.woken.fetch_add(threads, Relaxed);
        issued
    }

    /// Wake every waiter (kernel `sbitmap_queue_wake_all`), for teardown
    /// and depth changes.
    pub fn wake_all(&self) {
        for i in 0..SBQ_WAIT_QUEUES {
            while self.waitqueue_active(i) {
                if self.wake_up_nr(i, u32::MAX) == 0 {
                    break;
                }
            }
        }
    }

    /// The wait queue to use next for a hardware queue (kernel
    /// `sbq_wait_ptr`: read, then advance the index if nobody else did).
    pub fn wait_ptr(&self, wait_index: &WaitIndex) -> usize {
        let i = wait_index.0.load(Relaxed);
        let _ = wait_index
            .0
            .compare_exchange(i, sbq_index_inc(i), Relaxed, Relaxed);
        i as usize & (SBQ_WAIT_QUEUES - 1)
    }

    /// Kernel `sbitmap_prepare_to_wait`: count as active, queue at the tail
    /// (exclusive wait), then a full barrier before the caller's last try.
    pub fn prepare_to_wait(&self, ws: usize, wait: &mut SbqWait) {
        if !wait.active {
            self.ws_active.fetch_add(1, SeqCst);
            wait.active = true;
        }
        if let Some(prev) = wait.ws {
            if prev != ws {
                self.dequeue(prev, &wait.waiter);
            }
        }
        let st = &self.ws[ws];
        wait.rewait_after_wake = wait.prepared && wait.waiter.woken.load(Relaxed);
        wait.prepared = true;
        wait.waiter.woken.store(false, Relaxed);
        wait.waiter.want.store(wait.want, Relaxed);
        {
            let mut list = st.list.lock();
            if !wait.waiter.queued.load(Relaxed) {
                list.push_back(wait.waiter.clone());
                wait.waiter.queued.store(true, Relaxed);
                st.nr_waiters.fetch_add(1, SeqCst);
            }
        }
        wait.ws = Some(ws);
        fence(SeqCst);
    }

    fn dequeue(&self, ws: usize, waiter: &Arc<Waiter>) {
        if !waiter.queued.load(Acquire) {
            return;
        }
        let st = &self.ws[ws];
        let mut list = st.list.lock();
        if waiter.queued.load(Relaxed) {
            if let Some(pos) = list.iter().position(|w| Arc::ptr_eq(w, waiter)) {
                list.remove(pos);
                st.nr_waiters.fetch_sub(1, SeqCst);
            }
            waiter.queued.store(false, Relaxed);
        }
    }

    /// Kernel `sbitmap_finish_wait`: leave the queue (if no waker took us
    /// off it already) and stop counting as active.
    pub fn finish_wait(&self, wait: &mut SbqWait) {
        if let Some(ws) = wait.ws.take() {
            self.dequeue(ws, &wait.waiter);
        }
        if wait.active {
            self.ws_active.fetch_sub(1, SeqCst);
            wait.active = false;
        }
    }

    /// Sleep until woken (kernel `io_schedule()` after
    /// `prepare_to_wait`). Returns at once if already woken.
    pub fn schedule(&self, wait: &SbqWait) {
        if wait.rewait_after_wake {
            self.stats.wasted_wakeups.fetch_add(1, Relaxed);
        }
        self.stats.waits.fetch_add(1, Relaxed);
        #[cfg(not(loom))]
        if self.rescue_timeout_ns > 0 {
            let deadline = blkstack_core::clock::now_ns() + self.rescue_timeout_ns;
            while !wait.waiter.is_woken() {
                let now = blkstack_core::clock::now_ns();
                if now >= deadline {
                    self.stats.rescued.fetch_add(1, Relaxed);
                    return;
                }
                std::thread::park_timeout(std::time::Duration::from_nanos(deadline - now));
            }
            return;
        }
        wait.waiter.parker.park_until(|| wait.waiter.is_woken());
    }

    /// Allocate a bit, sleeping until one is free: the loop of the kernel's
    /// `blk_mq_get_tag`. `before_sleep` runs before each attempt that may
    /// sleep (blk-mq runs the hardware queue there, so that requests it
    /// holds back can complete and free bits).
    pub fn get_blocking(&self, wait_index: &WaitIndex, before_sleep: impl FnMut()) -> u32 {
        self.get_blocking_want(wait_index, 1, before_sleep)
    }

    /// [`Self::get_blocking`] for a caller that will take `want` bits in a
    /// row (its plug), which a sleep declares under [`WakeWeight::Plug`].
    pub fn get_blocking_want(
        &self,
        wait_index: &WaitIndex,
        want: u32,
        mut before_sleep: impl FnMut(),
    ) -> u32 {
        if let Some(nr) = self.get() {
            return nr;
        }
        let mut wait = SbqWait::new();
        wait.set_want(want);
        let mut ws = self.wait_ptr(wait_index);
        let nr = loop {
            before_sleep();
            if let Some(nr) = self.get() {
                break nr;
            }
            self.prepare_to_wait(ws, &mut wait);
            if let Some(nr) = self.get() {
                break nr;
            }
            self.schedule(&wait);
            self.finish_wait(&mut wait);
            ws = self.wait_ptr(wait_index);
        };
        self.finish_wait(&mut wait);
        nr
    }
}
