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
//! [`run`] is the experiment's entry: the in-process table
//! ([`crate::mpath`]) with this one added to its report.

use crate::common::{mean_sd, round};
use crate::mpath::{multipath_line, run_policy, Load, Policy};
use crate::netns::{self, delay_over_file, Daemon, Testbed};
use crate::report::LabReport;
use crate::LabOpts;
use anyhow::{bail, ensure, Context, Result};
use serde_json::json;
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

/// Add the remote-paths rows, checks and notes to `r`, or a note saying
/// why they could not be measured here.
/// `lab mpath`: the in-process table, then this one.
pub fn run(opts: &LabOpts) -> Result<LabReport> {
    crate::mpath::run_with(opts, add_table)
}

fn add_table(opts: &LabOpts, r: &mut LabReport, policies: &[Policy], load: &Load) -> Result<()> {
    let host_ms: Vec<f64> = opts.param_list("host_ms", &HOST_MS)?;
    if host_ms.is_empty()
        || host_ms.len() > 64
        || host_ms.iter().any(|m| !m.is_finite() || *m <= 0.0)
    {
        bail!("--set host_ms: give 1..64 positive delays in ms");
    }
    if let Err(why) = netns::probe() {
        r.note(format!(
            "remote-paths table skipped: network namespaces cannot be made here ({why:#}); it needs root and iproute2"
        ));
        return Ok(());
    }
    if let Err(why) = server_binary() {
        r.note(format!("remote-paths table skipped: {why:#}"));
        return Ok(());
    }
    // A failure here (a server that does not start, an I/O error) costs
    // this table only: the in-process one is kept, and a failed check
    // says what went wrong.
    if let Err(e) = measure(r, policies, load, &host_ms) {
        r.check(
            "remote paths: the table was measured",
            false,
            format!("{e:#}"),
        );
    }
    Ok(())
}

/// Start the hosts, run every policy over them, add rows, checks, notes.
fn measure(r: &mut LabReport, policies: &[Policy], load: &Load, host_ms: &[f64]) -> Result<()> {
    let hosts = RemotePaths::start(host_ms).context("starting the hosts")?;
    let n = host_ms.len();
    crate::progress::expect_runs((load.repeats * policies.len()) as u64);
    // shares[policy][repeat][path]
    let mut shares: Vec<Vec<Vec<f64>>> = vec![Vec::new(); policies.len()];
    let mut iops: Vec<Vec<f64>> = vec![Vec::new(); policies.len()];
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
            shares[pi].push(o.shares);
            iops[pi].push(o.iops);
        }
    }
    let mean = |pi: usize, path: usize| -> f64 {
        mean_sd(&shares[pi].iter().map(|s| s[path]).collect::<Vec<_>>()).0
    };
    let column = |name: &str| policies.iter().position(|p| p.column == name);
    let fastest = host_ms.iter().cloned().fold(f64::INFINITY, f64::min);
    let capacity: f64 = host_ms.iter().map(|m| 1.0 / m).sum();
    let ideal: Vec<f64> = host_ms.iter().map(|m| (1.0 / m) / capacity).collect();
    for (path, ms) in host_ms.iter().enumerate() {
        let mut row = vec![
            ("table", json!(TABLE)),
            ("path", json!(format!("h{path}"))),
            ("cost", json!(round(ms / fastest, 3))),
            ("latency_ms", json!(ms)),
            ("ideal", json!(round(ideal[path], 3))),
        ];
        for (pi, p) in policies.iter().enumerate() {
            row.push((p.column, json!(round(mean(pi, path), 3))));
        }
        r.push_row(row);
    }
    let gap = |pi: usize| -> f64 {
        (0..n)
            .map(|p| (mean(pi, p) - ideal[p]).abs())
            .fold(0.0, f64::max)
    };
    // Upstream's claim, on the path that shows it: HST with the kernel's
    // jiffies start times never works the slowest path's inflated
    // history down, so it starves; with ns start times it gets its share.
    let slowest = (0..n)
        .max_by(|&a, &b| host_ms[a].total_cmp(&host_ms[b]))
        .unwrap_or(0);
    if let (Some(ns), Some(jf)) = (column("hst_ns"), column("hst_jiffies")) {
        let (ns_share, jf_share, want) = (mean(ns, slowest), mean(jf, slowest), ideal[slowest]);
        r.check(
            "remote paths: HST with jiffies start times starves the slowest host (under a quarter of its ideal share), with ns it gets at least half",
            jf_share < 0.25 * want && ns_share >= 0.5 * want,
            format!(
                "h{slowest} ({} ms): jiffies {jf_share:.3}, ns {ns_share:.3}, ideal {want:.3}",
                host_ms[slowest]
            ),
        );
    }
    for (pi, p) in policies.iter().enumerate() {
        let (m, sd) = mean_sd(&iops[pi]);
        r.note(format!(
            "remote paths, {}: {m:.0} IOPS (sd {sd:.0}), largest gap to ideal {:.3}",
            p.column,
            gap(pi)
        ));
    }
    r.note(format!(
        "remote paths (table={TABLE}): {n} hosts in network namespaces on one bridge, each blkstack serve exporting a delay target of {} ms (load_k=1) over one shared file; the multipath runs in a client namespace over nbd leaves (TCP)",
        host_ms.iter().map(|m| m.to_string()).collect::<Vec<_>>().join("/")
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
    fn bad_host_delays_are_refused() {
        for bad in ["0", "-1", "0.1,x", "nan"] {
            let mut opts = LabOpts::default();
            opts.params.insert("host_ms".into(), bad.into());
            let mut r = LabReport::new("mpath", "t", &[]);
            let load = Load {
                qd: 1,
                jobs: 1,
                runtime: Duration::from_millis(10),
                warmup: Duration::from_millis(1),
                repeats: 1,
            };
            assert!(add_table(&opts, &mut r, &[], &load).is_err(), "{bad}");
            assert!(
                r.rows.is_empty() && r.notes.is_empty(),
                "{bad}: changed the report"
            );
        }
    }
}
