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
    /// The option value naming this weight.
    pub fn name(self) -> &'static str {
        match self {
            WakeWeight::Plug => "plug",
            WakeWeight::One => "one",
        }
    }
}

impl WakeupAlgo {
    /// The option value naming this algorithm.
    pub fn name(self) -> &'static str {
        match self {
            WakeupAlgo::Counter => "counter",
            WakeupAlgo::WaitCnt => "wait_cnt",
            WakeupAlgo::CounterFirstQueue => "counter_first_queue",
        }
    }

    /// The algorithm an option value names; `None` for an unknown one.
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

    /// The usable depth now: how many bits may be allocated (at most the
    /// capacity; see [`Sbitmap::resize`]).
    pub fn depth(&self) -> u32 {
        self.depth.load(Relaxed)
    }

    /// The most bits the bitmap can hold: its depth when it was built.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// log2 of the bits per word (kernel `sb->shift`).
    pub fn shift(&self) -> u32 {
        self.shift
    }

    /// Words covering the current depth (kernel `sb->map_nr`).
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

mod queue;
pub use queue::{SbitmapQueue, SbqStats, SbqWait, WaitIndex, Waiter};

#[cfg(all(test, not(loom)))]
mod tests;
