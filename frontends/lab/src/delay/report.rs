//! `lab delay`'s report: a QD1 point's row, the claims checked on each
//! point, the notes on the machine's sleep and wake floors, and the
//! figure (criterion's report half; the measurement is in the parent
//! module).

use super::*;

/// A QD1 point's row, with upstream's figures where it published some.
pub(super) fn qd1_row(p: &Point) -> Row {
    let d = p.delay;
    let theory = if d > 0.0 { Some(1000.0 / d) } else { None };
    let seed = SEED
        .iter()
        .find(|s| s.0 == rw_name(p.rw) && f64::from(s.1) == d);
    let split = |x: f64| (d > 0.0).then(|| round(x / 1000.0, 1));
    Row {
        theory_iops: theory.map(|t| round(t, 1)),
        hybrid_pct_of_theory: theory.map(|t| round(p.iops[HYBRID] / t * 100.0, 2)),
        hybrid_late_us: split(p.late),
        hybrid_turn_us: Some(split(p.turn)),
        hybrid_spin_us: split(p.spin),
        seed_theory_iops: Some(seed.map(|s| s.2)),
        seed_previous_iops: Some(seed.map(|s| s.3)),
        seed_kthread_iops: Some(seed.map(|s| s.4)),
        ..Row::per_mode(rw_name(p.rw), 1, d, &p.iops, &p.cpu)
    }
}

/// The run times, the floors under any sleeping design, the job's settings.
pub(super) fn floor_notes(cfg: &Config, m: &Measurement) -> Vec<String> {
    let (sleep_cpu_ns, sleep_late) = m.sleep_floor;
    let wake_text = |w: Option<([f64; 2], f64)>| {
        match w {
        Some((l, c)) => format!(
            "submitter woke p50 {:.1} / p90 {:.1} µs after the notify, worker CPU {:.1} µs per round",
            l[0] / 1000.0,
            l[1] / 1000.0,
            c / 1000.0
        ),
        None => "not measured (no second CPU to pin to)".into(),
    }
    };
    let setup = &cfg.setup;
    vec![
        format!(
            "QD1 run times: {} per point; hybrid CPU at 1 ms is the median of {} runs: {:?} µs",
            if cfg.quick {
                "max(0.3 s, 50 x delay)"
            } else {
                "max(1 s, 100 x delay)"
            },
            m.hybrid_1ms.len(),
            m.hybrid_1ms
                .iter()
                .map(|h| round(h.0 / 1000.0, 2))
                .collect::<Vec<_>>()
        ),
        format!(
            "on this machine one absolute 1 ms sleep and its wake-up cost {:.1} µs of thread CPU (median of 200) and woke late by p50 {:.0} / p90 {:.0} / p99 {:.0} µs; \
             hybrid at QD1 sleeps once per I/O in the delay worker (and once in the bench job), so that is its CPU floor, and a worker that sleeps to the deadline itself would be that late",
            sleep_cpu_ns / 1000.0,
            sleep_late[0] / 1000.0,
            sleep_late[1] / 1000.0,
            sleep_late[2] / 1000.0
        ),
        format!(
            "floor of a worker that sleeps 1 ms then wakes a blocked submitter (200 rounds): same CPU: {}; other CPU: {}. \
             At QD1 the period is at least delay + that wake + the resubmission, and the worker's CPU at least that round",
            wake_text(m.local_wake),
            wake_text(m.remote_wake)
        ),
        format!(
            "bench job: wait={}, cpus_allowed={}; extra hybrid table options: {}",
            setup.wait.as_deref().unwrap_or("interrupt"),
            setup.cpus_allowed.as_deref().unwrap_or("(any)"),
            if setup.hybrid_extra.is_empty() {
                "(none)"
            } else {
                &setup.hybrid_extra
            }
        ),
        "CPU per I/O is process CPU (bench job thread + delay workers) over completed I/Os; \
         at delay 0 every mode passes bios straight through"
            .to_string(),
    ]
}

/// The claims on one QD1 point.
pub(super) fn point_checks(p: &Point) -> Vec<Check> {
    let (rw, d, iops, cpu) = (rw_name(p.rw), p.delay, &p.iops, &p.cpu);
    let h = HYBRID;
    let mut checks = Vec::new();
    if [1.0, 2.0, 5.0, 10.0, 20.0].contains(&d) {
        let theory = 1000.0 / d;
        checks.push(check(
            format!("{rw} {d} ms: hybrid QD1 >= 99% of theoretical"),
            iops[h] >= 0.99 * theory,
            format!(
                "hybrid {:.1} IOPS = {:.2}% of {theory:.1}",
                iops[h],
                iops[h] / theory * 100.0
            ),
        ));
    }
    if d > 0.0 && d <= 2.0 {
        let theory = 1000.0 / d;
        checks.push(check(
            format!("{rw} {d} ms: timer mode loses IOPS (upstream's 'previous')"),
            iops[0] < 0.9 * theory && iops[1] < 0.9 * theory,
            format!(
                "timer HZ=250 {:.1}, HZ=1000 {:.1} of {theory:.1} IOPS",
                iops[0], iops[1]
            ),
        ));
    }
    if d >= 5.0 {
        checks.push(check(
            format!("{rw} {d} ms: kthread burns CPU, hybrid does not"),
            cpu[2] >= 10.0 * cpu[h],
            format!(
                "kthread {:.1} µs vs hybrid {:.1} µs CPU per I/O",
                cpu[2] / 1000.0,
                cpu[h] / 1000.0
            ),
        ));
    }
    if d > 0.0 {
        // Hybrid beats timer outright, and kthread in CPU at no loss
        // of IOPS beyond noise (0.5%).
        let beats_timer = iops[h] >= iops[0].max(iops[1]);
        let keeps_kthread_iops = iops[h] >= 0.995 * iops[2];
        let cheaper = cpu[h] <= cpu[2];
        checks.push(check(
            format!("{rw} {d} ms: hybrid beats timer and kthread"),
            beats_timer && keeps_kthread_iops && cheaper,
            format!(
                "IOPS hybrid {:.1} / timer {:.1} / kthread {:.1}; CPU µs hybrid {:.1} / kthread {:.1}",
                iops[h],
                iops[0].max(iops[1]),
                iops[2],
                cpu[h] / 1000.0,
                cpu[2] / 1000.0
            ),
        ));
    }
    checks
}

/// % of the theoretical QD1 IOPS per mechanism against the delay (the
/// 0 ms pass-through row left out: it would flatten every other point
/// onto zero), and the mechanism's CPU per I/O beside it on a log axis,
/// since the kthread's spin is decades above the rest.
pub(super) fn figure() -> Figure {
    const MECHS: [(&str, &str); 4] = [
        ("timer HZ=250", "timer250"),
        ("timer HZ=1000", "timer1000"),
        ("kthread", "kthread"),
        ("hybrid (ours)", "hybrid"),
    ];
    fn pct(mech: &'static str) -> crate::plot::ValueFn {
        Box::new(move |r: &ReportRow| {
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
