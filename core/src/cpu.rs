//! CPU time accounting (getrusage), as fio reports usr/sys per job and as
//! the upstream changes the lab reproduces argue about CPU spent per I/O.

use std::time::Duration;

/// User and system CPU time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuTime {
    /// Time spent in user mode, in nanoseconds (`ru_utime`).
    pub user_ns: u64,
    /// Time spent in the kernel on the process's behalf, in nanoseconds
    /// (`ru_stime`).
    pub sys_ns: u64,
}

impl CpuTime {
    /// User plus system time.
    pub fn total_ns(self) -> u64 {
        self.user_ns + self.sys_ns
    }

    /// CPU time spent between `earlier` and this sample (saturating, so a
    /// sample taken out of order reads as zero rather than wrapping).
    pub fn since(self, earlier: CpuTime) -> CpuTime {
        CpuTime {
            user_ns: self.user_ns.saturating_sub(earlier.user_ns),
            sys_ns: self.sys_ns.saturating_sub(earlier.sys_ns),
        }
    }

    /// The sum of two samples, to total CPU time over several threads.
    pub fn plus(self, o: CpuTime) -> CpuTime {
        CpuTime {
            user_ns: self.user_ns + o.user_ns,
            sys_ns: self.sys_ns + o.sys_ns,
        }
    }

    /// Percent of `wall` spent in user and system mode (may exceed 100 for a
    /// whole process on several CPUs).
    pub fn percent_of(self, wall: Duration) -> (f64, f64) {
        let w = wall.as_nanos().max(1) as f64;
        (
            self.user_ns as f64 * 100.0 / w,
            self.sys_ns as f64 * 100.0 / w,
        )
    }
}

fn rusage(who: libc::c_int) -> CpuTime {
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer.
    unsafe { libc::getrusage(who, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    CpuTime {
        user_ns: tv(ru.ru_utime),
        sys_ns: tv(ru.ru_stime),
    }
}

/// CPU time of the calling thread, user and system together, to the ns
/// (getrusage counts in µs): for timing short stretches of one thread.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec out-parameter.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CPU time of the calling thread.
pub fn thread_cpu() -> CpuTime {
    rusage(libc::RUSAGE_THREAD)
}

/// CPU time of the whole process (all threads, including workers that
/// complete I/O on behalf of submitters).
pub fn process_cpu() -> CpuTime {
    rusage(libc::RUSAGE_SELF)
}
