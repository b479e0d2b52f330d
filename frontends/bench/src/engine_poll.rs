//! The job loop's polled wait (`wait=poll|hybrid`, `--hipri`): spin on
//! the completion queue, polling the device (io_uring IOPOLL's reaping on
//! the submitter), then yield; and since a yield does not reliably give
//! the CPU to another runnable thread, a poller that finds its CPU shared
//! naps until its oldest request could be done. Every spin has a bound
//! and a fallback to sleep.

use crate::engine::{Engine, POLL_SPINS};
use blkstack_core::clock::{now_ns, sleep_until_ns};

/// A yield that kept the poller off the CPU this long means another
/// runnable thread wanted it (more pollers than CPUs, or the thread that
/// completes the I/O): from then on the poller naps instead of yielding,
/// because `sched_yield` does not reliably hand the CPU over (pollers
/// yielding to each other starved the ones whose requests were ready).
/// Alone on its CPU, a poller spins and yields as classic polling does.
const YIELD_CONTENDED_NS: u64 = 20_000;
/// Shortest and longest nap of a poller that found nothing on a contended
/// CPU: it sleeps until the oldest request in flight could be done (its
/// start plus the shortest latency seen), within these bounds.
const POLL_NAP_MIN_NS: u64 = 2_000;
const POLL_NAP_MAX_NS: u64 = 200_000;

impl Engine {
    /// Spin on the queue, yielding the CPU after a bounded number of spins
    /// (on a small machine the completing thread may need this CPU). On a
    /// polling device each round first polls it.
    pub(crate) fn poll_take(&mut self) -> usize {
        let mut spins = 0u32;
        let mut contended = false;
        loop {
            // What the poll completes for this job lands on this thread's
            // local list, which `has_ready` (other threads' list) does not
            // show.
            if self.dev_polls && self.dev.poll() > 0 {
                let n = self.cq.try_take(&mut self.drained);
                if n > 0 {
                    return n;
                }
            }
            if self.cq.has_ready() {
                let n = self.cq.try_take(&mut self.drained);
                if n > 0 {
                    return n;
                }
            }
            if spins < POLL_SPINS {
                spins += 1;
                std::hint::spin_loop();
            } else if contended {
                self.poll_nap();
            } else {
                let t = now_ns();
                std::thread::yield_now();
                contended = now_ns() - t > YIELD_CONTENDED_NS;
            }
        }
    }

    /// A poller's bounded sleep on a contended CPU:
    /// until the oldest request in flight could complete, at least
    /// [`POLL_NAP_MIN_NS`] and at most [`POLL_NAP_MAX_NS`].
    fn poll_nap(&self) {
        let now = self.clock.now_ns();
        let earliest = if self.min_lat_ns == u64::MAX {
            now
        } else {
            let oldest = self
                .slots
                .iter()
                .filter(|s| s.busy)
                .map(|s| s.start_ns)
                .min()
                .unwrap_or(now);
            oldest.saturating_add(self.min_lat_ns)
        };
        let nap = earliest
            .saturating_sub(now)
            .clamp(POLL_NAP_MIN_NS, POLL_NAP_MAX_NS);
        // Stamps are on the cycle clock; sleep on now_ns.
        sleep_until_ns(now_ns() + nap);
    }
}
