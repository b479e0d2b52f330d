//! The emulated disk's completion threads (`irqmode=1` softirq and
//! `irqmode=2` timer): one per hardware queue, ending the requests the driver handed it, in
//! timer mode each no earlier than `completion_nsec` after its issue
//! (null_blk's `null_cmd_end_timer`/hrtimer), with an optional spin
//! budget (`timer_spin_ns`) that keeps the emulated disk's clock on time.
//!
//! null_blk arms an hrtimer, and on bare metal an idle CPU leaves its
//! C-state for it in a few µs. On a virtual machine an idle vCPU halts and
//! the host wakes it late, more so when the host is busy, so a disk that
//! only sleeps completes later whenever the submitters let the vCPUs idle
//! (`interrupt`, `hybrid`) than when they spin (`poll`): the emulated
//! disk, not the wait, then decides the comparison (`lab hybrid-poll`,
//! `timer_late_avg_ns`). With a spin budget the thread models a disk whose
//! clock keeps running whatever the host does: it sleeps until a margin
//! before the deadline, the 90th percentile of how late its last 32 sleeps
//! woke (at most the budget, which is also where it starts), then spins
//! the rest (`blkstack_core::timing::sleep_then_spin_metered`). The spin
//! never starts more than the budget before the deadline, and its CPU time
//! is counted apart (`timer_spin_cpu_ns`) so that a measurement can leave
//! the disk's timekeeping out of the host's cost.

use super::poll::{PollList, POLL_BACKSTOP_CHECK};
use blkstack_core::clock::now_ns;
use blkstack_core::cpu::thread_cpu_ns;
use blkstack_core::timing::{
    prepare_precise_thread, sleep_then_spin_metered, WakeMargin, WakeMarginConfig,
};
use blkstack_core::Status;
use blkstack_mq::HeldCompleter;
use parking_lot::Mutex;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::OnceLock;

/// Timer-mode counters, summed over the hardware queues.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimerStats {
    /// Timer completions, and their summed lateness past the asked
    /// `completion_nsec`.
    pub completions: u64,
    pub late_ns: u64,
    /// With `timer_spin_ns`: the completion threads' CPU time spent
    /// spinning towards deadlines (the emulated disk keeping time, which a
    /// real disk does without the host's CPU).
    pub spin_cpu_ns: u64,
}

impl TimerStats {
    /// The counters as `status` appends them (nothing before the first
    /// timer completion).
    pub fn status_suffix(&self) -> String {
        if self.completions == 0 {
            return String::new();
        }
        format!(
            " timer_late_avg_ns={} timer_spin_cpu_ns={}",
            self.late_ns / self.completions,
            self.spin_cpu_ns
        )
    }
}

/// One hardware queue's completion thread state.
pub(super) struct IrqQueue {
    /// Timer mode: completions done, and their total lateness past the
    /// deadline (how precise the timer is, wakeup latency included).
    pub(super) timer_done: AtomicU64,
    pub(super) timer_late_ns: AtomicU64,
    timer_spin_cpu_ns: AtomicU64,
    /// `(deadline, tag, status)`; deadline 0 in softirq mode.
    queue: Mutex<Vec<(u64, u32, Status)>>,
    /// Timer mode with `iopoll`: requests whose bio is `POLLED`.
    pub(super) polled: PollList,
    sleeping: AtomicBool,
    shutdown: AtomicBool,
    pub(super) thread: OnceLock<std::thread::Thread>,
}

impl IrqQueue {
    pub(super) fn new(depth: usize) -> IrqQueue {
        IrqQueue {
            timer_done: AtomicU64::new(0),
            timer_late_ns: AtomicU64::new(0),
            timer_spin_cpu_ns: AtomicU64::new(0),
            queue: Mutex::new(Vec::with_capacity(depth)),
            polled: PollList::new(depth),
            sleeping: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            thread: OnceLock::new(),
        }
    }

    /// Hand a request to the completion thread.
    #[inline]
    pub(super) fn push(&self, deadline: u64, tag: u32, status: Status) {
        self.queue.lock().push((deadline, tag, status));
        if self.sleeping.load(SeqCst) {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
    }

    pub(super) fn add_stats(&self, s: &mut TimerStats) {
        s.completions += self.timer_done.load(Relaxed);
        s.late_ns += self.timer_late_ns.load(Relaxed);
        s.spin_cpu_ns += self.timer_spin_cpu_ns.load(Relaxed);
    }

    /// Ask the thread to end what it holds and exit.
    pub(super) fn stop(&self) {
        self.shutdown.store(true, SeqCst);
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    /// End, through `completer`, the polled requests due at least
    /// `grace_ns` ago.
    pub(super) fn end_polled(&self, hctx: u32, grace_ns: u64, completer: &HeldCompleter) -> usize {
        self.polled.end_due(
            hctx,
            grace_ns,
            &completer.completer_ref(),
            &self.timer_done,
            &self.timer_late_ns,
        )
    }
}

/// The completion thread of hardware queue `hctx`: ends what `irq` is
/// handed, each at its deadline; with `poll_backstop_ns` (`iopoll=1`),
/// also the polled requests nobody reaped that long past their deadline.
/// On shutdown it ends everything left (polled ones no earlier than their
/// deadline) and returns. `ready` is told once the thread is set up (its
/// own allocations done), so a device is whole when its constructor
/// returns, as `kthread_run` returns a running thread.
pub(super) fn completion_thread(
    irq: &IrqQueue,
    hctx: u32,
    poll_backstop_ns: Option<u64>,
    spin_max_ns: u64,
    depth: usize,
    completer: HeldCompleter,
    ready: std::sync::mpsc::SyncSender<()>,
) {
    prepare_precise_thread();
    let mut clock = DeadlineClock::new(spin_max_ns);
    let mut local: Vec<(u64, u32, Status)> = Vec::with_capacity(depth);
    // The starter may have given up on us (a later thread failed): no one
    // to tell, nothing to change.
    let _ = ready.send(());
    drop(ready);
    loop {
        std::mem::swap(&mut *irq.queue.lock(), &mut local);
        if local.is_empty() {
            if irq.shutdown.load(SeqCst) {
                irq.polled.drain(hctx, &completer.completer_ref());
                return;
            }
            irq.sleeping.store(true, SeqCst);
            if irq.queue.lock().is_empty() && !irq.shutdown.load(SeqCst) {
                if poll_backstop_ns.is_some() {
                    std::thread::park_timeout(POLL_BACKSTOP_CHECK);
                } else {
                    std::thread::park();
                }
            }
            irq.sleeping.store(false, SeqCst);
            if let Some(grace_ns) = poll_backstop_ns {
                irq.end_polled(hctx, grace_ns, &completer);
            }
            continue;
        }
        for &(deadline, tag, status) in local.iter() {
            if deadline != 0 {
                clock.wait_until(deadline, &irq.timer_spin_cpu_ns);
                let late = now_ns().saturating_sub(deadline);
                irq.timer_done.fetch_add(1, Relaxed);
                irq.timer_late_ns.fetch_add(late, Relaxed);
            }
            completer.end_request(hctx, tag, status);
        }
        local.clear();
    }
}

/// How the timer-mode completion thread reaches a deadline (see the
/// module documentation).
pub(super) struct DeadlineClock {
    margin: WakeMargin,
}

impl DeadlineClock {
    pub(super) fn new(max_spin_ns: u64) -> DeadlineClock {
        DeadlineClock {
            margin: WakeMargin::new(WakeMarginConfig {
                percentile: 90,
                window: 32,
                every: 1,
                initial_ns: max_spin_ns,
                cap_ns: max_spin_ns,
                prefill: true,
            }),
        }
    }

    /// Wait until `deadline`, never earlier; spin CPU time goes to
    /// `spin_cpu_ns`.
    pub(super) fn wait_until(&mut self, deadline: u64, spin_cpu_ns: &AtomicU64) {
        let w = sleep_then_spin_metered(deadline, &mut self.margin, thread_cpu_ns);
        if w.spin_start_ns != 0 {
            spin_cpu_ns.fetch_add(w.spin_cost, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_clock_is_never_early_and_spins_only_within_its_budget() {
        prepare_precise_thread();
        let spun = AtomicU64::new(0);
        let mut clock = DeadlineClock::new(200_000);
        for _ in 0..50 {
            let deadline = now_ns() + 300_000;
            clock.wait_until(deadline, &spun);
            assert!(now_ns() >= deadline);
            let m = clock.margin.margin_ns();
            assert!(m <= 200_000, "margin {m}");
        }
        // It starts with the whole budget as its margin, so unless every
        // one of 50 sleeps woke more than 200 µs late, it spun.
        assert!(spun.load(Relaxed) > 0);

        // Without a budget it only sleeps.
        let spun = AtomicU64::new(0);
        let mut clock = DeadlineClock::new(0);
        for _ in 0..10 {
            let deadline = now_ns() + 100_000;
            clock.wait_until(deadline, &spun);
            assert!(now_ns() >= deadline);
        }
        assert_eq!(spun.load(Relaxed), 0);
    }

    #[test]
    fn status_suffix_only_after_timer_completions() {
        assert_eq!(TimerStats::default().status_suffix(), "");
        let s = TimerStats {
            completions: 4,
            late_ns: 4_000,
            spin_cpu_ns: 7,
        };
        assert_eq!(
            s.status_suffix(),
            " timer_late_avg_ns=1000 timer_spin_cpu_ns=7"
        );
    }
}
