//! Crash-consistency testing, as xfstests does it with dm-log-writes
//! (generic/455, 457, 482): a `log-writes` target records every change in
//! the order it became durable, and `replay-log` replays the log onto a
//! device to any point a crash could expose, running a checker there.
//! `blkstack replay-log` takes xfstests' `replay-log` options and prints
//! what it prints, so its scripts work unchanged; it reads logs the
//! kernel's dm-log-writes wrote as well as ours. `blkstack crashtest`
//! does the whole method: record a workload, then replay to every crash
//! point through a copy-on-write overlay and check each, and with
//! `--reorder N [--torn]` states a crash inside a flush epoch could leave
//! (CrashMonkey's method, `reorder.rs`), each rebuilt by `replay-log
//! --reorder-seed`.

pub mod block;
pub mod command;
pub mod fuzzing;
pub mod guest;
pub mod log;
pub mod reorder;
pub mod replay;
pub mod report;
pub mod runner;
pub mod sink;
mod stack_device;
pub mod walk;

pub use command::{run as run_crashtest, CrashtestArgs};

use clap::Args;
use std::path::PathBuf;

/// `blkstack replay-log`: xfstests' replay-log options.
#[derive(Args, Debug)]
pub struct ReplayLogArgs {
    /// The log: an image file or a block device a log-writes target wrote.
    #[arg(long, value_name = "LOG")]
    log: PathBuf,
    /// Replay onto this device or image file (without it, print the log's
    /// version, block size and entry count). A name that is no path is a
    /// blkstack device: of the stack file given with --stack, or of the
    /// running serve whose control socket --control names.
    #[arg(long, value_name = "DEV")]
    replay: Option<String>,
    /// With --replay NAME: build the devices of this stack file (dmsetup
    /// concise text or `NAME: <table>` lines) here and replay onto NAME.
    #[arg(long, value_name = "FILE", conflicts_with = "control")]
    stack: Option<PathBuf>,
    /// With --replay NAME: the control socket of the `blkstack serve`
    /// that has NAME; replay writes through its NBD export.
    #[arg(long, value_name = "SOCK")]
    control: Option<PathBuf>,
    /// Replay (or find) this many entries.
    #[arg(long, value_name = "N", default_value_t = 0)]
    limit: u64,
    /// Replay to (or find) the next flush entry.
    #[arg(long)]
    next_flush: bool,
    /// Replay to (or find) the next FUA entry.
    #[arg(long)]
    next_fua: bool,
    /// Start at this entry (from 0).
    #[arg(long, value_name = "N", default_value_t = 0)]
    start_entry: u64,
    /// Start after this mark.
    #[arg(long, value_name = "TEXT")]
    start_mark: Option<String>,
    /// Replay to (or find) this mark.
    #[arg(long, value_name = "TEXT")]
    end_mark: Option<String>,
    /// Print where the entry the other options name is (ENTRY@BLOCK).
    #[arg(long)]
    find: bool,
    /// Print the number of entries in the log.
    #[arg(long)]
    num_entries: bool,
    /// Skip discard entries.
    #[arg(long)]
    no_discard: bool,
    /// Checker to run (through sh -c) at each --check point; replay stops
    /// at the first one that fails.
    #[arg(long, value_name = "CMD")]
    fsck: Option<String>,
    /// When to run --fsck: every N entries, at each flush or at each FUA.
    #[arg(long, value_name = "N|flush|fua")]
    check: Option<replay::Check>,
    /// Replay only entries that reach this sector or beyond.
    #[arg(long, value_name = "SECTOR", default_value_t = 0)]
    start_sector: u64,
    /// Replay only entries that start at or before this sector.
    #[arg(long, value_name = "SECTOR")]
    end_sector: Option<u64>,
    /// After the replay stops (at a FLUSH entry, e.g. --limit K+1), add the
    /// crash state this seed makes of the flush epoch after it: a subset
    /// of its writes and discards, its FUA writes always (crashtest prints
    /// the seed of each state that failed).
    #[arg(long, value_name = "SEED")]
    reorder_seed: Option<u64>,
    /// With --reorder-seed: the state with a torn multi-block write.
    #[arg(long, requires = "reorder_seed")]
    torn: bool,
}

/// Run `replay-log`; `verbose` is the global `-v` count (1: print the
/// replayed entries, 2: the skipped ones too), as replay-log's own -v.
pub fn run_replay_log(a: ReplayLogArgs, verbose: u8) -> anyhow::Result<()> {
    // The registry of a --stack file lives as long as the replay.
    let (replay, _stack) = match &a.replay {
        None => (None, None),
        Some(r) => {
            let (dev, keep) = stack_device::resolve(r, a.stack.as_deref(), a.control.as_deref())?;
            (Some(dev), keep)
        }
    };
    let o = replay::ReplayOptions {
        log: a.log,
        replay,
        limit: a.limit,
        next_flush: a.next_flush,
        next_fua: a.next_fua,
        start_entry: a.start_entry,
        start_mark: a.start_mark,
        end_mark: a.end_mark,
        find: a.find,
        num_entries: a.num_entries,
        no_discard: a.no_discard,
        fsck: a.fsck,
        check: a.check,
        start_sector: a.start_sector,
        end_sector: a.end_sector,
        reorder_seed: a.reorder_seed,
        torn: a.torn,
        verbose,
    };
    let stdout = std::io::stdout();
    replay::run(&o, &mut stdout.lock())?;
    Ok(())
}
