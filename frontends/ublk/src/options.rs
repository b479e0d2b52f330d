//! How a device is presented on ublk: queues, depth, I/O buffer size and
//! the driver features asked for (`UBLK_F_*` in the kernel's
//! include/uapi/linux/ublk_cmd.h).

/// Default queues and depth: the blk-mq engine's own defaults
/// (`submit_queues=1`, `hw_queue_depth=64`), so a ublk queue is one of
/// our hardware queues and the kernel never has more requests in flight
/// than our tags hold.
pub const DEFAULT_QUEUES: u16 = 1;
pub const DEFAULT_DEPTH: u16 = 64;
/// Largest request the kernel sends (its `max_sectors`): a buffer of
/// this size is reserved per tag (address space, touched only as used).
pub const DEFAULT_IO_BUF_BYTES: u32 = 512 << 10;
/// The driver's limits (`UBLK_MAX_NR_QUEUES`, `UBLK_MAX_QUEUE_DEPTH`).
pub const MAX_QUEUES: u16 = 4096;
pub const MAX_DEPTH: u16 = 4096;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UblkOptions {
    pub queues: u16,
    pub depth: u16,
    pub io_buf_bytes: u32,
    /// `UBLK_F_USER_RECOVERY` (with `_REISSUE`): the device outlives a
    /// killed server, its I/O waits, and a server restarted with the same
    /// names takes it over and reissues what was in flight.
    pub recovery: bool,
    /// `UBLK_F_UNPRIVILEGED_DEV`: a device a non-root user may add where
    /// /dev/ublk-control is open to them. The kernel refuses recovery for
    /// such devices, so this turns recovery off.
    pub unprivileged: bool,
}

impl Default for UblkOptions {
    fn default() -> Self {
        UblkOptions {
            queues: DEFAULT_QUEUES,
            depth: DEFAULT_DEPTH,
            io_buf_bytes: DEFAULT_IO_BUF_BYTES,
            recovery: true,
            unprivileged: false,
        }
    }
}

impl UblkOptions {
    /// Check against the driver's limits; the message names the flag.
    pub fn validate(&self) -> Result<(), String> {
        if self.queues == 0 || self.queues > MAX_QUEUES {
            return Err(format!(
                "--ublk-queues {}: must be 1..={MAX_QUEUES}",
                self.queues
            ));
        }
        if self.depth == 0 || self.depth > MAX_DEPTH {
            return Err(format!(
                "--ublk-depth {}: must be 1..={MAX_DEPTH}",
                self.depth
            ));
        }
        if self.io_buf_bytes < 4096 || !self.io_buf_bytes.is_multiple_of(4096) {
            return Err(format!(
                "--ublk-max-io {}: must be a multiple of 4096, at least 4096",
                self.io_buf_bytes
            ));
        }
        Ok(())
    }

    /// The `UBLK_F_*` flags for ADD_DEV.
    pub fn ctrl_flags(&self) -> u64 {
        use libublk::sys;
        let mut f = 0u64;
        if self.unprivileged {
            f |= sys::UBLK_F_UNPRIVILEGED_DEV as u64;
        } else if self.recovery {
            f |= (sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE) as u64;
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_checked_and_named() {
        assert!(UblkOptions::default().validate().is_ok());
        let bad = UblkOptions {
            depth: 0,
            ..UblkOptions::default()
        };
        assert!(bad.validate().unwrap_err().contains("--ublk-depth"));
        let bad = UblkOptions {
            io_buf_bytes: 5000,
            ..UblkOptions::default()
        };
        assert!(bad.validate().unwrap_err().contains("--ublk-max-io"));
    }

    #[test]
    fn unprivileged_devices_get_no_recovery() {
        let o = UblkOptions {
            unprivileged: true,
            ..UblkOptions::default()
        };
        let f = o.ctrl_flags();
        assert_eq!(f & libublk::sys::UBLK_F_USER_RECOVERY as u64, 0);
        assert_ne!(f & libublk::sys::UBLK_F_UNPRIVILEGED_DEV as u64, 0);
        assert_ne!(
            UblkOptions::default().ctrl_flags() & libublk::sys::UBLK_F_USER_RECOVERY as u64,
            0
        );
    }
}
