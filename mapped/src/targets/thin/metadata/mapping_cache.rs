//! The mapping trees' answers kept in memory, so a thin device's I/O to
//! a block whose mapping was read before costs one hash lookup instead of
//! a walk down two btrees (`dm_thin_find_block` through
//! `persistent-data/dm-btree.c`): the binary searches of that walk touch
//! a few dozen cache lines spread over nodes of 4 KiB each, which on a
//! large pool are each a miss.
//!
//! The kernel keeps its metadata blocks in dm-bufio and walks the btrees
//! on every bio; this cache is blkstack's own and changes nothing on
//! disk. It holds, per thin device, pages of [`PAGE`] consecutive virtual
//! blocks, each entry unknown, known unmapped, or the packed
//! `block << 24 | time` value of the leaf. A lookup that reaches a leaf
//! fills every entry of the page the leaf answers for (the keys whose
//! own lookup would end in the same leaf, mapped or not), so a leaf is
//! walked to once, not once per block.
//!
//! Coherence: every change to a device's mapping tree goes through
//! [`super::PoolMetadata`], which updates the entry ([`MappingCache::set`])
//! or forgets the device ([`MappingCache::forget`]); an aborted
//! transaction builds a new `PoolMetadata`, and with it an empty cache.

pub use crate::persistent_data::btree::LeafSpan;
use crate::persistent_data::tm::BlockHasher;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

/// Virtual blocks per page: a page is 4 KiB of entries.
pub const PAGE: u64 = 512;
/// Pages kept at most (32 MiB of entries; 4 M blocks, 256 GiB of 64 KiB
/// blocks): past it the cache starts again empty.
pub const MAX_PAGES: usize = 8192;

const UNKNOWN: u64 = u64::MAX;
const UNMAPPED: u64 = u64::MAX - 1;

type Page = Box<[u64; PAGE as usize]>;

/// The cache itself: per thin device, pages of mapping values keyed by
/// (device, page number); see the module documentation.
#[derive(Default)]
pub struct MappingCache {
    pages: HashMap<(u64, u64), Page, BuildHasherDefault<BlockHasher>>,
}

impl MappingCache {
    /// The cached mapping of `vblock` in `dev`: `None` if not known,
    /// `Some(None)` if known unmapped.
    #[inline]
    pub fn get(&self, dev: u64, vblock: u64) -> Option<Option<u64>> {
        let page = self.pages.get(&(dev, vblock / PAGE))?;
        match page[(vblock % PAGE) as usize] {
            UNKNOWN => None,
            UNMAPPED => Some(None),
            v => Some(Some(v)),
        }
    }

    /// Record what `span` says about the keys of `key`'s page.
    pub fn fill(&mut self, dev: u64, key: u64, span: &LeafSpan) {
        let base = key - key % PAGE;
        let from = span.lo.max(base);
        let to = span.hi.min(base.saturating_add(PAGE));
        if from >= to {
            return;
        }
        let page = self.page_mut(dev, key / PAGE);
        page[(from - base) as usize..(to - base) as usize].fill(UNMAPPED);
        if let Some(leaf) = &span.leaf {
            let start = leaf.keys.partition_point(|&k| k < from);
            for (i, &k) in leaf.keys.iter().enumerate().skip(start) {
                if k >= to {
                    break;
                }
                page[(k - base) as usize] = storable(leaf.value_u64(i));
            }
        }
    }

    /// `vblock` of `dev` now maps to `packed` (or nothing): update the
    /// entry if its page is cached.
    pub fn set(&mut self, dev: u64, vblock: u64, packed: Option<u64>) {
        if let Some(page) = self.pages.get_mut(&(dev, vblock / PAGE)) {
            page[(vblock % PAGE) as usize] = packed.map_or(UNMAPPED, storable);
        }
    }

    /// Forget `begin..end` of `dev` (unmapped by a discard): pages wholly
    /// inside go, the entries of the pages at the edges become unknown.
    pub fn forget_range(&mut self, dev: u64, begin: u64, end: u64) {
        if end <= begin {
            return;
        }
        let (first, last) = (begin / PAGE, (end - 1) / PAGE);
        if last - first > self.pages.len() as u64 {
            self.pages
                .retain(|&(d, p), _| d != dev || p < first || p > last);
        }
        for p in first..=last.min(first + self.pages.len() as u64) {
            let Some(page) = self.pages.get_mut(&(dev, p)) else {
                continue;
            };
            let lo = begin.max(p * PAGE) - p * PAGE;
            let hi = end.min((p + 1) * PAGE) - p * PAGE;
            page[lo as usize..hi as usize].fill(UNKNOWN);
        }
    }

    /// Forget everything about `dev` (deleted, or a new device on an id).
    pub fn forget(&mut self, dev: u64) {
        self.pages.retain(|&(d, _), _| d != dev);
    }

    /// Pages held now.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether no page is held.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    fn page_mut(&mut self, dev: u64, page: u64) -> &mut Page {
        if self.pages.len() >= MAX_PAGES && !self.pages.contains_key(&(dev, page)) {
            self.pages.clear();
        }
        self.pages
            .entry((dev, page))
            .or_insert_with(|| Box::new([UNKNOWN; PAGE as usize]))
    }
}

/// A value the entry can hold: the two sentinels are never data (block
/// numbers below 2^40 cannot pack to them); anything else stays unknown.
fn storable(v: u64) -> u64 {
    if v >= UNMAPPED {
        UNKNOWN
    } else {
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persistent_data::node::Node;
    use std::sync::Arc;

    fn leaf(pairs: &[(u64, u64)]) -> Arc<Node> {
        let mut n = Node::empty_leaf(8);
        for (i, &(k, v)) in pairs.iter().enumerate() {
            n.insert_at(i, k, &v.to_le_bytes());
        }
        Arc::new(n)
    }

    #[test]
    fn a_span_fills_its_part_of_the_page_and_nothing_else() {
        let mut c = MappingCache::default();
        let span = LeafSpan {
            leaf: Some(leaf(&[(600, 7), (700, 8), (2000, 9)])),
            lo: 550,
            hi: 1000,
        };
        c.fill(1, 600, &span);
        assert_eq!(c.get(1, 600), Some(Some(7)));
        assert_eq!(c.get(1, 700), Some(Some(8)));
        assert_eq!(c.get(1, 601), Some(None));
        assert_eq!(c.get(1, 999), Some(None));
        // Outside the span, or the page, or the device: not known.
        assert_eq!(c.get(1, 549), None);
        assert_eq!(c.get(1, 1000), None);
        assert_eq!(c.get(1, 2000), None);
        assert_eq!(c.get(2, 600), None);
    }

    /// A span saying every key is unmapped.
    fn nothing() -> LeafSpan {
        LeafSpan {
            leaf: None,
            lo: 0,
            hi: u64::MAX,
        }
    }

    #[test]
    fn set_and_forget_keep_it_coherent() {
        let mut c = MappingCache::default();
        let span = nothing();
        c.fill(3, 10, &span);
        assert_eq!(c.get(3, 11), Some(None));
        c.set(3, 11, Some(42));
        assert_eq!(c.get(3, 11), Some(Some(42)));
        c.set(3, 11, None);
        assert_eq!(c.get(3, 11), Some(None));
        // A value that would read as a sentinel is left unknown.
        c.set(3, 12, Some(u64::MAX));
        assert_eq!(c.get(3, 12), None);
        c.forget(3);
        assert_eq!(c.get(3, 10), None);
        assert!(c.is_empty());
    }

    #[test]
    fn a_forgotten_range_is_unknown_and_the_rest_kept() {
        let mut c = MappingCache::default();
        for p in 0..4 {
            c.fill(1, p * PAGE, &nothing());
            c.fill(2, p * PAGE, &nothing());
        }
        c.forget_range(1, 100, 3 * PAGE + 10);
        assert_eq!(c.get(1, 99), Some(None));
        for v in [100, PAGE, 2 * PAGE + 7, 3 * PAGE + 9] {
            assert_eq!(c.get(1, v), None, "block {v}");
        }
        assert_eq!(c.get(1, 3 * PAGE + 10), Some(None));
        assert_eq!(c.get(2, PAGE), Some(None));
        // A range far wider than the cache.
        c.forget_range(2, 0, u64::MAX);
        assert_eq!(c.get(2, PAGE), None);
        assert_eq!(c.get(1, 99), Some(None));
    }

    #[test]
    fn the_cache_is_bounded() {
        let mut c = MappingCache::default();
        let span = nothing();
        for p in 0..(MAX_PAGES as u64 + 10) {
            c.fill(1, p * PAGE, &span);
            assert!(c.len() <= MAX_PAGES);
        }
    }
}
