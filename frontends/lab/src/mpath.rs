//! `lab mpath`: upstream dm-mpath HST (nanosecond start times for the
//! historical-service-time selector in bio-based multipath) rerun with
//! jiffies and nanosecond start times, beside service-time and the ideal.
//!
//! As upstream: ten paths to one device with unequal cost, 4 KiB random
//! writes at queue depth 64, and per path its share of the I/O. Our
//! "utilisation" is the share of completed I/Os each path served, read
//! from the multipath's `path_stats` message after a warm-up (so the
//! selectors' learning phase is not counted).
//!
//! A path is a `delay` target over one `null` device with `load_k=1`:
//! every I/O is delayed `cost * (1 + I/Os already in flight on that
//! path)`. That is a server of fixed capacity `1/cost` I/Os per time unit
//! whatever the queue on it (Little's law: n in flight, each taking
//! `n * cost`), like upstream's disks, so the ideal split is each path's
//! capacity over the sum: `(1/cost_i) / sum(1/cost_j)`. Costs default to
//! 1,1,1,4,8,8,16,16,1,1 times `fast_ms`, the ratios that give upstream's
//! "Best" column (0.18 x5, 0.04, 0.02 x2, 0.01 x2).
//!
//! The jiffies run gives HST what bio-based dm gave it before upstream's
//! patch (the multipath feature `start_time jiffies:HZ`):
//! `jiffies_to_nsecs(jiffies)`, emulated with the kernel's jiffies origin
//! (`INITIAL_JIFFIES`, 300 s before the 32-bit wrap) and its 32-bit
//! microseconds, against an end time on the `ktime_get_ns()` base. On a
//! machine up more than five minutes that start time lies 300 s (plus
//! multiples of 71.6 min) in the past, so a path's first completion makes
//! its history "300 s" and the slow paths never work theirs down (see the
//! selector's documentation). The tick run (`start_time tick:HZ`) keeps
//! only the precision loss upstream's text names: the start truncated to
//! its 4 ms tick on the right base. The ns run uses the target's default,
//! `start_time ns`, the patch.
//!
//! Load: two jobs of QD64 (128 I/Os in flight) by default. HST sends an
//! I/O where `(1 + in flight) * history` is least, and a path of cost c
//! with n in flight finishes a new I/O after `(n + 1) * c`: a 16x path is
//! worth one I/O only once the fast paths hold 15 or more each. One QD64
//! job spread over ten paths keeps the fast ones near 11, so HST with ns
//! start times leaves the 16x and 8x paths idle between stale probes
//! (a small fraction of their ideal share in trial runs). Upstream's HST(ktime) column gives every slow disk
//! at least its ideal share, so its "high-iops" load kept them busy; two
//! QD64 jobs is the smallest load that does that here.
//!
//! A second table (rows with `table` = `hosts`, see [`crate::mpath_hosts`])
//! runs service-time and HST with both start times over four remote
//! paths: hosts in network namespaces serving one LUN over NBD, skipped
//! with a note where namespaces cannot be made.
//!
//! `--set` keys: `fast_ms` (0.25), `costs` (comma list, relative),
//! `hz` (250), `iodepth` (64), `numjobs` (2), `runtime_ms`, `warmup_ms`,
//! and for the remote-paths table `host_ms` (0.1,0.2,0.4,0.8).

use crate::common::{job, mean_sd, round};
use crate::experiment::check;
use crate::report::{present, Check, SeedTable};
use crate::LabOpts;
use anyhow::{bail, ensure, Context, Result};
use blkstack_bench::{run_jobs, RunOptions, RwMode};
use blkstack_core::clock::{now_ns, Jiffies};
use blkstack_mapped::targets::multipath::StartTime;
use blkstack_mapped::Registry;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;

/// Upstream's disks, in its table's order.
const DISKS: [&str; 10] = [
    "sdd", "sde", "sdf", "sdg", "sdh", "sdi", "sdj", "sdk", "sdl", "sdm",
];
/// Relative path costs that give upstream's "Best" column.
const COSTS: [f64; 10] = [1.0, 1.0, 1.0, 4.0, 8.0, 8.0, 16.0, 16.0, 1.0, 1.0];
/// Upstream's figures, per disk: ST, HST (orig), HST (ktime), Best.
const SEED: [[f64; 4]; 10] = [
    [0.17, 0.20, 0.17, 0.18],
    [0.17, 0.20, 0.17, 0.18],
    [0.17, 0.20, 0.17, 0.18],
    [0.06, 0.00, 0.06, 0.04],
    [0.03, 0.00, 0.03, 0.02],
    [0.03, 0.00, 0.03, 0.02],
    [0.02, 0.00, 0.01, 0.01],
    [0.02, 0.00, 0.01, 0.01],
    [0.17, 0.20, 0.17, 0.18],
    [0.17, 0.20, 0.17, 0.18],
];
/// Every device is 1 GiB.
const SECTORS: u64 = 2 * 1024 * 1024;

/// One selector configuration to measure.
pub(crate) struct Policy {
    pub column: &'static str,
    pub selector: &'static str,
    pub features: String,
}

/// The stack: a null device, one `delay` path per cost, the multipath.
fn stack(costs_ms: &[f64], p: &Policy) -> String {
    let mut s = format!("base: 0 {SECTORS} null\n");
    for (i, ms) in costs_ms.iter().enumerate() {
        s.push_str(&format!("p{i}: 0 {SECTORS} delay base 0 {ms} load_k=1\n"));
    }
    s.push_str(&multipath_line(SECTORS, costs_ms.len(), p));
    s
}

/// `dev`, a multipath of `sectors` over paths `p0..pN-1` in one group
/// with `p`'s selector and features.
pub(crate) fn multipath_line(sectors: u64, paths: usize, p: &Policy) -> String {
    let names: Vec<String> = (0..paths).map(|i| format!("p{i}")).collect();
    format!(
        "dev: 0 {sectors} multipath {} 0 1 1 {} 0 {paths} 0 {}\n",
        p.features,
        p.selector,
        names.join(" ")
    )
}

/// The selector configurations measured, in the table's column order:
/// service-time, HST with jiffies, tick-truncated and ns start times.
fn policies(hz: u32) -> Vec<Policy> {
    vec![
        Policy {
            column: "st",
            selector: "service-time",
            features: "0".into(),
        },
        Policy {
            column: "hst_jiffies",
            selector: "historical-service-time",
            features: format!("2 start_time jiffies:{hz}"),
        },
        Policy {
            column: "hst_tick",
            selector: "historical-service-time",
            features: format!("2 start_time tick:{hz}"),
        },
        Policy {
            column: "hst_ns",
            selector: "historical-service-time",
            features: "0".into(),
        },
    ]
}

/// Completed I/Os per path from a `path_stats` answer.
fn parse_path_stats(text: &str, paths: usize) -> Result<Vec<u64>> {
    let v: Vec<u64> = text
        .lines()
        .map(|l| {
            l.split_whitespace()
                .nth(1)
                .and_then(|w| w.parse().ok())
                .with_context(|| format!("path_stats line '{l}'"))
        })
        .collect::<Result<_>>()?;
    ensure!(
        v.len() == paths,
        "path_stats has {} lines, want {paths}",
        v.len()
    );
    Ok(v)
}

pub(crate) struct Outcome {
    pub shares: Vec<f64>,
    pub iops: f64,
    pub errors: u64,
}

/// Run the job on a fresh stack; shares count I/Os completed between the
/// end of the warm-up and the end of the run.
pub(crate) fn run_policy(
    stack_text: &str,
    paths: usize,
    qd: u32,
    jobs: u32,
    runtime: Duration,
    warmup: Duration,
) -> Result<Outcome> {
    crate::progress::tick_stack(stack_text);
    let reg: Arc<Registry> = Registry::new();
    reg.create_stack(stack_text)
        .with_context(|| format!("building stack:\n{stack_text}"))?;
    let snapshot = {
        let reg = reg.clone();
        std::thread::spawn(move || -> Result<String> {
            std::thread::sleep(warmup);
            Ok(reg.message("dev", 0, &["path_stats"])?)
        })
    };
    let spec = job(RwMode::RandWrite, 4096, qd, jobs, runtime);
    let report = run_jobs(&reg, std::slice::from_ref(&spec), &RunOptions::default());
    let at_warmup = snapshot
        .join()
        .map_err(|_| anyhow::anyhow!("path_stats snapshot thread panicked"))??;
    let at_end = reg.message("dev", 0, &["path_stats"])?;
    reg.remove_all();
    let report = report?;
    let j = report.jobs.first().context("bench returned no job")?;
    let before = parse_path_stats(&at_warmup, paths)?;
    let after = parse_path_stats(&at_end, paths)?;
    let counted: Vec<u64> = after
        .iter()
        .zip(&before)
        .map(|(a, b)| a.saturating_sub(*b))
        .collect();
    let total: u64 = counted.iter().sum();
    ensure!(total > 0, "no I/O completed after the warm-up");
    Ok(Outcome {
        shares: counted.iter().map(|&c| c as f64 / total as f64).collect(),
        iops: j.write.iops() + j.read.iops(),
        errors: j.write.errors + j.read.errors + j.error.unsigned_abs() as u64,
    })
}

/// The load every selector runs under, in both tables.
pub(crate) struct Load {
    pub qd: u32,
    pub jobs: u32,
    pub runtime: Duration,
    pub warmup: Duration,
    pub repeats: usize,
}

/// The in-process table's settings.
pub(crate) struct Config {
    pub fast_ms: f64,
    pub costs: Vec<f64>,
    pub hz: u32,
    pub load: Load,
}

/// Read and check the in-process table's settings.
pub(crate) fn configure(opts: &LabOpts) -> Result<Config> {
    let fast_ms: f64 = opts.param("fast_ms", 0.25)?;
    let costs: Vec<f64> = opts.param_list("costs", &COSTS)?;
    let hz: u32 = opts.param("hz", 250)?;
    let qd: u32 = opts.param("iodepth", 64)?;
    let jobs: u32 = opts.param("numjobs", 2)?;
    let runtime =
        Duration::from_millis(opts.param("runtime_ms", if opts.quick { 4000 } else { 12000 })?);
    let warmup = Duration::from_millis(opts.param("warmup_ms", runtime.as_millis() as u64 / 4)?);
    let repeats = opts.repeats.unwrap_or(if opts.quick { 1 } else { 2 });
    if costs.is_empty() || costs.len() > 1000 || costs.iter().any(|c| !c.is_finite() || *c <= 0.0) {
        bail!("--set costs: give 1..1000 positive relative costs");
    }
    if !fast_ms.is_finite() || fast_ms <= 0.0 {
        bail!("--set fast_ms: must be positive");
    }
    if !(1..=64).contains(&jobs) {
        bail!("--set numjobs: must be in 1..=64");
    }
    if warmup >= runtime {
        bail!("--set warmup_ms must be shorter than runtime_ms");
    }
    Ok(Config {
        fast_ms,
        costs,
        hz,
        load: Load {
            qd,
            jobs,
            runtime,
            warmup,
            repeats,
        },
    })
}

impl Config {
    /// Each path's ideal share: its capacity over the sum.
    fn ideal(&self) -> Vec<f64> {
        let capacity: f64 = self.costs.iter().map(|c| 1.0 / c).sum();
        self.costs.iter().map(|c| (1.0 / c) / capacity).collect()
    }
}

/// Every run of every selector: shares per path and IOPS.
pub(crate) struct Runs {
    /// The selectors' columns, in run order.
    pub columns: Vec<&'static str>,
    /// shares[policy][repeat][path]
    pub shares: Vec<Vec<Vec<f64>>>,
    /// iops[policy][repeat]
    pub iops: Vec<Vec<f64>>,
}

impl Runs {
    pub fn new(policies: &[Policy]) -> Runs {
        Runs {
            columns: policies.iter().map(|p| p.column).collect(),
            shares: vec![Vec::new(); policies.len()],
            iops: vec![Vec::new(); policies.len()],
        }
    }

    /// Policy `pi`'s mean share of `path` over the runs.
    pub fn mean_share(&self, pi: usize, path: usize) -> f64 {
        mean_sd(&self.shares[pi].iter().map(|r| r[path]).collect::<Vec<_>>()).0
    }

    /// The mean share of the selector with `column`, rounded for the table.
    pub fn cell(&self, column: &str, path: usize) -> Option<f64> {
        let pi = self.columns.iter().position(|c| *c == column)?;
        Some(round(self.mean_share(pi, path), 3))
    }

    /// Per selector: "COLUMN: mean IOPS (sd)".
    pub fn iops(&self, pi: usize) -> (f64, f64) {
        mean_sd(&self.iops[pi])
    }
}

/// A row of either table: a path's share under each selector (the
/// remote table has no tick-truncated column and no upstream figures;
/// the in-process one no remote latency).
#[derive(Serialize, Deserialize)]
pub struct Row {
    pub table: String,
    pub path: String,
    pub cost: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<f64>,
    pub ideal: f64,
    pub st: f64,
    pub hst_jiffies: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hst_tick: Option<f64>,
    pub hst_ns: f64,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub seed_st: Option<Option<f64>>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub seed_hst_orig: Option<Option<f64>>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub seed_hst_ktime: Option<Option<f64>>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub seed_best: Option<Option<f64>>,
}

/// The in-process table's columns (the remote one adds `latency_ms`).
pub(crate) const COLUMNS: [&str; 13] = [
    "table",
    "path",
    "cost",
    "latency_ms",
    "ideal",
    "st",
    "hst_jiffies",
    "hst_tick",
    "hst_ns",
    "seed_st",
    "seed_hst_orig",
    "seed_hst_ktime",
    "seed_best",
];

/// Every selector `repeats` times over the in-process paths.
pub(crate) fn measure(cfg: &Config) -> Result<Runs> {
    let costs_ms: Vec<f64> = cfg.costs.iter().map(|c| c * cfg.fast_ms).collect();
    let n = cfg.costs.len();
    let policies = policies(cfg.hz);
    let mut runs = Runs::new(&policies);
    let l = &cfg.load;
    crate::progress::expect_runs((l.repeats * policies.len()) as u64);
    for _ in 0..l.repeats {
        for (pi, p) in policies.iter().enumerate() {
            let o = run_policy(&stack(&costs_ms, p), n, l.qd, l.jobs, l.runtime, l.warmup)?;
            ensure!(o.errors == 0, "{}: {} I/O errors", p.column, o.errors);
            runs.shares[pi].push(o.shares);
            runs.iops[pi].push(o.iops);
        }
    }
    Ok(runs)
}

/// The in-process table: one row per path.
pub(crate) fn rows(cfg: &Config, runs: &Runs) -> Vec<Row> {
    let n = cfg.costs.len();
    let ideal = cfg.ideal();
    let cell = |c: &str, path: usize| runs.cell(c, path).unwrap_or(0.0);
    (0..n)
        .map(|path| {
            let seed = SEED.get(path).filter(|_| n == DISKS.len());
            let name = match DISKS.get(path) {
                Some(d) if n == DISKS.len() => format!("p{path}/{d}"),
                _ => format!("p{path}"),
            };
            Row {
                table: "in-process".into(),
                path: name,
                cost: cfg.costs[path],
                latency_ms: None,
                ideal: round(ideal[path], 3),
                st: cell("st", path),
                hst_jiffies: cell("hst_jiffies", path),
                hst_tick: runs.cell("hst_tick", path),
                hst_ns: cell("hst_ns", path),
                seed_st: Some(seed.map(|s| s[0])),
                seed_hst_orig: Some(seed.map(|s| s[1])),
                seed_hst_ktime: Some(seed.map(|s| s[2])),
                seed_best: Some(seed.map(|s| s[3])),
            }
        })
        .collect()
}

/// Index of the ns-start-time HST in [`policies`].
const NS: usize = 3;

/// The path with the largest gap between policy `pi`'s share and the
/// ideal, and the gap.
fn worst(cfg: &Config, runs: &Runs, pi: usize) -> (usize, f64) {
    let ideal = cfg.ideal();
    (0..cfg.costs.len())
        .map(|p| (p, (runs.mean_share(pi, p) - ideal[p]).abs()))
        .fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a })
}

/// The slow paths' total share under (jiffies, tick, ns), and ideally.
fn slow_shares(cfg: &Config, runs: &Runs) -> (Vec<usize>, [f64; 3], f64) {
    let costs = &cfg.costs;
    let ideal = cfg.ideal();
    let slow: Vec<usize> = (0..costs.len())
        .filter(|&p| costs[p] > costs.iter().cloned().fold(f64::INFINITY, f64::min))
        .collect();
    let slow_sum = |pi: usize| slow.iter().map(|&p| runs.mean_share(pi, p)).sum::<f64>();
    let ideal_slow: f64 = slow.iter().map(|&p| ideal[p]).sum();
    let sums = [slow_sum(1), slow_sum(2), slow_sum(NS)];
    (slow, sums, ideal_slow)
}

/// The in-process claims: HST with ns start times near the ideal on
/// every path; with jiffies start times the slow paths starve.
pub(crate) fn checks(cfg: &Config, runs: &Runs) -> Vec<Check> {
    let ideal = cfg.ideal();
    let (wp, wd) = worst(cfg, runs, NS);
    let (slow, [jiffies_slow, _, ns_slow], ideal_slow) = slow_shares(cfg, runs);
    // Upstream's slow disks are the same ones when the costs are the default.
    let seed_slow = if cfg.costs == COSTS {
        let col = |c: usize| slow.iter().map(|&p| SEED[p][c]).sum::<f64>();
        format!(
            " (upstream: orig {:.2}, ktime {:.2}, best {:.2})",
            col(1),
            col(2),
            col(3)
        )
    } else {
        String::new()
    };
    vec![
        check(
            "HST with ns start times: within 0.02 of the ideal share on every path",
            wd <= 0.02,
            format!(
                "largest gap {wd:.3} on p{wp} (ns {:.3} vs ideal {:.3})",
                runs.mean_share(NS, wp),
                ideal[wp]
            ),
        ),
        check(
            "HST with jiffies start times starves the slow paths (under a tenth of their ideal share, upstream: 0.00)",
            !slow.is_empty() && jiffies_slow < 0.1 * ideal_slow && jiffies_slow < ns_slow,
            format!(
                "slow paths' total share: jiffies {jiffies_slow:.3}, ns {ns_slow:.3}, ideal {ideal_slow:.3}{seed_slow}"
            ),
        ),
    ]
}

/// The in-process notes: precision loss alone, service-time's gap, IOPS
/// per selector, the load, the paths, the jiffies origin.
pub(crate) fn notes(cfg: &Config, runs: &Runs) -> Vec<String> {
    let (_, [jiffies_slow, tick_slow, ns_slow], _) = slow_shares(cfg, runs);
    let (st_wp, st_wd) = worst(cfg, runs, 0);
    let mut notes = vec![
        format!(
            "precision loss alone (start truncated to its tick on the clock's base): slow paths' total share {tick_slow:.3}, vs {ns_slow:.3} with ns and {jiffies_slow:.3} with the kernel's jiffies start time"
        ),
        format!("service-time: largest gap to ideal {st_wd:.3} on p{st_wp}"),
    ];
    for (pi, column) in runs.columns.iter().enumerate() {
        let (m, sd) = runs.iops(pi);
        notes.push(format!("{column}: {m:.0} IOPS (sd {sd:.0})"));
    }
    let l = &cfg.load;
    notes.push(format!(
        "utilisation = share of completed I/Os per path (multipath path_stats), counted after a {} ms warm-up of a {} ms run, {} run(s) per selector; load {} job(s) x QD{} randwrite 4k",
        l.warmup.as_millis(),
        l.runtime.as_millis(),
        l.repeats,
        l.jobs,
        l.qd
    ));
    notes.push(format!(
        "paths: delay targets over one null device, delay = cost x {} ms x (1 + I/Os in flight on the path) (load_k=1), so path capacity is 1/cost; jiffies and tick runs at HZ={}",
        cfg.fast_ms, cfg.hz
    ));
    notes.push(start_time_note(cfg.hz));
    notes
}

/// The remote paths' selectors: service-time and HST with both start
/// times (no tick-truncated run).
pub(crate) fn remote_policies(hz: u32) -> Vec<Policy> {
    policies(hz)
        .into_iter()
        .filter(|p| p.column != "hst_tick")
        .collect()
}

/// Upstream's table.
pub(crate) fn seed_table() -> SeedTable {
    SeedTable {
        caption: "upstream: utilisation of a 10-disk multipath with asymmetric costs, fio randwrite QD64, bio-based mpath".into(),
        columns: ["disk", "ST", "HST (orig)", "HST(ktime)", "Best"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        rows: DISKS
            .iter()
            .zip(SEED.iter())
            .map(|(d, s)| {
                let mut row = vec![d.to_string()];
                row.extend(s.iter().map(|x| format!("{x:.2}")));
                row
            })
            .collect(),
    }
}

/// Where the kernel's jiffies start time lies on this machine now: the
/// result depends on it (up less than 5 minutes, it lies in the future and
/// every HST sample is 0).
fn start_time_note(hz: u32) -> String {
    let now = now_ns();
    let start = StartTime::Jiffies(Jiffies::new(hz)).at(now);
    let uptime_s = now as f64 / 1e9;
    if start <= now {
        format!(
            "jiffies start time now: {:.1} s before the clock (machine up {uptime_s:.0} s; INITIAL_JIFFIES puts it 300 s back, the 32-bit microseconds wrap every 4295 s)",
            (now - start) as f64 / 1e9
        )
    } else {
        format!(
            "jiffies start time now: {:.1} s AFTER the clock (machine up only {uptime_s:.0} s, under 300 s): every HST sample is 0 in this state, as in a kernel booted less than 5 minutes ago",
            (start - now) as f64 / 1e9
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stack_builds_and_stats_parse() {
        let p = Policy {
            column: "hst_jiffies",
            selector: "historical-service-time",
            features: "2 start_time jiffies:250".into(),
        };
        let text = stack(&[0.25, 1.0], &p);
        let reg = Registry::new();
        reg.create_stack(&text).unwrap();
        let t = reg.table_text("dev").unwrap();
        assert!(
            t.contains("multipath 2 start_time jiffies:250 0 1 1 historical-service-time"),
            "{t}"
        );
        let stats = reg.message("dev", 0, &["path_stats"]).unwrap();
        assert_eq!(parse_path_stats(&stats, 2).unwrap(), vec![0, 0]);
        assert!(parse_path_stats(&stats, 3).is_err());
    }

    #[test]
    fn seed_costs_give_the_seed_best_column() {
        let cap: f64 = COSTS.iter().map(|c| 1.0 / c).sum();
        for (c, s) in COSTS.iter().zip(SEED.iter()) {
            assert!(((1.0 / c) / cap - s[3]).abs() < 0.005, "cost {c}");
        }
    }
}
