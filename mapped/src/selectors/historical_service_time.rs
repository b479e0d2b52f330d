//! `historical-service-time` (HST): choose the path whose estimated time
//! to finish this I/O, `(1 + outstanding) * historical service time`, is
//! smallest (kernel dm-ps-historical-service-time.c, version 0.1.1).
//!
//! The history is a fixed-point (10 fractional bits) exponential moving
//! average of measured service times, weighted by how long the measured
//! I/O took: times fall into 64 buckets of 2^24 ns (~16.8 ms) and bucket
//! n's weight is `base_weight^(n+1)`, the last bucket 0, precomputed at
//! create. A path that has finished nothing for `valid paths * hst` is
//! *stale*: an idle stale path is probed with one I/O, a loaded stale
//! path gets no more than equal use.
//!
//! The service time of an I/O is measured from its start time, or from
//! the path's previous completion if that is later (serial submission is
//! assumed), to the clock at completion (`ktime_get_ns()`). That start
//! time is what upstream 'dm: dm-mpath: Provide high-resolution timer to
//! HST with bio-mpath' changed. Before it, bio-based dm passed
//! `jiffies_to_nsecs(jiffies)`, which is not on the end time's base: with
//! the kernel's jiffies origin and 32-bit microseconds it lies 300 s (plus
//! multiples of 71.6 min) in the past once the machine has been up five
//! minutes. Then a path's first completion measures "300 s" (weight 0:
//! the history becomes 300 s), and every later one measures the time since
//! the path's previous completion. Busy paths work that history down by
//! 5 % per completion; a slow path completes too few I/Os to catch up,
//! stops being chosen once its in-flight I/Os drain, and its stale window
//! (`valid paths * hst`: tens of minutes) never lets it be probed: it starves
//! completely (the patch's "HST (orig)" figures show it). The precision loss
//! alone (start truncated to its tick) only adds up to a tick to I/Os that
//! found their path idle. The `multipath` target's `start_time` feature
//! picks which start time this selector is given (`ns`, `jiffies:HZ`,
//! `tick:HZ`).
//!
//! Selector args: `[<base_weight> [<threshold_multiplier>]]`, base weight
//! in 0..1024 (default 972, ~0.95), threshold 0 or 1 for no effect. Per-
//! path arg: `[<repeat_count>]` (kept for table syntax; HST does not use
//! it and its table view prints 0, as the kernel does).

use super::{parse_u32, repeat_count_arg, PathSelector, SelectorType, StatusType, ValidList};
use crate::error::TargetError;
use blkstack_core::clock::now_ns;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The `historical-service-time` selector as multipath's constructor finds
/// it by name (kernel `dm-ps-historical-service-time.c`'s `hst_ps`).
pub const TYPE: SelectorType = SelectorType {
    name: "historical-service-time",
    table_args: 1,
    info_args: 3,
    create,
};

const NAME: &str = "historical-service-time";
const FIXED_SHIFT: u32 = 10;
const FIXED_MAX: u64 = u64::MAX >> FIXED_SHIFT;
const FIXED_1: u64 = 1 << FIXED_SHIFT;
const FIXED_95: u32 = 972;
const MAX_INFLIGHT: u64 = FIXED_1;
const BUCKET_SHIFT: u32 = 24;
const WEIGHT_COUNT: usize = 64;

/// Kernel `fixed_power`: x^n in fixed point with `frac_bits`, rounding at
/// each step, in O(log n).
fn fixed_power(mut x: u64, frac_bits: u32, mut n: u32) -> u64 {
    let mut result: u64 = 1 << frac_bits;
    if n != 0 {
        loop {
            if n & 1 != 0 {
                result = result.wrapping_mul(x);
                result = result.wrapping_add(1 << (frac_bits - 1));
                result >>= frac_bits;
            }
            n >>= 1;
            if n == 0 {
                break;
            }
            x = x.wrapping_mul(x);
            x = x.wrapping_add(1 << (frac_bits - 1));
            x >>= frac_bits;
        }
    }
    result
}

/// Kernel `fixed_ema`: `last * weight + next * (1 - weight)`, rounded.
fn fixed_ema(last: u64, next: u64, weight: u64) -> u64 {
    let mut v = last.wrapping_mul(weight);
    v = v.wrapping_add(next.wrapping_mul(FIXED_1 - weight));
    v = v.wrapping_add(1 << (FIXED_SHIFT - 1));
    v >> FIXED_SHIFT
}

/// Kernel `time_after64(a, b)`: is `a` later than `b`?
fn time_after64(a: u64, b: u64) -> bool {
    (b.wrapping_sub(a) as i64) < 0
}

#[derive(Clone, Copy, Debug, Default)]
struct PathState {
    /// Fixed point, nanoseconds.
    historical_service_time: u64,
    stale_after: u64,
    last_finish: u64,
    outstanding: u64,
}

struct PathInfo {
    repeat_count: u32,
    /// The kernel's per-path spinlock.
    state: Mutex<PathState>,
}

/// One multipath priority group's historical-service-time state: per path,
/// a decaying average of service time and the nanosecond start times of
/// its in-flight I/O, from which it predicts which path ends a new I/O
/// first (upstream "dm mpath: use nanosecond start times for HST").
pub struct HistoricalServiceTime {
    valid: Mutex<ValidList>,
    valid_count: AtomicUsize,
    weights: [u32; WEIGHT_COUNT],
    threshold_multiplier: u32,
    paths: Vec<PathInfo>,
}

fn create(args: &[&str]) -> Result<Box<dyn PathSelector>, TargetError> {
    if args.len() > 2 {
        return Err(TargetError::invalid(format!(
            "{NAME}: expected at most 2 selector arguments '[<base_weight> [<threshold_multiplier>]]', got {}",
            args.len()
        )));
    }
    let base_weight = match args.first() {
        Some(a) => {
            let v = parse_u32(NAME, "base_weight", a)?;
            if v as u64 >= FIXED_1 {
                return Err(TargetError::invalid(format!(
                    "{NAME}: invalid base_weight {v}: must be below {FIXED_1} (10-bit fixed point)"
                )));
            }
            v
        }
        None => FIXED_95,
    };
    let threshold_multiplier = match args.get(1) {
        Some(a) => parse_u32(NAME, "threshold_multiplier", a)?,
        None => 0,
    };
    Ok(Box::new(HistoricalServiceTime::new(
        base_weight,
        threshold_multiplier,
    )))
}

impl HistoricalServiceTime {
    fn new(base_weight: u32, threshold_multiplier: u32) -> Self {
        // Kernel `hst_set_weights`: weights[n] = base^(n+1), last one 0.
        let mut weights = [0u32; WEIGHT_COUNT];
        for (i, w) in weights.iter_mut().enumerate().take(WEIGHT_COUNT - 1) {
            *w = fixed_power(base_weight as u64, FIXED_SHIFT, i as u32 + 1) as u32;
        }
        HistoricalServiceTime {
            valid: Mutex::new(ValidList::default()),
            valid_count: AtomicUsize::new(0),
            weights,
            threshold_multiplier,
            paths: Vec::new(),
        }
    }

    /// Kernel `hst_weight`: the weight for an I/O that took `delta` ns.
    fn weight(&self, delta: u64) -> u64 {
        let bucket = (delta >> BUCKET_SHIFT).min(WEIGHT_COUNT as u64 - 1) as usize;
        self.weights[bucket] as u64
    }

    fn snapshot(&self, p: usize) -> PathState {
        *self.paths[p].state.lock()
    }

    /// Kernel `hst_compare`: < 0 if `p1` is better, > 0 if `p2` is.
    fn compare(&self, p1: usize, p2: usize, time_now: u64) -> i64 {
        let a = self.snapshot(p1);
        let b = self.snapshot(p2);
        let (mut hst1, mut hst2) = (a.historical_service_time, b.historical_service_time);
        let (out1, out2) = (a.outstanding as i64, b.outstanding as i64);
        let (stale1, stale2) = (a.stale_after, b.stale_after);
        let thr = self.threshold_multiplier as u64;

        // Too similar an estimate: just balance outstanding I/O.
        let over_threshold = if hst1 > hst2 {
            hst1 > thr.wrapping_mul(hst2)
        } else {
            hst2 > thr.wrapping_mul(hst1)
        };
        if !over_threshold {
            return out1.wrapping_sub(out2);
        }

        // An idle stale path is probed; of two idle paths, the staler.
        if (out1 == 0 && stale1 < time_now)
            || (out2 == 0 && stale2 < time_now)
            || (out1 == 0 && out2 == 0)
        {
            let l = ((out2 == 0) as u64).wrapping_mul(stale1) as i64;
            let r = ((out1 == 0) as u64).wrapping_mul(stale2) as i64;
            return l.wrapping_sub(r);
        }

        let pi2_better = if out1 == out2 {
            hst1 > hst2
        } else {
            if a.outstanding >= MAX_INFLIGHT || b.outstanding >= MAX_INFLIGHT {
                hst1 >>= FIXED_SHIFT;
                hst2 >>= FIXED_SHIFT;
            }
            (1 + a.outstanding).wrapping_mul(hst1) > (1 + b.outstanding).wrapping_mul(hst2)
        };

        // A stale winner gets no more than equal use.
        if pi2_better {
            if stale2 < time_now {
                return out1.wrapping_sub(out2);
            }
            return 1;
        }
        if stale1 < time_now {
            return out1.wrapping_sub(out2);
        }
        -1
    }
}

impl PathSelector for HistoricalServiceTime {
    fn add_path(&mut self, args: &[&str]) -> Result<(), TargetError> {
        let repeat_count = repeat_count_arg(NAME, args)?;
        let index = self.paths.len();
        self.paths.push(PathInfo {
            repeat_count,
            state: Mutex::new(PathState {
                historical_service_time: FIXED_1,
                ..PathState::default()
            }),
        });
        self.valid.get_mut().push_back(index);
        *self.valid_count.get_mut() += 1;
        Ok(())
    }

    fn fail_path(&self, path: usize) {
        let mut v = self.valid.lock();
        if v.remove(path) {
            self.valid_count.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn reinstate_path(&self, path: usize) {
        let mut v = self.valid.lock();
        if !v.contains(path) {
            v.push_back(path);
            self.valid_count.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn select_path(&self, _nr_bytes: u64) -> Option<usize> {
        let time_now = now_ns();
        let mut v = self.valid.lock();
        let mut best: Option<usize> = None;
        for p in v.iter() {
            if best.is_none_or(|b| self.compare(p, b, time_now) < 0) {
                best = Some(p);
            }
        }
        let p = best?;
        // Last used goes to the end: least preferred on ties.
        v.move_to_tail(p);
        Some(p)
    }

    fn start_io(&self, path: usize, _nr_bytes: u64) {
        self.paths[path].state.lock().outstanding += 1;
    }

    fn end_io(&self, path: usize, _nr_bytes: u64, start_time_ns: u64) {
        let mut s = self.paths[path].state.lock();
        // Kernel `path_service_time`: a completion on this path after
        // this I/O started means it queued behind that one.
        let now = now_ns();
        let start = if time_after64(s.last_finish, start_time_ns) {
            s.last_finish
        } else {
            start_time_ns
        };
        s.last_finish = now;
        let st = if time_after64(start, now) {
            0
        } else {
            now - start
        };

        s.outstanding = s.outstanding.saturating_sub(1);
        s.historical_service_time = fixed_ema(
            s.historical_service_time,
            st.saturating_mul(FIXED_1).min(FIXED_MAX),
            self.weight(st),
        );
        // Fresh again; if nothing finishes within this window the
        // estimate is treated as too optimistic.
        s.stale_after = s.last_finish.wrapping_add(
            (self.valid_count.load(Ordering::Relaxed) as u64)
                .wrapping_mul(s.historical_service_time >> FIXED_SHIFT),
        );
    }

    fn needs_start_time(&self) -> bool {
        true
    }

    fn status(&self, path: Option<usize>, ty: StatusType) -> String {
        match (path, ty) {
            (None, _) => format!("2 {} {} ", self.weights[0], self.threshold_multiplier),
            (Some(p), StatusType::Info) => {
                let s = self.snapshot(p);
                format!(
                    "{} {} {} ",
                    s.historical_service_time, s.outstanding, s.stale_after
                )
            }
            (Some(_), StatusType::Table) => "0 ".to_string(),
        }
    }
}

impl HistoricalServiceTime {
    /// The repeat count a path was given (not used for selection).
    pub fn repeat_count(&self, path: usize) -> u32 {
        self.paths[path].repeat_count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_point_helpers_match_kernel_arithmetic() {
        assert_eq!(fixed_power(972, 10, 1), 972);
        // 0.95^2 = 0.9025 -> 924 (972*972 = 944784; +512 >> 10 = 923)
        assert_eq!(fixed_power(972, 10, 2), (972 * 972 + 512) >> 10);
        assert_eq!(fixed_power(0, 10, 3), 0);
        assert_eq!(fixed_power(512, 10, 0), 1024);
        // Weight 0 takes the new sample, weight 1 keeps the old one.
        assert_eq!(fixed_ema(5 << 10, 9 << 10, 0), 9 << 10);
        assert_eq!(fixed_ema(5 << 10, 9 << 10, 1024), 5 << 10);
    }

    #[test]
    fn weights_decay_by_bucket_and_end_at_zero() {
        let s = HistoricalServiceTime::new(FIXED_95, 0);
        assert_eq!(s.weights[0], 972);
        assert!(s.weights[1] < s.weights[0]);
        assert_eq!(s.weights[WEIGHT_COUNT - 1], 0);
        assert_eq!(s.weight(0), 972);
        assert_eq!(s.weight(1 << 24), s.weights[1] as u64);
        assert_eq!(s.weight(u64::MAX), 0);
    }

    #[test]
    fn prefers_the_path_with_the_shorter_history() {
        let mut s = HistoricalServiceTime::new(0, 0);
        s.add_path(&[]).unwrap();
        s.add_path(&[]).unwrap();
        // Base weight 0: the history is the last sample.
        let now = now_ns();
        s.start_io(0, 4096);
        s.end_io(0, 4096, now.saturating_sub(100_000));
        s.start_io(1, 4096);
        s.end_io(1, 4096, now.saturating_sub(1_000_000));
        let h0 = s.snapshot(0).historical_service_time >> FIXED_SHIFT;
        let h1 = s.snapshot(1).historical_service_time >> FIXED_SHIFT;
        assert!(h0 >= 100_000 && h0 < h1, "{h0} {h1}");
        // Both loaded equally and fresh: the faster history wins.
        s.start_io(0, 4096);
        s.start_io(1, 4096);
        assert_eq!(s.select_path(4096), Some(0));
        assert_eq!(s.status(None, StatusType::Table), "2 0 0 ");
        assert_eq!(s.status(Some(1), StatusType::Table), "0 ");
        let info = s.status(Some(0), StatusType::Info);
        assert_eq!(info.split_whitespace().nth(1), Some("1"));
    }

    /// The arithmetic behind the jiffies start time's starvation: a start time far
    /// before the clock (the kernel's jiffies base) makes the first sample
    /// huge, with weight 0, and every later one the gap since the path's
    /// previous completion, which moves the history by only 5 %.
    #[test]
    fn a_start_time_far_behind_the_clock_sticks_to_the_history() {
        let mut s = HistoricalServiceTime::new(FIXED_95, 0);
        s.add_path(&[]).unwrap();
        s.add_path(&[]).unwrap();
        let far_ns = 2_000_000_000;
        let hst =
            |s: &HistoricalServiceTime, p| s.snapshot(p).historical_service_time >> FIXED_SHIFT;
        s.start_io(0, 4096);
        s.end_io(0, 4096, now_ns() - far_ns);
        let first = hst(&s, 0);
        assert!(first >= far_ns, "{first}");
        // Same far start again: measured from the last completion instead.
        s.start_io(0, 4096);
        s.end_io(0, 4096, now_ns() - far_ns);
        let second = hst(&s, 0);
        assert!(
            second < first && second > first * 9 / 10,
            "{first} -> {second}"
        );
        // A path with a short history and 10 in flight still looks better,
        // and path 0's stale window (2 paths x ~2 s) keeps it from being
        // probed. Path 1's one 200 ms sample leaves it a ~92 ms history
        // (weight 0.95^12), so its own stale window is ~184 ms: a test
        // thread descheduled for a while (a loaded CI machine) does not
        // make it stale, which would rightly send the I/O to path 0.
        let now = now_ns();
        s.start_io(1, 4096);
        s.end_io(1, 4096, now - 200_000_000);
        for _ in 0..10 {
            s.start_io(1, 4096);
        }
        assert!(s.snapshot(0).stale_after > now + far_ns);
        assert_eq!(s.select_path(4096), Some(1));
    }

    #[test]
    fn args_are_checked() {
        assert!(create(&["1024"])
            .unwrap_err()
            .report()
            .contains("base_weight"));
        assert!(create(&["x"]).unwrap_err().report().contains("base_weight"));
        assert!(create(&["1", "2", "3"]).is_err());
        let s = create(&["512", "2"]).unwrap();
        assert_eq!(s.status(None, StatusType::Info), "2 512 2 ");
    }
}
