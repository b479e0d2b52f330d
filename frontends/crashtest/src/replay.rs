//! Replaying a dm-log-writes log onto a device or image file with the
//! semantics and output of xfstests' `replay-log`: replay from the start,
//! an entry number or a mark, up to a count, the next flush or FUA entry
//! or a mark; `--find` prints where such an entry is; `--fsck CMD --check
//! N|flush|fua` runs a checker at each such point and stops at the first
//! failure; discards become BLKDISCARD where the device takes it and
//! written zeroes otherwise (up to 128 MiB each, as replay-log).

use crate::log::{Entry, LogError, LogReader};
use crate::sink::{Sink, SinkError};
use blkstack_core::DeviceRef;
use blkstack_mapped::targets::log_writes::format::{
    LOG_DISCARD_FLAG, LOG_FLUSH_FLAG, LOG_FUA_FLAG, LOG_MARK_FLAG,
};
use std::io::Write;
use std::path::PathBuf;

/// When `--fsck` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    Every(u64),
    Flush,
    Fua,
}

/// A `--check` value that is no rule.
#[derive(Debug, thiserror::Error)]
#[error("'{0}' is not flush, fua or a positive entry count")]
pub struct BadCheck(String);

impl std::str::FromStr for Check {
    type Err = BadCheck;
    fn from_str(s: &str) -> Result<Check, BadCheck> {
        match s {
            "flush" => Ok(Check::Flush),
            "fua" => Ok(Check::Fua),
            n => match n.parse::<u64>() {
                Ok(v) if v > 0 => Ok(Check::Every(v)),
                _ => Err(BadCheck(n.to_string())),
            },
        }
    }
}

/// What `--replay` names: an image file or block device, or a blkstack
/// device (from a stack file or a running serve) opened in this process.
#[derive(Clone)]
pub enum ReplayDev {
    Path(PathBuf),
    Device { name: String, dev: DeviceRef },
}

#[derive(Clone, Default)]
pub struct ReplayOptions {
    pub log: PathBuf,
    pub replay: Option<ReplayDev>,
    pub limit: u64,
    pub next_flush: bool,
    pub next_fua: bool,
    pub start_entry: u64,
    pub start_mark: Option<String>,
    pub end_mark: Option<String>,
    pub find: bool,
    pub num_entries: bool,
    pub no_discard: bool,
    pub fsck: Option<String>,
    pub check: Option<Check>,
    pub start_sector: u64,
    pub end_sector: Option<u64>,
    /// After the replay stops, add the crash state this seed makes of the
    /// flush epoch that follows (see `reorder.rs`).
    pub reorder_seed: Option<u64>,
    /// With `reorder_seed`: the state with a torn write.
    pub torn: bool,
    /// 1: print replayed entries; 2: skipped ones too.
    pub verbose: u8,
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("--fsck and --check go together")]
    FsckWithoutCheck,
    #[error("invalid entry number {0}: the log has {1}")]
    NoSuchEntry(u64, u64),
    #[error("couldn't find the starting mark '{0}'")]
    NoStartMark(String),
    #[error("couldn't find entry")]
    NotFound,
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error("the replay device: {0}")]
    Device(String),
    #[error("fsck errored out on entry {0}")]
    Fsck(u64),
    #[error("running the fsck command: {0}")]
    FsckSpawn(std::io::Error),
    #[error("--reorder-seed rebuilds a whole crash state: it does not go with {0}")]
    ReorderWith(&'static str),
    #[error("--torn goes with --reorder-seed")]
    TornWithoutSeed,
    #[error(transparent)]
    Epoch(#[from] crate::reorder::EpochError),
}

/// The entry's flags as replay-log prints them.
pub fn flags_text(flags: u64) -> String {
    let names = [
        (LOG_FLUSH_FLAG, "FLUSH"),
        (LOG_FUA_FLAG, "FUA"),
        (LOG_DISCARD_FLAG, "DISCARD"),
        (LOG_MARK_FLAG, "MARK"),
    ];
    let mut parts: Vec<String> = names
        .iter()
        .filter(|(f, _)| flags & f != 0)
        .map(|(_, n)| n.to_string())
        .collect();
    let rest = flags & !(LOG_FLUSH_FLAG | LOG_FUA_FLAG | LOG_DISCARD_FLAG | LOG_MARK_FLAG);
    if rest != 0 {
        parts.push(format!("UNKNOWN.{rest:#x}"));
    }
    if parts.is_empty() {
        "NONE".into()
    } else {
        parts.join("|")
    }
}

/// Does the entry end the replay: one of `stop` flags, and for a mark
/// stop, the mark named.
fn should_stop(e: &Entry, stop: u64, mark: Option<&str>) -> bool {
    if e.header.flags & stop == 0 {
        return false;
    }
    if stop & LOG_MARK_FLAG == 0 {
        return true;
    }
    e.is(LOG_MARK_FLAG) && Some(e.mark.as_str()) == mark
}

/// Run replay-log; what it prints goes to `out`.
pub fn run(o: &ReplayOptions, out: &mut dyn Write) -> Result<(), ReplayError> {
    if o.fsck.is_some() != o.check.is_some() {
        return Err(ReplayError::FsckWithoutCheck);
    }
    check_reorder(o)?;
    let mut log = LogReader::open(&o.log)?;
    let nr = log.sup.nr_entries;
    if let Some(mark) = &o.start_mark {
        loop {
            match log.next_entry()? {
                Some(e) if should_stop(&e, LOG_MARK_FLAG, Some(mark)) => break,
                Some(_) => {}
                None => return Err(ReplayError::NoStartMark(mark.clone())),
            }
        }
    } else {
        if o.start_entry >= nr {
            return Err(ReplayError::NoSuchEntry(o.start_entry, nr));
        }
        for _ in 0..o.start_entry {
            log.next_entry()?;
        }
    }
    let mut stop = 0;
    if o.next_flush {
        stop |= LOG_FLUSH_FLAG;
    }
    if o.next_fua {
        stop |= LOG_FUA_FLAG;
    }
    if o.end_mark.is_some() {
        stop |= LOG_MARK_FLAG;
    }
    let end_mark = o.end_mark.as_deref();
    if o.find {
        let mut n = 0;
        while let Some(e) = log.next_entry()? {
            n += 1;
            if (o.limit != 0 && n == o.limit) || should_stop(&e, stop, end_mark) {
                let _ = writeln!(
                    out,
                    "{}@{}",
                    e.index,
                    e.block + 1 + e.data_len / log.sup.sectorsize as u64
                );
                return Ok(());
            }
        }
        return Err(ReplayError::NotFound);
    }
    if o.num_entries {
        let _ = writeln!(out, "{nr}");
        return Ok(());
    }
    let Some(replay) = &o.replay else {
        let _ = writeln!(
            out,
            "Log version=1, sectorsize={}, entries={nr}",
            log.sup.sectorsize
        );
        return Ok(());
    };
    let mut target = match replay {
        ReplayDev::Path(p) => Sink::open_path(p)?,
        ReplayDev::Device { dev, .. } => Sink::device(dev.clone()),
    };
    let result = replay_entries(o, &mut log, &mut target, stop, out);
    target.sync();
    result
}

/// `--reorder-seed` rebuilds what crashtest checked: every entry up to
/// the stop, then the epoch's state. Options that replay part of the
/// entries, or check or find instead of replaying, would not.
fn check_reorder(o: &ReplayOptions) -> Result<(), ReplayError> {
    if o.reorder_seed.is_none() {
        return if o.torn {
            Err(ReplayError::TornWithoutSeed)
        } else {
            Ok(())
        };
    }
    let clash = [
        (o.start_sector != 0, "--start-sector"),
        (o.end_sector.is_some(), "--end-sector"),
        (o.fsck.is_some(), "--fsck"),
        (o.find, "--find"),
        (o.num_entries, "--num-entries"),
    ];
    match clash.iter().find(|(on, _)| *on) {
        Some((_, name)) => Err(ReplayError::ReorderWith(name)),
        None => Ok(()),
    }
}

/// The crash state `seed` makes of the epoch after where the replay
/// stopped, onto the target.
fn replay_state(
    o: &ReplayOptions,
    seed: u64,
    log: &mut LogReader,
    target: &mut Sink,
    out: &mut dyn Write,
) -> Result<(), ReplayError> {
    let ep = crate::reorder::read_epoch(log)?;
    let sel = crate::reorder::choose(&ep, seed, o.torn);
    if o.verbose > 0 {
        for (i, e) in ep.entries.iter().enumerate() {
            let _ = writeln!(
                out,
                "reorder {}@{}: sector {}, size {}, flags {:#x}({}): {}",
                e.index,
                e.block + 1,
                e.header.sector,
                e.dev_len,
                e.header.flags,
                flags_text(e.header.flags),
                crate::reorder::describe(&ep, &sel, i)
            );
        }
    }
    crate::reorder::apply(log, &ep, &sel, target, o.no_discard)?;
    Ok(())
}

fn replay_entries(
    o: &ReplayOptions,
    log: &mut LogReader,
    target: &mut Sink,
    stop: u64,
    out: &mut dyn Write,
) -> Result<(), ReplayError> {
    let end_sector = o.end_sector.unwrap_or(u64::MAX);
    let mut n = 0;
    while let Some(e) = log.next_entry()? {
        n += 1;
        let (sector, count) = (e.header.sector, e.header.nr_sectors);
        // The reader checked that the entry's bytes fit in 64 bits, so its
        // sectors do too.
        let skip = count != 0 && (sector + count <= o.start_sector || sector > end_sector);
        if o.verbose > 1 || (o.verbose > 0 && !skip) {
            let _ = writeln!(
                out,
                "{} {}@{}: sector {sector}, size {}, flags {:#x}({})",
                if skip { "skipping" } else { "replaying" },
                e.index,
                e.block + 1,
                e.dev_len,
                e.header.flags,
                flags_text(e.header.flags)
            );
        }
        if count != 0 && e.is(LOG_DISCARD_FLAG) {
            if !o.no_discard {
                target.discard(e.dev_at, e.dev_len)?;
            }
        } else if count != 0 && !skip {
            copy_data(log, &e, target, e.dev_at)?;
        }
        if let (Some(cmd), Some(check)) = (&o.fsck, o.check) {
            let due = match check {
                Check::Every(k) => n % k == 0,
                Check::Flush => e.is(LOG_FLUSH_FLAG),
                Check::Fua => e.is(LOG_FUA_FLAG),
            };
            if due && !run_fsck(target, cmd)? {
                return Err(ReplayError::Fsck(e.index));
            }
        }
        if (o.limit != 0 && n == o.limit) || should_stop(&e, stop, o.end_mark.as_deref()) {
            break;
        }
    }
    match o.reorder_seed {
        Some(seed) => replay_state(o, seed, log, target, out),
        None => Ok(()),
    }
}

/// An entry's data onto the target, a bounded buffer at a time.
pub(crate) fn copy_data(
    log: &LogReader,
    e: &Entry,
    target: &Sink,
    at: u64,
) -> Result<(), ReplayError> {
    copy_data_len(log, e, target, at, e.data_len)
}

/// The first `len` bytes (at most all) of an entry's data onto the target.
pub(crate) fn copy_data_len(
    log: &LogReader,
    e: &Entry,
    target: &Sink,
    at: u64,
    len: u64,
) -> Result<(), ReplayError> {
    let len = len.min(e.data_len);
    let mut buf = vec![0u8; (len as usize).min(4 << 20)];
    let mut done = 0;
    while done < len {
        let k = (len - done).min(buf.len() as u64) as usize;
        log.read_data(e, done, &mut buf[..k])?;
        target.write(at + done, &buf[..k])?;
        done += k as u64;
    }
    Ok(())
}

/// Sync the target and run the checker through the shell: true when it
/// exits 0.
fn run_fsck(target: &Sink, cmd: &str) -> Result<bool, ReplayError> {
    target.sync();
    let st = std::process::Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .status()
        .map_err(ReplayError::FsckSpawn)?;
    Ok(st.success())
}
