//! Running a list of jobs: fio's job/group model on threads.
//!
//! Each job runs `numjobs` threads. Jobs run concurrently until one with
//! `stonewall` (or `wait_for_previous`), which waits for everything before
//! it and opens a new reporting group; `new_group` opens a group without
//! waiting. Devices and geometry are resolved for every job before any I/O
//! starts, so a typo in the last job's `filename` fails the run up front.
//! While threads run, the calling thread draws the progress bar (when
//! asked) from counters the job loops publish once per completion batch.

use crate::completion::{clear_segment_stop, clear_stop, JobProgress};
use crate::engine::ThreadSetup;
use crate::geometry::Geometry;
use crate::job::run_thread;
use crate::spec::JobSpec;
use crate::stats::{BenchReport, JobResult};
use anyhow::{bail, Context};
use blkstack_core::clock::now_ns;
use blkstack_core::DeviceRef;
use blkstack_mapped::Registry;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// How to run (everything that is not part of a job).
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Draw a progress bar on stderr once the run has lasted a second.
    pub progress: bool,
    /// Device for jobs without `filename` (and without a device named like
    /// the job): the CLI passes the last device `--stack`/`--concise` made.
    pub default_filename: Option<String>,
    /// fio's `--status-interval`: report progress this often.
    pub status: Option<crate::status::StatusSink>,
}

/// A job thread ready to start.
struct Planned {
    setup: ThreadSetup,
    /// Index of the stonewall segment it runs in.
    segment: usize,
}

/// Run `jobs` against devices of `registry` (`filename` is a registry name
/// or `/dev/mapper/NAME`).
pub fn run_jobs(
    registry: &Arc<Registry>,
    jobs: &[JobSpec],
    opts: &RunOptions,
) -> anyhow::Result<BenchReport> {
    let resolve = |job: &JobSpec| -> anyhow::Result<(String, DeviceRef)> {
        let name = match &job.filename {
            Some(f) => device_name_for(registry, f),
            None if registry.get(&job.name).is_some() => job.name.clone(),
            None => opts.default_filename.clone().with_context(|| {
                format!(
                    "job '{}' has no filename and there is no device named '{}'",
                    job.name, job.name
                )
            })?,
        };
        let dev = registry
            .device(&name)
            .map_err(|e| anyhow::anyhow!("job '{}': device '{}': {}", job.name, name, e))?;
        Ok((name, dev))
    };
    run_jobs_with(&resolve, jobs, opts)
}

/// fio's `filename=/dev/NAME`: the stack's device `NAME` when there is
/// one (`/dev/mapper/NAME` the registry resolves itself), else as given.
fn device_name_for(registry: &Registry, filename: &str) -> String {
    if let Some(rest) = filename.strip_prefix("/dev/") {
        if !rest.starts_with("mapper/") && registry.get(rest).is_some() {
            return rest.to_string();
        }
    }
    filename.to_string()
}

/// Run every job against `device` (called `name` in the report), ignoring
/// their `filename`: for callers that built a device themselves.
pub fn run_on_device(
    device: DeviceRef,
    name: &str,
    jobs: &[JobSpec],
    opts: &RunOptions,
) -> anyhow::Result<BenchReport> {
    let resolve = |_: &JobSpec| -> anyhow::Result<(String, DeviceRef)> {
        Ok((name.to_string(), device.clone()))
    };
    run_jobs_with(&resolve, jobs, opts)
}

/// Run `jobs`, finding each job's device with `resolve`.
pub fn run_jobs_with(
    resolve: &dyn Fn(&JobSpec) -> anyhow::Result<(String, DeviceRef)>,
    jobs: &[JobSpec],
    opts: &RunOptions,
) -> anyhow::Result<BenchReport> {
    if jobs.is_empty() {
        bail!("no jobs to run");
    }
    let mut planned = Vec::new();
    let mut groupid = 0u32;
    let mut segment = 0usize;
    let mut thread_number = 0u32;
    for (i, job) in jobs.iter().enumerate() {
        if i > 0 && job.stonewall {
            groupid += 1;
            segment += 1;
        } else if i > 0 && job.new_group {
            groupid += 1;
        }
        if job.time_based && job.runtime.is_none() {
            bail!("job '{}': time_based needs a runtime", job.name);
        }
        let (dev_name, dev) = resolve(job)?;
        if (job.rw.writes() || job.rw.trims()) && dev.features().read_only {
            bail!(
                "job '{}': {dev_name} is read-only and the job writes",
                job.name
            );
        }
        let wait_for = match &job.wait_for {
            Some(name) => {
                let ahead: Vec<Arc<JobProgress>> = planned
                    .iter()
                    .filter(|p: &&Planned| &p.setup.spec.name == name)
                    .map(|p| p.setup.progress.clone())
                    .collect();
                if ahead.is_empty() {
                    bail!(
                        "job '{}': wait_for={name}: no job of that name before it",
                        job.name
                    );
                }
                ahead
            }
            None => Vec::new(),
        };
        for clone in 0..job.numjobs {
            let geometry = Geometry::resolve(job, &dev, &dev_name, clone)?;
            thread_number += 1;
            planned.push(Planned {
                setup: ThreadSetup {
                    spec: job.clone(),
                    device: dev.clone(),
                    device_name: dev_name.clone(),
                    geometry,
                    groupid,
                    thread_number,
                    progress: Arc::new(JobProgress::default()),
                    wait_for: wait_for.clone(),
                },
                segment,
            });
        }
    }
    clear_stop();
    let mut results: Vec<JobResult> = Vec::with_capacity(planned.len());
    let last_segment = segment;
    let mut rest = planned;
    for seg in 0..=last_segment {
        let (now, later): (Vec<Planned>, Vec<Planned>) =
            rest.into_iter().partition(|p| p.segment == seg);
        rest = later;
        clear_segment_stop();
        results.extend(run_segment(now, opts)?);
    }
    Ok(BenchReport::from_threads(results))
}

/// Run a set of threads concurrently and wait for them all.
fn run_segment(threads: Vec<Planned>, opts: &RunOptions) -> anyhow::Result<Vec<JobResult>> {
    let progress: Vec<Arc<JobProgress>> =
        threads.iter().map(|p| p.setup.progress.clone()).collect();
    let plan = ProgressPlan::new(&threads);
    let watched: Vec<crate::status::Watched> = threads
        .iter()
        .map(|p| crate::status::Watched {
            name: p.setup.spec.name.clone(),
            groupid: p.setup.groupid,
            progress: p.setup.progress.clone(),
        })
        .collect();
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for (k, p) in threads.into_iter().enumerate() {
            let name = format!("bench-{}-{}", p.setup.spec.name, k);
            let h = std::thread::Builder::new()
                .name(name)
                .spawn_scoped(scope, move || {
                    if let Some(cpus) = &p.setup.spec.cpus_allowed {
                        pin_thread(cpus).with_context(|| {
                            format!("job '{}': cpus_allowed", p.setup.spec.name)
                        })?;
                    }
                    run_thread(p.setup)
                })
                .context("spawning a job thread")?;
            handles.push(h);
        }
        if let Some(st) = &opts.status {
            crate::status::report_status(&watched, st);
        } else if opts.progress {
            draw_progress(&progress, &plan);
        }
        let mut out = Vec::with_capacity(handles.len());
        for h in handles {
            match h.join() {
                Ok(r) => out.push(r?),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        Ok(out)
    })
}

/// Restrict the calling thread to `cpus` (fio's `cpus_allowed` applied
/// with `sched_setaffinity`, as fio does for each job thread).
fn pin_thread(cpus: &[usize]) -> anyhow::Result<()> {
    // SAFETY: a zeroed cpu_set_t is empty; every CPU number was checked
    // to be below CPU_SETSIZE when the option was parsed.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        bail!(
            "sched_setaffinity({cpus:?}) failed: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// What the progress bar measures against.
struct ProgressPlan {
    /// All threads are time based: the bar is time, this long (ns).
    time_ns: Option<u64>,
    /// Otherwise: bytes all threads will move in their I/O phase.
    bytes: u64,
    jobs: usize,
}

impl ProgressPlan {
    fn new(threads: &[Planned]) -> ProgressPlan {
        let all_timed = threads
            .iter()
            .all(|p| p.setup.spec.time_based && p.setup.spec.runtime.is_some());
        let time_ns = all_timed.then(|| {
            threads
                .iter()
                .map(|p| {
                    let s = &p.setup.spec;
                    (s.ramp_time + s.runtime.unwrap_or_default()).as_nanos() as u64
                })
                .max()
                .unwrap_or(0)
        });
        let bytes = threads.iter().map(|p| p.setup.geometry.io_limit).sum();
        ProgressPlan {
            time_ns,
            bytes,
            jobs: threads.len(),
        }
    }
}

/// fio-like status line on stderr, shown only once the run has lasted a
/// second (short runs stay quiet), until every thread is done.
fn draw_progress(progress: &[Arc<JobProgress>], plan: &ProgressPlan) {
    let t0 = now_ns();
    // Check for the end often (the caller joins right after), redraw less.
    let tick = Duration::from_millis(50);
    let redraw_ns = 250_000_000;
    let mut bar: Option<ProgressBar> = None;
    let (mut last_ns, mut last_r, mut last_w, mut last_b) = (t0, 0u64, 0u64, 0u64);
    loop {
        std::thread::sleep(tick);
        if progress.iter().all(|p| p.done.load(Ordering::Acquire)) {
            break;
        }
        let now = now_ns();
        if now - t0 < 1_000_000_000 || now - last_ns < redraw_ns {
            continue;
        }
        let b = bar.get_or_insert_with(|| {
            let len = plan.time_ns.map(|t| t / 1_000_000).unwrap_or(plan.bytes);
            let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
            pb.set_style(
                ProgressStyle::with_template(
                    "Jobs: {prefix} [{bar:30}] {percent:>3}% [{msg}] [eta {eta}]",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            pb.set_prefix(plan.jobs.to_string());
            pb
        });
        let r: u64 = progress
            .iter()
            .map(|p| p.read_ios.load(Ordering::Relaxed))
            .sum();
        let w: u64 = progress
            .iter()
            .map(|p| p.write_ios.load(Ordering::Relaxed))
            .sum();
        let bytes: u64 = progress
            .iter()
            .map(|p| p.bytes.load(Ordering::Relaxed))
            .sum();
        let dt = (now - last_ns).max(1) as f64 / 1e9;
        let bw = (bytes.saturating_sub(last_b)) as f64 / dt;
        let riops = (r.saturating_sub(last_r)) as f64 / dt;
        let wiops = (w.saturating_sub(last_w)) as f64 / dt;
        (last_ns, last_r, last_w, last_b) = (now, r, w, bytes);
        let verifying = progress
            .iter()
            .any(|p| p.phase.load(Ordering::Relaxed) == 2);
        b.set_message(format!(
            "{}{}={}/s][r={},w={} IOPS",
            if verifying { "verify " } else { "" },
            "bw",
            crate::output::num2str(bw as u64, 4, 1, true, crate::output::Unit::Byte),
            crate::output::num2str(riops as u64, 4, 1, false, crate::output::Unit::None),
            crate::output::num2str(wiops as u64, 4, 1, false, crate::output::Unit::None),
        ));
        match plan.time_ns {
            Some(_) => b.set_position((now - t0) / 1_000_000),
            None => b.set_position(bytes),
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
}
