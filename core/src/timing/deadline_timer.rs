//! A CLOCK_MONOTONIC timerfd armed for an absolute time: a sleep that
//! another thread can move earlier without waking the sleeper.
//!
//! The hybrid flush of dm-delay (the maintainer's suggested follow-up to
//! "dm: delay: use kthread instead of timers and wq": sleep for long
//! delays, poll for short ones) sleeps on one of these. A submitter whose
//! bio is due before the armed time re-arms it, so the worker wakes once
//! per deadline and is never woken merely to be told about a bio, as an
//! hrtimer's `hrtimer_start_range_ns` moves a pending timer.
//!
//! A thread with an event loop of its own may instead poll the timer's
//! descriptor ([`DeadlineTimer::fd`]): it polls readable once the armed
//! time has passed, until the timer is armed again or disarmed (either
//! resets the expiry count), so it needs no `read`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Why a [`DeadlineTimer`] could not be made.
#[derive(Debug, thiserror::Error)]
pub enum DeadlineTimerError {
    /// `timerfd_create` failed (descriptor limit, or no timerfd support).
    #[error("cannot create a CLOCK_MONOTONIC timerfd")]
    Create(#[source] std::io::Error),
}

/// A one-shot absolute CLOCK_MONOTONIC timer one thread blocks on.
pub struct DeadlineTimer {
    fd: OwnedFd,
}

impl DeadlineTimer {
    /// A disarmed timer on its own timerfd.
    pub fn new() -> Result<DeadlineTimer, DeadlineTimerError> {
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_CLOEXEC) };
        if fd < 0 {
            return Err(DeadlineTimerError::Create(std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(DeadlineTimer { fd })
    }

    /// Fire at the absolute CLOCK_MONOTONIC time `at_ns` (at least 1: 0
    /// would disarm); a time already past fires at once.
    pub fn arm(&self, at_ns: u64) {
        let at_ns = at_ns.max(1);
        self.set(libc::timespec {
            tv_sec: (at_ns / 1_000_000_000) as libc::time_t,
            tv_nsec: (at_ns % 1_000_000_000) as libc::c_long,
        });
    }

    /// Stop the timer: it will not fire, and a fire not yet waited for
    /// is forgotten (the descriptor no longer polls readable).
    pub fn disarm(&self) {
        self.set(libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        });
    }

    /// Set the one-shot absolute expiry `value` (zero disarms).
    fn set(&self, value: libc::timespec) {
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: value,
        };
        // SAFETY: valid descriptor and itimerspec.
        unsafe {
            libc::timerfd_settime(
                self.fd.as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            );
        }
    }

    /// The timerfd, for a caller that polls it beside other descriptors
    /// (readable once the armed time has passed).
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }

    /// Block until the timer fires (or has fired since the last wait).
    pub fn wait(&self) {
        let mut ticks = 0u64;
        loop {
            // SAFETY: reading 8 bytes into a u64 we own.
            let r = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    &mut ticks as *mut u64 as *mut libc::c_void,
                    8,
                )
            };
            if r >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::now_ns;
    use std::sync::Arc;

    #[test]
    fn fires_never_before_the_armed_time() {
        let t = DeadlineTimer::new().expect("timerfd");
        for _ in 0..10 {
            let at = now_ns() + 200_000;
            t.arm(at);
            t.wait();
            assert!(now_ns() >= at);
        }
    }

    #[test]
    fn another_thread_can_bring_the_wake_forward() {
        let t = Arc::new(DeadlineTimer::new().expect("timerfd"));
        t.arm(now_ns() + 60_000_000_000);
        let waiter = t.clone();
        let h = std::thread::spawn(move || {
            waiter.wait();
            now_ns()
        });
        std::thread::sleep(std::time::Duration::from_millis(5));
        let early = now_ns() + 1_000_000;
        t.arm(early);
        let woke = h.join().expect("waiter");
        assert!(
            woke >= early,
            "woke {} ns before the new time",
            early - woke
        );
        assert!(woke < early + 30_000_000_000, "the re-arm did not take");
    }
}
