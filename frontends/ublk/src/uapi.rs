//! The ublk driver's user API, written by hand from
//! `include/uapi/linux/ublk_cmd.h` of Linux 6.12 (the kernel the test
//! guest runs), so that building us needs no bindgen and no libclang.
//!
//! Only what this frontend speaks is here: the control commands
//! (`UBLK_U_CMD_*`, sent on /dev/ublk-control in an SQE128 ring), the io
//! commands (`UBLK_U_IO_*`, sent on /dev/ublkcN), the structures they
//! carry, and the flag and state values they use. Every structure's size
//! and every field's offset is checked against the 6.12 header at compile
//! time below; the command numbers are computed as the header's
//! `_IOR`/`_IOWR('u', nr, struct)` are (include/uapi/asm-generic/ioctl.h)
//! and checked against the values that header yields.

#![allow(non_camel_case_types)]

use core::mem::{offset_of, size_of};

// include/uapi/asm-generic/ioctl.h: the number's fields.
const IOC_NRSHIFT: u32 = 0;
const IOC_TYPESHIFT: u32 = 8;
const IOC_SIZESHIFT: u32 = 16;
const IOC_DIRSHIFT: u32 = 30;
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

const fn ioc(dir: u32, ty: u8, nr: u32, size: usize) -> u32 {
    (dir << IOC_DIRSHIFT)
        | ((ty as u32) << IOC_TYPESHIFT)
        | (nr << IOC_NRSHIFT)
        | ((size as u32) << IOC_SIZESHIFT)
}

/// `_IOR('u', nr, T)`.
const fn ior<T>(nr: u32) -> u32 {
    ioc(IOC_READ, b'u', nr, size_of::<T>())
}

/// `_IOWR('u', nr, T)`.
const fn iowr<T>(nr: u32) -> u32 {
    ioc(IOC_READ | IOC_WRITE, b'u', nr, size_of::<T>())
}

/// Shipped in the SQE's command area (`sqe->cmd`) of a control command.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ublksrv_ctrl_cmd {
    /// The device the command is for.
    pub dev_id: u32,
    /// The queue, `u16::MAX` (-1) for a command not about one queue.
    pub queue_id: u16,
    /// Length of the buffer at `addr` (in or out, by command).
    pub len: u16,
    pub addr: u64,
    /// Inline data (START_DEV's and END_USER_RECOVERY's server pid).
    pub data: [u64; 1],
    /// For `UBLK_F_UNPRIVILEGED_DEV` and GET_DEV_INFO2 only: the length of
    /// the char device's path prepended to the buffer, NUL included.
    pub dev_path_len: u16,
    pub pad: u16,
    pub reserved: u32,
}

/// A device's description: ADD_DEV's payload (written back with the
/// device's id) and GET_DEV_INFO's answer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ublksrv_ctrl_dev_info {
    pub nr_hw_queues: u16,
    pub queue_depth: u16,
    /// `UBLK_S_DEV_*`.
    pub state: u16,
    pub pad0: u16,
    pub max_io_buf_bytes: u32,
    pub dev_id: u32,
    pub ublksrv_pid: i32,
    pub pad1: u32,
    /// `UBLK_F_*`.
    pub flags: u64,
    /// For the server's own use; the driver does not look at it.
    pub ublksrv_flags: u64,
    /// Stored by the kernel.
    pub owner_uid: u32,
    pub owner_gid: u32,
    pub reserved1: u64,
    pub reserved2: u64,
}

/// One request, in the array the driver shares per queue (mmapped from
/// /dev/ublkcN), indexed by tag.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ublksrv_io_desc {
    /// Op in bits 0-7 (`UBLK_IO_OP_*`), flags above (`UBLK_IO_F_*`).
    pub op_flags: u32,
    /// Sectors (a union with `nr_zones`, for REPORT_ZONES, unused here).
    pub nr_sectors: u32,
    pub start_sector: u64,
    /// Buffer address in the server, from the driver.
    pub addr: u64,
}

/// The io commands' payload (`sqe->cmd` of FETCH_REQ and
/// COMMIT_AND_FETCH_REQ).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ublksrv_io_cmd {
    pub q_id: u16,
    pub tag: u16,
    /// The request's result, for COMMIT_AND_FETCH_REQ.
    pub result: i32,
    /// The tag's buffer in the server (a union with `zone_append_lba`).
    pub addr: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ublk_param_basic {
    /// `UBLK_ATTR_*`.
    pub attrs: u32,
    pub logical_bs_shift: u8,
    pub physical_bs_shift: u8,
    pub io_opt_shift: u8,
    pub io_min_shift: u8,
    pub max_sectors: u32,
    pub chunk_sectors: u32,
    pub dev_sectors: u64,
    pub virt_boundary_mask: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ublk_param_discard {
    pub discard_alignment: u32,
    pub discard_granularity: u32,
    pub max_discard_sectors: u32,
    pub max_write_zeroes_sectors: u32,
    pub max_discard_segments: u16,
    pub reserved0: u16,
}

/// Read-only (GET_PARAMS): the device numbers once the disk exists.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ublk_param_devt {
    pub char_major: u32,
    pub char_minor: u32,
    pub disk_major: u32,
    pub disk_minor: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ublk_param_zoned {
    pub max_open_zones: u32,
    pub max_active_zones: u32,
    pub max_zone_append_sectors: u32,
    pub reserved: [u8; 20],
}

/// SET_PARAMS' payload: which parts are present is in `types`
/// (`UBLK_PARAM_TYPE_*`), `len` is this structure's size.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ublk_params {
    pub len: u32,
    pub types: u32,
    pub basic: ublk_param_basic,
    pub discard: ublk_param_discard,
    pub devt: ublk_param_devt,
    pub zoned: ublk_param_zoned,
    /// Not in the header: the C structure's tail padding (its `u64`s
    /// align it to 8), spelled out so that every byte sent is a defined
    /// one. The size is the header's either way.
    pub tail_pad: u32,
}

// Legacy command numbers: the `nr` of the encoded ones.
pub const UBLK_CMD_GET_DEV_INFO: u32 = 0x02;
pub const UBLK_CMD_ADD_DEV: u32 = 0x04;
pub const UBLK_CMD_DEL_DEV: u32 = 0x05;
pub const UBLK_CMD_START_DEV: u32 = 0x06;
pub const UBLK_CMD_STOP_DEV: u32 = 0x07;
pub const UBLK_CMD_SET_PARAMS: u32 = 0x08;
pub const UBLK_CMD_GET_PARAMS: u32 = 0x09;
pub const UBLK_CMD_START_USER_RECOVERY: u32 = 0x10;
pub const UBLK_CMD_END_USER_RECOVERY: u32 = 0x11;
pub const UBLK_CMD_GET_DEV_INFO2: u32 = 0x12;
pub const UBLK_IO_FETCH_REQ: u32 = 0x20;
pub const UBLK_IO_COMMIT_AND_FETCH_REQ: u32 = 0x21;

pub const UBLK_U_CMD_GET_DEV_INFO: u32 = ior::<ublksrv_ctrl_cmd>(UBLK_CMD_GET_DEV_INFO);
pub const UBLK_U_CMD_ADD_DEV: u32 = iowr::<ublksrv_ctrl_cmd>(UBLK_CMD_ADD_DEV);
pub const UBLK_U_CMD_DEL_DEV: u32 = iowr::<ublksrv_ctrl_cmd>(UBLK_CMD_DEL_DEV);
pub const UBLK_U_CMD_START_DEV: u32 = iowr::<ublksrv_ctrl_cmd>(UBLK_CMD_START_DEV);
pub const UBLK_U_CMD_STOP_DEV: u32 = iowr::<ublksrv_ctrl_cmd>(UBLK_CMD_STOP_DEV);
pub const UBLK_U_CMD_SET_PARAMS: u32 = iowr::<ublksrv_ctrl_cmd>(UBLK_CMD_SET_PARAMS);
pub const UBLK_U_CMD_GET_PARAMS: u32 = ior::<ublksrv_ctrl_cmd>(UBLK_CMD_GET_PARAMS);
pub const UBLK_U_CMD_START_USER_RECOVERY: u32 =
    iowr::<ublksrv_ctrl_cmd>(UBLK_CMD_START_USER_RECOVERY);
pub const UBLK_U_CMD_END_USER_RECOVERY: u32 = iowr::<ublksrv_ctrl_cmd>(UBLK_CMD_END_USER_RECOVERY);
pub const UBLK_U_CMD_GET_DEV_INFO2: u32 = ior::<ublksrv_ctrl_cmd>(UBLK_CMD_GET_DEV_INFO2);
/// Deletes without waiting for the device's last user to let go.
pub const UBLK_U_CMD_DEL_DEV_ASYNC: u32 = ior::<ublksrv_ctrl_cmd>(0x14);
pub const UBLK_U_IO_FETCH_REQ: u32 = iowr::<ublksrv_io_cmd>(UBLK_IO_FETCH_REQ);
pub const UBLK_U_IO_COMMIT_AND_FETCH_REQ: u32 =
    iowr::<ublksrv_io_cmd>(UBLK_IO_COMMIT_AND_FETCH_REQ);

/// Io command results: only ABORT means no re-fetch (the device is going
/// or its server is being replaced).
pub const UBLK_IO_RES_OK: i32 = 0;
pub const UBLK_IO_RES_NEED_GET_DATA: i32 = 1;
pub const UBLK_IO_RES_ABORT: i32 = -libc::ENODEV;

/// Where a queue's descriptor arrays start in /dev/ublkcN's mmap space;
/// queue `q`'s is at `q * ublk_queue_cmd_buf_size(UBLK_MAX_QUEUE_DEPTH)`.
pub const UBLKSRV_CMD_BUF_OFFSET: u64 = 0;
pub const UBLK_MAX_QUEUE_DEPTH: u16 = 4096;
pub const UBLK_MAX_NR_QUEUES: u16 = 4096;

pub const UBLK_F_SUPPORT_ZERO_COPY: u64 = 1 << 0;
pub const UBLK_F_URING_CMD_COMP_IN_TASK: u64 = 1 << 1;
pub const UBLK_F_NEED_GET_DATA: u64 = 1 << 2;
/// The device outlives its server; I/O in flight when it dies errors.
pub const UBLK_F_USER_RECOVERY: u64 = 1 << 3;
/// With `UBLK_F_USER_RECOVERY`: that I/O is reissued to the new server.
pub const UBLK_F_USER_RECOVERY_REISSUE: u64 = 1 << 4;
/// A non-root user may add the device; control commands then carry the
/// char device's path, which the driver checks the caller may open.
pub const UBLK_F_UNPRIVILEGED_DEV: u64 = 1 << 5;
pub const UBLK_F_CMD_IOCTL_ENCODE: u64 = 1 << 6;
pub const UBLK_F_USER_COPY: u64 = 1 << 7;
pub const UBLK_F_ZONED: u64 = 1 << 8;

pub const UBLK_S_DEV_DEAD: u16 = 0;
pub const UBLK_S_DEV_LIVE: u16 = 1;
pub const UBLK_S_DEV_QUIESCED: u16 = 2;

pub const UBLK_IO_OP_READ: u32 = 0;
pub const UBLK_IO_OP_WRITE: u32 = 1;
pub const UBLK_IO_OP_FLUSH: u32 = 2;
pub const UBLK_IO_OP_DISCARD: u32 = 3;
pub const UBLK_IO_OP_WRITE_SAME: u32 = 4;
pub const UBLK_IO_OP_WRITE_ZEROES: u32 = 5;
pub const UBLK_IO_OP_ZONE_OPEN: u32 = 10;
pub const UBLK_IO_OP_ZONE_CLOSE: u32 = 11;
pub const UBLK_IO_OP_ZONE_FINISH: u32 = 12;
pub const UBLK_IO_OP_ZONE_APPEND: u32 = 13;
pub const UBLK_IO_OP_ZONE_RESET_ALL: u32 = 14;
pub const UBLK_IO_OP_ZONE_RESET: u32 = 15;
pub const UBLK_IO_OP_REPORT_ZONES: u32 = 18;

pub const UBLK_IO_F_FAILFAST_DEV: u32 = 1 << 8;
pub const UBLK_IO_F_FAILFAST_TRANSPORT: u32 = 1 << 9;
pub const UBLK_IO_F_FAILFAST_DRIVER: u32 = 1 << 10;
pub const UBLK_IO_F_META: u32 = 1 << 11;
pub const UBLK_IO_F_FUA: u32 = 1 << 13;
pub const UBLK_IO_F_NOUNMAP: u32 = 1 << 15;
pub const UBLK_IO_F_SWAP: u32 = 1 << 16;

pub const UBLK_ATTR_READ_ONLY: u32 = 1 << 0;
pub const UBLK_ATTR_ROTATIONAL: u32 = 1 << 1;
pub const UBLK_ATTR_VOLATILE_CACHE: u32 = 1 << 2;
pub const UBLK_ATTR_FUA: u32 = 1 << 3;

pub const UBLK_PARAM_TYPE_BASIC: u32 = 1 << 0;
pub const UBLK_PARAM_TYPE_DISCARD: u32 = 1 << 1;
pub const UBLK_PARAM_TYPE_DEVT: u32 = 1 << 2;
pub const UBLK_PARAM_TYPE_ZONED: u32 = 1 << 3;

// The layout of the 6.12 header, as a C compiler lays it out on x86_64
// (and every 64-bit Linux target: only natural alignment is involved).
const _: () = {
    assert!(size_of::<ublksrv_ctrl_cmd>() == 32);
    assert!(offset_of!(ublksrv_ctrl_cmd, dev_id) == 0);
    assert!(offset_of!(ublksrv_ctrl_cmd, queue_id) == 4);
    assert!(offset_of!(ublksrv_ctrl_cmd, len) == 6);
    assert!(offset_of!(ublksrv_ctrl_cmd, addr) == 8);
    assert!(offset_of!(ublksrv_ctrl_cmd, data) == 16);
    assert!(offset_of!(ublksrv_ctrl_cmd, dev_path_len) == 24);
    assert!(offset_of!(ublksrv_ctrl_cmd, pad) == 26);
    assert!(offset_of!(ublksrv_ctrl_cmd, reserved) == 28);

    assert!(size_of::<ublksrv_ctrl_dev_info>() == 64);
    assert!(offset_of!(ublksrv_ctrl_dev_info, nr_hw_queues) == 0);
    assert!(offset_of!(ublksrv_ctrl_dev_info, queue_depth) == 2);
    assert!(offset_of!(ublksrv_ctrl_dev_info, state) == 4);
    assert!(offset_of!(ublksrv_ctrl_dev_info, pad0) == 6);
    assert!(offset_of!(ublksrv_ctrl_dev_info, max_io_buf_bytes) == 8);
    assert!(offset_of!(ublksrv_ctrl_dev_info, dev_id) == 12);
    assert!(offset_of!(ublksrv_ctrl_dev_info, ublksrv_pid) == 16);
    assert!(offset_of!(ublksrv_ctrl_dev_info, pad1) == 20);
    assert!(offset_of!(ublksrv_ctrl_dev_info, flags) == 24);
    assert!(offset_of!(ublksrv_ctrl_dev_info, ublksrv_flags) == 32);
    assert!(offset_of!(ublksrv_ctrl_dev_info, owner_uid) == 40);
    assert!(offset_of!(ublksrv_ctrl_dev_info, owner_gid) == 44);
    assert!(offset_of!(ublksrv_ctrl_dev_info, reserved1) == 48);
    assert!(offset_of!(ublksrv_ctrl_dev_info, reserved2) == 56);

    assert!(size_of::<ublksrv_io_desc>() == 24);
    assert!(offset_of!(ublksrv_io_desc, op_flags) == 0);
    assert!(offset_of!(ublksrv_io_desc, nr_sectors) == 4);
    assert!(offset_of!(ublksrv_io_desc, start_sector) == 8);
    assert!(offset_of!(ublksrv_io_desc, addr) == 16);

    assert!(size_of::<ublksrv_io_cmd>() == 16);
    assert!(offset_of!(ublksrv_io_cmd, q_id) == 0);
    assert!(offset_of!(ublksrv_io_cmd, tag) == 2);
    assert!(offset_of!(ublksrv_io_cmd, result) == 4);
    assert!(offset_of!(ublksrv_io_cmd, addr) == 8);

    assert!(size_of::<ublk_param_basic>() == 32);
    assert!(offset_of!(ublk_param_basic, attrs) == 0);
    assert!(offset_of!(ublk_param_basic, logical_bs_shift) == 4);
    assert!(offset_of!(ublk_param_basic, physical_bs_shift) == 5);
    assert!(offset_of!(ublk_param_basic, io_opt_shift) == 6);
    assert!(offset_of!(ublk_param_basic, io_min_shift) == 7);
    assert!(offset_of!(ublk_param_basic, max_sectors) == 8);
    assert!(offset_of!(ublk_param_basic, chunk_sectors) == 12);
    assert!(offset_of!(ublk_param_basic, dev_sectors) == 16);
    assert!(offset_of!(ublk_param_basic, virt_boundary_mask) == 24);

    assert!(size_of::<ublk_param_discard>() == 20);
    assert!(offset_of!(ublk_param_discard, discard_alignment) == 0);
    assert!(offset_of!(ublk_param_discard, discard_granularity) == 4);
    assert!(offset_of!(ublk_param_discard, max_discard_sectors) == 8);
    assert!(offset_of!(ublk_param_discard, max_write_zeroes_sectors) == 12);
    assert!(offset_of!(ublk_param_discard, max_discard_segments) == 16);
    assert!(offset_of!(ublk_param_discard, reserved0) == 18);

    assert!(size_of::<ublk_param_devt>() == 16);
    assert!(offset_of!(ublk_param_devt, char_major) == 0);
    assert!(offset_of!(ublk_param_devt, char_minor) == 4);
    assert!(offset_of!(ublk_param_devt, disk_major) == 8);
    assert!(offset_of!(ublk_param_devt, disk_minor) == 12);

    assert!(size_of::<ublk_param_zoned>() == 32);
    assert!(offset_of!(ublk_param_zoned, max_open_zones) == 0);
    assert!(offset_of!(ublk_param_zoned, max_active_zones) == 4);
    assert!(offset_of!(ublk_param_zoned, max_zone_append_sectors) == 8);
    assert!(offset_of!(ublk_param_zoned, reserved) == 12);

    assert!(size_of::<ublk_params>() == 112);
    assert!(offset_of!(ublk_params, len) == 0);
    assert!(offset_of!(ublk_params, types) == 4);
    assert!(offset_of!(ublk_params, basic) == 8);
    assert!(offset_of!(ublk_params, discard) == 40);
    assert!(offset_of!(ublk_params, devt) == 60);
    assert!(offset_of!(ublk_params, zoned) == 76);
    assert!(offset_of!(ublk_params, tail_pad) == 108);

    // What the 6.12 header's macros evaluate to.
    assert!(UBLK_U_CMD_GET_DEV_INFO == 0x8020_7502);
    assert!(UBLK_U_CMD_ADD_DEV == 0xc020_7504);
    assert!(UBLK_U_CMD_DEL_DEV == 0xc020_7505);
    assert!(UBLK_U_CMD_START_DEV == 0xc020_7506);
    assert!(UBLK_U_CMD_STOP_DEV == 0xc020_7507);
    assert!(UBLK_U_CMD_SET_PARAMS == 0xc020_7508);
    assert!(UBLK_U_CMD_GET_PARAMS == 0x8020_7509);
    assert!(UBLK_U_CMD_START_USER_RECOVERY == 0xc020_7510);
    assert!(UBLK_U_CMD_END_USER_RECOVERY == 0xc020_7511);
    assert!(UBLK_U_CMD_GET_DEV_INFO2 == 0x8020_7512);
    assert!(UBLK_U_CMD_DEL_DEV_ASYNC == 0x8020_7514);
    assert!(UBLK_U_IO_FETCH_REQ == 0xc010_7520);
    assert!(UBLK_U_IO_COMMIT_AND_FETCH_REQ == 0xc010_7521);
};

/// Bytes of queue `depth`'s descriptor array as the driver maps it
/// (`ublk_queue_cmd_buf_size`: rounded up to a page).
pub fn queue_cmd_buf_size(depth: u16, page: usize) -> usize {
    (depth as usize * size_of::<ublksrv_io_desc>()).next_multiple_of(page)
}

/// Offset of queue `qid`'s descriptor array in /dev/ublkcN
/// (`ublk_ch_mmap`: each queue's slot is sized for the deepest queue).
pub fn queue_cmd_buf_offset(qid: u16, page: usize) -> u64 {
    UBLKSRV_CMD_BUF_OFFSET + qid as u64 * queue_cmd_buf_size(UBLK_MAX_QUEUE_DEPTH, page) as u64
}

/// A structure's bytes, for an SQE's command area.
pub fn cmd_bytes<T: Copy, const N: usize>(v: &T) -> [u8; N] {
    const { assert!(size_of::<T>() <= N) };
    let mut out = [0u8; N];
    // SAFETY: T is one of this module's plain `repr(C)` integer structs
    // (no padding bytes: the asserts above account for every byte), at
    // most N bytes long.
    unsafe {
        core::ptr::copy_nonoverlapping(
            (v as *const T).cast::<u8>(),
            out.as_mut_ptr(),
            size_of::<T>(),
        )
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_arrays_are_laid_out_as_the_driver_maps_them() {
        assert_eq!(queue_cmd_buf_size(64, 4096), 4096);
        assert_eq!(queue_cmd_buf_size(256, 4096), 8192);
        // 4096 * 24 bytes = 24 pages per queue slot.
        assert_eq!(queue_cmd_buf_offset(0, 4096), 0);
        assert_eq!(queue_cmd_buf_offset(2, 4096), 2 * 24 * 4096);
    }

    #[test]
    fn commands_are_copied_bytewise() {
        let c = ublksrv_io_cmd {
            q_id: 3,
            tag: 0x102,
            result: -5,
            addr: 0x1122_3344_5566_7788,
        };
        let b: [u8; 16] = cmd_bytes(&c);
        assert_eq!(&b[0..2], &3u16.to_ne_bytes());
        assert_eq!(&b[2..4], &0x102u16.to_ne_bytes());
        assert_eq!(&b[4..8], &(-5i32).to_ne_bytes());
        assert_eq!(&b[8..16], &0x1122_3344_5566_7788u64.to_ne_bytes());
        let c = ublksrv_ctrl_cmd {
            dev_id: 7,
            queue_id: u16::MAX,
            ..Default::default()
        };
        let b: [u8; 80] = cmd_bytes(&c);
        assert_eq!(&b[0..4], &7u32.to_ne_bytes());
        assert!(b[32..].iter().all(|x| *x == 0));
    }
}
