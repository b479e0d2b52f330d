//! A futex word a thread parks on, with the deadline it is heading for, so
//! that a waker only wakes it when it brings an earlier one.
//!
//! This is the sleep of dm-delay's flush kthread (upstream "dm: delay: use
//! kthread instead of timers and wq"): the worker sleeps while nothing is
//! held and a submitter wakes it with one futex call; and of the emulated
//! timer wheel's timer thread, which sleeps to an absolute tick. The
//! timeout is an absolute CLOCK_MONOTONIC time (`FUTEX_WAIT_BITSET`), so a
//! park computed from [`crate::clock::now_ns`] never drifts.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// A futex word to sleep on, plus the deadline (on whatever clock the
/// owner chooses) the sleeper waits for.
pub struct Parker {
    word: AtomicU32,
    /// The key the parked thread waits for: `u64::MAX` when idle, 0 when it
    /// polls and needs no wake-up. Its owner decides when to read and write
    /// it (typically under the lock that guards what the key orders).
    pub target: AtomicU64,
}

impl Default for Parker {
    fn default() -> Self {
        Parker::new()
    }
}

impl Parker {
    /// An idle parker: nothing pending, no key set.
    pub fn new() -> Parker {
        Parker {
            word: AtomicU32::new(0),
            target: AtomicU64::new(u64::MAX),
        }
    }

    /// The word's current value: read it before deciding to park, and
    /// pass it to [`Self::park`], so that an unpark in between is not lost.
    pub fn seen(&self) -> u32 {
        self.word.load(Ordering::Acquire)
    }

    /// Sleep until the word changes from `seen` or, if given, the absolute
    /// CLOCK_MONOTONIC time `until_ns` passes. Returns whether it timed out.
    /// It may also return early (a signal, a spurious wake): callers loop.
    pub fn park(&self, seen: u32, until_ns: Option<u64>) -> bool {
        let ts;
        let tsp = match until_ns {
            Some(ns) => {
                ts = libc::timespec {
                    tv_sec: (ns / 1_000_000_000) as libc::time_t,
                    tv_nsec: (ns % 1_000_000_000) as libc::c_long,
                };
                &ts as *const libc::timespec
            }
            None => std::ptr::null(),
        };
        // SAFETY: the word outlives the call; FUTEX_WAIT_BITSET takes an
        // absolute CLOCK_MONOTONIC timeout, or none when null.
        let r = unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.word.as_ptr(),
                libc::FUTEX_WAIT_BITSET | libc::FUTEX_PRIVATE_FLAG,
                seen,
                tsp,
                std::ptr::null::<u32>(),
                libc::FUTEX_BITSET_MATCH_ANY,
            )
        };
        r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ETIMEDOUT)
    }

    /// Change the word and wake every thread parked on it.
    pub fn unpark(&self) {
        self.word.fetch_add(1, Ordering::Release);
        // SAFETY: a wake on a word we own.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.word.as_ptr(),
                libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::now_ns;
    use std::sync::Arc;

    #[test]
    fn a_timed_park_is_never_early() {
        let p = Parker::new();
        for _ in 0..10 {
            let until = now_ns() + 300_000;
            let seen = p.seen();
            while now_ns() < until {
                p.park(seen, Some(until));
            }
            assert!(now_ns() >= until);
        }
    }

    #[test]
    fn an_unpark_before_the_park_is_not_lost() {
        let p = Parker::new();
        let seen = p.seen();
        p.unpark();
        // The word changed: the park returns at once, without timing out.
        let start = now_ns();
        assert!(!p.park(seen, Some(start + 5_000_000_000)));
        assert!(now_ns() - start < 4_000_000_000);
    }

    #[test]
    fn unpark_wakes_a_parked_thread() {
        let p = Arc::new(Parker::new());
        let seen = p.seen();
        let q = p.clone();
        let t = std::thread::spawn(move || {
            while q.seen() == seen {
                q.park(seen, None);
            }
        });
        std::thread::sleep(std::time::Duration::from_millis(5));
        p.unpark();
        t.join().expect("the parked thread returns once unparked");
        assert_ne!(p.seen(), seen);
    }
}
