//! What an experiment produces: our table, the seed's published table
//! beside it, the checks that say whether the seed's claim reproduced, and
//! notes. Written as text (terminal), `NAME.json` and `NAME.svg`.
//!
//! The JSON shape is fixed by the issue: an object with `experiment` and
//! `rows`, one object per table row keyed by the table's column names
//! (plus `title`, `columns`, `seed`, `checks`, `notes` for context).

use serde::Serialize;
use serde_json::{Map, Value};
use std::fmt::Write as _;

/// One row: column name -> value, in column order.
pub type Row = Map<String, Value>;

/// The seed's published figures, shown for shape beside ours.
#[derive(Clone, Debug, Serialize, Default)]
pub struct SeedTable {
    pub caption: String,
    pub columns: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

/// A claim of the issue checked against this run's figures.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub name: String,
    pub pass: bool,
    pub detail: String,
}

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq, Default)]
pub enum PlotKind {
    /// One line per series over the rows' x values.
    #[default]
    Line,
    /// Grouped bars per x value (for categorical x such as path names).
    Bar,
}

/// How to draw the SVG: which column is x, which columns are series.
#[derive(Clone, Debug, Serialize, Default)]
pub struct PlotSpec {
    pub x: String,
    pub series: Vec<String>,
    pub x_label: String,
    pub y_label: String,
    pub kind: PlotKind,
    /// Only rows where every `filter` column equals the value are drawn
    /// (e.g. one table holds read and write rows; plot one of them).
    pub filter: Vec<(String, Value)>,
}

#[derive(Clone, Debug, Serialize, Default)]
pub struct LabReport {
    pub experiment: String,
    pub title: String,
    pub columns: Vec<String>,
    pub rows: Vec<Row>,
    pub seed: Option<SeedTable>,
    pub checks: Vec<Check>,
    pub notes: Vec<String>,
    #[serde(skip)]
    pub plot: Option<PlotSpec>,
    /// The command that reproduces this run.
    pub command: String,
}

impl LabReport {
    pub fn new(experiment: &str, title: &str, columns: &[&str]) -> LabReport {
        LabReport {
            experiment: experiment.to_string(),
            title: title.to_string(),
            columns: columns.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    /// Add a row given as (column, value) pairs; columns not declared are
    /// appended to the column list.
    pub fn push_row<I, K, V>(&mut self, cells: I)
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<Value>,
    {
        let mut row = Row::new();
        for (k, v) in cells {
            let k = k.into();
            if !self.columns.contains(&k) {
                self.columns.push(k.clone());
            }
            row.insert(k, v.into());
        }
        self.rows.push(row);
    }

    pub fn check(&mut self, name: &str, pass: bool, detail: impl Into<String>) {
        self.checks.push(Check {
            name: name.to_string(),
            pass,
            detail: detail.into(),
        });
    }

    pub fn note(&mut self, note: impl Into<String>) {
        self.notes.push(note.into());
    }

    pub fn all_checks_pass(&self) -> bool {
        self.checks.iter().all(|c| c.pass)
    }

    /// The JSON document written to `NAME.json`.
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// Human-readable text: our table, the seed's, checks and notes.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "== lab {}: {}", self.experiment, self.title);
        let cells: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| self.columns.iter().map(|c| fmt_value(r.get(c))).collect())
            .collect();
        s.push_str(&render_grid(&self.columns, &cells));
        if let Some(seed) = &self.seed {
            let _ = writeln!(s, "\n-- seed: {}", seed.caption);
            s.push_str(&render_grid(&seed.columns, &seed.rows));
        }
        if !self.checks.is_empty() {
            s.push('\n');
            for c in &self.checks {
                let _ = writeln!(
                    s,
                    "[{}] {}: {}",
                    if c.pass { "PASS" } else { "FAIL" },
                    c.name,
                    c.detail
                );
            }
        }
        for n in &self.notes {
            let _ = writeln!(s, "note: {n}");
        }
        if !self.command.is_empty() {
            let _ = writeln!(s, "reproduce: {}", self.command);
        }
        s
    }
}

/// Format a cell: integers plainly, floats with 3 significant decimals.
pub fn fmt_value(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "-".into(),
        Some(Value::Number(n)) => {
            if let Some(i) = n.as_i64() {
                i.to_string()
            } else if let Some(f) = n.as_f64() {
                if f.abs() >= 1000.0 {
                    format!("{f:.0}")
                } else if f.abs() >= 10.0 {
                    format!("{f:.1}")
                } else {
                    format!("{f:.3}")
                }
            } else {
                n.to_string()
            }
        }
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    }
}

fn render_grid(columns: &[String], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = columns.iter().map(|c| c.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(c.len());
            }
        }
    }
    let mut s = String::new();
    let line = |cells: &[String]| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{:>w$}", c, w = widths.get(i).copied().unwrap_or(0)))
            .collect::<Vec<_>>()
            .join("  ")
    };
    let _ = writeln!(s, "{}", line(columns));
    let _ = writeln!(
        s,
        "{}",
        widths
            .iter()
            .map(|w| "-".repeat(*w))
            .collect::<Vec<_>>()
            .join("  ")
    );
    for r in rows {
        let _ = writeln!(s, "{}", line(r));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rows_keyed_by_columns_in_order() {
        let mut r = LabReport::new("x", "t", &["depth", "iops"]);
        r.push_row([("depth", json!(2)), ("iops", json!(1234.5))]);
        r.push_row([
            ("depth", json!(4)),
            ("iops", json!(2000.0)),
            ("extra", json!("a")),
        ]);
        let j = r.to_json();
        assert_eq!(j["experiment"], "x");
        assert_eq!(j["rows"][1]["extra"], "a");
        assert_eq!(r.columns, vec!["depth", "iops", "extra"]);
        let text = r.to_text();
        assert!(text.contains(" 1234 "), "{text}");
        assert!(text.lines().nth(1).unwrap().contains("depth"));
    }

    #[test]
    fn checks_are_reported() {
        let mut r = LabReport::new("x", "t", &["a"]);
        r.check("claim", false, "1 < 2");
        assert!(!r.all_checks_pass());
        assert!(r.to_text().contains("[FAIL] claim: 1 < 2"));
    }
}
