//! What one fio job asks for ([`JobSpec`]), and how fio's `key=value` text
//! becomes one.
//!
//! The same setter ([`JobSpec::apply`]) serves the job file and the command
//! line, as in fio, where every option can be given either way. Values follow
//! fio's parser (`parse.c`): sizes take `k/m/g/t/p` suffixes in powers of
//! 1024 (fio's default `kb_base=1024`, so `4k`, `4kb` and `4KiB` are all
//! 4096) and `size`/`offset`/`io_size` also take a percentage of the device;
//! times are seconds unless suffixed (`us`, `ms`, `s`, `m`, `h`, `d`);
//! booleans accept `0/1`, `true/false`, `yes/no`, `on/off`, and a bare key
//! means "set". Keys fio has that make no difference in-process (`ioengine`,
//! `direct`, `thread`, ...) are accepted and ignored; any other key is an
//! error naming it, as fio refuses unknown options.

use std::fmt;
use std::time::Duration;

/// The I/O pattern, fio's `rw=`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RwMode {
    #[default]
    Read,
    Write,
    RandRead,
    RandWrite,
    /// Sequential mixed reads and writes (`rw` / `readwrite`).
    ReadWrite,
    /// Random mixed reads and writes, split by `rwmixread`.
    RandRw,
}

impl RwMode {
    pub fn parse(s: &str) -> Option<RwMode> {
        Some(match s {
            "read" => RwMode::Read,
            "write" => RwMode::Write,
            "randread" => RwMode::RandRead,
            "randwrite" => RwMode::RandWrite,
            "rw" | "readwrite" => RwMode::ReadWrite,
            "randrw" => RwMode::RandRw,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            RwMode::Read => "read",
            RwMode::Write => "write",
            RwMode::RandRead => "randread",
            RwMode::RandWrite => "randwrite",
            RwMode::ReadWrite => "rw",
            RwMode::RandRw => "randrw",
        }
    }

    pub fn is_random(self) -> bool {
        matches!(self, RwMode::RandRead | RwMode::RandWrite | RwMode::RandRw)
    }

    pub fn reads(self) -> bool {
        !matches!(self, RwMode::Write | RwMode::RandWrite)
    }

    pub fn writes(self) -> bool {
        !matches!(self, RwMode::Read | RwMode::RandRead)
    }

    pub fn is_mixed(self) -> bool {
        matches!(self, RwMode::ReadWrite | RwMode::RandRw)
    }
}

/// How the job thread learns that its I/O completed (`wait=`, blkstack's
/// addition; the three strategies of the design notes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WaitMode {
    /// Block on the completion queue until a completion wakes the thread.
    #[default]
    Interrupt,
    /// Spin on the completion queue (bounded spin, then yield the CPU).
    Poll,
    /// Sleep `hybrid_sleep_pct` of the estimated completion time, measured
    /// from the oldest in-flight submission, then poll (io_uring hybrid
    /// polling, seed 002).
    Hybrid,
}

impl WaitMode {
    pub fn parse(s: &str) -> Option<WaitMode> {
        Some(match s {
            "interrupt" | "irq" => WaitMode::Interrupt,
            "poll" => WaitMode::Poll,
            "hybrid" => WaitMode::Hybrid,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            WaitMode::Interrupt => "interrupt",
            WaitMode::Poll => "poll",
            WaitMode::Hybrid => "hybrid",
        }
    }
}

/// How `wait=hybrid` estimates when the next completion is due.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HybridEstimator {
    /// The shortest completion time seen (upstream IORING_SETUP_HYBRID_IOPOLL):
    /// never oversleeps a steady device, polls longer on a jittery one.
    #[default]
    Min,
    /// An exponentially weighted moving average (weight 1/8): sleeps
    /// closer to the typical completion, risks oversleeping fast outliers.
    Ewma,
}

/// Data verification, fio's `verify=`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VerifyMode {
    #[default]
    None,
    /// Each block carries a header (offset, write number, length) and a
    /// crc32c of the block; read back and checked.
    Crc32c,
}

/// A size given either in bytes or as a percentage of the device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SizeSpec {
    Bytes(u64),
    /// Percent of the device size, 0 < p <= 100.
    Percent(f64),
}

impl SizeSpec {
    /// Resolve against a device of `dev_size` bytes.
    pub fn resolve(self, dev_size: u64) -> u64 {
        match self {
            SizeSpec::Bytes(b) => b,
            SizeSpec::Percent(p) => ((dev_size as f64) * p / 100.0) as u64,
        }
    }
}

impl fmt::Display for SizeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SizeSpec::Bytes(b) => write!(f, "{b}"),
            SizeSpec::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// Block sizes: one size, or fio's `bssplit` weighted list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSizes {
    /// `(bytes, percent)` pairs; the percents add up to 100.
    pub split: Vec<(u64, u32)>,
}

impl BlockSizes {
    pub fn single(bytes: u64) -> BlockSizes {
        BlockSizes {
            split: vec![(bytes, 100)],
        }
    }

    pub fn min(&self) -> u64 {
        self.split.iter().map(|s| s.0).min().unwrap_or(4096)
    }

    pub fn max(&self) -> u64 {
        self.split.iter().map(|s| s.0).max().unwrap_or(4096)
    }

    /// fio's `bs=(R) 4096B-4096B` notation (min-max).
    pub fn range_text(&self) -> String {
        format!("{}B-{}B", self.min(), self.max())
    }
}

impl Default for BlockSizes {
    fn default() -> Self {
        BlockSizes::single(4096)
    }
}

/// One job as fio understands it. Build it from code with `..Default::default()`
/// or from text with [`crate::jobfile::parse_job_file`] /
/// [`crate::cmdline::parse_command_line`]. Defaults are fio's.
#[derive(Clone, Debug, PartialEq)]
pub struct JobSpec {
    pub name: String,
    /// The device to run against: a registry name or `/dev/mapper/NAME`.
    /// `None`: the device named like the job, else the last device created
    /// by `--stack`/`--concise`.
    pub filename: Option<String>,
    pub rw: RwMode,
    pub bs: BlockSizes,
    pub iodepth: u32,
    /// Number of identical threads running this job (fio clones).
    pub numjobs: u32,
    /// Stop after this long (the whole job, ramp excluded).
    pub runtime: Option<Duration>,
    /// Keep going until `runtime` even after `size` bytes (wrapping around).
    pub time_based: bool,
    /// Run this long before measuring anything.
    pub ramp_time: Duration,
    /// Region size from `offset`; `None` = the rest of the device.
    pub size: Option<SizeSpec>,
    /// Bytes of I/O to do (default `size`), fio's `io_size`.
    pub io_size: Option<SizeSpec>,
    pub offset: SizeSpec,
    /// Clone `k` of this job starts `k * offset_increment` after `offset`
    /// (fio `offset_increment`), so clones can verify separate regions.
    pub offset_increment: SizeSpec,
    /// Repeat the job this many times (fio `loops`).
    pub loops: u32,
    /// Percent of mixed I/O that reads.
    pub rwmixread: u32,
    /// Random I/O without the "each block once per pass" map.
    pub norandommap: bool,
    /// Seed the random generators the same way every run.
    pub randrepeat: bool,
    pub randseed: u64,
    pub verify: VerifyMode,
    /// Run the verify phase after writing (fio `do_verify`).
    pub do_verify: bool,
    /// Stop at the first verify failure.
    pub verify_fatal: bool,
    /// Keep going after an I/O error (fio `continue_on_error` != none).
    pub continue_on_error: bool,
    pub wait: WaitMode,
    /// `wait=hybrid`: sleep this percentage of the estimated completion time
    /// (counted from the oldest in-flight submission) before polling.
    /// Upstream io_uring sleeps 50 %; the default here is 90 %, measured on
    /// 128 KiB writes at QD64 against a 1 ms device (docs/BENCHMARKS.md):
    /// 50 % kept the job thread 53 % busy, 90 % 11-13 %, at the same
    /// bandwidth as polling; 98 % saved a little more but leaves no room
    /// for a device whose latency jitters below the minimum seen.
    pub hybrid_sleep_pct: u32,
    /// `wait=hybrid`: how the completion time is estimated.
    pub hybrid_estimator: HybridEstimator,
    /// Completion-latency percentiles to report (fio `percentile_list`).
    pub percentile_list: Vec<f64>,
    pub group_reporting: bool,
    /// Wait for the jobs before this one to finish, and start a new
    /// reporting group (fio `stonewall`).
    pub stonewall: bool,
    /// Start a new reporting group without waiting (fio `new_group`).
    pub new_group: bool,
    /// CPUs the job's threads may run on (fio `cpus_allowed`, with fio's
    /// default `cpus_allowed_policy=shared`: every thread gets the whole
    /// set); `None` leaves the scheduler free.
    pub cpus_allowed: Option<Vec<usize>>,
}

impl Default for JobSpec {
    fn default() -> Self {
        JobSpec {
            name: "job".to_string(),
            filename: None,
            rw: RwMode::Read,
            bs: BlockSizes::default(),
            iodepth: 1,
            numjobs: 1,
            runtime: None,
            time_based: false,
            ramp_time: Duration::ZERO,
            size: None,
            io_size: None,
            offset: SizeSpec::Bytes(0),
            offset_increment: SizeSpec::Bytes(0),
            loops: 1,
            rwmixread: 50,
            norandommap: false,
            randrepeat: true,
            // fio's FIO_RANDSEED default.
            randseed: 0xb0_3a_8c_39,
            verify: VerifyMode::None,
            do_verify: true,
            verify_fatal: false,
            continue_on_error: false,
            wait: WaitMode::Interrupt,
            hybrid_sleep_pct: 90,
            hybrid_estimator: HybridEstimator::Min,
            percentile_list: crate::stats::DEFAULT_PERCENTILES.to_vec(),
            group_reporting: false,
            stonewall: false,
            new_group: false,
            cpus_allowed: None,
        }
    }
}

/// Keys fio accepts that change nothing for an in-process run: the engine is
/// always blkstack's, there is no page cache to bypass, and jobs are always
/// threads.
const IGNORED_KEYS: &[&str] = &[
    "ioengine",
    "direct",
    "buffered",
    "thread",
    "invalidate",
    "description",
    "iodepth_batch",
    "iodepth_batch_submit",
    "iodepth_batch_complete",
    "iodepth_batch_complete_min",
    "iodepth_batch_complete_max",
    "iodepth_low",
    "unified_rw_reporting",
    "disable_slat",
    "gtod_reduce",
    "clat_percentiles",
    "kb_base",
    "unit_base",
    "allow_file_create",
    "fallocate",
    "create_on_open",
    "random_generator",
];

/// fio options that change what is measured but that blkstack bench does
/// not implement: refused with a message saying so, never ignored.
const UNSUPPORTED_KEYS: &[&str] = &[
    "lat_percentiles",
    "slat_percentiles",
    "rate",
    "rate_iops",
    "rate_min",
    "rate_iops_min",
    "thinktime",
    "bsrange",
    "blocksize_range",
    "blockalign",
    "verify_backlog",
    "verify_interval",
    "verify_pattern",
    "verify_offset",
    "verify_only",
    "fsync",
    "fdatasync",
    "end_fsync",
    "zonemode",
    "zonesize",
    "random_distribution",
    "nrfiles",
    "filesize",
    "trim_percentage",
];

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

impl JobSpec {
    /// Set one fio option. `value` is `None` for a bare key (`time_based`).
    pub fn apply(&mut self, key: &str, value: Option<&str>) -> Result<(), KeyError> {
        let key_norm = key.trim().to_ascii_lowercase();
        let key = key_norm.as_str();
        let need = |v: Option<&str>| -> Result<String, KeyError> {
            match v.map(str::trim) {
                Some(s) if !s.is_empty() => Ok(s.to_string()),
                _ => Err(key_err(key, "needs a value")),
            }
        };
        let bool_of = |v: Option<&str>| -> Result<bool, KeyError> {
            match v.map(str::trim) {
                None | Some("") => Ok(true),
                Some(s) => parse_bool(s).ok_or_else(|| {
                    key_err(
                        key,
                        format!("'{s}' is not a boolean (0/1, true/false, yes/no, on/off)"),
                    )
                }),
            }
        };
        let wrap = |r: Result<u64, String>| r.map_err(|m| key_err(key, m));
        match key {
            "name" => self.name = need(value)?,
            "filename" => {
                let v = need(value)?;
                if v.contains(':') {
                    return Err(key_err(
                        key,
                        format!("'{v}': one device per job (fio's ':'-separated file lists are not supported)"),
                    ));
                }
                self.filename = Some(v);
            }
            "rw" | "readwrite" => {
                let v = need(value)?;
                // fio allows `rw=randread:8` (offset modifier); not supported.
                self.rw = RwMode::parse(&v).ok_or_else(|| {
                    key_err(
                        key,
                        format!("'{v}' is not one of read, write, randread, randwrite, rw, readwrite, randrw"),
                    )
                })?;
            }
            "bs" | "blocksize" => {
                let v = need(value)?;
                // fio allows `bs=4k,8k` (read,write); one size for both here.
                if v.contains(',') {
                    return Err(key_err(
                        key,
                        format!("'{v}': per-direction block sizes are not supported"),
                    ));
                }
                let b = wrap(parse_size(&v))?;
                if b == 0 {
                    return Err(key_err(key, "block size must be greater than 0"));
                }
                self.bs = BlockSizes::single(b);
            }
            "bssplit" => {
                let v = need(value)?;
                self.bs = parse_bssplit(&v).map_err(|m| key_err(key, m))?;
            }
            "iodepth" => {
                let d = wrap(parse_int(&need(value)?))?;
                if d == 0 || d > 65536 {
                    return Err(key_err(key, format!("{d} is outside 1..65536")));
                }
                self.iodepth = d as u32;
            }
            "numjobs" => {
                let n = wrap(parse_int(&need(value)?))?;
                if n == 0 || n > 4096 {
                    return Err(key_err(key, format!("{n} is outside 1..4096")));
                }
                self.numjobs = n as u32;
            }
            "runtime" | "timeout" => {
                let d =
                    parse_time(&need(value)?, TimeUnit::Seconds).map_err(|m| key_err(key, m))?;
                self.runtime = if d.is_zero() { None } else { Some(d) };
            }
            "ramp_time" => {
                self.ramp_time =
                    parse_time(&need(value)?, TimeUnit::Seconds).map_err(|m| key_err(key, m))?;
            }
            "time_based" => self.time_based = bool_of(value)?,
            "size" => {
                self.size = Some(parse_size_spec(&need(value)?).map_err(|m| key_err(key, m))?)
            }
            "io_size" | "io_limit" => {
                self.io_size = Some(parse_size_spec(&need(value)?).map_err(|m| key_err(key, m))?)
            }
            "offset" => {
                self.offset = parse_size_spec(&need(value)?).map_err(|m| key_err(key, m))?
            }
            "offset_increment" => {
                self.offset_increment =
                    parse_size_spec(&need(value)?).map_err(|m| key_err(key, m))?
            }
            "loops" => {
                let n = wrap(parse_int(&need(value)?))?;
                if n == 0 {
                    return Err(key_err(key, "must be at least 1"));
                }
                self.loops = n.min(u32::MAX as u64) as u32;
            }
            "rwmixread" => {
                let n = wrap(parse_int(&need(value)?))?;
                if n > 100 {
                    return Err(key_err(key, format!("{n} is not a percentage (0..100)")));
                }
                self.rwmixread = n as u32;
            }
            "rwmixwrite" => {
                let n = wrap(parse_int(&need(value)?))?;
                if n > 100 {
                    return Err(key_err(key, format!("{n} is not a percentage (0..100)")));
                }
                self.rwmixread = 100 - n as u32;
            }
            "norandommap" => self.norandommap = bool_of(value)?,
            "randrepeat" => self.randrepeat = bool_of(value)?,
            "randseed" => self.randseed = wrap(parse_int(&need(value)?))?,
            "verify" => {
                let v = need(value)?;
                self.verify = match v.as_str() {
                    "0" | "none" => VerifyMode::None,
                    "crc32c" | "crc32c-intel" => VerifyMode::Crc32c,
                    other => {
                        return Err(key_err(
                            key,
                            format!("'{other}' is not supported (use crc32c or none)"),
                        ))
                    }
                };
            }
            "do_verify" => self.do_verify = bool_of(value)?,
            "verify_fatal" => self.verify_fatal = bool_of(value)?,
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
            "wait" => {
                let v = need(value)?;
                self.wait = WaitMode::parse(&v).ok_or_else(|| {
                    key_err(key, format!("'{v}' is not one of interrupt, poll, hybrid"))
                })?;
            }
            "hybrid_sleep_pct" => {
                let v = need(value)?;
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
                let v = need(value)?;
                self.hybrid_estimator = match v.as_str() {
                    "min" => HybridEstimator::Min,
                    "ewma" => HybridEstimator::Ewma,
                    _ => return Err(key_err(key, format!("'{v}' is not one of min, ewma"))),
                };
            }
            "percentile_list" => {
                let v = need(value)?;
                self.percentile_list = parse_percentile_list(&v).map_err(|m| key_err(key, m))?;
            }
            "group_reporting" => self.group_reporting = bool_of(value)?,
            "stonewall" | "wait_for_previous" => self.stonewall = bool_of(value)?,
            "new_group" => self.new_group = bool_of(value)?,
            "cpus_allowed" => {
                let v = need(value)?;
                self.cpus_allowed = Some(parse_cpu_list(&v).map_err(|m| key_err(key, m))?);
            }
            k if IGNORED_KEYS.contains(&k) => {}
            k if UNSUPPORTED_KEYS.contains(&k) => {
                return Err(key_err(
                    key,
                    "is a fio option blkstack bench does not implement",
                ))
            }
            _ => return Err(key_err(key, "unknown option")),
        }
        Ok(())
    }

    /// Bytes of I/O the job does when not time based, given its region.
    pub fn io_limit(&self, region: u64, dev_size: u64) -> u64 {
        let one = self.io_size.map(|s| s.resolve(dev_size)).unwrap_or(region);
        one.saturating_mul(self.loops as u64)
    }
}

/// fio's boolean spellings.
pub fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// A plain integer, decimal or `0x` hex.
pub fn parse_int(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let r = if let Some(h) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        u64::from_str_radix(h, 16)
    } else {
        t.parse::<u64>()
    };
    r.map_err(|_| format!("'{s}' is not a non-negative integer"))
}

/// A byte count with fio's suffixes: `k`, `m`, `g`, `t`, `p` (optionally
/// followed by `b`/`ib`, any case) in powers of 1024; a trailing `b` alone
/// means bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'x' || c == 'X'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits_end);
    if num.is_empty() {
        return Err(format!("'{s}' is not a size (e.g. 4096, 4k, 1m, 2g)"));
    }
    let mult: u64 = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        "p" | "pb" | "pib" => 1 << 50,
        other => {
            return Err(format!(
                "'{s}': unknown size suffix '{other}' (use k, m, g, t, p)"
            ))
        }
    };
    if num.contains('.') {
        let f: f64 = num
            .parse()
            .map_err(|_| format!("'{s}' is not a size (e.g. 4096, 4k, 1m, 2g)"))?;
        let v = f * mult as f64;
        if !(0.0..1.8e19).contains(&v) {
            return Err(format!("'{s}' is out of range"));
        }
        return Ok(v as u64);
    }
    let n = parse_int(num).map_err(|_| format!("'{s}' is not a size (e.g. 4096, 4k, 1m, 2g)"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("'{s}' is out of range"))
}

/// A size or a percentage of the device (`size=50%`).
pub fn parse_size_spec(s: &str) -> Result<SizeSpec, String> {
    let t = s.trim();
    if let Some(p) = t.strip_suffix('%') {
        let v: f64 = p
            .trim()
            .parse()
            .map_err(|_| format!("'{s}' is not a percentage"))?;
        if !(v > 0.0 && v <= 100.0) {
            return Err(format!("'{s}': a percentage must be in (0, 100]"));
        }
        return Ok(SizeSpec::Percent(v));
    }
    parse_size(t).map(SizeSpec::Bytes)
}

/// The unit a bare number of a time option is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeUnit {
    Seconds,
    Micros,
}

/// A duration with fio's suffixes (`us`/`usec`, `ms`/`msec`, `s`/`sec`,
/// `m`/`min`, `h`, `d`); a bare number is in `bare` units.
pub fn parse_time(s: &str, bare: TimeUnit) -> Result<Duration, String> {
    let t = s.trim();
    let digits_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits_end);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a time (e.g. 10, 10s, 500ms, 2m)"))?;
    let ns_per: f64 = match suffix.to_ascii_lowercase().as_str() {
        "" => match bare {
            TimeUnit::Seconds => 1e9,
            TimeUnit::Micros => 1e3,
        },
        "ns" | "nsec" => 1.0,
        "us" | "usec" => 1e3,
        "ms" | "msec" => 1e6,
        "s" | "sec" => 1e9,
        "m" | "min" => 60e9,
        "h" | "hour" => 3600e9,
        "d" | "day" => 86400e9,
        other => {
            return Err(format!(
                "'{s}': unknown time unit '{other}' (use us, ms, s, m, h, d)"
            ))
        }
    };
    let ns = v * ns_per;
    if !(0.0..1.8e19).contains(&ns) {
        return Err(format!("'{s}' is out of range"));
    }
    Ok(Duration::from_nanos(ns as u64))
}

/// The most CPUs a `cpus_allowed` list may name (glibc's `CPU_SETSIZE`).
pub const MAX_CPU: usize = 1024;

/// fio's `cpus_allowed=0-3,6`: CPU numbers and inclusive ranges, comma
/// separated; returned sorted, without duplicates.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, String> {
    let num = |t: &str| -> Result<usize, String> {
        let n: usize = t
            .trim()
            .parse()
            .map_err(|_| format!("'{t}' is not a CPU number"))?;
        if n >= MAX_CPU {
            return Err(format!("CPU {n} is out of range (at most {})", MAX_CPU - 1));
        }
        Ok(n)
    };
    let mut cpus = Vec::new();
    for part in s.split(',').map(str::trim) {
        if part.is_empty() {
            return Err(format!("'{s}': empty entry in the CPU list"));
        }
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(format!("'{part}': a range must go up"));
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(num(part)?),
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// fio's `percentile_list=50:99:99.9`: at most 20 values in (0, 100],
/// reported in ascending order.
pub fn parse_percentile_list(s: &str) -> Result<Vec<f64>, String> {
    let mut list = Vec::new();
    for part in s.split(':').map(str::trim).filter(|p| !p.is_empty()) {
        let v: f64 = part
            .parse()
            .map_err(|_| format!("'{part}' is not a number"))?;
        if !(v > 0.0 && v <= 100.0) {
            return Err(format!("{part} is not a percentile in (0, 100]"));
        }
        list.push(v);
    }
    if list.is_empty() || list.len() > 20 {
        return Err(format!("'{s}': give 1 to 20 percentiles separated by ':'"));
    }
    list.sort_by(f64::total_cmp);
    Ok(list)
}

/// fio's `bssplit=4k/50:64k/50`. A size without a percentage shares what
/// the others leave, as in fio.
pub fn parse_bssplit(s: &str) -> Result<BlockSizes, String> {
    if s.contains(',') {
        return Err(format!(
            "'{s}': per-direction bssplit lists are not supported (one list for reads and writes)"
        ));
    }
    let mut split = Vec::new();
    let mut open = Vec::new();
    let mut total = 0u32;
    for part in s.split(':').map(str::trim).filter(|p| !p.is_empty()) {
        let (size_text, pct) = match part.split_once('/') {
            Some((a, b)) => (a, Some(b)),
            None => (part, None),
        };
        let size = parse_size(size_text)?;
        if size == 0 {
            return Err(format!("'{part}': block size must be greater than 0"));
        }
        match pct {
            Some(p) => {
                let p = p
                    .trim()
                    .parse::<u32>()
                    .map_err(|_| format!("'{part}': '{p}' is not a whole percentage"))?;
                total += p;
                if p > 0 {
                    split.push((size, p));
                }
            }
            None => open.push(size),
        }
    }
    if total > 100 {
        return Err(format!(
            "'{s}': percentages add up to {total}, more than 100"
        ));
    }
    if !open.is_empty() {
        let left = 100 - total;
        let n = open.len() as u32;
        for (i, size) in open.into_iter().enumerate() {
            // Spread the remainder so the shares still sum to 100.
            let share = left / n + u32::from((i as u32) < left % n);
            if share > 0 {
                split.push((size, share));
            }
        }
    } else if total != 100 {
        return Err(format!("'{s}': percentages add up to {total}, not 100"));
    }
    if split.is_empty() {
        return Err(format!("'{s}': no block size with a non-zero share"));
    }
    Ok(BlockSizes { split })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_fio_suffixes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("4KiB").unwrap(), 4096);
        assert_eq!(parse_size("1m").unwrap(), 1 << 20);
        assert_eq!(parse_size("2g").unwrap(), 2 << 30);
        assert_eq!(parse_size("1.5k").unwrap(), 1536);
        assert_eq!(parse_size("0x1000").unwrap(), 4096);
        assert!(parse_size("4q").unwrap_err().contains("suffix 'q'"));
        assert!(parse_size("k").is_err());
        assert_eq!(parse_size_spec("50%").unwrap(), SizeSpec::Percent(50.0));
        assert!(parse_size_spec("150%").is_err());
        assert_eq!(SizeSpec::Percent(25.0).resolve(1 << 20), 1 << 18);
    }

    #[test]
    fn times_take_units() {
        assert_eq!(
            parse_time("5", TimeUnit::Seconds).unwrap(),
            Duration::from_secs(5)
        );
        assert_eq!(
            parse_time("5s", TimeUnit::Seconds).unwrap(),
            Duration::from_secs(5)
        );
        assert_eq!(
            parse_time("1m", TimeUnit::Seconds).unwrap(),
            Duration::from_secs(60)
        );
        assert_eq!(
            parse_time("250ms", TimeUnit::Seconds).unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(
            parse_time("10us", TimeUnit::Seconds).unwrap(),
            Duration::from_micros(10)
        );
        assert!(parse_time("5 parsecs", TimeUnit::Seconds).is_err());
        assert!(parse_time("fast", TimeUnit::Seconds).is_err());
    }

    #[test]
    fn bssplit_parses_and_checks_shares() {
        let b = parse_bssplit("4k/50:64k/50").unwrap();
        assert_eq!(b.split, vec![(4096, 50), (65536, 50)]);
        assert_eq!(b.min(), 4096);
        assert_eq!(b.max(), 65536);
        let b = parse_bssplit("4k/10:8k:16k").unwrap();
        assert_eq!(b.split.iter().map(|s| s.1).sum::<u32>(), 100);
        assert!(parse_bssplit("4k/60:8k/60").unwrap_err().contains("120"));
        assert!(parse_bssplit("4k/50:8k/30")
            .unwrap_err()
            .contains("not 100"));
        assert!(parse_bssplit("4k/x").is_err());
    }

    #[test]
    fn apply_sets_and_rejects() {
        let mut j = JobSpec::default();
        j.apply("rw", Some("randrw")).unwrap();
        j.apply("bs", Some("8k")).unwrap();
        j.apply("iodepth", Some("32")).unwrap();
        j.apply("time_based", None).unwrap();
        j.apply("randrepeat", Some("false")).unwrap();
        j.apply("verify", Some("crc32c")).unwrap();
        j.apply("wait", Some("hybrid")).unwrap();
        j.apply("ioengine", Some("libaio")).unwrap();
        assert_eq!(j.rw, RwMode::RandRw);
        assert_eq!(j.bs, BlockSizes::single(8192));
        assert_eq!(j.iodepth, 32);
        assert!(j.time_based);
        assert!(!j.randrepeat);
        assert_eq!(j.verify, VerifyMode::Crc32c);
        assert_eq!(j.wait, WaitMode::Hybrid);
        let e = j.apply("rw", Some("sideways")).unwrap_err();
        assert_eq!(e.key, "rw");
        assert!(e.to_string().contains("sideways"));
        assert_eq!(
            j.apply("frobnicate", Some("1")).unwrap_err().message,
            "unknown option"
        );
        assert!(j.apply("iodepth", Some("0")).is_err());
        assert!(j.apply("time_based", Some("maybe")).is_err());
        assert!(j.apply("wait", Some("sometimes")).is_err());
        assert!(j
            .apply("bs", None)
            .unwrap_err()
            .message
            .contains("needs a value"));
    }
}

#[cfg(test)]
mod hybrid_option_tests {
    use super::*;

    #[test]
    fn hybrid_options_parse_and_refuse_bad_values() {
        let mut j = JobSpec::default();
        assert_eq!(
            (j.hybrid_sleep_pct, j.hybrid_estimator),
            (90, HybridEstimator::Min)
        );
        j.apply("hybrid_sleep_pct", Some("90")).unwrap();
        j.apply("hybrid_estimator", Some("ewma")).unwrap();
        assert_eq!(
            (j.hybrid_sleep_pct, j.hybrid_estimator),
            (90, HybridEstimator::Ewma)
        );
        let e = j.apply("hybrid_sleep_pct", Some("0")).unwrap_err();
        assert!(e.to_string().contains("1..=100"), "{e}");
        let e = j.apply("hybrid_estimator", Some("median")).unwrap_err();
        assert!(e.to_string().contains("min, ewma"), "{e}");
        assert_eq!(j.hybrid_sleep_pct, 90, "a refused value changes nothing");
    }

    #[test]
    fn cpus_allowed_takes_fio_cpu_lists() {
        let mut j = JobSpec::default();
        assert_eq!(j.cpus_allowed, None);
        j.apply("cpus_allowed", Some("3,0-1,1")).unwrap();
        assert_eq!(j.cpus_allowed, Some(vec![0, 1, 3]));
        for (bad, why) in [
            ("", "needs a value"),
            ("1,,2", "empty entry"),
            ("2-1", "must go up"),
            ("x", "not a CPU number"),
            ("1024", "out of range"),
        ] {
            let e = j.apply("cpus_allowed", Some(bad)).unwrap_err();
            assert!(e.to_string().contains(why), "{bad}: {e}");
        }
        assert_eq!(
            j.cpus_allowed,
            Some(vec![0, 1, 3]),
            "a refused list changes nothing"
        );
    }
}
