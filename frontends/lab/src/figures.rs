//! What each experiment draws: the plots that show its claim, made from
//! the table alone (so saved `NAME.json` files redraw the same figures),
//! with the upstream patch's published figures as dashed series with
//! hollow markers wherever the patch published any.
//!
//! - delay: % of the theoretical QD1 IOPS per mechanism against the delay
//!   (the 0 ms pass-through row is left out: it would flatten every other
//!   point onto zero), and the mechanism's CPU per I/O beside it on a
//!   log axis, since the kthread's spin is decades above the rest.
//! - mq-run: IOPS against queue depth with dedup off and on, the upstream
//!   curves beside them; kblockd posts per I/O and ns per post; IOPS
//!   against posting threads.
//! - hybrid-poll: throughput and CPU as % of busy polling, per workload.
//! - sbitmap: counter/wait_cnt IOPS ratio per depth with upstream's ratio;
//!   wakeups per batch, wasted wakeups per batch, sleeps per I/O.
//! - mpath: each path's share of the I/O against the ideal split, in
//!   process and over remote paths (hosts in network namespaces).

use crate::plot::{num, Figure, Panel, Series, Style};
use crate::report::{LabReport, Row};
use serde_json::{json, Value};

/// The figures for `report` (none for an unknown experiment).
pub fn figures_for(report: &LabReport) -> Vec<Figure> {
    match report.experiment.as_str() {
        "delay" => vec![delay()],
        "mq-run" => vec![mq_run()],
        "hybrid-poll" => vec![hybrid_poll()],
        "sbitmap" => vec![sbitmap()],
        "mpath" => vec![mpath()],
        _ => Vec::new(),
    }
}

fn ratio(a: &'static str, b: &'static str, scale: f64) -> crate::plot::ValueFn {
    Box::new(move |r: &Row| {
        let (a, b) = (num(r, a)?, num(r, b)?);
        (b > 0.0).then_some(a / b * scale)
    })
}

fn delay() -> Figure {
    const MECHS: [(&str, &str); 4] = [
        ("timer HZ=250", "timer250"),
        ("timer HZ=1000", "timer1000"),
        ("kthread", "kthread"),
        ("hybrid (ours)", "hybrid"),
    ];
    fn pct(mech: &'static str) -> crate::plot::ValueFn {
        Box::new(move |r: &Row| {
            let iops = num(r, &format!("{mech}_iops"))?;
            let theory = num(r, "theory_iops")?;
            (theory > 0.0).then_some(iops / theory * 100.0)
        })
    }
    let mut panels = Vec::new();
    for rw in ["randread", "randwrite"] {
        let mut p = Panel::new(
            &format!("{rw} QD1: IOPS as % of 1000/delay"),
            "delay_ms",
            "delay (ms); 0 ms pass-through not drawn",
            "% of theoretical IOPS",
        );
        p.filter = vec![("rw".into(), json!(rw)), ("qd".into(), json!(1))];
        p.skip = Some(|r| num(r, "delay_ms").unwrap_or(0.0) <= 0.0);
        p.reference = Some(100.0);
        for (i, (label, mech)) in MECHS.iter().enumerate() {
            p.series.push(Series::new(label, Style::Ours, i, pct(mech)));
        }
        p.series.push(Series::new(
            "upstream timer+wq",
            Style::Upstream,
            0,
            ratio("seed_previous_iops", "seed_theory_iops", 100.0),
        ));
        p.series.push(Series::new(
            "upstream kthread",
            Style::Upstream,
            2,
            ratio("seed_kthread_iops", "seed_theory_iops", 100.0),
        ));
        let mut c = Panel::new(
            &format!("{rw} QD1: delay mechanism's CPU per I/O"),
            "delay_ms",
            "delay (ms)",
            "CPU µs per I/O (log)",
        );
        c.filter = p.filter.clone();
        c.skip = p.skip;
        c.log_y = true;
        for (i, (label, mech)) in MECHS.iter().enumerate() {
            c.series.push(Series::column(
                label,
                Style::Ours,
                i,
                &format!("{mech}_cpu_us"),
            ));
        }
        panels.push(p);
        panels.push(c);
    }
    Figure {
        suffix: String::new(),
        title: "dm-delay: accuracy (left) and CPU cost (right) of each delay mechanism".into(),
        columns: 2,
        panels,
    }
}

/// A row of a job-count sweep (reports made before the sweeps existed
/// have no `sweep` column: all their rows are depth rows).
fn in_job_sweep(r: &Row) -> bool {
    r.get("sweep").and_then(Value::as_str) == Some("jobs")
}

fn mq_run() -> Figure {
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

/// Upstream's hybrid/poll figures per workload: (throughput %, CPU %).
fn upstream_hybrid(workload: &str) -> Option<(f64, f64)> {
    match workload {
        "read" => Some((10.8 / 10.9 * 100.0, 44.0)),
        "write" => Some((6150.0 / 6175.0 * 100.0, 32.0)),
        "randread" => Some((1608.0 / 1680.0 * 100.0, 100.0)),
        "randwrite" => Some((100.0, 15.0)),
        _ => None,
    }
}

fn hybrid_poll() -> Figure {
    let upstream = |cpu: bool| -> crate::plot::ValueFn {
        Box::new(move |r: &Row| {
            let w = r.get("workload").and_then(Value::as_str)?;
            upstream_hybrid(w).map(|(t, c)| if cpu { c } else { t })
        })
    };
    let mut perf = Panel::new(
        "throughput as % of busy polling",
        "case",
        "workload and device service time",
        "% of poll's throughput",
    );
    perf.bars = true;
    perf.reference = Some(100.0);
    perf.series = vec![
        Series::new(
            "interrupt",
            Style::Ours,
            7,
            ratio("interrupt_perf", "poll_perf", 100.0),
        ),
        Series::column("hybrid (ours)", Style::Ours, 0, "hybrid_vs_poll_perf_pct"),
        Series::new("upstream hybrid", Style::Upstream, 0, upstream(false)),
    ];
    let mut cpu = Panel::new(
        "CPU as % of busy polling's",
        "case",
        "workload and device service time",
        "% of poll's CPU",
    );
    cpu.bars = true;
    cpu.reference = Some(30.0);
    cpu.series = vec![
        Series::new(
            "interrupt",
            Style::Ours,
            7,
            ratio("interrupt_cpu_pct", "poll_cpu_pct", 100.0),
        ),
        Series::column("hybrid (ours)", Style::Ours, 0, "hybrid_vs_poll_cpu_pct"),
        Series::new("upstream hybrid", Style::Upstream, 0, upstream(true)),
    ];
    Figure {
        suffix: String::new(),
        title: "io_uring hybrid polling: poll's throughput at a fraction of its CPU (dotted: 100 %, 30 %)"
            .into(),
        columns: 1,
        panels: vec![perf, cpu],
    }
}

fn sbitmap() -> Figure {
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

/// A row of `lab mpath`'s remote-paths table (hosts in namespaces).
fn remote_path_row(r: &Row) -> bool {
    r.get("table").and_then(Value::as_str) == Some(crate::mpath_hosts::TABLE)
}

fn mpath() -> Figure {
    let mut p = Panel::new(
        "share of I/O per path (path cost in the table)",
        "path",
        "path",
        "share of completed I/O",
    );
    p.bars = true;
    p.skip = Some(remote_path_row);
    p.series = vec![
        Series::column("ideal", Style::Ours, 7, "ideal"),
        Series::column("service-time", Style::Ours, 2, "st"),
        Series::column("HST jiffies (old)", Style::Ours, 3, "hst_jiffies"),
        Series::column("HST ns", Style::Ours, 0, "hst_ns"),
        Series::column("upstream HST orig", Style::Upstream, 3, "seed_hst_orig"),
        Series::column("upstream HST ktime", Style::Upstream, 0, "seed_hst_ktime"),
    ];
    let mut remote = Panel::new(
        "remote paths: share of I/O per host (NBD over veth; remote delay in the table)",
        "path",
        "host",
        "share of completed I/O",
    );
    remote.bars = true;
    remote.filter = vec![("table".into(), json!(crate::mpath_hosts::TABLE))];
    remote.series = vec![
        Series::column("ideal", Style::Ours, 7, "ideal"),
        Series::column("service-time", Style::Ours, 2, "st"),
        Series::column("HST jiffies (old)", Style::Ours, 3, "hst_jiffies"),
        Series::column("HST ns", Style::Ours, 0, "hst_ns"),
    ];
    Figure {
        suffix: String::new(),
        title: "dm-mpath HST: per-path share with jiffies vs ns start times, in process and over remote paths".into(),
        columns: 1,
        panels: vec![p, remote],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_experiment_has_a_figure_and_unknown_has_none() {
        for e in crate::EXPERIMENTS {
            let r = LabReport::new(e.name, "t", &[]);
            assert!(!figures_for(&r).is_empty(), "{}", e.name);
        }
        assert!(figures_for(&LabReport::new("nope", "t", &[])).is_empty());
    }

    #[test]
    fn delay_leaves_out_the_zero_row_and_draws_percent_of_theory() {
        let mut r = LabReport::new("delay", "t", &[]);
        for (d, theory, hybrid) in [(0.0, None, 1.0e6), (1.0, Some(1000.0), 990.0)] {
            r.push_row([
                ("rw", json!("randread")),
                ("qd", json!(1)),
                ("delay_ms", json!(d)),
                ("theory_iops", json!(theory)),
                ("hybrid_iops", json!(hybrid)),
                ("hybrid_cpu_us", json!(40.0)),
                ("seed_theory_iops", json!(theory)),
                ("seed_kthread_iops", json!(theory.map(|t| t / 2.0))),
            ]);
        }
        let fig = &figures_for(&r)[0];
        let svg = crate::plot::render_svg(fig, &r.rows).unwrap();
        assert!(svg.contains("upstream kthread"));
        assert!(!svg.lines().any(|l| l.trim() == "0.000"), "0 ms row drawn");
        // randwrite panels have no rows: said so, not dropped.
        assert!(svg.contains("no data in this run"));
    }
}
