//! The crash points of a dm-log-writes log, and replaying up to each in
//! turn. A point is an entry a crash could leave the device at with
//! everything before it durable: a FLUSH entry (the writes logged before
//! it were on stable storage when it completed) or a FUA write, as
//! xfstests' generic/455, 457 and 482 replay with `--check flush|fua`; or
//! a named mark, or every Nth entry. The whole log is read once before
//! anything is replayed, so a log that is not one, a truncated one or a
//! mark it lacks is refused before any device changes.

use crate::log::{Entry, LogError, LogReader};
use crate::replay::{copy_data, ReplayError};
use crate::sink::Sink;
use blkstack_mapped::targets::log_writes::format::{
    LOG_DISCARD_FLAG, LOG_FLUSH_FLAG, LOG_FUA_FLAG, LOG_MARK_FLAG,
};
use std::path::Path;

/// Which entries are crash points.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PointRule {
    /// FLUSH or FUA entries (the default).
    Durable,
    Flush,
    Fua,
    Marks,
    /// Every Nth entry.
    Every(u64),
}

/// A `--points` value that names no rule.
#[derive(Debug, thiserror::Error)]
#[error("'{0}' is not flush,fua, flush, fua, marks or every:N (N > 0)")]
pub struct BadPointRule(String);

impl std::str::FromStr for PointRule {
    type Err = BadPointRule;
    fn from_str(s: &str) -> Result<PointRule, BadPointRule> {
        match s {
            "flush,fua" | "fua,flush" | "durable" => Ok(PointRule::Durable),
            "flush" => Ok(PointRule::Flush),
            "fua" => Ok(PointRule::Fua),
            "marks" => Ok(PointRule::Marks),
            n => match n.strip_prefix("every:").unwrap_or(n).parse::<u64>() {
                Ok(v) if v > 0 => Ok(PointRule::Every(v)),
                _ => Err(BadPointRule(n.to_string())),
            },
        }
    }
}

/// One crash point: the log entry a replay stops after.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Point {
    /// Its number among the points checked, from 1.
    pub n: usize,
    /// The entry, from 0.
    pub entry: u64,
    pub flags: u64,
    /// FLUSH entries up to and including this one.
    pub flushes: u64,
    /// The mark's text, for a mark.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub mark: String,
}

#[derive(Debug, thiserror::Error)]
pub enum WalkError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error(transparent)]
    Replay(#[from] ReplayError),
    #[error(transparent)]
    Epoch(#[from] crate::reorder::EpochError),
    #[error("the log has no mark '{0}'")]
    NoMark(String),
    #[error("the log has no crash point ({0:?}) after its start")]
    NoPoints(PointRule),
}

/// What to check, chosen before any replay.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    pub rule: PointRule,
    /// Points start after this mark (e.g. the one after mkfs).
    pub start_mark: Option<String>,
    /// Keep every Nth point only.
    pub every_nth: u64,
    /// Keep at most this many points.
    pub max_points: Option<usize>,
}

pub struct Plan {
    pub points: Vec<Point>,
    pub entries: u64,
    pub sectorsize: u32,
}

fn is_point(e: &Entry, rule: PointRule) -> bool {
    match rule {
        PointRule::Durable => e.is(LOG_FLUSH_FLAG) || e.is(LOG_FUA_FLAG),
        PointRule::Flush => e.is(LOG_FLUSH_FLAG),
        PointRule::Fua => e.is(LOG_FUA_FLAG),
        PointRule::Marks => e.is(LOG_MARK_FLAG),
        PointRule::Every(k) => (e.index + 1).is_multiple_of(k),
    }
}

/// Read the whole log and choose its points.
pub fn plan(log: &Path, o: &PlanOptions) -> Result<Plan, WalkError> {
    let mut r = LogReader::open(log)?;
    let mut started = o.start_mark.is_none();
    let mut all = Vec::new();
    let mut flushes = 0;
    while let Some(e) = r.next_entry()? {
        if e.is(LOG_FLUSH_FLAG) {
            flushes += 1;
        }
        if !started {
            started = e.is(LOG_MARK_FLAG) && Some(e.mark.as_str()) == o.start_mark.as_deref();
            continue;
        }
        if is_point(&e, o.rule) {
            all.push((e.index, e.header.flags, flushes, e.mark.clone()));
        }
    }
    if !started {
        return Err(WalkError::NoMark(o.start_mark.clone().unwrap_or_default()));
    }
    let nth = o.every_nth.max(1) as usize;
    let points: Vec<Point> = all
        .into_iter()
        .enumerate()
        .filter(|(i, _)| (i + 1).is_multiple_of(nth))
        .take(o.max_points.unwrap_or(usize::MAX))
        .enumerate()
        .map(|(i, (_, (entry, flags, flushes, mark)))| Point {
            n: i + 1,
            entry,
            flags,
            flushes,
            mark,
        })
        .collect();
    if points.is_empty() {
        return Err(WalkError::NoPoints(o.rule));
    }
    Ok(Plan {
        points,
        entries: r.sup.nr_entries,
        sectorsize: r.sup.sectorsize,
    })
}

/// Replays a log forward onto a sink, point after point.
pub struct Replayer {
    log: LogReader,
    sink: Sink,
    /// Entries applied so far.
    pub applied: u64,
    pub bytes: u64,
}

impl Replayer {
    pub fn new(log: &Path, sink: Sink) -> Result<Replayer, WalkError> {
        Ok(Replayer {
            log: LogReader::open(log)?,
            sink,
            applied: 0,
            bytes: 0,
        })
    }

    /// Apply every entry up to and including `entry`, then make it durable.
    pub fn advance_to(&mut self, entry: u64) -> Result<(), WalkError> {
        while self.applied <= entry {
            let Some(e) = self.log.next_entry()? else {
                break;
            };
            self.applied += 1;
            if e.dev_len == 0 || e.is(LOG_MARK_FLAG) {
                continue;
            }
            if e.is(LOG_DISCARD_FLAG) {
                self.sink
                    .discard(e.dev_at, e.dev_len)
                    .map_err(ReplayError::from)?;
            } else {
                copy_data(&self.log, &e, &self.sink, e.dev_at)?;
                self.bytes += e.data_len;
            }
        }
        self.sink.sync();
        Ok(())
    }
}
