//! Precise waits, in one place for every layer: a futex [`Parker`], a
//! timerfd [`DeadlineTimer`], a learnt [`WakeMargin`], [`sleep_then_spin`],
//! the adaptive bounded socket poll ([`spin`]) and the per-thread setup
//! ([`prepare_precise_thread`]) that makes a sleep end when asked.
//!
//! The block layer's own precise waits are hrtimers (null_blk's
//! `completion_nsec`, io_uring's hybrid IOPOLL sleep, upstream "io_uring:
//! releasing CPU resources when polling") and a kthread that polls (dm-delay,
//! upstream "dm: delay: use kthread instead of timers and wq"). In user
//! space a timed sleep is padded by the thread's timer slack (50 µs by
//! default) and then by the scheduler's wake latency, so a thread that
//! must be on time sleeps to a margin short of its deadline, learnt from
//! its own recent wakes, and spins the rest, the spin bounded by that
//! margin. The legacy clocks the upstream changes replaced (jiffies, the
//! HZ timer wheel) stay in [`crate::clock`].

mod deadline_timer;
mod margin;
mod parker;
pub mod spin;

pub use deadline_timer::{DeadlineTimer, DeadlineTimerError};
pub use margin::{WakeMargin, WakeMarginConfig, MAX_WINDOW};
pub use parker::Parker;

use crate::clock::{now_ns, sleep_until_ns};

/// Make the calling thread's sleeps end when asked: timer slack 1 ns
/// (PR_SET_TIMERSLACK) instead of the default 50 µs. Every thread that
/// sleeps towards a deadline calls this once, first.
pub fn prepare_precise_thread() {
    set_thread_timer_slack_ns(1);
}

/// [`prepare_precise_thread`], and ask the scheduler for a short slice
/// ([`set_thread_sched_slice_ns`]): for workers that run briefly per wake
/// (delay flushers, NBD readers), so a wake-up preempts a CPU-bound thread
/// instead of queueing behind its whole slice.
pub fn prepare_precise_worker(slice_ns: u64) {
    prepare_precise_thread();
    set_thread_sched_slice_ns(slice_ns);
}

/// Set this thread's timer slack (PR_SET_TIMERSLACK). Prefer
/// [`prepare_precise_thread`]; this is the one place the prctl is made.
pub fn set_thread_timer_slack_ns(ns: u64) {
    // SAFETY: prctl with an integer argument.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, ns as libc::c_ulong, 0, 0, 0);
    }
}

/// Ask EEVDF for a slice of `ns` (`sched_attr.sched_runtime`, Linux 6.12+)
/// for the calling thread: its virtual deadline then comes early, so its
/// wake-up preempts a CPU-bound thread instead of queueing behind that
/// thread's whole slice. Kernels without custom slices ignore the field;
/// a refusal only costs latency, so it is not an error.
pub fn set_thread_sched_slice_ns(ns: u64) {
    #[repr(C)]
    struct SchedAttr {
        size: u32,
        policy: u32,
        flags: u64,
        nice: i32,
        priority: u32,
        runtime: u64,
        deadline: u64,
        period: u64,
    }
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        policy: libc::SCHED_OTHER as u32,
        flags: 0,
        nice: 0,
        priority: 0,
        runtime: ns,
        deadline: 0,
        period: 0,
    };
    // SAFETY: a valid sched_attr for the calling thread (pid 0).
    unsafe {
        libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0);
    }
}

/// What one [`sleep_then_spin`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Waited {
    /// It slept (to the deadline less the margin, or, with a zero spin
    /// bound, to the deadline itself).
    pub slept: bool,
    /// When the spin began on [`now_ns`] (0: no spin). Never more than
    /// the margin's cap before the deadline.
    pub spin_start_ns: u64,
    /// The spin's cost on the caller's meter (see
    /// [`sleep_then_spin_metered`]); 0 when it did not spin.
    pub spin_cost: u64,
}

/// Wait until `deadline_ns` on [`now_ns`], never returning early: sleep
/// to the deadline less `margin`'s current margin (learning from how late
/// that sleep woke), then spin the rest. The spin never starts more than
/// the margin's cap before the deadline; a margin capped at 0 only sleeps.
/// The caller should have called [`prepare_precise_thread`]. `spin_cost`
/// is the spin's wall-clock nanoseconds.
pub fn sleep_then_spin(deadline_ns: u64, margin: &mut WakeMargin) -> Waited {
    sleep_then_spin_metered(deadline_ns, margin, now_ns)
}

/// [`sleep_then_spin`], with the spin's cost read from `meter` before and
/// after it (e.g. [`crate::cpu::thread_cpu_ns`] for its CPU time); the
/// meter is read only when the wait spins.
pub fn sleep_then_spin_metered(
    deadline_ns: u64,
    margin: &mut WakeMargin,
    meter: impl Fn() -> u64,
) -> Waited {
    let mut w = Waited::default();
    let now = now_ns();
    if now >= deadline_ns {
        return w;
    }
    if margin.cap_ns() == 0 {
        sleep_until_ns(deadline_ns);
        w.slept = true;
        return w;
    }
    let m = margin.margin_ns();
    if deadline_ns - now > m {
        let target = deadline_ns - m;
        sleep_until_ns(target);
        w.slept = true;
        margin.record(now_ns().saturating_sub(target));
    }
    // The sleep ends at or after `target`, so at most the margin (at most
    // its cap) is left to spin.
    let mut t = now_ns();
    if t < deadline_ns {
        w.spin_start_ns = t;
        let c0 = meter();
        while t < deadline_ns {
            std::hint::spin_loop();
            t = now_ns();
        }
        w.spin_cost = meter().saturating_sub(c0);
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    fn margin(cap_ns: u64) -> WakeMargin {
        WakeMargin::new(WakeMarginConfig {
            percentile: 90,
            window: 32,
            every: 1,
            initial_ns: cap_ns,
            cap_ns,
            prefill: true,
        })
    }

    #[test]
    fn sleep_then_spin_is_never_early_and_spins_only_within_the_cap() {
        prepare_precise_thread();
        let mut m = margin(200_000);
        let mut spun = 0;
        for i in 0..40u64 {
            let deadline = now_ns() + 300_000 + i * 10_000;
            let w = sleep_then_spin(deadline, &mut m);
            assert!(now_ns() >= deadline, "early");
            assert!(m.margin_ns() <= 200_000, "margin {}", m.margin_ns());
            if w.spin_start_ns != 0 {
                spun += 1;
                assert!(
                    deadline - w.spin_start_ns <= 200_000,
                    "spin began {} ns before the deadline",
                    deadline - w.spin_start_ns
                );
            }
        }
        // The margin starts at the cap, so unless every sleep woke later
        // than the deadline itself, some waits spun.
        assert!(spun > 0 || m.margin_ns() == 200_000);
    }

    #[test]
    fn a_zero_cap_only_sleeps() {
        prepare_precise_thread();
        let mut m = margin(0);
        for _ in 0..10 {
            let deadline = now_ns() + 100_000;
            let w = sleep_then_spin(deadline, &mut m);
            assert!(now_ns() >= deadline);
            assert!(w.slept);
            assert_eq!(w.spin_start_ns, 0, "spun with a zero budget");
        }
    }

    #[test]
    fn a_past_deadline_returns_at_once() {
        let mut m = margin(100_000);
        let w = sleep_then_spin(now_ns().saturating_sub(1), &mut m);
        assert_eq!(w, Waited::default());
    }

    #[test]
    fn the_margin_learns_from_the_sleeps() {
        prepare_precise_thread();
        // Learn from the last wake only, starting at a 5 ms cap: one wait
        // sleeps to 5 ms before its deadline, and the margin becomes how
        // late that sleep woke (below 5 ms unless the host stalled it).
        let mut m = WakeMargin::new(WakeMarginConfig {
            percentile: 100,
            window: 1,
            every: 1,
            initial_ns: 5_000_000,
            cap_ns: 5_000_000,
            prefill: false,
        });
        let deadline = now_ns() + 6_000_000;
        let w = sleep_then_spin(deadline, &mut m);
        assert!(w.slept && now_ns() >= deadline);
        assert!(m.margin_ns() < 5_000_000, "margin {}", m.margin_ns());
    }
}
