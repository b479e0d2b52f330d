//! The stochastic multiqueue policy (`drivers/md/dm-cache-policy-smq.c`)
//! and its `cleaner` variant: which origin blocks live in the cache.
//!
//! Structure as the kernel's: every entry (sentinels, hotspot entries,
//! cache entries) lives in one array and is linked by index; three
//! multilevel queues (`hotspot`, `clean`, `dirty`, 64 levels each) order
//! them by how often they were hit. Misses feed the hotspot queue (blocks
//! of 16 cache blocks); a hotspot block that climbs above the promote
//! level gets its origin block promoted. When the cache is full, clean
//! entries of the bottom half of the clean queue are demoted; dirty
//! entries are written back when the target is idle (or always, for the
//! cleaner). Sentinels, swapped every writeback / demote period, mark
//! which entries have not been hit for a period, so busy writeback only
//! cleans entries older than that.
//!
//! The mapping table is [`HitIndex`], index-chained as the kernel's, and
//! mirrors each cache block's pending bit, hit bit and whether its level
//! counts as a hit, so that a read hit that would change nothing here
//! but the cache stats is served without the policy lock and counted in
//! at the next tick (`hits.rs`).
//!
//! Differences: the hotspot table is a `HashMap` with a fast non-keyed
//! hash (foldhash) rather than the kernel's index-chained buckets, and
//! the background tracker is a bounded queue inside the policy.

use super::hits::{HitIndex, HIT, HOT, PENDING};
use super::queue::{Alloc, Entry, Perf, Queue, Space, Stats};
use foldhash::{HashMap, HashSet};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

const NR_HOTSPOT_LEVELS: u32 = 64;
const NR_CACHE_LEVELS: u32 = 64;
const WRITEBACK_PERIOD: Duration = Duration::from_secs(10);
const DEMOTE_PERIOD: Duration = Duration::from_secs(60);
const HOTSPOT_UPDATE_PERIOD: Duration = Duration::from_secs(1);
const CACHE_UPDATE_PERIOD: Duration = Duration::from_secs(60);
const FREE_TARGET: u32 = 25;
/// `btracker_create(4096)`: background work queued at most.
const MAX_WORK: usize = 4096;
pub(super) const NULL: u32 = u32::MAX;
pub(super) const FP_SHIFT: u32 = 8;

/// What the policy asks the target to do (`enum policy_operation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkOp {
    /// Copy `oblock` from the origin into `cblock`.
    Promote,
    /// Drop the (clean) mapping of `cblock`.
    Demote,
    /// Copy `cblock` back to `oblock` on the origin.
    Writeback,
}

/// `struct policy_work`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Work {
    /// What to do.
    pub op: WorkOp,
    /// The origin block.
    pub oblock: u64,
    /// The cache block.
    pub cblock: u32,
}

/// The smq policy (`struct smq_policy`); `cleaner` and `mq` are
/// variants of it as in the kernel.
pub struct Smq {
    name: &'static str,
    es: Space,
    cache_size: u32,
    nr_hotspot_blocks: u32,
    cache_blocks_per_hotspot_block: u64,
    hotspot_level_jump: u32,
    wb_sentinels: u32,
    demote_sentinels: u32,
    hotspot_alloc: Alloc,
    cache_alloc: Alloc,
    hotspot_hit_bits: Vec<bool>,
    cache_hit_bits: Vec<bool>,
    hotspot: Queue,
    clean: Queue,
    dirty: Queue,
    hotspot_stats: Stats,
    cache_stats: Stats,
    table: Arc<HitIndex>,
    hotspot_table: HashMap<u64, u32>,
    current_wb_sentinels: bool,
    next_wb_period: Instant,
    current_demote_sentinels: bool,
    next_demote_period: Instant,
    write_promote_level: u32,
    read_promote_level: u32,
    next_hotspot_period: Instant,
    next_cache_period: Instant,
    work: VecDeque<Work>,
    promotions_queued: HashSet<u64>,
    demotions_queued: u32,
    migrations_allowed: bool,
    cleaner: bool,
}

/// The policies the target knows and the name a table gives each.
pub const POLICIES: &[&str] = &["smq", "mq", "cleaner", "default"];

/// Bytes of hint per cache block every policy stores (`hint_size`).
pub const HINT_SIZE: u32 = 4;
/// `.version = {2, 0, 0}`.
pub const VERSION: [u32; 3] = [2, 0, 0];

impl Smq {
    /// `dm_cache_policy_create(name, ...)`; `None` for an unknown name.
    pub fn create(
        name: &str,
        cache_size: u32,
        origin_sectors: u64,
        block_sectors: u64,
    ) -> Option<Smq> {
        let (name, mimic_mq, cleaner): (&'static str, bool, bool) = match name {
            "smq" | "default" => ("smq", false, false),
            "mq" => ("mq", true, false),
            "cleaner" => ("cleaner", false, true),
            _ => return None,
        };
        let _ = mimic_mq;
        let (hs_size, nr_hotspot) = calc_hotspot_params(origin_sectors, block_sectors, cache_size);
        let per_sentinels = 2 * NR_CACHE_LEVELS;
        let total_sentinels = 2 * per_sentinels;
        let n = total_sentinels + nr_hotspot + cache_size;
        let mut es = Space(vec![Entry::default(); n as usize]);
        for i in 0..total_sentinels {
            es.0[i as usize].sentinel = true;
        }
        let hotspot_alloc = Alloc::new(&mut es, total_sentinels, total_sentinels + nr_hotspot);
        let cache_alloc = Alloc::new(&mut es, total_sentinels + nr_hotspot, n);
        let mut hotspot = Queue::new(NR_HOTSPOT_LEVELS);
        let per_hs = (hs_size / block_sectors).max(1);
        hotspot.nr_top_levels = 8;
        hotspot.nr_in_top_levels =
            (nr_hotspot / NR_HOTSPOT_LEVELS).min((cache_size as u64 / per_hs) as u32);
        let now = Instant::now();
        let mut p = Smq {
            name,
            es,
            cache_size,
            nr_hotspot_blocks: nr_hotspot,
            cache_blocks_per_hotspot_block: per_hs,
            hotspot_level_jump: 1,
            wb_sentinels: 0,
            demote_sentinels: per_sentinels,
            hotspot_alloc,
            cache_alloc,
            hotspot_hit_bits: vec![false; nr_hotspot as usize],
            cache_hit_bits: vec![false; cache_size as usize],
            hotspot,
            clean: Queue::new(NR_CACHE_LEVELS),
            dirty: Queue::new(NR_CACHE_LEVELS),
            hotspot_stats: Stats::new(NR_HOTSPOT_LEVELS),
            cache_stats: Stats::new(NR_CACHE_LEVELS),
            table: Arc::new(HitIndex::new(cache_size)),
            hotspot_table: HashMap::default(),
            current_wb_sentinels: false,
            next_wb_period: now + WRITEBACK_PERIOD,
            current_demote_sentinels: false,
            next_demote_period: now + DEMOTE_PERIOD,
            write_promote_level: NR_HOTSPOT_LEVELS,
            read_promote_level: NR_HOTSPOT_LEVELS,
            next_hotspot_period: now,
            next_cache_period: now,
            work: VecDeque::new(),
            promotions_queued: HashSet::default(),
            demotions_queued: 0,
            migrations_allowed: !cleaner,
            cleaner,
        };
        p.sentinels_init();
        Some(p)
    }

    /// The policy's name as status shows it.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// `emit_config_values`: `mq` shows its old tunables, others none.
    pub fn config_values(&self) -> &'static str {
        if self.name == "mq" {
            "10 random_threshold 0 sequential_threshold 0 discard_promote_adjustment 0 read_promote_adjustment 0 write_promote_adjustment 0"
        } else {
            "0"
        }
    }

    /// `set_config_value`: only `mq` accepts (and ignores) its old
    /// tunables; smq and cleaner have none (`-EINVAL`).
    pub fn set_config_value(&mut self, key: &str, value: &str) -> bool {
        if self.name != "mq" || value.parse::<u64>().is_err() {
            return false;
        }
        let known = [
            "random_threshold",
            "sequential_threshold",
            "discard_promote_adjustment",
            "read_promote_adjustment",
            "write_promote_adjustment",
        ];
        if known.iter().any(|k| k.eq_ignore_ascii_case(key)) {
            tracing::warn!(
                key,
                "tunable no longer has any effect, mq policy is now an alias for smq"
            );
            return true;
        }
        false
    }

    /// `allow_migrations` (passthrough mode turns them off).
    pub fn allow_migrations(&mut self, allow: bool) {
        self.migrations_allowed = allow;
    }

    fn sentinel(&self, writeback: bool, level: u32, which: bool) -> u32 {
        let base = if writeback {
            self.wb_sentinels
        } else {
            self.demote_sentinels
        };
        base + if which {
            level
        } else {
            NR_CACHE_LEVELS + level
        }
    }

    fn sentinels_init(&mut self) {
        for which in [false, true] {
            for level in 0..NR_CACHE_LEVELS {
                let s = self.sentinel(true, level, which);
                self.es.0[s as usize].level = level;
                self.dirty.push(&mut self.es, s);
                let s = self.sentinel(false, level, which);
                self.es.0[s as usize].level = level;
                self.clean.push(&mut self.es, s);
            }
        }
        self.current_wb_sentinels = true;
        self.current_demote_sentinels = true;
    }

    fn update_sentinels(&mut self, now: Instant) {
        if now > self.next_wb_period {
            self.next_wb_period = now + WRITEBACK_PERIOD;
            self.current_wb_sentinels = !self.current_wb_sentinels;
            for level in 0..NR_CACHE_LEVELS {
                let s = self.sentinel(true, level, self.current_wb_sentinels);
                self.dirty.del(&mut self.es, s);
                self.dirty.push(&mut self.es, s);
            }
        }
        if now > self.next_demote_period {
            self.next_demote_period = now + DEMOTE_PERIOD;
            self.current_demote_sentinels = !self.current_demote_sentinels;
            for level in 0..NR_CACHE_LEVELS {
                let s = self.sentinel(false, level, self.current_demote_sentinels);
                self.clean.del(&mut self.es, s);
                self.clean.push(&mut self.es, s);
            }
        }
    }

    fn cblock_of(&self, e: u32) -> u32 {
        e - self.cache_alloc.begin
    }

    fn entry_of(&self, cblock: u32) -> u32 {
        self.cache_alloc.begin + cblock
    }

    fn push_queue(&mut self, e: u32) {
        self.with_queue(e, |q, es| q.push(es, e));
    }

    fn with_queue(&mut self, e: u32, f: impl FnOnce(&mut Queue, &mut Space)) {
        let dirty = self.es.0[e as usize].dirty;
        let q = if dirty {
            &mut self.dirty
        } else {
            &mut self.clean
        };
        f(q, &mut self.es);
    }

    fn requeue(&mut self, e: u32) {
        if self.es.0[e as usize].pending {
            return;
        }
        let cb = self.cblock_of(e);
        if std::mem::replace(&mut self.cache_hit_bits[cb as usize], true) {
            return;
        }
        self.table.set_flag(cb, HIT, true);
        let swapped = if !self.es.0[e as usize].dirty {
            self.clean.requeue(&mut self.es, e, 1, None)
        } else {
            let level = self.es.0[e as usize].level;
            let s1 = self.sentinel(true, level, !self.current_wb_sentinels);
            let s2 = self.sentinel(true, level, self.current_wb_sentinels);
            self.dirty.requeue(&mut self.es, e, 1, Some((s1, s2)))
        };
        self.sync_hot(e);
        if let Some(d) = swapped {
            self.sync_hot(d);
        }
    }

    /// The table's flags of a cache entry as the kernel's state of it
    /// has them (set on insertion).
    fn flags_of(&self, e: u32) -> u64 {
        let en = &self.es.0[e as usize];
        let mut f = 0;
        if en.pending {
            f |= PENDING;
        }
        if self.cache_hit_bits[self.cblock_of(e) as usize] {
            f |= HIT;
        }
        if en.level >= self.cache_stats.hit_threshold {
            f |= HOT;
        }
        f
    }

    /// Mirror a cache entry's level into the table's `HOT` flag.
    fn sync_hot(&self, e: u32) {
        if e >= self.cache_alloc.begin && self.es.0[e as usize].allocated {
            let hot = self.es.0[e as usize].level >= self.cache_stats.hit_threshold;
            self.table.set_flag(self.cblock_of(e), HOT, hot);
        }
    }

    /// Mark a cache entry pending (or not), in the table too.
    fn set_pending(&mut self, e: u32, pending: bool) {
        self.es.0[e as usize].pending = pending;
        if e >= self.cache_alloc.begin {
            self.table.set_flag(self.cblock_of(e), PENDING, pending);
        }
    }

    /// The mapping table, which the target reads without the lock.
    pub fn index(&self) -> Arc<HitIndex> {
        self.table.clone()
    }

    fn default_promote_level(&self) -> u32 {
        const TABLE: [u32; 17] = [1, 1, 1, 2, 4, 6, 7, 8, 7, 6, 4, 4, 3, 3, 2, 2, 1];
        let (h, m) = (self.cache_stats.hits, self.cache_stats.misses);
        TABLE[(h << 4).checked_div(h + m).unwrap_or(0).min(16) as usize]
    }

    fn update_promote_levels(&mut self) {
        let mut t = if self.cache_alloc.empty() {
            self.default_promote_level()
        } else {
            NR_HOTSPOT_LEVELS / 2
        };
        // The kernel's `max(threshold_level, NR_HOTSPOT_LEVELS)`.
        t = t.max(NR_HOTSPOT_LEVELS);
        match self.hotspot_stats.assess() {
            Perf::Poor => t /= 4,
            Perf::Fair => t /= 2,
            Perf::Well => {}
        }
        self.read_promote_level = NR_HOTSPOT_LEVELS - t;
        self.write_promote_level = NR_HOTSPOT_LEVELS - t;
    }

    /// `smq_tick`: once per tick of the core (a bio completion after
    /// the previous tick).
    pub fn tick(&mut self) {
        let now = Instant::now();
        let (hits, misses) = self.table.take_fast_stats();
        self.cache_stats.hits += hits;
        self.cache_stats.misses += misses;
        self.update_sentinels(now);
        self.hotspot_hit_bits.iter_mut().for_each(|b| *b = false);
        self.update_promote_levels();
        if now > self.next_hotspot_period {
            self.hotspot_level_jump = match self.hotspot_stats.assess() {
                Perf::Poor => 4,
                Perf::Fair => 2,
                Perf::Well => 1,
            };
            self.hotspot.redistribute(&mut self.es);
            self.hotspot_stats.hits = 0;
            self.hotspot_stats.misses = 0;
            self.next_hotspot_period = now + HOTSPOT_UPDATE_PERIOD;
        }
        if now > self.next_cache_period {
            self.cache_hit_bits.iter_mut().for_each(|b| *b = false);
            self.table.clear_all(HIT);
            self.dirty.redistribute(&mut self.es);
            self.clean.redistribute(&mut self.es);
            for e in self.cache_alloc.begin..self.es.0.len() as u32 {
                self.sync_hot(e);
            }
            self.cache_stats.hits = 0;
            self.cache_stats.misses = 0;
            self.next_cache_period = now + CACHE_UPDATE_PERIOD;
        }
    }

    fn clean_target_met(&self, idle: bool) -> bool {
        if idle || self.cleaner {
            return self.dirty.nr_elts == 0;
        }
        true
    }

    fn free_target_met(&self) -> bool {
        let nr_free = self.cache_size - self.cache_alloc.nr_allocated;
        nr_free + self.demotions_queued >= self.cache_size * FREE_TARGET / 100
    }

    fn queue_work(&mut self, w: Work) -> bool {
        if self.work.len() >= MAX_WORK {
            return false;
        }
        match w.op {
            WorkOp::Promote => {
                self.promotions_queued.insert(w.oblock);
            }
            WorkOp::Demote => self.demotions_queued += 1,
            WorkOp::Writeback => {}
        }
        self.work.push_back(w);
        true
    }

    fn queue_writeback(&mut self, idle: bool) {
        let Some(e) = self.dirty.peek(&self.es, NR_CACHE_LEVELS, idle) else {
            return;
        };
        self.set_pending(e, true);
        self.dirty.del(&mut self.es, e);
        let w = Work {
            op: WorkOp::Writeback,
            oblock: self.es.0[e as usize].oblock,
            cblock: self.cblock_of(e),
        };
        if !self.queue_work(w) {
            self.set_pending(e, false);
            self.dirty.push_front(&mut self.es, e);
        }
    }

    fn queue_demotion(&mut self) {
        if !self.migrations_allowed {
            return;
        }
        let Some(e) = self.clean.peek(&self.es, NR_CACHE_LEVELS / 2, true) else {
            if !self.clean_target_met(true) {
                self.queue_writeback(false);
            }
            return;
        };
        self.set_pending(e, true);
        self.clean.del(&mut self.es, e);
        let w = Work {
            op: WorkOp::Demote,
            oblock: self.es.0[e as usize].oblock,
            cblock: self.cblock_of(e),
        };
        if !self.queue_work(w) {
            self.set_pending(e, false);
            self.clean.push_front(&mut self.es, e);
        }
    }

    fn queue_promotion(&mut self, oblock: u64) {
        if !self.migrations_allowed {
            return;
        }
        if self.cache_alloc.empty() {
            if !self.free_target_met() {
                self.queue_demotion();
            }
            return;
        }
        if self.promotions_queued.contains(&oblock) || self.work.len() >= MAX_WORK {
            return;
        }
        let Some(e) = self.cache_alloc.alloc(&mut self.es) else {
            return;
        };
        self.es.0[e as usize].pending = true;
        let cblock = self.cblock_of(e);
        self.queue_work(Work {
            op: WorkOp::Promote,
            oblock,
            cblock,
        });
    }

    fn update_hotspot_queue(&mut self, b: u64) -> Option<u32> {
        let hb = b / self.cache_blocks_per_hotspot_block;
        if let Some(&e) = self.hotspot_table.get(&hb) {
            self.hotspot_stats.accessed(self.es.0[e as usize].level);
            let hi = (e - self.hotspot_alloc.begin) as usize;
            let jump = if std::mem::replace(&mut self.hotspot_hit_bits[hi], true) {
                0
            } else {
                self.hotspot_level_jump
            };
            self.hotspot.requeue(&mut self.es, e, jump, None);
            return Some(e);
        }
        self.hotspot_stats.misses += 1;
        let e = match self.hotspot_alloc.alloc(&mut self.es) {
            Some(e) => e,
            None => {
                let e = self.hotspot.pop(&mut self.es)?;
                let old = self.es.0[e as usize].oblock;
                self.hotspot_table.remove(&old);
                self.hotspot_hit_bits[(e - self.hotspot_alloc.begin) as usize] = false;
                e
            }
        };
        self.es.0[e as usize].oblock = hb;
        self.es.0[e as usize].level = 0;
        self.hotspot.push(&mut self.es, e);
        self.hotspot_table.insert(hb, e);
        Some(e)
    }

    /// `smq_lookup`: the cache block holding `oblock`, counting the hit;
    /// on a miss, feed the hotspot queue and maybe queue a promotion.
    pub fn lookup(&mut self, oblock: u64, write: bool, fast_promote: bool) -> Option<u32> {
        if let Some(cb) = self.table.lookup(oblock) {
            let e = self.entry_of(cb);
            self.cache_stats.accessed(self.es.0[e as usize].level);
            self.requeue(e);
            return Some(self.cblock_of(e));
        }
        self.cache_stats.misses += 1;
        let hs = self.update_hotspot_queue(oblock)?;
        let level = self.es.0[hs as usize].level;
        let promote = if write {
            (!self.cache_alloc.empty() && fast_promote) || level >= self.write_promote_level
        } else {
            level >= self.read_promote_level
        };
        if promote {
            self.queue_promotion(oblock);
        }
        None
    }

    /// The cache block holding `oblock`, without counting anything (the
    /// target's own bookkeeping).
    pub fn peek_mapping(&self, oblock: u64) -> Option<u32> {
        self.table.lookup(oblock)
    }

    /// Background work is queued for the worker.
    pub fn has_work(&self) -> bool {
        !self.work.is_empty()
    }

    /// `smq_get_background_work`.
    pub fn background_work(&mut self, idle: bool) -> Option<Work> {
        if self.work.is_empty() && !self.clean_target_met(idle) {
            self.queue_writeback(idle);
        }
        self.work.pop_front()
    }

    /// `smq_complete_background_work`.
    pub fn complete(&mut self, w: Work, success: bool) {
        let e = self.entry_of(w.cblock);
        match w.op {
            WorkOp::Promote => {
                self.promotions_queued.remove(&w.oblock);
                self.es.0[e as usize].pending = false;
                if success {
                    let en = &mut self.es.0[e as usize];
                    en.oblock = w.oblock;
                    en.level = NR_CACHE_LEVELS - 1;
                    en.dirty = false;
                    self.table.insert(w.oblock, w.cblock, self.flags_of(e));
                    self.push_queue(e);
                } else {
                    self.cache_alloc.free(&mut self.es, e);
                }
            }
            WorkOp::Demote => {
                self.demotions_queued = self.demotions_queued.saturating_sub(1);
                if success {
                    self.table.remove(w.oblock, w.cblock);
                    self.es.0[e as usize].pending = false;
                    self.cache_alloc.free(&mut self.es, e);
                } else {
                    self.set_pending(e, false);
                    self.push_queue(e);
                }
            }
            WorkOp::Writeback => {
                self.set_pending(e, false);
                self.push_queue(e);
            }
        }
    }

    /// `smq_set_dirty` / `smq_clear_dirty`.
    pub fn set_dirty(&mut self, cblock: u32, dirty: bool) {
        let e = self.entry_of(cblock);
        if self.es.0[e as usize].pending {
            self.es.0[e as usize].dirty = dirty;
            return;
        }
        if self.es.0[e as usize].dirty == dirty {
            return;
        }
        self.with_queue(e, |q, es| q.del(es, e));
        self.es.0[e as usize].dirty = dirty;
        self.push_queue(e);
    }

    /// `smq_load_mapping`: a mapping read from the metadata, put ahead of
    /// both sentinels so it may be demoted or cleaned at once.
    pub fn load_mapping(&mut self, oblock: u64, cblock: u32, dirty: bool, hint: Option<u32>) {
        let e = self.cache_alloc.alloc_particular(&mut self.es, cblock);
        let en = &mut self.es.0[e as usize];
        en.oblock = oblock;
        en.dirty = dirty;
        en.level = match hint {
            Some(h) => h.min(NR_CACHE_LEVELS - 1),
            None => random_level(cblock),
        };
        self.table.insert(oblock, cblock, self.flags_of(e));
        self.with_queue(e, |q, es| q.push_front(es, e));
    }

    /// `smq_invalidate_mapping`; false if `cblock` holds nothing.
    pub fn invalidate(&mut self, cblock: u32) -> bool {
        let e = self.entry_of(cblock);
        let en = self.es.0[e as usize];
        if !en.allocated || en.pending {
            return false;
        }
        self.with_queue(e, |q, es| q.del(es, e));
        self.table.remove(en.oblock, cblock);
        self.cache_alloc.free(&mut self.es, e);
        true
    }

    /// `smq_get_hint`: the entry's level.
    pub fn hint(&self, cblock: u32) -> u32 {
        let e = &self.es.0[self.entry_of(cblock) as usize];
        if e.allocated {
            e.level
        } else {
            0
        }
    }

    /// `smq_residency`.
    pub fn residency(&self) -> u32 {
        self.cache_alloc.nr_allocated
    }

    /// Hotspot blocks tracked (for tests of the sizing).
    pub fn nr_hotspot_blocks(&self) -> u32 {
        self.nr_hotspot_blocks
    }
}

/// `random_level`: `hash_32(cblock, 9) & 63`.
fn random_level(cblock: u32) -> u32 {
    (cblock.wrapping_mul(0x61C8_8647) >> (32 - 9)) & (NR_CACHE_LEVELS - 1)
}

/// `calc_hotspot_params`: hotspot blocks of 16 cache blocks (halved
/// while they would cover more than the origin), at least 1024 of them.
fn calc_hotspot_params(origin_sectors: u64, block_sectors: u64, nr_cache: u32) -> (u64, u32) {
    let mut hs = block_sectors * 16;
    let nr = (nr_cache / 4).max(1024);
    while hs > block_sectors && hs * nr as u64 > origin_sectors {
        hs /= 2;
    }
    (hs, nr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hot_blocks_are_promoted_and_idle_dirty_ones_written_back() {
        let mut p = Smq::create("smq", 8, 1 << 20, 64).unwrap();
        let mut promoted = 0;
        for round in 0..200 {
            for b in 0..4u64 {
                if p.lookup(b, false, false).is_none() {
                    while let Some(w) = p.background_work(false) {
                        assert_eq!(w.op, WorkOp::Promote);
                        p.complete(w, true);
                        promoted += 1;
                    }
                }
            }
            if round % 10 == 0 {
                p.tick();
            }
        }
        assert!(promoted >= 1, "hot blocks get promoted");
        assert!(p.residency() as usize <= 8);
        for b in 0..4u64 {
            if let Some(c) = p.peek_mapping(b) {
                p.set_dirty(c, true);
            }
        }
        // Idle: dirty blocks are written back.
        let w = p.background_work(true);
        assert!(
            matches!(
                w,
                Some(Work {
                    op: WorkOp::Writeback,
                    ..
                })
            ),
            "{w:?}"
        );
    }

    #[test]
    fn cleaner_writes_back_and_never_promotes() {
        let mut p = Smq::create("cleaner", 8, 1 << 20, 64).unwrap();
        p.load_mapping(5, 2, true, None);
        for _ in 0..100 {
            assert_eq!(p.lookup(9, false, true), None);
        }
        let w = p.background_work(false).unwrap();
        assert_eq!((w.op, w.oblock, w.cblock), (WorkOp::Writeback, 5, 2));
        p.complete(w, true);
        p.set_dirty(2, false);
        assert_eq!(p.background_work(false), None);
        assert_eq!(p.lookup(5, false, false), Some(2));
    }
}
