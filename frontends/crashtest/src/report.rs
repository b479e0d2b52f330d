//! What a crashtest run prints and the JSON report it writes: the points
//! (and reorder states) checked, each failure with its entry number,
//! flags, the state's seed and mode and the `replay-log` command line that
//! rebuilds it, and the checker's output, and what the run cost (points
//! per minute; the overlay's reset, the replay and the check per point).

use crate::replay::flags_text;
use crate::runner::{Costs, Outcome, Variant, Walker};
use std::io::Write;

#[derive(Debug, serde::Serialize)]
pub struct Report {
    pub workload: String,
    pub planted: bool,
    /// The planted bug's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bug: Option<String>,
    pub log: String,
    pub log_entries: u64,
    pub rule: String,
    pub points_planned: usize,
    /// Points checked in order.
    pub points_checked: usize,
    /// Reorder (and torn) states checked beyond them.
    pub states_checked: usize,
    pub failures: Vec<Failure>,
    /// The first failing point's entry, if any.
    pub first_failure_entry: Option<u64>,
    /// The rebuild commands name a log that was removed (no --keep-log).
    pub log_removed: bool,
    pub seconds: f64,
    /// Points and reorder states checked per minute.
    pub points_per_minute: f64,
    pub per_point_ms: PerPoint,
    pub costs: Costs,
}

#[derive(Debug, serde::Serialize)]
pub struct Failure {
    pub point: usize,
    pub entry: u64,
    pub flags: String,
    /// The crash state beyond the in-order point, if it is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<Variant>,
    /// The shell command that rebuilds the state onto `state.img`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rebuild: Option<String>,
    pub output: String,
}

/// What a failing state's rebuild command needs.
pub struct Rebuild {
    /// The log the run checked.
    pub log: String,
    /// The log is removed when the run ends (no --keep-log).
    pub temporary: bool,
    /// The replayed device's size.
    pub bytes: u64,
}

impl Rebuild {
    /// `truncate` and `replay-log` onto `state.img`: the device as the
    /// check saw it (a zeroed image of the device's size, the log
    /// replayed to the point, the state's epoch subset on top).
    pub fn command(&self, entry: u64, v: Option<&Variant>) -> String {
        let state = match v {
            Some(v) => format!(
                " --reorder-seed {}{}",
                v.seed,
                if v.torn { " --torn" } else { "" }
            ),
            None => String::new(),
        };
        format!(
            "rm -f state.img; truncate -s {} state.img; blkstack replay-log --log {} --replay state.img --limit {}{state}",
            self.bytes,
            shell_word(&self.log),
            entry + 1
        )
    }
}

/// `s` as one shell word.
fn shell_word(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+=:,@".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
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
    pub fn new(
        workload: &str,
        bug: Option<&str>,
        log: &str,
        rule: &str,
        w: &Walker,
        rebuild: &Rebuild,
    ) -> Report {
        let checked = w.outcomes.len();
        let states = w.outcomes.iter().filter(|o| o.variant.is_some()).count();
        let failures: Vec<Failure> = w
            .outcomes
            .iter()
            .filter(|o| !o.ok)
            .map(|o: &Outcome| Failure {
                point: o.point.n,
                entry: o.point.entry,
                flags: flags_text(o.point.flags),
                state: o.variant.clone(),
                rebuild: Some(rebuild.command(o.point.entry, o.variant.as_ref())),
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
            planted: bug.is_some(),
            bug: bug.map(str::to_string),
            log: log.into(),
            log_entries: w.plan.entries,
            rule: rule.into(),
            points_planned: w.plan.points.len(),
            points_checked: checked - states,
            states_checked: states,
            first_failure_entry: failures.first().map(|f| f.entry),
            log_removed: rebuild.temporary,
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
        let states = if self.states_checked > 0 {
            format!(
                " and {} reorder states after its flush points",
                self.states_checked
            )
        } else {
            String::new()
        };
        writeln!(
            out,
            "crashtest {}{}: {} of {} points checked ({}, log of {} entries){states}, {} failed",
            self.workload,
            match &self.bug {
                Some(b) => format!(" (planted bug {b})"),
                None => String::new(),
            },
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
            match &f.state {
                None => writeln!(out, "FAIL point {} at entry {} ({})", f.point, f.entry, f.flags)?,
                Some(v) => writeln!(
                    out,
                    "FAIL point {} at entry {} ({}), {} state {}: seed {}, {} of the next epoch's {} entries kept{}",
                    f.point,
                    f.entry,
                    f.flags,
                    if v.torn { "torn" } else { "reorder" },
                    v.j,
                    v.seed,
                    v.kept,
                    v.epoch_entries,
                    match v.torn_entry {
                        Some([e, k, of]) => format!(", entry {e} torn to {k} of {of} blocks"),
                        None => String::new(),
                    }
                )?,
            }
            if let Some(cmd) = &f.rebuild {
                writeln!(out, "    rebuild: {cmd}")?;
            }
            if i < 3 {
                for l in f.output.lines().take(40) {
                    writeln!(out, "    {l}")?;
                }
            }
        }
        if self.log_removed && !self.failures.is_empty() {
            writeln!(
                out,
                "(the log was a temporary file and is removed: run again with --keep-log FILE to rebuild a state)"
            )?;
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
