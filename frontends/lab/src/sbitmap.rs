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
use crate::report::{LabReport, SeedTable};
use crate::LabOpts;
use anyhow::Result;
use blkstack_bench::RwMode;
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
struct Point<'a> {
    table: &'a str,
    sweep: &'a str,
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
fn points<'a>(
    tables: &[&'a str],
    depths: &[u32],
    jobs: u32,
    shared_queues: u32,
    job_sweep: &[u32],
    sweep_depth: u32,
) -> Vec<Point<'a>> {
    let mut points = Vec::new();
    for (table, queues, njobs) in [("single", 1u32, jobs), ("shared", shared_queues, jobs * 2)] {
        if tables.contains(&table) {
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

fn push_row(r: &mut LabReport, p: &Point, t: &[Tally], seed: Option<(f64, f64)>) {
    let (wm, ws) = mean_sd(&t[0].kiops);
    let (cm, cs) = mean_sd(&t[1].kiops);
    r.push_row([
        ("table", json!(p.table)),
        ("sweep", json!(p.sweep)),
        ("jobs", json!(p.jobs)),
        ("depth", json!(p.depth)),
        ("wait_cnt_kiops", json!(round(wm, 1))),
        ("wait_cnt_sd", json!(round(ws, 1))),
        ("counter_kiops", json!(round(cm, 1))),
        ("counter_sd", json!(round(cs, 1))),
        ("counter/wait_cnt", json!(round(cm / wm.max(1e-9), 3))),
        ("wait_cnt_rescued", json!(t[0].rescued)),
        ("counter_rescued", json!(t[1].rescued)),
        (
            "wait_cnt_sleeps_per_io",
            json!(round(t[0].sleeps_per_io(), 3)),
        ),
        (
            "counter_sleeps_per_io",
            json!(round(t[1].sleeps_per_io(), 3)),
        ),
        (
            "wait_cnt_woken_per_batch",
            json!(round(t[0].woken_per_batch(), 2)),
        ),
        (
            "counter_woken_per_batch",
            json!(round(t[1].woken_per_batch(), 2)),
        ),
        (
            "wait_cnt_wasted_per_batch",
            json!(round(t[0].wasted_per_batch(), 3)),
        ),
        (
            "counter_wasted_per_batch",
            json!(round(t[1].wasted_per_batch(), 3)),
        ),
        ("seed_wait_cnt_kiops", json!(seed.map(|s| s.0))),
        ("seed_counter_kiops", json!(seed.map(|s| s.1))),
    ]);
}

pub fn run(opts: &LabOpts) -> Result<LabReport> {
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
        algos.push(also.clone());
    }
    let setup = Setup {
        algos,
        weight: opts.param("wake_weight", "plug".to_string())?,
        fair_share: opts.param::<u8>("fair_share", 0)? != 0,
        repeats,
        runtime,
        trace: opts.param::<u8>("trace", 0)? != 0,
    };
    let tables: Vec<&str> = tables.iter().map(String::as_str).collect();
    let points = points(
        &tables,
        &depths,
        jobs,
        shared_queues,
        &job_sweep,
        sweep_depth,
    );
    crate::progress::expect_runs((points.len() * repeats * setup.algos.len()) as u64);

    let mut r = LabReport::new(
        "sbitmap",
        "tag wakeups: per-queue wait_cnt countdown (old) vs completion/wakeup counters",
        &["table", "sweep", "jobs", "depth"],
    );
    for p in &points {
        let t = measure_point(p, &setup)?;
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
        push_row(&mut r, p, &t, seed);
        check_point(&mut r, p, &t, &setup);
    }
    add_guarantee_checks(&mut r);
    r.seed = Some(SeedTable {
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
    });
    r.note(format!(
        "{jobs} jobs on one hardware queue, {} jobs on {shared_queues} queues sharing one tag set; job sweep {job_sweep:?} on one queue at depth {sweep_depth}; {repeats} runs of {} ms per point, interleaved; wasted wakeups: woken by a completion, found no free tag, slept again",
        jobs * 2,
        runtime.as_millis()
    ));
    Ok(r)
}

/// The throughput check of a depth point, and the note on the extra
/// algorithm (`--set also=...`) if one ran.
fn check_point(r: &mut LabReport, p: &Point, t: &[Tally], setup: &Setup) {
    if p.sweep == "depth" {
        // "Within noise": the difference is smaller than the two
        // standard deviations together.
        let ((wm, ws), (cm, cs)) = (mean_sd(&t[0].kiops), mean_sd(&t[1].kiops));
        r.check(
            &format!(
                "{} depth {}: counter IOPS >= wait_cnt within noise",
                p.table, p.depth
            ),
            cm + cs + ws >= wm,
            format!("counter {cm:.1}k (sd {cs:.1}) vs wait_cnt {wm:.1}k (sd {ws:.1})"),
        );
    }
    if let (Some(extra), Some(et)) = (setup.algos.get(2), t.get(2)) {
        let (em, es) = mean_sd(&et.kiops);
        r.note(format!(
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
        ));
    }
}

/// What the change guarantees besides throughput: no lost wakeup with
/// the counters (no sleep ended by the rescue timeout), and fewer wasted
/// wakeups per batch than `wait_cnt` at small depths.
fn add_guarantee_checks(r: &mut LabReport) {
    let f = |x: &crate::report::Row, c: &str| x.get(c).and_then(|v| v.as_f64()).unwrap_or(0.0);
    let rescued: f64 = r.rows.iter().map(|x| f(x, "counter_rescued")).sum();
    let old_rescued: f64 = r.rows.iter().map(|x| f(x, "wait_cnt_rescued")).sum();
    r.check(
        "counter: no lost wakeup (no sleep ended by the rescue timeout, any point)",
        rescued == 0.0,
        format!(
            "counter {rescued} rescued; wait_cnt {old_rescued} (its lost wakeups). A rescue \
             also happens when no completion arrives within {RESCUE_MS} ms (completion thread \
             starved on a loaded machine): check the load in the machine line"
        ),
    );
    for table in ["single", "shared"] {
        let small: Vec<&crate::report::Row> = r
            .rows
            .iter()
            .filter(|x| {
                x.get("sweep") == Some(&json!("depth"))
                    && x.get("table") == Some(&json!(table))
                    && SMALL_DEPTHS
                        .iter()
                        .any(|&d| x.get("depth") == Some(&json!(d)))
            })
            .collect();
        if small.is_empty() {
            continue;
        }
        let mean = |c: &str| small.iter().map(|x| f(x, c)).sum::<f64>() / small.len() as f64;
        let (old, new) = (
            mean("wait_cnt_wasted_per_batch"),
            mean("counter_wasted_per_batch"),
        );
        r.check(
            &format!("{table} depths 2-8: counter wastes fewer wakeups per batch than wait_cnt"),
            new < old || (new == 0.0 && old == 0.0),
            format!("mean wasted wakeups per batch: counter {new:.3}, wait_cnt {old:.3}"),
        );
    }
}
