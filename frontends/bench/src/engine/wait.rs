//! The job loop's wait for completions, per the job's `wait=` mode: block
//! on the completion queue (`interrupt`), or in the device's sleeping
//! poll (the `nbd` leaf's poll queues), or sleep part of the expected
//! completion time and then poll (`hybrid`, io_uring's hybrid polling).
//!
//! The polled wait (`wait=poll|hybrid`, `--hipri`): spin on
//! the completion queue, polling the device (io_uring IOPOLL's reaping on
//! the submitter), and yield the CPU after a bounded number of spins. It
//! never sleeps: `wait=poll` is the classic busy polling that the
//! hybrid-poll experiment compares hybrid polling with. (A poller that
//! napped once a yield showed its CPU shared kept 4 jobs' IOPS, but cost
//! classic polling its throughput on the lab's rows; what made 4 pollers
//! collapse was the tag wait, which mq's `polled_tag` fixed.)

use super::{Engine, POLL_SPINS};
use crate::spec::{HybridEstimator, JobSpec, WaitMode};
use blkstack_core::clock::{now_ns, sleep_until_ns};
use blkstack_core::DeviceRef;

/// How long a job whose device has nothing to poll (its connection is
/// being restored) waits for an ordinary completion before polling again.
const SLEEPING_POLL_RETRY: std::time::Duration = std::time::Duration::from_millis(1);

/// How the job waits, and what hybrid's estimate is made from.
pub(super) struct Waiter {
    pub(super) mode: WaitMode,
    /// `wait=poll|hybrid` on a device that polls (`Device::polls`): bios
    /// go out `POLLED`, and the wait loop calls `Device::poll`, which
    /// completes them once due (io_uring IOPOLL: the submitter reaps its
    /// own I/O; nothing wakes it from another thread).
    pub(super) dev_polls: bool,
    /// `wait=interrupt` on a device whose poll sleeps in the device
    /// (`Device::poll_sleeps`: the `nbd` leaf's poll queues): bios go out
    /// `POLLED` and the job thread waits in `Device::poll_wait`, reading
    /// its own replies, so one wake-up (the reply's) serves each wait.
    pub(super) dev_sleeps: bool,
    pub(super) sleep_pct: u64,
    pub(super) estimator: HybridEstimator,
    pub(super) min_lat_ns: u64,
    /// Moving average of completion times (`hybrid_estimator=ewma`).
    pub(super) ewma_lat_ns: u64,
}

impl Waiter {
    pub(super) fn new(spec: &JobSpec, device: &DeviceRef) -> Waiter {
        Waiter {
            mode: spec.wait,
            dev_polls: match spec.wait {
                WaitMode::Interrupt => device.poll_sleeps(),
                _ => device.polls(),
            },
            dev_sleeps: spec.wait == WaitMode::Interrupt && device.poll_sleeps(),
            sleep_pct: spec.hybrid_sleep_pct.clamp(1, 100) as u64,
            estimator: spec.hybrid_estimator,
            min_lat_ns: u64::MAX,
            ewma_lat_ns: 0,
        }
    }

    /// A completion took `lat` ns: update the estimates hybrid sleeps on.
    pub(super) fn observe(&mut self, lat: u64) {
        self.min_lat_ns = self.min_lat_ns.min(lat.max(1));
        self.ewma_lat_ns = if self.ewma_lat_ns == 0 {
            lat.max(1)
        } else {
            self.ewma_lat_ns - self.ewma_lat_ns / 8 + lat.max(1) / 8
        };
    }
}

impl Engine {
    /// Wait for at least one completion according to the wait mode.
    pub(super) fn wait_for_completions(&mut self) -> usize {
        let n = self.cq.try_take(&mut self.drained);
        if n > 0 {
            return n;
        }
        match self.waiter.mode {
            WaitMode::Interrupt if self.waiter.dev_sleeps => self.sleeping_poll_take(),
            WaitMode::Interrupt => self.cq.wait_take(&mut self.drained),
            WaitMode::Poll => self.poll_take(),
            WaitMode::Hybrid => {
                if self.waiter.min_lat_ns != u64::MAX {
                    let oldest = self
                        .slots
                        .iter()
                        .filter(|s| s.busy)
                        .map(|s| s.start_ns)
                        .min()
                        .unwrap_or(0);
                    let estimate = match self.waiter.estimator {
                        HybridEstimator::Min => self.waiter.min_lat_ns,
                        HybridEstimator::Ewma => self.waiter.ewma_lat_ns.max(1),
                    };
                    let wake = oldest.saturating_add(estimate * self.waiter.sleep_pct / 100);
                    // Sleeping for less than a few µs costs more than it saves.
                    let now = self.clock.now_ns();
                    if wake > now + 2_000 && !self.cq.has_ready() {
                        // Stamps are on the cycle clock; sleep on now_ns.
                        sleep_until_ns(now_ns() + (wake - now));
                    }
                }
                self.poll_take()
            }
        }
    }

    /// Wait in the device's sleeping poll; when it has nothing to read
    /// (no polled bio in flight there, or its connection is down and being
    /// restored) wait for an ordinary completion, briefly, and look again.
    fn sleeping_poll_take(&mut self) -> usize {
        loop {
            let cq = &self.cq;
            if self.dev.poll_wait(&|| cq.has_any()) == 0 {
                let n = self
                    .cq
                    .wait_take_for(&mut self.drained, SLEEPING_POLL_RETRY);
                if n > 0 {
                    return n;
                }
            }
            let n = self.cq.try_take(&mut self.drained);
            if n > 0 {
                return n;
            }
        }
    }

    /// Spin on the queue, yielding the CPU after a bounded number of spins
    /// (on a small machine the completing thread may need this CPU). On a
    /// polling device each round first polls it.
    pub(super) fn poll_take(&mut self) -> usize {
        let mut spins = 0u32;
        loop {
            // What the poll completes for this job lands on this thread's
            // local list, which `has_ready` (other threads' list) does not
            // show.
            if self.waiter.dev_polls && self.dev.poll() > 0 {
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
            } else {
                std::thread::yield_now();
            }
        }
    }
}
