//! The smq policy's building blocks (`dm-cache-policy-smq.c`'s
//! `entry_space`, `ilist`, `queue`, `stats` and `entry_alloc`): entries
//! in one array linked by index, multilevel queues with the kernel's
//! redistribution and requeue-with-swap, and the hit statistics that
//! steer promotion. Sentinel entries are counted nowhere, as there.

use super::smq::{FP_SHIFT, NULL};

#[derive(Clone, Copy, Default)]
pub(super) struct Entry {
    pub(super) next: u32,
    pub(super) prev: u32,
    pub(super) level: u32,
    pub(super) oblock: u64,
    pub(super) dirty: bool,
    pub(super) allocated: bool,
    pub(super) sentinel: bool,
    pub(super) pending: bool,
}

#[derive(Clone, Copy)]
pub(super) struct IList {
    pub(super) nr_elts: u32,
    pub(super) head: u32,
    pub(super) tail: u32,
}

impl IList {
    const EMPTY: IList = IList {
        nr_elts: 0,
        head: NULL,
        tail: NULL,
    };
}

/// The entry array and its lists (`struct entry_space` + `ilist`).
pub(super) struct Space(pub(super) Vec<Entry>);

impl Space {
    pub(super) fn add_tail(&mut self, l: &mut IList, i: u32) {
        let tail = l.tail;
        self.0[i as usize].next = NULL;
        self.0[i as usize].prev = tail;
        if tail == NULL {
            l.head = i;
        } else {
            self.0[tail as usize].next = i;
        }
        l.tail = i;
        if !self.0[i as usize].sentinel {
            l.nr_elts += 1;
        }
    }
    pub(super) fn add_head(&mut self, l: &mut IList, i: u32) {
        let head = l.head;
        self.0[i as usize].prev = NULL;
        self.0[i as usize].next = head;
        if head == NULL {
            l.tail = i;
        } else {
            self.0[head as usize].prev = i;
        }
        l.head = i;
        if !self.0[i as usize].sentinel {
            l.nr_elts += 1;
        }
    }
    pub(super) fn add_before(&mut self, l: &mut IList, old: u32, i: u32) {
        let prev = self.0[old as usize].prev;
        if prev == NULL {
            return self.add_head(l, i);
        }
        self.0[i as usize].prev = prev;
        self.0[i as usize].next = old;
        self.0[prev as usize].next = i;
        self.0[old as usize].prev = i;
        if !self.0[i as usize].sentinel {
            l.nr_elts += 1;
        }
    }
    pub(super) fn del(&mut self, l: &mut IList, i: u32) {
        let Entry { prev, next, .. } = self.0[i as usize];
        if prev == NULL {
            l.head = next;
        } else {
            self.0[prev as usize].next = next;
        }
        if next == NULL {
            l.tail = prev;
        } else {
            self.0[next as usize].prev = prev;
        }
        if !self.0[i as usize].sentinel {
            l.nr_elts -= 1;
        }
    }
    pub(super) fn pop_head(&mut self, l: &mut IList) -> Option<u32> {
        let mut i = l.head;
        while i != NULL {
            if !self.0[i as usize].sentinel {
                self.del(l, i);
                return Some(i);
            }
            i = self.0[i as usize].next;
        }
        None
    }
    pub(super) fn pop_tail(&mut self, l: &mut IList) -> Option<u32> {
        let mut i = l.tail;
        while i != NULL {
            if !self.0[i as usize].sentinel {
                self.del(l, i);
                return Some(i);
            }
            i = self.0[i as usize].prev;
        }
        None
    }
}

/// A multilevel queue (`struct queue`).
pub(super) struct Queue {
    pub(super) nr_elts: u32,
    pub(super) qs: Vec<IList>,
    pub(super) last_target_nr_elts: u32,
    pub(super) nr_top_levels: u32,
    pub(super) nr_in_top_levels: u32,
    pub(super) target_count: Vec<u32>,
}

impl Queue {
    pub(super) fn new(nr_levels: u32) -> Queue {
        Queue {
            nr_elts: 0,
            qs: vec![IList::EMPTY; nr_levels as usize],
            last_target_nr_elts: 0,
            nr_top_levels: 0,
            nr_in_top_levels: 0,
            target_count: vec![0; nr_levels as usize],
        }
    }
    pub(super) fn nr_levels(&self) -> u32 {
        self.qs.len() as u32
    }
    pub(super) fn push(&mut self, es: &mut Space, i: u32) {
        if !es.0[i as usize].sentinel {
            self.nr_elts += 1;
        }
        let lvl = es.0[i as usize].level as usize;
        es.add_tail(&mut self.qs[lvl], i);
    }
    pub(super) fn push_front(&mut self, es: &mut Space, i: u32) {
        if !es.0[i as usize].sentinel {
            self.nr_elts += 1;
        }
        let lvl = es.0[i as usize].level as usize;
        es.add_head(&mut self.qs[lvl], i);
    }
    pub(super) fn push_before(&mut self, es: &mut Space, old: u32, i: u32) {
        if !es.0[i as usize].sentinel {
            self.nr_elts += 1;
        }
        let lvl = es.0[i as usize].level as usize;
        es.add_before(&mut self.qs[lvl], old, i);
    }
    pub(super) fn del(&mut self, es: &mut Space, i: u32) {
        let lvl = es.0[i as usize].level as usize;
        es.del(&mut self.qs[lvl], i);
        if !es.0[i as usize].sentinel {
            self.nr_elts -= 1;
        }
    }
    /// `q_peek`: the oldest entry of the lowest populated level.
    pub(super) fn peek(&self, es: &Space, max_level: u32, can_cross_sentinel: bool) -> Option<u32> {
        for l in &self.qs[..max_level.min(self.nr_levels()) as usize] {
            let mut i = l.head;
            while i != NULL {
                if !es.0[i as usize].sentinel {
                    return Some(i);
                }
                if !can_cross_sentinel {
                    break;
                }
                i = es.0[i as usize].next;
            }
        }
        None
    }
    pub(super) fn pop(&mut self, es: &mut Space) -> Option<u32> {
        let i = self.peek(es, self.nr_levels(), true)?;
        self.del(es, i);
        Some(i)
    }
    pub(super) fn set_targets_subrange(&mut self, nr_elts: u32, lbegin: u32, lend: u32) {
        let nr_levels = lend - lbegin;
        let per = nr_elts.checked_div(nr_levels).unwrap_or(0);
        let rem = nr_elts.checked_rem(nr_levels).unwrap_or(0);
        for level in lbegin..lend {
            self.target_count[level as usize] = per + (level < lbegin + rem) as u32;
        }
    }
    pub(super) fn set_targets(&mut self) {
        if self.last_target_nr_elts == self.nr_elts {
            return;
        }
        self.last_target_nr_elts = self.nr_elts;
        let n = self.nr_levels();
        if self.nr_top_levels > n {
            self.set_targets_subrange(self.nr_elts, 0, n);
        } else {
            let top = n - self.nr_top_levels;
            self.set_targets_subrange(self.nr_in_top_levels, top, n);
            let rest = self.nr_elts.saturating_sub(self.nr_in_top_levels);
            self.set_targets_subrange(rest, 0, top);
        }
    }
    /// `q_redistribute`: move entries between levels to meet the targets.
    pub(super) fn redistribute(&mut self, es: &mut Space) {
        self.set_targets();
        for level in 0..self.nr_levels() as usize - 1 {
            let target = self.target_count[level];
            while self.qs[level].nr_elts < target {
                let mut found = None;
                for above in level + 1..self.qs.len() {
                    if let Some(i) = es.pop_head(&mut self.qs[above]) {
                        found = Some(i);
                        break;
                    }
                }
                let Some(i) = found else { break };
                es.0[i as usize].level = level as u32;
                es.add_tail(&mut self.qs[level], i);
            }
            while self.qs[level].nr_elts > target {
                let Some(i) = es.pop_tail(&mut self.qs[level]) else {
                    break;
                };
                es.0[i as usize].level = level as u32 + 1;
                es.add_tail(&mut self.qs[level + 1], i);
            }
        }
    }
    /// `q_requeue`: move `e` up `extra` levels, swapping an entry of the
    /// new level down into its place (before the sentinels `s`); returns
    /// the entry swapped down.
    pub(super) fn requeue(
        &mut self,
        es: &mut Space,
        e: u32,
        extra: u32,
        s: Option<(u32, u32)>,
    ) -> Option<u32> {
        let level = es.0[e as usize].level;
        let new_level = (self.nr_levels() - 1).min(level + extra);
        let mut swapped = None;
        if extra > 0 && level < self.nr_levels() - 1 {
            let mut passed = 0;
            let mut de = self.qs[new_level as usize].head;
            while de != NULL && es.0[de as usize].sentinel {
                passed += 1;
                de = es.0[de as usize].next;
            }
            if de != NULL {
                self.del(es, de);
                es.0[de as usize].level = level;
                match (s, passed) {
                    (Some((s1, _)), 0) => self.push_before(es, s1, de),
                    (Some((_, s2)), 1) => self.push_before(es, s2, de),
                    _ => self.push(es, de),
                }
                swapped = Some(de);
            }
        }
        self.del(es, e);
        es.0[e as usize].level = new_level;
        self.push(es, e);
        swapped
    }
}

#[derive(Default)]
pub(super) struct Stats {
    pub(super) hit_threshold: u32,
    pub(super) hits: u32,
    pub(super) misses: u32,
}

#[derive(PartialEq)]
pub(super) enum Perf {
    Poor,
    Fair,
    Well,
}

impl Stats {
    pub(super) fn new(nr_levels: u32) -> Stats {
        Stats {
            hit_threshold: nr_levels * 3 / 4,
            ..Stats::default()
        }
    }
    pub(super) fn accessed(&mut self, level: u32) {
        if level >= self.hit_threshold {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
    }
    pub(super) fn assess(&self) -> Perf {
        let c = (self.hits << FP_SHIFT)
            .checked_div(self.hits + self.misses)
            .unwrap_or(0);
        if c < 1 << (FP_SHIFT - 4) {
            Perf::Poor
        } else if c < 1 << (FP_SHIFT - 3) {
            Perf::Fair
        } else {
            Perf::Well
        }
    }
}

/// An entry allocator over a range of the space (`struct entry_alloc`).
pub(super) struct Alloc {
    pub(super) begin: u32,
    pub(super) nr_allocated: u32,
    pub(super) free: IList,
}

impl Alloc {
    pub(super) fn new(es: &mut Space, begin: u32, end: u32) -> Alloc {
        let mut free = IList::EMPTY;
        for i in begin..end {
            es.add_tail(&mut free, i);
        }
        Alloc {
            begin,
            nr_allocated: 0,
            free,
        }
    }
    pub(super) fn init(es: &mut Space, i: u32) {
        let e = &mut es.0[i as usize];
        *e = Entry {
            next: NULL,
            prev: NULL,
            dirty: true,
            allocated: true,
            ..Entry::default()
        };
    }
    pub(super) fn alloc(&mut self, es: &mut Space) -> Option<u32> {
        let i = es.pop_head(&mut self.free)?;
        Alloc::init(es, i);
        self.nr_allocated += 1;
        Some(i)
    }
    pub(super) fn alloc_particular(&mut self, es: &mut Space, index: u32) -> u32 {
        let i = self.begin + index;
        es.del(&mut self.free, i);
        Alloc::init(es, i);
        self.nr_allocated += 1;
        i
    }
    pub(super) fn free(&mut self, es: &mut Space, i: u32) {
        self.nr_allocated -= 1;
        es.0[i as usize].allocated = false;
        es.add_tail(&mut self.free, i);
    }
    pub(super) fn empty(&self) -> bool {
        self.free.head == NULL
    }
}
