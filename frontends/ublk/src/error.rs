//! What can go wrong presenting a device on ublk, typed so the CLI and
//! the control socket can say it plainly (the missing-module case above
//! all: most hosts have the driver but not the module loaded).

use crate::options::OptionsError;
use crate::params::ParamsError;
use crate::queue::QueueStartError;
use std::path::PathBuf;

/// The control node the kernel's ublk driver (drivers/block/ublk_drv.c)
/// creates when the module is loaded.
pub const CONTROL_PATH: &str = "/dev/ublk-control";

#[derive(Debug, thiserror::Error)]
pub enum UblkError {
    #[error(
        "{path} is missing: the kernel's ublk driver is not loaded (run `modprobe ublk_drv` as root; \
         it needs CONFIG_BLK_DEV_UBLK, Linux 6.0 or later)",
        path = .0.display()
    )]
    NoControl(PathBuf),
    #[error(
        "{path}: permission denied (ublk devices need root, or an unprivileged-ublk setup: a udev \
         rule giving users {path} and --ublk-unprivileged)",
        path = .0.display()
    )]
    Permission(PathBuf),
    #[error("ublk export {0}: already exported on ublk")]
    AlreadyExported(String),
    #[error("ublk export {0}: not exported on ublk")]
    NotExported(String),
    #[error("ublk export {name}: {what}")]
    Invalid { name: String, what: String },
    /// `--ublk-*` options the driver or the stack cannot take. Here and
    /// below the detail is in the message, not a `#[source]`, so a
    /// context chain (`{:#}`) prints it once.
    #[error("ublk export {name}: {what}")]
    Options { name: String, what: OptionsError },
    /// A device the driver would refuse.
    #[error("ublk export {name}: {what}")]
    Params { name: String, what: ParamsError },
    /// A queue could not be set up, so the device cannot start.
    #[error("ublk export {name}: {what}")]
    Queues { name: String, what: QueueStartError },
    /// A command the driver answered with an error (or did not answer in
    /// time: `ETIMEDOUT`).
    #[error("ublk export {name}: {what} failed: {errno}")]
    Kernel {
        name: String,
        what: &'static str,
        errno: Errno,
    },
    #[error("ublk export {name}: {what}: {source}")]
    Io {
        name: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// An errno the driver (or a system call on its nodes) answered,
/// positive, printed as the system's message for it (with its number).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", std::io::Error::from_raw_os_error(self.0))]
pub struct Errno(pub i32);

impl Errno {
    /// The errno of a failed system call, just after it failed.
    pub fn last() -> Errno {
        Errno(
            std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO),
        )
    }
}

impl From<std::io::Error> for Errno {
    fn from(e: std::io::Error) -> Errno {
        Errno(e.raw_os_error().unwrap_or(libc::EIO))
    }
}

/// Refuse early, with the module's name, where the driver is absent or
/// closed to us: the driver's own answer to that is a bare errno.
pub fn check_control(path: &std::path::Path) -> Result<(), UblkError> {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
    {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(UblkError::NoControl(path.to_path_buf()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            Err(UblkError::Permission(path.to_path_buf()))
        }
        Err(e) => Err(UblkError::Io {
            name: String::new(),
            what: "opening the ublk control device",
            source: e,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_control_node_names_the_module() {
        let dir = tempfile::tempdir().unwrap();
        let e = check_control(&dir.path().join("ublk-control")).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, UblkError::NoControl(_)), "{e:?}");
        assert!(text.contains("modprobe ublk_drv"), "{text}");
        assert!(text.contains("ublk-control is missing"), "{text}");
    }
}
