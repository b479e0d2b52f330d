//! Scalable bitmap queue: the allocator behind every tag set (Linux
//! `lib/sbitmap.c`, `include/linux/sbitmap.h`).
//!
//! Why it looks the way it does:
//! - The bitmap is split into words that each sit on their own cache line,
//!   and each submitter starts its search at its own hint (random at first,
//!   then the bit after the one it last got, or the bit it just freed), so
//!   threads allocating at the same time mostly touch different lines.
//! - Freeing a bit does not touch the allocation word: it sets the bit in the
//!   word's `cleared` mask, and an allocator that finds a word full folds the
//!   mask back in with one exchange ("deferred clear"). Allocation and
//!   freeing then contend on different atomics.
//! - Submitters that find no free bit sleep on one of 8 wait queues (chosen
//!   round-robin per hardware queue) and are woken in batches of
//!   `wake_batch` (`sbq_calc_wake_batch`: `clamp(depth / 8, 1, 8)`), so a
//!   burst of completions does not wake a thundering herd.
//!
//! Two wakeup algorithms are kept, selectable by [`WakeupAlgo`]:
//! - [`WakeupAlgo::Counter`] (default): the batched-wakeup algorithm (upstream
//!   4f8126bb2308 "sbitmap: Use single per-bitmap counting to wake up queued
//!   tags"), as it stands today: two always-increasing per-bitmap counters,
//!   `completion_cnt` and `wakeup_cnt`; whoever advances `wakeup_cnt` by a
//!   batch with a compare-and-swap wakes that many waiters, trying each wait
//!   queue in turn from `wake_index` (the later upstream refinement that
//!   keeps looking past a queue with fewer waiters than the batch).
//! - [`WakeupAlgo::WaitCnt`]: the algorithm it replaced (as of v6.1-rc2,
//!   the "-" side of that change's diff): each wait queue has a `wait_cnt`
//!   countdown that a completion decrements and, at zero, the completer
//!   wakes a batch and resets it. Decrement and reset are two steps, and a
//!   completion that lands between them (a nested completion in the
//!   kernel, a preempted thread here) finds the count at zero, skips that
//!   queue, and its credit is lost. That weakness is reproduced on purpose
//!   (see the `nested_completion` tests).
//! - [`WakeupAlgo::CounterFirstQueue`], a measurement aid: the counters as
//!   they were before upstream's "sbitmap: fix batching wakeup" (Ming Lei /
//!   David Jeffery, 2023), where a batch wakes the sleepers of the first
//!   wait queue that has any and stops there. With one sleeper per queue
//!   (few submitters, depth 64, batch 8) a batch then wakes one thread, as
//!   `wait_cnt` does; that fix wakes up to a whole batch across queues,
//!   because a sleeper that joins a queue right after its wakeup can be
//!   left behind for good. Where few CPUs run many sleepers the extra
//!   wakeups cost more than they save: `lab sbitmap --set algos=...` shows
//!   both (docs/BENCHMARKS.md).
//!
//! Orthogonal to the algorithm, [`WakeWeight`] says what one wakeup is
//! worth. The kernel counts a woken thread as one (`wake_up_nr` on an
//! exclusive queue): right when each sleeper needs one tag. A submitter
//! flushing a plug of `k` bios needs `k`, and will take every free tag it
//! finds once woken, so a batch of 8 freed tags that wakes 8 such
//! submitters leaves each with 1-2 tags and 7 of them asleep again soon
//! after, each sleep a wasted wakeup. With
//! [`WakeWeight::Plug`] (our default, not in the kernel) a sleeper says how
//! many tags it is about to take (its plug, capped at the batch) and a
//! batch wakes sleepers until their wants cover it. Forward progress is the
//! kernel's: every batch still wakes at least one sleeper, and it wakes
//! more whenever the first ones do not want the whole batch; a woken
//! thread that finds fewer tags than it wanted sleeps again with its
//! remaining want and is woken by a later batch, as in the kernel.
//!
//! Both include the fix b5fcf7871acb ("sbitmap: correct wake_batch
//! recalculation to avoid potential IO hung"): the shared-tags
//! recalculation clamps to 1, not 4.
//!
//! Sleeping waiters block (park), never spin. As a measurement aid that the
//! kernel does not have, a queue can be given a rescue timeout: a waiter
//! still asleep after it wakes itself, tries again, and is counted in
//! [`SbqStats::rescued`]: with the counter algorithm that number must stay
//! zero; with `wait_cnt` it counts the lost wakeups that change describes.

use crate::sync::{fence, Arc, AtomicBool, AtomicI32, AtomicU32, AtomicU64, Lock, Parker};
use crossbeam_utils::CachePadded;
use std::collections::VecDeque;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};

/// Number of wait queues (kernel `SBQ_WAIT_QUEUES`).
pub const SBQ_WAIT_QUEUES: usize = 8;
/// Largest wake batch (kernel `SBQ_WAKE_BATCH`).
pub const SBQ_WAKE_BATCH: u32 = 8;
/// Largest depth a tag set accepts (kernel `BLK_MQ_MAX_DEPTH`).
pub const MAX_DEPTH: u32 = 10240;
const BITS_PER_WORD: u32 = 64;
/// Per-sbitmap allocation hints, one per thread slot (the kernel has one per
/// CPU). Threads beyond this share slots; a hint is only a hint.
const HINT_SLOTS: usize = 64;

/// How completions wake tag waiters. See the module documentation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WakeupAlgo {
    /// Per-bitmap `completion_cnt`/`wakeup_cnt` (upstream "sbitmap: Use single per-bitmap counting to wake up queued tags", upstream today).
    #[default]
    Counter,
    /// Per-wait-queue `wait_cnt` countdown (before that change).
    WaitCnt,
    /// `Counter` with a batch waking one wait queue only (before upstream's
    /// 2023 "fix batching wakeup"); may leave sleepers behind.
    CounterFirstQueue,
}

/// What one woken sleeper counts for against a wake batch. See the module
/// documentation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WakeWeight {
    /// As many wakeups as tags the sleeper is about to take (its plug,
    /// capped at the batch).
    #[default]
    Plug,
    /// One per sleeper, as the kernel's `wake_up_nr`.
    One,
}

impl WakeWeight {
    pub fn name(self) -> &'static str {
        match self {
            WakeWeight::Plug => "plug",
            WakeWeight::One => "one",
        }
    }
}

impl WakeupAlgo {
    pub fn name(self) -> &'static str {
        match self {
            WakeupAlgo::Counter => "counter",
            WakeupAlgo::WaitCnt => "wait_cnt",
            WakeupAlgo::CounterFirstQueue => "counter_first_queue",
        }
    }

    pub fn parse(s: &str) -> Option<WakeupAlgo> {
        match s {
            "counter" => Some(WakeupAlgo::Counter),
            "wait_cnt" => Some(WakeupAlgo::WaitCnt),
            "counter_first_queue" => Some(WakeupAlgo::CounterFirstQueue),
            _ => None,
        }
    }
}

/// Under loom every modelled thread runs on one OS thread and executions
/// must be repeatable: one slot, no clock.
#[cfg(loom)]
fn thread_slot() -> usize {
    0
}

#[cfg(not(loom))]
fn thread_slot() -> usize {
    use std::cell::Cell;
    use std::sync::atomic::AtomicUsize;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SLOT: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    SLOT.with(|s| {
        let mut v = s.get();
        if v == usize::MAX {
            v = NEXT.fetch_add(1, Relaxed);
            s.set(v);
        }
        v % HINT_SLOTS
    })
}

/// A cheap random number below `bound` for the initial allocation hints
/// (kernel `get_random_u32_below`); quality does not matter, spread does.
fn random_below(bound: u32, salt: u64) -> u32 {
    if bound == 0 {
        return 0;
    }
    #[cfg(loom)]
    let seed = 0;
    #[cfg(not(loom))]
    let seed = blkstack_core::clock::now_ns();
    let mut x = salt.wrapping_add(seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    (x % bound as u64) as u32
}

/// One word of the bitmap, alone on its cache line with its deferred-clear
/// mask (kernel `struct sbitmap_word`, `____cacheline_aligned_in_smp`).
#[repr(align(64))]
struct SbitmapWord {
    word: AtomicU64,
    cleared: AtomicU64,
}

/// Kernel `sbitmap_calculate_shift`: use at least 4 words when the depth
/// allows, so that even small tag sets spread over several cache lines.
pub fn calculate_shift(depth: u32) -> u32 {
    let mut shift = BITS_PER_WORD.trailing_zeros();
    if depth >= 4 {
        while (4u32 << shift) > depth {
            shift -= 1;
        }
    }
    shift
}

/// The bitmap itself (kernel `struct sbitmap`).
pub struct Sbitmap {
    depth: AtomicU32,
    map_nr: AtomicU32,
    shift: u32,
    capacity: u32,
    round_robin: bool,
    map: Box<[SbitmapWord]>,
    hints: Box<[CachePadded<AtomicU32>]>,
}

impl Sbitmap {
    /// A bitmap of `depth` bits, all free. `shift` is log2 of the bits per
    /// word (`None`: [`calculate_shift`]). `depth` is also the capacity:
    /// [`Sbitmap::resize`] can shrink and grow back up to it.
    pub fn new(depth: u32, shift: Option<u32>, round_robin: bool) -> Sbitmap {
        let shift = shift.unwrap_or_else(|| calculate_shift(depth)).min(6);
        let bits = 1u32 << shift;
        let map_nr = depth.div_ceil(bits);
        let map = (0..map_nr.max(1))
            .map(|_| SbitmapWord {
                word: AtomicU64::new(0),
                cleared: AtomicU64::new(0),
            })
            .collect();
        let hints = (0..HINT_SLOTS)
            .map(|i| {
                let h = if round_robin {
                    0
                } else {
                    random_below(depth, i as u64)
                };
                CachePadded::new(AtomicU32::new(h))
            })
            .collect();
        Sbitmap {
            depth: AtomicU32::new(depth),
            map_nr: AtomicU32::new(map_nr),
            shift,
            capacity: depth,
            round_robin,
            map,
            hints,
        }
    }

    pub fn depth(&self) -> u32 {
        self.depth.load(Relaxed)
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    pub fn shift(&self) -> u32 {
        self.shift
    }

    pub fn map_nr(&self) -> u32 {
        self.map_nr.load(Relaxed)
    }

    #[inline]
    fn map_depth(&self, index: u32, depth: u32, map_nr: u32) -> u32 {
        if index == map_nr - 1 {
            depth - (index << self.shift)
        } else {
            1 << self.shift
        }
    }

    /// Fold a word's deferred clears back into it (kernel
    /// `sbitmap_deferred_clear`). Returns whether there were any.
    #[inline]
    fn deferred_clear(w: &SbitmapWord) -> bool {
        if w.cleared.load(Relaxed) == 0 {
            return false;
        }
        let mask = w.cleared.swap(0, Acquire);
        w.word.fetch_and(!mask, AcqRel);
        true
    }

    /// Kernel `__sbitmap_get_word`.
    #[inline]
    fn get_word(word: &AtomicU64, depth: u32, mut hint: u32, wrap: bool) -> Option<u32> {
        let wrap = wrap && hint != 0;
        let depth_mask = if depth >= 64 {
            u64::MAX
        } else {
            (1u64 << depth) - 1
        };
        loop {
            let free = !word.load(Relaxed) & depth_mask & !((1u64 << hint) - 1);
            if free == 0 {
                if hint != 0 && wrap {
                    hint = 0;
                    continue;
                }
                return None;
            }
            let nr = free.trailing_zeros();
            let bit = 1u64 << nr;
            if word.fetch_or(bit, AcqRel) & bit == 0 {
                return Some(nr);
            }
            hint = nr + 1;
            if hint >= depth.saturating_sub(1) {
                hint = 0;
            }
        }
    }

    /// Kernel `sbitmap_find_bit`: try each word once, starting at `index`.
    #[inline]
    fn find_bit(&self, limit: u32, mut index: u32, mut hint: u32, wrap: bool) -> Option<u32> {
        let depth = self.depth.load(Relaxed);
        let map_nr = self.map_nr.load(Relaxed);
        if depth == 0 {
            return None;
        }
        if index >= map_nr {
            index = 0;
        }
        for _ in 0..map_nr {
            let w = &self.map[index as usize];
            let word_depth = self.map_depth(index, depth, map_nr).min(limit);
            let got = loop {
                if let Some(nr) = Self::get_word(&w.word, word_depth, hint, wrap) {
                    break Some(nr);
                }
                if !Self::deferred_clear(w) {
                    break None;
                }
            };
            if let Some(nr) = got {
                return Some(nr + (index << self.shift));
            }
            hint = 0;
            index += 1;
            if index >= map_nr {
                index = 0;
            }
        }
        None
    }

    #[inline]
    fn hint_before_get(&self, slot: usize, depth: u32) -> u32 {
        let h = self.hints[slot].load(Relaxed);
        if h >= depth {
            let h = random_below(depth, slot as u64);
            self.hints[slot].store(h, Relaxed);
            return h;
        }
        h
    }

    #[inline]
    fn hint_after_get(&self, slot: usize, depth: u32, hint: u32, nr: Option<u32>) {
        match nr {
            // If the map is full, a hint won't do us much good.
            None => self.hints[slot].store(0, Relaxed),
            Some(nr) if nr == hint || self.round_robin => {
                let mut h = nr + 1;
                if h >= depth.saturating_sub(1) {
                    h = 0;
                }
                self.hints[slot].store(h, Relaxed);
            }
            Some(_) => {}
        }
    }

    /// Allocate a free bit (kernel `sbitmap_get`).
    #[inline]
    pub fn get(&self) -> Option<u32> {
        let slot = thread_slot();
        let depth = self.depth.load(Relaxed);
        let hint = self.hint_before_get(slot, depth);
        let index = hint >> self.shift;
        // Unless allocating round-robin, the hint only picks the word.
        let (bit_hint, wrap) = if self.round_robin {
            (hint & ((1 << self.shift) - 1), false)
        } else {
            (0, true)
        };
        let nr = self.find_bit(u32::MAX, index, bit_hint, wrap);
        self.hint_after_get(slot, depth, hint, nr);
        nr
    }

    /// Allocate a free bit among the first `shallow_depth` bits of each word
    /// (kernel `sbitmap_get_shallow`).
    pub fn get_shallow(&self, shallow_depth: u32) -> Option<u32> {
        let slot = thread_slot();
        let depth = self.depth.load(Relaxed);
        let hint = self.hint_before_get(slot, depth);
        let index = hint >> self.shift;
        let bit_hint = hint & ((1 << self.shift) - 1);
        let nr = self.find_bit(shallow_depth, index, bit_hint, true);
        self.hint_after_get(slot, depth, hint, nr);
        nr
    }

    /// Allocate up to `nr` bits from one word in one atomic operation
    /// (kernel `__sbitmap_queue_get_batch`): the run of `nr` bits from the
    /// first free one of the first word (from the hint) that has room;
    /// bits in that run already taken are skipped. Returns the mask of the
    /// bits won, relative to `offset`, or `None` (round-robin maps never
    /// batch, as in the kernel). `nr` is at most the bits per word.
    pub fn get_batch(&self, nr: u32) -> Option<(u64, u32)> {
        if self.round_robin || nr == 0 || nr > 1 << self.shift {
            return None;
        }
        let slot = thread_slot();
        let depth = self.depth.load(Relaxed);
        let map_nr = self.map_nr.load(Relaxed);
        if depth == 0 {
            return None;
        }
        let hint = self.hint_before_get(slot, depth);
        let mut index = (hint >> self.shift).min(map_nr - 1);
        for _ in 0..map_nr {
            let w = &self.map[index as usize];
            let map_depth = self.map_depth(index, depth, map_nr);
            Self::deferred_clear(w);
            let val = w.word.load(Relaxed);
            let first_free = (!val).trailing_zeros();
            if first_free + nr <= map_depth {
                let want = (u64::MAX >> (64 - nr)) << first_free;
                let prev = w.word.fetch_or(want, AcqRel);
                let won = (want & !prev) >> first_free;
                if won != 0 {
                    let offset = first_free + (index << self.shift);
                    self.hint_after_get(slot, depth, hint, Some(offset + nr - 1));
                    return Some((won, offset));
                }
            }
            index += 1;
            if index >= map_nr {
                index = 0;
            }
        }
        None
    }

    /// Free every bit of `mask` in word `index` at once, bypassing the
    /// deferred-clear mask (kernel `sbitmap_queue_clear_batch`). SeqCst for
    /// the same pairing with waiters as [`Sbitmap::clear_bit`].
    #[inline]
    fn clear_word_mask(&self, index: u32, mask: u64) {
        let w = &self.map[index as usize];
        debug_assert!(
            w.word.load(Relaxed) & mask == mask,
            "sbitmap bits {mask:#x} of word {index} freed but not all set"
        );
        w.word.fetch_and(!mask, SeqCst);
    }

    /// Free a bit through the deferred-clear mask (kernel
    /// `sbitmap_deferred_clear_bit`). Release: whatever the holder wrote to
    /// the slot this bit names is visible to the next allocator.
    #[inline]
    pub fn clear_bit(&self, nr: u32) {
        let w = &self.map[(nr >> self.shift) as usize];
        let bit = 1u64 << (nr & ((1 << self.shift) - 1));
        // Checked before publishing the clear: afterwards an allocator may
        // fold it in and hand the bit out again at any moment.
        debug_assert!(
            w.word.load(Relaxed) & bit != 0,
            "sbitmap bit {nr} freed but not set"
        );
        // SeqCst: this and the waker's later SeqCst load of `ws_active`
        // pair with the waiter's increment and fence in `prepare_to_wait`
        // (the kernel's smp_mb__after_atomic, free after a locked
        // instruction on x86, as this is).
        let prev = w.cleared.fetch_or(bit, SeqCst);
        debug_assert!(prev & bit == 0, "sbitmap bit {nr} freed twice");
    }

    /// Remember the bit just freed as this thread's next hint (kernel
    /// `sbitmap_update_cpu_hint`): its cache line is hot here.
    #[inline]
    fn update_hint_after_clear(&self, nr: u32) {
        if !self.round_robin && nr < self.depth.load(Relaxed) {
            self.hints[thread_slot()].store(nr, Relaxed);
        }
    }

    /// Change the usable depth, up to the capacity (kernel `sbitmap_resize`).
    pub fn resize(&self, depth: u32) {
        let depth = depth.min(self.capacity);
        for w in self.map.iter() {
            Self::deferred_clear(w);
        }
        let bits = 1u32 << self.shift;
        self.depth.store(depth, Relaxed);
        self.map_nr.store(depth.div_ceil(bits), Relaxed);
    }

    /// Bits in use (kernel `sbitmap_weight`).
    pub fn weight(&self) -> u32 {
        let map_nr = self.map_nr.load(Relaxed) as usize;
        self.map[..map_nr.min(self.map.len())]
            .iter()
            .map(|w| (w.word.load(Relaxed) & !w.cleared.load(Relaxed)).count_ones())
            .sum()
    }

    /// Is bit `nr` allocated (and not yet freed)?
    pub fn test_bit(&self, nr: u32) -> bool {
        let w = &self.map[(nr >> self.shift) as usize];
        let bit = 1u64 << (nr & ((1 << self.shift) - 1));
        (w.word.load(Relaxed) & !w.cleared.load(Relaxed)) & bit != 0
    }
}

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

    pub fn algo(&self) -> WakeupAlgo {
        self.algo
    }

    pub fn wake_weight(&self) -> WakeWeight {
        self.weight
    }

    pub fn sbitmap(&self) -> &Sbitmap {
        &self.sb
    }

    pub fn depth(&self) -> u32 {
        self.sb.depth()
    }

    pub fn wake_batch(&self) -> u32 {
        self.wake_batch.load(Relaxed)
    }

    /// Threads currently registered as waiting (kernel `ws_active`).
    pub fn ws_active(&self) -> u32 {
        self.ws_active.load(Relaxed)
    }

    pub fn completion_cnt(&self) -> u32 {
        self.completion_cnt.load(Relaxed)
    }

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
    fn waitqueue_active(&self, i: usize) -> bool {
        self.ws[i].nr_waiters.load(SeqCst) != 0
    }

    /// Kernel `wake_up_nr` on an exclusive wait queue: take waiters off the
    /// front and wake them until `nr` wakeups are issued, each counting as
    /// one or as its want ([`WakeWeight`]). Returns the wakeups issued.
    ///
    /// Waiters are taken off under the lock but woken after it is dropped,
    /// a few at a time, so a woken thread does not run straight into the
    /// lock its waker still holds.
    fn wake_up_nr(&self, i: usize, nr: u32) -> u32 {
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn shift_matches_kernel() {
        assert_eq!(calculate_shift(1), 6);
        assert_eq!(calculate_shift(4), 0);
        assert_eq!(calculate_shift(64), 4);
        assert_eq!(calculate_shift(256), 6);
        assert_eq!(calculate_shift(10240), 6);
        assert_eq!(calculate_shift(31), 2);
    }

    #[test]
    fn wake_batch_matches_kernel() {
        for (depth, batch) in [(1, 1), (2, 1), (16, 2), (32, 4), (64, 8), (1024, 8)] {
            let q = SbitmapQueue::new(depth, false, WakeupAlgo::Counter);
            assert_eq!(q.wake_batch(), batch, "depth {depth}");
        }
        // Shallow depth: 4 words of 16 bits, 2 usable per word -> 8 bits.
        let q = SbitmapQueue::new(64, false, WakeupAlgo::Counter);
        q.set_min_shallow_depth(2);
        assert_eq!(q.wake_batch(), 1);
        // Shared users (with the b5fcf7871acb fix): 64 / 4 users = 16 -> 2.
        let q = SbitmapQueue::new(64, false, WakeupAlgo::Counter);
        q.recalculate_wake_batch(4);
        assert_eq!(q.wake_batch(), 2);
        // 64 tags, 16 users: share 4 -> batch 1 (the old code forced 4).
        q.recalculate_wake_batch(16);
        assert_eq!(q.wake_batch(), 1);
        q.resize(16);
        assert_eq!(q.wake_batch(), 2);
    }

    #[test]
    fn old_algorithm_rearms_counts_on_batch_change() {
        let q = SbitmapQueue::new(64, false, WakeupAlgo::WaitCnt);
        assert_eq!(q.wait_cnt(3), 8);
        q.recalculate_wake_batch(4);
        assert_eq!(q.wait_cnt(3), 1);
    }

    /// A thread woken with no bit free retries, finds none and sleeps
    /// again: one wasted wakeup, counted once; it then gets the bit freed
    /// later (no lost wakeup).
    #[test]
    fn wakeup_that_finds_no_bit_is_counted_as_wasted() {
        for algo in [WakeupAlgo::Counter, WakeupAlgo::WaitCnt] {
            let q = std::sync::Arc::new(SbitmapQueue::new(1, false, algo));
            let held = q.get().expect("the only bit");
            let q2 = q.clone();
            let waiter = std::thread::spawn(move || q2.get_blocking(&WaitIndex::new(), || ()));
            let wait_until = |what: &str, f: &dyn Fn(&SbqStats) -> bool| {
                let deadline = blkstack_core::clock::now_ns() + 5_000_000_000;
                while !f(&q.stats()) {
                    assert!(
                        blkstack_core::clock::now_ns() < deadline,
                        "{algo:?}: {what}"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            };
            wait_until("waiter never slept", &|s| s.waits == 1);
            assert_eq!(q.stats().wasted_wakeups, 0);
            // Woken once with the bitmap still full: it must sleep again.
            // (Not `wake_all`: it keeps scanning while any queue is active,
            // so it may wake the waiter a second time after it re-queues.)
            let woke = (0..SBQ_WAIT_QUEUES)
                .find(|&i| q.waitqueue_active(i))
                .map(|i| q.wake_up_nr(i, 1));
            assert_eq!(woke, Some(1), "{algo:?}: one waiter to wake");
            wait_until("woken waiter did not sleep again", &|s| s.waits == 2);
            assert_eq!(q.stats().wasted_wakeups, 1, "{algo:?}");
            q.clear(held);
            let got = waiter.join().expect("waiter panicked");
            assert_eq!(got, held);
            assert_eq!(
                q.stats().wasted_wakeups,
                1,
                "{algo:?}: the last wakeup was not wasted"
            );
            assert_eq!(q.stats().rescued, 0);
        }
    }

    #[test]
    fn every_bit_allocated_once_then_full() {
        for depth in [1u32, 2, 3, 7, 64, 100, 1000, 10240] {
            let q = SbitmapQueue::new(depth, false, WakeupAlgo::Counter);
            let mut seen = HashSet::new();
            for _ in 0..depth {
                let nr = q.get().expect("free bit");
                assert!(nr < depth);
                assert!(seen.insert(nr), "bit {nr} handed out twice");
            }
            assert_eq!(q.get(), None, "depth {depth}: full map gave a bit");
            assert_eq!(q.sbitmap().weight(), depth);
            for nr in seen {
                q.clear(nr);
            }
            assert_eq!(q.sbitmap().weight(), 0);
            // Deferred clears fold back in: the whole map is usable again.
            for _ in 0..depth {
                assert!(q.get().is_some());
            }
        }
    }

    #[test]
    fn freed_bit_is_reused_by_the_same_thread() {
        let q = SbitmapQueue::new(256, false, WakeupAlgo::Counter);
        let a = q.get().unwrap();
        let b = q.get().unwrap();
        q.clear(a);
        // The hint now points at `a`'s word: the next get comes from there.
        let c = q.get().unwrap();
        assert_eq!(c >> q.sbitmap().shift(), a >> q.sbitmap().shift());
        assert_ne!(c, b);
    }

    #[test]
    fn resize_limits_allocation() {
        let q = SbitmapQueue::new(64, false, WakeupAlgo::Counter);
        q.resize(10);
        let got: Vec<u32> = std::iter::from_fn(|| q.get()).collect();
        assert_eq!(got.len(), 10);
        assert!(got.iter().all(|&n| n < 10));
        for n in got {
            q.clear(n);
        }
        q.resize(64);
        assert_eq!(std::iter::from_fn(|| q.get()).count(), 64);
    }

    #[test]
    fn shallow_get_uses_only_low_bits_of_each_word() {
        let q = SbitmapQueue::new(64, false, WakeupAlgo::Counter);
        let got: Vec<u32> = std::iter::from_fn(|| q.get_shallow(2)).collect();
        assert_eq!(got.len(), 8);
        assert!(got.iter().all(|&n| n % 16 < 2));
    }

    /// Register `n` waiters (one thread, detached entries) on queue 0.
    fn waiters_on_queue0(q: &SbitmapQueue, n: usize) -> Vec<SbqWait> {
        (0..n)
            .map(|_| {
                let mut w = SbqWait::new_detached();
                q.prepare_to_wait(0, &mut w);
                w
            })
            .collect()
    }

    /// The nested completion the upstream counter change was made for: completion A is between its first
    /// atomic step and the end of its wakeup when completion B arrives.
    /// Returns how many of two waiters were woken by two completions.
    fn nested_completion(algo: WakeupAlgo) -> (usize, SbqStats) {
        let q = Arc::new(SbitmapQueue::new(2, false, algo));
        assert_eq!(q.wake_batch(), 1);
        let a = q.get().unwrap();
        let b = q.get().unwrap();
        assert_eq!(q.get(), None);
        let waiters = waiters_on_queue0(&q, 2);
        let q2 = q.clone();
        q.set_nested_hook(Box::new(move || q2.clear(b)));
        q.clear(a);
        let woken = waiters.iter().filter(|w| w.is_woken()).count();
        (woken, q.stats())
    }

    #[test]
    fn nested_completion_counter_wakes_everyone() {
        let (woken, stats) = nested_completion(WakeupAlgo::Counter);
        assert_eq!(woken, 2, "{stats:?}");
        assert_eq!(stats.dropped_credits, 0);
    }

    #[test]
    fn nested_completion_wait_cnt_loses_a_wakeup() {
        // The known weakness, reproduced: two tags freed, two waiters, one
        // woken; the other sleeps beside a free tag until some unrelated
        // completion comes along (if one ever does).
        let (woken, stats) = nested_completion(WakeupAlgo::WaitCnt);
        assert_eq!(woken, 1, "{stats:?}");
        assert_eq!(stats.dropped_credits, 1);
    }

    #[test]
    fn counter_batches_wakeups() {
        // depth 32 -> wake_batch 4: three completions wake nobody, the
        // fourth wakes a batch of four.
        let q = SbitmapQueue::new(32, false, WakeupAlgo::Counter);
        let tags: Vec<u32> = std::iter::from_fn(|| q.get()).collect();
        let waiters = waiters_on_queue0(&q, 6);
        for &t in &tags[..3] {
            q.clear(t);
        }
        assert_eq!(waiters.iter().filter(|w| w.is_woken()).count(), 0);
        q.clear(tags[3]);
        assert_eq!(waiters.iter().filter(|w| w.is_woken()).count(), 4);
        assert_eq!(q.wakeup_cnt(), 4);
        assert_eq!(q.completion_cnt(), 4);
    }

    #[test]
    fn counter_wake_spills_to_next_queue() {
        let q = SbitmapQueue::new(16, false, WakeupAlgo::Counter);
        assert_eq!(q.wake_batch(), 2);
        let tags: Vec<u32> = std::iter::from_fn(|| q.get()).collect();
        let mut w0 = SbqWait::new_detached();
        let mut w1 = SbqWait::new_detached();
        q.prepare_to_wait(0, &mut w0);
        q.prepare_to_wait(1, &mut w1);
        q.clear(tags[0]);
        q.clear(tags[1]);
        assert!(w0.is_woken() && w1.is_woken());
        q.finish_wait(&mut w0);
        q.finish_wait(&mut w1);
        assert_eq!(q.ws_active(), 0);
    }

    #[test]
    fn plug_weight_wakes_sleepers_until_their_wants_cover_the_batch() {
        // Depth 64, batch 8; four sleepers on four queues, as four
        // submitters with full plugs. The kernel's count wakes all four
        // for one batch of 8 freed tags (2 tags each); plug weight wakes
        // the first, which will take all 8.
        for (weight, want, expect) in [
            (WakeWeight::One, 64, 4u64),
            (WakeWeight::Plug, 64, 1),
            (WakeWeight::Plug, 3, 3),
            (WakeWeight::Plug, 1, 4),
        ] {
            let q = SbitmapQueue::new(64, false, WakeupAlgo::Counter).with_wake_weight(weight);
            assert_eq!(q.wake_batch(), 8);
            let tags: Vec<u32> = std::iter::from_fn(|| q.get()).collect();
            let mut waits: Vec<SbqWait> = (0..4).map(|_| SbqWait::new_detached()).collect();
            for (i, w) in waits.iter_mut().enumerate() {
                w.set_want(want);
                q.prepare_to_wait(i, w);
            }
            q.clear_batch(&tags[..8]);
            let woken = waits.iter().filter(|w| w.is_woken()).count() as u64;
            assert_eq!(woken, expect, "{weight:?} want {want}");
            assert_eq!(q.stats().woken, expect);
            // The next batch goes on from the queue after the last one
            // woken, so nobody is left behind.
            q.clear_batch(&tags[8..16]);
            if weight == WakeWeight::Plug && want == 64 {
                assert!(waits[1].is_woken(), "second batch wakes the next queue");
            }
            for w in waits.iter_mut() {
                q.finish_wait(w);
            }
            assert_eq!(q.ws_active(), 0);
        }
    }

    #[test]
    fn counter_first_queue_stops_after_one_queue() {
        // The same two completions, one sleeper on each of two queues:
        // before upstream's 2023 fix the batch stops at the first queue
        // that woke anyone, and the second sleeper is left behind.
        let q = SbitmapQueue::new(16, false, WakeupAlgo::CounterFirstQueue);
        assert_eq!(WakeupAlgo::parse("counter_first_queue"), Some(q.algo()));
        let tags: Vec<u32> = std::iter::from_fn(|| q.get()).collect();
        let mut w0 = SbqWait::new_detached();
        let mut w1 = SbqWait::new_detached();
        q.prepare_to_wait(0, &mut w0);
        q.prepare_to_wait(1, &mut w1);
        q.clear(tags[0]);
        q.clear(tags[1]);
        assert!(w0.is_woken());
        assert!(!w1.is_woken());
        assert_eq!(q.stats().woken, 1);
        q.finish_wait(&mut w0);
        q.finish_wait(&mut w1);
    }

    #[test]
    fn finish_wait_leaves_queue() {
        let q = SbitmapQueue::new(4, false, WakeupAlgo::Counter);
        let mut w = SbqWait::new_detached();
        q.prepare_to_wait(2, &mut w);
        assert_eq!(q.waiters_on(2), 1);
        assert_eq!(q.ws_active(), 1);
        q.finish_wait(&mut w);
        assert_eq!(q.waiters_on(2), 0);
        assert_eq!(q.ws_active(), 0);
    }

    #[test]
    fn blocking_get_sleeps_until_a_bit_is_freed() {
        let q = Arc::new(SbitmapQueue::new(1, false, WakeupAlgo::Counter));
        let t = q.get().unwrap();
        let q2 = q.clone();
        let h = std::thread::spawn(move || {
            let idx = WaitIndex::new();
            q2.get_blocking(&idx, || {})
        });
        while q.ws_active() == 0 {
            std::thread::yield_now();
        }
        q.clear(t);
        assert_eq!(h.join().unwrap(), t);
        assert_eq!(q.stats().rescued, 0);
    }
}
