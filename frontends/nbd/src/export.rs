//! An export: a named device as one NBD client sees it, and what the
//! device's [`Features`](blkstack_core::Features) become on the wire
//! (transmission flags, block-size constraints).

use crate::proto::*;
use blkstack_core::DeviceRef;

/// Largest READ/WRITE we accept: the protocol's usual 32 MiB cap (qemu and
/// nbdkit use the same), or the device's own limit if smaller.
pub const MAX_REQUEST: u32 = 32 << 20;

pub struct Export {
    pub name: String,
    /// Shown by `nbdinfo` (NBD_INFO_DESCRIPTION) and in NBD_OPT_LIST.
    pub description: String,
    pub dev: DeviceRef,
    /// Set by the user (`NAME:ro`, `--readonly`) or by the device itself.
    pub read_only: bool,
}

impl Export {
    pub fn new(name: impl Into<String>, dev: DeviceRef, read_only: bool) -> Export {
        let read_only = read_only || dev.features().read_only;
        let name = name.into();
        let description = format!(
            "blkstack device {name} ({} bytes{})",
            dev.size(),
            if read_only { ", read-only" } else { "" }
        );
        Export {
            name,
            description,
            dev,
            read_only,
        }
    }

    /// Transmission flags for a client that did (or did not) negotiate
    /// structured replies.
    pub fn transmission_flags(&self, structured: bool) -> u16 {
        let f = self.dev.features();
        let mut t = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_CACHE;
        if f.fua {
            t |= TFLAG_SEND_FUA;
        }
        if self.read_only {
            t |= TFLAG_READ_ONLY;
        } else {
            if f.discard {
                t |= TFLAG_SEND_TRIM;
            }
            if f.write_zeroes {
                // FAST_ZERO is always answerable: either the device is
                // fast, or the request is refused at once with ENOTSUP.
                t |= TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO;
            }
        }
        if structured {
            t |= TFLAG_SEND_DF;
        }
        // Only when a flush on one connection covers writes completed on
        // every other one (the spec's condition for multi-conn).
        if f.flush_is_global {
            t |= TFLAG_CAN_MULTI_CONN;
        }
        t
    }

    /// (minimum, preferred, maximum) block sizes for NBD_INFO_BLOCK_SIZE.
    /// The minimum is the logical block size because misaligned requests
    /// are refused (EINVAL) rather than emulated with read-modify-write.
    pub fn block_sizes(&self) -> (u32, u32, u32) {
        let min = self.dev.logical_block_size().max(1);
        let preferred = self.dev.physical_block_size().max(4096).max(min);
        let max = self.max_request().max(preferred);
        (min, preferred, max)
    }

    /// Largest READ/WRITE, a multiple of the logical block size.
    pub fn max_request(&self) -> u32 {
        let lbs = self.dev.logical_block_size().max(1) as u64;
        let m = self.dev.max_io_bytes().min(MAX_REQUEST as u64);
        let m = m - m % lbs;
        m.max(lbs) as u32
    }
}
