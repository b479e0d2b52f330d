//! `lab hybrid-poll`'s report: the table's rows, the claim checked on
//! each point, the notes and the figure, made from the measured rounds
//! (criterion's report half; the measurement is in the parent module).

use super::*;

pub(super) const COLUMNS: [&str; 25] = [
    "case",
    "workload",
    "service_us",
    "jobs",
    "iodepth",
    "unit",
    "interrupt_perf",
    "interrupt_cpu_pct",
    "poll_perf",
    "poll_cpu_pct",
    "hybrid_perf",
    "hybrid_cpu_pct",
    "hybrid_vs_poll_perf_pct",
    "hybrid_vs_poll_cpu_pct",
    "hybrid_vs_poll_perf_pct_range",
    "hybrid_vs_poll_cpu_pct_range",
    "poll_perf_spread_pct",
    "hybrid_perf_spread_pct",
    "interrupt_thread_cpu_pct",
    "poll_thread_cpu_pct",
    "hybrid_thread_cpu_pct",
    "poll_lat_us",
    "hybrid_lat_us",
    "poll_disk_spin_pct",
    "hybrid_disk_spin_pct",
];

/// A point's row.
pub(super) fn row(cfg: &Config, p: &Point) -> Row {
    let r = p.reduce();
    let (int, poll, hyb) = (r.int, r.poll, r.hyb);
    let svc_us = p.service_us();
    let ((perf_lo, perf_hi), (cpu_lo, cpu_hi)) = (r.perf_range, r.cpu_range);
    Row {
        case: format!("{} {}us", p.w.name, svc_us),
        workload: p.w.name.to_string(),
        service_us: round(svc_us, 1),
        jobs: p.jobs,
        iodepth: cfg.iodepth,
        unit: p.unit().to_string(),
        interrupt_perf: round(int.perf, 1),
        interrupt_cpu_pct: round(int.cpu_per_job_pct, 1),
        poll_perf: round(poll.perf, 1),
        poll_cpu_pct: round(poll.cpu_per_job_pct, 1),
        hybrid_perf: round(hyb.perf, 1),
        hybrid_cpu_pct: round(hyb.cpu_per_job_pct, 1),
        hybrid_vs_poll_perf_pct: round(r.perf_ratio * 100.0, 1),
        hybrid_vs_poll_cpu_pct: round(r.cpu_ratio * 100.0, 1),
        hybrid_vs_poll_perf_pct_range: format!("{perf_lo:.0}-{perf_hi:.0}"),
        hybrid_vs_poll_cpu_pct_range: format!("{cpu_lo:.0}-{cpu_hi:.0}"),
        poll_perf_spread_pct: round(perf_spread_pct(&p.runs[1]), 1),
        hybrid_perf_spread_pct: round(perf_spread_pct(&p.runs[2]), 1),
        interrupt_thread_cpu_pct: round(int.job_thread_cpu_pct, 1),
        poll_thread_cpu_pct: round(poll.job_thread_cpu_pct, 1),
        hybrid_thread_cpu_pct: round(hyb.job_thread_cpu_pct, 1),
        poll_lat_us: round(poll.mean_lat_us, 1),
        hybrid_lat_us: round(hyb.mean_lat_us, 1),
        poll_disk_spin_pct: round(poll.disk_spin_pct, 1),
        hybrid_disk_spin_pct: round(hyb.disk_spin_pct, 1),
    }
}

/// The claim on one point: hybrid keeps 97 % of poll's figure at 30 %
/// of its CPU (medians of the paired rounds).
pub(super) fn point_check(p: &Point) -> Check {
    let r = p.reduce();
    let (int, poll, hyb) = (r.int, r.poll, r.hyb);
    let (name, svc_us, unit) = (p.w.name, p.service_us(), p.unit());
    let ((perf_lo, perf_hi), (cpu_lo, cpu_hi)) = (r.perf_range, r.cpu_range);
    let pass = r.perf_ratio >= MIN_PERF_RATIO && r.cpu_ratio <= MAX_CPU_RATIO;
    check(
        format!("{name} {svc_us}us: hybrid >= 97% of poll's {unit} at <= 30% of poll's CPU"),
        pass,
        format!(
            "hybrid {:.1} {unit} at {:.1}% CPU/job vs poll {:.1} {unit} at {:.1}% CPU/job (medians): {:.1}% of poll's {unit} (need >= 97%), {:.1}% of poll's CPU (need <= 30%) (medians of {} paired rounds, ranges {perf_lo:.0}-{perf_hi:.0}% and {cpu_lo:.0}-{cpu_hi:.0}%); interrupt {:.1} {unit} at {:.1}% CPU/job; poll's job threads ran {:.0}% of the time (a spinner given the whole CPU runs ~100%: less means other processes took it, which shrinks poll's CPU and so raises hybrid's share of it)",
            hyb.perf,
            hyb.cpu_per_job_pct,
            poll.perf,
            poll.cpu_per_job_pct,
            r.perf_ratio * 100.0,
            r.cpu_ratio * 100.0,
            r.rounds,
            int.perf,
            int.cpu_per_job_pct,
            poll.job_thread_cpu_pct
        ),
    )
}

/// The device, the settings, the load, and how to read the columns.
pub(super) fn notes(cfg: &Config, m: &Measurement) -> Vec<String> {
    let contended: Vec<String> = m
        .points
        .iter()
        .filter(|p| p.service_ns >= CLAIM_MIN_SERVICE_NS)
        .filter_map(|p| {
            let poll = p.reduce().poll;
            (poll.job_thread_cpu_pct < CONTENDED_POLL_THREAD_PCT).then(|| {
                format!(
                    "{} {}us ({:.0}%)",
                    p.w.name,
                    p.service_us(),
                    poll.job_thread_cpu_pct
                )
            })
        })
        .collect();
    let device = stack(&cfg.backend, cfg.services[0], cfg.tags, &cfg.disk)
        .unwrap_or_default()
        .trim()
        .replace('\n', " | ");
    let mut notes = vec![
        format!(
            "device: {device}; iodepth {}; sequential jobs 1 thread, random jobs {} threads (upstream used 16 on 8 cores; this machine has {} CPUs); {} round(s) of {} ms per point (modes interleaved, order rotated), medians shown, checks on the median of per-round hybrid/poll ratios",
            cfg.iodepth,
            cfg.many_jobs,
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            cfg.repeats,
            cfg.runtime.as_millis()
        ),
        format!(
            "hybrid sleeps {}% of the {} completion time seen, counted from the oldest in-flight submission, then polls (--set hybrid_sleep_pct=, hybrid_estimator=min|ewma); upstream IORING_SETUP_HYBRID_IOPOLL sleeps 50% of the minimum, counted from each request's first poll",
            cfg.hybrid.hybrid_sleep_pct,
            match cfg.hybrid.hybrid_estimator {
                HybridEstimator::Min => "shortest",
                HybridEstimator::Ewma => "moving-average",
            }
        ),
    ];
    if !contended.is_empty() {
        notes.push(format!(
            "measured under contention: at {} of the checked points poll's job threads ran under {CONTENDED_POLL_THREAD_PCT:.0}% of the time ({}); a poller only gets its fair share of a busy machine, so there poll's CPU, the CPU check's denominator, reflects the load rather than what polling costs",
            contended.len(),
            contended.join(", ")
        ));
    }
    notes.push(format!(
        "load average (1/5/15 min) before the run: {}; anything above the CPU count means other processes competed with the jobs for CPU",
        m.load_before.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    ));
    notes.push("perf columns are MB/s (10^6 B/s) for read/write and kIOPS for randread/randwrite; *_cpu_pct is process CPU over wall time divided by the job count, less the emulated disk's spin towards its deadlines (with --set timer_spin_ns=N; *_disk_spin_pct shows it, in % of one CPU), which a real disk's clock does not cost the host; *_thread_cpu_pct is the job threads' own CPU".to_string());
    notes.push("read rows: the null device runs with zero_reads=0 (null_blk's own behaviour: the read buffer is not touched), because a real NVMe disk DMAs the data and upstream's host CPU never touches it; with zero-filled reads (the null default) the job thread copies 128 KiB per read in every wait mode and no wait strategy can save that CPU.".to_string());
    notes.push("hybrid can only save CPU when the job thread has time to wait: when the service time is shorter than the CPU cost of keeping iodepth I/Os moving, every mode is CPU-bound and all three spend about the same CPU (upstream's randread row shows the same: 100% for both)".to_string());
    notes
}

/// Upstream's hybrid/poll figures per workload: (throughput %, CPU %).
pub(super) fn upstream_hybrid(workload: &str) -> Option<(f64, f64)> {
    match workload {
        "read" => Some((10.8 / 10.9 * 100.0, 44.0)),
        "write" => Some((6150.0 / 6175.0 * 100.0, 32.0)),
        "randread" => Some((1608.0 / 1680.0 * 100.0, 100.0)),
        "randwrite" => Some((100.0, 15.0)),
        _ => None,
    }
}

pub(super) fn figure() -> Figure {
    let upstream = |cpu: bool| -> crate::plot::ValueFn {
        Box::new(move |r: &ReportRow| {
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
