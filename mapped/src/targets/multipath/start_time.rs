//! The start time multipath hands its path selectors in `end_io`, the
//! `start_time ns|jiffies:HZ|tick:HZ` feature. `ns` (default) follows
//! upstream 'dm: dm-mpath: Provide high-resolution timer to HST with
//! bio-mpath' (HST gets `ktime_get_ns()` start times in bio mode). `jiffies:250` is what
//! bio-based dm gave HST before it, `dm_start_time_ns_from_clone()` =
//! `jiffies_to_nsecs(jiffies at submission)` at HZ=250, emulated exactly:
//! the jiffies counter starts at `INITIAL_JIFFIES` (300 s before wrapping
//! 32 bits) and `jiffies_to_usecs` returns an `unsigned int`, so that
//! "start time" is not on the `ktime_get_ns()` base the selector's end time
//! uses: it is the tick's start minus 300 s, minus a multiple of 2^32 µs
//! (71.6 min), once the machine has been up for 5 minutes, and in the
//! future before that. `tick:250` keeps only the precision loss (the start
//! truncated to its 4 ms tick on the right base), to tell the two effects
//! apart.

use crate::error::TargetError;
use blkstack_core::clock::Jiffies;

/// Which start time selectors get (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartTime {
    /// The clock itself (`ktime_get_ns()`), the high-resolution fix.
    Ns,
    /// Bio-based dm before the fix: `jiffies_to_nsecs(jiffies)`, with the
    /// kernel's jiffies origin and 32-bit microsecond conversion.
    Jiffies(Jiffies),
    /// The clock truncated to the start of its jiffy: the precision loss
    /// alone, without the kernel's change of time base.
    Tick(Jiffies),
}

/// Kernel `INITIAL_JIFFIES`: `(unsigned long)(unsigned int)(-300*HZ)`, so
/// that the 32-bit jiffies value wraps five minutes after boot.
fn initial_jiffies(hz: u32) -> u64 {
    (300u64 * hz as u64).wrapping_neg() as u32 as u64
}

/// Kernel `jiffies_to_nsecs(j)` = `(u64)jiffies_to_usecs(j) * 1000`, where
/// `jiffies_to_usecs` returns an `unsigned int`: the microseconds wrap at
/// 2^32 (71.6 minutes). Exact for every HZ that divides 10^6 (100, 250,
/// 1000, ...); other HZ round down as the kernel's 64-bit path does.
fn kernel_jiffies_to_nsecs(j: u64, hz: u32) -> u64 {
    let usecs = (j as u128 * 1_000_000 / hz as u128) as u32;
    usecs as u64 * 1_000
}

impl StartTime {
    /// The start time a selector is given for an I/O submitted at `now`
    /// (a [`now_ns`](blkstack_core::clock::now_ns) reading, i.e. nanoseconds since boot like
    /// `ktime_get_ns()`): `now` itself, `jiffies_to_nsecs` of the emulated
    /// jiffies counter at `now`, or the start of the tick containing `now`.
    pub fn at(self, now: u64) -> u64 {
        match self {
            StartTime::Ns => now,
            StartTime::Jiffies(j) => {
                let jiffies = initial_jiffies(j.hz).wrapping_add(j.from_ns(now));
                kernel_jiffies_to_nsecs(jiffies, j.hz)
            }
            StartTime::Tick(j) => j.truncate_ns(now),
        }
    }

    pub(super) fn parse(s: &str) -> Result<StartTime, TargetError> {
        if s.eq_ignore_ascii_case("ns") {
            return Ok(StartTime::Ns);
        }
        let hz_of = |hz: &str| -> Result<Jiffies, TargetError> {
            let hz: u32 = hz.parse().map_err(|_| {
                TargetError::invalid(format!("start_time: invalid HZ '{hz}' in '{s}'"))
            })?;
            if !(1..=100_000).contains(&hz) {
                return Err(TargetError::invalid(format!(
                    "start_time: HZ {hz} must be in 1..=100000"
                )));
            }
            Ok(Jiffies::new(hz))
        };
        if let Some(hz) = s.strip_prefix("jiffies:") {
            return Ok(StartTime::Jiffies(hz_of(hz)?));
        }
        if let Some(hz) = s.strip_prefix("tick:") {
            return Ok(StartTime::Tick(hz_of(hz)?));
        }
        Err(TargetError::invalid(format!(
            "start_time: unknown value '{s}': expected 'ns', 'jiffies:HZ' or 'tick:HZ' (e.g. jiffies:250)"
        )))
    }

    /// The feature's value as `table` prints it.
    pub(super) fn table_word(self) -> String {
        match self {
            StartTime::Ns => "ns".to_string(),
            StartTime::Jiffies(j) => format!("jiffies:{}", j.hz),
            StartTime::Tick(j) => format!("tick:{}", j.hz),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tick_start_times_fall_back_to_the_tick() {
        let now = 7_123_456_789u64;
        assert_eq!(StartTime::Ns.at(now), now);
        // HZ=250: 4 ms ticks; HZ=1: whole seconds.
        assert_eq!(StartTime::parse("tick:250").unwrap().at(now), 7_120_000_000);
        assert_eq!(StartTime::parse("tick:1").unwrap().at(now), 7_000_000_000);
    }

    #[test]
    fn jiffies_start_times_are_the_kernels_jiffies_to_nsecs() {
        let j = StartTime::parse("jiffies:250").unwrap();
        assert_eq!(initial_jiffies(250), (1u64 << 32) - 75_000);
        // Up 1000.001 s: jiffies = INITIAL_JIFFIES + 250000 wraps 32 bits
        // to 175000, i.e. 700 s: the tick's start minus 300 s.
        assert_eq!(j.at(1_000_001_000_007), 700_000_000_000);
        // Up 5000 s: 4000 * (1250000 - 75000) µs wraps at 2^32 µs.
        assert_eq!(j.at(5_000_000_000_000), 405_032_704_000);
        // In the first 5 minutes the "start" lies after the clock.
        assert_eq!(j.at(0), 3_994_967_296_000);
        // HZ=1000 has the same 300 s origin.
        let k = StartTime::parse("jiffies:1000").unwrap();
        assert_eq!(k.at(1_000_001_000_007), 700_001_000_000);
    }

    #[test]
    fn start_time_values() {
        assert_eq!(StartTime::parse("ns").ok(), Some(StartTime::Ns));
        assert_eq!(
            StartTime::parse("jiffies:250").ok(),
            Some(StartTime::Jiffies(Jiffies::new(250)))
        );
        assert_eq!(
            StartTime::parse("tick:1000").ok(),
            Some(StartTime::Tick(Jiffies::new(1000)))
        );
        assert!(StartTime::parse("tick:").is_err());
        assert!(StartTime::parse("jiffies:0").is_err());
        assert!(StartTime::parse("ms").is_err());
    }
}
