//! What the experiments draw, and the helpers their figures share. Each
//! experiment draws its own plots ([`crate::experiment::Experiment::figures`]),
//! from the table alone (so saved `NAME.json` files redraw the same
//! figures), with the upstream patch's published figures as dashed series
//! with hollow markers wherever the patch published any; this module finds
//! a report's experiment by the name it was saved under.

use crate::plot::{num, Figure};
use crate::report::{LabReport, Row};
use serde_json::Value;

/// The figures for `report` (none for an unknown experiment).
pub fn figures_for(report: &LabReport) -> Vec<Figure> {
    crate::EXPERIMENTS
        .iter()
        .find(|e| e.name == report.experiment)
        .map(|e| (e.figures)())
        .unwrap_or_default()
}

/// A series of `a / b * scale`, where both cells are numbers and `b > 0`.
pub(crate) fn ratio(a: &'static str, b: &'static str, scale: f64) -> crate::plot::ValueFn {
    Box::new(move |r: &Row| {
        let (a, b) = (num(r, a)?, num(r, b)?);
        (b > 0.0).then_some(a / b * scale)
    })
}

/// A row of a job-count sweep (reports made before the sweeps existed
/// have no `sweep` column: all their rows are depth rows).
pub(crate) fn in_job_sweep(r: &Row) -> bool {
    r.get("sweep").and_then(Value::as_str) == Some("jobs")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
