//! `blkstack crashtest`: record a workload through a `log-writes` stack,
//! then replay the log to every crash point through the overlay and check
//! each: a block workload in this process (`verify`, `journal`), or ext4 /
//! xfs in the kernel VM's guest (see `guest.rs`). Prints the points
//! checked and each failure with its entry and the checker's output, and
//! writes a JSON report. A bad log, a truncated one or a missing mark is
//! refused before anything is replayed.

use crate::block::{run_verify, Journal, Recorder, BLOCK};
use crate::guest::{self, Fs, FsOptions, MKFS_MARK};
use crate::report::Report;
use crate::runner::{Overlay, Walker};
use crate::walk::{plan, PlanOptions, PointRule};
use anyhow::{bail, Context};
use blkstack_mapped::Registry;
use clap::Args;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// Rounds of concurrent self-describing block writes, a FLUSH after
    /// each; the bench's verify rule at every point.
    Verify,
    /// A filesystem-like journal: data, FLUSH, FUA commit record.
    Journal,
    /// ext4 in the kernel VM, e2fsck -fn at every point.
    Ext4,
    /// xfs in the kernel VM, xfs_repair -n at every point.
    Xfs,
}

/// `blkstack crashtest` options.
#[derive(Args, Debug)]
pub struct CrashtestArgs {
    #[arg(long, value_enum)]
    workload: Workload,
    /// Plant the ordering bug (journal: the commit record without the
    /// flush that must precede it).
    #[arg(long)]
    plant_bug: bool,
    /// Crash points: flush,fua (every FLUSH or FUA entry), flush, fua,
    /// marks, or every:N entries.
    #[arg(long, default_value = "flush,fua", value_name = "RULE")]
    points: PointRule,
    /// Check only every Nth of those points.
    #[arg(long, default_value_t = 1, value_name = "N")]
    every: u64,
    /// Check at most this many points.
    #[arg(long, value_name = "N")]
    max_points: Option<usize>,
    /// Points start after this mark (default: the filesystem workloads'
    /// mark after mkfs).
    #[arg(long, value_name = "TEXT")]
    start_mark: Option<String>,
    /// Points from the log's first entry, even for a filesystem workload
    /// (whose states before mkfs ended are not filesystems: they fail).
    #[arg(long, conflicts_with = "start_mark")]
    from_start: bool,
    /// Workload size: verify rounds, journal transactions, or the
    /// filesystem workload's steps (each ends with a sync).
    #[arg(long, value_name = "N")]
    ops: Option<u64>,
    /// Device size in MiB (default: 16 for block workloads, the smallest
    /// the filesystem takes with room for the workload otherwise).
    #[arg(long, value_name = "MIB")]
    size_mib: Option<u64>,
    /// Check this existing log instead of running the workload (journal,
    /// ext4 and xfs; verify needs its own run's expectations).
    #[arg(long, value_name = "LOG")]
    log: Option<PathBuf>,
    /// Keep the recorded log in this file (default: a temporary file).
    #[arg(long, value_name = "FILE", conflicts_with = "log")]
    keep_log: Option<PathBuf>,
    /// Write the JSON report here.
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
    /// Stop at the first failing point.
    #[arg(long)]
    stop_at_failure: bool,
    /// The kernel VM script (filesystem workloads).
    #[arg(long, value_name = "PATH", default_value_os_t = guest::default_vm_script())]
    vm_script: PathBuf,
    /// Bound on the guest's whole run, in seconds.
    #[arg(long, default_value_t = 3600, value_name = "S")]
    vm_timeout: u64,
}

fn rule_text(a: &CrashtestArgs) -> String {
    let r = match a.points {
        PointRule::Durable => "flush,fua".to_string(),
        PointRule::Flush => "flush".into(),
        PointRule::Fua => "fua".into(),
        PointRule::Marks => "marks".into(),
        PointRule::Every(n) => format!("every:{n}"),
    };
    if a.every > 1 {
        format!("{r}, every {}th", a.every)
    } else {
        r
    }
}

pub fn run(a: CrashtestArgs) -> anyhow::Result<()> {
    if a.every == 0 {
        bail!("--every 0: give a positive N");
    }
    if a.plant_bug && a.workload != Workload::Journal {
        bail!("--plant-bug: only the journal workload has a bug to plant");
    }
    if a.log.is_some() && a.workload == Workload::Verify {
        bail!("--log with --workload verify: verify checks against its own run's writes; record a new log");
    }
    let scratch = tempfile::tempdir()?;
    let log_path = a
        .keep_log
        .clone()
        .unwrap_or_else(|| scratch.path().join("crashtest.log"));
    let fs = match a.workload {
        Workload::Ext4 => Some(Fs::Ext4),
        Workload::Xfs => Some(Fs::Xfs),
        _ => None,
    };
    let plan_opts = PlanOptions {
        rule: a.points,
        start_mark: match (&a.start_mark, a.from_start) {
            (Some(m), _) => Some(m.clone()),
            (None, true) => None,
            (None, false) => fs.map(|_| MKFS_MARK.to_string()),
        },
        every_nth: a.every,
        max_points: a.max_points,
    };
    let walker = match fs {
        Some(fs) => {
            let mib = a.size_mib.unwrap_or(fs.min_mib());
            if mib < fs.min_mib() {
                bail!("--size-mib {mib}: {fs:?} needs at least {}", fs.min_mib());
            }
            guest::run(&FsOptions {
                fs,
                sectors: mib << 11,
                steps: a.ops.unwrap_or(40),
                existing_log: a.log.clone(),
                log_path: log_path.clone(),
                plan: plan_opts,
                vm_script: a.vm_script.clone(),
                vm_timeout_s: a.vm_timeout,
                stop_at_failure: a.stop_at_failure,
            })?
        }
        None => run_block(&a, &log_path, &plan_opts)?,
    };
    let shown_log = match (&a.log, &a.keep_log) {
        (Some(l), _) | (None, Some(l)) => l.display().to_string(),
        (None, None) => "(a temporary file, removed; --keep-log keeps it)".to_string(),
    };
    let wl = format!("{:?}", a.workload).to_lowercase();
    let report = Report::new(&wl, a.plant_bug, &shown_log, &rule_text(&a), &walker);
    report.print(&mut std::io::stdout().lock())?;
    if let Some(p) = &a.report {
        std::fs::write(p, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing the report {}", p.display()))?;
    }
    if !report.failures.is_empty() {
        bail!(
            "{} of {} crash points failed; the first at log entry {}",
            report.failures.len(),
            report.points_checked,
            report.first_failure_entry.unwrap_or_default()
        );
    }
    Ok(())
}

/// Record (unless given a log) and check a block workload in process.
fn run_block(a: &CrashtestArgs, log_path: &Path, o: &PlanOptions) -> anyhow::Result<Walker> {
    let mib = a.size_mib.unwrap_or(16);
    let sectors = mib << 11;
    let blocks = sectors * 512 / BLOCK as u64;
    let journal = Journal {
        txns: a.ops.unwrap_or(64),
        per_txn: 4,
    };
    if a.workload == Workload::Journal && journal.blocks() > blocks {
        bail!(
            "--ops {}: the journal needs {} blocks, the device has {blocks} (raise --size-mib)",
            journal.txns,
            journal.blocks()
        );
    }
    let mut model = None;
    let log = match &a.log {
        Some(l) => l.clone(),
        None => {
            let rec = Recorder::create(log_path, sectors, sectors * 4)?;
            let dev = rec.device()?;
            match a.workload {
                Workload::Verify => {
                    let rounds = a.ops.unwrap_or(100);
                    model = Some(run_verify(&dev, blocks.min(1024), rounds, 8)?);
                }
                _ => journal.run(&dev, a.plant_bug)?,
            }
            drop(dev);
            rec.finish()?
        }
    };
    // Every bad input is refused here, before a device is made.
    let p = plan(&log, o)?;
    let reg = Registry::new();
    let overlay = Overlay::create(reg, sectors)?;
    let mut w = Walker::new(&log, p, overlay)?;
    match &model {
        Some(m) => w.run(a.stop_at_failure, &mut |p, dev| m.check(dev, p.flushes))?,
        None => w.run(a.stop_at_failure, &mut |_, dev| journal.check(dev))?,
    }
    Ok(w)
}
