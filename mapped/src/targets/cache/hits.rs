//! The cache's mapping table (origin block -> cache block), readable
//! without the policy lock so that a warm read hit costs a lookup and a
//! few atomics, not the lock (`dm-cache-policy-smq.c`'s `h_*` hash table
//! of entries chained by index, whose `h_lookup` runs under `mq->lock`).
//!
//! The policy is the only writer (under the core lock); the submitters
//! read. Per cache block one word holds the origin block it maps and
//! three flags the policy keeps: `PENDING` (background work holds the
//! block, the kernel's `e->pending_work`), `HIT` (the block's hit bit
//! of this period, `mq->cache_hit_bits`) and `HOT` (its level is at or
//! above the cache stats' hit threshold). A read may take the fast path
//! only when the block is mapped, not pending and already hit this
//! period: then `smq_lookup` would do nothing but count the hit in the
//! cache stats by level, which the fast path counts in two atomics the
//! policy folds in at its next tick ([`HitIndex::take_fast_stats`]).
//! Anything else (a miss, a first hit, a pending block) takes the
//! locked path, which is the kernel's.
//!
//! Readers walk chains that the writer may change under them: a walk is
//! bounded and may miss (then the locked path decides), but never finds
//! a block that does not map the origin block asked for, because the
//! match is on the block's own word. Against migrations the fast path
//! counts the I/O in flight to the block first and checks the word
//! again after (both sequentially consistent): the target's quiesce
//! reads the in-flight count after the policy marked the block pending,
//! so either the reader sees `PENDING` and backs off, or the migration
//! sees the I/O and waits for it. A block's word, its chain link and
//! its in-flight count share one cache line, so a hit touches two lines
//! here (the bucket and the block), where the I/O's data copy keeps
//! evicting them; a batch asks for all of its lines before its first
//! lookup (`prefetch_*`), so their misses overlap. Written by hand: no
//! crate offers an index-chained table with this read protocol.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Background work holds the block.
pub(super) const PENDING: u64 = 1;
/// The block was hit this cache period.
pub(super) const HIT: u64 = 2;
/// The block's level is at or above the hit threshold.
pub(super) const HOT: u64 = 4;
const FLAG_BITS: u32 = 3;
const FLAGS: u64 = (1 << FLAG_BITS) - 1;
/// Chain links the lock-free walk follows before it gives up.
const MAX_WALK: u32 = 32;
/// "No block", in bucket heads and links (cache blocks are below it).
const NONE: u32 = u32::MAX;

/// One cache block's entry.
#[derive(Default)]
struct Slot {
    /// 0 if it maps nothing, else `(oblock + 1) << FLAG_BITS | flags`.
    word: AtomicU64,
    /// The next block in its bucket's chain.
    next: AtomicU32,
    /// Bios in flight to the block (the target's; a migration waits for
    /// them to drain).
    inflight: AtomicU32,
}

/// See the module documentation.
pub struct HitIndex {
    /// Per cache block.
    slots: Box<[Slot]>,
    /// Per bucket: the first block of its chain.
    buckets: Box<[AtomicU32]>,
    hash_shift: u32,
    /// Fast-path hits on `HOT` blocks, not yet folded into the stats.
    fast_hot: AtomicU64,
    /// Fast-path hits on other blocks, not yet folded into the stats.
    fast_cold: AtomicU64,
}

/// A hit the fast path may take: the block and the word it checked.
#[derive(Clone, Copy, Debug)]
pub struct FastHit {
    /// The cache block.
    pub cblock: u32,
    word: u64,
}

fn key(oblock: u64) -> u64 {
    (oblock + 1) << FLAG_BITS
}

impl HitIndex {
    /// An empty table for `nr_cblocks` cache blocks (one bucket per
    /// block, rounded up to a power of two).
    pub fn new(nr_cblocks: u32) -> HitIndex {
        let nr_buckets = (nr_cblocks.max(16) as usize).next_power_of_two();
        HitIndex {
            slots: (0..nr_cblocks)
                .map(|_| Slot {
                    next: AtomicU32::new(NONE),
                    ..Slot::default()
                })
                .collect(),
            buckets: (0..nr_buckets).map(|_| AtomicU32::new(NONE)).collect(),
            hash_shift: 64 - nr_buckets.trailing_zeros(),
            fast_hot: AtomicU64::new(0),
            fast_cold: AtomicU64::new(0),
        }
    }

    /// `hash_64(oblock, hash_bits)`.
    fn bucket(&self, oblock: u64) -> &AtomicU32 {
        let h = oblock.wrapping_mul(0x61C8_8646_80B5_83EB) >> self.hash_shift;
        &self.buckets[h as usize]
    }

    /// The cache block mapping `oblock` (the policy, under its lock: the
    /// table does not change during the walk).
    pub(super) fn lookup(&self, oblock: u64) -> Option<u32> {
        let want = key(oblock);
        let mut cb = self.bucket(oblock).load(Ordering::Relaxed);
        while cb != NONE {
            if self.slots[cb as usize].word.load(Ordering::Relaxed) & !FLAGS == want {
                return Some(cb);
            }
            cb = self.slots[cb as usize].next.load(Ordering::Relaxed);
        }
        None
    }

    /// Map `oblock` to `cblock` (the policy, under its lock).
    pub(super) fn insert(&self, oblock: u64, cblock: u32, flags: u64) {
        let head = self.bucket(oblock);
        self.slots[cblock as usize]
            .next
            .store(head.load(Ordering::Relaxed), Ordering::Relaxed);
        self.slots[cblock as usize]
            .word
            .store(key(oblock) | (flags & FLAGS), Ordering::SeqCst);
        head.store(cblock, Ordering::Release);
    }

    /// Unmap `cblock`, which maps `oblock` (the policy, under its lock).
    /// Its link is left as it was, so a walk standing on it goes on.
    pub(super) fn remove(&self, oblock: u64, cblock: u32) {
        let head = self.bucket(oblock);
        let next = self.slots[cblock as usize].next.load(Ordering::Relaxed);
        let mut at = head;
        loop {
            let cb = at.load(Ordering::Relaxed);
            if cb == NONE {
                debug_assert!(false, "removing an unmapped cache block");
                break;
            }
            if cb == cblock {
                at.store(next, Ordering::Release);
                break;
            }
            at = &self.slots[cb as usize].next;
        }
        self.slots[cblock as usize].word.store(0, Ordering::SeqCst);
    }

    /// Set or clear `flag` of a mapped `cblock` (the policy, under its
    /// lock; an unmapped block stays unmapped).
    pub(super) fn set_flag(&self, cblock: u32, flag: u64, on: bool) {
        let s = &self.slots[cblock as usize].word;
        let w = s.load(Ordering::Relaxed);
        if w == 0 {
            return;
        }
        let n = if on { w | flag } else { w & !flag };
        if n != w {
            s.store(n, Ordering::SeqCst);
        }
    }

    /// Clear `flag` on every block (the policy, under its lock).
    pub(super) fn clear_all(&self, flag: u64) {
        for s in self.slots.iter().map(|s| &s.word) {
            let w = s.load(Ordering::Relaxed);
            if w & flag != 0 {
                s.store(w & !flag, Ordering::SeqCst);
            }
        }
    }

    /// The in-flight count of `cblock`, if there is such a block.
    #[inline]
    pub fn inflight(&self, cblock: u64) -> Option<&AtomicU32> {
        self.slots.get(cblock as usize).map(|s| &s.inflight)
    }

    /// A read of `oblock` the fast path may serve, without the lock: the
    /// block maps it, is not pending and was hit this period. Bounded;
    /// `None` sends the bio down the locked path.
    #[inline]
    pub fn find_fast(&self, oblock: u64) -> Option<FastHit> {
        let want = key(oblock);
        let mut cb = self.bucket(oblock).load(Ordering::Acquire);
        for _ in 0..MAX_WALK {
            if cb == NONE {
                return None;
            }
            let word = self.slots.get(cb as usize)?.word.load(Ordering::Acquire);
            if word & !FLAGS == want {
                return (word & (PENDING | HIT) == HIT).then_some(FastHit { cblock: cb, word });
            }
            cb = self.slots[cb as usize].next.load(Ordering::Acquire);
        }
        None
    }

    /// Start loading the bucket of `oblock` into the CPU cache, for a
    /// lookup soon after ([`HitIndex::find_fast`]).
    #[inline]
    pub fn prefetch_bucket(&self, oblock: u64) {
        prefetch(self.bucket(oblock).as_ptr().cast());
    }

    /// Start loading the first block of `oblock`'s chain, whose bucket
    /// [`HitIndex::prefetch_bucket`] asked for earlier.
    #[inline]
    pub fn prefetch_head(&self, oblock: u64) {
        let cb = self.bucket(oblock).load(Ordering::Relaxed);
        if let Some(s) = self.slots.get(cb as usize) {
            prefetch(s.word.as_ptr().cast());
        }
    }

    /// Confirm a fast hit after its I/O was counted in flight to the
    /// block (`inflight` incremented with `SeqCst` before this): the
    /// block still maps the same origin block and is still not pending.
    /// On true, the hit is counted in the stats by the block's level.
    #[inline]
    pub fn confirm(&self, hit: FastHit) -> bool {
        let word = self.slots[hit.cblock as usize].word.load(Ordering::SeqCst);
        if word & !FLAGS != hit.word & !FLAGS || word & (PENDING | HIT) != HIT {
            return false;
        }
        if word & HOT != 0 {
            &self.fast_hot
        } else {
            &self.fast_cold
        }
        .fetch_add(1, Ordering::Relaxed);
        true
    }

    /// The fast path's (hits, misses) by level since the last call, for
    /// the policy's cache stats.
    pub(super) fn take_fast_stats(&self) -> (u32, u32) {
        let h = self.fast_hot.swap(0, Ordering::Relaxed);
        let m = self.fast_cold.swap(0, Ordering::Relaxed);
        (h as u32, m as u32)
    }
}

/// A hint to load the line holding `p` (x86's `prefetcht0`); nothing
/// on other architectures.
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch only hints the CPU; it never faults nor reads
    // into the program, whatever the address (and `p` is in this table).
    unsafe {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    #[test]
    fn lookup_insert_remove_and_flags() {
        let ix = HitIndex::new(8);
        for cb in 0..8 {
            ix.insert(cb as u64 * 1000, cb, HIT);
        }
        for cb in 0..8 {
            assert_eq!(ix.lookup(cb as u64 * 1000), Some(cb));
            assert_eq!(ix.find_fast(cb as u64 * 1000).unwrap().cblock, cb);
        }
        assert_eq!(ix.lookup(1), None);
        ix.remove(3000, 3);
        assert_eq!(ix.lookup(3000), None);
        assert!(ix.find_fast(3000).is_none());
        ix.set_flag(4, PENDING, true);
        assert!(ix.find_fast(4000).is_none(), "a pending block is slow");
        assert_eq!(ix.lookup(4000), Some(4));
        ix.clear_all(HIT);
        assert!(ix.find_fast(5000).is_none(), "a first hit is slow");
        ix.set_flag(5, HIT, true);
        ix.set_flag(5, HOT, true);
        let h = ix.find_fast(5000).unwrap();
        assert!(ix.confirm(h));
        assert_eq!(ix.take_fast_stats(), (1, 0));
        assert_eq!(ix.take_fast_stats(), (0, 0));
    }

    /// Readers take fast hits while a writer keeps moving origin blocks
    /// between cache blocks as a migration does (mark pending, wait for
    /// the I/O in flight, change the data and the mapping): a confirmed
    /// hit always reads the data of the origin block it asked for.
    #[test]
    fn fast_hits_never_see_another_blocks_data_under_migrations() {
        const CB: u32 = 4;
        const OB: u64 = 6;
        let ix = Arc::new(HitIndex::new(CB));
        let data: Arc<Vec<AtomicU64>> = Arc::new((0..CB).map(|_| AtomicU64::new(0)).collect());
        let stop = Arc::new(AtomicBool::new(false));
        // Origin block cb (of 0..CB) starts in cache block cb.
        for cb in 0..CB {
            data[cb as usize].store(cb as u64, Ordering::SeqCst);
            ix.insert(cb as u64, cb, HIT);
        }
        let readers: Vec<_> = (0..3)
            .map(|t| {
                let (ix, data, stop) = (ix.clone(), data.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut hits = 0u64;
                    let mut ob = t as u64;
                    while !stop.load(Ordering::Relaxed) {
                        ob = (ob * 7 + 3) % OB;
                        let Some(h) = ix.find_fast(ob) else { continue };
                        let n = ix.inflight(h.cblock as u64).unwrap();
                        n.fetch_add(1, Ordering::SeqCst);
                        if ix.confirm(h) {
                            assert_eq!(data[h.cblock as usize].load(Ordering::SeqCst), ob);
                            hits += 1;
                        }
                        n.fetch_sub(1, Ordering::SeqCst);
                    }
                    hits
                })
            })
            .collect();
        // The writer: move origin blocks in and out, as demote + promote.
        let mut owner: Vec<Option<u64>> = (0..CB as u64).map(Some).collect();
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(300);
        let mut i = 0u64;
        while std::time::Instant::now() < deadline {
            i += 1;
            let cb = (i * 5 % CB as u64) as u32;
            if let Some(ob) = owner[cb as usize] {
                ix.set_flag(cb, PENDING, true);
                while ix.inflight(cb as u64).unwrap().load(Ordering::SeqCst) != 0 {
                    std::hint::spin_loop();
                }
                ix.remove(ob, cb);
                owner[cb as usize] = None;
            } else {
                let taken: Vec<u64> = owner.iter().flatten().copied().collect();
                let ob = (0..OB).find(|o| !taken.contains(o) && (o + i).is_multiple_of(2));
                let Some(ob) = ob.or_else(|| (0..OB).find(|o| !taken.contains(o))) else {
                    continue;
                };
                while ix.inflight(cb as u64).unwrap().load(Ordering::SeqCst) != 0 {
                    std::hint::spin_loop();
                }
                data[cb as usize].store(ob, Ordering::SeqCst);
                ix.insert(ob, cb, HIT);
                owner[cb as usize] = Some(ob);
            }
        }
        stop.store(true, Ordering::Relaxed);
        let hits: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
        assert!(hits > 0, "the readers took no fast hit");
    }
}
