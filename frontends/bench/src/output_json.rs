//! fio's JSON reports: `--output-format=json` and `json+`.
//!
//! Field names and nesting follow fio's `stat.c` (`show_thread_status_json`,
//! `add_ddir_status_json`); blkstack adds `verify_errors`,
//! `verify_checked`, `device` and `wait` per job. `json+` adds fio's
//! latency bins: `clat_ns.bins` maps each of fio's histogram buckets
//! (`plat_idx_to_val`: 64 linear buckets per power of two) to its count,
//! so fio's `fio_jsonplus_clat2csv` reads them. What blkstack does not
//! measure is reported as fio reports an unmeasured value: `slat_ns` has
//! `N: 0`, and `lat_ns` carries the same samples as `clat_ns`.

use crate::output::{ctime_now, latency_rows, percent_of_agg};
use crate::stats::{sample_stats, BenchReport, DirStats, JobResult, LatStats};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

/// An ordered JSON value (fio's key order), serialised by serde_json.
enum J {
    Obj(Vec<(String, J)>),
    Arr(Vec<J>),
    U(u64),
    I(i64),
    F(f64),
    S(String),
}

impl Serialize for J {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            J::Obj(kv) => {
                let mut m = s.serialize_map(Some(kv.len()))?;
                for (k, v) in kv {
                    m.serialize_entry(k, v)?;
                }
                m.end()
            }
            J::Arr(items) => {
                let mut q = s.serialize_seq(Some(items.len()))?;
                for i in items {
                    q.serialize_element(i)?;
                }
                q.end()
            }
            J::U(v) => s.serialize_u64(*v),
            J::I(v) => s.serialize_i64(*v),
            J::F(v) => s.serialize_f64(if v.is_finite() { *v } else { 0.0 }),
            J::S(v) => s.serialize_str(v),
        }
    }
}

fn obj(kv: Vec<(&str, J)>) -> J {
    J::Obj(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
}

/// fio's histogram: 64 buckets per power of two above 128 ns
/// (`FIO_IO_U_PLAT_BITS`), 29 groups.
const PLAT_BITS: u32 = 6;
const PLAT_VAL: u64 = 1 << PLAT_BITS;
const PLAT_NR: u64 = 29 * PLAT_VAL;

/// fio's `plat_val_to_idx`.
fn plat_val_to_idx(val: u64) -> u64 {
    let msb = if val == 0 {
        0
    } else {
        63 - val.leading_zeros()
    };
    if msb <= PLAT_BITS {
        return val;
    }
    let error_bits = msb - PLAT_BITS;
    let base = ((error_bits + 1) as u64) << PLAT_BITS;
    let offset = (PLAT_VAL - 1) & (val >> error_bits);
    (base + offset).min(PLAT_NR - 1)
}

/// fio's `plat_idx_to_val`: the bucket's middle.
fn plat_idx_to_val(idx: u64) -> u64 {
    if idx < (PLAT_VAL << 1) {
        return idx;
    }
    let error_bits = (idx >> PLAT_BITS) - 1;
    let base = 1u64 << (error_bits + PLAT_BITS as u64);
    let k = idx % PLAT_VAL;
    base + ((k as f64 + 0.5) * (1u64 << error_bits) as f64) as u64
}

/// `json+`'s `bins`: the samples regrouped into fio's buckets.
fn bins_json(l: &LatStats) -> J {
    let mut bins: std::collections::BTreeMap<u64, u64> = Default::default();
    for v in l.hist.iter_recorded() {
        let idx = plat_val_to_idx(l.hist.highest_equivalent(v.value_iterated_to()));
        *bins.entry(idx).or_default() += v.count_at_value();
    }
    J::Obj(
        bins.into_iter()
            .map(|(i, c)| (plat_idx_to_val(i).to_string(), J::U(c)))
            .collect(),
    )
}

fn lat_json(l: &LatStats, percentiles: Option<&[f64]>) -> J {
    let mut kv = vec![
        ("min", J::U(l.min())),
        ("max", J::U(l.max_ns)),
        ("mean", J::F(l.mean())),
        ("stddev", J::F(l.stddev())),
        ("N", J::U(l.samples)),
    ];
    if let (Some(list), true) = (percentiles, l.samples > 0) {
        let p = l
            .percentiles_of(list)
            .into_iter()
            .map(|(p, v)| (format!("{p:.6}"), J::U(v)))
            .collect();
        kv.push(("percentile", J::Obj(p)));
    }
    obj(kv)
}

fn dir_json(d: &DirStats, agg_bytes: u64, plist: &[f64], plus: bool) -> J {
    let (bmin, bmax, bmean, bdev) = sample_stats(&d.bw_samples).unwrap_or((0, 0, 0.0, 0.0));
    let (imin, imax, imean, idev) = sample_stats(&d.iops_samples).unwrap_or((0, 0, 0.0, 0.0));
    let bw_agg = if d.bw_samples.is_empty() {
        0.0
    } else {
        percent_of_agg(bmean, agg_bytes)
    };
    obj(vec![
        ("io_bytes", J::U(d.io_bytes)),
        ("io_kbytes", J::U(d.io_bytes >> 10)),
        ("bw_bytes", J::U(d.bw_bytes())),
        ("bw", J::U(d.bw_kib())),
        ("iops", J::F(d.iops())),
        ("runtime", J::U(d.runtime_ms())),
        ("total_ios", J::U(d.total_ios)),
        ("short_ios", J::U(d.short_ios)),
        ("drop_ios", J::U(d.drop_ios)),
        ("slat_ns", lat_json(&LatStats::default(), None)),
        ("clat_ns", {
            let mut c = lat_json(&d.clat, Some(plist));
            if let (true, J::Obj(kv)) = (plus && d.clat.samples > 0, &mut c) {
                kv.push(("bins".into(), bins_json(&d.clat)));
            }
            c
        }),
        ("lat_ns", lat_json(&d.clat, None)),
        ("bw_min", J::U(bmin)),
        ("bw_max", J::U(bmax)),
        ("bw_agg", J::F(bw_agg)),
        ("bw_mean", J::F(bmean)),
        ("bw_dev", J::F(bdev)),
        ("bw_samples", J::U(d.bw_samples.len() as u64)),
        ("iops_min", J::U(imin)),
        ("iops_max", J::U(imax)),
        ("iops_mean", J::F(imean)),
        ("iops_stddev", J::F(idev)),
        ("iops_samples", J::U(d.iops_samples.len() as u64)),
        ("errors", J::U(d.errors)),
    ])
}

/// fio's `job options` object.
fn job_options(s: &crate::spec::JobSpec, job: &JobResult) -> Vec<(&'static str, J)> {
    let mut opts = vec![
        ("name", J::S(s.name.clone())),
        ("filename", J::S(job.device.clone())),
        ("rw", J::S(s.rw.name().to_string())),
    ];
    if s.bs.split.len() == 1 {
        opts.push(("bs", J::S(s.bs.min().to_string())));
    } else {
        let text =
            s.bs.split
                .iter()
                .map(|(b, p)| format!("{b}/{p}"))
                .collect::<Vec<_>>()
                .join(":");
        opts.push(("bssplit", J::S(text)));
    }
    opts.push(("iodepth", J::S(s.iodepth.to_string())));
    opts.push(("numjobs", J::S(s.numjobs.to_string())));
    if let Some(r) = s.runtime {
        opts.push(("runtime", J::S(format!("{}ms", r.as_millis()))));
    }
    if s.time_based {
        opts.push(("time_based", J::S("1".into())));
    }
    if s.rw.is_mixed() {
        opts.push(("rwmixread", J::S(s.rwmixread.to_string())));
    }
    if s.verify != crate::spec::VerifyMode::None {
        opts.push(("verify", J::S(s.verify.name().into())));
    }
    opts.push(("ioengine", J::S(s.ioengine.clone())));
    opts.push(("wait", J::S(s.wait.name().into())));
    opts
}

fn job_json(report: &BenchReport, job: &JobResult, plus: bool) -> J {
    let s = &job.spec;
    let group = report.groups.iter().find(|g| g.groupid == job.groupid);
    let (agg_r, agg_w, agg_t) = group
        .map(|g| (g.read.agg_bw, g.write.agg_bw, g.trim.agg_bw))
        .unwrap_or((0, 0, 0));
    let opts = job_options(s, job);
    let pct_map = |v: &[u64; 7], labels: [&str; 7]| -> J {
        let total: u64 = v.iter().sum();
        J::Obj(
            labels
                .iter()
                .zip(v.iter())
                .map(|(l, &c)| {
                    let p = if total == 0 {
                        0.0
                    } else {
                        c as f64 * 100.0 / total as f64
                    };
                    (l.to_string(), J::F(p))
                })
                .collect(),
        )
    };
    let total = (job.read.clat.samples + job.write.clat.samples).max(1) as f64;
    let lat_maps: Vec<(String, J)> = latency_rows(job)
        .into_iter()
        .map(|(unit, cells)| {
            let key = match unit {
                "nsec" => "latency_ns",
                "usec" => "latency_us",
                _ => "latency_ms",
            };
            (
                key.to_string(),
                J::Obj(
                    cells
                        .into_iter()
                        .map(|(l, c)| (l, J::F(c as f64 * 100.0 / total)))
                        .collect(),
                ),
            )
        })
        .collect();
    let mut kv = vec![
        ("jobname", J::S(job.name.clone())),
        ("groupid", J::U(job.groupid as u64)),
        ("error", J::I(job.error as i64)),
        ("elapsed", J::U(job.elapsed_ns.div_ceil(1_000_000_000))),
        ("job options", obj(opts)),
        ("read", dir_json(&job.read, agg_r, &s.percentile_list, plus)),
        (
            "write",
            dir_json(&job.write, agg_w, &s.percentile_list, plus),
        ),
        ("trim", dir_json(&job.trim, agg_t, &s.percentile_list, plus)),
        ("job_runtime", J::U(job.runtime_ns / 1_000_000)),
        ("usr_cpu", J::F(job.usr_cpu_pct())),
        ("sys_cpu", J::F(job.sys_cpu_pct())),
        ("ctx", J::U(job.ctx)),
        ("majf", J::U(job.majf)),
        ("minf", J::U(job.minf)),
        (
            "iodepth_level",
            pct_map(&job.depths.depth, ["1", "2", "4", "8", "16", "32", ">=64"]),
        ),
        (
            "iodepth_submit",
            pct_map(
                &job.depths.submit,
                ["0", "4", "8", "16", "32", "64", ">=64"],
            ),
        ),
        (
            "iodepth_complete",
            pct_map(
                &job.depths.complete,
                ["0", "4", "8", "16", "32", "64", ">=64"],
            ),
        ),
    ];
    let mut j = match obj(std::mem::take(&mut kv)) {
        J::Obj(v) => v,
        _ => unreachable!("obj builds an object"),
    };
    j.extend(lat_maps);
    j.push(("latency_depth".into(), J::U(s.iodepth as u64)));
    j.push(("device".into(), J::S(job.device.clone())));
    j.push(("wait".into(), J::S(s.wait.name().into())));
    j.push(("verify_errors".into(), J::U(job.verify_errors)));
    j.push(("verify_checked".into(), J::U(job.verify_checked)));
    J::Obj(j)
}

/// Render a report as fio-shaped JSON.
pub fn write_json(report: &BenchReport) -> String {
    render(report, false)
}

/// fio's `json+`: JSON with latency bins.
pub fn write_json_plus(report: &BenchReport) -> String {
    render(report, true)
}

fn render(report: &BenchReport, plus: bool) -> String {
    let time = ctime_now().trim_end().to_string();
    let root = obj(vec![
        ("fio version", J::S(report.version.clone())),
        ("timestamp", J::U(report.timestamp)),
        ("timestamp_ms", J::U(report.timestamp * 1000)),
        ("time", J::S(time)),
        (
            "jobs",
            J::Arr(
                report
                    .jobs
                    .iter()
                    .map(|j| job_json(report, j, plus))
                    .collect(),
            ),
        ),
    ]);
    let mut s =
        serde_json::to_string_pretty(&root).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plat_buckets_are_fios() {
        // Values from fio's stat.c: exact below 128, then 64 per octave.
        assert_eq!(plat_val_to_idx(100), 100);
        assert_eq!(plat_val_to_idx(128), 128);
        // 1000: msb 9, 3 error bits, group (3 + 1) * 64, offset 125 & 63.
        assert_eq!(plat_val_to_idx(1000), 4 * 64 + (1000 >> 3) % 64);
        for idx in [130u64, 500, 1000, 1500] {
            assert_eq!(plat_val_to_idx(plat_idx_to_val(idx)), idx);
        }
        assert_eq!(plat_val_to_idx(u64::MAX), PLAT_NR - 1);
    }
}
