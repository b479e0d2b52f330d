//! The one clock: `u64` nanoseconds of CLOCK_MONOTONIC, plus emulated
//! jiffies for the legacy mechanisms the seeds replaced (dm-delay's
//! jiffies timers, HST's jiffies start times), and precise sleeping.
//!
//! Precision notes for this machine: `nanosleep` is padded by the thread's
//! timer slack (50 µs by default), so any thread that sleeps towards a
//! deadline sets its slack to 1 ns first ([`set_thread_timer_slack_ns`]).

use std::time::Duration;

/// Nanoseconds since an arbitrary fixed point (boot), monotonic.
#[inline]
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// An emulated jiffies counter at `hz` ticks per second, derived from
/// [`now_ns`] so that it agrees with every other timestamp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Jiffies {
    pub hz: u32,
}

impl Jiffies {
    pub fn new(hz: u32) -> Jiffies {
        assert!(hz > 0, "HZ must be positive");
        Jiffies { hz }
    }

    /// Nanoseconds per tick.
    pub fn tick_ns(self) -> u64 {
        1_000_000_000 / self.hz as u64
    }

    /// The current jiffies value.
    pub fn now(self) -> u64 {
        self.from_ns(now_ns())
    }

    /// The tick containing `ns` (truncating, like the kernel's counter).
    pub fn from_ns(self, ns: u64) -> u64 {
        ns / self.tick_ns()
    }

    /// Kernel `jiffies_to_nsecs`.
    pub fn to_ns(self, j: u64) -> u64 {
        j * self.tick_ns()
    }

    /// `ns` as the kernel would have seen it through jiffies: truncated to
    /// the start of its tick.
    pub fn truncate_ns(self, ns: u64) -> u64 {
        self.to_ns(self.from_ns(ns))
    }

    /// Kernel `msecs_to_jiffies`: rounds up, so a 1 ms timer at HZ=250 is
    /// one 4 ms tick.
    pub fn msecs_to_jiffies(self, ms: u64) -> u64 {
        (ms * self.hz as u64).div_ceil(1000)
    }
}

/// Set this thread's timer slack (PR_SET_TIMERSLACK). 1 ns makes sleeps
/// end when asked rather than up to 50 µs later.
pub fn set_thread_timer_slack_ns(ns: u64) {
    // SAFETY: prctl with an integer argument.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, ns as libc::c_ulong, 0, 0, 0);
    }
}

/// Sleep until `deadline_ns` on the [`now_ns`] clock (absolute
/// clock_nanosleep, so no drift from computing a relative interval).
pub fn sleep_until_ns(deadline_ns: u64) {
    let ts = libc::timespec {
        tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
    };
    loop {
        // SAFETY: valid timespec; remaining-time pointer unused for ABSTIME.
        let r = unsafe {
            libc::clock_nanosleep(
                libc::CLOCK_MONOTONIC,
                libc::TIMER_ABSTIME,
                &ts,
                std::ptr::null_mut(),
            )
        };
        if r != libc::EINTR {
            return;
        }
    }
}

/// Sleep for `d`, relative.
pub fn sleep_ns(ns: u64) {
    sleep_until_ns(now_ns().saturating_add(ns));
}

pub fn duration_ns(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic() {
        let a = now_ns();
        let b = now_ns();
        assert!(b >= a);
    }

    #[test]
    fn jiffies_math() {
        let j = Jiffies::new(250);
        assert_eq!(j.tick_ns(), 4_000_000);
        assert_eq!(j.msecs_to_jiffies(1), 1);
        assert_eq!(j.msecs_to_jiffies(5), 2);
        assert_eq!(j.truncate_ns(9_999_999), 8_000_000);
        assert_eq!(Jiffies::new(1000).msecs_to_jiffies(20), 20);
    }

    #[test]
    fn sleep_until_is_never_early() {
        set_thread_timer_slack_ns(1);
        for _ in 0..20 {
            let deadline = now_ns() + 200_000;
            sleep_until_ns(deadline);
            assert!(now_ns() >= deadline);
        }
    }
}
