//! One job thread from start to end, fio's `thread_main`: `startdelay`,
//! `nice`, the ramp, the measured I/O phase, `end_fsync`, the verify phase,
//! the log files, the `rate_min` check and `exitall`.

use crate::completion::{request_segment_stop, stop_requested};
use crate::engine::{Engine, ThreadSetup};
use crate::spec::{VerifyMode, WaitMode};
use crate::stats::{DepthStats, DirStats, JobResult};
use anyhow::Context;
use blkstack_core::clock::{now_ns, sleep_until_ns};
use blkstack_core::timing::prepare_precise_thread;
use std::sync::atomic::Ordering;

/// Context switches (voluntary + involuntary), major and minor faults of
/// the calling thread: the rest of fio's `cpu` line.
fn thread_rusage_counts() -> [u64; 3] {
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    [
        (ru.ru_nvcsw + ru.ru_nivcsw) as u64,
        ru.ru_majflt as u64,
        ru.ru_minflt as u64,
    ]
}

/// What happens before a job's first I/O: timer slack, `nice`,
/// `wait_for`, `startdelay`.
fn before_start(setup: &ThreadSetup) -> anyhow::Result<()> {
    let spec = &setup.spec;
    if spec.wait == WaitMode::Hybrid || spec.rate.limited() || !spec.thinktime.time.is_zero() {
        // Hybrid sleeps and paced gaps are short; the default 50 µs slack
        // would swamp them.
        prepare_precise_thread();
    }
    if spec.nice != 0 {
        // SAFETY: setpriority on the calling thread (who 0 = this thread).
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, spec.nice) };
        if rc != 0 {
            anyhow::bail!(
                "job '{}': nice={}: {}",
                spec.name,
                spec.nice,
                std::io::Error::last_os_error()
            );
        }
    }
    // fio's wait_for: poll the other job's done flags (it ends once).
    while !setup
        .wait_for
        .iter()
        .all(|p| p.done.load(Ordering::Acquire))
        && !stop_requested()
    {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    if !spec.startdelay.is_zero() {
        let until = now_ns().saturating_add(spec.startdelay.as_nanos() as u64);
        while now_ns() < until && !stop_requested() {
            sleep_until_ns(until.min(now_ns() + 100_000_000));
        }
    }
    Ok(())
}

/// Run one job thread to the end: ramp, work, verify.
pub(crate) fn run_thread(setup: ThreadSetup) -> anyhow::Result<JobResult> {
    let spec = &setup.spec;
    before_start(&setup)?;
    let mut eng = Engine::new(&setup)?;
    let t0 = now_ns();
    let mut result = JobResult::new(&spec.name, setup.groupid, spec, &setup.device_name);

    if !spec.ramp_time.is_zero() {
        ramp(&mut eng, &setup, t0);
    }

    setup.progress.phase.store(1, Ordering::Relaxed);
    // CPU and rusage are counted from here, as fio resets them when the
    // ramp ends: they are shares of the runtime, which excludes the ramp.
    let cpu0 = blkstack_core::cpu::thread_cpu();
    let ru0 = thread_rusage_counts();
    let work_start = now_ns();
    eng.start_sampling(work_start);
    let deadline = match spec.runtime {
        Some(r) => work_start.saturating_add(r.as_nanos().min(u64::MAX as u128) as u64),
        None => u64::MAX,
    };
    let io_limit = if spec.time_based {
        u64::MAX
    } else {
        setup.geometry.io_limit
    };
    eng.pump_work(true, deadline, io_limit);
    if spec.end_fsync && spec.rw.writes() && !eng.stats.failed {
        eng.final_flush();
    }
    let work_end = now_ns();
    let work_ns = work_end - work_start;
    for d in [
        &mut eng.stats.read,
        &mut eng.stats.write,
        &mut eng.stats.trim,
    ] {
        if d.total_ios + d.errors > 0 {
            d.runtime_ns = work_ns;
        }
    }
    if let Some(logs) = eng.ctl.logs.take() {
        logs.write(work_end, &spec.name)
            .with_context(|| format!("job '{}': writing its log files", spec.name))?;
    }

    let verify_ns = verify_phase(&mut eng, &setup);
    let end = now_ns();
    let cpu = blkstack_core::cpu::thread_cpu().since(cpu0);
    eng.publish_progress();
    setup.progress.done.store(true, Ordering::Release);

    result.error = eng.stats.first_error;
    if result.error == 0 && !rate_min_met(spec, &eng, work_ns) {
        // fio ends a job that cannot keep rate_min/rate_iops_min.
        result.error = libc::EIO;
    }
    if spec.exitall {
        request_segment_stop();
    }
    take_figures(&mut result, &mut eng);
    result.usr_cpu_ns = cpu.user_ns;
    result.sys_cpu_ns = cpu.sys_ns;
    let ru1 = thread_rusage_counts();
    result.ctx = ru1[0].saturating_sub(ru0[0]);
    result.majf = ru1[1].saturating_sub(ru0[1]);
    result.minf = ru1[2].saturating_sub(ru0[2]);
    result.runtime_ns = work_ns + verify_ns;
    result.elapsed_ns = end - t0;
    debug_assert_eq!(eng.inflight(), 0);
    Ok(result)
}

/// The ramp: I/O as in the work phase, none of it counted.
fn ramp(eng: &mut Engine, setup: &ThreadSetup, t0: u64) {
    let spec = &setup.spec;
    setup.progress.phase.store(0, Ordering::Relaxed);
    let ramp_end = t0.saturating_add(spec.ramp_time.as_nanos() as u64);
    eng.pump_work(false, ramp_end, u64::MAX);
    // The verify log survives the ramp: those writes are on the device.
    eng.stats.read = DirStats::default();
    eng.stats.write = DirStats::default();
    eng.stats.trim = DirStats::default();
    eng.stats.depths = DepthStats::default();
}

/// fio's verify phase after the writes, if the job has one; its
/// duration in ns (0 without one).
fn verify_phase(eng: &mut Engine, setup: &ThreadSetup) -> u64 {
    let spec = &setup.spec;
    let mut verify_ns = 0;
    if spec.verify != VerifyMode::None
        && spec.do_verify
        && spec.rw.writes()
        && !eng.stats.failed
        && !stop_requested()
    {
        setup.progress.phase.store(2, Ordering::Relaxed);
        let v0 = now_ns();
        let reads_before = eng.stats.read.total_ios;
        eng.pump_verify();
        verify_ns = now_ns() - v0;
        if eng.stats.read.total_ios > reads_before {
            // fio counts the verify phase as read time.
            eng.stats.read.runtime_ns += verify_ns;
        }
    }
    verify_ns
}

/// Move the engine's figures into the job's result.
fn take_figures(result: &mut JobResult, eng: &mut Engine) {
    result.steady_attained = eng.ctl.steady_attained;
    result.read = std::mem::take(&mut eng.stats.read);
    result.write = std::mem::take(&mut eng.stats.write);
    result.trim = std::mem::take(&mut eng.stats.trim);
    result.depths = std::mem::take(&mut eng.stats.depths);
    (
        result.verify_errors,
        result.verify_checked,
        result.verify_failures,
    ) = eng.take_verify_outcome();
}

/// Did the job keep its `rate_min`/`rate_iops_min` on average?
fn rate_min_met(spec: &crate::spec::JobSpec, eng: &Engine, work_ns: u64) -> bool {
    let secs = work_ns as f64 / 1e9;
    if secs <= 0.0 {
        return true;
    }
    [&eng.stats.read, &eng.stats.write, &eng.stats.trim]
        .iter()
        .enumerate()
        .all(|(i, d)| {
            let bw_ok = spec.rate.min_bytes_per_sec[i] == 0
                || d.total_ios == 0
                || d.io_bytes as f64 / secs >= spec.rate.min_bytes_per_sec[i] as f64;
            let iops_ok = spec.rate.min_iops[i] == 0
                || d.total_ios == 0
                || d.total_ios as f64 / secs >= spec.rate.min_iops[i] as f64;
            bw_ok && iops_ok
        })
}
