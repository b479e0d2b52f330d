//! What one fio job asks for ([`JobSpec`]): the job's fields with fio's
//! defaults (`thread_options` in fio's `thread_options.h`).
//!
//! How fio's `key=value` text becomes a `JobSpec` lives in
//! [`crate::options`] (the option table) and [`crate::parse`] (values);
//! the mechanisms that options configure have their own modules
//! ([`crate::distribution`], [`crate::rate`], [`crate::buffers`],
//! [`crate::logs`]).

use crate::buffers::BufferSpec;
use crate::distribution::Distribution;
use crate::logs::LogSpec;
use crate::rate::{FlowSpec, LatencyTarget, RateSpec, SteadyState, ThinkTime};
use std::time::Duration;

pub use crate::options::KeyError;
pub use crate::parse::{
    parse_bool, parse_bssplit, parse_cpu_list, parse_int, parse_percentile_list, parse_size,
    parse_size_spec, parse_time, TimeUnit, MAX_CPU,
};
pub use crate::sizes::{BlockSizes, SizeSpec};

/// fio's default `percentile_list`.
pub const DEFAULT_PERCENTILES: [f64; 17] = [
    1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95,
    99.99,
];

/// A data direction, fio's `enum fio_ddir` (its index is fio's `ddir`
/// number in log files).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ddir {
    Read = 0,
    Write = 1,
    Trim = 2,
}

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
    /// Sequential trims (discards).
    Trim,
    /// Random trims.
    RandTrim,
    /// Trim a block, then write it (fio `trimwrite`).
    TrimWrite,
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
            "trim" => RwMode::Trim,
            "randtrim" => RwMode::RandTrim,
            "trimwrite" => RwMode::TrimWrite,
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
            RwMode::Trim => "trim",
            RwMode::RandTrim => "randtrim",
            RwMode::TrimWrite => "trimwrite",
        }
    }

    pub fn is_random(self) -> bool {
        matches!(
            self,
            RwMode::RandRead | RwMode::RandWrite | RwMode::RandRw | RwMode::RandTrim
        )
    }

    pub fn reads(self) -> bool {
        matches!(
            self,
            RwMode::Read | RwMode::RandRead | RwMode::ReadWrite | RwMode::RandRw
        )
    }

    pub fn writes(self) -> bool {
        matches!(
            self,
            RwMode::Write
                | RwMode::RandWrite
                | RwMode::ReadWrite
                | RwMode::RandRw
                | RwMode::TrimWrite
        )
    }

    pub fn trims(self) -> bool {
        matches!(self, RwMode::Trim | RwMode::RandTrim | RwMode::TrimWrite)
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
    /// polling, upstream IORING_SETUP_HYBRID_IOPOLL).
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
    /// As crc32c with fio's other checksums over the data after the header.
    Crc64,
    Md5,
    Sha1,
    Sha256,
    Sha512,
    /// Header only: offset, length and write number, no data checksum.
    Meta,
    /// No header: every byte must equal `verify_pattern`.
    Pattern,
}

impl VerifyMode {
    pub fn parse(s: &str) -> Option<VerifyMode> {
        Some(match s {
            "0" | "none" => VerifyMode::None,
            "crc32c" | "crc32c-intel" | "crc32" | "1" => VerifyMode::Crc32c,
            "crc64" => VerifyMode::Crc64,
            "md5" => VerifyMode::Md5,
            "sha1" => VerifyMode::Sha1,
            "sha256" => VerifyMode::Sha256,
            "sha512" => VerifyMode::Sha512,
            "meta" => VerifyMode::Meta,
            "pattern" => VerifyMode::Pattern,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            VerifyMode::None => "none",
            VerifyMode::Crc32c => "crc32c",
            VerifyMode::Crc64 => "crc64",
            VerifyMode::Md5 => "md5",
            VerifyMode::Sha1 => "sha1",
            VerifyMode::Sha256 => "sha256",
            VerifyMode::Sha512 => "sha512",
            VerifyMode::Meta => "meta",
            VerifyMode::Pattern => "pattern",
        }
    }
}

/// fio's `rw=MODE:N` modifier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RwModifier {
    #[default]
    None,
    /// Sequential: after each I/O move this many bytes further (negative:
    /// back), on top of the block itself (`rw=read:-8k`, `rw=write:112k`).
    Skip(i64),
    /// Random: draw a new random offset only every N I/Os, going on
    /// sequentially in between (`rw=randread:8`).
    RandomEvery(u32),
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
    /// Upstream io_uring sleeps 50 %; the default here is 90 %: on a
    /// device with a steady completion time it keeps the job thread far
    /// less busy at the same bandwidth as polling (figures in
    /// docs/BENCHMARKS.md), while leaving room for a device whose latency
    /// jitters below the minimum seen.
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
    /// Per-direction block sizes `[write, trim]` (fio `bs=R,W,T`);
    /// `None`: as `bs`.
    pub bs_dir: [Option<BlockSizes>; 2],
    /// `rw=MODE:N`.
    pub rw_modifier: RwModifier,
    /// Offsets align to this instead of the block size (fio `blockalign`).
    pub blockalign: Option<u64>,
    /// `bsrange` sizes need not be multiples of the smallest
    /// (fio `blocksize_unaligned`): multiples of the logical block size.
    pub bs_unaligned: bool,
    /// Where random offsets fall (fio `random_distribution`).
    pub distribution: Distribution,
    /// Percent of a random job's I/Os that are random; the rest go on
    /// sequentially from the last one (fio `percentage_random`).
    pub percentage_random: u32,
    /// Stop after this many I/Os (fio `number_ios`).
    pub number_ios: Option<u64>,
    /// Wait this long before starting (fio `startdelay`).
    pub startdelay: Duration,
    /// `rate`, `rate_iops`, `rate_min`, `rate_iops_min`, `rate_process`.
    pub rate: RateSpec,
    /// `thinktime`, `thinktime_spin`, `thinktime_blocks`.
    pub thinktime: ThinkTime,
    /// Flush after this many writes (fio `fsync`; 0: never).
    pub fsync: u32,
    /// The same for `fdatasync` (a flush here too: no metadata to skip).
    pub fdatasync: u32,
    /// Flush once when the job's writes are done (fio `end_fsync`).
    pub end_fsync: bool,
    /// Percent of verified blocks trimmed before the read-back (fio
    /// `trim_percentage`, with `trim_backlog`): they must read back as
    /// anything, so the verify skips them.
    pub trim_percentage: u32,
    /// When this job ends, stop every other job (fio `exitall`).
    pub exitall: bool,
    /// `flow`, `flow_id`, `flow_sleep`.
    pub flow: FlowSpec,
    /// `steadystate`, `ss_dur`, `ss_ramp`: end the job once steady.
    pub steadystate: Option<SteadyState>,
    /// `latency_target`, `latency_window`, `latency_percentile`.
    pub latency_target: Option<LatencyTarget>,
    /// Report total-latency percentiles (fio `lat_percentiles`): in
    /// process the submission latency is part of the completion latency,
    /// so the two lists are the same.
    pub lat_percentiles: bool,
    /// What written buffers hold.
    pub buffers: BufferSpec,
    /// `verify_pattern` bytes (for `verify=pattern`, and after the header
    /// of the checksummed modes when given).
    pub verify_pattern: Vec<u8>,
    /// Read back and check every this many writes as the job runs (fio
    /// `verify_backlog`; 0: only after the writes).
    pub verify_backlog: u64,
    /// Verify unit (fio `verify_interval`); default the smallest block.
    pub verify_interval: Option<u64>,
    /// `write_bw_log`, `write_lat_log`, `write_iops_log`, `log_avg_msec`.
    pub logs: LogSpec,
    /// Nice value of the job's threads (fio `nice`).
    pub nice: i32,
    /// The `ioengine` the job file named (shown in the header line; the
    /// engine is always blkstack's own).
    pub ioengine: String,
    /// The job's file size (fio `filesize`): with one device per job, the
    /// region the job covers, `size` then bounding the I/O done.
    pub filesize: Option<SizeSpec>,
    /// `zonemode=strided`: `(zonesize, zonerange, zoneskip)`; sequential
    /// I/O does `zonesize` bytes per zone, then moves `zoneskip` past the
    /// zone's `zonerange`.
    pub strided_zones: Option<(u64, u64, u64)>,
    /// `zonemode=zbd`: emulated sequential-write-required zones of
    /// `zonesize` (the first field of `strided_zones`).
    pub zbd: bool,
    /// `max_open_zones` (0: no limit).
    pub max_open_zones: u32,
    /// `read_beyond_wp`: reads may go past a zone's write pointer.
    pub read_beyond_wp: bool,
    /// Start only once the job of this name has finished (fio `wait_for`).
    pub wait_for: Option<String>,
    /// Options accepted that have no counterpart in process (engine and
    /// OS tuning), named in the job's header line as fio options that do
    /// not apply here.
    pub not_applicable: Vec<String>,
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
            percentile_list: DEFAULT_PERCENTILES.to_vec(),
            group_reporting: false,
            stonewall: false,
            new_group: false,
            cpus_allowed: None,
            bs_dir: [None, None],
            rw_modifier: RwModifier::None,
            blockalign: None,
            bs_unaligned: false,
            distribution: Distribution::Random,
            percentage_random: 100,
            number_ios: None,
            startdelay: Duration::ZERO,
            rate: RateSpec::default(),
            thinktime: ThinkTime::default(),
            fsync: 0,
            fdatasync: 0,
            end_fsync: false,
            trim_percentage: 0,
            exitall: false,
            flow: FlowSpec::default(),
            steadystate: None,
            latency_target: None,
            lat_percentiles: false,
            buffers: BufferSpec::default(),
            verify_pattern: Vec::new(),
            verify_interval: None,
            verify_backlog: 0,
            logs: LogSpec::default(),
            nice: 0,
            ioengine: "psync".to_string(),
            filesize: None,
            strided_zones: None,
            zbd: false,
            max_open_zones: 0,
            read_beyond_wp: false,
            wait_for: None,
            not_applicable: Vec::new(),
        }
    }
}

impl JobSpec {
    /// The block sizes of direction `dir` (0 read, 1 write, 2 trim).
    pub fn bs_for(&self, dir: usize) -> &BlockSizes {
        match dir {
            1 | 2 => self.bs_dir[dir - 1].as_ref().unwrap_or(&self.bs),
            _ => &self.bs,
        }
    }

    /// Smallest and largest block size over every direction.
    pub fn bs_bounds(&self) -> (u64, u64) {
        let all = std::iter::once(&self.bs).chain(self.bs_dir.iter().flatten());
        all.fold((u64::MAX, 0), |(lo, hi), b| {
            (lo.min(b.min()), hi.max(b.max()))
        })
    }

    /// Bytes of I/O the job does when not time based, given its region.
    pub fn io_limit(&self, region: u64, dev_size: u64) -> u64 {
        let one = self.io_size.map(|s| s.resolve(dev_size)).unwrap_or(region);
        one.saturating_mul(self.loops as u64)
    }
}

#[cfg(test)]
mod tests {
    use crate::spec::*;

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
