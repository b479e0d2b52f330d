//! A held bio and the deadline-ordered heap every flush mechanism keeps
//! its bios in (dm-delay keeps a list walked in arrival order; a heap
//! keeps the per-bio cost to a push and a pop however many are held).

use super::Shared;
use blkstack_core::clock;
use blkstack_core::Bio;
use std::cmp::Ordering as CmpOrdering;
use std::collections::BinaryHeap;
use std::sync::atomic::Ordering;

/// One held bio.
pub(super) struct Held {
    /// What the flusher compares: the deadline in ns, or in `timer` mode
    /// the jiffies expiry.
    pub key: u64,
    pub deadline_ns: u64,
    /// Arrival order, for sending everything on in order (presuspend).
    pub seq: u64,
    pub class: u8,
    pub bio: Bio,
}

impl PartialEq for Held {
    fn eq(&self, o: &Held) -> bool {
        (self.key, self.seq) == (o.key, o.seq)
    }
}
impl Eq for Held {}
impl PartialOrd for Held {
    fn partial_cmp(&self, o: &Held) -> Option<CmpOrdering> {
        Some(self.cmp(o))
    }
}
impl Ord for Held {
    /// Reversed, so that `BinaryHeap` (a max-heap) pops the earliest.
    fn cmp(&self, o: &Held) -> CmpOrdering {
        (o.key, o.seq).cmp(&(self.key, self.seq))
    }
}

/// Pop the bios whose key is at most `now_key` and whose deadline has
/// passed into `batch`, taking them off their class's held count.
///
/// Only `timer` mode can meet a bio whose jiffies expiry has passed but
/// whose deadline has not: the kernel would send it on up to a tick early
/// when another bio's timer runs the work. Here it waits for the tick
/// after its deadline, as if armed for that jiffy: `rekey` gives that
/// jiffy for a deadline.
pub(super) fn pop_due(
    sh: &Shared,
    heap: &mut BinaryHeap<Held>,
    now_key: u64,
    rekey: impl Fn(u64) -> u64,
    batch: &mut Vec<Held>,
) {
    let now = clock::now_ns();
    let mut deferred: Vec<Held> = Vec::new();
    while heap.peek().is_some_and(|h| h.key <= now_key) {
        let Some(mut h) = heap.pop() else { break };
        if h.deadline_ns > now {
            h.key = h.key.max(rekey(h.deadline_ns));
            deferred.push(h);
            continue;
        }
        sh.classes[h.class as usize]
            .ops
            .fetch_sub(1, Ordering::Relaxed);
        batch.push(h);
    }
    heap.extend(deferred);
}
