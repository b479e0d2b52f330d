//! The floors under any delay design that sleeps per I/O, measured on
//! this machine for `lab delay`'s notes: what one timed sleep and its
//! wake-up cost, and how late a worker's wake of a blocked submitter
//! comes (the kernel's `hrtimer_nanosleep` and a waitqueue wake-up, in
//! userspace terms).

use crate::common::median;

/// The floor under any design that sleeps per I/O: what one timed 1 ms
/// sleep and its wake-up cost this thread in CPU (median of `n`, ns), and
/// how late the wakes came (p50, p90, p99, ns). Hybrid at QD1 sleeps
/// twice per I/O: the delay worker and the bench job thread.
pub(super) fn sleep_wake_floor(n: usize) -> (f64, [f64; 3]) {
    blkstack_core::timing::prepare_precise_thread();
    let mut late = Vec::with_capacity(n);
    let costs: Vec<f64> = (0..n)
        .map(|_| {
            let c0 = blkstack_core::cpu::thread_cpu();
            let until = blkstack_core::clock::now_ns() + 1_000_000;
            blkstack_core::clock::sleep_until_ns(until);
            late.push((blkstack_core::clock::now_ns() - until) as f64);
            blkstack_core::cpu::thread_cpu().since(c0).total_ns() as f64
        })
        .collect();
    late.sort_by(f64::total_cmp);
    let q = |p: usize| late[(n * p / 100).min(n - 1)];
    (median(&costs), [q(50), q(90), q(99)])
}

/// The floor under a delay worker that sleeps to a deadline and then
/// wakes a blocked submitter: the worker sleeps 1 ms (absolute, 1 ns slack)
/// and notifies a condition variable the submitter waits on, `n` times,
/// with both threads pinned to CPU 0, or the submitter to CPU 1 when
/// `cross` (`None` if the machine has no CPU 1). Returns the submitter's
/// wake latency (p50, p90 from the notify, ns) and the worker's CPU per
/// round (sleep + wake + notify, ns).
pub(super) fn wake_floor(cross: bool, n: usize) -> Option<([f64; 2], f64)> {
    use std::sync::{Condvar, Mutex};
    fn pin(cpu: usize) -> bool {
        // SAFETY: a zeroed cpu_set_t is empty; cpu is 0 or 1.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        }
    }
    let clock = blkstack_core::clock::now_ns;
    // (round, when the worker notified)
    let shared = (Mutex::new((0usize, 0u64)), Condvar::new());
    let mut lat: Vec<f64> = Vec::with_capacity(n);
    let mut worker_cpu = 0.0;
    let ok = std::thread::scope(|s| {
        let sub = s.spawn(|| {
            if !pin(usize::from(cross)) {
                // Let the worker finish its rounds, then report no figure.
                let mut g = shared.0.lock().unwrap_or_else(|e| e.into_inner());
                while g.0 < n {
                    g = shared.1.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                return false;
            }
            let mut seen = 0;
            let mut g = shared.0.lock().unwrap_or_else(|e| e.into_inner());
            while seen < n {
                while g.0 == seen {
                    g = shared.1.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                lat.push(clock().saturating_sub(g.1) as f64);
                seen = g.0;
            }
            true
        });
        // The worker is a thread of its own: pinning the caller would
        // pin every bench job it starts later.
        let worker = s.spawn(|| {
            pin(0);
            blkstack_core::timing::prepare_precise_thread();
            let c0 = blkstack_core::cpu::thread_cpu();
            for i in 1..=n {
                blkstack_core::clock::sleep_ns(1_000_000);
                *shared.0.lock().unwrap_or_else(|e| e.into_inner()) = (i, clock());
                shared.1.notify_one();
            }
            blkstack_core::cpu::thread_cpu().since(c0).total_ns() as f64 / n as f64
        });
        worker_cpu = worker.join().unwrap_or(0.0);
        sub.join().unwrap_or(false)
    });
    if !ok || lat.is_empty() {
        return None;
    }
    lat.sort_by(f64::total_cmp);
    let q = |p: usize| lat[(lat.len() * p / 100).min(lat.len() - 1)];
    Some(([q(50), q(90)], worker_cpu))
}
