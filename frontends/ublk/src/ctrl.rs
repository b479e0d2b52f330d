//! The ublk control commands, sent on /dev/ublk-control as io_uring
//! commands in an SQE128 ring, as drivers/block/ublk_drv.c's
//! `ublk_ctrl_uring_cmd` takes them (the payloads are in [`crate::uapi`]).
//!
//! A [`Control`] is one open control node and one small ring; each call
//! site makes its own (a device's start, its stop, the fail-stop of a
//! dead queue), so nothing is shared between threads. The driver handles
//! a control command in io_uring's worker threads (it refuses the
//! non-blocking issue), so a command that blocks in the kernel (START_DEV
//! waits for every queue's fetches, STOP_DEV for the requests in flight)
//! blocks a worker, not us: every wait here is bounded by a timeout, and a
//! command that outlives it leaves its payload buffer behind rather than
//! free it under the kernel.
//!
//! For a `UBLK_F_UNPRIVILEGED_DEV` device every command but ADD_DEV carries
//! the char device's path in front of its payload (`dev_path_len`), which
//! the driver checks the caller may open; GET_DEV_INFO2 always does.

use crate::error::{Errno, CONTROL_PATH};
use crate::uapi::{self, ublk_params, ublksrv_ctrl_cmd, ublksrv_ctrl_dev_info};
use io_uring::{opcode, squeue, types, IoUring};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Room for the char device's path in front of a payload (NUL padded);
/// the driver takes any length, libublk and ublksrv use this one.
const DEV_PATH_ROOM: usize = 32;

/// How long an ordinary control command may take.
pub const CMD_TIMEOUT: Duration = Duration::from_secs(30);

/// What a command sends besides its number.
#[derive(Default)]
struct Cmd<'a> {
    data: u64,
    /// The payload, in and out (the driver writes ADD_DEV's and the
    /// GET_* commands' answers back into it).
    buf: Option<&'a mut [u8]>,
    /// Prepend the char device's path.
    with_path: bool,
}

/// One open /dev/ublk-control and the ring its commands go through.
pub struct Control {
    file: File,
    ring: IoUring<squeue::Entry128>,
    next_token: u64,
}

/// The path the driver checks for an unprivileged device's commands.
/// Submit what is queued and wait, at most `ts`, for one completion. A
/// wait that times out, is interrupted or finds the ring busy is not an
/// error: the caller looks at what completed and at its own deadline.
pub(crate) fn submit_and_wait(
    submitter: &io_uring::Submitter<'_>,
    ts: &types::Timespec,
) -> std::io::Result<()> {
    let args = types::SubmitArgs::new().timespec(ts);
    match submitter.submit_with_args(1, &args) {
        Ok(_) => Ok(()),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

pub fn cdev_path(dev_id: u32) -> String {
    format!("/dev/ublkc{dev_id}")
}

fn bytes_of<T: Copy>(v: &mut T) -> &mut [u8] {
    // SAFETY: T is one of uapi's plain repr(C) integer structs without
    // padding bytes (uapi's asserts account for every byte): any byte
    // pattern is a valid value, and the slice borrows `v` exclusively.
    unsafe { std::slice::from_raw_parts_mut((v as *mut T).cast::<u8>(), std::mem::size_of::<T>()) }
}

impl Control {
    /// Open the control node, with a ring of its own.
    pub fn open() -> Result<Control, Errno> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(CONTROL_PATH)?;
        let ring = IoUring::<squeue::Entry128>::builder().build(4)?;
        Ok(Control {
            file,
            ring,
            next_token: 1,
        })
    }

    /// Send command `op` for device `dev_id` and wait, at most `timeout`,
    /// for its answer (the command's non-negative result).
    fn run(&mut self, op: u32, dev_id: u32, cmd: Cmd<'_>, timeout: Duration) -> Result<i32, Errno> {
        let path = cmd.with_path.then(|| cdev_path(dev_id));
        let payload_len = cmd.buf.as_ref().map_or(0, |b| b.len());
        let skip = if path.is_some() { DEV_PATH_ROOM } else { 0 };
        // The kernel reads and writes this copy, never the caller's memory:
        // it stays valid however the wait ends.
        let mut staged = vec![0u8; skip + payload_len];
        if let Some(p) = &path {
            if p.len() >= DEV_PATH_ROOM {
                return Err(Errno(libc::ENAMETOOLONG));
            }
            staged[..p.len()].copy_from_slice(p.as_bytes());
        }
        if let Some(b) = &cmd.buf {
            staged[skip..].copy_from_slice(b);
        }
        let len = u16::try_from(staged.len()).map_err(|_| Errno(libc::EINVAL))?;
        let c = ublksrv_ctrl_cmd {
            dev_id,
            queue_id: u16::MAX,
            len,
            addr: if staged.is_empty() {
                0
            } else {
                staged.as_mut_ptr() as u64
            },
            data: [cmd.data],
            dev_path_len: skip as u16,
            ..Default::default()
        };
        let token = self.next_token;
        self.next_token += 1;
        let sqe = opcode::UringCmd80::new(types::Fd(self.file.as_raw_fd()), op)
            .cmd(uapi::cmd_bytes(&c))
            .build()
            .user_data(token);
        // SAFETY: the SQE points at `staged`, which lives until the answer
        // has come or is leaked below when it does not come in time.
        unsafe { self.ring.submission().push(&sqe) }.map_err(|_| Errno(libc::EBUSY))?;
        match self.wait_for(token, timeout) {
            Ok(res) => {
                if let Some(b) = cmd.buf {
                    b.copy_from_slice(&staged[skip..]);
                }
                if res < 0 {
                    Err(Errno(-res))
                } else {
                    Ok(res)
                }
            }
            Err(e) => {
                // The kernel may still write into it.
                std::mem::forget(staged);
                Err(e)
            }
        }
    }

    /// The result of the command with user data `token`, within `timeout`.
    fn wait_for(&mut self, token: u64, timeout: Duration) -> Result<i32, Errno> {
        let deadline = Instant::now() + timeout;
        loop {
            // Answers to commands that timed out earlier are skipped.
            while let Some(cqe) = self.ring.completion().next() {
                if cqe.user_data() == token {
                    return Ok(cqe.result());
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Errno(libc::ETIMEDOUT));
            }
            let ts = types::Timespec::from(left.min(Duration::from_secs(1)));
            submit_and_wait(&self.ring.submitter(), &ts)?;
        }
    }

    /// ADD_DEV: a new device (`info.dev_id` `u32::MAX` lets the driver pick
    /// the id); the driver's view of it, with its id, comes back.
    pub fn add_dev(
        &mut self,
        mut info: ublksrv_ctrl_dev_info,
    ) -> Result<ublksrv_ctrl_dev_info, Errno> {
        let id = info.dev_id;
        let cmd = Cmd {
            buf: Some(bytes_of(&mut info)),
            ..Cmd::default()
        };
        self.run(uapi::UBLK_U_CMD_ADD_DEV, id, cmd, CMD_TIMEOUT)?;
        Ok(info)
    }

    /// GET_DEV_INFO2 (which names the char device, so also works for an
    /// unprivileged device), or GET_DEV_INFO on a driver without it.
    pub fn dev_info(&mut self, dev_id: u32) -> Result<ublksrv_ctrl_dev_info, Errno> {
        let mut info = ublksrv_ctrl_dev_info::default();
        let cmd = Cmd {
            buf: Some(bytes_of(&mut info)),
            with_path: true,
            ..Cmd::default()
        };
        match self.run(uapi::UBLK_U_CMD_GET_DEV_INFO2, dev_id, cmd, CMD_TIMEOUT) {
            Ok(_) => return Ok(info),
            Err(Errno(libc::EOPNOTSUPP)) | Err(Errno(libc::EINVAL)) => {}
            Err(e) => return Err(e),
        }
        let cmd = Cmd {
            buf: Some(bytes_of(&mut info)),
            ..Cmd::default()
        };
        self.run(uapi::UBLK_U_CMD_GET_DEV_INFO, dev_id, cmd, CMD_TIMEOUT)?;
        Ok(info)
    }

    pub fn set_params(&mut self, dev: &Dev, params: &ublk_params) -> Result<(), Errno> {
        let mut p = *params;
        let cmd = Cmd {
            buf: Some(bytes_of(&mut p)),
            with_path: dev.unprivileged,
            ..Cmd::default()
        };
        self.run(uapi::UBLK_U_CMD_SET_PARAMS, dev.id, cmd, CMD_TIMEOUT)
            .map(drop)
    }

    /// START_DEV, naming us as the server: the driver answers once every
    /// queue has its fetches in, and adds /dev/ublkbN.
    pub fn start_dev(&mut self, dev: &Dev, timeout: Duration) -> Result<(), Errno> {
        self.pid_cmd(uapi::UBLK_U_CMD_START_DEV, dev, timeout)
    }

    /// START_USER_RECOVERY: EBUSY while the old server's /dev/ublkcN is
    /// still open or the device not yet quiesced.
    pub fn start_user_recovery(&mut self, dev: &Dev) -> Result<(), Errno> {
        self.simple(uapi::UBLK_U_CMD_START_USER_RECOVERY, dev, CMD_TIMEOUT)
    }

    /// END_USER_RECOVERY: as START_DEV, for a device taken over.
    pub fn end_user_recovery(&mut self, dev: &Dev, timeout: Duration) -> Result<(), Errno> {
        self.pid_cmd(uapi::UBLK_U_CMD_END_USER_RECOVERY, dev, timeout)
    }

    /// STOP_DEV: the disk goes (its I/O fails from now on) and the queues'
    /// fetches are aborted.
    pub fn stop_dev(&mut self, dev: &Dev) -> Result<(), Errno> {
        self.simple(uapi::UBLK_U_CMD_STOP_DEV, dev, CMD_TIMEOUT)
    }

    /// DEL_DEV without waiting for the device's last user to let go
    /// (DEL_DEV_ASYNC), or the waiting DEL_DEV on a driver without it.
    pub fn del_dev(&mut self, dev: &Dev) -> Result<(), Errno> {
        match self.simple(uapi::UBLK_U_CMD_DEL_DEV_ASYNC, dev, CMD_TIMEOUT) {
            Err(Errno(libc::EOPNOTSUPP)) => self.simple(uapi::UBLK_U_CMD_DEL_DEV, dev, CMD_TIMEOUT),
            r => r,
        }
    }

    fn simple(&mut self, op: u32, dev: &Dev, timeout: Duration) -> Result<(), Errno> {
        let cmd = Cmd {
            with_path: dev.unprivileged,
            ..Cmd::default()
        };
        self.run(op, dev.id, cmd, timeout).map(drop)
    }

    fn pid_cmd(&mut self, op: u32, dev: &Dev, timeout: Duration) -> Result<(), Errno> {
        let cmd = Cmd {
            data: std::process::id() as u64,
            with_path: dev.unprivileged,
            ..Cmd::default()
        };
        self.run(op, dev.id, cmd, timeout).map(drop)
    }
}

/// Which device a command is for, and whether it must name its char
/// device (an unprivileged one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dev {
    pub id: u32,
    pub unprivileged: bool,
}

impl Dev {
    pub fn of(info: &ublksrv_ctrl_dev_info) -> Dev {
        Dev {
            id: info.dev_id,
            unprivileged: info.flags & uapi::UBLK_F_UNPRIVILEGED_DEV != 0,
        }
    }
}
