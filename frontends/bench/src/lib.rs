//! `blkstack bench`: an in-process, fio-compatible benchmark runner.
//!
//! It reads fio job files and fio's command-line options, drives blkstack
//! devices through the core [`Device`](blkstack_core::Device) API with
//! `iodepth` requests in flight per thread, and reports in fio's normal and
//! JSON formats, so results sit beside fio's own. Latencies go into
//! HdrHistograms; `verify=crc32c` writes self-describing blocks and reads
//! them back as fio does.
//!
//! # Library use (the lab and other frontends)
//!
//! ```no_run
//! use blkstack_bench::{run_jobs, JobSpec, RunOptions, RwMode};
//! use std::time::Duration;
//! let reg = blkstack_mapped::Registry::new();
//! reg.create("m0", "0 2048 memory").unwrap();
//! let job = JobSpec {
//!     name: "x".into(),
//!     filename: Some("m0".into()),
//!     rw: RwMode::RandRead,
//!     iodepth: 16,
//!     runtime: Some(Duration::from_secs(1)),
//!     time_based: true,
//!     ..JobSpec::default()
//! };
//! let report = run_jobs(&reg, &[job], &RunOptions::default()).unwrap();
//! println!("{:.0} IOPS, p99 {} ns", report.jobs[0].read.iops(),
//!          report.jobs[0].read.clat.percentile(99.0));
//! print!("{}", blkstack_bench::write_json(&report));
//! ```
//!
//! [`run_on_device`] runs against a [`DeviceRef`](blkstack_core::DeviceRef)
//! you built yourself; [`run_jobs_with`] takes any resolver.

pub mod buffers;
pub mod cli;
pub mod cmdline;
mod completion;
mod controls;
pub mod distribution;
mod engine;
/// Entry points of the cargo-fuzz targets in fuzz/ (and their corpus replay tests).
#[doc(hidden)]
pub mod fuzzing;
mod geometry;
mod job;
pub mod jobfile;
pub mod logs;
mod offsets;
pub mod option_table;
pub mod options;
pub mod output;
pub mod output_json;
pub mod output_terse;
pub mod parse;
pub mod rate;
mod run;
pub mod sizes;
pub mod spec;
pub mod stats;
pub mod status;
pub mod verify;
pub mod verify_algo;
mod zbd;

pub use cli::{run_cli, BenchArgs};
pub use cmdline::{parse_command_line, CommandLine, EtaMode, OutputFormat};
pub use completion::{request_stop, JobProgress};
pub use geometry::Geometry;
pub use jobfile::{parse_job_file, JobFileError};
pub use output::{write_normal, write_normal_header};
pub use output_json::{write_json, write_json_plus};
pub use run::{run_jobs, run_jobs_with, run_on_device, RunOptions};
pub use spec::{BlockSizes, HybridEstimator, JobSpec, RwMode, SizeSpec, VerifyMode, WaitMode};
pub use stats::{BenchReport, DirStats, GroupStats, JobResult, LatStats};
