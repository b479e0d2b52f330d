//! `lab sbitmap`: upstream "sbitmap: Use single per-bitmap counting to
//! wake up queued tags" rerun with both wakeup algorithms.
//!
//! As upstream: parallel jobs issue QD64 4 KiB random writes to a `null`
//! device whose completions arrive on another thread (`irqmode=1`, so
//! submitters really wait for tags), varying only the hardware queue
//! depth, 2..64; first with one hardware queue, then with one tag set
//! shared by several hardware queues and twice as many jobs (upstream's
//! "single bitmap shared by 20 hctx" of one nullb: `shared_tags=1`, which
//! like the kernel for one device applies no fair share and keeps the
//! depth's wake batch; `--set fair_share=1` adds blk-mq's per-user fair
//! share and the recalculated batch instead). Upstream ran 20 jobs on 20
//! CPUs; the job counts here default lower and are flags (`--jobs`, `--set
//! shared_queues=N`), and a job-count sweep at a small depth (`--set
//! job_sweep=...`) shows how the contrast moves with more waiters.
//!
//! Throughput alone cannot tell whether the contention the change removes
//! exists on the machine at hand, so every point also gives the
//! per-operation figures that carry to a bigger machine: threads woken per
//! wake batch, wasted wakeups per batch (woken, found no tag, slept
//! again), tag sleeps per I/O, and sleeps ended by the rescue timeout (a
//! lost wakeup shows up there instead of hanging the run). The checks are
//! what the change guarantees: no lost wakeup with the counters, fewer
//! wasted wakeups per batch at small depths, and throughput at least that
//! of `wait_cnt` within noise.
//!
//! Both algorithms run with our plug-weighted wakeups
//! (`tag_wake_weight=plug`, see `mq::sbitmap`): a sleeper about to take a
//! plug of tags counts for that many wakeups. `--set
//! also=counter_first_queue` adds the counter algorithm before upstream's
//! later "fix batching wakeup", `--set also=counter/one` the kernel's one
//! wakeup per sleeper, and `--set wake_weight=one` runs the two main
//! columns that way.

use crate::common::{job, mean_sd, round, run_stack};
use crate::experiment::{check, Experiment};
use crate::figures::{in_job_sweep, ratio};
use crate::plot::{Figure, Panel, Series, Style};
use crate::report::{Check, SeedTable};
use crate::LabOpts;
use anyhow::Result;
use blkstack_bench::RwMode;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::time::Duration;

const DEPTHS: [u32; 6] = [2, 4, 8, 16, 32, 64];

/// Upstream's figures, in thousands of IOPS: (old wait_cnt, new counter).
const SEED_SINGLE: [(f64, f64); 6] = [
    (1681.1, 1721.8),
    (2633.0, 3016.7),
    (6940.8, 7543.0),
    (8172.3, 8132.5),
    (8391.7, 8324.2),
    (8606.1, 8401.8),
];
const SEED_SHARED: [(f64, f64); 6] = [
    (1081.0, 1081.8),
    (957.2, 1316.5),
    (1699.1, 2364.4),
    (6178.2, 6151.4),
    (12227.9, 11893.6),
    (13286.6, 12385.6),
];

/// A waiter not woken within this is rescued and counted, so a lost
/// wakeup (possible with `wait_cnt`, as the upstream change explains)
/// shows up in the table instead of hanging the run.
const RESCUE_MS: u32 = 20;

/// `algo` is a wakeup algorithm, optionally `/WEIGHT` (`plug` or `one`,
/// the `tag_wake_weight` arg); without one, `weight` applies.
fn stack(depth: u32, algo: &str, weight: &str, queues: u32, fair_share: bool) -> String {
    let shared = match (queues > 1, fair_share) {
        (false, _) => "",
        (true, false) => " shared_tags=1",
        (true, true) => " shared_tags=1 tag_fair_share=1",
    };
    let (algo, weight) = algo.split_once('/').unwrap_or((algo, weight));
    format!(
        "dev: 0 2097152 null irqmode=1 hw_queue_depth={depth} submit_queues={queues}{shared} tag_wakeup={algo} tag_wake_weight={weight} tag_rescue_ms={RESCUE_MS}\n"
    )
}

/// Depths at which the change must cut wasted wakeups per batch.
const SMALL_DEPTHS: [u32; 3] = [2, 4, 8];

/// Engine counters and IOPS of one algorithm over a point's runs.
#[derive(Clone, Debug, Default)]
struct Tally {
    kiops: Vec<f64>,
    ios: u64,
    sleeps: u64,
    woken: u64,
    batches: u64,
    wasted: u64,
    rescued: u64,
}

impl Tally {
    fn add(&mut self, m: &crate::common::Measured) {
        self.kiops.push(m.iops / 1000.0);
        self.ios += m.ios;
        self.sleeps += m.counter("tag_waits");
        self.woken += m.counter("tag_wakeups");
        self.batches += m.counter("wake_batches");
        self.wasted += m.counter("wasted_wakeups");
        self.rescued += m.counter("rescued");
    }

    fn sleeps_per_io(&self) -> f64 {
        self.sleeps as f64 / self.ios.max(1) as f64
    }

    fn woken_per_batch(&self) -> f64 {
        self.woken as f64 / self.batches.max(1) as f64
    }

    fn wasted_per_batch(&self) -> f64 {
        self.wasted as f64 / self.batches.max(1) as f64
    }
}

/// One point of the table.
struct Point {
    table: &'static str,
    sweep: &'static str,
    depth: u32,
    queues: u32,
    jobs: u32,
}

/// The settings every point shares.
struct Setup {
    algos: Vec<String>,
    weight: String,
    fair_share: bool,
    repeats: usize,
    runtime: Duration,
    trace: bool,
}

/// The table's points: a depth sweep per table (`single`: one hardware
/// queue and `jobs` jobs; `shared`: `shared_queues` queues on one tag set
/// and twice the jobs), then the job sweep on one queue.
fn points(
    tables: &[String],
    depths: &[u32],
    jobs: u32,
    shared_queues: u32,
    job_sweep: &[u32],
    sweep_depth: u32,
) -> Vec<Point> {
    let mut points = Vec::new();
    for (table, queues, njobs) in [("single", 1u32, jobs), ("shared", shared_queues, jobs * 2)] {
        if tables.iter().any(|t| t == table) {
            for &depth in depths {
                points.push(Point {
                    table,
                    sweep: "depth",
                    depth,
                    queues,
                    jobs: njobs,
                });
            }
        }
    }
    for &j in job_sweep {
        points.push(Point {
            table: "single",
            sweep: "jobs",
            depth: sweep_depth,
            queues: 1,
            jobs: j,
        });
    }
    points
}

/// Run every algorithm `repeats` times at one point, interleaved, and
/// rotate which goes first, so none always runs right after a fresh
/// start of another.
fn measure_point(p: &Point, s: &Setup) -> Result<Vec<Tally>> {
    let n = s.algos.len();
    let mut tallies = vec![Tally::default(); n];
    for repeat in 0..s.repeats {
        for i in (0..n).map(|k| (k + repeat) % n) {
            let algo = &s.algos[i];
            let m = run_stack(
                &stack(p.depth, algo, &s.weight, p.queues, s.fair_share),
                &job(RwMode::RandWrite, 4096, 64, p.jobs, s.runtime),
            )?;
            anyhow::ensure!(
                m.errors == 0,
                "{} depth {} {algo}: {} I/O errors",
                p.table,
                p.depth,
                m.errors
            );
            if s.trace {
                eprintln!(
                    "{} depth {} {} jobs {algo}: {:.1}k IOPS, {:.0} ns CPU/IO | {}",
                    p.table,
                    p.depth,
                    p.jobs,
                    m.iops / 1000.0,
                    m.cpu_ns_per_io,
                    m.status.trim()
                );
            }
            tallies[i].add(&m);
        }
    }
    Ok(tallies)
}

/// The settings of a run.
pub struct Config {
    jobs: u32,
    shared_queues: u32,
    job_sweep: Vec<u32>,
    sweep_depth: u32,
    setup: Setup,
    points: Vec<Point>,
}

/// Per point of [`Config::points`], per algorithm, the tally of its runs.
pub struct Measurement {
    tallies: Vec<Vec<Tally>>,
}

/// A row of the table: both algorithms at one point.
#[derive(Serialize, Deserialize)]
pub struct Row {
    table: String,
    sweep: String,
    jobs: u32,
    depth: u32,
    wait_cnt_kiops: f64,
    wait_cnt_sd: f64,
    counter_kiops: f64,
    counter_sd: f64,
    #[serde(rename = "counter/wait_cnt")]
    counter_per_wait_cnt: f64,
    wait_cnt_rescued: u64,
    counter_rescued: u64,
    wait_cnt_sleeps_per_io: f64,
    counter_sleeps_per_io: f64,
    wait_cnt_woken_per_batch: f64,
    counter_woken_per_batch: f64,
    wait_cnt_wasted_per_batch: f64,
    counter_wasted_per_batch: f64,
    seed_wait_cnt_kiops: Option<f64>,
    seed_counter_kiops: Option<f64>,
}

/// `lab sbitmap`.
pub struct Sbitmap;

impl Experiment for Sbitmap {
    const NAME: &'static str = "sbitmap";
    const SEED: &'static str = "003";
    const ABOUT: &'static str = "tag wakeups: wait_cnt vs completion/wakeup counters";
    const TITLE: &'static str =
        "tag wakeups: per-queue wait_cnt countdown (old) vs completion/wakeup counters";
    type Config = Config;
    type Measurement = Measurement;
    type Row = Row;

    fn configure(opts: &LabOpts) -> Result<Config> {
        configure(opts)
    }

    fn measure(cfg: &Config) -> Result<Measurement> {
        let s = &cfg.setup;
        crate::progress::expect_runs((cfg.points.len() * s.repeats * s.algos.len()) as u64);
        let tallies = cfg
            .points
            .iter()
            .map(|p| measure_point(p, s))
            .collect::<Result<_>>()?;
        Ok(Measurement { tallies })
    }

    fn columns(_: &Config) -> Vec<String> {
        ["table", "sweep", "jobs", "depth"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    fn rows(cfg: &Config, m: &Measurement) -> Vec<Row> {
        cfg.points
            .iter()
            .zip(&m.tallies)
            .map(|(p, t)| row(p, t))
            .collect()
    }

    fn checks(cfg: &Config, m: &Measurement, rows: &[Row]) -> Vec<Check> {
        let mut checks: Vec<Check> = cfg
            .points
            .iter()
            .zip(&m.tallies)
            .filter_map(|(p, t)| throughput_check(p, t))
            .collect();
        checks.extend(guarantee_checks(rows));
        checks
    }

    fn notes(cfg: &Config, m: &Measurement, _: &[Row]) -> Vec<String> {
        let mut notes: Vec<String> = cfg
            .points
            .iter()
            .zip(&m.tallies)
            .filter_map(|(p, t)| extra_algo_note(p, t, &cfg.setup))
            .collect();
        notes.push(format!(
            "{} jobs on one hardware queue, {} jobs on {} queues sharing one tag set; job sweep {:?} on one queue at depth {}; {} runs of {} ms per point, interleaved; wasted wakeups: woken by a completion, found no free tag, slept again",
            cfg.jobs,
            cfg.jobs * 2,
            cfg.shared_queues,
            cfg.job_sweep,
            cfg.sweep_depth,
            cfg.setup.repeats,
            cfg.setup.runtime.as_millis()
        ));
        notes
    }

    fn seed_table() -> Option<SeedTable> {
        Some(SeedTable {
            caption:
                "upstream, 20-CPU box, 20 jobs (shared: 40 jobs, 20 hctx), QD64 randwrite, KIOPS mean"
                    .into(),
            columns: vec![
                "table".into(),
                "depth".into(),
                "6.1-rc2 (wait_cnt)".into(),
                "patched (counter)".into(),
            ],
            rows: [("single", &SEED_SINGLE), ("shared", &SEED_SHARED)]
                .iter()
                .flat_map(|(t, s)| {
                    DEPTHS.iter().zip(s.iter()).map(move |(d, (o, n))| {
                        vec![
                            t.to_string(),
                            d.to_string(),
                            format!("{o}K"),
                            format!("{n}K"),
                        ]
                    })
                })
                .collect(),
        })
    }

    fn figures() -> Vec<Figure> {
        vec![figure()]
    }
}

/// The settings, checked.
fn configure(opts: &LabOpts) -> Result<Config> {
    let jobs = opts.jobs.unwrap_or(4) as u32;
    let shared_queues: u32 = opts.param("shared_queues", 4)?;
    let repeats = opts.repeats.unwrap_or(if opts.quick { 3 } else { 5 });
    let runtime =
        Duration::from_millis(opts.param("runtime_ms", if opts.quick { 600 } else { 3000 })?);
    let depths: Vec<u32> = opts.param_list("depths", &DEPTHS)?;
    let tables: Vec<String> =
        opts.param_list("tables", &["single".to_string(), "shared".to_string()])?;
    // The job sweep runs on one hardware queue at `sweep_depth`, where
    // upstream saw its largest single-queue gain.
    let sweep_default: &[u32] = if opts.quick { &[2, 8] } else { &[2, 8, 16] };
    let job_sweep: Vec<u32> = opts.param_list("job_sweep", sweep_default)?;
    let sweep_depth: u32 = opts.param("sweep_depth", 4)?;
    anyhow::ensure!(
        job_sweep.iter().all(|&j| j >= 1),
        "--set job_sweep: every job count must be at least 1"
    );
    // `--set also=counter_first_queue`: a third wakeup variant run beside
    // the two in every repeat and reported in a note per depth (not in
    // the table, whose columns are the two algorithms).
    let also: String = opts.param("also", String::new())?;
    let mut algos = vec!["wait_cnt".to_string(), "counter".to_string()];
    // An unknown name is refused by the null driver's table parser.
    if !also.is_empty() {
        algos.push(also);
    }
    let setup = Setup {
        algos,
        weight: opts.param("wake_weight", "plug".to_string())?,
        fair_share: opts.param::<u8>("fair_share", 0)? != 0,
        repeats,
        runtime,
        trace: opts.param::<u8>("trace", 0)? != 0,
    };
    let points = points(
        &tables,
        &depths,
        jobs,
        shared_queues,
        &job_sweep,
        sweep_depth,
    );
    Ok(Config {
        jobs,
        shared_queues,
        job_sweep,
        sweep_depth,
        setup,
        points,
    })
}

/// A point's row, with upstream's figures at its depth.
fn row(p: &Point, t: &[Tally]) -> Row {
    let seed = (p.sweep == "depth")
        .then(|| DEPTHS.iter().position(|&d| d == p.depth))
        .flatten()
        .map(|i| {
            if p.table == "single" {
                SEED_SINGLE[i]
            } else {
                SEED_SHARED[i]
            }
        });
    let (wm, ws) = mean_sd(&t[0].kiops);
    let (cm, cs) = mean_sd(&t[1].kiops);
    Row {
        table: p.table.to_string(),
        sweep: p.sweep.to_string(),
        jobs: p.jobs,
        depth: p.depth,
        wait_cnt_kiops: round(wm, 1),
        wait_cnt_sd: round(ws, 1),
        counter_kiops: round(cm, 1),
        counter_sd: round(cs, 1),
        counter_per_wait_cnt: round(cm / wm.max(1e-9), 3),
        wait_cnt_rescued: t[0].rescued,
        counter_rescued: t[1].rescued,
        wait_cnt_sleeps_per_io: round(t[0].sleeps_per_io(), 3),
        counter_sleeps_per_io: round(t[1].sleeps_per_io(), 3),
        wait_cnt_woken_per_batch: round(t[0].woken_per_batch(), 2),
        counter_woken_per_batch: round(t[1].woken_per_batch(), 2),
        wait_cnt_wasted_per_batch: round(t[0].wasted_per_batch(), 3),
        counter_wasted_per_batch: round(t[1].wasted_per_batch(), 3),
        seed_wait_cnt_kiops: seed.map(|s| s.0),
        seed_counter_kiops: seed.map(|s| s.1),
    }
}

/// The throughput check of a depth point.
fn throughput_check(p: &Point, t: &[Tally]) -> Option<Check> {
    if p.sweep != "depth" {
        return None;
    }
    // "Within noise": the difference is smaller than the two standard
    // deviations together.
    let ((wm, ws), (cm, cs)) = (mean_sd(&t[0].kiops), mean_sd(&t[1].kiops));
    Some(check(
        format!(
            "{} depth {}: counter IOPS >= wait_cnt within noise",
            p.table, p.depth
        ),
        cm + cs + ws >= wm,
        format!("counter {cm:.1}k (sd {cs:.1}) vs wait_cnt {wm:.1}k (sd {ws:.1})"),
    ))
}

/// The note on the extra algorithm (`--set also=...`), if one ran.
fn extra_algo_note(p: &Point, t: &[Tally], setup: &Setup) -> Option<String> {
    let (extra, et) = (setup.algos.get(2)?, t.get(2)?);
    let (em, es) = mean_sd(&et.kiops);
    Some(format!(
        "{} depth {} {} jobs: {extra} {em:.1}k (sd {es:.1}), {:.2}x wait_cnt; \
         {:.3} sleeps/IO, {:.2} woken and {:.3} wasted per batch, {} rescued",
        p.table,
        p.depth,
        p.jobs,
        em / mean_sd(&t[0].kiops).0.max(1e-9),
        et.sleeps_per_io(),
        et.woken_per_batch(),
        et.wasted_per_batch(),
        et.rescued
    ))
}

/// What the change guarantees besides throughput: no lost wakeup with
/// the counters (no sleep ended by the rescue timeout), and fewer wasted
/// wakeups per batch than `wait_cnt` at small depths.
fn guarantee_checks(rows: &[Row]) -> Vec<Check> {
    let rescued: f64 = rows.iter().map(|x| x.counter_rescued as f64).sum();
    let old_rescued: f64 = rows.iter().map(|x| x.wait_cnt_rescued as f64).sum();
    let mut checks = vec![check(
        "counter: no lost wakeup (no sleep ended by the rescue timeout, any point)",
        rescued == 0.0,
        format!(
            "counter {rescued} rescued; wait_cnt {old_rescued} (its lost wakeups). A rescue \
             also happens when no completion arrives within {RESCUE_MS} ms (completion thread \
             starved on a loaded machine): check the load in the machine line"
        ),
    )];
    for table in ["single", "shared"] {
        let small: Vec<&Row> = rows
            .iter()
            .filter(|x| x.sweep == "depth" && x.table == table && SMALL_DEPTHS.contains(&x.depth))
            .collect();
        if small.is_empty() {
            continue;
        }
        let mean =
            |f: fn(&Row) -> f64| small.iter().map(|x| f(x)).sum::<f64>() / small.len() as f64;
        let (old, new) = (
            mean(|x| x.wait_cnt_wasted_per_batch),
            mean(|x| x.counter_wasted_per_batch),
        );
        checks.push(check(
            format!("{table} depths 2-8: counter wastes fewer wakeups per batch than wait_cnt"),
            new < old || (new == 0.0 && old == 0.0),
            format!("mean wasted wakeups per batch: counter {new:.3}, wait_cnt {old:.3}"),
        ));
    }
    checks
}

/// Counter/wait_cnt IOPS ratio per depth with upstream's ratio; wakeups
/// per batch, wasted wakeups per batch, sleeps per I/O.
fn figure() -> Figure {
    let depth_rows = |table: &str| vec![("table".to_string(), json!(table))];
    let mut gain = Panel::new(
        "IOPS ratio counter / wait_cnt",
        "depth",
        "hardware queue depth",
        "counter / wait_cnt",
    );
    gain.reference = Some(1.0);
    gain.skip = Some(in_job_sweep);
    for (i, table) in ["single", "shared"].into_iter().enumerate() {
        gain.series.push(
            Series::column(
                &format!("{table} queue"),
                Style::Ours,
                i,
                "counter/wait_cnt",
            )
            .only("table", json!(table)),
        );
        gain.series.push(
            Series::new(
                &format!("upstream {table}"),
                Style::Upstream,
                i,
                ratio("seed_counter_kiops", "seed_wait_cnt_kiops", 1.0),
            )
            .only("table", json!(table)),
        );
    }
    let per_algo = |title: &str, y: &str, suffix: &str| {
        let mut p = Panel::new(title, "depth", "hardware queue depth (single queue)", y);
        p.filter = depth_rows("single");
        p.skip = Some(in_job_sweep);
        p.series = vec![
            Series::column(
                "wait_cnt (old)",
                Style::Ours,
                3,
                &format!("wait_cnt_{suffix}"),
            ),
            Series::column("counter", Style::Ours, 0, &format!("counter_{suffix}")),
        ];
        p
    };
    let woken = per_algo(
        "threads woken per wake batch",
        "woken per batch",
        "woken_per_batch",
    );
    let wasted = per_algo(
        "wasted wakeups per batch (woken, no tag, slept)",
        "wasted per batch",
        "wasted_per_batch",
    );
    let sleeps = per_algo("tag sleeps per I/O", "sleeps per I/O", "sleeps_per_io");
    let mut jobs = Panel::new(
        "IOPS ratio vs jobs (one queue, small depth)",
        "jobs",
        "jobs (tag waiters)",
        "counter / wait_cnt",
    );
    jobs.filter = vec![("sweep".into(), json!("jobs"))];
    jobs.reference = Some(1.0);
    jobs.series = vec![Series::column(
        "counter / wait_cnt",
        Style::Ours,
        0,
        "counter/wait_cnt",
    )];
    Figure {
        suffix: String::new(),
        title: "sbitmap batched wakeups: throughput ratio and the per-operation figures".into(),
        columns: 2,
        panels: vec![gain, jobs, woken, wasted, sleeps],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_rows_write_the_saved_report_unchanged() {
        let (saved, again) = crate::report::round_trip::<Row>(include_str!(
            "../../cli/tests/data/lab-report/sbitmap.json"
        ));
        assert_eq!(saved, again);
    }

    #[test]
    fn points_sweep_depths_per_table_then_jobs() {
        let p = points(&["shared".to_string()], &[2, 4], 3, 4, &[2], 4);
        let shape: Vec<_> = p
            .iter()
            .map(|p| (p.table, p.sweep, p.depth, p.queues, p.jobs))
            .collect();
        assert_eq!(
            shape,
            vec![
                ("shared", "depth", 2, 4, 6),
                ("shared", "depth", 4, 4, 6),
                ("single", "jobs", 4, 1, 2)
            ]
        );
    }
}
