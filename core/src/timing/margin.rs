//! A learnt wake margin: how far short of a deadline to sleep so that the
//! wake, late as timer wakes are, still lands before the deadline and the
//! rest can be spun.
//!
//! io_uring's hybrid polling (upstream "io_uring: releasing CPU resources
//! when polling") sleeps about half the expected completion time and polls the
//! rest; dm-delay's hybrid flush and null's timer completions need the
//! same thing at the other end, a sleep that ends just before a known
//! deadline. The margin is a percentile of the last wakes' lateness over
//! a sliding window, capped by the spin the caller allows.
//!
//! Why a percentile: a margin `m` costs `E[(m - L)+]` of spinning and
//! leaves `E[(L - m)+]` of lateness for a wake latency `L`; if a
//! microsecond late weighs as much as `w` microseconds of spinning, the
//! `m` with the least total cost is the `w / (1 + w)` quantile of `L` (the
//! newsvendor critical ratio). Each caller picks its own weighting.

/// The largest window a [`WakeMargin`] keeps.
pub const MAX_WINDOW: usize = 64;

/// How a [`WakeMargin`] learns. Each user keeps the rule it was tuned
/// with; see the constructors' callers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WakeMarginConfig {
    /// The percentile (1..=100) of recent wake lateness the margin covers:
    /// the smallest sample with at least this share of the window at or
    /// below it.
    pub percentile: u32,
    /// How many recent wakes the percentile is taken over (1..=64).
    pub window: usize,
    /// Recompute the margin every this many wakes (1: every wake).
    pub every: usize,
    /// The margin before anything was learnt.
    pub initial_ns: u64,
    /// The most the margin may be: the caller's spin bound.
    pub cap_ns: u64,
    /// Start with the window full of `initial_ns` samples (the first wakes
    /// move the margin only as far as a percentile of a full window
    /// lets them), rather than empty (the percentile of the wakes seen).
    pub prefill: bool,
}

/// A wake margin learnt from recent wakes' lateness.
#[derive(Clone, Debug)]
pub struct WakeMargin {
    cfg: WakeMarginConfig,
    samples: [u64; MAX_WINDOW],
    /// Wakes recorded (plus a full window when prefilled).
    n: usize,
    margin_ns: u64,
}

impl WakeMargin {
    /// A margin learning by `cfg`; out-of-range fields are clamped (the
    /// window to 1..=64, the percentile to 1..=100, `every` to at least 1).
    pub fn new(cfg: WakeMarginConfig) -> WakeMargin {
        let cfg = WakeMarginConfig {
            percentile: cfg.percentile.clamp(1, 100),
            window: cfg.window.clamp(1, MAX_WINDOW),
            every: cfg.every.max(1),
            ..cfg
        };
        let initial = cfg.initial_ns.min(cfg.cap_ns);
        WakeMargin {
            samples: [if cfg.prefill { cfg.initial_ns } else { 0 }; MAX_WINDOW],
            n: if cfg.prefill { cfg.window } else { 0 },
            margin_ns: initial,
            cfg,
        }
    }

    /// How far short of a deadline to sleep now.
    pub fn margin_ns(&self) -> u64 {
        self.margin_ns
    }

    /// The most the margin may be.
    pub fn cap_ns(&self) -> u64 {
        self.cfg.cap_ns
    }

    /// Record one wake `late_ns` after the time asked; returns the new
    /// margin when it is recomputed.
    pub fn record(&mut self, late_ns: u64) -> Option<u64> {
        let len = self.cfg.window;
        self.samples[self.n % len] = late_ns;
        self.n += 1;
        if !self.n.is_multiple_of(self.cfg.every) {
            return None;
        }
        let k = self.n.min(len);
        let mut s = self.samples;
        let s = &mut s[..k];
        s.sort_unstable();
        let rank = (k * self.cfg.percentile as usize).div_ceil(100).clamp(1, k);
        self.margin_ns = s[rank - 1].min(self.cfg.cap_ns);
        Some(self.margin_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sparse(pct: u32) -> WakeMargin {
        WakeMargin::new(WakeMarginConfig {
            percentile: pct,
            window: 64,
            every: 8,
            initial_ns: 50_000,
            cap_ns: u64::MAX,
            prefill: false,
        })
    }

    #[test]
    fn margin_is_the_chosen_percentile_of_recent_wakes() {
        let mut w = sparse(95);
        assert_eq!(w.margin_ns(), 50_000);
        // Nothing until 8 samples, then every 8th.
        for late in 1..=7 {
            assert_eq!(w.record(late * 1000), None);
        }
        assert_eq!(w.record(8000), Some(8000), "95th of 1..8 µs is the top");
        // 64 samples 1..=64 µs: the 95th percentile is the 61st.
        let mut w = sparse(95);
        let got: Vec<u64> = (1..=64).filter_map(|l| w.record(l * 1000)).collect();
        assert_eq!(got.last(), Some(&61_000));
        // The window slides: 64 more wakes of 5 µs replace them all.
        let got: Vec<u64> = (0..64).filter_map(|_| w.record(5000)).collect();
        assert_eq!(got.last(), Some(&5000));
        assert_eq!(w.margin_ns(), 5000);
        let mut w = sparse(50);
        let got: Vec<u64> = (1..=64).filter_map(|l| w.record(l * 1000)).collect();
        assert_eq!(got.last(), Some(&32_000));
    }

    #[test]
    fn margin_never_exceeds_the_cap() {
        let mut w = WakeMargin::new(WakeMarginConfig {
            percentile: 90,
            window: 32,
            every: 1,
            initial_ns: 1_000_000,
            cap_ns: 100_000,
            prefill: false,
        });
        assert_eq!(w.margin_ns(), 100_000, "initial margin capped");
        for _ in 0..100 {
            assert!(w.record(10_000_000).is_some_and(|m| m <= 100_000));
        }
        assert_eq!(w.margin_ns(), 100_000);
    }

    #[test]
    fn a_prefilled_window_moves_only_as_a_full_window_percentile() {
        // The completion-timer rule: 32 wakes, the 90th percentile (the
        // 29th smallest), starting full of the cap.
        let cap = 200_000;
        let mut w = WakeMargin::new(WakeMarginConfig {
            percentile: 90,
            window: 32,
            every: 1,
            initial_ns: cap,
            cap_ns: cap,
            prefill: true,
        });
        assert_eq!(w.margin_ns(), cap);
        // 28 prompt wakes leave 4 samples at the cap: still the cap.
        for _ in 0..28 {
            assert_eq!(w.record(1_000), Some(cap));
        }
        // The 29th brings the 29th smallest down to the wakes seen.
        assert_eq!(w.record(1_000), Some(1_000));
        // Four late wakes in the window (the top 4 of 32) are ignored...
        for _ in 0..3 {
            assert_eq!(w.record(150_000), Some(1_000));
        }
        // ...a fourth late one among the last 32 is not.
        assert_eq!(w.record(150_000), Some(150_000));
    }
}
