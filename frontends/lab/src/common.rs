//! What every experiment does: build a fresh stack, run a bench job on
//! it, and reduce repeated runs to mean and standard deviation. Process
//! CPU time is measured around the run, so CPU per I/O includes every
//! thread the mechanism uses (completion threads, kblockd, delay workers),
//! not only the submitters.

use anyhow::{Context, Result};
use blkstack_bench::{run_jobs, BlockSizes, JobSpec, RunOptions, RwMode};
use blkstack_core::cpu::process_cpu;
use blkstack_mapped::Registry;
use std::sync::Arc;
use std::time::Duration;

/// The figures one run yields.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub iops: f64,
    pub bw_bytes: f64,
    pub ios: u64,
    pub mean_lat_ns: f64,
    pub p99_ns: u64,
    /// Process CPU time (user + system) per completed I/O.
    pub cpu_ns_per_io: f64,
    /// The bench job threads' own CPU per I/O (submitting, waiting for and
    /// reaping completions): the load generator's share of the above.
    pub job_cpu_ns_per_io: f64,
    /// Process CPU time over wall time, in CPUs (1.0 = one CPU busy).
    pub cpus: f64,
    pub errors: u64,
    /// `dmsetup status` of the device under test at the end of the run
    /// (engine counters: tag waits, rescued wakeups, runs posted...).
    pub status: String,
}

impl Measured {
    /// CPU per I/O spent by everything but the bench's job threads: the
    /// mechanism under test (delay workers, completion threads, kblockd).
    pub fn mech_cpu_ns_per_io(&self) -> f64 {
        (self.cpu_ns_per_io - self.job_cpu_ns_per_io).max(0.0)
    }

    /// A `key=value` counter from the status text, summed over lines.
    pub fn counter(&self, key: &str) -> u64 {
        status_counter(&self.status, key)
    }
}

/// A `key=value` counter from a device's status text, summed over lines.
pub fn status_counter(status: &str, key: &str) -> u64 {
    status
        .split_whitespace()
        .filter_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .filter_map(|v| v.parse::<u64>().ok())
        .sum()
}

/// A job as the upstream reports describe them: `rw`, block size, depth, job count,
/// time-based for `runtime`, reported as one group.
pub fn job(rw: RwMode, bs: u64, iodepth: u32, numjobs: u32, runtime: Duration) -> JobSpec {
    JobSpec {
        name: "lab".into(),
        filename: Some("dev".into()),
        rw,
        bs: BlockSizes::single(bs),
        iodepth,
        numjobs,
        runtime: Some(runtime),
        time_based: true,
        group_reporting: true,
        norandommap: true,
        ..JobSpec::default()
    }
}

/// Create `stack` (a stack file: `NAME: table line` lines; the device
/// under test is called `dev`) in a fresh registry, run `job` on it,
/// tear the stack down.
pub fn run_stack(stack: &str, job: &JobSpec) -> Result<Measured> {
    run_stack_inspect(stack, job, |_| ())
}

/// [`run_stack`], letting `inspect` look at the devices after the run and
/// before the teardown (a target's counters, through `message`).
pub fn run_stack_inspect(
    stack: &str,
    job: &JobSpec,
    inspect: impl FnOnce(&Registry),
) -> Result<Measured> {
    crate::progress::tick_stack(stack);
    let reg: Arc<Registry> = Registry::new();
    reg.create_stack(stack)
        .with_context(|| format!("building stack:\n{stack}"))?;
    let before = process_cpu();
    let t0 = std::time::Instant::now();
    let report = run_jobs(&reg, std::slice::from_ref(job), &RunOptions::default())?;
    let wall = t0.elapsed();
    let cpu = process_cpu().since(before);
    let status = reg.status_text("dev").unwrap_or_default();
    inspect(&reg);
    reg.remove_all();
    let j = report.jobs.first().context("bench returned no job")?;
    let mut d = j.read.clone();
    d.merge(&j.write);
    let ios = d.total_ios.max(1);
    Ok(Measured {
        iops: j.read.iops() + j.write.iops(),
        bw_bytes: (j.read.bw_bytes() + j.write.bw_bytes()) as f64,
        ios: d.total_ios,
        mean_lat_ns: d.clat.mean(),
        p99_ns: d.clat.percentile(99.0),
        cpu_ns_per_io: cpu.total_ns() as f64 / ios as f64,
        job_cpu_ns_per_io: (j.usr_cpu_ns + j.sys_cpu_ns) as f64 / ios as f64,
        cpus: cpu.total_ns() as f64 / wall.as_nanos().max(1) as f64,
        errors: d.errors + j.error.unsigned_abs() as u64,
        status,
    })
}

/// Mean and sample standard deviation.
pub fn mean_sd(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (mean, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// Median (of a copy).
pub fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Round to `d` decimals for tables and JSON.
pub fn round(x: f64, d: i32) -> f64 {
    let p = 10f64.powi(d);
    (x * p).round() / p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats() {
        let (m, sd) = mean_sd(&[1.0, 2.0, 3.0]);
        assert_eq!(m, 2.0);
        assert!((sd - 1.0).abs() < 1e-9);
        assert_eq!(median(&[3.0, 1.0, 2.0, 10.0]), 2.5);
        assert_eq!(round(1.23456, 2), 1.23);
    }

    #[test]
    fn runs_a_job_on_a_stack() {
        let m = run_stack(
            "dev: 0 8192 zero\n",
            &job(RwMode::RandRead, 4096, 4, 1, Duration::from_millis(200)),
        )
        .unwrap();
        assert!(m.ios > 0 && m.iops > 0.0, "{m:?}");
        assert_eq!(m.errors, 0);
        assert!(m.cpu_ns_per_io > 0.0);
        assert!(
            m.job_cpu_ns_per_io > 0.0 && m.job_cpu_ns_per_io <= m.cpu_ns_per_io * 1.05,
            "{m:?}"
        );
        assert_eq!(m.status.trim(), "0 8192 zero");
    }

    #[test]
    fn counters_from_status() {
        let m = Measured {
            status: "0 8 null tags=0/2 rescued=3 runs_posted=10\n8 8 null rescued=1".into(),
            ..Default::default()
        };
        assert_eq!(m.counter("rescued"), 4);
        assert_eq!(m.counter("runs_posted"), 10);
        assert_eq!(m.counter("missing"), 0);
    }
}
