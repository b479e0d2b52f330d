//! What an experiment produces: our table, the upstream patch's published
//! table beside it, the checks that say whether its claim reproduced,
//! notes, and the machine it ran on. Written as text (terminal),
//! `NAME.json`, `NAME*.svg` and a section of `index.html`.
//!
//! The JSON shape is fixed by the issue: an object with `experiment` and
//! `rows`, one object per table row keyed by the table's column names
//! (plus `title`, `columns`, `seed`, `checks`, `notes`, `machine` for
//! context). It reads back ([`LabReport::from_json`]) so that the report
//! page and `lab compare` can be made from saved runs.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::fmt::Write as _;

/// One row: column name -> value, in column order.
pub type Row = Map<String, Value>;

/// Upstream's published figures, shown for shape beside ours.
#[derive(Clone, Debug, Serialize, Deserialize, Default)]
pub struct SeedTable {
    pub caption: String,
    pub columns: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

/// A claim of the issue checked against this run's figures.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Check {
    pub name: String,
    pub pass: bool,
    pub detail: String,
}

/// Where a run happened: enough to tell whether two runs can be compared
/// and whether other processes competed for the CPUs.
#[derive(Clone, Debug, Serialize, Deserialize, Default, PartialEq)]
pub struct Machine {
    /// CPUs this process may run on.
    pub cpus: usize,
    /// `uname -sr`.
    pub kernel: String,
    /// CPU model name (`/proc/cpuinfo`), if known.
    pub cpu_model: String,
    /// 1-minute load average before and after the experiment.
    pub load_before: f64,
    pub load_after: f64,
    /// UTC time the experiment finished, RFC 3339.
    pub finished: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, Default)]
pub struct LabReport {
    pub experiment: String,
    pub title: String,
    pub columns: Vec<String>,
    pub rows: Vec<Row>,
    #[serde(default)]
    pub seed: Option<SeedTable>,
    #[serde(default)]
    pub checks: Vec<Check>,
    #[serde(default)]
    pub notes: Vec<String>,
    /// The command that reproduces this run.
    #[serde(default)]
    pub command: String,
    #[serde(default)]
    pub machine: Option<Machine>,
    /// A column whose values name separate tables (`lab mpath`'s
    /// in-process and remote-paths tables): text and page show one grid
    /// per value, each with the columns its rows fill. `None`: one grid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split_by: Option<String>,
}

/// One grid of a report: a caption (the split column's value, empty for
/// an unsplit report), its columns and its cells as text.
pub struct Grid {
    pub caption: String,
    pub columns: Vec<String>,
    pub cells: Vec<Vec<String>>,
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

    /// Add a typed row: its serialized fields, in their order, are the
    /// row's cells (an experiment's `Row` struct, see
    /// [`crate::experiment::Experiment::Row`]).
    pub fn push_typed<T: Serialize>(&mut self, row: &T) -> Result<(), serde_json::Error> {
        match serde_json::to_value(row)? {
            Value::Object(cells) => {
                self.push_row(cells);
                Ok(())
            }
            other => Err(serde::ser::Error::custom(format!(
                "a row must serialize as an object, not {other}"
            ))),
        }
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

    /// A report read back from its `NAME.json`.
    pub fn from_json(text: &str) -> Result<LabReport, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// A row's cell as text, as the tables print it.
    pub fn cell(&self, row: &Row, column: &str) -> String {
        fmt_value(row.get(column))
    }

    /// Our table as grids: one, or one per value of `split_by` (in
    /// order of first appearance) with the columns its rows fill.
    pub fn grids(&self) -> Vec<Grid> {
        let grid = |caption: String, rows: Vec<&Row>, columns: Vec<String>| Grid {
            caption,
            cells: rows
                .iter()
                .map(|r| columns.iter().map(|c| fmt_value(r.get(c))).collect())
                .collect(),
            columns,
        };
        let Some(key) = &self.split_by else {
            return vec![grid(
                String::new(),
                self.rows.iter().collect(),
                self.columns.clone(),
            )];
        };
        let mut captions: Vec<String> = Vec::new();
        for r in &self.rows {
            let c = fmt_value(r.get(key));
            if !captions.contains(&c) {
                captions.push(c);
            }
        }
        captions
            .into_iter()
            .map(|caption| {
                let rows: Vec<&Row> = self
                    .rows
                    .iter()
                    .filter(|r| fmt_value(r.get(key)) == caption)
                    .collect();
                let columns = self
                    .columns
                    .iter()
                    .filter(|c| *c != key)
                    .filter(|c| rows.iter().any(|r| !r.get(*c).is_none_or(Value::is_null)))
                    .cloned()
                    .collect();
                grid(caption, rows, columns)
            })
            .collect()
    }

    /// Human-readable text: our table, upstream's, checks and notes.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "== lab {}: {}", self.experiment, self.title);
        for (i, g) in self.grids().iter().enumerate() {
            if !g.caption.is_empty() {
                let _ = writeln!(s, "{}-- {}:", if i > 0 { "\n" } else { "" }, g.caption);
            }
            s.push_str(&render_grid(&g.columns, &g.cells));
        }
        if let Some(seed) = &self.seed {
            let _ = writeln!(s, "\n-- upstream: {}", seed.caption);
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

/// For a typed row's cell that some rows leave out and others leave
/// empty: `None` is no key, `Some(None)` a `null` cell. Use with
/// `#[serde(default, deserialize_with = "present", skip_serializing_if =
/// "Option::is_none")]` so a saved row reads back the same.
pub fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// A saved report's rows read back as `T` and written again, as text:
/// equal to the saved rows when `T` is the experiment's row type (the
/// typed rows' tests use this on the saved fixtures).
#[cfg(test)]
pub(crate) fn round_trip<T: Serialize + serde::de::DeserializeOwned>(
    saved: &str,
) -> (String, String) {
    let r = LabReport::from_json(saved).expect("saved report parses");
    let typed: Vec<T> = r
        .rows
        .iter()
        .map(|row| {
            serde_json::from_value(Value::Object(row.clone())).expect("row reads as its type")
        })
        .collect();
    let again = serde_json::to_string(&typed).expect("typed rows serialize");
    (
        serde_json::to_string(&r.rows).expect("rows serialize"),
        again,
    )
}

/// Format an axis or table number: no more digits than it needs.
pub fn fmt_num(f: f64) -> String {
    if f.fract() == 0.0 && f.abs() < 1e15 {
        return format!("{f:.0}");
    }
    let s = fmt_value(serde_json::Number::from_f64(f).map(Value::Number).as_ref());
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
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
    fn split_reports_print_one_grid_per_table() {
        let mut r = LabReport::new("x", "t", &["table", "path", "a", "b"]);
        r.push_row([
            ("table", json!("one")),
            ("path", json!("p0")),
            ("a", json!(1)),
        ]);
        r.push_row([
            ("table", json!("two")),
            ("path", json!("h0")),
            ("b", json!(2)),
        ]);
        assert_eq!(r.grids().len(), 1);
        r.split_by = Some("table".into());
        let g = r.grids();
        assert_eq!(g.len(), 2);
        assert_eq!(
            (g[0].caption.as_str(), &g[0].columns[..]),
            ("one", &["path".to_string(), "a".to_string()][..])
        );
        assert_eq!(g[1].columns, vec!["path", "b"]);
        let text = r.to_text();
        assert!(
            text.contains("-- one:") && text.contains("-- two:"),
            "{text}"
        );
        let back = LabReport::from_json(&r.to_json().to_string()).unwrap();
        assert_eq!(back.split_by.as_deref(), Some("table"));
    }

    #[test]
    fn checks_are_reported() {
        let mut r = LabReport::new("x", "t", &["a"]);
        r.check("claim", false, "1 < 2");
        assert!(!r.all_checks_pass());
        assert!(r.to_text().contains("[FAIL] claim: 1 < 2"));
    }
}
