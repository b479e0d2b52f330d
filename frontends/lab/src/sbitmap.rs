//! `lab sbitmap`: seed 003 (sbitmap: wake waiters in batches using two
//! always-increasing counters) rerun with both wakeup algorithms.
//!
//! As the seed: parallel jobs issue QD64 4 KiB random writes to a `null`
//! device whose completions arrive on another thread (`irqmode=1`, so
//! submitters really wait for tags), varying only the hardware queue
//! depth, 2..64; first with one hardware queue, then with one tag set
//! shared by several hardware queues and twice as many jobs (the seed's
//! "single bitmap shared by 20 hctx" of one nullb: `shared_tags=1`, which
//! like the kernel for one device applies no fair share and keeps the
//! depth's wake batch; `--set fair_share=1` adds blk-mq's per-user fair
//! share and the recalculated batch instead). Each point is
//! repeated; mean (stddev) as the seed reports. The seed ran 20 jobs on 20
//! CPUs; this machine has 2, so the job counts default lower and are
//! flags (`--jobs`, `--set shared_queues=N`).
//!
//! The table also gives tag sleeps per 1000 I/Os and sleepers woken per
//! wake batch, because they explain the IOPS here: with few submitters
//! spread over the 8 wait queues, `wait_cnt` wakes one queue's sleeper per
//! batch while today's `counter` wakes up to a batch across queues
//! (upstream's 2023 "fix batching wakeup", against a hang), and on 2 vCPUs
//! each extra sleep costs more than the I/O. Both algorithms run with our
//! plug-weighted wakeups (`tag_wake_weight=plug`, see `mq::sbitmap`): a
//! sleeper about to take a plug of tags counts for that many wakeups, so
//! a batch wakes one such sleeper, not eight. `--set
//! also=counter_first_queue` adds the counter algorithm before that fix,
//! `--set also=counter/one` the kernel's one wakeup per sleeper, and
//! `--set wake_weight=one` runs the two main columns that way.

use crate::common::{job, mean_sd, round, run_stack};
use crate::report::{LabReport, SeedTable};
use crate::LabOpts;
use anyhow::Result;
use blkstack_bench::RwMode;
use serde_json::json;
use std::time::Duration;

const DEPTHS: [u32; 6] = [2, 4, 8, 16, 32, 64];

/// The seed's figures, in thousands of IOPS: (old wait_cnt, new counter).
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
/// wakeup (possible with `wait_cnt`, as the seed explains) shows up in the
/// table instead of hanging the run.
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

/// Events per thousand I/Os.
fn per_kio(events: u64, ios: u64) -> f64 {
    events as f64 * 1000.0 / ios.max(1) as f64
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
    // `--set trace=1`: each run's figures and engine counters on stderr
    // (tag waits, threads woken, wake batches), to see where time goes.
    let trace: u8 = opts.param("trace", 0)?;
    // `--set also=counter_first_queue`: a third wakeup variant run beside
    // the two in every repeat and reported in a note per depth (not in
    // the table, whose columns are the two algorithms).
    // `--set also=counter/one`: the same with the kernel's one wakeup per
    // sleeper; `--set wake_weight=one` applies that to the two main ones.
    let also: String = opts.param("also", String::new())?;
    let weight: String = opts.param("wake_weight", "plug".to_string())?;
    let fair_share = opts.param::<u8>("fair_share", 0)? != 0;
    let mut algos = vec!["wait_cnt", "counter"];
    // An unknown name is refused by the null driver's table parser.
    if !also.is_empty() {
        algos.push(also.as_str());
    }

    let mut r = LabReport::new(
        "sbitmap",
        "tag wakeups: per-queue wait_cnt countdown (old) vs completion/wakeup counters (seed 003)",
        &[
            "table",
            "jobs",
            "depth",
            "wait_cnt_kiops",
            "wait_cnt_sd",
            "counter_kiops",
            "counter_sd",
            "counter/wait_cnt",
            "wait_cnt_rescued",
            "counter_rescued",
            "wait_cnt_sleeps_per_kio",
            "counter_sleeps_per_kio",
            "wait_cnt_woken_per_batch",
            "counter_woken_per_batch",
            "seed_wait_cnt_kiops",
            "seed_counter_kiops",
        ],
    );
    for (table, queues, njobs, seed) in [
        ("single", 1u32, jobs, &SEED_SINGLE),
        ("shared", shared_queues, jobs * 2, &SEED_SHARED),
    ] {
        if !tables.iter().any(|t| t == table) {
            continue;
        }
        for &depth in &depths {
            let mut figures = vec![Vec::new(); algos.len()];
            let mut rescued = vec![0u64; algos.len()];
            // Engine counters summed over the runs: I/Os, sleeps on a tag,
            // threads woken, wake batches. They show the mechanism behind
            // the IOPS: how often a submitter sleeps per I/O, and how many
            // sleepers one batch of completions wakes.
            let mut ios = vec![0u64; algos.len()];
            let mut sleeps = vec![0u64; algos.len()];
            let mut woken = vec![0u64; algos.len()];
            let mut batches = vec![0u64; algos.len()];
            // Interleave the algorithms so drift on a shared machine hits
            // them alike, and rotate which goes first, so none always runs
            // right after a fresh start of another.
            for repeat in 0..repeats {
                let n = algos.len();
                for i in (0..n).map(|k| (k + repeat) % n) {
                    let algo = algos[i];
                    let m = run_stack(
                        &stack(depth, algo, &weight, queues, fair_share),
                        &job(RwMode::RandWrite, 4096, 64, njobs, runtime),
                    )?;
                    anyhow::ensure!(
                        m.errors == 0,
                        "{table} depth {depth} {algo}: {} I/O errors",
                        m.errors
                    );
                    if trace != 0 {
                        eprintln!(
                            "{table} depth {depth} {algo}: {:.1}k IOPS, {:.0} ns CPU/IO ({:.0} in jobs), {:.2} CPUs | {}",
                            m.iops / 1000.0,
                            m.cpu_ns_per_io,
                            m.job_cpu_ns_per_io,
                            m.cpus,
                            m.status.trim()
                        );
                    }
                    figures[i].push(m.iops / 1000.0);
                    rescued[i] += m.counter("rescued");
                    ios[i] += m.ios;
                    sleeps[i] += m.counter("tag_waits");
                    woken[i] += m.counter("tag_wakeups");
                    batches[i] += m.counter("wake_batches");
                }
            }
            let (wm, ws) = mean_sd(&figures[0]);
            let (cm, cs) = mean_sd(&figures[1]);
            let seed_row = DEPTHS.iter().position(|&d| d == depth).map(|i| seed[i]);
            r.push_row([
                ("table", json!(table)),
                ("jobs", json!(njobs)),
                ("depth", json!(depth)),
                ("wait_cnt_kiops", json!(round(wm, 1))),
                ("wait_cnt_sd", json!(round(ws, 1))),
                ("counter_kiops", json!(round(cm, 1))),
                ("counter_sd", json!(round(cs, 1))),
                ("counter/wait_cnt", json!(round(cm / wm.max(1e-9), 3))),
                ("wait_cnt_rescued", json!(rescued[0])),
                ("counter_rescued", json!(rescued[1])),
                (
                    "wait_cnt_sleeps_per_kio",
                    json!(round(per_kio(sleeps[0], ios[0]), 1)),
                ),
                (
                    "counter_sleeps_per_kio",
                    json!(round(per_kio(sleeps[1], ios[1]), 1)),
                ),
                (
                    "wait_cnt_woken_per_batch",
                    json!(round(woken[0] as f64 / batches[0].max(1) as f64, 2)),
                ),
                (
                    "counter_woken_per_batch",
                    json!(round(woken[1] as f64 / batches[1].max(1) as f64, 2)),
                ),
                ("seed_wait_cnt_kiops", json!(seed_row.map(|s| s.0))),
                ("seed_counter_kiops", json!(seed_row.map(|s| s.1))),
            ]);
            // "Within noise": the difference is smaller than the two
            // standard deviations together.
            let ok = cm + cs + ws >= wm;
            r.check(
                &format!("{table} depth {depth}: counter >= wait_cnt within noise"),
                ok,
                format!("counter {cm:.1}k (sd {cs:.1}) vs wait_cnt {wm:.1}k (sd {ws:.1})"),
            );
            if let Some(extra) = algos.get(2) {
                let (em, es) = mean_sd(&figures[2]);
                r.note(format!(
                    "{table} depth {depth}: {extra} {em:.1}k (sd {es:.1}), {:.2}x wait_cnt; \
                     {:.1} sleeps/kIO, {:.2} woken per batch, {} rescued",
                    em / wm.max(1e-9),
                    per_kio(sleeps[2], ios[2]),
                    woken[2] as f64 / batches[2].max(1) as f64,
                    rescued[2]
                ));
            }
        }
    }
    r.seed = Some(SeedTable {
        caption:
            "seed 003, 20-CPU box, 20 jobs (shared: 40 jobs, 20 hctx), QD64 randwrite, KIOPS mean"
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
        "{jobs} jobs on one hardware queue, {} jobs on {shared_queues} queues sharing one tag set; {repeats} runs of {} ms per point, interleaved",
        jobs * 2,
        runtime.as_millis()
    ));
    Ok(r)
}
