//! `lab-out/index.html`: the lab as one self-contained page (inline SVG
//! and CSS, nothing fetched), rebuilt from the `NAME.json` files in the
//! output directory after every run, so each experiment adds or updates
//! its own section and `lab all` fills all five.
//!
//! Per experiment: the upstream change in two sentences with a link to
//! its entry in docs/UPSTREAM.md, the upstream table, our table, the
//! figures, every check with PASS/FAIL and its figures, the notes, the
//! machine (CPUs, kernel, load before and after) and the command that
//! reproduces the run.

use crate::figures::figures_for;
use crate::plot::render_svg;
use crate::report::{LabReport, SeedTable};
use crate::EXPERIMENTS;
use anyhow::{Context, Result};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// What each upstream change did, in two sentences, and its anchor in
/// docs/UPSTREAM.md.
fn upstream_summary(experiment: &str) -> (&'static str, &'static str) {
    match experiment {
        "delay" => (
            "delay",
            "dm-delay used to queue delayed bios on a timer and flush them from a workqueue, \
             so a 1 ms delay was rounded up to whole jiffies and QD1 IOPS fell far short of \
             1000/delay. Upstream moved the flush to a kthread that sleeps precisely \
             (\"dm: delay: use kthread instead of timers and wq\"); the maintainer asked for \
             a hybrid that sleeps for long delays and polls only for short ones, which is \
             what our hybrid mechanism is.",
        ),
        "mq-run" => (
            "mq-run",
            "SCSI asks for an asynchronous run of its hardware queues on every completion, and \
             each request went through kblockd_mod_delayed_work_on, which grabs the pending \
             work, deletes its timer and requeues it under the worker pool's lock. Upstream \
             \"blk-mq: avoid repeatedly scheduling the same work to run hardware queue\" keeps \
             a queued bit per hardware queue so that no post happens while a run is pending.",
        ),
        "hybrid-poll" => (
            "hybrid-poll",
            "Busy polling for io_uring completions gives the lowest latency but burns a whole \
             CPU per poller. Upstream hybrid polling (IORING_SETUP_HYBRID_IOPOLL) sleeps for \
             about half the expected completion time, then polls, keeping polling's \
             throughput at a fraction of its CPU.",
        ),
        "sbitmap" => (
            "sbitmap",
            "Tag waiters used to be woken by a per-wait-queue wait_cnt countdown whose \
             decrement and reset are two steps, which could lose wakeups and woke one queue at \
             a time. Upstream \"sbitmap: Use single per-bitmap counting to wake up queued \
             tags\" counts completions and wakeups in two always-increasing per-bitmap \
             counters and wakes a batch across queues.",
        ),
        "mpath" => (
            "mpath",
            "dm-mpath's historical-service-time selector estimates each path's service time \
             from request start times kept in jiffies, which rounds fast paths' times to zero \
             and starves the slow ones. Upstream switched the start times to nanoseconds \
             (ktime), bringing the per-path share close to the ideal split.",
        ),
        _ => ("", ""),
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const CSS: &str = "
body{font-family:sans-serif;margin:0 auto;max-width:1180px;padding:0 16px 40px;color:#222}
h1{margin-top:20px} h2{border-top:2px solid #ccc;padding-top:14px;margin-top:36px}
table{border-collapse:collapse;margin:6px 0 14px;font-size:13px;display:block;overflow-x:auto}
th,td{border:1px solid #ccc;padding:2px 6px;text-align:right;white-space:nowrap}
th{background:#f2f2f2} td:first-child,th:first-child{text-align:left}
.pass{color:#0a6b0a;font-weight:bold} .fail{color:#b00;font-weight:bold}
.figure svg{max-width:100%;height:auto;border:1px solid #ddd;margin:8px 0}
code{background:#f4f4f4;padding:1px 4px} .missing{color:#777;font-style:italic}
ul.checks li{margin:2px 0} .machine{font-size:13px;color:#444}
";

fn table_html(s: &mut String, columns: &[String], rows: &[Vec<String>]) {
    s.push_str("<table><tr>");
    for c in columns {
        let _ = write!(s, "<th>{}</th>", esc(c));
    }
    s.push_str("</tr>\n");
    for r in rows {
        s.push_str("<tr>");
        for c in r {
            let _ = write!(s, "<td>{}</td>", esc(c));
        }
        s.push_str("</tr>\n");
    }
    s.push_str("</table>\n");
}

fn seed_html(s: &mut String, seed: &SeedTable) {
    let _ = writeln!(s, "<h3>Upstream figures</h3><p>{}</p>", esc(&seed.caption));
    table_html(s, &seed.columns, &seed.rows);
}

/// One experiment's section.
pub fn section_html(r: &LabReport) -> Result<String> {
    let mut s = String::new();
    let (anchor, summary) = upstream_summary(&r.experiment);
    let passed = r.checks.iter().filter(|c| c.pass).count();
    let _ = writeln!(
        s,
        "<section id=\"{id}\" class=\"experiment\"><h2>{id}: {title}</h2>",
        id = esc(&r.experiment),
        title = esc(&r.title)
    );
    let _ = writeln!(
        s,
        "<p>{} <a href=\"../docs/UPSTREAM.md#{anchor}\">docs/UPSTREAM.md#{anchor}</a></p>",
        esc(summary)
    );
    let _ = writeln!(
        s,
        "<p><b>{passed} of {} checks reproduced.</b></p>",
        r.checks.len()
    );
    if let Some(seed) = &r.seed {
        seed_html(&mut s, seed);
    }
    s.push_str("<h3>This run</h3>\n");
    for g in r.grids() {
        if !g.caption.is_empty() {
            let _ = writeln!(s, "<p><b>{}</b></p>", esc(&g.caption));
        }
        table_html(&mut s, &g.columns, &g.cells);
    }
    for fig in figures_for(r) {
        let svg = render_svg(&fig, &r.rows)
            .with_context(|| format!("drawing {} figure", r.experiment))?;
        let _ = writeln!(s, "<div class=\"figure\">{svg}</div>");
    }
    s.push_str("<h3>Checks</h3><ul class=\"checks\">\n");
    for c in &r.checks {
        let (class, word) = if c.pass {
            ("pass", "PASS")
        } else {
            ("fail", "FAIL")
        };
        let _ = writeln!(
            s,
            "<li><span class=\"{class}\">{word}</span> {}: {}</li>",
            esc(&c.name),
            esc(&c.detail)
        );
    }
    s.push_str("</ul>\n<h3>Notes</h3><ul>\n");
    for n in &r.notes {
        let _ = writeln!(s, "<li>{}</li>", esc(n));
    }
    s.push_str("</ul>\n");
    match &r.machine {
        Some(m) => {
            let _ = writeln!(
                s,
                "<p class=\"machine\">Machine: {} CPUs ({}), {}; load average (1 min) {:.2} \
                 before, {:.2} after; finished {}.</p>",
                m.cpus,
                esc(&m.cpu_model),
                esc(&m.kernel),
                m.load_before,
                m.load_after,
                esc(&m.finished)
            );
        }
        None => s.push_str("<p class=\"machine\">Machine: not recorded in this run.</p>\n"),
    }
    let _ = writeln!(
        s,
        "<p>Reproduce: <code>{}</code></p></section>",
        esc(&r.command)
    );
    Ok(s)
}

/// The reports found in `dir` (`NAME.json` of every known experiment),
/// in experiment order; a missing file is `None`.
pub fn load_reports(dir: &Path) -> Result<Vec<(&'static str, Option<LabReport>)>> {
    let mut out = Vec::new();
    for e in EXPERIMENTS {
        let path = dir.join(format!("{}.json", e.name));
        let report = match std::fs::read_to_string(&path) {
            Ok(text) => Some(
                LabReport::from_json(&text)
                    .with_context(|| format!("reading {}", path.display()))?,
            ),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => None,
            Err(err) => return Err(err).with_context(|| format!("reading {}", path.display())),
        };
        out.push((e.name, report));
    }
    Ok(out)
}

/// The whole page for the reports in `dir`.
pub fn index_html(dir: &Path) -> Result<String> {
    let reports = load_reports(dir)?;
    let mut s = String::new();
    let _ = write!(
        s,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>blkstack lab report</title><style>{CSS}</style></head><body>\n\
         <h1>blkstack lab: five upstream block-layer changes, rerun</h1>\n\
         <p>Each section reruns one upstream change with the old and the new mechanism \
         side by side. Solid lines and filled bars are this run; dashed lines with hollow \
         triangles and hollow bars are the figures upstream published.</p>\n"
    );
    s.push_str("<table><tr><th>experiment</th><th>checks reproduced</th><th>ran</th></tr>\n");
    for (name, r) in &reports {
        match r {
            Some(r) => {
                let _ = writeln!(
                    s,
                    "<tr><td><a href=\"#{name}\">{name}</a></td><td>{} of {}</td><td>{}</td></tr>",
                    r.checks.iter().filter(|c| c.pass).count(),
                    r.checks.len(),
                    esc(r.machine.as_ref().map_or("-", |m| m.finished.as_str()))
                );
            }
            None => {
                let _ = writeln!(
                    s,
                    "<tr><td><a href=\"#{name}\">{name}</a></td><td>-</td><td>not run</td></tr>"
                );
            }
        }
    }
    s.push_str("</table>\n");
    for (name, r) in &reports {
        match r {
            Some(r) => s.push_str(&section_html(r)?),
            None => {
                let _ = writeln!(
                    s,
                    "<section id=\"{name}\" class=\"experiment missing\"><h2>{name}</h2>\
                     <p class=\"missing\">Not run into this directory yet: \
                     <code>cargo run --release -- lab {name}</code>.</p></section>"
                );
            }
        }
    }
    s.push_str("</body></html>\n");
    Ok(s)
}

/// Rewrite `dir/index.html` from the reports in `dir`.
pub fn write_index(dir: &Path) -> Result<PathBuf> {
    let path = dir.join("index.html");
    let html = index_html(dir)?;
    std::fs::write(&path, html).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::LabReport;
    use serde_json::json;

    #[test]
    fn page_has_every_section_escapes_text_and_says_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = LabReport::new("mpath", "share <per> path", &["path", "ideal", "hst_ns"]);
        r.push_row([
            ("path", json!("p0")),
            ("ideal", json!(0.5)),
            ("hst_ns", json!(0.49)),
        ]);
        r.check("close to ideal", true, "gap 0.01");
        r.check("jiffies starve", false, "share 0.3");
        r.command = "cargo run --release -- lab mpath".into();
        std::fs::write(dir.path().join("mpath.json"), r.to_json().to_string()).unwrap();
        let path = write_index(dir.path()).unwrap();
        let html = std::fs::read_to_string(path).unwrap();
        for e in EXPERIMENTS {
            assert!(
                html.contains(&format!("<section id=\"{}\"", e.name)),
                "{}",
                e.name
            );
        }
        assert!(html.contains("share &lt;per&gt; path"));
        assert!(html.contains("1 of 2 checks reproduced"));
        assert!(html.contains("<span class=\"fail\">FAIL</span> jiffies starve: share 0.3"));
        assert!(html.contains("../docs/UPSTREAM.md#mpath"));
        assert!(html.contains("<svg"));
        assert!(html.contains("Not run into this directory yet"));
        for fetch in [" src=", "<link", "<img", "@import"] {
            assert!(!html.contains(fetch), "the page loads something: {fetch}");
        }
    }

    #[test]
    fn a_corrupt_report_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("delay.json"), "{not json").unwrap();
        let err = format!("{:#}", write_index(dir.path()).unwrap_err());
        assert!(err.contains("delay.json"), "{err}");
    }
}
