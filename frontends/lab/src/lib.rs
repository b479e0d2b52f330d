//! `blkstack lab`: five upstream block-layer changes, each rerun with the
//! old and the new mechanism side by side, printed beside the figures
//! upstream published, checked against the claims the issues make, and
//! written as `NAME.json`, `NAME.svg` and a section of `index.html` (one
//! self-contained report page for every experiment run into the output
//! directory). `lab compare A B` puts two runs side by side.
//!
//! An experiment is one module with a type implementing
//! [`experiment::Experiment`] (configure, measure, rows, checks, notes,
//! figures) and one line in [`EXPERIMENTS`].

pub mod common;
pub mod compare;
pub mod delay;
pub mod experiment;
pub mod figures;
pub mod html;
pub mod hybrid_poll;
pub mod machine;
pub mod mpath;
pub mod mpath_hosts;
pub mod mq_run;
pub mod netns;
pub mod plot;
pub mod progress;
pub mod report;
pub mod sbitmap;

use anyhow::{anyhow, bail, Context, Result};
use experiment::Entry;
use report::LabReport;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Options every experiment gets.
#[derive(Clone, Debug, Default)]
pub struct LabOpts {
    /// Each experiment under 60 s.
    pub quick: bool,
    /// Repetitions per point (experiments choose a default when `None`).
    pub repeats: Option<usize>,
    /// Parallel jobs (experiments choose a default suited to the machine).
    pub jobs: Option<usize>,
    /// Experiment-specific `key=value` settings (`--set`).
    pub params: BTreeMap<String, String>,
}

impl LabOpts {
    /// The command line that reruns experiment `name` with these options.
    pub fn command_for(&self, name: &str) -> String {
        let mut c = format!("cargo run --release -- lab {name}");
        if self.quick {
            c.push_str(" --quick");
        }
        if let Some(r) = self.repeats {
            c.push_str(&format!(" --repeats {r}"));
        }
        if let Some(j) = self.jobs {
            c.push_str(&format!(" --jobs {j}"));
        }
        for (k, v) in &self.params {
            c.push_str(&format!(" --set {k}={v}"));
        }
        c
    }

    /// A `--set key=value` parameter parsed as `T`, or `default`.
    pub fn param<T: std::str::FromStr>(&self, key: &str, default: T) -> Result<T> {
        match self.params.get(key) {
            None => Ok(default),
            Some(v) => v
                .parse::<T>()
                .map_err(|_| anyhow!("--set {key}={v}: not a valid value")),
        }
    }

    /// A comma-separated list parameter.
    pub fn param_list<T: std::str::FromStr + Clone>(
        &self,
        key: &str,
        default: &[T],
    ) -> Result<Vec<T>> {
        match self.params.get(key) {
            None => Ok(default.to_vec()),
            Some(v) => v
                .split(',')
                .map(|x| {
                    x.trim()
                        .parse::<T>()
                        .map_err(|_| anyhow!("--set {key}={v}: '{x}' is not valid"))
                })
                .collect(),
        }
    }
}

/// Every experiment, in the order of the upstream changes' dates.
pub static EXPERIMENTS: &[Entry] = &[
    Entry::of::<delay::Delay>(),
    Entry::of::<mq_run::MqRun>(),
    Entry::of::<hybrid_poll::HybridPoll>(),
    Entry::of::<sbitmap::Sbitmap>(),
    Entry::of::<mpath_hosts::Mpath>(),
];

#[derive(clap::Args, Debug)]
#[command(
    about = "Rerun the upstream experiments (old vs new mechanism) beside upstream's figures; write JSON, SVG and index.html",
    after_help = "`lab compare A.json B.json` (or two output directories) shows two runs side by side."
)]
pub struct LabArgs {
    /// Experiment name, `all`, or `compare`. `--list` shows them.
    pub experiment: Option<String>,
    /// For `compare`: the two runs (two NAME.json files or two output
    /// directories).
    #[arg(value_name = "RUN")]
    pub runs: Vec<PathBuf>,
    /// Short runs: each experiment under 60 s.
    #[arg(long)]
    pub quick: bool,
    /// Directory for NAME.json and NAME.svg (created if missing).
    #[arg(long, default_value = "lab-out")]
    pub out: PathBuf,
    /// Repetitions per point.
    #[arg(long)]
    pub repeats: Option<usize>,
    /// Parallel jobs where the experiment has them.
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Experiment-specific setting, `key=value` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// List the experiments and exit.
    #[arg(long)]
    pub list: bool,
    /// Exit non-zero when a check does not reproduce (errors always do).
    #[arg(long)]
    pub strict: bool,
}

fn list() -> String {
    let mut s = String::from("experiments:\n");
    for e in EXPERIMENTS {
        s.push_str(&format!("  {:<12} {}\n", e.name, e.about));
    }
    s.push_str("  all          every experiment above\n");
    s.push_str("  compare A B  two runs side by side (NAME.json files or output directories)\n");
    s.push_str(
        "  report       redraw --out's figures and index.html from the NAME.json files there\n",
    );
    s
}

/// Run one experiment and write its outputs: `NAME.json`, its figures as
/// `NAME*.svg`, and `index.html` rebuilt from every report in `out`.
pub fn run_one(e: &Entry, opts: &LabOpts, out: &std::path::Path) -> Result<LabReport> {
    let started = std::time::Instant::now();
    let load_before = machine::load_average();
    progress::begin(e.name);
    let result = (e.run)(opts);
    progress::finish();
    let mut report = result.with_context(|| format!("lab {}", e.name))?;
    if report.command.is_empty() {
        report.command = opts.command_for(e.name);
    }
    report.machine = Some(machine::describe(load_before));
    report.note(format!("ran in {:.1} s", started.elapsed().as_secs_f64()));
    write_outputs(&report, out)?;
    Ok(report)
}

/// Write `report`'s JSON and SVG files into `out` and rebuild the page.
pub fn write_outputs(report: &report::LabReport, out: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let json_path = out.join(format!("{}.json", report.experiment));
    std::fs::write(&json_path, serde_json::to_string_pretty(&report.to_json())?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    write_figures(report, out)?;
    html::write_index(out)?;
    Ok(())
}

/// Draw `report`'s figures into `out` as `NAME.svg` (`NAME-SUFFIX.svg`).
pub fn write_figures(report: &report::LabReport, out: &std::path::Path) -> Result<()> {
    for fig in figures::figures_for(report) {
        let stem = if fig.suffix.is_empty() {
            report.experiment.clone()
        } else {
            format!("{}-{}", report.experiment, fig.suffix)
        };
        let svg_path = out.join(format!("{stem}.svg"));
        std::fs::write(&svg_path, plot::render_svg(&fig, &report.rows)?)
            .with_context(|| format!("writing {}", svg_path.display()))?;
    }
    Ok(())
}

/// `lab report`: redraw every saved report's figures in `out` and rebuild
/// its page (after a change to the figures, or on copied JSON files).
fn rebuild_report(out: &std::path::Path) -> Result<std::path::PathBuf> {
    for (_, report) in html::load_reports(out)? {
        if let Some(r) = report {
            write_figures(&r, out)?;
        }
    }
    html::write_index(out)
}

/// `lab compare` and `lab report`, which run no experiment; `None` for
/// any other name.
fn run_tool(name: &str, args: &LabArgs) -> Option<Result<()>> {
    match name {
        "compare" => Some(match args.runs.as_slice() {
            [a, b] => compare::compare_paths(a, b).map(|text| print!("{text}")),
            runs => Err(anyhow!(
                "lab compare takes two runs (NAME.json files or output directories), got {}",
                runs.len()
            )),
        }),
        "report" => {
            Some(rebuild_report(&args.out).map(|page| println!("wrote {}", page.display())))
        }
        _ => None,
    }
}

/// The experiments' options from the command line, checked.
fn lab_opts(args: &LabArgs) -> Result<LabOpts> {
    let mut params = BTreeMap::new();
    for kv in &args.set {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| anyhow!("--set {kv}: expected KEY=VALUE"))?;
        params.insert(k.trim().to_string(), v.trim().to_string());
    }
    let opts = LabOpts {
        quick: args.quick,
        repeats: args.repeats,
        jobs: args.jobs,
        params,
    };
    if args.repeats == Some(0) {
        bail!("--repeats must be at least 1");
    }
    if args.jobs == Some(0) {
        bail!("--jobs must be at least 1");
    }
    Ok(opts)
}

/// Where the outputs are and which checks did not reproduce.
fn print_summary(out: &std::path::Path, unreproduced: &[String]) {
    println!(
        "outputs in {} (report page: {})",
        out.display(),
        out.join("index.html").display()
    );
    if unreproduced.is_empty() {
        println!("every check reproduced");
    } else {
        println!(
            "{} check(s) not reproduced on this run:",
            unreproduced.len()
        );
        for u in unreproduced {
            println!("  {u}");
        }
    }
}

/// `blkstack lab`.
pub fn run_cli(args: LabArgs) -> Result<()> {
    if args.list {
        print!("{}", list());
        return Ok(());
    }
    let Some(name) = args.experiment.as_deref() else {
        bail!("name an experiment or `all`\n{}", list());
    };
    if let Some(done) = run_tool(name, &args) {
        return done;
    }
    if !args.runs.is_empty() {
        bail!(
            "unexpected argument(s) after '{name}': {} (only `lab compare` takes runs)",
            args.runs
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    let opts = lab_opts(&args)?;
    let selected: Vec<&Entry> = if name == "all" {
        EXPERIMENTS.iter().collect()
    } else {
        match EXPERIMENTS.iter().find(|e| e.name == name) {
            Some(e) => vec![e],
            None => bail!("unknown experiment '{name}'\n{}", list()),
        }
    };
    if selected.is_empty() {
        bail!("no experiments are built yet");
    }
    let mut errors = Vec::new();
    let mut unreproduced = Vec::new();
    for e in selected {
        eprintln!(
            "lab {}: running{}...",
            e.name,
            if opts.quick { " (quick)" } else { "" }
        );
        match run_one(e, &opts, &args.out) {
            Ok(r) => {
                println!("{}", r.to_text());
                for c in r.checks.iter().filter(|c| !c.pass) {
                    unreproduced.push(format!("{}: {}", e.name, c.name));
                }
            }
            Err(err) => {
                eprintln!("lab {}: error: {err:#}", e.name);
                errors.push(e.name);
            }
        }
    }
    print_summary(&args.out, &unreproduced);
    if !errors.is_empty() {
        bail!("experiment(s) failed to run: {}", errors.join(", "));
    }
    if args.strict && !unreproduced.is_empty() {
        bail!("--strict: {} check(s) not reproduced", unreproduced.len());
    }
    Ok(())
}
