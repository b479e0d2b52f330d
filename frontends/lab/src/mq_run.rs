//! `lab mq-run`: upstream "blk-mq: avoid repeatedly scheduling the same
//! work to run hardware queue" rerun with the queued-bit dedup off and on.
//!
//! As upstream: 8 jobs of 4 KiB random reads on a RAM-backed device whose
//! driver, like SCSI's `scsi_end_request`, asks for an asynchronous run of
//! its hardware queues on every completion, at queue depths 16..1024.
//! Without the dedup every completion posts the run work to kblockd, and
//! the post is the kernel's `kblockd_mod_delayed_work_on`: grab the
//! pending work, delete its timer entry and requeue it under the pool's
//! lock (see `mq::kblockd`); with the dedup a run already pending absorbs
//! the request and nothing is posted.
//!
//! Besides IOPS, every run reads the kblockd pool's counters, so the table
//! shows the mechanism itself: posts per I/O, grabs of pending work per
//! I/O and ns per post, for both modes. Those figures carry to a bigger
//! machine even where this one shows no collapse in IOPS; a sweep over
//! the number of posting threads (jobs) at the deepest queue shows how
//! the posting cost grows with contention on the pool's lock.
//!
//! Two devices can be run. `can_queue32` (`null irqmode=1
//! max_inflight=32`) is the checked one: upstream's disk was RAM-backed
//! but behind SCSI (storvsc), whose `can_queue` limit makes requests wait
//! for a queue run; this driver is busy above 32 in flight and completes
//! on another thread. `memory` (`--set devices=memory,can_queue32`, not
//! run in quick mode) completes every request inside `queue_rq`, so the
//! posted runs find no work and the dedup can only save the posting cost.
//!
//! The null driver leaves read buffers untouched (`zero_reads=0`), as
//! upstream's host moved the data into the guest's buffers without the
//! measured CPUs touching them; `--set null_zero_reads=1` fills them
//! (docs/BENCHMARKS.md shows that cost separately).
//!
//! Every point and mode runs once per round, rounds are repeated and
//! every other one runs in reverse, and the checks compare medians: the
//! claims are ratios, so drift on a shared machine must hit both sides
//! alike.

use crate::common::{job, mean_sd, median, round, run_stack};
use crate::experiment::{check, Experiment};
use crate::figures::in_job_sweep;
use crate::plot::{Figure, Panel, Series, Style};
use crate::report::{Check, SeedTable};
use crate::LabOpts;
use anyhow::Result;
use blkstack_bench::RwMode;
use blkstack_mq::Kblockd;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

const DEPTHS: [u32; 4] = [16, 64, 256, 1024];
/// Posting threads swept at the deepest queue depth.
const JOB_SWEEP: [u32; 4] = [1, 2, 4, 8];
const JOB_SWEEP_QUICK: [u32; 2] = [1, 4];
/// The device the checks apply to (see the module documentation).
const CHECKED: &str = "can_queue32";
/// Upstream's IOPS in thousands, (pre-patch, after-patch).
const SEED: [(u32, u32); 4] = [(190, 190), (235, 240), (180, 256), (156, 250)];

/// (label, table without the dedup setting). The `null` line gets its
/// `zero_reads=` from the `null_zero_reads` setting (default 0, see above).
const DEVICES: [(&str, &str); 2] = [
    ("memory", "memory run_on_completion=1"),
    (
        CHECKED,
        "null irqmode=1 max_inflight=32 run_on_completion=1",
    ),
];

/// One run's figures: throughput and the kblockd pool's per-operation
/// counters over the run.
#[derive(Clone, Copy, Debug, Default)]
struct Sample {
    kiops: f64,
    posts_per_io: f64,
    grabs_per_io: f64,
    ns_per_post: f64,
}

/// The settings every run shares.
struct Setup {
    repeats: usize,
    info_repeats: usize,
    null_zero_reads: u8,
    kblockd: String,
    runtime: Duration,
    trace: bool,
}

/// A point of the table: which sweep, device, depth and job count.
#[derive(Clone, Copy, Debug)]
struct Point {
    sweep: &'static str,
    label: &'static str,
    device: &'static str,
    qd: u32,
    jobs: u32,
}

impl Point {
    /// A point of the checked device's depth sweep (run every round).
    fn is_checked(&self) -> bool {
        self.label == CHECKED && self.sweep == "depth"
    }
}

fn stack(device: &str, dedup: &str, null_zero_reads: u8, kblockd: &str) -> String {
    let zero_reads = if device.starts_with("null ") {
        format!(" zero_reads={null_zero_reads}")
    } else {
        String::new()
    };
    format!("dev: 0 2097152 {device} run_dedup={dedup} kblockd={kblockd}{zero_reads}\n")
}

/// Every point and mode once per round, and every other round in
/// reverse, so drift on a shared machine hits every point alike; the
/// unchecked points only in the first `info_repeats` rounds.
/// Returns samples[point][0 = off, 1 = on].
fn measure_all(points: &[Point], s: &Setup) -> Result<Vec<[Vec<Sample>; 2]>> {
    let runs: usize = (0..s.repeats)
        .map(|r| {
            points
                .iter()
                .filter(|p| p.is_checked() || r < s.info_repeats)
                .count()
                * 2
        })
        .sum();
    crate::progress::expect_runs(runs as u64);
    // samples[point][0 = off, 1 = on].
    let mut samples = vec![[Vec::new(), Vec::new()]; points.len()];
    // Every point and mode once per round, and every other round in
    // reverse: drift on a shared machine must hit every point alike.
    for round_nr in 0..s.repeats {
        let mut order: Vec<(usize, usize)> = (0..points.len())
            .filter(|&p| points[p].is_checked() || round_nr < s.info_repeats)
            .flat_map(|p| [(p, 0), (p, 1)])
            .collect();
        if round_nr % 2 == 1 {
            order.reverse();
        }
        for (p, i) in order {
            let dedup = ["off", "on"][i];
            let m = measure(&points[p], dedup, s)?;
            if s.trace {
                let pt = &points[p];
                eprintln!(
                    "{} QD{} {} jobs dedup={dedup}: {:.1}k IOPS, {:.3} posts/IO, {:.3} grabs/IO, {:.0} ns/post",
                    pt.label, pt.qd, pt.jobs, m.kiops, m.posts_per_io, m.grabs_per_io, m.ns_per_post
                );
            }
            samples[p][i].push(m);
        }
    }
    Ok(samples)
}

fn pool(kind: &str) -> Arc<Kblockd> {
    if kind == "unbound" {
        Kblockd::global_unbound()
    } else {
        Kblockd::global()
    }
}

fn measure(p: &Point, dedup: &str, s: &Setup) -> Result<Sample> {
    let pool = pool(&s.kblockd);
    let before = pool.stats();
    let m = run_stack(
        &stack(p.device, dedup, s.null_zero_reads, &s.kblockd),
        &job(RwMode::RandRead, 4096, p.qd, p.jobs, s.runtime),
    )?;
    let after = pool.stats();
    anyhow::ensure!(
        m.errors == 0,
        "{} QD{} {} jobs dedup={dedup}: {} I/O errors",
        p.label,
        p.qd,
        p.jobs,
        m.errors
    );
    let ios = m.ios.max(1) as f64;
    let posts = after.posts.saturating_sub(before.posts);
    Ok(Sample {
        kiops: m.iops / 1000.0,
        posts_per_io: posts as f64 / ios,
        grabs_per_io: after.grabs.saturating_sub(before.grabs) as f64 / ios,
        ns_per_post: after.post_ns.saturating_sub(before.post_ns) as f64 / posts.max(1) as f64,
    })
}

/// Medians of each figure over the runs.
fn medians(samples: &[Sample]) -> Sample {
    let m = |f: fn(&Sample) -> f64| median(&samples.iter().map(f).collect::<Vec<_>>());
    Sample {
        kiops: m(|s| s.kiops),
        posts_per_io: m(|s| s.posts_per_io),
        grabs_per_io: m(|s| s.grabs_per_io),
        ns_per_post: m(|s| s.ns_per_post),
    }
}

/// The settings of a run: the points and what every run shares.
pub struct Config {
    jobs: u32,
    deepest: u32,
    points: Vec<Point>,
    setup: Setup,
}

/// Per point of [`Config::points`], per mode (0 = off, 1 = on), every run.
pub struct Measurement {
    samples: Vec<[Vec<Sample>; 2]>,
}

/// A row of the table: medians per mode at one point.
#[derive(Serialize, Deserialize)]
pub struct Row {
    sweep: String,
    device: String,
    jobs: u32,
    iodepth: u32,
    off_kiops: f64,
    off_sd: f64,
    on_kiops: f64,
    on_sd: f64,
    improvement_pct: f64,
    off_posts_per_io: f64,
    on_posts_per_io: f64,
    off_grabs_per_io: f64,
    off_ns_per_post: f64,
    on_ns_per_post: f64,
    seed_pre_kiops: Option<u32>,
    seed_after_kiops: Option<u32>,
}

/// `lab mq-run`.
pub struct MqRun;

impl Experiment for MqRun {
    const NAME: &'static str = "mq-run";
    const SEED: &'static str = "001";
    const ABOUT: &'static str = "queue-run dedup off vs on at QD 16..1024";
    const TITLE: &'static str = "queue runs posted on every completion: dedup off (old, kernel's mod_delayed_work_on per post) vs on";
    type Config = Config;
    type Measurement = Measurement;
    type Row = Row;

    fn configure(opts: &LabOpts) -> Result<Config> {
        let jobs = opts.jobs.unwrap_or(8) as u32;
        let runtime =
            Duration::from_millis(opts.param("runtime_ms", if opts.quick { 750 } else { 4000 })?);
        let depths: Vec<u32> = opts.param_list("depths", &DEPTHS)?;
        let default_devices: &[&str] = if opts.quick {
            &[CHECKED]
        } else {
            &["memory", CHECKED]
        };
        let devices: Vec<String> = opts.param_list(
            "devices",
            &default_devices
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>(),
        )?;
        let sweep_default: &[u32] = if opts.quick {
            &JOB_SWEEP_QUICK
        } else {
            &JOB_SWEEP
        };
        let job_sweep: Vec<u32> = opts.param_list("job_sweep", sweep_default)?;
        anyhow::ensure!(
            job_sweep.iter().all(|&j| j >= 1),
            "--set job_sweep: every job count must be at least 1"
        );
        let setup = configure_setup(opts, runtime)?;
        let deepest = depths.iter().copied().max().unwrap_or(1024);
        let mut points: Vec<Point> = DEVICES
            .iter()
            .filter(|(label, _)| devices.iter().any(|d| d == label))
            .flat_map(|&(label, device)| {
                depths.iter().map(move |&qd| Point {
                    sweep: "depth",
                    label,
                    device,
                    qd,
                    jobs,
                })
            })
            .collect();
        points.extend(job_sweep.iter().filter(|&&j| j != jobs).map(|&j| Point {
            sweep: "jobs",
            label: CHECKED,
            device: DEVICES[1].1,
            qd: deepest,
            jobs: j,
        }));
        Ok(Config {
            jobs,
            deepest,
            points,
            setup,
        })
    }

    fn measure(cfg: &Config) -> Result<Measurement> {
        Ok(Measurement {
            samples: measure_all(&cfg.points, &cfg.setup)?,
        })
    }

    fn columns(_: &Config) -> Vec<String> {
        [
            "sweep",
            "device",
            "jobs",
            "iodepth",
            "off_kiops",
            "off_sd",
            "on_kiops",
            "on_sd",
            "improvement_pct",
            "off_posts_per_io",
            "on_posts_per_io",
            "off_grabs_per_io",
            "off_ns_per_post",
            "on_ns_per_post",
            "seed_pre_kiops",
            "seed_after_kiops",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    fn rows(cfg: &Config, m: &Measurement) -> Vec<Row> {
        let mut rows: Vec<Row> = cfg
            .points
            .iter()
            .zip(&m.samples)
            .map(|(pt, s)| row(pt, s))
            .collect();
        // The 8-job point of the job sweep is the depth sweep's deepest one.
        if let Some(p) = cfg
            .points
            .iter()
            .position(|p| p.is_checked() && p.qd == cfg.deepest)
        {
            let mut pt = cfg.points[p];
            pt.sweep = "jobs";
            rows.push(row(&pt, &m.samples[p]));
        }
        rows
    }

    fn checks(cfg: &Config, _: &Measurement, rows: &[Row]) -> Vec<Check> {
        let deepest = cfg.deepest;
        let Some(deep) = find_row(rows, "depth", deepest) else {
            return Vec::new();
        };
        let (off, on) = (deep.off_kiops, deep.on_kiops);
        let (pp_off, pp_on) = (deep.off_posts_per_io, deep.on_posts_per_io);
        vec![
            check(
                format!(
                    "{CHECKED} QD{deepest}: dedup on >= 110% of dedup off's IOPS (upstream QD1024: +60%)"
                ),
                on >= 1.10 * off,
                format!(
                    "on {on:.1}k vs off {off:.1}k ({:+.1}%)",
                    (on / off.max(1e-9) - 1.0) * 100.0
                ),
            ),
            check(
                format!("{CHECKED} QD{deepest}: dedup on posts at most half as many runs per I/O"),
                pp_off > 0.0 && pp_on <= 0.5 * pp_off,
                format!(
                    "{pp_on:.3} vs {pp_off:.3} posts per I/O; off: {:.3} grabs of pending work per I/O, {:.0} ns per post (on: {:.0} ns)",
                    deep.off_grabs_per_io, deep.off_ns_per_post, deep.on_ns_per_post
                ),
            ),
        ]
    }

    fn notes(cfg: &Config, _: &Measurement, rows: &[Row]) -> Vec<String> {
        let mut notes = collapse_notes(rows, cfg.deepest);
        let s = &cfg.setup;
        notes.push(
            "ns per post: with dedup off most posts find the run pending and pay the grab and \
             requeue under two pool locks; with dedup on a post happens only when no run is \
             pending, so nearly every one also wakes the sleeping worker: fewer, dearer posts"
                .to_string(),
        );
        notes.push(format!(
            "{} jobs in the depth sweep; KIOPS are the median (sd) of {} runs ({CHECKED} depth sweep) and {} runs (job sweep, memory) of {} ms per point, all points interleaved; per-post figures are medians of the kblockd pool's counters per run ({} pool)",
            cfg.jobs,
            s.repeats,
            s.info_repeats,
            s.runtime.as_millis(),
            s.kblockd
        ));
        notes
    }

    fn seed_table() -> Option<SeedTable> {
        Some(seed_table())
    }

    fn figures() -> Vec<Figure> {
        vec![figure()]
    }
}

/// The settings every run shares, from the options.
fn configure_setup(opts: &LabOpts, runtime: Duration) -> Result<Setup> {
    // The checked device's runs spread widely at any depth (see
    // docs/BENCHMARKS.md), so its medians need five runs even in quick
    // mode; the job sweep and `memory` carry no check and keep three.
    let repeats = opts.repeats.unwrap_or(5);
    let info_repeats = if opts.quick && opts.repeats.is_none() {
        3
    } else {
        repeats
    };
    // `--set trace=1`: each run's figures on stderr.
    let trace: u8 = opts.param("trace", 0)?;
    let null_zero_reads: u8 = opts.param("null_zero_reads", 0)?;
    // `--set kblockd=unbound`: queue runs to a shared pool instead of the
    // poster's CPU's worker (an unknown name is refused by the driver).
    let kblockd: String = opts.param("kblockd", "percpu".to_string())?;
    anyhow::ensure!(
        null_zero_reads <= 1,
        "--set null_zero_reads={null_zero_reads}: must be 0 or 1"
    );
    Ok(Setup {
        repeats,
        info_repeats,
        null_zero_reads,
        kblockd,
        runtime,
        trace: trace != 0,
    })
}

/// A point's row: medians of its runs, upstream's figures at its depth.
fn row(p: &Point, samples: &[Vec<Sample>; 2]) -> Row {
    let (off, on) = (medians(&samples[0]), medians(&samples[1]));
    let sd = |v: &[Sample]| mean_sd(&v.iter().map(|s| s.kiops).collect::<Vec<_>>()).1;
    let seed = DEPTHS
        .iter()
        .position(|&d| d == p.qd && p.sweep == "depth" && p.label == CHECKED)
        .map(|i| SEED[i]);
    Row {
        sweep: p.sweep.to_string(),
        device: p.label.to_string(),
        jobs: p.jobs,
        iodepth: p.qd,
        off_kiops: round(off.kiops, 1),
        off_sd: round(sd(&samples[0]), 1),
        on_kiops: round(on.kiops, 1),
        on_sd: round(sd(&samples[1]), 1),
        improvement_pct: round((on.kiops / off.kiops.max(1e-9) - 1.0) * 100.0, 1),
        off_posts_per_io: round(off.posts_per_io, 3),
        on_posts_per_io: round(on.posts_per_io, 3),
        off_grabs_per_io: round(off.grabs_per_io, 3),
        off_ns_per_post: round(off.ns_per_post, 0),
        on_ns_per_post: round(on.ns_per_post, 0),
        seed_pre_kiops: seed.map(|s| s.0),
        seed_after_kiops: seed.map(|s| s.1),
    }
}

/// The checked device's row of `sweep` at depth `qd`.
fn find_row<'a>(rows: &'a [Row], sweep: &str, qd: u32) -> Option<&'a Row> {
    rows.iter()
        .find(|x| x.sweep == sweep && x.device == CHECKED && x.iodepth == qd)
}

/// Whether the collapse itself appeared (dedup off, deepest against
/// QD64), with the per-post figures either way; the job sweep's costs.
fn collapse_notes(rows: &[Row], deepest: u32) -> Vec<String> {
    let mut notes = Vec::new();
    let Some(deep) = find_row(rows, "depth", deepest) else {
        return notes;
    };
    if let Some(q64) = find_row(rows, "depth", 64) {
        let change = (deep.off_kiops / q64.off_kiops.max(1e-9) - 1.0) * 100.0;
        let verdict = if change <= -10.0 {
            "the collapse appears"
        } else {
            "the collapse does NOT appear on this machine"
        };
        notes.push(format!(
            "{CHECKED}, dedup off: QD{deepest} is {change:+.1}% against QD64 (upstream: -34%): {verdict}; \
             per post with dedup off {:.0} ns and {:.3} posts per I/O, with dedup on {:.0} ns and {:.3}",
            deep.off_ns_per_post, deep.off_posts_per_io, deep.on_ns_per_post, deep.on_posts_per_io
        ));
    }
    let sweep: Vec<String> = rows
        .iter()
        .filter(|x| x.sweep == "jobs")
        .map(|x| {
            format!(
                "{} jobs: off {:.0} ns/post {:.1}k, on {:.1}k",
                x.jobs, x.off_ns_per_post, x.off_kiops, x.on_kiops
            )
        })
        .collect();
    if !sweep.is_empty() {
        notes.push(format!(
            "job sweep at QD{deepest} (cost of a post as posting threads grow): {}",
            sweep.join("; ")
        ));
    }
    notes
}

fn seed_table() -> SeedTable {
    SeedTable {
        caption: "upstream: RAM-backed virtual disk on Hyper-V, 8 fio jobs, 4k randread, IOPS"
            .into(),
        columns: vec![
            "queue_depth".into(),
            "pre-patch".into(),
            "after-patch".into(),
            "improvement".into(),
        ],
        rows: DEPTHS
            .iter()
            .zip(SEED.iter())
            .map(|(qd, &(pre, after))| {
                vec![
                    qd.to_string(),
                    format!("{pre}k"),
                    format!("{after}k"),
                    format!("{:.0}%", (after as f64 / pre as f64 - 1.0) * 100.0),
                ]
            })
            .collect(),
    }
}

/// IOPS against queue depth with dedup off and on, the upstream curves
/// beside them; kblockd posts per I/O and ns per post; IOPS against
/// posting threads.
fn figure() -> Figure {
    let depth = || vec![("device".to_string(), json!("can_queue32"))];
    let mut iops = Panel::new(
        "IOPS vs queue depth",
        "iodepth",
        "queue depth per job",
        "KIOPS",
    );
    iops.filter = depth();
    iops.skip = Some(in_job_sweep);
    iops.series = vec![
        Series::column("dedup off (old)", Style::Ours, 3, "off_kiops"),
        Series::column("dedup on", Style::Ours, 0, "on_kiops"),
        Series::column("upstream pre-patch", Style::Upstream, 3, "seed_pre_kiops"),
        Series::column("upstream after", Style::Upstream, 0, "seed_after_kiops"),
    ];
    let mut posts = Panel::new(
        "kblockd posts per I/O",
        "iodepth",
        "queue depth per job",
        "posts per I/O",
    );
    posts.filter = depth();
    posts.skip = Some(in_job_sweep);
    posts.series = vec![
        Series::column("dedup off", Style::Ours, 3, "off_posts_per_io"),
        Series::column("dedup on", Style::Ours, 0, "on_posts_per_io"),
        Series::column("off: grabs per I/O", Style::Ours, 4, "off_grabs_per_io"),
    ];
    let mut cost = Panel::new(
        "time per post (mod_delayed_work_on)",
        "iodepth",
        "queue depth per job",
        "ns per post (log)",
    );
    cost.filter = depth();
    cost.skip = Some(in_job_sweep);
    cost.log_y = true;
    cost.series = vec![
        Series::column("dedup off", Style::Ours, 3, "off_ns_per_post"),
        Series::column("dedup on", Style::Ours, 0, "on_ns_per_post"),
    ];
    let mut jobs = Panel::new(
        "IOPS vs posting threads (jobs)",
        "jobs",
        "jobs (each posting on its completions)",
        "KIOPS",
    );
    jobs.filter = vec![("sweep".into(), json!("jobs"))];
    jobs.series = vec![
        Series::column("dedup off (old)", Style::Ours, 3, "off_kiops"),
        Series::column("dedup on", Style::Ours, 0, "on_kiops"),
    ];
    Figure {
        suffix: String::new(),
        title: "blk-mq run-work dedup: throughput and the per-post cost it removes".into(),
        columns: 2,
        panels: vec![iops, posts, cost, jobs],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_rows_write_the_saved_report_unchanged() {
        let (saved, again) = crate::report::round_trip::<Row>(include_str!(
            "../../cli/tests/data/lab-report/mq-run.json"
        ));
        assert_eq!(saved, again);
    }

    #[test]
    fn bad_settings_are_refused_before_any_run() {
        for (k, v) in [
            ("job_sweep", "0"),
            ("null_zero_reads", "2"),
            ("depths", "x"),
        ] {
            let mut opts = LabOpts::default();
            opts.params.insert(k.into(), v.into());
            assert!(MqRun::configure(&opts).is_err(), "{k}={v}");
        }
    }
}
