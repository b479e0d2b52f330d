//! Work that must wait for a metadata commit before it goes on, with one
//! commit for everything queued meanwhile (`dm-cache-target.c`'s `struct
//! batcher`: `continue_after_commit`, `schedule_commit`, `__commit`).
//!
//! The kernel queues the commit on its workqueue; the continuations queued
//! before the commit work starts are taken by it, committed once, and sent
//! on. Here the first caller that finds no commit running becomes the
//! committer: it takes everything queued, commits, runs those
//! continuations, and goes round again while more were queued during its
//! commit; a caller that finds a commit running only queues and returns.
//! So a continuation always waits for a commit that began after it was
//! queued, and each commit carries every continuation queued while the
//! previous one ran.
//!
//! The queue holds at most one continuation per migration in flight (and
//! the worker's one invalidation), which `migrate.rs` bounds.
//! Written by hand: a mutex, a vector and a flag.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// What runs after the commit, told whether it succeeded.
pub type Continuation = Box<dyn FnOnce(bool) + Send>;

struct State {
    waiting: Vec<Continuation>,
    committing: bool,
}

/// `struct batcher`.
pub struct Batcher {
    state: Mutex<State>,
    /// Commits run by the batcher (each carried one or more continuations).
    commits: AtomicU64,
}

impl Default for Batcher {
    fn default() -> Self {
        Batcher {
            state: Mutex::new(State {
                waiting: Vec::new(),
                committing: false,
            }),
            commits: AtomicU64::new(0),
        }
    }
}

impl Batcher {
    /// `continue_after_commit` + `schedule_commit`: run `k` after a commit
    /// that starts after this call. `commit` is the commit operation (the
    /// kernel's `commit_op`: commit if the transaction changed; true on
    /// success); it runs on this thread if no commit is running, and then
    /// so do the continuations it carried.
    pub fn continue_after_commit(&self, k: Continuation, mut commit: impl FnMut() -> bool) {
        {
            let mut s = self.state.lock();
            s.waiting.push(k);
            if s.committing {
                return;
            }
            s.committing = true;
        }
        loop {
            // Taken before the commit, as `__commit` does: what is queued
            // from here on waits for the next round.
            let batch = {
                let mut s = self.state.lock();
                if s.waiting.is_empty() {
                    s.committing = false;
                    return;
                }
                std::mem::take(&mut s.waiting)
            };
            let ok = commit();
            self.commits.fetch_add(1, Ordering::Relaxed);
            for k in batch {
                k(ok);
            }
        }
    }

    /// Continuations waiting for a commit.
    #[cfg(test)]
    pub fn queued(&self) -> usize {
        self.state.lock().waiting.len()
    }

    /// Commits the batcher ran.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Arc, Barrier};
    use std::time::{Duration, Instant};

    fn until(what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done() {
            assert!(Instant::now() < deadline, "timed out: {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A commit held open while three more continuations arrive: they
    /// queue without committing, and one second commit carries all three;
    /// each runs once, after a commit that began after it was queued.
    #[test]
    fn continuations_queued_during_a_commit_share_the_next_one() {
        let b = Arc::new(Batcher::default());
        let (enter, leave) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
        // Commit number n, and after which commit each continuation ran.
        let started = Arc::new(AtomicUsize::new(0));
        let ran = Arc::new(Mutex::new(Vec::new()));
        let commit = {
            let (enter, leave, started) = (enter.clone(), leave.clone(), started.clone());
            move || {
                if started.fetch_add(1, Ordering::SeqCst) == 0 {
                    enter.wait();
                    leave.wait();
                }
                true
            }
        };
        let cont = |id: usize| -> Continuation {
            let (ran, started) = (ran.clone(), started.clone());
            Box::new(move |ok| {
                assert!(ok);
                ran.lock().push((id, started.load(Ordering::SeqCst)));
            })
        };
        let first = {
            let (b, k, commit) = (b.clone(), cont(0), commit.clone());
            std::thread::spawn(move || b.continue_after_commit(k, commit))
        };
        enter.wait();
        // The first commit runs: these only queue, on this thread.
        for id in 1..4 {
            b.continue_after_commit(cont(id), || panic!("a second committer"));
        }
        assert_eq!(b.queued(), 3);
        leave.wait();
        first.join().unwrap();
        until("all ran", || ran.lock().len() == 4);
        let mut ran = ran.lock().clone();
        ran.sort_unstable();
        assert_eq!(ran, [(0, 1), (1, 2), (2, 2), (3, 2)]);
        assert_eq!(b.commits(), 2, "four continuations, two commits");
        assert_eq!(b.queued(), 0);
    }

    /// A failed commit tells its continuations so.
    #[test]
    fn a_failed_commit_is_passed_on() {
        let b = Batcher::default();
        let got = Arc::new(Mutex::new(None));
        let g = got.clone();
        b.continue_after_commit(Box::new(move |ok| *g.lock() = Some(ok)), || false);
        assert_eq!(*got.lock(), Some(false));
        assert_eq!(b.commits(), 1);
    }
}
