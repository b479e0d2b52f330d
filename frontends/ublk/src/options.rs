//! How a device is presented on ublk: queues, depth, I/O buffer size and
//! the driver features asked for (`UBLK_F_*` in the kernel's
//! include/uapi/linux/ublk_cmd.h).
//!
//! The queues and their depth come from the stack: each ublk queue is one
//! hardware queue of the tag set below the exported device, as deep as its
//! tags (`Device::queue_shape`), as a blk-mq driver's `nr_hw_queues` and
//! `queue_depth` describe its hardware. `--ublk-queues` / `--ublk-depth`
//! may ask for fewer (fewer queue threads, a shallower queue), never for
//! more than the stack has.

use crate::uapi;
use blkstack_core::QueueShape;

/// Queues and depth for a device with no tag set below it (`zero`,
/// `error`): the blk-mq engine's own defaults (`submit_queues=1`,
/// `hw_queue_depth=64`).
pub const DEFAULT_QUEUES: u16 = 1;
pub const DEFAULT_DEPTH: u16 = 64;
/// Largest request the kernel sends (its `max_sectors`): a buffer of
/// this size is reserved per tag (address space, touched only as used).
pub const DEFAULT_IO_BUF_BYTES: u32 = 512 << 10;
/// The driver's limits (`UBLK_MAX_NR_QUEUES`, `UBLK_MAX_QUEUE_DEPTH`).
pub const MAX_QUEUES: u16 = uapi::UBLK_MAX_NR_QUEUES;
pub const MAX_DEPTH: u16 = uapi::UBLK_MAX_QUEUE_DEPTH;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UblkOptions {
    /// Fewer queues than the stack's hardware queues (`None`: all).
    pub queues: Option<u16>,
    /// A shallower queue than the stack's tags (`None`: all of them).
    pub depth: Option<u16>,
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
            queues: None,
            depth: None,
            io_buf_bytes: DEFAULT_IO_BUF_BYTES,
            recovery: true,
            unprivileged: false,
        }
    }
}

/// Options the driver or the stack cannot take; each message names the
/// flag.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OptionsError {
    #[error("--ublk-queues {0}: must be 1..={MAX_QUEUES}")]
    QueuesOutOfRange(u16),
    #[error("--ublk-depth {0}: must be 1..={MAX_DEPTH}")]
    DepthOutOfRange(u16),
    #[error("--ublk-max-io {0}: must be a multiple of 4096, at least 4096")]
    MaxIo(u32),
    /// More queues than `offerer` (the stack, or the driver) has.
    #[error(
        "--ublk-queues {asked}: {offerer} offers {have} hardware queue(s); ask for at most {have}"
    )]
    MoreQueues {
        asked: u16,
        offerer: &'static str,
        have: u16,
    },
    /// Deeper than `offerer`'s tags.
    #[error(
        "--ublk-depth {asked}: {offerer} offers {have} tags per queue; ask for at most {have}"
    )]
    Deeper {
        asked: u16,
        offerer: &'static str,
        have: u16,
    },
}

impl UblkOptions {
    /// Check against the driver's limits; the message names the flag.
    pub fn validate(&self) -> Result<(), OptionsError> {
        if let Some(q) = self.queues.filter(|q| *q == 0 || *q > MAX_QUEUES) {
            return Err(OptionsError::QueuesOutOfRange(q));
        }
        if let Some(d) = self.depth.filter(|d| *d == 0 || *d > MAX_DEPTH) {
            return Err(OptionsError::DepthOutOfRange(d));
        }
        if self.io_buf_bytes < 4096 || !self.io_buf_bytes.is_multiple_of(4096) {
            return Err(OptionsError::MaxIo(self.io_buf_bytes));
        }
        Ok(())
    }

    /// `(nr_queues, depth)` for a device whose stack has tag set `stack`:
    /// the stack's, or the smaller ones asked for. More than the stack
    /// has is refused: the kernel would queue requests on queues and tags
    /// that nothing below can take.
    pub fn queues_and_depth(&self, stack: Option<QueueShape>) -> Result<(u16, u16), OptionsError> {
        let (have_q, have_d, offerer) = match stack {
            Some(s) => (
                s.hw_queues.clamp(1, MAX_QUEUES as u32) as u16,
                s.depth.clamp(1, MAX_DEPTH as u32) as u16,
                "the stack",
            ),
            None => (MAX_QUEUES, MAX_DEPTH, "the ublk driver"),
        };
        let queues = match self.queues {
            Some(asked) if asked > have_q => {
                return Err(OptionsError::MoreQueues {
                    asked,
                    offerer,
                    have: have_q,
                })
            }
            Some(q) => q,
            None if stack.is_some() => have_q,
            None => DEFAULT_QUEUES,
        };
        let depth = match self.depth {
            Some(asked) if asked > have_d => {
                return Err(OptionsError::Deeper {
                    asked,
                    offerer,
                    have: have_d,
                })
            }
            Some(d) => d,
            None if stack.is_some() => have_d,
            None => DEFAULT_DEPTH,
        };
        Ok((queues, depth))
    }

    /// The `UBLK_F_*` flags for ADD_DEV. The io commands are sent with
    /// their ioctl-encoded numbers (`UBLK_U_IO_*`), so the device says so.
    pub fn ctrl_flags(&self) -> u64 {
        let mut f = uapi::UBLK_F_CMD_IOCTL_ENCODE;
        if self.unprivileged {
            f |= uapi::UBLK_F_UNPRIVILEGED_DEV;
        } else if self.recovery {
            f |= uapi::UBLK_F_USER_RECOVERY | uapi::UBLK_F_USER_RECOVERY_REISSUE;
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
            depth: Some(0),
            ..UblkOptions::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--ublk-depth"));
        let bad = UblkOptions {
            io_buf_bytes: 5000,
            ..UblkOptions::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--ublk-max-io"));
    }

    #[test]
    fn queues_and_depth_come_from_the_stack_and_may_only_shrink() {
        let stack = Some(QueueShape {
            hw_queues: 3,
            depth: 48,
        });
        let o = UblkOptions::default();
        assert_eq!(o.queues_and_depth(stack), Ok((3, 48)));
        assert_eq!(
            o.queues_and_depth(None),
            Ok((DEFAULT_QUEUES, DEFAULT_DEPTH))
        );
        let fewer = UblkOptions {
            queues: Some(2),
            depth: Some(16),
            ..UblkOptions::default()
        };
        assert_eq!(fewer.queues_and_depth(stack), Ok((2, 16)));
        let more = UblkOptions {
            queues: Some(4),
            ..UblkOptions::default()
        };
        let e = more.queues_and_depth(stack).unwrap_err().to_string();
        assert!(
            e.contains("--ublk-queues 4") && e.contains("3 hardware queue"),
            "{e}"
        );
        let deeper = UblkOptions {
            depth: Some(64),
            ..UblkOptions::default()
        };
        let e = deeper.queues_and_depth(stack).unwrap_err().to_string();
        assert!(
            e.contains("--ublk-depth 64") && e.contains("48 tags"),
            "{e}"
        );
        // Nothing below queues: any count the driver takes.
        assert_eq!(more.queues_and_depth(None), Ok((4, DEFAULT_DEPTH)));
        // A stack deeper than the driver allows is cut to its limit.
        let huge = Some(QueueShape {
            hw_queues: 1,
            depth: 100_000,
        });
        assert_eq!(o.queues_and_depth(huge), Ok((1, MAX_DEPTH)));
    }

    #[test]
    fn unprivileged_devices_get_no_recovery() {
        let o = UblkOptions {
            unprivileged: true,
            ..UblkOptions::default()
        };
        let f = o.ctrl_flags();
        assert_eq!(f & uapi::UBLK_F_USER_RECOVERY, 0);
        assert_ne!(f & uapi::UBLK_F_UNPRIVILEGED_DEV, 0);
        let f = UblkOptions::default().ctrl_flags();
        assert_ne!(f & uapi::UBLK_F_USER_RECOVERY, 0);
        assert_ne!(f & uapi::UBLK_F_USER_RECOVERY_REISSUE, 0);
        assert_ne!(f & uapi::UBLK_F_CMD_IOCTL_ENCODE, 0);
        let off = UblkOptions {
            recovery: false,
            ..UblkOptions::default()
        };
        assert_eq!(off.ctrl_flags() & uapi::UBLK_F_USER_RECOVERY, 0);
    }
}
