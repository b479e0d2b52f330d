//! What a run measured: per direction I/O counts and latency, per job CPU
//! time and verify results, and fio's per-group summaries.
//!
//! Latency min/max/mean/stddev are exact (running sums, sample standard
//! deviation as fio's `calc_lat`); percentiles come from an HdrHistogram
//! with 3 significant digits, the counterpart of fio's `io_u_plat` buckets.
//! Bandwidth and IOPS are computed as fio does, from bytes and the
//! direction's runtime in milliseconds.

use crate::spec::{JobSpec, DEFAULT_PERCENTILES};
use hdrhistogram::Histogram;

/// Longest latency the histograms resolve (an hour); longer ones saturate.
const HIST_MAX_NS: u64 = 3_600_000_000_000;

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_NS, 3).expect("static histogram bounds are valid")
}

/// Latency samples of one kind, in nanoseconds.
#[derive(Clone, Debug)]
pub struct LatStats {
    pub min_ns: u64,
    pub max_ns: u64,
    pub samples: u64,
    sum: u128,
    sum_sq: u128,
    pub hist: Histogram<u64>,
}

impl Default for LatStats {
    fn default() -> Self {
        LatStats {
            min_ns: u64::MAX,
            max_ns: 0,
            samples: 0,
            sum: 0,
            sum_sq: 0,
            hist: new_histogram(),
        }
    }
}

impl LatStats {
    /// Record one sample (the hot path: no allocation, no clock).
    #[inline]
    pub fn record(&mut self, ns: u64) {
        self.min_ns = self.min_ns.min(ns);
        self.max_ns = self.max_ns.max(ns);
        self.samples += 1;
        self.sum += ns as u128;
        self.sum_sq += (ns as u128) * (ns as u128);
        self.hist.saturating_record(ns.max(1));
    }

    pub fn merge(&mut self, o: &LatStats) {
        if o.samples == 0 {
            return;
        }
        self.min_ns = self.min_ns.min(o.min_ns);
        self.max_ns = self.max_ns.max(o.max_ns);
        self.samples += o.samples;
        self.sum += o.sum;
        self.sum_sq += o.sum_sq;
        // Same bounds on both sides, so adding cannot fail.
        let _ = self.hist.add(&o.hist);
    }

    /// Smallest sample, 0 when there are none (fio prints 0 then).
    pub fn min(&self) -> u64 {
        if self.samples == 0 {
            0
        } else {
            self.min_ns
        }
    }

    pub fn mean(&self) -> f64 {
        if self.samples == 0 {
            0.0
        } else {
            self.sum as f64 / self.samples as f64
        }
    }

    /// Sample standard deviation (n - 1), as fio.
    pub fn stddev(&self) -> f64 {
        if self.samples < 2 {
            return 0.0;
        }
        let n = self.samples as f64;
        let mean = self.sum as f64 / n;
        let var = (self.sum_sq as f64 - n * mean * mean) / (n - 1.0);
        var.max(0.0).sqrt()
    }

    /// The latency at percentile `p` (0..100].
    pub fn percentile(&self, p: f64) -> u64 {
        if self.samples == 0 {
            return 0;
        }
        self.hist.value_at_quantile(p / 100.0)
    }

    /// `(percent, ns)` for fio's default list.
    pub fn percentiles(&self) -> Vec<(f64, u64)> {
        self.percentiles_of(&DEFAULT_PERCENTILES)
    }

    /// `(percent, ns)` for each percent of `list`.
    pub fn percentiles_of(&self, list: &[f64]) -> Vec<(f64, u64)> {
        list.iter().map(|&p| (p, self.percentile(p))).collect()
    }

    /// Samples in `[lo, hi)` nanoseconds. Each histogram bucket is placed
    /// by its median-equivalent value, so adjacent ranges never share a
    /// bucket and fio's latency rows, which are disjoint, sum to 100 %.
    pub fn count_between(&self, lo: u64, hi: u64) -> u64 {
        if self.samples == 0 || hi <= lo {
            return 0;
        }
        self.hist
            .iter_recorded()
            .filter(|v| {
                let at = self.hist.median_equivalent(v.value_iterated_to());
                at >= lo && at < hi
            })
            .map(|v| v.count_at_value())
            .sum()
    }
}

/// One direction (read or write) of a job.
#[derive(Clone, Debug, Default)]
pub struct DirStats {
    pub io_bytes: u64,
    pub total_ios: u64,
    /// Completed with fewer bytes than asked (never happens for a block device).
    pub short_ios: u64,
    /// Dropped (rate limiting); always 0 here, present for fio's shape.
    pub drop_ios: u64,
    /// I/Os that completed with an error status.
    pub errors: u64,
    /// How long this direction was active, ns.
    pub runtime_ns: u64,
    /// Submission to completion, the one latency blkstack measures: it
    /// reads the clock once at submit and once at completion, so fio's
    /// `clat` and `lat` are the same samples and `slat` is not measured.
    pub clat: LatStats,
    /// Bandwidth over each [`SAMPLE_INTERVAL_NS`] of the I/O phase, KiB/s
    /// (fio's `bw_avg_time` samples).
    pub bw_samples: Vec<u64>,
    /// IOPS over each sample interval (fio's `iops_avg_time` samples).
    pub iops_samples: Vec<u64>,
}

/// fio's default `bw_avg_time` / `iops_avg_time`: 500 ms.
pub const SAMPLE_INTERVAL_NS: u64 = 500_000_000;

/// `(min, max, mean, sample stddev)` of periodic samples, as fio's
/// `calc_lat` over `bw_stat`/`iops_stat`; `None` without samples.
pub fn sample_stats(v: &[u64]) -> Option<(u64, u64, f64, f64)> {
    if v.is_empty() {
        return None;
    }
    let n = v.len() as f64;
    let min = *v.iter().min()?;
    let max = *v.iter().max()?;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let dev = if v.len() > 1 {
        (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    Some((min, max, mean, dev))
}

impl DirStats {
    /// fio's runtime in milliseconds (rounded up, as fio's `update_runtime`,
    /// so a sub-millisecond run still has a rate).
    pub fn runtime_ms(&self) -> u64 {
        self.runtime_ns.div_ceil(1_000_000)
    }

    /// IOPS as fio computes them: ios * 1000 / runtime_ms.
    pub fn iops(&self) -> f64 {
        let ms = self.runtime_ms();
        if ms == 0 {
            0.0
        } else {
            self.total_ios as f64 * 1000.0 / ms as f64
        }
    }

    /// Bytes per second as fio computes them (integer).
    pub fn bw_bytes(&self) -> u64 {
        let ms = self.runtime_ms();
        if ms == 0 {
            0
        } else {
            (self.io_bytes as u128 * 1000 / ms as u128) as u64
        }
    }

    /// KiB per second (fio's JSON `bw`).
    pub fn bw_kib(&self) -> u64 {
        self.bw_bytes() / 1024
    }

    pub fn merge(&mut self, o: &DirStats) {
        self.io_bytes += o.io_bytes;
        self.total_ios += o.total_ios;
        self.short_ios += o.short_ios;
        self.drop_ios += o.drop_ios;
        self.errors += o.errors;
        self.runtime_ns = self.runtime_ns.max(o.runtime_ns);
        self.clat.merge(&o.clat);
        self.bw_samples.extend_from_slice(&o.bw_samples);
        self.iops_samples.extend_from_slice(&o.iops_samples);
    }
}

/// fio's depth distributions (`IO depths`, `submit`, `complete`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DepthStats {
    /// In-flight count at each submission: 1, 2, 4, 8, 16, 32, >=64.
    pub depth: [u64; 7],
    /// I/Os per submit call: 0, 4, 8, 16, 32, 64, >64 (fio's buckets).
    pub submit: [u64; 7],
    /// Completions per reap: same buckets.
    pub complete: [u64; 7],
}

impl DepthStats {
    #[inline]
    pub fn depth_bucket(depth: u32) -> usize {
        match depth {
            0..=1 => 0,
            2..=3 => 1,
            4..=7 => 2,
            8..=15 => 3,
            16..=31 => 4,
            32..=63 => 5,
            _ => 6,
        }
    }

    #[inline]
    pub fn batch_bucket(n: u32) -> usize {
        match n {
            0 => 0,
            1..=4 => 1,
            5..=8 => 2,
            9..=16 => 3,
            17..=32 => 4,
            33..=64 => 5,
            _ => 6,
        }
    }

    pub fn merge(&mut self, o: &DepthStats) {
        for i in 0..7 {
            self.depth[i] += o.depth[i];
            self.submit[i] += o.submit[i];
            self.complete[i] += o.complete[i];
        }
    }
}

/// The result of one job thread, or of several merged by `group_reporting`.
#[derive(Clone, Debug)]
pub struct JobResult {
    pub name: String,
    pub groupid: u32,
    /// How many threads this result covers (fio `jobs=`).
    pub members: u32,
    /// The spec the job ran with.
    pub spec: JobSpec,
    /// The device the job ran against, as named.
    pub device: String,
    /// First error, as a positive errno (0: none). A verify failure is
    /// EILSEQ as in fio.
    pub error: i32,
    pub read: DirStats,
    pub write: DirStats,
    pub trim: DirStats,
    pub depths: DepthStats,
    /// The job ended because `steadystate` was attained.
    pub steady_attained: bool,
    pub usr_cpu_ns: u64,
    pub sys_cpu_ns: u64,
    /// Voluntary + involuntary context switches of the job thread(s).
    pub ctx: u64,
    /// Major and minor page faults of the job thread(s).
    pub majf: u64,
    pub minf: u64,
    /// Time the job ran (I/O phase + verify), ns; fio `job_runtime`.
    pub runtime_ns: u64,
    /// Wall time from the job's start to its end, ramp included, ns.
    pub elapsed_ns: u64,
    /// Blocks that failed verification.
    pub verify_errors: u64,
    /// Blocks that were verified.
    pub verify_checked: u64,
    /// The first few verify failures, described as fio does.
    pub verify_failures: Vec<String>,
}

impl JobResult {
    pub fn new(name: &str, groupid: u32, spec: &JobSpec, device: &str) -> JobResult {
        JobResult {
            name: name.to_string(),
            groupid,
            members: 1,
            spec: spec.clone(),
            device: device.to_string(),
            error: 0,
            read: DirStats::default(),
            write: DirStats::default(),
            trim: DirStats::default(),
            depths: DepthStats::default(),
            steady_attained: false,
            usr_cpu_ns: 0,
            sys_cpu_ns: 0,
            ctx: 0,
            majf: 0,
            minf: 0,
            runtime_ns: 0,
            elapsed_ns: 0,
            verify_errors: 0,
            verify_checked: 0,
            verify_failures: Vec::new(),
        }
    }

    /// User CPU as a percent of the job's runtime (fio `usr_cpu`).
    pub fn usr_cpu_pct(&self) -> f64 {
        pct(
            self.usr_cpu_ns,
            self.runtime_ns * self.members.max(1) as u64,
        )
    }

    pub fn sys_cpu_pct(&self) -> f64 {
        pct(
            self.sys_cpu_ns,
            self.runtime_ns * self.members.max(1) as u64,
        )
    }

    /// Fold another thread's result into this one (fio `sum_thread_stats`).
    pub fn merge(&mut self, o: &JobResult) {
        self.members += o.members;
        if self.error == 0 {
            self.error = o.error;
        }
        self.read.merge(&o.read);
        self.write.merge(&o.write);
        self.trim.merge(&o.trim);
        self.steady_attained |= o.steady_attained;
        self.depths.merge(&o.depths);
        self.usr_cpu_ns += o.usr_cpu_ns;
        self.sys_cpu_ns += o.sys_cpu_ns;
        self.ctx += o.ctx;
        self.majf += o.majf;
        self.minf += o.minf;
        self.runtime_ns = self.runtime_ns.max(o.runtime_ns);
        self.elapsed_ns = self.elapsed_ns.max(o.elapsed_ns);
        self.verify_errors += o.verify_errors;
        self.verify_checked += o.verify_checked;
        for f in &o.verify_failures {
            if self.verify_failures.len() < 10 {
                self.verify_failures.push(f.clone());
            }
        }
    }

    pub fn dir(&self, write: bool) -> &DirStats {
        if write {
            &self.write
        } else {
            &self.read
        }
    }
}

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 * 100.0 / whole as f64
    }
}

/// fio's `group_run_stats` for one direction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupDir {
    pub io_bytes: u64,
    /// Aggregate bandwidth: bytes * 1000 / max_run_ms.
    pub agg_bw: u64,
    pub min_bw: u64,
    pub max_bw: u64,
    pub min_run_ms: u64,
    pub max_run_ms: u64,
}

/// The `Run status group N` line data.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupStats {
    pub groupid: u32,
    pub read: GroupDir,
    pub write: GroupDir,
    pub trim: GroupDir,
}

impl GroupStats {
    /// Summarise the threads of one group, as fio's `show_run_stats`.
    pub fn from_threads<'a>(
        groupid: u32,
        threads: impl Iterator<Item = &'a JobResult>,
    ) -> GroupStats {
        let mut g = GroupStats {
            groupid,
            ..GroupStats::default()
        };
        for gd in [&mut g.read, &mut g.write, &mut g.trim] {
            gd.min_bw = u64::MAX;
            gd.min_run_ms = u64::MAX;
        }
        for t in threads {
            for (gd, d) in [
                (&mut g.read, &t.read),
                (&mut g.write, &t.write),
                (&mut g.trim, &t.trim),
            ] {
                let run = d.runtime_ms();
                if run == 0 {
                    continue;
                }
                gd.max_run_ms = gd.max_run_ms.max(run);
                gd.min_run_ms = gd.min_run_ms.min(run);
                let bw = d.bw_bytes();
                gd.min_bw = gd.min_bw.min(bw);
                gd.max_bw = gd.max_bw.max(bw);
                gd.io_bytes += d.io_bytes;
            }
        }
        for gd in [&mut g.read, &mut g.write, &mut g.trim] {
            if gd.max_run_ms == 0 {
                *gd = GroupDir::default();
            } else {
                gd.agg_bw = (gd.io_bytes as u128 * 1000 / gd.max_run_ms as u128) as u64;
            }
        }
        g
    }
}

/// Everything a run produced.
#[derive(Clone, Debug)]
pub struct BenchReport {
    /// `blkstack-<version>`, in fio's `"fio version"` slot.
    pub version: String,
    /// Jobs as reported: one per thread, or one per group with
    /// `group_reporting`.
    pub jobs: Vec<JobResult>,
    /// One per thread, never merged.
    pub threads: Vec<JobResult>,
    pub groups: Vec<GroupStats>,
    /// Seconds since the epoch when the run ended.
    pub timestamp: u64,
}

impl BenchReport {
    /// Build the reported view from per-thread results.
    pub fn from_threads(threads: Vec<JobResult>) -> BenchReport {
        let mut group_ids: Vec<u32> = threads.iter().map(|t| t.groupid).collect();
        group_ids.dedup();
        group_ids.sort_unstable();
        group_ids.dedup();
        let mut jobs: Vec<JobResult> = Vec::new();
        for &gid in &group_ids {
            let members: Vec<&JobResult> = threads.iter().filter(|t| t.groupid == gid).collect();
            if members.iter().any(|t| t.spec.group_reporting) {
                let mut merged = members[0].clone();
                for t in &members[1..] {
                    merged.merge(t);
                }
                jobs.push(merged);
            } else {
                jobs.extend(members.into_iter().cloned());
            }
        }
        let groups = group_ids
            .iter()
            .map(|&gid| GroupStats::from_threads(gid, threads.iter().filter(|t| t.groupid == gid)))
            .collect();
        BenchReport {
            version: format!("blkstack-{}", env!("CARGO_PKG_VERSION")),
            jobs,
            threads,
            groups,
            timestamp: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        }
    }

    /// Total verify failures over all threads.
    pub fn verify_errors(&self) -> u64 {
        self.threads.iter().map(|t| t.verify_errors).sum()
    }

    /// Did any job end with an error (I/O or verify)?
    pub fn failed(&self) -> bool {
        self.threads
            .iter()
            .any(|t| t.error != 0 || t.verify_errors > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lat_stats_are_exact_where_fio_is() {
        let mut l = LatStats::default();
        for v in [100u64, 200, 300, 400] {
            l.record(v);
        }
        assert_eq!((l.min(), l.max_ns, l.samples), (100, 400, 4));
        assert!((l.mean() - 250.0).abs() < 1e-9);
        // sample stddev of 100..400 step 100
        assert!((l.stddev() - 129.0994).abs() < 1e-3);
        assert!(l.percentile(50.0) >= 200 && l.percentile(50.0) <= 201);
        assert_eq!(l.count_between(0, 250), 2);
        assert_eq!(l.count_between(250, 1000), 2);
        let mut m = LatStats::default();
        m.record(50);
        m.merge(&l);
        assert_eq!((m.min(), m.samples), (50, 5));
    }

    #[test]
    fn latency_ranges_are_disjoint_around_every_boundary() {
        // Samples on and around fio's row boundaries (2 ms, 10 ms, 20 ms,
        // ...), where the histogram's buckets straddle the bound.
        let mut l = LatStats::default();
        let bounds = [
            0u64,
            1_000,
            2_000,
            750_000,
            1_000_000,
            2_000_000,
            4_000_000,
            10_000_000,
            20_000_000,
            50_000_000,
            1_000_000_000,
        ];
        for &b in &bounds[1..] {
            for d in [-3_000i64, -1, 0, 1, 700, 3_000] {
                l.record((b as i64 + d).max(1) as u64);
            }
        }
        let mut edges = bounds.to_vec();
        edges.push(u64::MAX);
        let counted: u64 = edges.windows(2).map(|w| l.count_between(w[0], w[1])).sum();
        assert_eq!(counted, l.samples, "every sample in exactly one range");
        // A sample well inside a range is counted there.
        assert!(l.count_between(2_000_000, 4_000_000) >= 3);
    }

    #[test]
    fn dir_rates_follow_fio_integer_math() {
        let d = DirStats {
            io_bytes: 4096 * 1000,
            total_ios: 1000,
            runtime_ns: 999_100_000, // 1000 ms after rounding up
            ..DirStats::default()
        };
        assert_eq!(d.runtime_ms(), 1000);
        assert!((d.iops() - 1000.0).abs() < 1e-9);
        assert_eq!(d.bw_bytes(), 4096 * 1000);
        assert_eq!(d.bw_kib(), 4000);
    }
}
