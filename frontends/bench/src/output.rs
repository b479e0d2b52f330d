//! fio's normal text report, from a [`BenchReport`] ([`crate::output_json`]
//! writes the JSON ones).
//!
//! The normal text follows fio 3.x `stat.c` (`show_thread_status_normal`,
//! `show_ddir_status`, `show_clat_percentiles`, `show_latencies`,
//! `show_group_stats`) and its number formatting (`num2str`), so tools and
//! eyes used to fio read it unchanged. The JSON follows fio's
//! `--output-format=json` field names and nesting; blkstack adds
//! `verify_errors`, `verify_checked`, `device` and `wait` per job.
//!
//! What blkstack does not measure is reported as fio reports an unmeasured
//! value: `slat_ns` has `N: 0` (the clock is read once at submission, so
//! submission latency is not separated), and `lat_ns` carries the same
//! samples as `clat_ns`.

use crate::stats::{sample_stats, BenchReport, DirStats, GroupDir, JobResult, LatStats};
use std::fmt::Write as _;

/// Units `num2str` appends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    None,
    PerSec,
    Byte,
    BytePerSec,
}

/// fio's `num2str`: at most `maxlen` digits, scaled by 1000 or 1024 with
/// SI or IEC prefixes, with fio's rounding quirks.
pub fn num2str(num: u64, maxlen: usize, base: u64, pow2: bool, unit: Unit) -> String {
    const SI: [&str; 6] = ["", "k", "M", "G", "T", "P"];
    const IEC: [&str; 6] = ["", "Ki", "Mi", "Gi", "Ti", "Pi"];
    let prefixes = if pow2 { &IEC } else { &SI };
    let thousand: u64 = if pow2 { 1024 } else { 1000 };
    let unit_str = match unit {
        Unit::None => "",
        Unit::PerSec => "/s",
        Unit::Byte => "B",
        Unit::BytePerSec => "B/s",
    };
    let mut post_index = 0usize;
    let mut b = base;
    while b > 1 {
        b /= thousand;
        post_index += 1;
    }
    let mut num = num;
    let mut modulo: Option<u64> = None;
    let mut carry = false;
    while post_index < prefixes.len() {
        if digits(num) <= maxlen {
            break;
        }
        let m = num % thousand;
        num /= thousand;
        carry = m >= thousand / 2;
        modulo = Some(m);
        post_index += 1;
    }
    let done = |num: u64, post_index: usize| {
        let p = if post_index >= prefixes.len() {
            0
        } else {
            post_index
        };
        format!("{num}{}{unit_str}", prefixes[p])
    };
    let Some(m) = modulo else {
        return done(num, post_index);
    };
    let len = digits(num);
    if (maxlen as i64 - len as i64) <= 1 {
        if carry {
            num += 1;
        }
        return done(num, post_index);
    }
    let decimals = maxlen - len - 1;
    let frac = format!("{:.*}", decimals, m as f64 / thousand as f64);
    // fio prints the digits after "0." (a quirk it keeps: 0.999.. -> "00").
    let frac_digits = frac.get(2..).unwrap_or("");
    let p = if post_index >= prefixes.len() {
        0
    } else {
        post_index
    };
    format!("{num}.{frac_digits}{}{unit_str}", prefixes[p])
}

fn digits(n: u64) -> usize {
    let mut d = 1;
    let mut v = n;
    while v >= 10 {
        v /= 10;
        d += 1;
    }
    d
}

/// Render a report as fio's normal text.
pub fn write_normal(report: &BenchReport) -> String {
    let mut out = String::new();
    for job in &report.jobs {
        write_job_normal(&mut out, report, job);
    }
    for g in &report.groups {
        let _ = writeln!(out, "\nRun status group {} (all jobs):", g.groupid);
        for (label, d) in [
            ("   READ", &g.read),
            ("  WRITE", &g.write),
            ("   TRIM", &g.trim),
        ] {
            if d.max_run_ms == 0 {
                continue;
            }
            write_group_dir(&mut out, label, d);
        }
    }
    out
}

/// The lines fio prints before starting: one per job, version, count.
pub fn write_normal_header(jobs: &[crate::spec::JobSpec]) -> String {
    let mut out = String::new();
    let mut groupid = 0u32;
    let mut threads = 0u32;
    for (i, j) in jobs.iter().enumerate() {
        if i > 0 && (j.stonewall || j.new_group) {
            groupid += 1;
        }
        threads += j.numjobs;
        let [r, w, t] = [0, 1, 2].map(|d| j.bs_for(d).range_text());
        let _ = write!(
            out,
            "{}: (g={groupid}): rw={}, bs=(R) {r}, (W) {w}, (T) {t}, ioengine=blkstack({}), iodepth={}, wait={}",
            j.name,
            j.rw.name(),
            j.ioengine,
            j.iodepth,
            j.wait.name()
        );
        if !j.not_applicable.is_empty() {
            let _ = write!(out, ", not applicable: {}", j.not_applicable.join(" "));
        }
        out.push('\n');
    }
    let _ = writeln!(out, "blkstack-{}", env!("CARGO_PKG_VERSION"));
    let _ = writeln!(
        out,
        "Starting {threads} thread{}",
        if threads == 1 { "" } else { "s" }
    );
    out
}

fn write_group_dir(out: &mut String, label: &str, d: &GroupDir) {
    let _ = writeln!(
        out,
        "{label}: bw={} ({}), {}-{} ({}-{}), io={} ({}), run={}-{}msec",
        num2str(d.agg_bw, 4, 1, true, Unit::BytePerSec),
        num2str(d.agg_bw, 4, 1, false, Unit::BytePerSec),
        num2str(d.min_bw, 4, 1, true, Unit::BytePerSec),
        num2str(d.max_bw, 4, 1, true, Unit::BytePerSec),
        num2str(d.min_bw, 4, 1, false, Unit::BytePerSec),
        num2str(d.max_bw, 4, 1, false, Unit::BytePerSec),
        num2str(d.io_bytes, 4, 1, true, Unit::Byte),
        num2str(d.io_bytes, 4, 1, false, Unit::Byte),
        d.min_run_ms,
        d.max_run_ms
    );
}

pub(crate) fn ctime_now() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as libc::time_t)
        .unwrap_or(0);
    let mut buf = [0 as libc::c_char; 64];
    // SAFETY: ctime_r writes at most 26 bytes into a 64-byte buffer.
    let p = unsafe { libc::ctime_r(&t, buf.as_mut_ptr()) };
    if p.is_null() {
        return "\n".to_string();
    }
    // SAFETY: ctime_r returned a NUL-terminated string in `buf`.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn strerror(errno: i32) -> String {
    let s = std::io::Error::from_raw_os_error(errno).to_string();
    match s.find(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

fn write_job_normal(out: &mut String, report: &BenchReport, job: &JobResult) {
    let pid = std::process::id();
    if job.error == 0 {
        let _ = write!(
            out,
            "{}: (groupid={}, jobs={}): err={:2}: pid={pid}: {}",
            job.name,
            job.groupid,
            job.members,
            job.error,
            ctime_now()
        );
    } else {
        let _ = write!(
            out,
            "{}: (groupid={}, jobs={}): err={:2} ({}): pid={pid}: {}",
            job.name,
            job.groupid,
            job.members,
            job.error,
            strerror(job.error),
            ctime_now()
        );
    }
    let group = report.groups.iter().find(|g| g.groupid == job.groupid);
    for (name, d, agg) in [
        ("read", &job.read, group.map(|g| g.read.agg_bw).unwrap_or(0)),
        (
            "write",
            &job.write,
            group.map(|g| g.write.agg_bw).unwrap_or(0),
        ),
        ("trim", &job.trim, group.map(|g| g.trim.agg_bw).unwrap_or(0)),
    ] {
        if d.io_bytes > 0 {
            write_dir_normal(out, name, d, agg, &job.spec.percentile_list);
        }
    }
    write_latency_distribution(out, job);
    let _ = writeln!(
        out,
        "  cpu          : usr={:.2}%, sys={:.2}%, ctx={}, majf={}, minf={}",
        job.usr_cpu_pct(),
        job.sys_cpu_pct(),
        job.ctx,
        job.majf,
        job.minf
    );
    let dist = |v: &[u64; 7]| -> [f64; 7] {
        let total: u64 = v.iter().sum();
        let mut r = [0.0; 7];
        for i in 0..7 {
            if total > 0 {
                r[i] = v[i] as f64 * 100.0 / total as f64;
                if r[i] < 0.1 && v[i] > 0 {
                    r[i] = 0.1;
                }
            }
        }
        r
    };
    let d = dist(&job.depths.depth);
    let _ = writeln!(
        out,
        "  IO depths    : 1={:.1}%, 2={:.1}%, 4={:.1}%, 8={:.1}%, 16={:.1}%, 32={:.1}%, >=64={:.1}%",
        d[0], d[1], d[2], d[3], d[4], d[5], d[6]
    );
    for (label, v) in [
        ("submit", &job.depths.submit),
        ("complete", &job.depths.complete),
    ] {
        let d = dist(v);
        let _ = writeln!(
            out,
            "     {label:<9} : 0={:.1}%, 4={:.1}%, 8={:.1}%, 16={:.1}%, 32={:.1}%, 64={:.1}%, >=64={:.1}%",
            d[0], d[1], d[2], d[3], d[4], d[5], d[6]
        );
    }
    write_issued_normal(out, job);
    if job.spec.verify != crate::spec::VerifyMode::None {
        let _ = writeln!(
            out,
            "  verify       : checked={}, errors={}",
            job.verify_checked, job.verify_errors
        );
    }
}

/// fio's `issued rwts` and `latency` lines (and whether steady state
/// ended the job).
fn write_issued_normal(out: &mut String, job: &JobResult) {
    let _ = writeln!(
        out,
        "     issued rwts: total={},{},{},0 short={},{},{},0 dropped={},{},{},0",
        job.read.total_ios + job.read.errors,
        job.write.total_ios + job.write.errors,
        job.trim.total_ios + job.trim.errors,
        job.read.short_ios,
        job.write.short_ios,
        job.trim.short_ios,
        job.read.drop_ios,
        job.write.drop_ios,
        job.trim.drop_ios
    );
    let (target, window, pct) = job.spec.latency_target.as_ref().map_or((0, 0, 100.0), |t| {
        (
            t.target.as_micros() as u64,
            t.window.as_micros() as u64,
            t.percentile,
        )
    });
    let _ = writeln!(
        out,
        "     latency   : target={target}, window={window}, percentile={pct:.2}%, depth={}",
        job.spec.iodepth
    );
    if job.steady_attained {
        let _ = writeln!(out, "  steadystate  : attained");
    }
}

/// fio's `per=`: this job's mean bandwidth as a share of its group's
/// aggregate (`convert_agg_kbytes_percent`).
pub(crate) fn percent_of_agg(mean_kib: f64, agg_bytes: u64) -> f64 {
    if agg_bytes > 1024 {
        (mean_kib * 100.0 / (agg_bytes as f64 / 1024.0)).min(100.0)
    } else {
        100.0
    }
}

fn write_dir_normal(out: &mut String, name: &str, d: &DirStats, agg_bytes: u64, plist: &[f64]) {
    let runt = d.runtime_ms().max(1);
    let bw = (d.io_bytes as u128 * 1000 / runt as u128) as u64;
    let iops = (d.total_ios as u128 * 1000 / runt as u128) as u64;
    let _ = writeln!(
        out,
        "  {name}: IOPS={}, BW={} ({})({}/{}msec)",
        num2str(iops, 4, 1, false, Unit::None),
        num2str(bw, 4, 1, true, Unit::BytePerSec),
        num2str(bw, 4, 1, false, Unit::BytePerSec),
        num2str(d.io_bytes, 4, 1, true, Unit::Byte),
        d.runtime_ms()
    );
    display_lat(out, "clat", &d.clat);
    display_lat(out, " lat", &d.clat);
    write_percentiles(out, "clat", &d.clat, plist);
    if let Some((min, max, mean, dev)) = sample_stats(&d.bw_samples) {
        let per = percent_of_agg(mean, agg_bytes);
        let (mut min, mut max, mut mean, mut dev) = (min as f64, max as f64, mean, dev);
        let mut unit = "KiB";
        if mean > 1024.0 * 1024.0 {
            min /= 1024.0;
            max /= 1024.0;
            mean /= 1024.0;
            dev /= 1024.0;
            unit = "MiB";
        }
        let _ = writeln!(
            out,
            "   bw ({unit:>5}/s): min={:5}, max={:5}, per={per:3.2}%, avg={mean:5.02}, stdev={dev:5.02}, samples={}",
            min as u64,
            max as u64,
            d.bw_samples.len()
        );
    }
    if let Some((min, max, mean, dev)) = sample_stats(&d.iops_samples) {
        let _ = writeln!(
            out,
            "   iops        : min={min:5}, max={max:5}, avg={mean:5.02}, stdev={dev:5.02}, samples={}",
            d.iops_samples.len()
        );
    }
}

/// fio's `display_lat`: unit chosen by `nsec_to_usec`/`nsec_to_msec`.
fn display_lat(out: &mut String, name: &str, l: &LatStats) {
    if l.samples == 0 {
        return;
    }
    let (mut min, mut max, mut mean, mut dev) = (l.min(), l.max_ns, l.mean(), l.stddev());
    let mut base = "(nsec)";
    if min > 2_000_000 && max > 99_999_999 && dev > 1_000_000.0 {
        min /= 1_000_000;
        max /= 1_000_000;
        mean /= 1e6;
        dev /= 1e6;
        base = "(msec)";
    } else if min > 2000 && max > 99_999 && dev > 1000.0 {
        min /= 1000;
        max /= 1000;
        mean /= 1e3;
        dev /= 1e3;
        base = "(usec)";
    }
    let _ = writeln!(
        out,
        "    {name} {base}: min={}, max={}, avg={:5.02}, stdev={:5.02}",
        num2str(min, 6, 1, false, Unit::None),
        num2str(max, 6, 1, false, Unit::None),
        mean,
        dev
    );
}

/// fio's `show_clat_percentiles` with precision 2.
fn write_percentiles(out: &mut String, name: &str, l: &LatStats, plist: &[f64]) {
    if l.samples == 0 || plist.is_empty() {
        return;
    }
    let list = l.percentiles_of(plist);
    let minv = list.iter().map(|p| p.1).min().unwrap_or(0);
    let maxv = list.iter().map(|p| p.1).max().unwrap_or(0);
    let (scale_down, divisor, unit) = if minv > 2_000_000 && maxv > 99_999_999 {
        (2, 1_000_000u64, "msec")
    } else if minv > 2000 && maxv > 99_999 {
        (1, 1000u64, "usec")
    } else {
        (0, 1u64, "nsec")
    };
    let _ = write!(out, "    {name} percentiles ({unit}):\n     |");
    let precision = 2usize;
    let scaled_max = maxv / divisor;
    let time_width = if scaled_max == 0 {
        5
    } else {
        ((scaled_max as f64).log10() as usize + 1).max(5)
    };
    let per_line = (80 - 7) / (precision + 10 + time_width);
    for (j, &(p, v)) in list.iter().enumerate() {
        if j != 0 && j.is_multiple_of(per_line) {
            out.push_str("     |");
        }
        let is_last = j == list.len() - 1;
        let mut v = v;
        for _ in 0..scale_down {
            v = v.div_ceil(1000);
        }
        let _ = write!(
            out,
            " {:>w$.prec$}th=[{:>tw$}]{}",
            p,
            v,
            if is_last { '\n' } else { ',' },
            w = precision + 3,
            prec = precision,
            tw = time_width
        );
        if is_last {
            break;
        }
        if j % per_line == per_line - 1 {
            out.push('\n');
        }
    }
}

/// fio's latency buckets: upper bounds (exclusive) in ns, per unit line.
const LAT_BOUNDS: [u64; 10] = [2, 4, 10, 20, 50, 100, 250, 500, 750, 1000];

/// `(unit, [(label, count)])` rows of fio's `show_latencies`.
pub(crate) fn latency_rows(job: &JobResult) -> Vec<(&'static str, Vec<(String, u64)>)> {
    let count = |lo: u64, hi: u64| {
        job.read.clat.count_between(lo, hi)
            + job.write.clat.count_between(lo, hi)
            + job.trim.clat.count_between(lo, hi)
    };
    let mut rows = Vec::new();
    for (unit, scale) in [("nsec", 1u64), ("usec", 1000), ("msec", 1_000_000)] {
        let mut cells = Vec::new();
        let mut lo = if scale == 1 { 0 } else { scale };
        for &b in &LAT_BOUNDS {
            let hi = b * scale;
            cells.push((format!("{b}"), count(lo, hi)));
            lo = hi;
        }
        if unit == "msec" {
            cells.push(("2000".to_string(), count(1_000_000_000, 2_000_000_000)));
            cells.push((">=2000".to_string(), count(2_000_000_000, u64::MAX)));
        }
        rows.push((unit, cells));
    }
    rows
}

fn write_latency_distribution(out: &mut String, job: &JobResult) {
    let total = job.read.clat.samples + job.write.clat.samples + job.trim.clat.samples;
    if total == 0 {
        return;
    }
    for (unit, cells) in latency_rows(job) {
        let mut line_items = 0;
        let mut any = false;
        for (label, c) in cells {
            if c == 0 {
                continue;
            }
            let mut pct = c as f64 * 100.0 / total as f64;
            if pct < 0.01 {
                pct = 0.01;
            }
            if line_items == 0 {
                if any {
                    out.push('\n');
                }
                let _ = write!(out, "  lat ({unit})   : ");
            } else {
                out.push_str(", ");
            }
            any = true;
            let _ = write!(out, "{label}={pct:.2}%");
            line_items += 1;
            if line_items == 5 {
                line_items = 0;
            }
        }
        if any {
            out.push('\n');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn num2str_matches_fio() {
        // Values from a fio 3.33 run: IOPS=665k, BW=2597MiB/s (2723MB/s),
        // io 2600MiB, clat max=4080.3k.
        assert_eq!(num2str(664_899, 4, 1, false, Unit::None), "665k");
        assert_eq!(
            num2str(2_723_000_000, 4, 1, true, Unit::BytePerSec),
            "2597MiB/s"
        );
        assert_eq!(
            num2str(2_723_000_000, 4, 1, false, Unit::BytePerSec),
            "2723MB/s"
        );
        assert_eq!(num2str(4_080_300, 6, 1, false, Unit::None), "4080.3k");
        assert_eq!(num2str(211, 6, 1, false, Unit::None), "211");
        assert_eq!(num2str(0, 4, 1, true, Unit::Byte), "0B");
        assert_eq!(num2str(4096, 4, 1, true, Unit::Byte), "4096B");
        assert_eq!(num2str(40960, 4, 1, true, Unit::Byte), "40.0KiB");
    }
}
