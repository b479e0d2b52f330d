//! fio's `--output-format=terse`: one semicolon-separated line per job,
//! field for field as fio's `show_thread_status_terse_all` writes it
//! (versions 3, 4 and 5 via `--terse-version`; fio's default is 3).
//!
//! Per direction: KiB done, KiB/s, IOPS, runtime ms; slat, clat (with
//! twenty `P%=usec` percentile slots) and lat as min;max;mean;stdev in
//! microseconds; bandwidth min;max;share of the group;mean;stdev (and, in
//! version 5, samples and IOPS statistics). Then CPU, the seven I/O depth
//! levels and the microsecond and millisecond latency distributions. As
//! in the other formats, slat is zero (not separated in process) and lat
//! repeats clat.

use crate::output::latency_rows;
use crate::stats::{sample_stats, BenchReport, DirStats, JobResult, LatStats};
use std::fmt::Write as _;

/// fio's fixed number of percentile slots.
const PERCENTILE_SLOTS: usize = 20;

fn lat_fields(out: &mut String, l: &LatStats) {
    if l.samples == 0 {
        out.push_str(";0;0;0.000000;0.000000");
    } else {
        let _ = write!(
            out,
            ";{};{};{:.6};{:.6}",
            l.min() / 1000,
            l.max_ns / 1000,
            l.mean() / 1000.0,
            l.stddev() / 1000.0
        );
    }
}

fn ddir_fields(out: &mut String, d: &DirStats, agg_bytes: u64, plist: &[f64], ver: u32) {
    let runt = d.runtime_ms();
    let bw = (d.io_bytes * 1000).checked_div(runt).unwrap_or(0) / 1024;
    let iops = (d.total_ios * 1000).checked_div(runt).unwrap_or(0);
    let _ = write!(out, ";{};{bw};{iops};{runt}", d.io_bytes >> 10);
    lat_fields(out, &LatStats::default());
    lat_fields(out, &d.clat);
    let pcts = if d.clat.samples > 0 {
        d.clat.percentiles_of(plist)
    } else {
        Vec::new()
    };
    for i in 0..PERCENTILE_SLOTS {
        match pcts.get(i) {
            Some((p, v)) => {
                let _ = write!(out, ";{p:.6}%={}", v / 1000);
            }
            None => out.push_str(";0%=0"),
        }
    }
    lat_fields(out, &d.clat);
    let bw_stat = sample_stats(&d.bw_samples);
    match bw_stat {
        Some((min, max, mean, dev)) => {
            let agg_kib = agg_bytes / 1024;
            let share = if agg_kib > 0 {
                (mean * 100.0 / agg_kib as f64).min(100.0)
            } else {
                100.0
            };
            let _ = write!(out, ";{min};{max};{share:.6}%;{mean:.6};{dev:.6}");
        }
        None => out.push_str(";0;0;0.000000%;0.000000;0.000000"),
    }
    if ver == 5 {
        let _ = write!(out, ";{}", d.bw_samples.len());
        match sample_stats(&d.iops_samples) {
            Some((min, max, mean, dev)) => {
                let _ = write!(
                    out,
                    ";{min};{max};{mean:.6};{dev:.6};{}",
                    d.iops_samples.len()
                );
            }
            None => out.push_str(";0;0;0.000000;0.000000;0"),
        }
    }
}

fn job_line(out: &mut String, report: &BenchReport, job: &JobResult, ver: u32) {
    let group = report.groups.iter().find(|g| g.groupid == job.groupid);
    let agg = |f: fn(&crate::stats::GroupStats) -> u64| group.map(f).unwrap_or(0);
    let _ = write!(
        out,
        "{ver};{};{};{};{}",
        report.version, job.name, job.groupid, job.error
    );
    let plist = &job.spec.percentile_list;
    ddir_fields(out, &job.read, agg(|g| g.read.agg_bw), plist, ver);
    ddir_fields(out, &job.write, agg(|g| g.write.agg_bw), plist, ver);
    if ver >= 4 {
        ddir_fields(out, &job.trim, agg(|g| g.trim.agg_bw), plist, ver);
    }
    let _ = write!(
        out,
        ";{:.6}%;{:.6}%;{};{};{}",
        job.usr_cpu_pct(),
        job.sys_cpu_pct(),
        job.ctx,
        job.majf,
        job.minf
    );
    let depth_total: u64 = job.depths.depth.iter().sum();
    for c in job.depths.depth {
        let p = if depth_total == 0 {
            0.0
        } else {
            c as f64 * 100.0 / depth_total as f64
        };
        let _ = write!(out, ";{p:3.1}%");
    }
    let total = (job.read.clat.samples + job.write.clat.samples + job.trim.clat.samples).max(1);
    let rows = latency_rows(job);
    let nsec: u64 = rows[0].1.iter().map(|c| c.1).sum();
    for (i, (_, c)) in rows[1].1.iter().enumerate() {
        // fio's stat_calc_lat_nu: nanosecond latencies count as the first
        // microsecond bucket.
        let c = if i == 0 { c + nsec } else { *c };
        let _ = write!(out, ";{:3.2}%", c as f64 * 100.0 / total as f64);
    }
    for (_, c) in &rows[2].1 {
        let _ = write!(out, ";{:3.2}%", *c as f64 * 100.0 / total as f64);
    }
    if job.spec.continue_on_error {
        let errors = job.read.errors + job.write.errors + job.trim.errors;
        let _ = write!(out, ";{errors};{}", job.error);
    }
    out.push('\n');
}

/// Render a report as fio's terse lines (`ver` 3, 4 or 5).
pub fn write_terse(report: &BenchReport, ver: u32) -> String {
    let mut out = String::new();
    for job in &report.jobs {
        job_line(&mut out, report, job, ver);
    }
    out
}
