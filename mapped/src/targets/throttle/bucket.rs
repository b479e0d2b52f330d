//! The throttle's token arithmetic: qemu's leaky buckets (util/throttle.c,
//! `throttle_leak_bucket`, `throttle_compute_wait`, `throttle_account`),
//! written over an injected clock so the unit tests are exact.
//!
//! A bucket fills with what I/O costs (one unit per I/O, or bytes) and
//! leaks at its base rate `avg`. An I/O may start while the bucket is not
//! full; it is charged after it starts, so one large request may take the
//! level past the top, and the next waits until the level is back under
//! it (a 1 MiB write under 4 MiB/s holds the next one a quarter second).
//! Without a burst the bucket holds a tenth of a second of the base rate
//! (qemu's "short bursts of I/O"); with a burst (`max` for `length`
//! seconds) it holds `max × length`, and a second bucket leaking at `max`
//! and holding a tenth of `max` keeps the burst itself to `max` per second.
//!
//! Levels are `f64` as in qemu; the clock is nanoseconds on the caller's
//! monotonic clock, and leaking is computed from the time elapsed since
//! the last leak, never from how long a sleeper slept, so a late wake-up
//! loses no tokens (a bucket only loses them once it is empty).

use super::config::{Config, Limit, BUCKETS};

/// Nanoseconds in a second.
const NS_PER_S: f64 = 1_000_000_000.0;

/// Which way an I/O goes: reads and writes have buckets of their own,
/// and share the total ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Read = 0,
    Write = 1,
}

impl Limit {
    /// Units the bucket holds before I/O waits for the base rate (qemu's
    /// `bucket_size`): a tenth of a second of it, or the whole burst.
    fn size(&self) -> f64 {
        match (self.avg, self.max) {
            (0, _) => 0.0,
            (avg, 0) => avg as f64 / 10.0,
            (_, max) => max as f64 * self.length as f64,
        }
    }

    /// Units the burst bucket holds before I/O waits for `max`
    /// (`burst_bucket_size`); only bursts longer than a second have one.
    fn burst_size(&self) -> f64 {
        if self.length > 1 {
            self.max as f64 / 10.0
        } else {
            0.0
        }
    }
}

/// qemu's `LeakyBucket`: a limit and how full its two buckets are.
#[derive(Clone, Copy, Debug, Default)]
struct LeakyBucket {
    limit: Limit,
    /// Units charged and not yet leaked at `avg`.
    level: f64,
    /// Units charged and not yet leaked at `max` (bursts of more than a
    /// second only).
    burst_level: f64,
}

impl LeakyBucket {
    /// `throttle_leak_bucket`.
    fn leak(&mut self, delta_ns: u64) {
        let d = delta_ns as f64;
        self.level = (self.level - self.limit.avg as f64 * d / NS_PER_S).max(0.0);
        if self.limit.length > 1 {
            self.burst_level = (self.burst_level - self.limit.max as f64 * d / NS_PER_S).max(0.0);
        }
    }

    /// `throttle_compute_wait`: nanoseconds until an I/O may start, 0 for
    /// now.
    fn wait_ns(&self) -> u64 {
        let l = &self.limit;
        if l.avg == 0 {
            return 0;
        }
        let extra = self.level - l.size();
        if extra > 0.0 {
            return (extra * NS_PER_S / l.avg as f64).ceil() as u64;
        }
        if l.length > 1 {
            let extra = self.burst_level - l.burst_size();
            if extra > 0.0 {
                return (extra * NS_PER_S / l.max as f64).ceil() as u64;
            }
        }
        0
    }

    fn charge(&mut self, units: f64) {
        if self.limit.avg != 0 {
            self.level += units;
            if self.limit.length > 1 {
                self.burst_level += units;
            }
        }
    }
}

/// Every bucket of one throttle, and when they last leaked (qemu's
/// `ThrottleState`).
#[derive(Clone, Debug)]
pub struct Buckets {
    cfg: Config,
    buckets: [LeakyBucket; BUCKETS],
    previous_leak: u64,
}

impl Buckets {
    /// Empty buckets for `cfg` at time `now_ns`.
    pub fn new(cfg: Config, now_ns: u64) -> Buckets {
        let mut buckets = [LeakyBucket::default(); BUCKETS];
        for (b, l) in buckets.iter_mut().zip(cfg.limits) {
            b.limit = l;
        }
        Buckets {
            cfg,
            buckets,
            previous_leak: now_ns,
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Change the limits at `now_ns` (a `set` message). A bucket whose
    /// limit changes keeps how full it is as a share of its size, so a
    /// `set` neither hands out a burst nor adds a wait: the next request
    /// goes when it would have gone, and the new rate counts from there.
    /// (qemu's `throttle_config` empties every bucket instead, which lets
    /// a tenth of a second of the new rate through at once.)
    pub fn reconfigure(&mut self, cfg: Config, now_ns: u64) {
        self.leak(now_ns);
        for (b, l) in self.buckets.iter_mut().zip(cfg.limits) {
            if b.limit == l {
                continue;
            }
            let (old, new) = (b.limit, l);
            let scale = |level: f64, from: f64, to: f64| {
                if from > 0.0 && to > 0.0 {
                    level * to / from
                } else {
                    0.0
                }
            };
            b.level = scale(b.level, old.size(), new.size());
            b.burst_level = scale(b.burst_level, old.burst_size(), new.burst_size());
            b.limit = l;
        }
        self.cfg = cfg;
    }

    /// `throttle_do_leak`: leak every bucket for the time since the last
    /// leak. A clock that went backwards leaks nothing.
    pub fn leak(&mut self, now_ns: u64) {
        let delta = now_ns.saturating_sub(self.previous_leak);
        if delta == 0 {
            return;
        }
        self.previous_leak = now_ns;
        for b in &mut self.buckets {
            b.leak(delta);
        }
    }

    /// How long the next I/O in `dir` must wait (after [`Self::leak`]):
    /// the longest wait of the buckets it is charged to.
    pub fn wait_ns(&self, dir: Dir) -> u64 {
        Config::buckets_of(dir)
            .iter()
            .map(|&i| self.buckets[i].wait_ns())
            .max()
            .unwrap_or(0)
    }

    /// `throttle_account`: charge an I/O of `bytes` in `dir`: one unit to
    /// its IOPS buckets (or `bytes / iops_size` units when `iops_size` is
    /// set and the I/O is larger), `bytes` to its bandwidth buckets.
    pub fn account(&mut self, dir: Dir, bytes: u64) {
        let ops = if self.cfg.iops_size != 0 && bytes > self.cfg.iops_size {
            bytes as f64 / self.cfg.iops_size as f64
        } else {
            1.0
        };
        for &i in Config::buckets_of(dir) {
            let units = if Config::is_bps(i) { bytes as f64 } else { ops };
            self.buckets[i].charge(units);
        }
    }

    /// Whether any bucket limits anything.
    pub fn limits_anything(&self) -> bool {
        self.cfg.limits.iter().any(|l| l.avg != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::super::config::parse_limits;
    use super::*;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000_000_000;

    fn buckets(words: &[&str]) -> Buckets {
        Buckets::new(parse_limits(words).expect("valid limits"), 0)
    }

    /// Run a closed loop with an injected clock: an I/O of `bytes` in
    /// `dir` starts whenever the buckets allow, as soon as they allow,
    /// until `until_ns`. Returns the start times.
    fn starts(b: &mut Buckets, dir: Dir, bytes: u64, until_ns: u64) -> Vec<u64> {
        let mut now = 0;
        let mut out = Vec::new();
        while now < until_ns {
            b.leak(now);
            match b.wait_ns(dir) {
                0 => {
                    b.account(dir, bytes);
                    out.push(now);
                }
                w => now += w,
            }
        }
        out
    }

    fn count_in(starts: &[u64], from: u64, to: u64) -> usize {
        starts.iter().filter(|&&t| t >= from && t < to).count()
    }

    #[test]
    fn an_iops_cap_gives_its_rate_after_a_tenth_of_a_second_of_slack() {
        let mut b = buckets(&["riops", "400"]);
        let s = starts(&mut b, Dir::Read, 4096, 10 * S);
        // qemu lets a tenth of a second of the rate go at once (the
        // bucket is avg/10 deep, and the I/O that crosses it is let in).
        assert_eq!(count_in(&s, 0, 1), 41);
        // Then exactly the rate: every second holds 400 starts.
        for sec in 1..10 {
            assert_eq!(count_in(&s, sec * S, (sec + 1) * S), 400, "second {sec}");
        }
        // Writes are not limited by a read cap.
        b.leak(10 * S);
        assert_eq!(b.wait_ns(Dir::Write), 0);
    }

    #[test]
    fn rates_from_a_hundred_to_fifty_thousand_iops_are_exact() {
        for rate in [100u64, 1_000, 10_000, 50_000] {
            let mut b = buckets(&["wiops", &rate.to_string()]);
            let s = starts(&mut b, Dir::Write, 512, 3 * S);
            // After the first second the rate is exact to one I/O.
            let n = count_in(&s, S, 3 * S) as u64;
            assert!(n.abs_diff(2 * rate) <= 1, "{rate}: {n} in 2 s");
        }
    }

    #[test]
    fn large_requests_are_charged_by_bytes() {
        let mut b = buckets(&["wbps", "4M"]);
        let s = starts(&mut b, Dir::Write, 1 << 20, 5 * S);
        // The first goes at once (the bucket was empty); from then on a
        // 1 MiB write under 4 MiB/s starts every quarter second.
        let gaps: Vec<u64> = s.windows(2).map(|w| w[1] - w[0]).collect();
        // (Levels are floating point, as qemu's: a nanosecond either way.)
        assert!(
            gaps[1..].iter().all(|&g| g.abs_diff(250 * MS) <= 1),
            "{gaps:?}"
        );
        assert!(
            gaps[0].abs_diff(150 * MS) <= 1,
            "the first waits for the bucket's top: {gaps:?}"
        );
    }

    #[test]
    fn iops_size_charges_a_large_request_as_several() {
        let mut b = buckets(&["iops", "100", "iops_size", "4K"]);
        // A 64 KiB read is sixteen 4 KiB operations.
        let s = starts(&mut b, Dir::Read, 64 << 10, 11 * S);
        let n = count_in(&s, S, 11 * S);
        assert!((n as i64 - 62).abs() <= 1, "{n} 64 KiB reads in 10 s");
    }

    #[test]
    fn a_burst_runs_at_max_for_its_length_then_at_the_base_rate() {
        // qemu: iops_rd=100, iops_rd_max=1000, iops_rd_max_length=2: the
        // bucket holds 2000; it fills at 1000 - 100 per second, so the
        // burst lasts 2000 / 900 s, at no more than 1000 a second.
        let mut b = buckets(&["riops", "100", "riops_burst", "1000", "2"]);
        let s = starts(&mut b, Dir::Read, 4096, 6 * S);
        let first = count_in(&s, 0, S);
        assert!((1000..=1101).contains(&first), "first second {first}");
        let second = count_in(&s, S, 2 * S);
        assert!((1000..=1001).contains(&second), "second second {second}");
        for sec in 3..6 {
            assert_eq!(count_in(&s, sec * S, (sec + 1) * S), 100, "second {sec}");
        }
        // Nothing ever beats `max` over any full second.
        let mut i = 0;
        for (j, &t) in s.iter().enumerate() {
            while s[i] + S <= t {
                i += 1;
            }
            assert!(j - i < 1101, "{} starts in a second at {t}", j - i + 1);
        }
    }

    #[test]
    fn a_one_second_burst_goes_at_once() {
        // length 1 (qemu's default) has no burst-rate bucket: max × 1
        // units go as fast as they come.
        let mut b = buckets(&["wbps", "1M", "wbps_burst", "8M", "1"]);
        let s = starts(&mut b, Dir::Write, 1 << 20, 3 * S);
        assert_eq!(count_in(&s, 0, 1), 9);
    }

    #[test]
    fn totals_are_shared_by_reads_and_writes() {
        let mut b = buckets(&["iops", "200"]);
        b.leak(0);
        for _ in 0..21 {
            assert_eq!(b.wait_ns(Dir::Read), 0);
            b.account(Dir::Read, 4096);
        }
        // The reads filled the bucket the writes also need.
        assert_eq!(b.wait_ns(Dir::Write), 5 * MS);
        b.leak(5 * MS);
        assert_eq!(b.wait_ns(Dir::Write), 0);
    }

    /// The closed loop of [`starts`] from `from_ns` on.
    fn starts_from(b: &mut Buckets, dir: Dir, from_ns: u64, until_ns: u64) -> Vec<u64> {
        let mut now = from_ns;
        let mut out = Vec::new();
        while now < until_ns {
            b.leak(now);
            match b.wait_ns(dir) {
                0 => {
                    b.account(dir, 4096);
                    out.push(now);
                }
                w => now += w,
            }
        }
        out
    }

    fn set(b: &mut Buckets, words: &[&str], now: u64) {
        let mut cfg = b.config().clone();
        cfg.set(words).expect("set");
        b.reconfigure(cfg, now);
    }

    #[test]
    fn a_live_set_changes_the_rate_at_once_without_a_burst() {
        let mut b = buckets(&["riops", "100"]);
        let s = starts(&mut b, Dir::Read, 4096, 2 * S);
        assert_eq!(count_in(&s, S, 2 * S), 100);
        let last = *s.last().expect("starts");
        // Raised: the new rate from the set on, no extra slack.
        set(&mut b, &["riops", "1000"], 2 * S);
        let s = starts_from(&mut b, Dir::Read, 2 * S, 4 * S);
        assert!(s[0] - last <= 10 * MS, "the next one is not held back");
        let n = count_in(&s, 2 * S, 3 * S);
        assert!((999..=1001).contains(&n), "{n} in the first second");
        assert_eq!(count_in(&s, 3 * S, 4 * S), 1000);
        // Lowered: the held head keeps its time, then the new rate.
        let last = *s.last().expect("starts");
        set(&mut b, &["riops", "10"], 4 * S);
        let s = starts_from(&mut b, Dir::Read, 4 * S, 6 * S);
        assert!(s[0] - last <= MS, "a set adds no wait");
        assert!(count_in(&s, 4 * S, 5 * S).abs_diff(10) <= 1);
        assert_eq!(count_in(&s, 5 * S, 6 * S), 10);
        // Lifted: no wait at all.
        set(&mut b, &["riops", "0"], 6 * S);
        assert_eq!(b.wait_ns(Dir::Read), 0);
        assert!(!b.limits_anything());
        // Set from nothing: an empty bucket.
        set(&mut b, &["riops", "50"], 6 * S);
        assert_eq!(
            count_in(&starts_from(&mut b, Dir::Read, 6 * S, 7 * S), 6 * S, 7 * S),
            55
        );
    }

    #[test]
    fn a_late_leak_loses_no_tokens_while_io_waits() {
        // Leaking once after 300 ms gives what three leaks of 100 ms give.
        let mut a = buckets(&["rbps", "1M"]);
        let mut b = a.clone();
        for x in [&mut a, &mut b] {
            x.leak(0);
            x.account(Dir::Read, 10 << 20);
        }
        a.leak(300 * MS);
        for t in 1..=3 {
            b.leak(t * 100 * MS);
        }
        // 10 MiB charged, 0.3 MiB leaked, 0.1 MiB of slack: 9.6 s to go,
        // either way (to a nanosecond of floating point).
        let (wa, wb) = (a.wait_ns(Dir::Read), b.wait_ns(Dir::Read));
        assert!(wa.abs_diff(wb) <= 1, "{wa} vs {wb}");
        assert!(wa.abs_diff(9_600 * MS) <= 1, "{wa}");
    }
}
