//! SIGINT and SIGTERM as serve's stop: the handler writes a byte to a
//! self-pipe (the classic async-signal-safe pattern, as qemu's
//! `os-posix.c` termsig handler sets a flag the main loop sees), and
//! [`StopSignals::wait`] blocks on the pipe's other end. What stopping
//! means (control socket closed, every frontend shut down gracefully)
//! is serve's, in `lib.rs`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, Ordering};

/// The write end of the stop pipe, for the signal handler (-1: none).
static SIGNAL_FD: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(_sig: libc::c_int) {
    let fd = SIGNAL_FD.load(Ordering::Relaxed);
    if fd >= 0 {
        let b = 1u8;
        // SAFETY: write(2) is async-signal-safe; fd is our pipe's write
        // end, which is never closed (see `install`), and `b` is a valid
        // one-byte buffer. A full pipe means a stop is already pending.
        unsafe { libc::write(fd, (&b as *const u8).cast(), 1) };
    }
}

/// SIGINT and SIGTERM, caught: [`StopSignals::wait`] returns once one
/// arrived.
pub struct StopSignals {
    read: OwnedFd,
}

impl StopSignals {
    /// Catch SIGINT and SIGTERM from now on (once per process: a second
    /// call takes the signals over from the first).
    pub fn install() -> io::Result<StopSignals> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: fds is a valid array of two ints for pipe2 to fill.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both fds are fresh and ours alone.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // The handler may fire for the rest of the process: its end of
        // the pipe is never closed.
        SIGNAL_FD.store(write.into_raw_fd(), Ordering::Relaxed);
        for sig in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: a zeroed sigaction with a plain handler and an empty
            // mask is valid; on_signal only does async-signal-safe work.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as *const () as usize;
                libc::sigemptyset(&mut sa.sa_mask);
                sa.sa_flags = libc::SA_RESTART;
                if libc::sigaction(sig, &sa, std::ptr::null_mut()) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
        }
        Ok(StopSignals { read })
    }

    /// Block until SIGINT or SIGTERM arrives (or arrived since `install`).
    pub fn wait(&self) {
        loop {
            let mut pfd = libc::pollfd {
                fd: self.read.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, for the duration of the call.
            let r = unsafe { libc::poll(&mut pfd, 1, -1) };
            if r > 0 && pfd.revents != 0 {
                return;
            }
            if r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                // Only a signal ends serve: a failing poll (out of
                // memory) is retried after a pause, never a stop.
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }
}
