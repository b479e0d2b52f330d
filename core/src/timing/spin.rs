//! When a socket reader may busy-poll its socket before blocking, and for
//! how long: the NBD server's connection readers wait for requests this
//! way, and the `nbd` client leaf's reply readers for replies.
//!
//! Why: on a small VM an idle vCPU wakes long after the interrupt that
//! wakes it, often several times the whole cost of serving a 4 KiB request,
//! so at low queue depth the round trip is mostly the reader's wake-up.
//! Polling the socket for a short while instead of sleeping keeps the vCPU
//! awake for the next request; it is a loss whenever the next request does
//! not come soon (a 1 ms device, an idle client) or when another runnable
//! thread — the client itself, on a machine with few CPUs — needs the CPU the
//! poller holds.
//!
//! The policy follows the kernel's `net.core.busy_read` / `SO_BUSY_POLL`
//! (a bounded poll of one socket before the normal sleep; Unix sockets
//! have no kernel busy-poll, so it is done here with non-blocking `recv`)
//! and the way
//! adaptive mutexes and io_uring's hybrid poll keep spinning only while it
//! pays: each poll has a time bound; a poll that ends without data (a
//! miss) or that was interrupted because the CPU went to another thread
//! (preempted) makes the next few waits block at once, twice as many after
//! every further failure, up to [`MAX_BACKOFF`]; a hit resets that. So a
//! stream of short gaps keeps the reader polling, and long gaps or a busy
//! CPU cost at most one bounded poll per [`MAX_BACKOFF`] waits. The poller
//! yields the CPU between polls, so a runnable thread on the same CPU (the
//! client, often) runs at once instead of waiting for the poll to end; a
//! yield that kept the poller off its CPU for [`PREEMPT_GAP_NS`] counts as
//! preempted. No load average or clock of other threads is consulted: the
//! signals are this thread's own success rate and whether its own poll
//! loop was descheduled.

use crate::clock::now_ns;

/// Waits blocked without polling after at most this many failures in a row
/// (so a 50 µs bound costs at most 50 µs / 64 per wait when polls never
/// pay).
pub const MAX_BACKOFF: u32 = 64;

/// A gap this long between two consecutive polls means the poller was not
/// running in between: the scheduler gave the CPU to another thread (or
/// the hypervisor to another vCPU). One poll iteration is a non-blocking
/// `recv`, well under a microsecond.
pub const PREEMPT_GAP_NS: u64 = 20_000;

/// How one bounded poll ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpinOutcome {
    /// Data arrived while polling.
    Hit,
    /// The bound passed without data.
    Miss,
    /// The poller lost its CPU to another thread: someone else needs it.
    Preempted,
}

/// Per-connection polling state; owned by the connection's reader.
#[derive(Debug)]
pub struct SpinPolicy {
    /// Poll bound; 0 = never poll.
    budget_ns: u64,
    /// Waits left that block without polling.
    skip: u32,
    /// Waits to skip after the next failure.
    backoff: u32,
}

impl SpinPolicy {
    /// A policy that polls for up to `budget_ns` per wait before blocking
    /// (0: never poll).
    pub fn new(budget_ns: u64) -> SpinPolicy {
        SpinPolicy {
            budget_ns,
            skip: 0,
            backoff: 1,
        }
    }

    /// Called once per wait for input: `Some(bound)` to poll that long
    /// first, `None` to block at once.
    pub fn next_wait(&mut self) -> Option<u64> {
        if self.budget_ns == 0 {
            return None;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return None;
        }
        Some(self.budget_ns)
    }

    /// How the poll that [`next_wait`](Self::next_wait) allowed ended.
    pub fn record(&mut self, outcome: SpinOutcome) {
        match outcome {
            SpinOutcome::Hit => self.backoff = 1,
            SpinOutcome::Miss | SpinOutcome::Preempted => {
                self.skip = self.backoff;
                // A preempted poll means the CPU is contended: back off
                // faster than after a plain miss.
                let step = if outcome == SpinOutcome::Preempted {
                    4
                } else {
                    2
                };
                self.backoff = (self.backoff * step).min(MAX_BACKOFF);
            }
        }
    }
}

/// Slice asked of the scheduler for a connection's reader.
pub const READER_SLICE_NS: u64 = 100_000;

/// Ask the scheduler for a short slice for the calling reader (see
/// [`super::set_thread_sched_slice_ns`]): the reader runs a few
/// microseconds per request, so a short slice costs it nothing.
pub fn ask_short_slice() {
    super::set_thread_sched_slice_ns(READER_SLICE_NS);
}

/// One bounded poll as `policy` allows: call `try_once` (a non-blocking
/// read) until it gives data, the bound passes, or the poller is found to
/// have lost its CPU; yield between tries. `Ok(None)` when the caller
/// must block instead (the outcome is recorded in `policy` either way).
pub fn poll_for<T>(
    policy: &mut SpinPolicy,
    mut try_once: impl FnMut() -> std::io::Result<Option<T>>,
) -> std::io::Result<Option<T>> {
    let Some(bound) = policy.next_wait() else {
        return Ok(None);
    };
    let start = now_ns();
    let mut prev = start;
    loop {
        if let Some(v) = try_once()? {
            policy.record(SpinOutcome::Hit);
            return Ok(Some(v));
        }
        let now = now_ns();
        if now - prev > PREEMPT_GAP_NS {
            policy.record(SpinOutcome::Preempted);
            return Ok(None);
        }
        if now - start >= bound {
            policy.record(SpinOutcome::Miss);
            return Ok(None);
        }
        prev = now;
        // Polling must not keep a runnable thread off this CPU (on a small
        // machine often the peer that has to run to send what is polled
        // for): yield between polls. With nobody else runnable this is a
        // cheap syscall; with someone, they run, and the gap check above
        // ends the poll if they held the CPU long.
        // SAFETY: plain syscall without arguments.
        unsafe { libc::sched_yield() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Count how many of `waits` waits poll, given each poll's outcome.
    fn polls(p: &mut SpinPolicy, waits: usize, outcome: SpinOutcome) -> usize {
        let mut n = 0;
        for _ in 0..waits {
            if p.next_wait().is_some() {
                n += 1;
                p.record(outcome);
            }
        }
        n
    }

    #[test]
    fn poll_for_returns_what_arrives_and_records_a_hit() {
        // poll_for yields between tries; on a loaded machine a yield can
        // lose the CPU for longer than the preemption gap, which ends that
        // poll as it should (and backs off). Such runs are retried.
        for _ in 0..100 {
            let mut p = SpinPolicy::new(1_000_000_000);
            let mut calls = 0;
            let got = poll_for(&mut p, || {
                calls += 1;
                Ok((calls == 3).then_some(7))
            });
            match got.unwrap() {
                Some(v) => {
                    assert_eq!((v, calls), (7, 3));
                    assert_eq!((p.skip, p.backoff), (0, 1));
                    return;
                }
                None => assert!(p.next_wait().is_none(), "ended early: preempted"),
            }
        }
        panic!("100 polls in a row were preempted");
    }

    #[test]
    fn poll_for_gives_up_at_the_bound_and_backs_off() {
        let mut p = SpinPolicy::new(1);
        let got = poll_for(&mut p, || Ok(None::<u8>));
        assert_eq!(got.unwrap(), None);
        // Missed (or preempted): the next wait blocks without polling.
        assert_eq!(p.next_wait(), None);
        let mut never = SpinPolicy::new(0);
        let got = poll_for(&mut never, || -> std::io::Result<Option<u8>> {
            panic!("a zero budget must not poll")
        });
        assert_eq!(got.unwrap(), None);
    }

    #[test]
    fn poll_for_passes_errors_through() {
        let mut p = SpinPolicy::new(1_000_000);
        let got = poll_for(&mut p, || -> std::io::Result<Option<u8>> {
            Err(std::io::ErrorKind::ConnectionReset.into())
        });
        assert_eq!(got.unwrap_err().kind(), std::io::ErrorKind::ConnectionReset);
    }

    #[test]
    fn zero_budget_never_polls() {
        let mut p = SpinPolicy::new(0);
        assert_eq!(polls(&mut p, 100, SpinOutcome::Hit), 0);
    }

    #[test]
    fn hits_keep_polling_every_wait() {
        let mut p = SpinPolicy::new(50_000);
        assert_eq!(polls(&mut p, 100, SpinOutcome::Hit), 100);
        assert_eq!(p.next_wait(), Some(50_000));
    }

    #[test]
    fn misses_back_off_exponentially_to_the_cap() {
        let mut p = SpinPolicy::new(50_000);
        // Skips after each miss: 1, 2, 4, ..., 64, 64, ...
        let mut seen = Vec::new();
        let mut since = 0;
        for _ in 0..400 {
            match p.next_wait() {
                Some(_) => {
                    seen.push(since);
                    since = 0;
                    p.record(SpinOutcome::Miss);
                }
                None => since += 1,
            }
        }
        assert_eq!(&seen[..9], &[0, 1, 2, 4, 8, 16, 32, 64, 64]);
    }

    #[test]
    fn preemption_backs_off_faster_than_a_miss() {
        let mut miss = SpinPolicy::new(50_000);
        let mut pre = SpinPolicy::new(50_000);
        assert!(
            polls(&mut pre, 200, SpinOutcome::Preempted) < polls(&mut miss, 200, SpinOutcome::Miss)
        );
    }

    #[test]
    fn a_hit_after_misses_resets_the_backoff() {
        let mut p = SpinPolicy::new(50_000);
        polls(&mut p, 100, SpinOutcome::Miss);
        // Drain the current skip, then poll once and hit.
        while p.next_wait().is_none() {}
        p.record(SpinOutcome::Hit);
        assert_eq!(polls(&mut p, 10, SpinOutcome::Hit), 10);
    }
}
