//! `blkstack crashtest`: record a workload through a `log-writes` stack,
//! then replay the log to every crash point through the overlay and check
//! each: a block workload in this process (`verify`, `journal`), or ext4 /
//! xfs in the kernel VM's guest (see `guest.rs`); with `--reorder N`, also
//! N states of the epoch after each FLUSH point (`reorder.rs`). Prints the
//! points checked and each failure with its entry, its state's seed, the
//! `replay-log` command that rebuilds it and the checker's output, and
//! writes a JSON report. A bad log, a truncated one or a missing mark is
//! refused before anything is replayed.

use crate::block::{run_verify, Bug, Journal, Recorder, BLOCK};
use crate::guest::{self, Fs, FsOptions, MKFS_MARK};
use crate::report::Report;
use crate::runner::{Overlay, ReorderOptions, State, Walker};
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
    /// Plant an ordering bug in the journal: no-flush (the default: the
    /// FUA commit record without the flush that must precede it) or
    /// same-epoch (a plain commit write in its data's flush epoch, one
    /// FLUSH after both: only --reorder finds it).
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "no-flush", value_name = "BUG")]
    plant_bug: Option<Bug>,
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
    /// After each FLUSH point, check N more states: the point plus a
    /// seeded random subset of the writes of the epoch after it (FUA
    /// writes always kept), as CrashMonkey does.
    #[arg(long, value_name = "N", default_value_t = 0)]
    reorder: u64,
    /// With --reorder: N more states per point, each with a multi-block
    /// write torn at the log's block size.
    #[arg(long, requires = "reorder")]
    torn: bool,
    /// With --reorder: the states' seeds are derived from this one.
    #[arg(long, value_name = "S", default_value_t = 0)]
    seed: u64,
    /// Write each failing state's device image, as it was checked, to
    /// DIR/state-LABEL.img (block workloads; at most 8 each of in-order,
    /// reorder and torn states).
    #[arg(long, value_name = "DIR")]
    save_failing: Option<PathBuf>,
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

/// A bound on `--reorder`: each state is a check, and the queue of a
/// point's states is held in memory.
const MAX_REORDER: u64 = 1 << 16;

/// Options that do not go together are refused before anything runs.
fn refuse_bad_options(a: &CrashtestArgs, is_fs: bool) -> anyhow::Result<()> {
    if a.every == 0 {
        bail!("--every 0: give a positive N");
    }
    if a.plant_bug.is_some() && a.workload != Workload::Journal {
        bail!("--plant-bug: only the journal workload has a bug to plant");
    }
    if a.log.is_some() && a.workload == Workload::Verify {
        bail!("--log with --workload verify: verify checks against its own run's writes; record a new log");
    }
    if a.reorder > MAX_REORDER {
        bail!(
            "--reorder {}: at most {MAX_REORDER} states per point",
            a.reorder
        );
    }
    if a.torn && a.reorder == 0 {
        bail!("--torn adds states to --reorder N: give N > 0");
    }
    if a.reorder > 0 && !matches!(a.points, PointRule::Durable | PointRule::Flush) {
        bail!("--reorder: states are made after FLUSH points; use --points flush or flush,fua");
    }
    if a.save_failing.is_some() && is_fs {
        bail!("--save-failing: the guest's check mounts the state and changes it; only the block workloads keep it as checked");
    }
    Ok(())
}

pub fn run(a: CrashtestArgs) -> anyhow::Result<()> {
    let fs = match a.workload {
        Workload::Ext4 => Some(Fs::Ext4),
        Workload::Xfs => Some(Fs::Xfs),
        _ => None,
    };
    refuse_bad_options(&a, fs.is_some())?;
    let reorder = (a.reorder > 0).then_some(ReorderOptions {
        states: a.reorder,
        torn: a.torn,
        base_seed: a.seed,
    });
    let scratch = tempfile::tempdir()?;
    let log_path = a
        .keep_log
        .clone()
        .unwrap_or_else(|| scratch.path().join("crashtest.log"));
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
                reorder,
            })?
        }
        None => run_block(&a, &log_path, &plan_opts, reorder)?,
    };
    let shown_log = match (&a.log, &a.keep_log) {
        (Some(l), _) | (None, Some(l)) => l.display().to_string(),
        (None, None) => "(a temporary file, removed; --keep-log keeps it)".to_string(),
    };
    let wl = format!("{:?}", a.workload).to_lowercase();
    let log_used = a.log.clone().unwrap_or(log_path);
    let rebuild = crate::report::Rebuild {
        log: log_used.display().to_string(),
        temporary: a.log.is_none() && a.keep_log.is_none(),
        bytes: walker.overlay.sectors() * 512,
    };
    let bug = a.plant_bug.map(|b| b.name());
    let report = Report::new(&wl, bug, &shown_log, &rule_text(&a), &walker, &rebuild);
    report.print(&mut std::io::stdout().lock())?;
    if let Some(p) = &a.report {
        std::fs::write(p, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing the report {}", p.display()))?;
    }
    if !report.failures.is_empty() {
        bail!(
            "{} of {} crash points and states failed; the first at log entry {}",
            report.failures.len(),
            report.points_checked + report.states_checked,
            report.first_failure_entry.unwrap_or_default()
        );
    }
    Ok(())
}

/// Record (unless given a log) and check a block workload in process.
fn run_block(
    a: &CrashtestArgs,
    log_path: &Path,
    o: &PlanOptions,
    reorder: Option<ReorderOptions>,
) -> anyhow::Result<Walker> {
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
    if let Some(r) = reorder {
        w = w.with_reorder(&log, r)?;
    }
    let mut saver = a
        .save_failing
        .as_deref()
        .map(FailingSaver::new)
        .transpose()?;
    let mut check = |s: &State, dev: &blkstack_core::DeviceRef| {
        let torn = s.variant.as_ref().is_some_and(|v| v.torn);
        let (ok, out) = match &model {
            Some(m) => m.check_state(dev, s.point.flushes, torn),
            None => journal.check(dev),
        };
        if let (false, Some(sv)) = (ok, saver.as_mut()) {
            if let Err(e) = sv.save(s, dev) {
                return (false, format!("{out}\n(saving its image failed: {e:#})"));
            }
        }
        (ok, out)
    };
    w.run(a.stop_at_failure, &mut check)?;
    Ok(w)
}

/// `--save-failing`: failing states' images, as checked (the block
/// checks only read), at most `MAX_SAVED` of each kind (in order,
/// reorder, torn).
struct FailingSaver {
    dir: PathBuf,
    saved: [usize; 3],
}

const MAX_SAVED: usize = 8;

impl FailingSaver {
    fn new(dir: &Path) -> anyhow::Result<FailingSaver> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(FailingSaver {
            dir: dir.to_path_buf(),
            saved: [0; 3],
        })
    }

    fn save(&mut self, s: &State, dev: &blkstack_core::DeviceRef) -> anyhow::Result<()> {
        let kind = match &s.variant {
            None => 0,
            Some(v) if !v.torn => 1,
            Some(_) => 2,
        };
        if self.saved[kind] == MAX_SAVED {
            return Ok(());
        }
        self.saved[kind] += 1;
        let path = self.dir.join(format!("state-{}.img", s.label()));
        let f = std::fs::File::create(&path)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut at = 0;
        while at < dev.size() {
            let n = (dev.size() - at).min(buf.len() as u64) as usize;
            let st = blkstack_core::submit_and_wait(
                &**dev,
                blkstack_core::Op::Read,
                at,
                n as u64,
                &mut buf[..n],
            );
            if !st.is_ok() {
                bail!("reading the state at byte {at}: {st:?}");
            }
            std::os::unix::fs::FileExt::write_all_at(&f, &buf[..n], at)?;
            at += n as u64;
        }
        Ok(())
    }
}
