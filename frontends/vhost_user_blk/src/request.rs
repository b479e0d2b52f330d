//! One virtio-blk request (virtio 1.2 section 5.2.6: a 16-byte header,
//! the data, a one-byte status the device writes last), from the
//! descriptor chain to a bio and back; the guest's side is
//! drivers/block/virtio_blk.c (`virtblk_setup_cmd`, `virtblk_done`).
//!
//! Guest data goes through a bounce buffer: a chain is a scatter list in
//! guest memory, a bio wants one buffer. A write's data is copied in
//! before submission, a read's copied out at completion, on whichever
//! thread completes the bio; the request then goes on the used ring and
//! the guest is notified if it asked to be (event index).

use blkstack_core::{AlignedBuf, Bio, BioFlags, DeviceRef, EndIo, IoBuf, Op, Status};
use std::io::{Read, Write};
use std::sync::Arc;
use vhost_user_backend::{VringRwLock, VringT};
use virtio_bindings::virtio_blk::*;
use virtio_queue::DescriptorChain;
use vm_memory::GuestMemoryMmap;

pub type Mem = Arc<GuestMemoryMmap<()>>;
pub type Chain = DescriptorChain<Mem>;

/// The serial number GET_ID answers (20 bytes, NUL-padded).
pub const ID_LEN: usize = 20;

/// A request between its submission and its completion.
pub struct Request {
    chain: Chain,
    vring: VringRwLock,
    /// The data, for reads and writes.
    buf: Option<AlignedBuf>,
    read: bool,
}

fn status_of(s: Status) -> u8 {
    match s {
        Status::Ok => VIRTIO_BLK_S_OK as u8,
        Status::NotSupported => VIRTIO_BLK_S_UNSUPP as u8,
        _ => VIRTIO_BLK_S_IOERR as u8,
    }
}

/// Write the status byte (and a read's data) back, put the chain on the
/// used ring, and notify the guest if it wants to be.
fn finish(chain: &Chain, vring: &VringRwLock, data: Option<&[u8]>, status: u8) {
    let mem = chain.memory();
    let mut used = 0u32;
    match chain.clone().writer(mem) {
        Ok(mut w) => {
            let n = w.available_bytes();
            if n == 0 {
                tracing::warn!("vhost-user-blk: a request with no status byte");
            } else if let Ok(mut tail) = w.split_at(n - 1) {
                if let Some(d) = data {
                    let k = d.len().min(n - 1);
                    if w.write_all(&d[..k]).is_ok() {
                        used += k as u32;
                    }
                }
                if tail.write_all(&[status]).is_ok() {
                    used += 1;
                }
            }
        }
        Err(e) => tracing::warn!("vhost-user-blk: bad descriptor chain: {e}"),
    }
    if let Err(e) = vring.add_used(chain.head_index(), used) {
        tracing::warn!("vhost-user-blk: add_used: {e}");
        return;
    }
    if vring.needs_notification().unwrap_or(true) {
        let _ = vring.signal_used_queue();
    }
}

impl EndIo for Request {
    fn end_io(&self, bio: Bio, status: Status, _private: u64) {
        drop(bio);
        if !status.is_ok() {
            tracing::debug!(?status, "vhost-user-blk request failed");
        }
        let data = if self.read && status.is_ok() {
            self.buf.as_ref().map(|b| b.as_slice())
        } else {
            None
        };
        finish(&self.chain, &self.vring, data, status_of(status));
    }
}

/// The limits a request is held to.
pub struct Limits {
    pub max_bytes: u64,
    pub read_only: bool,
    pub id: [u8; ID_LEN],
}

/// Start the request in `chain`: submit its bio, or answer it at once
/// (GET_ID, a refused or malformed request).
pub fn start(chain: Chain, vring: &VringRwLock, dev: &DeviceRef, lim: &Limits) {
    let mem = chain.memory();
    let mut r = match chain.clone().reader(mem) {
        Ok(r) => r,
        Err(_) => return finish(&chain, vring, None, VIRTIO_BLK_S_IOERR as u8),
    };
    let mut hdr = [0u8; 16];
    if r.read_exact(&mut hdr).is_err() {
        return finish(&chain, vring, None, VIRTIO_BLK_S_IOERR as u8);
    }
    let kind = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap_or([0; 8]));
    let writable_len = chain
        .clone()
        .writer(mem)
        .map(|w| w.available_bytes())
        .unwrap_or(0);
    let (op, len, flags) = match kind {
        VIRTIO_BLK_T_IN => (
            Op::Read,
            writable_len.saturating_sub(1) as u64,
            BioFlags::NONE,
        ),
        VIRTIO_BLK_T_OUT => (Op::Write, r.available_bytes() as u64, BioFlags::NONE),
        VIRTIO_BLK_T_FLUSH => (Op::Flush, 0, BioFlags::NONE),
        VIRTIO_BLK_T_GET_ID => return finish(&chain, vring, Some(&lim.id), VIRTIO_BLK_S_OK as u8),
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            // One segment (we offer max_discard_seg = 1): sector, count, flags.
            let mut seg = [0u8; 16];
            if r.read_exact(&mut seg).is_err() {
                return finish(&chain, vring, None, VIRTIO_BLK_S_IOERR as u8);
            }
            let s = u64::from_le_bytes(seg[0..8].try_into().unwrap_or([0; 8]));
            let n = u32::from_le_bytes(seg[8..12].try_into().unwrap_or([0; 4])) as u64;
            let unmap = u32::from_le_bytes(seg[12..16].try_into().unwrap_or([0; 4])) & 1 != 0;
            let (op, mut f) = if kind == VIRTIO_BLK_T_DISCARD {
                (Op::Discard, BioFlags::NONE)
            } else {
                (Op::WriteZeroes, BioFlags::NONE)
            };
            if op == Op::WriteZeroes && !unmap {
                f.insert(BioFlags::NOUNMAP);
            }
            return submit(chain, vring, dev, op, s, n << 9, f, lim);
        }
        _ => return finish(&chain, vring, None, VIRTIO_BLK_S_UNSUPP as u8),
    };
    submit(chain, vring, dev, op, sector, len, flags, lim)
}

#[allow(clippy::too_many_arguments)]
fn submit(
    chain: Chain,
    vring: &VringRwLock,
    dev: &DeviceRef,
    op: Op,
    sector: u64,
    len: u64,
    flags: BioFlags,
    lim: &Limits,
) {
    if op.is_write() && lim.read_only {
        return finish(&chain, vring, None, VIRTIO_BLK_S_IOERR as u8);
    }
    if len > lim.max_bytes && op.has_data() {
        return finish(&chain, vring, None, VIRTIO_BLK_S_IOERR as u8);
    }
    let Some(offset) = sector.checked_mul(512) else {
        return finish(&chain, vring, None, VIRTIO_BLK_S_IOERR as u8);
    };
    let mut buf = (op.has_data() && len > 0).then(|| AlignedBuf::new(len as usize));
    if op == Op::Write {
        let mem = chain.memory();
        let ok = chain.clone().reader(mem).is_ok_and(|mut r| {
            let mut hdr = [0u8; 16];
            r.read_exact(&mut hdr).is_ok()
                && buf
                    .as_mut()
                    .is_some_and(|b| r.read_exact(b.as_mut_slice()).is_ok())
        });
        if !ok {
            return finish(&chain, vring, None, VIRTIO_BLK_S_IOERR as u8);
        }
    }
    let io = match buf.as_mut() {
        // SAFETY: the buffer lives in the request, which the bio's frame
        // keeps until the bio completes; nothing else touches it meanwhile.
        Some(b) => unsafe { IoBuf::from_slice(b.as_mut_slice()) },
        None => IoBuf::empty(),
    };
    let req = Arc::new(Request {
        chain,
        vring: vring.clone(),
        buf,
        read: op == Op::Read,
    });
    let bio = Bio::new(
        op,
        if op == Op::Flush { 0 } else { offset },
        if op == Op::Flush { 0 } else { len },
        io,
        req,
        0,
    )
    .with_flags(if op == Op::Flush {
        BioFlags::NONE
    } else {
        flags
    });
    dev.submit(bio);
}
