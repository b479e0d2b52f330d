//! The multipath constructor, one function per piece of its grammar as
//! in dm-mpath.c: [`parse_features`], [`parse_hw_handler`], the group
//! counts, [`parse_priority_group`] (its path selector and its paths) and
//! [`parse_path`]. Each reads from an [`ArgSet`], the kernel's
//! `dm_arg_set`, and names the group and path an error is in.

use super::checker::{parse_ms, CheckerConfig, NoPathRetry};
use super::{
    Config, Multipath, MultipathTarget, PgPath, PriorityGroup, QueueMode, StartTime, MAX_PATHS,
};
use crate::error::TargetError;
use crate::selectors::{self, PathSelector};
use crate::target::{parse_sscanf, CtrContext, TargetRef};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};

/// How the constructor's dm_arg ranges are enforced (kernel `dm_arg`).
const MAX_GROUPS: u32 = 1024;
const MAX_PATHS_PER_GROUP: u32 = 1024;
const MAX_ARGS: u32 = 1024;
/// dm-mpath allows 8 feature words ("invalid number of feature args");
/// blkstack's own features (`start_time` and the checker's three) need
/// room beside every dm one, so a table using one of them may have up to
/// [`MAX_FEATURE_ARGS`].
const MAX_KERNEL_FEATURE_ARGS: u32 = 8;
const MAX_FEATURE_ARGS: u32 = 16;
/// The kernel's `dm_arg_set`: the args not consumed yet.
struct ArgSet<'a> {
    args: &'a [&'a str],
    pos: usize,
}

impl<'a> ArgSet<'a> {
    fn remaining(&self) -> usize {
        self.args.len() - self.pos
    }

    fn shift(&mut self, what: &str) -> Result<&'a str, TargetError> {
        let a = self
            .args
            .get(self.pos)
            .copied()
            .ok_or_else(|| TargetError::Missing(what.to_string()))?;
        self.pos += 1;
        Ok(a)
    }

    /// Kernel `dm_read_arg`: an unsigned in `min..=max`.
    fn read(&mut self, what: &str, min: u32, max: u32) -> Result<u32, TargetError> {
        let a = self.shift(what)?;
        let v: u32 = parse_sscanf(what, a)?;
        if v < min || v > max {
            return Err(TargetError::OutOfRange {
                what: what.to_string(),
                value: v.into(),
                min: min.into(),
                max: max.into(),
            });
        }
        Ok(v)
    }

    /// Kernel `dm_read_arg_group`: a count, and that many args must follow.
    fn read_group(&mut self, what: &str, max: u32) -> Result<u32, TargetError> {
        let n = self.read(what, 0, max)?;
        if n as usize > self.remaining() {
            return Err(TargetError::GroupTooLong {
                what: what.to_string(),
                count: n,
                left: self.remaining(),
            });
        }
        Ok(n)
    }

    fn take(&mut self, n: usize) -> &'a [&'a str] {
        let s = &self.args[self.pos..self.pos + n];
        self.pos += n;
        s
    }
}

fn parse_features(a: &mut ArgSet<'_>) -> Result<(Config, bool), TargetError> {
    let mut cfg = Config {
        queue_mode: QueueMode::Request,
        pg_init_retries: 0,
        pg_init_delay_msecs: None,
        retain_attached_hw_handler: false,
        hw_handler: None,
        start_time: StartTime::Ns,
        checker: CheckerConfig::default(),
    };
    let mut queue_if_no_path = false;
    let mut argc = a.read_group("number of feature args", MAX_FEATURE_ARGS)?;
    let declared = argc;
    let mut own_features = false;
    while argc > 0 {
        let name = a.shift("feature")?;
        argc -= 1;
        let is = |s: &str| name.eq_ignore_ascii_case(s);
        if is("queue_if_no_path") {
            queue_if_no_path = true;
            continue;
        }
        if is("retain_attached_hw_handler") {
            cfg.retain_attached_hw_handler = true;
            continue;
        }
        let takes_value = is("pg_init_retries")
            || is("pg_init_delay_msecs")
            || is("queue_mode")
            || is("start_time")
            || is("checker_interval")
            || is("checker_timeout")
            || is("no_path_retry");
        if !takes_value {
            return Err(TargetError::invalid(format!(
                "unrecognised multipath feature '{name}' (known: queue_if_no_path, pg_init_retries N, pg_init_delay_msecs N, retain_attached_hw_handler, queue_mode bio|rq|mq, start_time ns|jiffies:HZ|tick:HZ, checker_interval MS, checker_timeout MS, no_path_retry N|queue|fail)"
            )));
        }
        if argc == 0 {
            return Err(TargetError::invalid(format!(
                "feature '{name}' needs a value, but the feature count ends here"
            )));
        }
        argc -= 1;
        own_features |= is("start_time")
            || is("checker_interval")
            || is("checker_timeout")
            || is("no_path_retry");
        if is("pg_init_retries") {
            cfg.pg_init_retries = a.read("pg_init_retries", 1, 50)?;
        } else if is("pg_init_delay_msecs") {
            cfg.pg_init_delay_msecs = Some(a.read("pg_init_delay_msecs", 0, 60000)?);
        } else if is("queue_mode") {
            let m = a.shift("queue_mode")?;
            cfg.queue_mode = if m.eq_ignore_ascii_case("bio") {
                QueueMode::Bio
            } else if m.eq_ignore_ascii_case("rq") || m.eq_ignore_ascii_case("mq") {
                QueueMode::Request
            } else {
                return Err(TargetError::invalid(format!(
                    "unknown queue_mode '{m}' requested (known: bio, rq, mq)"
                )));
            };
        } else if is("start_time") {
            cfg.start_time = StartTime::parse(a.shift("start_time")?)?;
        } else if is("checker_interval") {
            cfg.checker.interval_ms = parse_ms("checker_interval", a.shift("checker_interval")?)?;
        } else if is("checker_timeout") {
            cfg.checker.timeout_ms =
                Some(parse_ms("checker_timeout", a.shift("checker_timeout")?)?);
        } else {
            cfg.checker.no_path_retry = Some(NoPathRetry::parse(a.shift("no_path_retry")?)?);
        }
    }
    if declared > MAX_KERNEL_FEATURE_ARGS && !own_features {
        return Err(TargetError::OutOfRange {
            what: "number of feature args (blkstack's own features allow more)".into(),
            value: declared.into(),
            min: 0,
            max: MAX_KERNEL_FEATURE_ARGS.into(),
        });
    }
    let queue_if_no_path = no_path_retry_queueing(&cfg.checker, queue_if_no_path)?;
    if cfg.queue_mode == QueueMode::Bio {
        // Kernel alloc_multipath_stage2: bio-based only discovers handlers.
        cfg.retain_attached_hw_handler = true;
    }
    Ok((cfg, queue_if_no_path))
}

/// multipathd's mapping of `no_path_retry` onto `queue_if_no_path`: a
/// count or `queue` queues, `fail` does not; a count needs the checker
/// whose intervals it counts.
fn no_path_retry_queueing(c: &CheckerConfig, queue_if_no_path: bool) -> Result<bool, TargetError> {
    match c.no_path_retry {
        None => Ok(queue_if_no_path),
        Some(NoPathRetry::Queue) => Ok(true),
        Some(NoPathRetry::Fail) if queue_if_no_path => Err(TargetError::invalid(
            "features 'queue_if_no_path' and 'no_path_retry fail' contradict each other: give one",
        )),
        Some(NoPathRetry::Fail) => Ok(false),
        Some(NoPathRetry::Count(n)) if c.interval_ms == 0 => Err(TargetError::invalid(format!(
            "feature 'no_path_retry {n}' counts checker intervals: add 'checker_interval MS'"
        ))),
        Some(NoPathRetry::Count(_)) => Ok(true),
    }
}

pub(super) fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    let mut a = ArgSet { args, pos: 0 };
    let (mut cfg, queue_if_no_path) = parse_features(&mut a)?;
    cfg.hw_handler = parse_hw_handler(&mut a, cfg.queue_mode)?;
    let (nr_groups, initial) = parse_group_counts(&mut a)?;
    let mut groups = Vec::new();
    let mut paths: Vec<PgPath> = Vec::new();
    while a.remaining() > 0 {
        let pg = parse_priority_group(&mut a, ctx, groups.len(), &mut paths)?;
        if let Some(h) = &cfg.hw_handler {
            // Kernel `setup_scsi_dh`: `scsi_dh_attach` fails on a device
            // that is not SCSI, and no blkstack device is.
            let group = format!("priority group {}", groups.len() + 1);
            return Err(TargetError::HwHandler(h.clone()).within(group));
        }
        groups.push(pg);
    }
    if groups.len() != nr_groups as usize {
        return Err(TargetError::invalid(format!(
            "priority group count mismatch: the table declares {nr_groups} group(s) but describes {}",
            groups.len()
        )));
    }
    let m = Multipath::new(cfg, groups, paths, initial, queue_if_no_path);
    Ok(std::sync::Arc::new(MultipathTarget::new(m)))
}

/// Kernel `parse_hw_handler`: `<#args> [<name> [<arg>]...]`. Bio-based
/// multipath ignores the handler (the kernel consumes its words); a
/// request-based one keeps the name, which only a table without paths can
/// keep: attaching it to a path fails, as on any non-SCSI device.
fn parse_hw_handler(a: &mut ArgSet<'_>, mode: QueueMode) -> Result<Option<String>, TargetError> {
    let hw_argc = a.read_group("number of hardware handler args", MAX_ARGS)?;
    if hw_argc == 0 {
        return Ok(None);
    }
    let words = a.take(hw_argc as usize);
    if mode == QueueMode::Bio {
        tracing::debug!(?words, "bio-based multipath ignores hardware handler args");
        return Ok(None);
    }
    Ok(words.first().map(|w| w.to_string()))
}

/// `<#priority groups> <initial group>`, checked against each other.
fn parse_group_counts(a: &mut ArgSet<'_>) -> Result<(u32, u32), TargetError> {
    let nr_groups = a.read("number of priority groups", 0, MAX_GROUPS)?;
    let initial = a.read("initial priority group number", 0, MAX_GROUPS)?;
    if (nr_groups == 0) != (initial == 0) {
        return Err(TargetError::invalid(format!(
            "invalid initial priority group {initial} for {nr_groups} group(s): it must be 0 exactly when there are no groups"
        )));
    }
    // An initial group past the last is accepted and means none, as in
    // dm-mpath (its countdown to the group never reaches it).
    Ok((nr_groups, if initial > nr_groups { 0 } else { initial }))
}

/// Kernel `parse_priority_group`: `<selector> <#selector args> [arg]...
/// <#paths> <#per-path args> [<path> [arg]...]...`. Group `g` (0-based)
/// appends its paths to `paths`, whose indices it keeps.
fn parse_priority_group(
    a: &mut ArgSet<'_>,
    ctx: &mut CtrContext<'_>,
    g: usize,
    paths: &mut Vec<PgPath>,
) -> Result<PriorityGroup, TargetError> {
    let gname = format!("priority group {}", g + 1);
    if a.remaining() < 2 {
        return Err(TargetError::invalid(format!(
            "{gname}: not enough priority group arguments"
        )));
    }
    let sel_name = a.shift("path selector")?;
    let ps_type = selectors::lookup(sel_name).ok_or_else(|| {
        TargetError::invalid(format!(
            "{gname}: unknown path selector type '{sel_name}' (known: {})",
            selectors::names().join(", ")
        ))
    })?;
    let ps_argc = a
        .read_group("number of path selector args", MAX_ARGS)
        .map_err(|e| e.within(gname.as_str()))?;
    let mut ps = (ps_type.create)(a.take(ps_argc as usize))
        .map_err(|e| e.within(format!("{gname}: path selector constructor failed")))?;
    let nr_paths = a
        .read("number of paths", 1, MAX_PATHS_PER_GROUP)
        .map_err(|e| e.within(gname.as_str()))?;
    let nr_sel_args = a
        .read("number of per-path selector args", 0, MAX_ARGS)
        .map_err(|e| e.within(gname.as_str()))?;
    let per_path = 1 + nr_sel_args as usize;
    let mut members = Vec::with_capacity(nr_paths as usize);
    for i in 0..nr_paths as usize {
        if a.remaining() < per_path {
            return Err(TargetError::invalid(format!(
                "{gname}: not enough path parameters: path {} of {nr_paths} needs a device and {nr_sel_args} selector arg(s), {} argument(s) left",
                i + 1,
                a.remaining()
            )));
        }
        let path = parse_path(a.take(per_path), ctx, &mut *ps, &gname, (g, i))?;
        if paths.len() + 1 >= MAX_PATHS {
            return Err(TargetError::invalid(format!(
                "too many paths: at most {} in one table",
                MAX_PATHS - 1
            )));
        }
        members.push(paths.len());
        paths.push(path);
    }
    Ok(PriorityGroup {
        ps_type,
        ps,
        paths: members,
        bypassed: AtomicBool::new(false),
    })
}

/// Kernel `parse_path`: `<path> [selector arg]...`, the device opened over
/// the whole target and the arguments handed to the group's selector.
/// `at` is (group, index in group), both 0-based.
fn parse_path(
    words: &[&str],
    ctx: &mut CtrContext<'_>,
    ps: &mut dyn PathSelector,
    gname: &str,
    (pg, index): (usize, usize),
) -> Result<PgPath, TargetError> {
    let dev = ctx
        .get_device(words[0], 0, ctx.len)
        .map_err(|e| e.within(format!("{gname}, path {}", index + 1)))?;
    ps.add_path(&words[1..])
        .map_err(|e| e.within(format!("{gname}, path {} ({})", index + 1, words[0])))?;
    Ok(PgPath {
        dev,
        pg,
        index,
        active: AtomicBool::new(true),
        fail_count: AtomicU32::new(0),
        ios: AtomicU64::new(0),
        bytes: AtomicU64::new(0),
    })
}
