//! "kblockd": a small pool of worker threads that runs posted, optionally
//! delayed, work (kernel `kblockd_mod_delayed_work_on`, a workqueue with
//! delayed work items).
//!
//! A [`DelayedWork`] is one item that is either idle or pending with a
//! deadline. Posting follows the kernel's `mod_delayed_work_on`: a post
//! to a pending item first grabs it (`try_to_grab_pending`: take the
//! pending bit, then, under the lock of the worker queue it sits on,
//! delete its timer entry) and then queues it again under the lock of the
//! poster's queue (`__queue_work`), waking a sleeping worker. That is two
//! pool-lock round trips, a cache line moved between CPUs and maybe a
//! futex wake on every call: the cost the upstream change "blk-mq: avoid
//! repeatedly scheduling the same work to run hardware queue" removed
//! when SCSI posted a queue run for every completed request, by keeping a
//! "queued" bit in the hardware queue so that no post happens at all
//! while a run is pending. One departure from the kernel: a re-post never
//! moves the deadline later (a pending delayed run never postpones an
//! immediate one, the review point of that change's v2); an immediate
//! re-post of an item already due goes to the back of the due work, as
//! the kernel's goes to the tail of the worklist.
//!
//! The process-wide pool is bound per CPU, as the kernel's kblockd is (a
//! per-CPU workqueue; blk-mq posts a hardware queue's run to a CPU of its
//! mask, the poster's own when it can): one worker pinned to each CPU, and
//! a post goes to the worker of the CPU the poster runs on. On a VM that
//! matters more than on bare metal: waking a worker on another vCPU,
//! often halted, costs the poster a cross-vCPU wake and the worker the
//! host's wake-up of that vCPU, while the local worker simply runs when
//! the poster sleeps, by when more completions have asked for the same
//! run. An unbound pool (any worker for any post) stays available for
//! comparison.
//!
//! [`KblockdStats`] counts posts, the posts that had to grab a pending
//! item, and the time spent posting, so the lab can show the per-post cost
//! beside the throughput.

use crossbeam_utils::CachePadded;
use parking_lot::{Condvar, Mutex};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use blkstack_core::affinity::{allowed_cpus, current_cpu, pin_current_thread};
use blkstack_core::clock::now_ns;

const NOT_PENDING: u64 = u64::MAX;

/// A work item that can be posted to a [`Kblockd`] pool.
pub struct DelayedWork {
    /// Deadline while pending, `NOT_PENDING` otherwise; changed only under
    /// `claim`, read anywhere.
    deadline: AtomicU64,
    /// The worker queue it is pending on (meaningful while pending).
    queue: AtomicUsize,
    /// The sequence number of its live timer entry on that queue; any
    /// other entry for it is stale (deleted by a grab or a cancel) and is
    /// dropped by the worker that pops it.
    entry: AtomicU64,
    /// Serialises posting, cancelling and a worker's claim of this item
    /// (the kernel's WORK_STRUCT_PENDING bit and its grab), so an item is
    /// pending on at most one worker queue. Taken before a queue's lock,
    /// never while a worker holds one.
    claim: Mutex<()>,
    func: Box<dyn Fn() + Send + Sync>,
}

impl DelayedWork {
    /// A work item that runs `func` each time a worker picks it up (kernel
    /// `INIT_DELAYED_WORK`); not pending until it is posted.
    pub fn new(func: impl Fn() + Send + Sync + 'static) -> Arc<DelayedWork> {
        Arc::new(DelayedWork {
            deadline: AtomicU64::new(NOT_PENDING),
            queue: AtomicUsize::new(0),
            entry: AtomicU64::new(0),
            claim: Mutex::new(()),
            func: Box::new(func),
        })
    }

    /// Is the work posted and not yet started?
    pub fn is_pending(&self) -> bool {
        self.deadline.load(Relaxed) != NOT_PENDING
    }
}

struct Timer {
    deadline: u64,
    seq: u64,
    work: Arc<DelayedWork>,
}

impl PartialEq for Timer {
    fn eq(&self, o: &Self) -> bool {
        (self.deadline, self.seq) == (o.deadline, o.seq)
    }
}
impl Eq for Timer {}
impl PartialOrd for Timer {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timer {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.deadline, self.seq).cmp(&(o.deadline, o.seq))
    }
}

struct QueueState {
    timers: BinaryHeap<Reverse<Timer>>,
    /// Entries in `timers` left stale by grabs and not yet popped.
    stale: usize,
    seq: u64,
    sleeping: u32,
    shutdown: bool,
}

/// Stale entries tolerated before a queue's heap is compacted: a grab
/// leaves one behind on every post to pending work, and a worker that
/// does not run for a while must not let them pile up (the kernel's
/// `list_del_init` leaves nothing behind).
const STALE_COMPACT: usize = 256;

impl Timer {
    /// Is this the item's live entry on queue `qi`?
    fn is_live(&self, qi: usize) -> bool {
        self.work.deadline.load(Relaxed) != NOT_PENDING
            && self.work.entry.load(Relaxed) == self.seq
            && self.work.queue.load(Relaxed) == qi
    }
}

/// One worker queue: a timer heap and the workers that serve it.
struct WorkQueue {
    state: Mutex<QueueState>,
    cv: Condvar,
}

struct Shared {
    queues: Vec<CachePadded<WorkQueue>>,
    /// CPU number -> the queue bound to it (per-CPU pools only).
    queue_of_cpu: Vec<usize>,
    posts: CachePadded<AtomicU64>,
    runs: CachePadded<AtomicU64>,
    grabs: CachePadded<AtomicU64>,
    post_ns: CachePadded<AtomicU64>,
}

/// Counters of a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KblockdStats {
    /// Calls that posted or re-timed work.
    pub posts: u64,
    /// Work items run.
    pub runs: u64,
    /// Posts that found the item pending and grabbed it off the queue it
    /// sat on before queueing it again (kernel `try_to_grab_pending`
    /// returning 1).
    pub grabs: u64,
    /// Time spent inside [`Kblockd::post`], summed over calls.
    pub post_ns: u64,
}

/// The worker pool.
pub struct Kblockd {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl Kblockd {
    /// An unbound pool: `workers` threads (at least one) serving one
    /// queue, any of them woken for any post.
    pub fn new(workers: usize) -> Arc<Kblockd> {
        Self::build(vec![None; workers.max(1)], Vec::new())
    }

    /// A bound pool, as the kernel's kblockd (a per-CPU workqueue): one
    /// worker pinned to each CPU this process may use, and work posted to
    /// the poster's own CPU's worker. A post then wakes a thread on the
    /// CPU that is already running (a local wakeup), not one that may sit
    /// on a halted vCPU that the host must wake first.
    pub fn per_cpu() -> Arc<Kblockd> {
        let cpus = allowed_cpus();
        let mut queue_of_cpu = vec![0; cpus.iter().max().map_or(1, |&c| c + 1)];
        for (i, &c) in cpus.iter().enumerate() {
            queue_of_cpu[c] = i;
        }
        Self::build(cpus.into_iter().map(Some).collect(), queue_of_cpu)
    }

    /// `workers[i]`: the CPU worker `i` is pinned to, if any. A pool with
    /// a `queue_of_cpu` map gives each worker its own queue; otherwise
    /// all share one.
    fn build(workers: Vec<Option<usize>>, queue_of_cpu: Vec<usize>) -> Arc<Kblockd> {
        let n = workers.len();
        let nqueues = if queue_of_cpu.is_empty() { 1 } else { n };
        let shared = Arc::new(Shared {
            queues: (0..nqueues)
                .map(|_| {
                    CachePadded::new(WorkQueue {
                        state: Mutex::new(QueueState {
                            timers: BinaryHeap::with_capacity(64),
                            seq: 0,
                            stale: 0,
                            sleeping: 0,
                            shutdown: false,
                        }),
                        cv: Condvar::new(),
                    })
                })
                .collect(),
            queue_of_cpu,
            posts: CachePadded::new(AtomicU64::new(0)),
            runs: CachePadded::new(AtomicU64::new(0)),
            grabs: CachePadded::new(AtomicU64::new(0)),
            post_ns: CachePadded::new(AtomicU64::new(0)),
        });
        // Return only once every worker runs: a thread's start-up (its
        // name, its signal stack, parking_lot's per-thread data on its
        // first sleep) allocates, and that belongs to pool creation, not
        // to whichever I/O happens to overlap it.
        let started = Arc::new(std::sync::Barrier::new(n + 1));
        let handles = workers
            .into_iter()
            .enumerate()
            .map(|(i, cpu)| {
                let shared = shared.clone();
                let started = started.clone();
                let queue = if nqueues == 1 { 0 } else { i };
                std::thread::Builder::new()
                    .name(format!("kblockd/{i}"))
                    .spawn(move || {
                        if let Some(cpu) = cpu {
                            pin_current_thread(cpu);
                        }
                        // One 1 ns timed sleep sets up this thread's
                        // parking_lot data now rather than on its first
                        // real wait.
                        let m = Mutex::new(());
                        Condvar::new().wait_for(&mut m.lock(), std::time::Duration::from_nanos(1));
                        started.wait();
                        worker(shared, queue)
                    })
                    .expect("spawn kblockd worker")
            })
            .collect();
        started.wait();
        Arc::new(Kblockd {
            shared,
            workers: Mutex::new(handles),
        })
    }

    /// The process-wide pool: bound per CPU, like the kernel's kblockd.
    pub fn global() -> Arc<Kblockd> {
        static GLOBAL: OnceLock<Arc<Kblockd>> = OnceLock::new();
        GLOBAL.get_or_init(Kblockd::per_cpu).clone()
    }

    /// A process-wide unbound pool of two workers (what `global` was
    /// before it was bound per CPU), kept for comparison: the engine's
    /// `kblockd=unbound`.
    pub fn global_unbound() -> Arc<Kblockd> {
        static GLOBAL: OnceLock<Arc<Kblockd>> = OnceLock::new();
        GLOBAL.get_or_init(|| Kblockd::new(2)).clone()
    }

    /// The queue a post from this thread goes to.
    fn local_queue(&self) -> usize {
        let map = &self.shared.queue_of_cpu;
        if map.is_empty() {
            return 0;
        }
        current_cpu().and_then(|c| map.get(c).copied()).unwrap_or(0)
    }

    /// Post `work` to run after `delay_ns` (kernel `mod_delayed_work_on`:
    /// grab the item if pending, then queue it on this thread's queue;
    /// except that a pending item's deadline only ever moves earlier).
    pub fn post(&self, work: &Arc<DelayedWork>, delay_ns: u64) {
        let t0 = now_ns();
        let mut deadline = t0.saturating_add(delay_ns);
        self.shared.posts.fetch_add(1, Relaxed);
        // The pending bit: serialises this post with other posts, cancels
        // and a worker's claim of the item.
        let _claim = work.claim.lock();
        let cur = work.deadline.load(Relaxed);
        if cur != NOT_PENDING {
            self.grab_pending(work);
            deadline = if delay_ns == 0 && cur <= t0 {
                // Already due: back of the due work, as the kernel's
                // requeue goes to the worklist's tail.
                t0
            } else {
                deadline.min(cur)
            };
        }
        let qi = self.local_queue();
        let q = &self.shared.queues[qi];
        let mut st = q.state.lock();
        if !st.shutdown {
            st.seq += 1;
            let seq = st.seq;
            work.queue.store(qi, Relaxed);
            work.entry.store(seq, Relaxed);
            work.deadline.store(deadline, Relaxed);
            st.timers.push(Reverse(Timer {
                deadline,
                seq,
                work: work.clone(),
            }));
            if st.sleeping > 0 {
                q.cv.notify_one();
            }
        }
        drop(st);
        self.shared
            .post_ns
            .fetch_add(now_ns().saturating_sub(t0), Relaxed);
    }

    /// Kernel `try_to_grab_pending` on a queued item: under the lock of the
    /// queue it is pending on, take it off (its heap entry goes stale, the
    /// constant-time equivalent of the kernel's `list_del_init`). Called
    /// with the item's claim held.
    fn grab_pending(&self, work: &DelayedWork) {
        let qi = work.queue.load(Relaxed);
        let q = &self.shared.queues[qi];
        let mut st = q.state.lock();
        work.deadline.store(NOT_PENDING, Relaxed);
        self.shared.grabs.fetch_add(1, Relaxed);
        st.stale += 1;
        if st.stale >= STALE_COMPACT && st.stale * 2 >= st.timers.len() {
            st.timers.retain(|Reverse(t)| t.is_live(qi));
            st.stale = 0;
        }
    }

    /// Remove `work` if pending (kernel `cancel_delayed_work`); a run
    /// already started is not waited for.
    pub fn cancel(&self, work: &Arc<DelayedWork>) {
        let _claim = work.claim.lock();
        work.deadline.store(NOT_PENDING, Relaxed);
    }

    /// A snapshot of the pool's post and run counters.
    pub fn stats(&self) -> KblockdStats {
        KblockdStats {
            posts: self.shared.posts.load(Relaxed),
            runs: self.shared.runs.load(Relaxed),
            grabs: self.shared.grabs.load(Relaxed),
            post_ns: self.shared.post_ns.load(Relaxed),
        }
    }

    /// Stop the workers after the work already due has run.
    pub fn shutdown(&self) {
        for q in self.shared.queues.iter() {
            q.state.lock().shutdown = true;
            q.cv.notify_all();
        }
        let handles = std::mem::take(&mut *self.workers.lock());
        for h in handles {
            let _ = h.join();
        }
    }
}

fn worker(shared: Arc<Shared>, qi: usize) {
    blkstack_core::timing::prepare_precise_thread();
    let q = &shared.queues[qi];
    let mut st = q.state.lock();
    loop {
        let now = now_ns();
        let next = st.timers.peek().map(|Reverse(t)| t.deadline);
        match next {
            Some(d) if d <= now => {
                let Some(Reverse(t)) = st.timers.pop() else {
                    continue;
                };
                drop(st);
                // Claim it: a stale entry (the item was grabbed and
                // queued again, which pushed another entry, or cancelled)
                // is dropped.
                let claimed = {
                    let _claim = t.work.claim.lock();
                    let mine = t.is_live(qi);
                    if mine {
                        t.work.deadline.store(NOT_PENDING, Relaxed);
                    }
                    mine
                };
                if claimed {
                    shared.runs.fetch_add(1, Relaxed);
                    (t.work.func)();
                }
                st = q.state.lock();
                if !claimed {
                    st.stale = st.stale.saturating_sub(1);
                }
            }
            _ => {
                if st.shutdown {
                    return;
                }
                st.sleeping += 1;
                match next {
                    Some(d) => {
                        let dur = std::time::Duration::from_nanos(d - now);
                        q.cv.wait_for(&mut st, dur);
                    }
                    None => q.cv.wait(&mut st),
                }
                st.sleeping -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn counter_work() -> (Arc<DelayedWork>, Arc<AtomicU32>) {
        let n = Arc::new(AtomicU32::new(0));
        let n2 = n.clone();
        (
            DelayedWork::new(move || {
                n2.fetch_add(1, Relaxed);
            }),
            n,
        )
    }

    fn wait_for(n: &AtomicU32, v: u32) {
        let deadline = now_ns() + 5_000_000_000;
        while n.load(Relaxed) < v {
            assert!(now_ns() < deadline, "work did not run");
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    #[test]
    fn pending_work_is_not_queued_twice() {
        let pool = Kblockd::new(1);
        let (w, n) = counter_work();
        pool.post(&w, 50_000_000);
        pool.post(&w, 60_000_000);
        pool.post(&w, 70_000_000);
        assert!(w.is_pending());
        wait_for(&n, 1);
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(n.load(Relaxed), 1);
        pool.shutdown();
    }

    #[test]
    fn immediate_post_brings_a_delayed_one_forward() {
        let pool = Kblockd::new(1);
        let (w, n) = counter_work();
        pool.post(&w, 10_000_000_000); // 10 s
        let t0 = now_ns();
        pool.post(&w, 0);
        wait_for(&n, 1);
        assert!(now_ns() - t0 < 2_000_000_000, "immediate run was postponed");
        pool.shutdown();
    }

    #[test]
    fn delayed_post_never_postpones_a_pending_immediate_one() {
        let pool = Kblockd::new(1);
        // Block the only worker so the immediate item stays pending.
        let gate = Arc::new(Mutex::new(()));
        let g = gate.lock();
        let gate2 = gate.clone();
        let blocker = DelayedWork::new(move || drop(gate2.lock()));
        pool.post(&blocker, 0);
        let (w, n) = counter_work();
        pool.post(&w, 0);
        pool.post(&w, 10_000_000_000);
        let t0 = now_ns();
        drop(g);
        wait_for(&n, 1);
        assert!(now_ns() - t0 < 2_000_000_000);
        pool.shutdown();
    }

    #[test]
    fn reposting_a_pending_item_grabs_and_requeues_it_and_it_runs_once() {
        let pool = Kblockd::new(1);
        let (w, n) = counter_work();
        pool.post(&w, 40_000_000);
        assert_eq!(pool.stats().grabs, 0, "an idle item needs no grab");
        for _ in 0..10 {
            pool.post(&w, 0);
        }
        let s = pool.stats();
        assert_eq!(s.posts, 11);
        assert!(s.grabs >= 1, "a pending item was re-posted without a grab");
        assert!(s.post_ns > 0);
        wait_for(&n, 1);
        // Every grab left a stale entry behind; none of them runs it.
        std::thread::sleep(std::time::Duration::from_millis(80));
        assert_eq!(n.load(Relaxed), 1, "a grabbed entry ran");
        assert!(!w.is_pending());
        pool.shutdown();
    }

    #[test]
    fn stale_entries_left_by_grabs_are_compacted() {
        let pool = Kblockd::new(1);
        let (w, n) = counter_work();
        // Far in the future, so the worker never pops anything meanwhile.
        pool.post(&w, 10_000_000_000);
        for _ in 0..(STALE_COMPACT * 4) {
            pool.post(&w, 10_000_000_000);
        }
        let len = pool.shared.queues[0].state.lock().timers.len();
        assert!(len <= STALE_COMPACT + 1, "{len} heap entries for one item");
        pool.post(&w, 0);
        wait_for(&n, 1);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(n.load(Relaxed), 1);
        pool.shutdown();
    }

    #[test]
    fn cancel_drops_pending_work() {
        let pool = Kblockd::new(1);
        let (w, n) = counter_work();
        pool.post(&w, 30_000_000);
        pool.cancel(&w);
        assert!(!w.is_pending());
        std::thread::sleep(std::time::Duration::from_millis(60));
        assert_eq!(n.load(Relaxed), 0);
        pool.shutdown();
    }

    /// Run `f` on a thread pinned to `cpu`; `None` if it could not be
    /// pinned there.
    fn on_cpu<T: Send + 'static>(cpu: usize, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
        std::thread::spawn(move || {
            pin_current_thread(cpu);
            (current_cpu() == Some(cpu)).then(f)
        })
        .join()
        .expect("pinned thread panicked")
    }

    #[test]
    fn per_cpu_pool_runs_work_on_the_posters_cpu() {
        let pool = Kblockd::per_cpu();
        for cpu in allowed_cpus() {
            let ran_on = Arc::new(AtomicU32::new(u32::MAX));
            let r = ran_on.clone();
            // An unknown CPU is stored as u32::MAX - 1: not `cpu`, so the
            // assertion below fails rather than the wait.
            let w = DelayedWork::new(move || {
                r.store(current_cpu().map_or(u32::MAX - 1, |c| c as u32), Relaxed)
            });
            let p = pool.clone();
            let w2 = w.clone();
            if on_cpu(cpu, move || p.post(&w2, 0)).is_none() {
                continue; // this thread could not be placed there
            }
            let deadline = now_ns() + 5_000_000_000;
            while ran_on.load(Relaxed) == u32::MAX {
                assert!(now_ns() < deadline, "work posted on CPU {cpu} did not run");
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            assert_eq!(ran_on.load(Relaxed), cpu as u32, "posted on CPU {cpu}");
        }
        pool.shutdown();
    }

    #[test]
    fn per_cpu_pool_keeps_one_pending_entry_across_cpus() {
        let pool = Kblockd::per_cpu();
        let cpus = allowed_cpus();
        let (first, other) = (cpus[0], *cpus.last().unwrap());
        let (w, n) = counter_work();
        // Pending for 10 s on the first CPU's worker...
        let (p, w2) = (pool.clone(), w.clone());
        on_cpu(first, move || p.post(&w2, 10_000_000_000)).unwrap_or_else(|| {
            panic!("cannot run a thread on CPU {first}, in this process's mask")
        });
        assert!(w.is_pending());
        // ...re-posted from another CPU: a later deadline changes nothing,
        // an earlier one brings it forward where it is pending, and the
        // item still runs once. (Earlier deadlines rather than immediate
        // posts: a worker may run an immediate item between two posts, and
        // a post after the run has started rightly queues it again.)
        let (p, w2) = (pool.clone(), w.clone());
        let t0 = now_ns();
        on_cpu(other, move || {
            p.post(&w2, 20_000_000_000);
            p.post(&w2, 300_000_000);
            p.post(&w2, 600_000_000);
        })
        .unwrap_or_else(|| panic!("cannot run a thread on CPU {other}, in this process's mask"));
        wait_for(&n, 1);
        let took = now_ns() - t0;
        assert!(took >= 300_000_000, "ran early, after {took} ns");
        assert!(took < 5_000_000_000, "the earlier deadline was not kept");
        // Past the 600 ms a second entry would have had.
        std::thread::sleep(std::time::Duration::from_millis(500));
        assert_eq!(n.load(Relaxed), 1, "queued twice");
        assert!(!w.is_pending());
        pool.shutdown();
    }
}
