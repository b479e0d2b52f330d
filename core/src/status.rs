//! Completion status of a bio: the kernel's `blk_status_t`.
//!
//! The distinction between path errors and target errors matters for
//! multipath, which retries only the former (kernel `blk_path_error`).

use std::fmt;

/// How a bio ended. `Ok` is success; the rest name the failure class the
/// way `blk_status_t` does, so that errno mapping (for NBD) and multipath's
/// retry decision can be made from the status alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum Status {
    /// Success (`BLK_STS_OK`).
    #[default]
    Ok = 0,
    /// Operation not supported by this device (EOPNOTSUPP).
    NotSupported,
    /// Timed out (ETIMEDOUT).
    Timeout,
    /// No space (ENOSPC).
    NoSpace,
    /// Transport/path failure: retryable on another path (ENOLINK).
    Transport,
    /// The target itself refused: not retryable on another path (EREMOTEIO).
    Target,
    /// Medium error, e.g. a bad block (ENODATA).
    Medium,
    /// Out of some resource, try later (ENOMEM).
    Resource,
    /// Generic I/O error (EIO).
    IoError,
    /// Would block (EAGAIN); used for fast-zero refusals.
    Again,
    /// Request outside the device or misaligned (EINVAL).
    Invalid,
    /// Write to a read-only device (EPERM).
    Permission,
    /// Request too large (EOVERFLOW).
    Overflow,
}

impl Status {
    /// Whether the bio succeeded.
    pub fn is_ok(self) -> bool {
        self == Status::Ok
    }

    /// Positive errno for this status (0 for `Ok`).
    pub fn errno(self) -> i32 {
        match self {
            Status::Ok => 0,
            Status::NotSupported => libc::EOPNOTSUPP,
            Status::Timeout => libc::ETIMEDOUT,
            Status::NoSpace => libc::ENOSPC,
            Status::Transport => libc::ENOLINK,
            Status::Target => libc::EREMOTEIO,
            Status::Medium => libc::ENODATA,
            Status::Resource => libc::ENOMEM,
            Status::IoError => libc::EIO,
            Status::Again => libc::EAGAIN,
            Status::Invalid => libc::EINVAL,
            Status::Permission => libc::EPERM,
            Status::Overflow => libc::EOVERFLOW,
        }
    }

    /// Map an errno (positive or negative) back to a status; unknown ones
    /// become `IoError`.
    pub fn from_errno(errno: i32) -> Status {
        match errno.abs() {
            0 => Status::Ok,
            libc::EOPNOTSUPP => Status::NotSupported,
            libc::ETIMEDOUT => Status::Timeout,
            libc::ENOSPC => Status::NoSpace,
            libc::ENOLINK => Status::Transport,
            libc::EREMOTEIO => Status::Target,
            libc::ENODATA => Status::Medium,
            libc::ENOMEM => Status::Resource,
            libc::EAGAIN => Status::Again,
            libc::EINVAL => Status::Invalid,
            libc::EPERM | libc::EROFS => Status::Permission,
            libc::EOVERFLOW => Status::Overflow,
            _ => Status::IoError,
        }
    }

    /// Kernel `blk_path_error`: may this failure succeed on another path?
    pub fn is_path_error(self) -> bool {
        !matches!(
            self,
            Status::Ok
                | Status::NotSupported
                | Status::NoSpace
                | Status::Target
                | Status::Medium
                | Status::Invalid
                | Status::Permission
                | Status::Overflow
        )
    }

    /// The status as one byte, for traces and wire formats;
    /// [`Status::from_u8`] reverses it.
    pub fn as_u8(self) -> u8 {
        self as u8
    }

    /// The status [`Status::as_u8`] encoded; unknown bytes become `IoError`.
    pub fn from_u8(v: u8) -> Status {
        const ALL: [Status; 13] = [
            Status::Ok,
            Status::NotSupported,
            Status::Timeout,
            Status::NoSpace,
            Status::Transport,
            Status::Target,
            Status::Medium,
            Status::Resource,
            Status::IoError,
            Status::Again,
            Status::Invalid,
            Status::Permission,
            Status::Overflow,
        ];
        ALL.get(v as usize).copied().unwrap_or(Status::IoError)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Status::Ok => "ok",
            Status::NotSupported => "operation not supported",
            Status::Timeout => "timeout",
            Status::NoSpace => "no space",
            Status::Transport => "transport (path) error",
            Status::Target => "target error",
            Status::Medium => "medium error",
            Status::Resource => "out of resources",
            Status::IoError => "I/O error",
            Status::Again => "try again",
            Status::Invalid => "invalid request",
            Status::Permission => "read-only",
            Status::Overflow => "request too large",
        };
        f.write_str(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_round_trips() {
        for v in 0..13u8 {
            let s = Status::from_u8(v);
            assert_eq!(s.as_u8(), v);
            assert_eq!(Status::from_errno(s.errno()), s);
        }
    }

    #[test]
    fn path_errors_follow_kernel() {
        assert!(Status::IoError.is_path_error());
        assert!(Status::Transport.is_path_error());
        assert!(!Status::Medium.is_path_error());
        assert!(!Status::Ok.is_path_error());
    }
}
