//! The shape every lab experiment has, after criterion's split between
//! measurement and report: `configure` reads and checks the `--set`
//! options before anything runs, `measure` runs the stacks and keeps
//! the raw figures, and `rows`, `checks` and `notes` turn those figures
//! into the report without running anything. Rows are typed (a serde
//! struct per experiment whose fields are the table's columns, in
//! order), so the JSON written is what the struct says; figures are
//! drawn from the saved table alone (so `lab report` redraws them from
//! `NAME.json`), by the experiment's own [`Experiment::figures`].
//!
//! [`run`] drives one experiment; [`Entry`] is its line in
//! [`crate::EXPERIMENTS`], the only place a saved report's name is
//! matched to its experiment.

use crate::plot::Figure;
use crate::report::{Check, LabReport, SeedTable};
use crate::LabOpts;
use anyhow::Result;
use serde::Serialize;

/// One upstream change rerun: its settings, its measurement, and the
/// report made from them.
pub trait Experiment {
    /// The subcommand and the report's `experiment` (`NAME.json`).
    const NAME: &'static str;
    /// The seed file the experiment reruns (`000`..`004`).
    const SEED: &'static str;
    /// One line for `lab --list`.
    const ABOUT: &'static str;
    /// The report's title.
    const TITLE: &'static str;
    /// A column whose values name separate tables (see
    /// [`LabReport::split_by`]).
    const SPLIT_BY: Option<&'static str> = None;

    /// The settings, read from the options and checked before any run.
    type Config;
    /// What the runs measured, before any reduction to the table.
    type Measurement;
    /// One row of the table: its fields are the JSON row's keys, in the
    /// table's column order.
    type Row: Serialize;

    /// Read and check the options (a bad `--set` fails here, before any run).
    fn configure(opts: &LabOpts) -> Result<Self::Config>;
    /// Run the experiment.
    fn measure(cfg: &Self::Config) -> Result<Self::Measurement>;
    /// The table's columns, in order (rows may leave some out).
    fn columns(cfg: &Self::Config) -> Vec<String>;
    /// The table.
    fn rows(cfg: &Self::Config, m: &Self::Measurement) -> Vec<Self::Row>;
    /// The claims, judged on this run.
    fn checks(cfg: &Self::Config, m: &Self::Measurement, rows: &[Self::Row]) -> Vec<Check>;
    /// What the table does not say: settings, counters, the machine's state.
    fn notes(cfg: &Self::Config, m: &Self::Measurement, rows: &[Self::Row]) -> Vec<String>;
    /// Upstream's published figures, shown beside ours.
    fn seed_table() -> Option<SeedTable>;
    /// The plots, drawn from the rows of a report (a fresh or a saved one).
    fn figures() -> Vec<Figure>;
}

/// Run `E` and assemble its report.
pub fn run<E: Experiment>(opts: &LabOpts) -> Result<LabReport> {
    let cfg = E::configure(opts)?;
    let m = E::measure(&cfg)?;
    report::<E>(&cfg, &m)
}

/// The report of a measurement: rows, checks, notes, upstream's table.
pub fn report<E: Experiment>(cfg: &E::Config, m: &E::Measurement) -> Result<LabReport> {
    let columns = E::columns(cfg);
    let columns: Vec<&str> = columns.iter().map(String::as_str).collect();
    let mut r = LabReport::new(E::NAME, E::TITLE, &columns);
    let rows = E::rows(cfg, m);
    for row in &rows {
        r.push_typed(row)?;
    }
    r.checks = E::checks(cfg, m, &rows);
    r.notes = E::notes(cfg, m, &rows);
    r.seed = E::seed_table();
    r.split_by = E::SPLIT_BY.map(str::to_string);
    Ok(r)
}

/// An experiment as the command line and the report page see it.
pub struct Entry {
    pub name: &'static str,
    pub seed: &'static str,
    pub about: &'static str,
    pub run: fn(&LabOpts) -> Result<LabReport>,
    pub figures: fn() -> Vec<Figure>,
}

impl Entry {
    /// `E`'s line in [`crate::EXPERIMENTS`].
    pub const fn of<E: Experiment>() -> Entry {
        Entry {
            name: E::NAME,
            seed: E::SEED,
            about: E::ABOUT,
            run: run::<E>,
            figures: E::figures,
        }
    }
}

/// A check of a claim: its name, whether this run reproduced it, the
/// figures that decided.
pub fn check(name: impl Into<String>, pass: bool, detail: impl Into<String>) -> Check {
    Check {
        name: name.into(),
        pass,
        detail: detail.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A toy experiment: two rows, the second with a cell the first lacks.
    struct Toy;

    #[derive(Serialize)]
    struct ToyRow {
        depth: u32,
        iops: f64,
        #[serde(skip_serializing_if = "Option::is_none")]
        extra: Option<&'static str>,
    }

    impl Experiment for Toy {
        const NAME: &'static str = "toy";
        const SEED: &'static str = "999";
        const ABOUT: &'static str = "a toy";
        const TITLE: &'static str = "toy title";
        const SPLIT_BY: Option<&'static str> = None;
        type Config = u32;
        type Measurement = Vec<f64>;
        type Row = ToyRow;

        fn configure(opts: &LabOpts) -> Result<u32> {
            opts.param("depth", 2)
        }
        fn measure(cfg: &u32) -> Result<Vec<f64>> {
            Ok(vec![f64::from(*cfg) * 1000.5, 2000.0])
        }
        fn columns(_: &u32) -> Vec<String> {
            vec!["depth".into(), "iops".into()]
        }
        fn rows(cfg: &u32, m: &Vec<f64>) -> Vec<ToyRow> {
            vec![
                ToyRow {
                    depth: *cfg,
                    iops: m[0],
                    extra: None,
                },
                ToyRow {
                    depth: cfg * 2,
                    iops: m[1],
                    extra: Some("a"),
                },
            ]
        }
        fn checks(_: &u32, _: &Vec<f64>, rows: &[ToyRow]) -> Vec<Check> {
            vec![check("rises", rows[1].iops > rows[0].iops, "2000 > 2001")]
        }
        fn notes(_: &u32, _: &Vec<f64>, _: &[ToyRow]) -> Vec<String> {
            vec!["a note".into()]
        }
        fn seed_table() -> Option<SeedTable> {
            None
        }
        fn figures() -> Vec<Figure> {
            Vec::new()
        }
    }

    /// The typed report is the one `push_row` builds from the same cells.
    #[test]
    fn typed_report_equals_the_hand_built_one() {
        let r = run::<Toy>(&LabOpts::default()).unwrap();
        let mut want = LabReport::new("toy", "toy title", &["depth", "iops"]);
        want.push_row([("depth", json!(2)), ("iops", json!(2001.0))]);
        want.push_row([
            ("depth", json!(4)),
            ("iops", json!(2000.0)),
            ("extra", json!("a")),
        ]);
        want.check("rises", false, "2000 > 2001");
        want.note("a note");
        assert_eq!(r.to_json().to_string(), want.to_json().to_string());
        let e = Entry::of::<Toy>();
        assert_eq!((e.name, e.seed, e.about), ("toy", "999", "a toy"));
    }

    #[test]
    fn a_bad_setting_fails_before_measuring() {
        let mut opts = LabOpts::default();
        opts.params.insert("depth".into(), "x".into());
        assert!(run::<Toy>(&opts).is_err());
    }
}
