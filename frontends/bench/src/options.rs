//! fio's option table: which `key=value` a job accepts and what it sets.
//!
//! The same setter ([`JobSpec::apply`]) serves the job file and the command
//! line, as in fio, where every option can be given either way. Options
//! fall in three sets, kept in [`crate::option_table`] (docs/FIO.md lists them
//! and a test keeps the two equal):
//! - implemented: they change what the job does, as fio's HOWTO defines;
//! - not applicable: engine and OS tuning with no counterpart in process
//!   (`sqthread_poll`, `fixedbufs`, `numa_cpu_nodes`, `directory`, ...):
//!   accepted and named in the job's header line, as fio options that do
//!   not apply here (`hipri` is not among them: it maps to polled
//!   completion, fio's meaning);
//! - refused: options whose meaning needs hardware or files blkstack does
//!   not model (zoned block devices, FDP, protection information, trace
//!   replay): an error naming the option and why.
//!
//! Any other key is an error naming it ("unknown option"), as fio refuses
//! a misspelt option. Boolean options may be given without a value.

use crate::distribution::Distribution;
pub use crate::option_table::{
    option_support, Support, BOOL_KEYS, IMPLEMENTED, NOT_APPLICABLE, REFUSED,
};
use crate::parse::{
    parse_bool, parse_bssplit, parse_cpu_list, parse_int, parse_pattern, parse_per_dir,
    parse_percentile_list, parse_signed_size, parse_size, parse_size_range, parse_size_spec,
    parse_time, TimeUnit,
};
use crate::rate::{LatencyTarget, RateProcess, SteadyState};
use crate::spec::{
    BlockSizes, HybridEstimator, JobSpec, RwMode, RwModifier, SizeSpec, VerifyMode, WaitMode,
};
use std::fmt;
use std::time::Duration;

/// What went wrong applying one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyError {
    pub key: String,
    pub message: String,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "option '{}': {}", self.key, self.message)
    }
}

impl std::error::Error for KeyError {}

fn key_err(key: &str, message: impl Into<String>) -> KeyError {
    KeyError {
        key: key.to_string(),
        message: message.into(),
    }
}

/// The value of a key that needs one.
fn need(key: &str, v: Option<&str>) -> Result<String, KeyError> {
    match v.map(str::trim) {
        Some(s) if !s.is_empty() => Ok(s.to_string()),
        _ => Err(key_err(key, "needs a value")),
    }
}

/// A boolean; a bare key means "set", as in fio.
fn bool_of(key: &str, v: Option<&str>) -> Result<bool, KeyError> {
    match v.map(str::trim) {
        None | Some("") => Ok(true),
        Some(s) => parse_bool(s).ok_or_else(|| {
            key_err(
                key,
                format!("'{s}' is not a boolean (0/1, true/false, yes/no, on/off)"),
            )
        }),
    }
}

fn int_of(key: &str, v: Option<&str>) -> Result<u64, KeyError> {
    parse_int(&need(key, v)?).map_err(|m| key_err(key, m))
}

fn pct_of(key: &str, v: Option<&str>) -> Result<u32, KeyError> {
    let n = int_of(key, v)?;
    if n > 100 {
        return Err(key_err(key, format!("{n} is not a percentage (0..100)")));
    }
    Ok(n as u32)
}

fn time_of(key: &str, v: Option<&str>, bare: TimeUnit) -> Result<Duration, KeyError> {
    parse_time(&need(key, v)?, bare).map_err(|m| key_err(key, m))
}

/// A size for a block size option (non-zero).
fn bs_of(key: &str, s: &str) -> Result<BlockSizes, KeyError> {
    let b = parse_size(s).map_err(|m| key_err(key, m))?;
    if b == 0 {
        return Err(key_err(key, "block size must be greater than 0"));
    }
    Ok(BlockSizes::single(b))
}

impl JobSpec {
    /// A size, a percentage, or with zones a count of zones (`128z`).
    fn size_spec_of(&self, key: &str, value: Option<&str>) -> Result<SizeSpec, KeyError> {
        let v = need(key, value)?;
        if let Some(n) = v.strip_suffix(['z', 'Z']) {
            let zs = self.strided_zones.map_or(0, |z| z.0);
            if zs == 0 {
                return Err(key_err(
                    key,
                    format!("'{v}': a size in zones needs zonesize first"),
                ));
            }
            let n = parse_int(n).map_err(|m| key_err(key, m))?;
            return n
                .checked_mul(zs)
                .map(SizeSpec::Bytes)
                .ok_or_else(|| key_err(key, format!("'{v}' is out of range")));
        }
        parse_size_spec(&v).map_err(|m| key_err(key, m))
    }

    /// Set one fio option. `value` is `None` for a bare key (`time_based`).
    /// A refused value changes nothing.
    pub fn apply(&mut self, key: &str, value: Option<&str>) -> Result<(), KeyError> {
        let key_norm = key.trim().to_ascii_lowercase();
        let key = key_norm.as_str();
        if self.apply_layout(key, value)?
            || self.apply_block_sizes(key, value)?
            || self.apply_region(key, value)?
            || self.apply_pattern(key, value)?
            || self.apply_pacing(key, value)?
            || self.apply_data(key, value)?
            || self.apply_run(key, value)?
        {
            return Ok(());
        }
        if let Some((_, why)) = NOT_APPLICABLE.iter().find(|(k, _)| *k == key) {
            // Still refuse a malformed boolean, as fio would.
            if BOOL_KEYS.contains(&key) {
                bool_of(key, value)?;
            }
            if !self.not_applicable.iter().any(|k| k == key) && *why != "text only" {
                self.not_applicable.push(key.to_string());
            }
            return Ok(());
        }
        if let Some((_, why)) = REFUSED.iter().find(|(k, _)| *k == key) {
            return Err(key_err(key, format!("not supported: {why}")));
        }
        Err(key_err(key, "unknown option"))
    }

    /// What: name, device, rw and its modifier.
    fn apply_layout(&mut self, key: &str, value: Option<&str>) -> Result<bool, KeyError> {
        match key {
            "name" => self.name = need(key, value)?,
            "filename" => {
                let v = need(key, value)?;
                if v.contains(':') {
                    return Err(key_err(
                        key,
                        format!("'{v}': one device per job (fio's ':'-separated file lists are not supported)"),
                    ));
                }
                self.filename = Some(v);
            }
            "rw" | "readwrite" => {
                let v = need(key, value)?;
                let (mode, modifier) = match v.split_once(':') {
                    Some((m, n)) => (m.trim(), Some(n.trim())),
                    None => (v.as_str(), None),
                };
                let rw = RwMode::parse(mode).ok_or_else(|| {
                    key_err(
                        key,
                        format!("'{mode}' is not one of read, write, randread, randwrite, rw, readwrite, randrw, trim, randtrim, trimwrite"),
                    )
                })?;
                self.rw_modifier = match modifier {
                    None => RwModifier::None,
                    Some(n) if rw.is_random() => {
                        let k = parse_int(n).map_err(|m| key_err(key, m))?;
                        RwModifier::RandomEvery(k.clamp(1, u32::MAX as u64) as u32)
                    }
                    Some(n) => RwModifier::Skip(parse_signed_size(n).map_err(|m| key_err(key, m))?),
                };
                self.rw = rw;
            }
            "rw_sequencer" => {
                let v = need(key, value)?;
                if v != "sequential" && v != "identical" {
                    return Err(key_err(
                        key,
                        format!("'{v}' is not one of sequential, identical"),
                    ));
                }
            }
            "blocksize_unaligned" | "bs_unaligned" => self.bs_unaligned = bool_of(key, value)?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Block sizes: `bs` per direction, `bssplit`, `bsrange`, `blockalign`.
    fn apply_block_sizes(&mut self, key: &str, value: Option<&str>) -> Result<bool, KeyError> {
        match key {
            "bs" | "blocksize" => {
                let v = need(key, value)?;
                let parts: Vec<&str> = v.split(',').collect();
                if parts.len() > 3 {
                    return Err(key_err(
                        key,
                        format!("'{v}': at most read,write,trim sizes"),
                    ));
                }
                let read = bs_of(key, parts[0])?;
                let mut dirs = [None, None];
                for (i, p) in parts.iter().enumerate().skip(1) {
                    if !p.trim().is_empty() {
                        dirs[i - 1] = Some(bs_of(key, p.trim())?);
                    }
                }
                if parts.len() == 2 && dirs[1].is_none() {
                    dirs[1] = dirs[0].clone();
                }
                self.bs = read;
                self.bs_dir = dirs;
            }
            "bssplit" => {
                let v = need(key, value)?;
                let parts: Vec<&str> = v.split(',').collect();
                if parts.len() > 3 {
                    return Err(key_err(
                        key,
                        format!("'{v}': at most read,write,trim lists"),
                    ));
                }
                let read = parse_bssplit(parts[0]).map_err(|m| key_err(key, m))?;
                let mut dirs = [None, None];
                for (i, p) in parts.iter().enumerate().skip(1) {
                    if !p.trim().is_empty() {
                        dirs[i - 1] = Some(parse_bssplit(p).map_err(|m| key_err(key, m))?);
                    }
                }
                self.bs = read;
                self.bs_dir = dirs;
            }
            "bsrange" | "blocksize_range" => {
                let v = need(key, value)?;
                let first = v.split(',').next().unwrap_or("");
                let (lo, hi) = parse_size_range(first).map_err(|m| key_err(key, m))?;
                self.bs = if lo == hi {
                    BlockSizes::single(lo)
                } else {
                    BlockSizes {
                        split: Vec::new(),
                        range: Some((lo, hi)),
                    }
                };
                self.bs_dir = [None, None];
            }
            "blockalign" | "ba" => {
                let v = need(key, value)?;
                let first = v.split(',').next().unwrap_or("");
                let a = parse_size(first).map_err(|m| key_err(key, m))?;
                self.blockalign = if a == 0 { None } else { Some(a) };
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// How much and how many: depth, clones, region, zones, limits.
    fn apply_region(&mut self, key: &str, value: Option<&str>) -> Result<bool, KeyError> {
        match key {
            "iodepth" => {
                let d = int_of(key, value)?;
                if d == 0 || d > 65536 {
                    return Err(key_err(key, format!("{d} is outside 1..65536")));
                }
                self.iodepth = d as u32;
            }
            "numjobs" => {
                let n = int_of(key, value)?;
                if n == 0 || n > 4096 {
                    return Err(key_err(key, format!("{n} is outside 1..4096")));
                }
                self.numjobs = n as u32;
            }
            "size" => self.size = Some(self.size_spec_of(key, value)?),
            "io_size" | "io_limit" => self.io_size = Some(self.size_spec_of(key, value)?),
            "offset" | "fileoffset" => self.offset = self.size_spec_of(key, value)?,
            "offset_align" => {
                let _ = parse_size(&need(key, value)?).map_err(|m| key_err(key, m))?;
            }
            "offset_increment" => self.offset_increment = self.size_spec_of(key, value)?,
            "loops" => {
                let n = int_of(key, value)?;
                if n == 0 {
                    return Err(key_err(key, "must be at least 1"));
                }
                self.loops = n.min(u32::MAX as u64) as u32;
            }
            "filesize" => {
                let v = need(key, value)?;
                // A range (`filesize=1G-2G`) picks sizes per file; one
                // device per job: its low end.
                let first = v.split('-').next().unwrap_or("");
                self.filesize = Some(parse_size_spec(first).map_err(|m| key_err(key, m))?);
            }
            "zonemode" => {
                let v = need(key, value)?;
                match v.as_str() {
                    "none" => (self.strided_zones, self.zbd) = (None, false),
                    "strided" | "zbd" => {
                        self.strided_zones.get_or_insert((0, 0, 0));
                        self.zbd = v == "zbd";
                    }
                    o => {
                        return Err(key_err(
                            key,
                            format!("'{o}' is not one of none, strided, zbd"),
                        ))
                    }
                }
            }
            "zonesize" | "zonerange" | "zoneskip" => {
                let b = parse_size(&need(key, value)?).map_err(|m| key_err(key, m))?;
                let z = self.strided_zones.get_or_insert((0, 0, 0));
                match key {
                    "zonesize" => z.0 = b,
                    "zonerange" => z.1 = b,
                    _ => z.2 = b,
                }
            }
            "wait_for" => self.wait_for = Some(need(key, value)?),
            "max_open_zones" | "job_max_open_zones" => {
                self.max_open_zones = int_of(key, value)?.min(u32::MAX as u64) as u32
            }
            "read_beyond_wp" => self.read_beyond_wp = bool_of(key, value)?,
            "number_ios" => {
                let n = int_of(key, value)?;
                self.number_ios = if n == 0 { None } else { Some(n) };
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Which offsets: mix, randomness, distributions.
    fn apply_pattern(&mut self, key: &str, value: Option<&str>) -> Result<bool, KeyError> {
        match key {
            "rwmixread" => self.rwmixread = pct_of(key, value)?,
            "rwmixwrite" => self.rwmixread = 100 - pct_of(key, value)?,
            "norandommap" => self.norandommap = bool_of(key, value)?,
            "randrepeat" | "allrandrepeat" => self.randrepeat = bool_of(key, value)?,
            "randseed" => self.randseed = int_of(key, value)?,
            "random_distribution" => {
                let v = need(key, value)?;
                let stride = matches!(
                    self.distribution,
                    Distribution::Sequence { stride: true, .. }
                );
                let mut d = Distribution::parse(&v).map_err(|m| key_err(key, m))?;
                if let Distribution::Sequence { stride: s, .. } = &mut d {
                    *s = stride;
                }
                self.distribution = d;
            }
            "random_sequence_stride" => {
                let on = bool_of(key, value)?;
                if let Distribution::Sequence { stride, .. } = &mut self.distribution {
                    *stride = on;
                }
            }
            "percentage_random" => {
                let v = need(key, value)?;
                let p = parse_per_dir(&v, 100u64, parse_int).map_err(|m| key_err(key, m))?;
                if p[0] > 100 {
                    return Err(key_err(
                        key,
                        format!("{} is not a percentage (0..100)", p[0]),
                    ));
                }
                self.percentage_random = p[0] as u32;
            }
            "percentage_sequential" => {
                self.percentage_random = 100 - pct_of(key, value)?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// When: runtime, delays, rates, think time, flow, targets.
    fn apply_pacing(&mut self, key: &str, value: Option<&str>) -> Result<bool, KeyError> {
        let rate_list = |v: Option<&str>| -> Result<[u64; 3], KeyError> {
            parse_per_dir(&need(key, v)?, 0u64, parse_size).map_err(|m| key_err(key, m))
        };
        match key {
            "runtime" | "timeout" => {
                let d = time_of(key, value, TimeUnit::Seconds)?;
                self.runtime = if d.is_zero() { None } else { Some(d) };
            }
            "ramp_time" => self.ramp_time = time_of(key, value, TimeUnit::Seconds)?,
            "time_based" => self.time_based = bool_of(key, value)?,
            "startdelay" => {
                let v = need(key, value)?;
                // fio allows a range (`startdelay=1-5`): its low end here.
                let first = v.split('-').next().unwrap_or("");
                self.startdelay =
                    parse_time(first, TimeUnit::Seconds).map_err(|m| key_err(key, m))?;
            }
            "rate" => self.rate.bytes_per_sec = rate_list(value)?,
            "rate_iops" => self.rate.iops = rate_list(value)?,
            "rate_min" | "ratemin" => self.rate.min_bytes_per_sec = rate_list(value)?,
            "rate_iops_min" => self.rate.min_iops = rate_list(value)?,
            "rate_process" => {
                let v = need(key, value)?;
                self.rate.process = match v.as_str() {
                    "linear" => RateProcess::Linear,
                    "poisson" => RateProcess::Poisson,
                    o => return Err(key_err(key, format!("'{o}' is not one of linear, poisson"))),
                };
            }
            "thinktime" => self.thinktime.time = time_of(key, value, TimeUnit::Micros)?,
            "thinktime_spin" => self.thinktime.spin = time_of(key, value, TimeUnit::Micros)?,
            "thinktime_blocks" => {
                self.thinktime.blocks = int_of(key, value)?.clamp(1, u32::MAX as u64) as u32
            }
            "flow" => {
                let v = need(key, value)?;
                let w: i64 = v
                    .parse()
                    .map_err(|_| key_err(key, format!("'{v}' is not an integer")))?;
                self.flow.weight = w.unsigned_abs();
            }
            "flow_id" => self.flow.id = int_of(key, value)?.min(u32::MAX as u64) as u32,
            "flow_sleep" => self.flow.sleep = time_of(key, value, TimeUnit::Micros)?,
            "steadystate" | "ss" => {
                let v = need(key, value)?;
                let mut ss = SteadyState::parse(&v).map_err(|m| key_err(key, m))?;
                if let Some(old) = &self.steadystate {
                    (ss.dur, ss.ramp, ss.interval) = (old.dur, old.ramp, old.interval);
                }
                self.steadystate = Some(ss);
            }
            "ss_dur"
            | "steadystate_duration"
            | "ss_ramp"
            | "steadystate_ramp_time"
            | "ss_interval"
            | "steadystate_check_interval" => {
                let d = time_of(key, value, TimeUnit::Seconds)?;
                let ss = self
                    .steadystate
                    .get_or_insert_with(|| SteadyState::parse("iops:0").expect("valid default"));
                match key {
                    "ss_dur" | "steadystate_duration" => ss.dur = d,
                    "ss_ramp" | "steadystate_ramp_time" => ss.ramp = d,
                    _ => ss.interval = d,
                }
            }
            "latency_target" | "latency_window" | "latency_percentile" => {
                let lt = self.latency_target.get_or_insert(LatencyTarget {
                    target: Duration::ZERO,
                    window: Duration::ZERO,
                    percentile: 100.0,
                });
                match key {
                    "latency_target" => lt.target = time_of(key, value, TimeUnit::Micros)?,
                    "latency_window" => lt.window = time_of(key, value, TimeUnit::Micros)?,
                    _ => {
                        let v = need(key, value)?;
                        let p: f64 = v
                            .parse()
                            .ok()
                            .filter(|p| *p > 0.0 && *p <= 100.0)
                            .ok_or_else(|| key_err(key, format!("'{v}' is not in (0, 100]")))?;
                        lt.percentile = p;
                    }
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// What is written and checked, flushed, trimmed and logged.
    fn apply_data(&mut self, key: &str, value: Option<&str>) -> Result<bool, KeyError> {
        match key {
            "verify" => {
                let v = need(key, value)?;
                self.verify = VerifyMode::parse(&v).ok_or_else(|| {
                    key_err(
                        key,
                        format!("'{v}' is not supported (use crc32c, crc64, md5, sha1, sha256, sha512, meta, pattern or none)"),
                    )
                })?;
            }
            "do_verify" => self.do_verify = bool_of(key, value)?,
            "verify_fatal" => self.verify_fatal = bool_of(key, value)?,
            "verify_pattern" => {
                self.verify_pattern =
                    parse_pattern(&need(key, value)?).map_err(|m| key_err(key, m))?
            }
            "verify_backlog" => self.verify_backlog = int_of(key, value)?,
            "verify_interval" => {
                let n = parse_size(&need(key, value)?).map_err(|m| key_err(key, m))?;
                self.verify_interval = if n == 0 { None } else { Some(n) };
            }
            "buffer_pattern" => {
                self.buffers.pattern =
                    parse_pattern(&need(key, value)?).map_err(|m| key_err(key, m))?
            }
            "zero_buffers" => self.buffers.zero = bool_of(key, value)?,
            "refill_buffers" => self.buffers.refill = bool_of(key, value)?,
            "scramble_buffers" => self.buffers.scramble = bool_of(key, value)?,
            "buffer_compress_percentage" => self.buffers.compress_pct = pct_of(key, value)?,
            "buffer_compress_chunk" => {
                self.buffers.compress_chunk =
                    parse_size(&need(key, value)?).map_err(|m| key_err(key, m))?
            }
            "dedupe_percentage" => self.buffers.dedupe_pct = pct_of(key, value)?,
            "dedupe_working_set_percentage" => {
                self.buffers.dedupe_working_set_pct = pct_of(key, value)?
            }
            "dedupe_mode" => {
                let v = need(key, value)?;
                self.buffers.dedupe_mode = match v.as_str() {
                    "repeat" => crate::buffers::DedupeMode::Repeat,
                    "working_set" => crate::buffers::DedupeMode::WorkingSet,
                    o => {
                        return Err(key_err(
                            key,
                            format!("'{o}' is not one of repeat, working_set"),
                        ))
                    }
                };
            }
            "fsync" => self.fsync = int_of(key, value)?.min(u32::MAX as u64) as u32,
            "sync" => {
                // fio's `sync=` is O_SYNC (or dsync/none); a write is durable
                // on completion when every write carries FUA: modelled as a
                // flush after each write.
                let v = value.unwrap_or("1").trim();
                self.fsync = match v {
                    "none" | "0" | "false" => 0,
                    "sync" | "dsync" | "1" | "true" => 1,
                    o => {
                        return Err(key_err(
                            key,
                            format!("'{o}' is not one of none, sync, dsync"),
                        ))
                    }
                };
            }
            "fdatasync" => self.fdatasync = int_of(key, value)?.min(u32::MAX as u64) as u32,
            "end_fsync" => self.end_fsync = bool_of(key, value)?,
            "trim_percentage" => self.trim_percentage = pct_of(key, value)?,
            "trim_backlog" => {
                let _ = int_of(key, value)?;
            }
            "write_bw_log" | "write_lat_log" | "write_iops_log" => {
                let prefix = value.map(str::trim).unwrap_or("").to_string();
                // A boolean-looking value means "on, named after the job".
                let prefix = match parse_bool(&prefix) {
                    Some(false) => None,
                    Some(true) => Some(String::new()),
                    None => Some(prefix),
                };
                match key {
                    "write_bw_log" => self.logs.bw = prefix,
                    "write_lat_log" => self.logs.lat = prefix,
                    _ => self.logs.iops = prefix,
                }
            }
            "log_avg_msec" => self.logs.avg_msec = int_of(key, value)?,
            "log_offset" => self.logs.offset = bool_of(key, value)?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Reporting, grouping, placement, completion strategy.
    fn apply_run(&mut self, key: &str, value: Option<&str>) -> Result<bool, KeyError> {
        match key {
            "continue_on_error" => {
                let v = value.map(str::trim).unwrap_or("all");
                self.continue_on_error = match v {
                    "none" | "0" => false,
                    "read" | "write" | "io" | "verify" | "all" | "1" => true,
                    other => {
                        return Err(key_err(
                            key,
                            format!("'{other}' is not one of none, read, write, io, verify, all"),
                        ))
                    }
                };
            }
            "ioengine" => {
                let v = need(key, value)?;
                self.ioengine = v;
            }
            "hipri" => {
                // fio's hipri: polled completion (io_uring IOPOLL).
                if bool_of(key, value)? {
                    self.wait = WaitMode::Poll;
                }
            }
            "wait" => {
                let v = need(key, value)?;
                self.wait = WaitMode::parse(&v).ok_or_else(|| {
                    key_err(key, format!("'{v}' is not one of interrupt, poll, hybrid"))
                })?;
            }
            "hybrid_sleep_pct" => {
                let v = need(key, value)?;
                match v.parse::<u32>() {
                    Ok(p) if (1..=100).contains(&p) => self.hybrid_sleep_pct = p,
                    _ => {
                        return Err(key_err(
                            key,
                            format!("'{v}' is not a percentage in 1..=100"),
                        ))
                    }
                }
            }
            "hybrid_estimator" => {
                let v = need(key, value)?;
                self.hybrid_estimator = match v.as_str() {
                    "min" => HybridEstimator::Min,
                    "ewma" => HybridEstimator::Ewma,
                    _ => return Err(key_err(key, format!("'{v}' is not one of min, ewma"))),
                };
            }
            "percentile_list" => {
                let v = need(key, value)?;
                self.percentile_list = parse_percentile_list(&v).map_err(|m| key_err(key, m))?;
            }
            "lat_percentiles" => self.lat_percentiles = bool_of(key, value)?,
            "clat_percentiles" | "slat_percentiles" => {
                bool_of(key, value)?;
            }
            "group_reporting" => self.group_reporting = bool_of(key, value)?,
            "stonewall" | "wait_for_previous" => self.stonewall = bool_of(key, value)?,
            "new_group" => self.new_group = bool_of(key, value)?,
            "exitall" => self.exitall = bool_of(key, value)?,
            "cpus_allowed" => {
                let v = need(key, value)?;
                self.cpus_allowed = Some(parse_cpu_list(&v).map_err(|m| key_err(key, m))?);
            }
            "cpumask" => {
                let mask = int_of(key, value)?;
                let cpus: Vec<usize> = (0..64).filter(|b| mask & (1u64 << b) != 0).collect();
                if cpus.is_empty() {
                    return Err(key_err(key, "an empty CPU mask"));
                }
                self.cpus_allowed = Some(cpus);
            }
            "nice" => {
                let v = need(key, value)?;
                self.nice = v
                    .parse::<i32>()
                    .ok()
                    .filter(|n| (-20..=19).contains(n))
                    .ok_or_else(|| key_err(key, format!("'{v}' is not a nice value in -20..19")))?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}
