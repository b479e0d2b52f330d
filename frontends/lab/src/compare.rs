//! `blkstack lab compare A B`: the same experiment from two runs side by
//! side (two machines, or before and after a change), with the change per
//! row: what a person measuring a mechanism does next. `A` and `B` are
//! two `NAME.json` files of one experiment, or two output directories
//! (every experiment found in both).
//!
//! Rows are matched by their key columns (the table's coordinates: rw,
//! delay, depth, device, path...); every other numeric column is a figure
//! shown as A, B and B's change relative to A. Checks are listed with
//! both verdicts, and the machines are named so a reader sees whether the
//! two runs can be compared at all.

use crate::report::{fmt_value, LabReport, Row};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::fmt::Write as _;
use std::path::Path;

/// Columns that locate a row rather than measure something.
const KEY_COLUMNS: [&str; 15] = [
    "rw",
    "qd",
    "delay_ms",
    "device",
    "sweep",
    "table",
    "jobs",
    "iodepth",
    "depth",
    "case",
    "workload",
    "service_us",
    "path",
    "cost",
    "unit",
];

fn read(path: &Path) -> Result<LabReport> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    LabReport::from_json(&text).with_context(|| format!("{}: not a lab report", path.display()))
}

fn key_of(r: &LabReport, row: &Row) -> String {
    r.columns
        .iter()
        .filter(|c| KEY_COLUMNS.contains(&c.as_str()))
        .map(|c| format!("{c}={}", fmt_value(row.get(c))))
        .collect::<Vec<_>>()
        .join(" ")
}

fn is_figure(column: &str) -> bool {
    !KEY_COLUMNS.contains(&column) && !column.starts_with("seed_")
}

fn change(a: f64, b: f64) -> String {
    if a == 0.0 {
        if b == 0.0 {
            "=".into()
        } else {
            "new".into()
        }
    } else {
        format!("{:+.1}%", (b / a - 1.0) * 100.0)
    }
}

fn machine_line(label: &str, r: &LabReport) -> String {
    match &r.machine {
        Some(m) => format!(
            "{label}: {} CPUs ({}), {}, load {:.2} -> {:.2}, {}\n",
            m.cpus, m.cpu_model, m.kernel, m.load_before, m.load_after, m.finished
        ),
        None => format!("{label}: machine not recorded\n"),
    }
}

/// The comparison of two runs of one experiment, as text.
pub fn compare_reports(a: &LabReport, b: &LabReport) -> Result<String> {
    if a.experiment != b.experiment {
        bail!(
            "cannot compare different experiments: '{}' and '{}'",
            a.experiment,
            b.experiment
        );
    }
    let mut s = String::new();
    let _ = writeln!(s, "== lab compare {}: A vs B", a.experiment);
    s.push_str(&machine_line("A", a));
    s.push_str(&machine_line("B", b));
    let mut lines = vec![[
        "row".to_string(),
        "figure".into(),
        "A".into(),
        "B".into(),
        "change".into(),
    ]];
    let mut unmatched = 0;
    for ra in &a.rows {
        let key = key_of(a, ra);
        let Some(rb) = b.rows.iter().find(|rb| key_of(b, rb) == key) else {
            unmatched += 1;
            continue;
        };
        for c in a.columns.iter().filter(|c| is_figure(c)) {
            let (Some(x), Some(y)) = (
                ra.get(c).and_then(Value::as_f64),
                rb.get(c).and_then(Value::as_f64),
            ) else {
                continue;
            };
            lines.push([
                key.clone(),
                c.clone(),
                fmt_value(ra.get(c)),
                fmt_value(rb.get(c)),
                change(x, y),
            ]);
        }
    }
    let widths: Vec<usize> = (0..5)
        .map(|i| lines.iter().map(|l| l[i].len()).max().unwrap_or(0))
        .collect();
    for l in &lines {
        let _ = writeln!(
            s,
            "{:<w0$}  {:<w1$}  {:>w2$}  {:>w3$}  {:>w4$}",
            l[0],
            l[1],
            l[2],
            l[3],
            l[4],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2],
            w3 = widths[3],
            w4 = widths[4]
        );
    }
    if unmatched > 0 {
        let _ = writeln!(
            s,
            "({unmatched} row(s) of A have no row with the same keys in B)"
        );
    }
    let verdict = |r: &LabReport, name: &str| {
        r.checks
            .iter()
            .find(|c| c.name == name)
            .map_or("-", |c| if c.pass { "PASS" } else { "FAIL" })
    };
    let mut names: Vec<&str> = a.checks.iter().map(|c| c.name.as_str()).collect();
    for c in &b.checks {
        if !names.contains(&c.name.as_str()) {
            names.push(&c.name);
        }
    }
    if !names.is_empty() {
        s.push_str("checks (A / B):\n");
        for n in names {
            let _ = writeln!(s, "  {:<4} / {:<4}  {n}", verdict(a, n), verdict(b, n));
        }
    }
    Ok(s)
}

/// `lab compare A B` on two files or two directories.
pub fn compare_paths(a: &Path, b: &Path) -> Result<String> {
    match (a.is_dir(), b.is_dir()) {
        (false, false) => compare_reports(&read(a)?, &read(b)?),
        (true, true) => {
            let mut s = String::new();
            let mut any = false;
            for e in crate::EXPERIMENTS {
                let (pa, pb) = (
                    a.join(format!("{}.json", e.name)),
                    b.join(format!("{}.json", e.name)),
                );
                if pa.exists() && pb.exists() {
                    s.push_str(&compare_reports(&read(&pa)?, &read(&pb)?)?);
                    s.push('\n');
                    any = true;
                }
            }
            if !any {
                bail!(
                    "no experiment has a NAME.json in both {} and {}",
                    a.display(),
                    b.display()
                );
            }
            Ok(s)
        }
        _ => bail!(
            "compare two files or two directories, not one of each: {} and {}",
            a.display(),
            b.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(kiops: [f64; 2], pass: bool) -> LabReport {
        let mut r = LabReport::new("mq-run", "t", &["sweep", "iodepth", "on_kiops"]);
        for (qd, k) in [16, 64].iter().zip(kiops) {
            r.push_row([
                ("sweep", json!("depth")),
                ("iodepth", json!(qd)),
                ("on_kiops", json!(k)),
                ("seed_pre_kiops", json!(190)),
            ]);
        }
        r.check("dedup matters", pass, "x");
        r
    }

    #[test]
    fn rows_matched_by_keys_with_change_and_both_verdicts() {
        let text =
            compare_reports(&run([100.0, 200.0], false), &run([110.0, 150.0], true)).unwrap();
        let line = |qd: &str| {
            text.lines()
                .find(|l| l.contains(&format!("iodepth={qd} ")) && l.contains("on_kiops"))
                .unwrap_or_else(|| panic!("no line for QD{qd}:\n{text}"))
                .to_string()
        };
        assert!(line("16").trim_end().ends_with("+10.0%"), "{text}");
        assert!(line("64").trim_end().ends_with("-25.0%"), "{text}");
        assert!(
            !text.contains("seed_pre_kiops"),
            "upstream columns are not figures"
        );
        assert!(text.contains("FAIL / PASS  dedup matters"), "{text}");
    }

    #[test]
    fn files_and_directories_and_mistakes() {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let pa = da.path().join("mq-run.json");
        let pb = db.path().join("mq-run.json");
        std::fs::write(&pa, run([1.0, 2.0], true).to_json().to_string()).unwrap();
        std::fs::write(&pb, run([2.0, 2.0], true).to_json().to_string()).unwrap();
        assert!(compare_paths(&pa, &pb).unwrap().contains("+100.0%"));
        assert!(compare_paths(da.path(), db.path())
            .unwrap()
            .contains("== lab compare mq-run"));
        assert!(compare_paths(&pa, db.path()).is_err());
        let other = da.path().join("x.json");
        std::fs::write(
            &other,
            LabReport::new("delay", "t", &[]).to_json().to_string(),
        )
        .unwrap();
        let err = compare_paths(&pa, &other).unwrap_err().to_string();
        assert!(err.contains("different experiments"), "{err}");
        std::fs::write(&other, "[]").unwrap();
        let err = format!("{:#}", compare_paths(&pa, &other).unwrap_err());
        assert!(err.contains("not a lab report"), "{err}");
    }
}
