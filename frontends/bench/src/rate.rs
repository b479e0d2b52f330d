//! Pacing a job: fio's `rate`/`rate_iops` with `rate_process`, `thinktime`,
//! `flow`, `latency_target` and `steadystate`.
//!
//! Rates follow fio's `usec_for_io`: each direction's next I/O is due when
//! the bytes (or I/Os) issued so far would have taken at the target rate;
//! with `rate_process=poisson` the gaps between I/Os are exponential with
//! the same mean, as fio's Poisson arrivals. `flow` keeps each job's share
//! of the I/Os of its `flow_id` group at its weight's share (fio's
//! `flow_threshold_exceeded`). `latency_target` searches the deepest queue
//! whose `latency_percentile` stays under the target in each window (fio's
//! `lat_target_check`); `steadystate` ends a job once its IOPS or
//! bandwidth stays within a limit (or its slope does) over `ss_dur`.

use crate::parse::ValueError;
use rand::rngs::SmallRng;
use rand::Rng;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// How arrivals are spaced (fio `rate_process`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RateProcess {
    #[default]
    Linear,
    Poisson,
}

/// `rate`, `rate_iops`, their minimums, `rate_process`; `[read, write,
/// trim]`, 0 = unlimited.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RateSpec {
    pub bytes_per_sec: [u64; 3],
    pub iops: [u64; 3],
    pub min_bytes_per_sec: [u64; 3],
    pub min_iops: [u64; 3],
    pub process: RateProcess,
}

impl RateSpec {
    pub fn limited(&self) -> bool {
        self.bytes_per_sec.iter().chain(&self.iops).any(|&v| v > 0)
    }
}

/// `thinktime`, `thinktime_spin`, `thinktime_blocks`.
#[derive(Clone, Debug, PartialEq)]
pub struct ThinkTime {
    pub time: Duration,
    pub spin: Duration,
    pub blocks: u32,
}

impl Default for ThinkTime {
    fn default() -> Self {
        ThinkTime {
            time: Duration::ZERO,
            spin: Duration::ZERO,
            blocks: 1,
        }
    }
}

/// `flow`, `flow_id`, `flow_sleep`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FlowSpec {
    pub weight: u64,
    pub id: u32,
    pub sleep: Duration,
}

/// What `steadystate` watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SsMetric {
    Iops,
    IopsSlope,
    Bw,
    BwSlope,
    Lat,
    LatSlope,
}

/// `steadystate=METRIC:LIMIT[%]`, `ss_dur`, `ss_ramp`, `ss_interval`.
#[derive(Clone, Debug, PartialEq)]
pub struct SteadyState {
    pub metric: SsMetric,
    pub limit: f64,
    /// The limit is a percent of the mean.
    pub percent: bool,
    pub dur: Duration,
    pub ramp: Duration,
    pub interval: Duration,
}

impl SteadyState {
    pub fn parse(s: &str) -> Result<SteadyState, ValueError> {
        let (m, l) = s
            .split_once(':')
            .ok_or_else(|| ValueError(format!("'{s}' is not METRIC:LIMIT (e.g. iops:10%)")))?;
        let metric = match m.trim() {
            "iops" => SsMetric::Iops,
            "iops_slope" => SsMetric::IopsSlope,
            "bw" => SsMetric::Bw,
            "bw_slope" => SsMetric::BwSlope,
            "lat" => SsMetric::Lat,
            "lat_slope" => SsMetric::LatSlope,
            o => {
                return Err(ValueError(format!(
                    "'{o}' is not one of iops, iops_slope, bw, bw_slope, lat, lat_slope"
                )))
            }
        };
        let (num, percent) = match l.trim().strip_suffix('%') {
            Some(n) => (n, true),
            None => (l.trim(), false),
        };
        let limit: f64 = num
            .parse()
            .map_err(|_| ValueError(format!("'{l}' is not a number")))?;
        Ok(SteadyState {
            metric,
            limit,
            percent,
            dur: Duration::ZERO,
            ramp: Duration::ZERO,
            interval: Duration::from_secs(1),
        })
    }
}

/// `latency_target`, `latency_window`, `latency_percentile`.
#[derive(Clone, Debug, PartialEq)]
pub struct LatencyTarget {
    pub target: Duration,
    pub window: Duration,
    pub percentile: f64,
}

/// Per-thread pacing state: when each direction may issue next.
pub(crate) struct Pacer {
    spec: RateSpec,
    /// Next due time per direction, ns on the engine's clock.
    next_ns: [u64; 3],
    think: ThinkTime,
    since_think: u32,
    think_until_ns: u64,
}

impl Pacer {
    pub fn new(spec: &RateSpec, think: &ThinkTime, start_ns: u64) -> Pacer {
        Pacer {
            spec: spec.clone(),
            next_ns: [start_ns; 3],
            think: think.clone(),
            since_think: 0,
            think_until_ns: 0,
        }
    }

    /// Start over from `now` (after the ramp).
    pub fn restart(&mut self, now: u64) {
        self.next_ns = [now; 3];
    }

    /// When an I/O of direction `dir` may be issued.
    pub fn due_ns(&self, dir: usize) -> u64 {
        let rate_due = if self.spec.bytes_per_sec[dir] > 0 || self.spec.iops[dir] > 0 {
            self.next_ns[dir]
        } else {
            0
        };
        rate_due.max(self.think_until_ns)
    }

    /// Account an issued I/O of `bytes`.
    pub fn issued(&mut self, dir: usize, bytes: u64, now: u64, rng: &mut SmallRng) {
        let mut gap_ns = 0.0f64;
        if self.spec.iops[dir] > 0 {
            gap_ns = gap_ns.max(1e9 / self.spec.iops[dir] as f64);
        }
        if self.spec.bytes_per_sec[dir] > 0 {
            gap_ns = gap_ns.max(bytes as f64 * 1e9 / self.spec.bytes_per_sec[dir] as f64);
        }
        if gap_ns > 0.0 {
            if self.spec.process == RateProcess::Poisson {
                let u: f64 = rng.gen_range(f64::EPSILON..1.0);
                gap_ns *= -u.ln();
            }
            // A job that fell behind does not burst to catch up by more
            // than one second's worth.
            let base = self.next_ns[dir].max(now.saturating_sub(1_000_000_000));
            self.next_ns[dir] = base + gap_ns as u64;
        }
        if !self.think.time.is_zero() {
            self.since_think += 1;
            if self.since_think >= self.think.blocks.max(1) {
                self.since_think = 0;
                self.think_until_ns = now + self.think.time.as_nanos() as u64;
            }
        }
    }

    /// `thinktime_spin`: how much of a think to spend spinning.
    pub fn spin_ns(&self) -> u64 {
        self.think.spin.as_nanos() as u64
    }
}

/// One `flow_id` group: I/Os issued by all members, and their weights.
#[derive(Default)]
pub(crate) struct FlowGroup {
    issued: AtomicU64,
    total_weight: AtomicU64,
}

/// The group of `id`, shared by every job of a run.
pub(crate) fn flow_group(id: u32) -> Arc<FlowGroup> {
    static GROUPS: OnceLock<Mutex<HashMap<u32, Arc<FlowGroup>>>> = OnceLock::new();
    let groups = GROUPS.get_or_init(Default::default);
    let mut g = groups.lock().unwrap_or_else(|e| e.into_inner());
    g.entry(id).or_default().clone()
}

/// One job thread's membership of a flow group.
pub(crate) struct FlowMember {
    group: Arc<FlowGroup>,
    weight: u64,
    mine: u64,
}

impl FlowMember {
    pub fn join(spec: &FlowSpec) -> Option<FlowMember> {
        if spec.weight == 0 {
            return None;
        }
        let group = flow_group(spec.id);
        group.total_weight.fetch_add(spec.weight, Ordering::Relaxed);
        Some(FlowMember {
            group,
            weight: spec.weight,
            mine: 0,
        })
    }

    /// May this job issue one more I/O? Counts it when yes.
    pub fn may_issue(&mut self) -> bool {
        let total = self.group.issued.load(Ordering::Relaxed).max(1);
        let weights = self.group.total_weight.load(Ordering::Relaxed).max(1);
        if self.mine as f64 / total as f64 > self.weight as f64 / weights as f64 {
            return false;
        }
        self.group.issued.fetch_add(1, Ordering::Relaxed);
        self.mine += 1;
        true
    }
}

impl Drop for FlowMember {
    fn drop(&mut self) {
        // A finished job no longer holds the others back.
        self.group
            .total_weight
            .fetch_sub(self.weight, Ordering::Relaxed);
        self.group.issued.fetch_sub(self.mine, Ordering::Relaxed);
    }
}

/// `latency_target`: the queue depth allowed now.
pub(crate) struct DepthProbe {
    target_ns: u64,
    window_ns: u64,
    percentile: f64,
    max_depth: u32,
    pub depth: u32,
    window_end_ns: u64,
    ios: u64,
    over: u64,
}

impl DepthProbe {
    pub fn new(t: &LatencyTarget, max_depth: u32, now: u64) -> DepthProbe {
        DepthProbe {
            target_ns: t.target.as_nanos() as u64,
            window_ns: (t.window.as_nanos() as u64).max(1_000_000),
            percentile: t.percentile,
            max_depth,
            depth: 1,
            window_end_ns: now + (t.window.as_nanos() as u64).max(1_000_000),
            ios: 0,
            over: 0,
        }
    }

    /// Record a completion; at a window's end raise the depth by one when
    /// the window met the target, else halve it.
    pub fn completed(&mut self, lat_ns: u64, now: u64) {
        self.ios += 1;
        if lat_ns > self.target_ns {
            self.over += 1;
        }
        if now < self.window_end_ns {
            return;
        }
        let ok_pct = 100.0 * (self.ios - self.over) as f64 / self.ios.max(1) as f64;
        self.depth = if ok_pct >= self.percentile {
            (self.depth + 1).min(self.max_depth)
        } else {
            (self.depth / 2).max(1)
        };
        self.ios = 0;
        self.over = 0;
        self.window_end_ns = now + self.window_ns;
    }
}

/// `steadystate`: per-interval samples and the test over the last `dur`.
pub(crate) struct SteadyTracker {
    ss: SteadyState,
    start_ns: u64,
    next_ns: u64,
    samples: Vec<f64>,
    prev: (u64, u64, u64, u64),
    pub attained: bool,
}

impl SteadyTracker {
    pub fn new(ss: &SteadyState, now: u64) -> SteadyTracker {
        let iv = (ss.interval.as_nanos() as u64).max(1_000_000);
        SteadyTracker {
            ss: ss.clone(),
            start_ns: now,
            next_ns: now + iv,
            samples: Vec::new(),
            prev: (0, 0, 0, 0),
            attained: false,
        }
    }

    /// Feed the job's totals `(ios, bytes, lat_sum_ns, lat_count)`;
    /// returns true once steady.
    pub fn tick(&mut self, now: u64, totals: (u64, u64, u64, u64)) -> bool {
        if now < self.next_ns {
            return false;
        }
        let iv = (self.ss.interval.as_nanos() as u64).max(1_000_000);
        self.next_ns = now + iv;
        let d = (
            totals.0 - self.prev.0,
            totals.1 - self.prev.1,
            totals.2 - self.prev.2,
            totals.3 - self.prev.3,
        );
        self.prev = totals;
        if now < self.start_ns + self.ss.ramp.as_nanos() as u64 {
            return false;
        }
        let v = match self.ss.metric {
            SsMetric::Iops | SsMetric::IopsSlope => d.0 as f64,
            SsMetric::Bw | SsMetric::BwSlope => d.1 as f64,
            SsMetric::Lat | SsMetric::LatSlope => d.2 as f64 / d.3.max(1) as f64,
        };
        self.samples.push(v);
        let want = (self.ss.dur.as_nanos() as u64 / iv).max(2) as usize;
        if self.samples.len() > want {
            self.samples.remove(0);
        }
        if self.samples.len() < want {
            return false;
        }
        self.attained = steady(&self.samples, &self.ss);
        self.attained
    }
}

/// fio's criteria: every sample within `limit` of the mean, or the
/// least-squares slope within it.
fn steady(v: &[f64], ss: &SteadyState) -> bool {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let limit = if ss.percent {
        ss.limit * mean / 100.0
    } else {
        ss.limit
    };
    match ss.metric {
        SsMetric::Iops | SsMetric::Bw | SsMetric::Lat => {
            v.iter().all(|x| (x - mean).abs() <= limit)
        }
        _ => {
            let xm = (n - 1.0) / 2.0;
            let (mut num, mut den) = (0.0, 0.0);
            for (i, y) in v.iter().enumerate() {
                num += (i as f64 - xm) * (y - mean);
                den += (i as f64 - xm).powi(2);
            }
            (num / den.max(f64::MIN_POSITIVE)).abs() <= limit
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn linear_and_poisson_rates_keep_the_mean() {
        for process in [RateProcess::Linear, RateProcess::Poisson] {
            let spec = RateSpec {
                iops: [1000, 0, 0],
                process,
                ..RateSpec::default()
            };
            let mut p = Pacer::new(&spec, &ThinkTime::default(), 0);
            let mut rng = SmallRng::seed_from_u64(3);
            for _ in 0..10_000 {
                let due = p.due_ns(0);
                p.issued(0, 4096, due, &mut rng);
            }
            let secs = p.due_ns(0) as f64 / 1e9;
            assert!(
                (secs - 10.0).abs() < 0.3,
                "{process:?}: 10k IOs took {secs}s"
            );
        }
    }

    #[test]
    fn steadystate_and_depth_probe() {
        let ss = SteadyState::parse("iops:10%").unwrap();
        assert!(steady(&[100.0, 105.0, 95.0], &ss));
        assert!(!steady(&[100.0, 150.0, 50.0], &ss));
        let slope = SteadyState::parse("bw_slope:1%").unwrap();
        assert!(!steady(&[10.0, 20.0, 30.0], &slope));
        assert!(SteadyState::parse("iops").is_err());
        let t = LatencyTarget {
            target: Duration::from_micros(100),
            window: Duration::from_millis(1),
            percentile: 99.0,
        };
        let mut d = DepthProbe::new(&t, 8, 0);
        d.completed(10_000, 2_000_000);
        assert_eq!(d.depth, 2);
        d.completed(1_000_000, 4_000_000);
        assert_eq!(d.depth, 1);
    }

    #[test]
    fn flow_members_share_by_weight() {
        let spec = FlowSpec {
            weight: 1,
            id: 9_999,
            sleep: Duration::ZERO,
        };
        let mut a = FlowMember::join(&spec).unwrap();
        let mut b = FlowMember::join(&FlowSpec { weight: 3, ..spec }).unwrap();
        let (mut na, mut nb) = (0, 0);
        for _ in 0..4000 {
            na += a.may_issue() as u32;
            nb += b.may_issue() as u32;
        }
        let ratio = nb as f64 / na as f64;
        assert!((2.7..3.3).contains(&ratio), "{nb}/{na}");
    }
}
