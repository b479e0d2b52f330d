//! The reads and writes in flight to data blocks, counted so a discard
//! can wait for every one that looked its block up before the discard
//! unmapped it (dm-thin.c `pool->all_io_ds`, a `dm_deferred_set` from
//! dm-bio-prison-v1.c). Without the wait, a block a discard frees could
//! be handed to another device while an older write to it is still in
//! flight, and that write would land in the other device's data.
//!
//! Two epochs instead of the kernel's ring of 64 entries under a
//! spinlock: an I/O counts itself in the current epoch before it looks
//! its block up ([`DeferredSet::enter`]), a discard switches the epoch
//! after it unmapped its blocks ([`DeferredSet::add_work`]), and its work
//! runs once the old epoch's count is zero. A discard that comes while
//! an older one still waits switches the epoch when that one is done.
//! Every counter operation is `SeqCst`, so an I/O that saw the new epoch
//! also sees the discard's unmapping.
//!
//! The pool keeps a second set for the reads of shared blocks (dm-thin's
//! `shared_read_ds`): a write that breaks a snapshot's sharing is mapped
//! only after the reads of that block counted before it, so the block
//! the mapping lets go (which a snapshot's deletion may free and the
//! next commit hand out again) is never written under such a read.

use blkstack_core::{Bio, EndIo, Status};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};

/// Work to run when the I/O before it is done.
pub type Work = Box<dyn FnOnce() + Send>;

/// Tries of [`DeferredSet::enter`] before it takes the lock instead (an
/// epoch switch between its load and its count is rare; two in a row
/// rarer still).
const ENTER_TRIES: usize = 4;

#[derive(Default)]
struct Waiting {
    /// The old epoch is draining; `draining` runs when it is empty.
    switching: bool,
    draining: Vec<Work>,
    /// Work that came while a switch was draining: it switches next.
    next: Vec<Work>,
}

#[derive(Default)]
pub struct DeferredSet {
    epoch: AtomicUsize,
    counts: [AtomicU64; 2],
    waiting: Mutex<Waiting>,
}

impl DeferredSet {
    /// Count an I/O in the current epoch; returns the epoch, to give to
    /// [`DeferredSet::exit`] (or [`DeferredSet::track`]).
    pub fn enter(&self) -> usize {
        self.enter_n(1)
    }

    /// Count `n` I/Os at once (a batch, with one atomic operation).
    pub fn enter_n(&self, n: u64) -> usize {
        for _ in 0..ENTER_TRIES {
            let e = self.epoch.load(SeqCst);
            self.counts[e].fetch_add(n, SeqCst);
            if self.epoch.load(SeqCst) == e {
                return e;
            }
            self.exit_n(e, n);
        }
        // Epochs switch under the lock: holding it, the epoch stays.
        let _g = self.waiting.lock();
        let e = self.epoch.load(SeqCst);
        self.counts[e].fetch_add(n, SeqCst);
        e
    }

    /// The I/O counted in `epoch` is done.
    pub fn exit(&self, epoch: usize) {
        self.exit_n(epoch, 1);
    }

    /// `n` I/Os counted in `epoch` are done.
    pub fn exit_n(&self, epoch: usize, n: u64) {
        if n == 0 {
            return;
        }
        if self.counts[epoch].fetch_sub(n, SeqCst) == n && self.epoch.load(SeqCst) != epoch {
            self.sweep();
        }
    }

    /// Make `bio`'s completion [`DeferredSet::exit`] `epoch`.
    pub fn track(self: &std::sync::Arc<Self>, bio: &mut Bio, epoch: usize) {
        bio.push_end(self.clone(), epoch as u64);
    }

    /// Run `work` once every I/O counted so far is done (at once when
    /// none is in flight), on the thread that finishes the last one.
    pub fn add_work(&self, work: Work) {
        {
            let mut w = self.waiting.lock();
            if w.switching {
                w.next.push(work);
                return;
            }
            w.switching = true;
            w.draining.push(work);
            let e = self.epoch.load(SeqCst);
            self.epoch.store(1 - e, SeqCst);
        }
        self.sweep();
    }

    /// Run the waiting work if the old epoch drained, switching again
    /// for work that came meanwhile.
    fn sweep(&self) {
        loop {
            let ready = {
                let mut w = self.waiting.lock();
                let old = 1 - self.epoch.load(SeqCst);
                if !w.switching || self.counts[old].load(SeqCst) != 0 {
                    return;
                }
                let ready = std::mem::take(&mut w.draining);
                if w.next.is_empty() {
                    w.switching = false;
                } else {
                    w.draining = std::mem::take(&mut w.next);
                    self.epoch.store(old, SeqCst);
                }
                ready
            };
            for work in ready {
                work();
            }
        }
    }

    /// I/O counted and not yet done, in both epochs.
    pub fn in_flight(&self) -> u64 {
        self.counts[0].load(SeqCst) + self.counts[1].load(SeqCst)
    }
}

impl EndIo for DeferredSet {
    fn end_io(&self, bio: Bio, status: Status, epoch: u64) {
        self.exit(epoch as usize & 1);
        bio.complete(status);
    }
}

/// `shared_read_ds`: a write that breaks a snapshot's sharing is mapped
/// only after the reads of the shared block counted before it.
impl super::pool::PoolShared {
    /// `schedule_copy`'s `dm_deferred_set_add_work(shared_read_ds)`:
    /// provisioning `id` breaks sharing while reads of the shared block
    /// are in flight; it is mapped once they are done.
    pub(super) fn wait_for_shared_reads(&self, st: &mut super::pool::PoolState, id: u64) {
        if let Some(p) = st.pending.get_mut(&id) {
            p.quiesced = false;
        }
        let me = self.me.clone();
        self.shared_reads.add_work(Box::new(move || {
            if let Some(pool) = me.upgrade() {
                pool.push(super::pool::Job::Quiesced(id));
            }
        }));
    }

    /// The reads before provisioning `id` are done: map it if its write
    /// is done too.
    pub(super) fn quiesced(&self, id: u64) {
        let mut st = self.state.lock();
        let Some(p) = st.pending.get_mut(&id) else {
            return;
        };
        p.quiesced = true;
        if let Some((bio, status)) = p.done.take() {
            self.finish_provisioning(st, bio, status, id, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    fn flag() -> (Arc<AtomicBool>, Work) {
        let f = Arc::new(AtomicBool::new(false));
        let g = f.clone();
        (f, Box::new(move || g.store(true, SeqCst)))
    }

    #[test]
    fn work_waits_for_the_io_before_it_only() {
        let ds = DeferredSet::default();
        let a = ds.enter();
        let (done, work) = flag();
        ds.add_work(work);
        assert!(!done.load(SeqCst), "an I/O from before is in flight");
        let b = ds.enter();
        ds.exit(a);
        assert!(done.load(SeqCst), "the I/O after it does not hold it");
        // A second discard waits for `b`, and a third behind it too.
        let (d2, w2) = flag();
        ds.add_work(w2);
        let c = ds.enter();
        let (d3, w3) = flag();
        ds.add_work(w3);
        assert!(!d2.load(SeqCst));
        ds.exit(b);
        assert!(d2.load(SeqCst) && !d3.load(SeqCst), "d3 waits for c");
        ds.exit(c);
        assert!(d3.load(SeqCst));
        let (d4, w4) = flag();
        ds.add_work(w4);
        assert!(d4.load(SeqCst), "nothing in flight: at once");
        assert_eq!(ds.in_flight(), 0);
    }

    #[test]
    fn a_batch_counted_at_once_holds_work_until_its_last_io() {
        let ds = DeferredSet::default();
        let e = ds.enter_n(3);
        let (done, work) = flag();
        ds.add_work(work);
        ds.exit_n(e, 2);
        assert!(!done.load(SeqCst), "one I/O of the batch is in flight");
        ds.exit_n(e, 0);
        assert!(!done.load(SeqCst));
        ds.exit(e);
        assert!(done.load(SeqCst));
        assert_eq!(ds.in_flight(), 0);
    }

    #[test]
    fn concurrent_io_never_outlives_the_work_that_waits_for_it() {
        use std::collections::BTreeSet;
        let ds = Arc::new(DeferredSet::default());
        // Each I/O takes a ticket after it entered; the tickets of the
        // I/O still in flight are in `live`.
        let tickets = Arc::new(AtomicU64::new(0));
        let live = Arc::new(parking_lot::Mutex::new(BTreeSet::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let broken = Arc::new(AtomicBool::new(false));
        let ran = Arc::new(AtomicU64::new(0));
        std::thread::scope(|s| {
            for _ in 0..3 {
                let (ds, tickets, live, stop) =
                    (ds.clone(), tickets.clone(), live.clone(), stop.clone());
                s.spawn(move || {
                    while !stop.load(SeqCst) {
                        let e = ds.enter();
                        let t = tickets.fetch_add(1, SeqCst);
                        live.lock().insert(t);
                        std::hint::spin_loop();
                        live.lock().remove(&t);
                        ds.exit(e);
                    }
                });
            }
            for _ in 0..2000 {
                // Every I/O with a ticket below `cut` entered before the
                // switch: it must be done when the work runs.
                let cut = tickets.load(SeqCst);
                let (live, broken, ran) = (live.clone(), broken.clone(), ran.clone());
                ds.add_work(Box::new(move || {
                    if live.lock().first().is_some_and(|&t| t < cut) {
                        broken.store(true, SeqCst);
                    }
                    ran.fetch_add(1, SeqCst);
                }));
            }
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while ran.load(SeqCst) < 2000 {
                assert!(std::time::Instant::now() < deadline, "work lost");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            stop.store(true, SeqCst);
        });
        assert!(
            !broken.load(SeqCst),
            "work ran before an older I/O was done"
        );
        assert_eq!(ds.in_flight(), 0);
    }
}
