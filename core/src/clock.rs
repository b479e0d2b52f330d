//! The one clock: `u64` nanoseconds of CLOCK_MONOTONIC, plus the legacy
//! clocks of the mechanisms upstream replaced: emulated jiffies (dm-delay's
//! jiffies timers, dm-mpath HST's jiffies start times before "dm: dm-mpath:
//! Provide high-resolution timer to HST with bio-mpath") and the HZ timer wheel's bucket
//! rounding ([`wheel_bucket_expiry`]).
//!
//! `nanosleep` is padded by the thread's timer slack (50 µs by default), so
//! a thread that sleeps towards a deadline prepares itself first with
//! [`crate::timing::prepare_precise_thread`]; sleeping to a deadline
//! precisely (sleep, then spin) is [`crate::timing`]'s.

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
    /// Ticks per second (kernel `CONFIG_HZ`: 100, 250, 300 or 1000).
    pub hz: u32,
}

impl Jiffies {
    /// A counter at `hz` ticks per second. Panics if `hz` is 0.
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

/// Kernel `calc_wheel_index` for a timer added at wheel clock `clk`: the
/// jiffy at which its bucket runs. Level `n` has a granularity of `8^n`
/// ticks and covers deltas below `63 << 3n`; the bucket is rounded up past
/// `expires` so a timer never fires early, which makes even level 0 fire
/// one tick after `expires`. dm-delay's timer before "dm: delay: use
/// kthread instead of timers and wq" lost its accuracy here.
pub fn wheel_bucket_expiry(expires: u64, clk: u64, hz: u32) -> u64 {
    const LVL_CLK_SHIFT: u32 = 3;
    const LVL_BITS: u64 = 6;
    let depth: u32 = if hz > 100 { 9 } else { 8 };
    if expires < clk {
        return clk;
    }
    let delta = expires - clk;
    let lvl_start = |n: u32| ((1u64 << LVL_BITS) - 1) << ((n - 1) * LVL_CLK_SHIFT);
    let mut lvl = 0;
    while lvl + 1 < depth && delta >= lvl_start(lvl + 1) {
        lvl += 1;
    }
    let shift = lvl * LVL_CLK_SHIFT;
    ((expires >> shift) + 1) << shift
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

/// A `Duration` in nanoseconds, saturating at `u64::MAX` (about 584
/// years), the unit every timestamp here is in.
pub fn duration_ns(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

/// [`now_ns`] read from the CPU's time-stamp counter, for hot loops that
/// stamp every I/O (fio's `clocksource=cpu`, its default where the TSC is
/// reliable).
///
/// `clock_gettime` through the vDSO is a noticeable share of an in-process
/// null I/O that reads the clock twice; `rdtsc` plus a multiply is a few
/// cycles. The readings are on the [`now_ns`] base: the
/// counter is calibrated against CLOCK_MONOTONIC once per process (10 ms of
/// spinning at first use), so a stamp from here and one from [`now_ns`]
/// differ by the calibration error (a few ppm of the time since
/// calibration), not by an offset. It is used only where the kernel itself
/// trusts the TSC (current clocksource `tsc`, which implies an invariant
/// counter synchronised across CPUs); otherwise it is [`now_ns`].
/// Anything that sleeps should still compute deadlines on [`now_ns`].
pub struct CycleClock {
    tsc: Option<TscScale>,
}

#[derive(Clone, Copy)]
struct TscScale {
    base_tsc: u64,
    base_ns: u64,
    /// Nanoseconds per cycle, as a 32.32 fixed-point number.
    mult: u64,
}

impl CycleClock {
    /// The process's cycle clock (calibrated on first use).
    pub fn get() -> &'static CycleClock {
        static CLOCK: std::sync::OnceLock<CycleClock> = std::sync::OnceLock::new();
        CLOCK.get_or_init(|| CycleClock {
            tsc: TscScale::calibrate(),
        })
    }

    /// A clock that always reads [`now_ns`] (tests, and machines without a
    /// trusted TSC).
    pub fn monotonic() -> CycleClock {
        CycleClock { tsc: None }
    }

    /// Whether readings come from the TSC.
    pub fn uses_tsc(&self) -> bool {
        self.tsc.is_some()
    }

    /// Nanoseconds on the [`now_ns`] base.
    #[inline]
    pub fn now_ns(&self) -> u64 {
        match &self.tsc {
            Some(s) => s.to_ns(rdtsc()),
            None => now_ns(),
        }
    }
}

impl TscScale {
    const CALIBRATION_NS: u64 = 10_000_000;

    fn calibrate() -> Option<TscScale> {
        if !cfg!(target_arch = "x86_64") {
            return None;
        }
        let source = std::fs::read_to_string(
            "/sys/devices/system/clocksource/clocksource0/current_clocksource",
        )
        .ok()?;
        if source.trim() != "tsc" {
            return None;
        }
        let (t0, m0) = Self::paired_sample();
        while now_ns() - m0 < Self::CALIBRATION_NS {
            std::hint::spin_loop();
        }
        let (t1, m1) = Self::paired_sample();
        if t1 <= t0 {
            return None;
        }
        let mult = (((m1 - m0) as u128) << 32) / (t1 - t0) as u128;
        let mult = u64::try_from(mult).ok().filter(|&m| m > 0)?;
        Some(TscScale {
            base_tsc: t1,
            base_ns: m1,
            mult,
        })
    }

    /// A (counter, CLOCK_MONOTONIC) pair read as close together as this
    /// thread manages: the narrowest of a few tries, counter at the middle.
    fn paired_sample() -> (u64, u64) {
        let mut best = (u64::MAX, 0, 0);
        for _ in 0..5 {
            let a = rdtsc();
            let ns = now_ns();
            let b = rdtsc();
            if b.wrapping_sub(a) < best.0 {
                best = (b.wrapping_sub(a), a + (b.wrapping_sub(a)) / 2, ns);
            }
        }
        (best.1, best.2)
    }

    #[inline]
    fn to_ns(self, tsc: u64) -> u64 {
        // Another CPU's counter may trail the calibrating one by a few
        // cycles: clamp rather than wrap.
        let cycles = tsc.saturating_sub(self.base_tsc);
        self.base_ns + ((cycles as u128 * self.mult as u128) >> 32) as u64
    }
}

#[inline]
fn rdtsc() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: rdtsc has no preconditions on x86_64.
        unsafe { std::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        now_ns()
    }
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
    fn wheel_rounds_past_expires_by_level_granularity() {
        // Level 0: one tick after expires.
        assert_eq!(wheel_bucket_expiry(101, 100, 1000), 102);
        assert_eq!(wheel_bucket_expiry(100 + 62, 100, 1000), 163);
        // Level 1 (delta 63..503): 8-tick granularity, rounded up.
        assert_eq!(wheel_bucket_expiry(100 + 63, 100, 1000), 168);
        assert_eq!(wheel_bucket_expiry(100 + 100, 100, 1000), 208);
        // Level 2: 64 ticks.
        assert_eq!(wheel_bucket_expiry(1000, 0, 1000), 1024);
        // Already expired: the current bucket.
        assert_eq!(wheel_bucket_expiry(5, 10, 1000), 10);
    }

    #[test]
    fn sleep_until_is_never_early() {
        crate::timing::prepare_precise_thread();
        for _ in 0..20 {
            let deadline = now_ns() + 200_000;
            sleep_until_ns(deadline);
            assert!(now_ns() >= deadline);
        }
    }

    #[test]
    fn cycle_clock_agrees_with_now_ns() {
        let c = CycleClock::get();
        for _ in 0..50 {
            let a = now_ns();
            let t = c.now_ns();
            let b = now_ns();
            // Same base: within the calibration error (a few ppm of the
            // time since calibration) plus a little.
            assert!(t + 20_000 >= a && t <= b + 20_000, "{a} {t} {b}");
        }
        let t0 = c.now_ns();
        sleep_ns(2_000_000);
        let dt = c.now_ns() - t0;
        assert!((2_000_000..1_000_000_000).contains(&dt), "{dt}");
        let m = CycleClock::monotonic();
        assert!(!m.uses_tsc());
        let a = now_ns();
        assert!(m.now_ns() >= a);
    }
}
