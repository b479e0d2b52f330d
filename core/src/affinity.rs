//! Which CPU a thread runs on, and pinning it to one: what per-CPU workers
//! need (kblockd bound per CPU as the kernel's, dm-delay's hybrid workers
//! completing on the submitter's CPU).

/// The CPU the calling thread runs on now, if the kernel says.
#[inline]
pub fn current_cpu() -> Option<usize> {
    // SAFETY: plain vDSO call without arguments; -1 when unknown.
    usize::try_from(unsafe { libc::sched_getcpu() }).ok()
}

/// Pin the calling thread to `cpu`. Failure (a cpuset without it, or a
/// CPU number past `CPU_SETSIZE`) leaves the thread unpinned, which costs
/// only the locality.
pub fn pin_current_thread(cpu: usize) {
    if cpu >= libc::CPU_SETSIZE as usize {
        return;
    }
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET stays within it for
    // cpu < CPU_SETSIZE, checked above.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// The CPUs this process may run on (all of 0..available_parallelism if
/// the mask cannot be read).
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set for the kernel to
    // fill; CPU_ISSET reads within it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
            let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect();
            if !cpus.is_empty() {
                return cpus;
            }
        }
    }
    (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pinned_thread_runs_on_its_cpu() {
        let cpus = allowed_cpus();
        assert!(!cpus.is_empty());
        let last = *cpus.last().unwrap();
        let ran_on = std::thread::spawn(move || {
            pin_current_thread(last);
            current_cpu()
        })
        .join()
        .unwrap();
        assert_eq!(ran_on, Some(last));
    }
}
