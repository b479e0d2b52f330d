//! How long a delay class holds a bio: dm-delay's fixed delay, plus two
//! latency models beyond dm. SPDK vbdev_delay's p99 model: the delay is an
//! "average" value except that one I/O in a hundred (drawn at random)
//! takes the p99 value instead. And a load-dependent model,
//! `delay = base * (1 + inflight / K)`, for a device whose queue grows with
//! the load: `K` I/Os in flight double the delay.

use super::MAX_DELAY_NS;

/// How long one class holds its bios.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Latency {
    pub delay_ns: u64,
    /// SPDK's p99 value, taken by one I/O in a hundred.
    pub p99_ns: Option<u64>,
    /// Load model: `delay * (1 + inflight / k)`.
    pub load_k: Option<f64>,
}

impl Latency {
    pub fn plain(delay_ns: u64) -> Latency {
        Latency {
            delay_ns,
            p99_ns: None,
            load_k: None,
        }
    }
}

/// The latency of the three classes (read, write, flush) and the draw
/// the p99 model needs.
pub(super) struct LatencyModel {
    pub classes: [Latency; 3],
    rng: u64,
    /// How many bios drew the p99 value (the `stats` message's
    /// `p99_draws`).
    pub p99_draws: u64,
}

impl LatencyModel {
    pub fn new(classes: [Latency; 3]) -> LatencyModel {
        LatencyModel {
            classes,
            rng: 0x9e37_79b9_7f4a_7c15,
            p99_draws: 0,
        }
    }

    /// xorshift64*: the p99 draw needs a cheap, seedable generator, not
    /// a good one.
    fn next_random(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// The delay a bio of `class` gets now, with `inflight` other I/Os on
    /// the target.
    pub fn delay_for(&mut self, class: usize, inflight: u64) -> u64 {
        let t = self.classes[class];
        let mut base = t.delay_ns;
        if let Some(p99) = t.p99_ns {
            if self.next_random().is_multiple_of(100) {
                base = p99;
                self.p99_draws += 1;
            }
        }
        match t.load_k {
            Some(k) if base > 0 => {
                let scaled = base as f64 * (1.0 + inflight as f64 / k);
                scaled.min(MAX_DELAY_NS as f64).ceil() as u64
            }
            _ => base,
        }
    }

    /// Whether the target must count I/Os in flight (a load model is on).
    pub fn load_model_on(&self) -> bool {
        self.classes.iter().any(|t| t.load_k.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::targets::delay::READ;

    #[test]
    fn load_model_scales_base_delay() {
        let mut m = LatencyModel::new(
            [Latency {
                delay_ns: 1_000_000,
                p99_ns: None,
                load_k: Some(4.0),
            }; 3],
        );
        m.rng = 1;
        assert_eq!(m.delay_for(READ, 0), 1_000_000);
        assert_eq!(m.delay_for(READ, 4), 2_000_000);
        assert_eq!(m.delay_for(READ, 2), 1_500_000);
    }

    #[test]
    fn p99_draw_is_about_one_in_a_hundred() {
        let mut m = LatencyModel::new(
            [Latency {
                delay_ns: 1,
                p99_ns: Some(2),
                load_k: None,
            }; 3],
        );
        let slow = (0..100_000).filter(|_| m.delay_for(READ, 0) == 2).count();
        assert!((700..1300).contains(&slow), "{slow} of 100000 took p99");
        assert_eq!(m.p99_draws, slow as u64);
    }
}
