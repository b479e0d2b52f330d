//! `lab mpath`'s second table: the same selectors over real remote
//! paths. Upstream's dm-mpath HST change (nanosecond start times for the
//! historical-service-time selector) was measured on disks behind real
//! paths; here four hosts are network namespaces on one bridge (see
//! [`crate::netns`]), each running `blkstack serve` over the same
//! backing file (one LUN, four paths), and the multipath runs in a
//! client namespace over four `nbd` leaves, one TCP connection per host.
//!
//! There is no netem qdisc in every kernel, so a path's service time is
//! set where a SAN's would come from, on the remote side: each host
//! exports a `delay` target (0.1, 0.2, 0.4 and 0.8 ms by default, with
//! `load_k=1`, so a path's capacity is `1/latency` whatever its queue,
//! as in the in-process table) over a `file` target. The ideal split is
//! then each path's capacity over the sum, `share_i ~ 1/latency_i`, and
//! the network, the NBD framing and the servers' own scheduling add what
//! a real path adds on top.
//!
//! Needs root and iproute2 only; where namespaces cannot be made the
//! table is skipped with a note saying why. The servers are this very
//! binary (`blkstack serve`; `BLKSTACK_BIN` names another).
//!
//! `--set` keys: `host_ms` (comma list of remote delays in ms).
//!
//! [`Mpath`] is the experiment: the in-process table ([`crate::mpath`])
//! with this one added to its report.

use crate::common::round;
use crate::experiment::{check, Experiment};
use crate::mpath::{self, multipath_line, run_policy, Load, Policy, Runs};
use crate::netns::{self, delay_over_file, Daemon, Testbed};
use crate::plot::{Figure, Panel, Series, Style};
use crate::report::{Check, Row as ReportRow, SeedTable};
use crate::LabOpts;
use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use std::path::PathBuf;

/// Remote service times of the four paths, in ms.
const HOST_MS: [f64; 4] = [0.1, 0.2, 0.4, 0.8];
/// The shared LUN: 1 GiB, sparse.
const SECTORS: u64 = 2 * 1024 * 1024;
/// The table's name in the rows' `table` column.
pub const TABLE: &str = "hosts";

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The binary to run `blkstack serve` from: `BLKSTACK_BIN`, else this
/// process when it is the `blkstack` binary.
fn server_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("BLKSTACK_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().context("finding this binary")?;
    ensure!(
        exe.file_name().is_some_and(|n| n == "blkstack"),
        "this process ({}) is not the blkstack binary; set BLKSTACK_BIN",
        exe.display()
    );
    Ok(exe)
}

/// The hosts serving the LUN, each behind its own delay.
struct RemotePaths {
    // Servers go before the namespaces they run in, the files last.
    _servers: Vec<Daemon>,
    bed: Testbed,
    _dir: Scratch,
}

impl RemotePaths {
    fn start(host_ms: &[f64]) -> Result<RemotePaths> {
        let bin = server_binary()?;
        let dir = Scratch(
            std::env::temp_dir().join(format!("blkstack-lab-hosts-{}", netns::unique_prefix())),
        );
        std::fs::create_dir_all(&dir.0).with_context(|| format!("creating {}", dir.0.display()))?;
        let lun = dir.0.join("lun.img");
        std::fs::File::create(&lun)
            .and_then(|f| f.set_len(SECTORS * 512))
            .with_context(|| format!("creating {}", lun.display()))?;
        let bed = Testbed::new(host_ms.len())?;
        let mut servers = Vec::new();
        for (i, ms) in host_ms.iter().enumerate() {
            let stack = delay_over_file(&lun, SECTORS, *ms, true);
            servers.push(bed.start_blkstack(i, &bin, &dir.0, &stack)?);
        }
        Ok(RemotePaths {
            _servers: servers,
            bed,
            _dir: dir,
        })
    }

    /// The client's stack over these hosts.
    fn stack(&self, p: &Policy) -> String {
        let uris: Vec<String> = (0..self.bed.hosts.len())
            .map(|i| self.bed.host_uri(i))
            .collect();
        client_stack(&uris, p)
    }
}

/// The client's stack: an nbd leaf per URI, `dev` the multipath over
/// them with `p`'s selector and features.
fn client_stack(uris: &[String], p: &Policy) -> String {
    let mut s = String::new();
    for (i, uri) in uris.iter().enumerate() {
        s.push_str(&format!("p{i}: 0 {SECTORS} nbd {uri} queue_depth=256\n"));
    }
    s.push_str(&multipath_line(SECTORS, uris.len(), p));
    s
}

/// `lab mpath`: the in-process table ([`crate::mpath`]), then this one.
pub struct Mpath;

/// Both tables' settings.
pub struct Config {
    in_process: mpath::Config,
    /// Remote service times of the hosts, ms.
    host_ms: Vec<f64>,
}

/// What the remote-paths table came to.
enum Remote {
    /// Not run here, and why.
    Skipped(String),
    /// Run, and failed (a server that does not start, an I/O error): the
    /// in-process table is kept and a failed check says what went wrong.
    Failed(String),
    Measured(Runs),
}

/// Both tables' runs.
pub struct Measurement {
    in_process: Runs,
    remote: Remote,
}

impl Experiment for Mpath {
    const NAME: &'static str = "mpath";
    const SEED: &'static str = "004";
    const ABOUT: &'static str =
        "multipath per-path share: service-time vs HST with jiffies and ns start times";
    const TITLE: &'static str = "share of I/O per path, 10 asymmetric paths, randwrite 2 jobs x QD64: service-time, HST with jiffies, tick-truncated and ns start times, ideal";
    const SPLIT_BY: Option<&'static str> = Some("table");
    type Config = Config;
    type Measurement = Measurement;
    type Row = mpath::Row;

    fn configure(opts: &LabOpts) -> Result<Config> {
        let in_process = mpath::configure(opts)?;
        let host_ms: Vec<f64> = opts.param_list("host_ms", &HOST_MS)?;
        if host_ms.is_empty()
            || host_ms.len() > 64
            || host_ms.iter().any(|m| !m.is_finite() || *m <= 0.0)
        {
            bail!("--set host_ms: give 1..64 positive delays in ms");
        }
        Ok(Config {
            in_process,
            host_ms,
        })
    }

    fn measure(cfg: &Config) -> Result<Measurement> {
        let in_process = mpath::measure(&cfg.in_process)?;
        let remote = if let Err(why) = netns::probe() {
            Remote::Skipped(format!(
                "remote-paths table skipped: network namespaces cannot be made here ({why:#}); it needs root and iproute2"
            ))
        } else if let Err(why) = server_binary() {
            Remote::Skipped(format!("remote-paths table skipped: {why:#}"))
        } else {
            let policies = mpath::remote_policies(cfg.in_process.hz);
            match measure_remote(&policies, &cfg.in_process.load, &cfg.host_ms) {
                Ok(runs) => Remote::Measured(runs),
                Err(e) => Remote::Failed(format!("{e:#}")),
            }
        };
        Ok(Measurement { in_process, remote })
    }

    fn columns(_: &Config) -> Vec<String> {
        mpath::COLUMNS.iter().map(|s| s.to_string()).collect()
    }

    fn rows(cfg: &Config, m: &Measurement) -> Vec<mpath::Row> {
        let mut rows = mpath::rows(&cfg.in_process, &m.in_process);
        if let Remote::Measured(runs) = &m.remote {
            rows.extend(remote_rows(&cfg.host_ms, runs));
        }
        rows
    }

    fn checks(cfg: &Config, m: &Measurement, _: &[mpath::Row]) -> Vec<Check> {
        let mut checks = mpath::checks(&cfg.in_process, &m.in_process);
        match &m.remote {
            Remote::Skipped(_) => {}
            Remote::Failed(e) => checks.push(check(
                "remote paths: the table was measured",
                false,
                e.clone(),
            )),
            Remote::Measured(runs) => checks.extend(remote_check(&cfg.host_ms, runs)),
        }
        checks
    }

    fn notes(cfg: &Config, m: &Measurement, _: &[mpath::Row]) -> Vec<String> {
        let mut notes = mpath::notes(&cfg.in_process, &m.in_process);
        match &m.remote {
            Remote::Skipped(why) => notes.push(why.clone()),
            Remote::Failed(_) => {}
            Remote::Measured(runs) => notes.extend(remote_notes(&cfg.host_ms, runs)),
        }
        notes
    }

    fn seed_table() -> Option<SeedTable> {
        Some(mpath::seed_table())
    }

    fn figures() -> Vec<Figure> {
        vec![figure()]
    }
}

/// Start the hosts, run every policy over them.
fn measure_remote(policies: &[Policy], load: &Load, host_ms: &[f64]) -> Result<Runs> {
    let hosts = RemotePaths::start(host_ms).context("starting the hosts")?;
    let n = host_ms.len();
    crate::progress::expect_runs((load.repeats * policies.len()) as u64);
    let mut runs = Runs::new(policies);
    for _ in 0..load.repeats {
        for (pi, p) in policies.iter().enumerate() {
            let stack = hosts.stack(p);
            let (qd, jobs, runtime, warmup) = (load.qd, load.jobs, load.runtime, load.warmup);
            let o = hosts
                .bed
                .client
                .run(move || run_policy(&stack, n, qd, jobs, runtime, warmup))
                .with_context(|| format!("remote paths, {}", p.column))?;
            ensure!(
                o.errors == 0,
                "remote paths, {}: {} I/O errors",
                p.column,
                o.errors
            );
            runs.shares[pi].push(o.shares);
            runs.iops[pi].push(o.iops);
        }
    }
    Ok(runs)
}

/// Each host's ideal share: its capacity over the sum.
fn ideal(host_ms: &[f64]) -> Vec<f64> {
    let capacity: f64 = host_ms.iter().map(|m| 1.0 / m).sum();
    host_ms.iter().map(|m| (1.0 / m) / capacity).collect()
}

/// The remote table: one row per host.
fn remote_rows(host_ms: &[f64], runs: &Runs) -> Vec<mpath::Row> {
    let fastest = host_ms.iter().cloned().fold(f64::INFINITY, f64::min);
    let ideal = ideal(host_ms);
    let cell = |c: &str, path: usize| runs.cell(c, path).unwrap_or(0.0);
    host_ms
        .iter()
        .enumerate()
        .map(|(path, ms)| mpath::Row {
            table: TABLE.into(),
            path: format!("h{path}"),
            cost: round(ms / fastest, 3),
            latency_ms: Some(*ms),
            ideal: round(ideal[path], 3),
            st: cell("st", path),
            hst_jiffies: cell("hst_jiffies", path),
            hst_tick: runs.cell("hst_tick", path),
            hst_ns: cell("hst_ns", path),
            seed_st: None,
            seed_hst_orig: None,
            seed_hst_ktime: None,
            seed_best: None,
        })
        .collect()
}

/// Upstream's claim, on the path that shows it: HST with the kernel's
/// jiffies start times never works the slowest path's inflated history
/// down, so it starves; with ns start times it gets its share.
fn remote_check(host_ms: &[f64], runs: &Runs) -> Option<Check> {
    let n = host_ms.len();
    let column = |name: &str| runs.columns.iter().position(|c| *c == name);
    let slowest = (0..n)
        .max_by(|&a, &b| host_ms[a].total_cmp(&host_ms[b]))
        .unwrap_or(0);
    let (ns, jf) = (column("hst_ns")?, column("hst_jiffies")?);
    let want = ideal(host_ms)[slowest];
    let (ns_share, jf_share) = (runs.mean_share(ns, slowest), runs.mean_share(jf, slowest));
    Some(check(
        "remote paths: HST with jiffies start times starves the slowest host (under a quarter of its ideal share), with ns it gets at least half",
        jf_share < 0.25 * want && ns_share >= 0.5 * want,
        format!(
            "h{slowest} ({} ms): jiffies {jf_share:.3}, ns {ns_share:.3}, ideal {want:.3}",
            host_ms[slowest]
        ),
    ))
}

/// IOPS and the largest gap per selector; how the hosts were set up.
fn remote_notes(host_ms: &[f64], runs: &Runs) -> Vec<String> {
    let ideal = ideal(host_ms);
    let gap = |pi: usize| -> f64 {
        (0..host_ms.len())
            .map(|p| (runs.mean_share(pi, p) - ideal[p]).abs())
            .fold(0.0, f64::max)
    };
    let mut notes: Vec<String> = runs
        .columns
        .iter()
        .enumerate()
        .map(|(pi, column)| {
            let (m, sd) = runs.iops(pi);
            format!(
                "remote paths, {column}: {m:.0} IOPS (sd {sd:.0}), largest gap to ideal {:.3}",
                gap(pi)
            )
        })
        .collect();
    notes.push(format!(
        "remote paths (table={TABLE}): {} hosts in network namespaces on one bridge, each blkstack serve exporting a delay target of {} ms (load_k=1) over one shared file; the multipath runs in a client namespace over nbd leaves (TCP)",
        host_ms.len(),
        host_ms.iter().map(|m| m.to_string()).collect::<Vec<_>>().join("/")
    ));
    notes
}

/// A row of `lab mpath`'s remote-paths table (hosts in namespaces).
fn remote_path_row(r: &ReportRow) -> bool {
    r.get("table").and_then(Value::as_str) == Some(TABLE)
}

fn figure() -> Figure {
    let mut p = Panel::new(
        "share of I/O per path (path cost in the table)",
        "path",
        "path",
        "share of completed I/O",
    );
    p.bars = true;
    p.skip = Some(remote_path_row);
    p.series = vec![
        Series::column("ideal", Style::Ours, 7, "ideal"),
        Series::column("service-time", Style::Ours, 2, "st"),
        Series::column("HST jiffies (old)", Style::Ours, 3, "hst_jiffies"),
        Series::column("HST ns", Style::Ours, 0, "hst_ns"),
        Series::column("upstream HST orig", Style::Upstream, 3, "seed_hst_orig"),
        Series::column("upstream HST ktime", Style::Upstream, 0, "seed_hst_ktime"),
    ];
    let mut remote = Panel::new(
        "remote paths: share of I/O per host (NBD over veth; remote delay in the table)",
        "path",
        "host",
        "share of completed I/O",
    );
    remote.bars = true;
    remote.filter = vec![("table".into(), json!(TABLE))];
    remote.series = vec![
        Series::column("ideal", Style::Ours, 7, "ideal"),
        Series::column("service-time", Style::Ours, 2, "st"),
        Series::column("HST jiffies (old)", Style::Ours, 3, "hst_jiffies"),
        Series::column("HST ns", Style::Ours, 0, "hst_ns"),
    ];
    Figure {
        suffix: String::new(),
        title: "dm-mpath HST: per-path share with jiffies vs ns start times, in process and over remote paths".into(),
        columns: 1,
        panels: vec![p, remote],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_stack_is_a_multipath_over_one_nbd_leaf_per_host() {
        let p = Policy {
            column: "hst_jiffies",
            selector: "historical-service-time",
            features: "2 start_time jiffies:250".into(),
        };
        let uris = vec![
            "nbd://10.77.0.11:10809/lun".to_string(),
            "nbd://10.77.0.12:10809/lun".to_string(),
        ];
        let text = client_stack(&uris, &p);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(
            lines[1].starts_with("p1: 0 2097152 nbd nbd://10.77.0.12:10809/lun"),
            "{text}"
        );
        assert!(
            lines[2].ends_with(
                "multipath 2 start_time jiffies:250 0 1 1 historical-service-time 0 2 0 p0 p1"
            ),
            "{text}"
        );
    }

    #[test]
    fn bad_host_delays_are_refused_before_any_run() {
        for bad in ["0", "-1", "0.1,x", "nan"] {
            let mut opts = LabOpts::default();
            opts.params.insert("host_ms".into(), bad.into());
            assert!(Mpath::configure(&opts).is_err(), "{bad}");
        }
    }

    #[test]
    fn typed_rows_write_the_saved_report_unchanged() {
        let (saved, again) = crate::report::round_trip::<mpath::Row>(include_str!(
            "../../cli/tests/data/lab-report/mpath.json"
        ));
        assert_eq!(saved, again);
    }
}
