//! What a crashtest run prints and the JSON report it writes: the points
//! checked, each failure with its entry number, flags and the checker's
//! output, and what the run cost (points per minute; the overlay's reset,
//! the replay and the check per point).

use crate::replay::flags_text;
use crate::runner::{Costs, Outcome, Walker};
use std::io::Write;

#[derive(Debug, serde::Serialize)]
pub struct Report {
    pub workload: String,
    pub planted: bool,
    pub log: String,
    pub log_entries: u64,
    pub rule: String,
    pub points_planned: usize,
    pub points_checked: usize,
    pub failures: Vec<Failure>,
    /// The first failing point's entry, if any.
    pub first_failure_entry: Option<u64>,
    pub seconds: f64,
    pub points_per_minute: f64,
    pub per_point_ms: PerPoint,
    pub costs: Costs,
}

#[derive(Debug, serde::Serialize)]
pub struct Failure {
    pub point: usize,
    pub entry: u64,
    pub flags: String,
    pub output: String,
}

#[derive(Debug, serde::Serialize)]
pub struct PerPoint {
    pub overlay_reset: f64,
    pub replay: f64,
    pub check: f64,
    /// Overlay sectors the check wrote, on average.
    pub cow_sectors: f64,
}

impl Report {
    pub fn new(workload: &str, planted: bool, log: &str, rule: &str, w: &Walker) -> Report {
        let checked = w.outcomes.len();
        let failures: Vec<Failure> = w
            .outcomes
            .iter()
            .filter(|o| !o.ok)
            .map(|o: &Outcome| Failure {
                point: o.point.n,
                entry: o.point.entry,
                flags: flags_text(o.point.flags),
                output: o.output.clone(),
            })
            .collect();
        let secs = w.elapsed().as_secs_f64();
        let per = |x: f64| {
            if checked == 0 {
                0.0
            } else {
                x * 1e3 / checked as f64
            }
        };
        Report {
            workload: workload.into(),
            planted,
            log: log.into(),
            log_entries: w.plan.entries,
            rule: rule.into(),
            points_planned: w.plan.points.len(),
            points_checked: checked,
            first_failure_entry: failures.first().map(|f| f.entry),
            failures,
            seconds: secs,
            points_per_minute: if secs > 0.0 {
                checked as f64 * 60.0 / secs
            } else {
                0.0
            },
            per_point_ms: PerPoint {
                overlay_reset: per(w.costs.reset_s),
                replay: per(w.costs.replay_s),
                check: per(w.costs.check_s),
                cow_sectors: if checked == 0 {
                    0.0
                } else {
                    w.costs.cow_sectors as f64 / checked as f64
                },
            },
            costs: w.costs.clone(),
        }
    }

    /// The summary a person reads.
    pub fn print(&self, out: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            out,
            "crashtest {}{}: {} of {} points checked ({}, log of {} entries), {} failed",
            self.workload,
            if self.planted { " (planted bug)" } else { "" },
            self.points_checked,
            self.points_planned,
            self.rule,
            self.log_entries,
            self.failures.len()
        )?;
        // The first failures in full, a line for each of the next ones.
        for (i, f) in self.failures.iter().enumerate() {
            if i == 20 {
                writeln!(
                    out,
                    "... and {} more failing points (all are in the JSON report)",
                    self.failures.len() - 20
                )?;
                break;
            }
            writeln!(
                out,
                "FAIL point {} at entry {} ({})",
                f.point, f.entry, f.flags
            )?;
            if i < 3 {
                for l in f.output.lines().take(40) {
                    writeln!(out, "    {l}")?;
                }
            }
        }
        writeln!(
            out,
            "{:.1} s, {:.0} points/min; per point: overlay reset {:.2} ms, replay {:.2} ms, \
             check {:.1} ms, {:.0} COW sectors",
            self.seconds,
            self.points_per_minute,
            self.per_point_ms.overlay_reset,
            self.per_point_ms.replay,
            self.per_point_ms.check,
            self.per_point_ms.cow_sectors
        )
    }
}
