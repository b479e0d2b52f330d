//! `lab mq-run`: seed 001 (blk-mq: do not schedule the same hardware-queue
//! run work again while one is pending) rerun with the queued-bit dedup
//! off and on.
//!
//! As the seed: 8 jobs of 4 KiB random reads on a RAM-backed device whose
//! driver, like SCSI's `scsi_end_request`, asks for an asynchronous run of
//! its hardware queues on every completion, at queue depths 16..1024.
//! Without the dedup every completion posts a run to the kblockd pool;
//! with it a run already pending absorbs the request.
//!
//! Two devices are run. `memory`, as the issue words it, completes every
//! request inside `queue_rq`, so nothing ever waits on a dispatch list and
//! the posted runs find no work: the dedup can only save the posting cost.
//! The seed's disk was RAM-backed but behind SCSI (storvsc), whose
//! `can_queue` limit makes requests wait for a queue run; `null irqmode=1
//! max_inflight=32` is that driver (busy above 32 in flight, completions on
//! another thread), and the checks apply to it.

use crate::common::{job, mean_sd, round, run_stack};
use crate::report::{LabReport, PlotKind, PlotSpec, SeedTable};
use crate::LabOpts;
use anyhow::Result;
use blkstack_bench::RwMode;
use serde_json::json;
use std::time::Duration;

const DEPTHS: [u32; 4] = [16, 64, 256, 1024];
/// Seed 001: IOPS in thousands, (pre-patch, after-patch).
const SEED: [(u32, u32); 4] = [(190, 190), (235, 240), (180, 256), (156, 250)];

/// (label, table without the dedup setting).
const DEVICES: [(&str, &str); 2] = [
    ("memory", "memory run_on_completion=1"),
    (
        "can_queue32",
        "null irqmode=1 max_inflight=32 run_on_completion=1",
    ),
];

fn stack(device: &str, dedup: &str) -> String {
    format!("dev: 0 2097152 {device} run_dedup={dedup}\n")
}

pub fn run(opts: &LabOpts) -> Result<LabReport> {
    let jobs = opts.jobs.unwrap_or(8) as u32;
    let repeats = opts.repeats.unwrap_or(if opts.quick { 2 } else { 5 });
    let runtime =
        Duration::from_millis(opts.param("runtime_ms", if opts.quick { 1500 } else { 4000 })?);
    let depths: Vec<u32> = opts.param_list("depths", &DEPTHS)?;

    let mut r = LabReport::new(
        "mq-run",
        "queue runs posted on every completion: dedup off (old) vs on (seed 001)",
        &[
            "device",
            "iodepth",
            "off_kiops",
            "off_sd",
            "on_kiops",
            "on_sd",
            "improvement_pct",
            "seed_pre_kiops",
            "seed_after_kiops",
        ],
    );
    let mut on_by_depth = Vec::new();
    let mut off_by_depth = Vec::new();
    for (label, device) in DEVICES {
        for &qd in &depths {
            let mut figures = [Vec::new(), Vec::new()];
            for _ in 0..repeats {
                for (i, dedup) in ["off", "on"].iter().enumerate() {
                    let m = run_stack(
                        &stack(device, dedup),
                        &job(RwMode::RandRead, 4096, qd, jobs, runtime),
                    )?;
                    anyhow::ensure!(
                        m.errors == 0,
                        "QD{qd} dedup={dedup}: {} I/O errors",
                        m.errors
                    );
                    figures[i].push(m.iops / 1000.0);
                }
            }
            let (off, off_sd) = mean_sd(&figures[0]);
            let (on, on_sd) = mean_sd(&figures[1]);
            let seed = DEPTHS.iter().position(|&d| d == qd).map(|i| SEED[i]);
            r.push_row([
                ("device", json!(label)),
                ("iodepth", json!(qd)),
                ("off_kiops", json!(round(off, 1))),
                ("off_sd", json!(round(off_sd, 1))),
                ("on_kiops", json!(round(on, 1))),
                ("on_sd", json!(round(on_sd, 1))),
                (
                    "improvement_pct",
                    json!(round((on / off.max(1e-9) - 1.0) * 100.0, 1)),
                ),
                ("seed_pre_kiops", json!(seed.map(|s| s.0))),
                ("seed_after_kiops", json!(seed.map(|s| s.1))),
            ]);
            if label == "can_queue32" {
                on_by_depth.push((qd, on));
                off_by_depth.push((qd, off));
            }
        }
    }
    let at = |v: &[(u32, f64)], d: u32| v.iter().find(|x| x.0 == d).map(|x| x.1);
    if let (Some(on64), Some(on1024)) = (at(&on_by_depth, 64), at(&on_by_depth, 1024)) {
        r.check(
            "can_queue32, dedup on: QD1024 IOPS >= 95% of QD64's",
            on1024 >= 0.95 * on64,
            format!("{on1024:.1}k vs {on64:.1}k ({:.1}%)", on1024 / on64 * 100.0),
        );
    }
    if let (Some(off64), Some(off1024)) = (at(&off_by_depth, 64), at(&off_by_depth, 1024)) {
        let drop = (1.0 - off1024 / off64) * 100.0;
        r.note(format!(
            "can_queue32, dedup off: QD1024 is {:.1}% {} QD64 (seed: -34%)",
            drop.abs(),
            if drop >= 0.0 { "below" } else { "above" }
        ));
    }
    r.seed = Some(SeedTable {
        caption: "seed 001: RAM-backed virtual disk on Hyper-V, 8 fio jobs, 4k randread, IOPS"
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
    });
    r.note(format!(
        "{jobs} jobs, {repeats} interleaved runs of {} ms per point",
        runtime.as_millis()
    ));
    r.plot = Some(PlotSpec {
        x: "iodepth".into(),
        series: vec!["off_kiops".into(), "on_kiops".into()],
        x_label: "queue depth per job".into(),
        y_label: "KIOPS".into(),
        kind: PlotKind::Line,
        filter: vec![("device".into(), json!("can_queue32"))],
    });
    Ok(r)
}
