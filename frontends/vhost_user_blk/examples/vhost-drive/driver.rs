//! A VMM and its guest driver, from the host, for a vhost-user-blk server
//! (issue 40): the `vhost` crate's `Frontend` speaks the protocol (guest
//! memory over a memfd-like file, one virtqueue), and this file plays
//! Linux's `drivers/virtio/virtio_ring.c` on that queue: it keeps `qd`
//! requests in flight, publishes each batch with one avail-index store,
//! kicks only when the device's `avail_event` asks (`vring_need_event`,
//! or `VRING_USED_F_NO_NOTIFY` without the event index), and sleeps on the
//! call eventfd after setting `used_event` to the next completion it
//! wants. No TCG guest: the server's work per request can be counted
//! (callgrind, strace) without the guest's noise.
//!
//! Written by hand: rust-vmm's `MockSplitQueue` lays its rings out anew on
//! each use and has no driver loop; the split ring itself is virtio 1.2
//! section 2.7. Every wait is bounded ([`HANG_MS`]).

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserVirtioFeatures};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE, VRING_USED_F_NO_NOTIFY,
};
use vm_memory::{Address, Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

/// Descriptors in the queue (three per request: header, data, status).
pub const QUEUE: u16 = 128;
/// Most requests in flight.
pub const MAX_QD: usize = QUEUE as usize / 3;
/// Bytes per request.
pub const LEN: u32 = 4096;
/// How long one wait for a call may take before the driver calls it a hang.
pub const HANG_MS: i32 = 20_000;

const MEM: usize = 4 << 20;
const DESC: u64 = 0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const HDR: u64 = 0x4000;
const STATUS: u64 = 0x5000;
const DATA: u64 = 0x1_0000;

/// What the requests do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// 4 KiB reads over the first `span` sectors.
    Read,
    /// 4 KiB writes over the first `span` sectors.
    Write,
    /// Each slot writes a pattern to its own blocks, then reads it back and
    /// checks it (a disk that keeps data: `memory`, `file`).
    Verify,
}

#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    #[error("vhost-user: {0}")]
    Vhost(#[from] vhost::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("guest memory: {0}")]
    Mem(String),
    #[error("{0}")]
    Bad(String),
}

/// A connected VMM with one ready queue.
pub struct Vmm {
    fe: Frontend,
    mem: GuestMemoryMmap<()>,
    kick: EventFd,
    call: EventFd,
    event_idx: bool,
    _file: std::fs::File,
    /// Avail index published so far, used index consumed so far.
    avail: u16,
    used: u16,
    /// Kicks sent and calls waited for.
    pub kicks: u64,
    pub calls: u64,
    /// The guest's think time: how long to wait after a call before it
    /// queues the next requests (zero: at once). A server that is still
    /// busy when the next request comes takes it without a kick, so how
    /// many syscalls a request costs depends on timing; a think time
    /// longer than the server's round makes the count the same on any
    /// machine (the server is back in its wait for every kick).
    pub settle: std::time::Duration,
}

fn mem_err(e: impl std::fmt::Display) -> DriveError {
    DriveError::Mem(e.to_string())
}

impl Vmm {
    /// Connect to `sock`, set up guest memory and queue 0 (with the event
    /// index or without).
    pub fn connect(sock: &Path, event_idx: bool) -> Result<Vmm, DriveError> {
        let file = tempfile::tempfile()?;
        file.set_len(MEM as u64)?;
        let fo = FileOffset::new(file.try_clone()?, 0);
        let mem = GuestMemoryMmap::<()>::from_ranges_with_files([(GuestAddress(0), MEM, Some(fo))])
            .map_err(mem_err)?;
        let host = mem.get_host_address(GuestAddress(0)).map_err(mem_err)? as u64;
        let mut fe = Frontend::connect(sock, 1)?;
        fe.set_owner()?;
        let mut want = 1 << VIRTIO_F_VERSION_1 | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if event_idx {
            want |= 1 << VIRTIO_RING_F_EVENT_IDX;
        }
        let offered = fe.get_features()?;
        if offered & want != want {
            return Err(DriveError::Bad(format!("features offered: {offered:#x}")));
        }
        fe.set_features(want)?;
        let pf = fe.get_protocol_features()?;
        fe.set_protocol_features(
            pf & (VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ),
        )?;
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: MEM as u64,
            userspace_addr: host,
            mmap_offset: 0,
            mmap_handle: file.as_raw_fd(),
        };
        fe.set_mem_table(&[region])?;
        fe.set_vring_num(0, QUEUE)?;
        let ring = VringConfigData {
            queue_max_size: QUEUE,
            queue_size: QUEUE,
            flags: 0,
            desc_table_addr: host + DESC,
            used_ring_addr: host + USED,
            avail_ring_addr: host + AVAIL,
            log_addr: None,
        };
        fe.set_vring_addr(0, &ring)?;
        fe.set_vring_base(0, 0)?;
        let (kick, call) = (EventFd::new(0)?, EventFd::new(0)?);
        fe.set_vring_call(0, &call)?;
        fe.set_vring_kick(0, &kick)?;
        fe.set_vring_enable(0, true)?;
        let vmm = Vmm {
            fe,
            mem,
            kick,
            call,
            event_idx,
            _file: file,
            avail: 0,
            used: 0,
            kicks: 0,
            calls: 0,
            settle: std::time::Duration::ZERO,
        };
        for k in 0..MAX_QD as u16 {
            vmm.lay_out(k)?;
        }
        Ok(vmm)
    }

    /// Slot k's three descriptors (its header, data and status).
    fn lay_out(&self, k: u16) -> Result<(), DriveError> {
        let (next, w) = (VRING_DESC_F_NEXT as u16, VRING_DESC_F_WRITE as u16);
        let d = [
            (HDR + 16 * u64::from(k), 16u32, next, 3 * k + 1),
            (DATA + u64::from(LEN) * u64::from(k), LEN, next, 3 * k + 2),
            (STATUS + u64::from(k), 1, w, 0),
        ];
        for (i, (addr, len, flags, nx)) in d.into_iter().enumerate() {
            let at = GuestAddress(DESC + 16 * u64::from(3 * k + i as u16));
            self.mem.write_obj(addr, at).map_err(mem_err)?;
            self.mem
                .write_obj(len, at.unchecked_add(8))
                .map_err(mem_err)?;
            self.mem
                .write_obj(flags, at.unchecked_add(12))
                .map_err(mem_err)?;
            self.mem
                .write_obj(nx, at.unchecked_add(14))
                .map_err(mem_err)?;
        }
        Ok(())
    }

    /// Fill in slot k as a request (`out`: a write) at `sector`, its data
    /// `fill` bytes, and put it on the avail ring (not yet published).
    fn queue(&mut self, k: u16, out: bool, sector: u64, fill: u8) -> Result<(), DriveError> {
        let kind = if out {
            VIRTIO_BLK_T_OUT
        } else {
            VIRTIO_BLK_T_IN
        };
        let mut hdr = [0u8; 16];
        hdr[0..4].copy_from_slice(&kind.to_le_bytes());
        hdr[8..16].copy_from_slice(&sector.to_le_bytes());
        let m = &self.mem;
        m.write_slice(&hdr, GuestAddress(HDR + 16 * u64::from(k)))
            .map_err(mem_err)?;
        let data = GuestAddress(DESC + 16 * u64::from(3 * k + 1) + 12);
        let flags = VRING_DESC_F_NEXT as u16 | if out { 0 } else { VRING_DESC_F_WRITE as u16 };
        m.write_obj(flags, data).map_err(mem_err)?;
        let buf = GuestAddress(DATA + u64::from(LEN) * u64::from(k));
        m.write_slice(&[fill; LEN as usize], buf).map_err(mem_err)?;
        m.write_obj(0xFFu8, GuestAddress(STATUS + u64::from(k)))
            .map_err(mem_err)?;
        let slot = u64::from(self.avail % QUEUE);
        m.write_obj(3 * k, GuestAddress(AVAIL + 4 + 2 * slot))
            .map_err(mem_err)?;
        self.avail = self.avail.wrapping_add(1);
        Ok(())
    }

    /// Publish what `queue` put on the ring since `old` and kick if the
    /// device asks for it (virtio_ring.c `virtqueue_kick_prepare_split`).
    fn publish(&mut self, old: u16) -> Result<(), DriveError> {
        let m = &self.mem;
        fence(Ordering::Release);
        m.store(self.avail, GuestAddress(AVAIL + 2), Ordering::Release)
            .map_err(mem_err)?;
        fence(Ordering::SeqCst);
        let kick = if self.event_idx {
            let at = GuestAddress(USED + 4 + 8 * u64::from(QUEUE));
            let ev: u16 = m.load(at, Ordering::Acquire).map_err(mem_err)?;
            self.avail.wrapping_sub(ev).wrapping_sub(1) < self.avail.wrapping_sub(old)
        } else {
            let f: u16 = m
                .load(GuestAddress(USED), Ordering::Acquire)
                .map_err(mem_err)?;
            f & VRING_USED_F_NO_NOTIFY as u16 == 0
        };
        if kick {
            self.kick.write(1)?;
            self.kicks += 1;
        }
        Ok(())
    }

    /// The used entries the device added since the last call: their slots.
    /// Sleeps on the call eventfd until there is at least one.
    fn reap(&mut self, done: &mut Vec<u16>) -> Result<(), DriveError> {
        let m = &self.mem;
        loop {
            if self.event_idx {
                let at = GuestAddress(AVAIL + 4 + 2 * u64::from(QUEUE));
                m.store(self.used, at, Ordering::Release).map_err(mem_err)?;
            }
            fence(Ordering::SeqCst);
            let idx: u16 = m
                .load(GuestAddress(USED + 2), Ordering::Acquire)
                .map_err(mem_err)?;
            if idx != self.used {
                while self.used != idx {
                    let e = USED + 4 + 8 * u64::from(self.used % QUEUE);
                    let id: u32 = m.read_obj(GuestAddress(e)).map_err(mem_err)?;
                    if !id.is_multiple_of(3) || id / 3 >= MAX_QD as u32 {
                        return Err(DriveError::Bad(format!("used id {id}")));
                    }
                    done.push((id / 3) as u16);
                    self.used = self.used.wrapping_add(1);
                }
                // Drained: ask for the next completion at once, as
                // virtio_ring.c's `virtqueue_enable_cb` does after
                // virtio_blk's `virtblk_done` has taken what was there.
                if self.event_idx {
                    let at = GuestAddress(AVAIL + 4 + 2 * u64::from(QUEUE));
                    m.store(self.used, at, Ordering::Release).map_err(mem_err)?;
                }
                return Ok(());
            }
            let mut p = libc::pollfd {
                fd: self.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: p is one live pollfd, the count given.
            let n = unsafe { libc::poll(&mut p, 1, HANG_MS) };
            if n != 1 {
                return Err(DriveError::Bad(format!("no call within {HANG_MS} ms")));
            }
            self.call.read()?;
            self.calls += 1;
        }
    }

    fn status(&self, k: u16) -> Result<u8, DriveError> {
        self.mem
            .read_obj(GuestAddress(STATUS + u64::from(k)))
            .map_err(mem_err)
    }

    fn data(&self, k: u16) -> Result<Vec<u8>, DriveError> {
        let mut v = vec![0u8; LEN as usize];
        let at = GuestAddress(DATA + u64::from(LEN) * u64::from(k));
        self.mem.read_slice(&mut v, at).map_err(mem_err)?;
        Ok(v)
    }

    /// Run `total` requests of `mode`, `qd` in flight, over the disk's
    /// first `span` sectors (a multiple of 8, at least 8 per slot for
    /// `Verify`). Every status must be OK; `Verify` checks every read.
    pub fn run(&mut self, mode: Mode, qd: usize, total: u64, span: u64) -> Result<(), DriveError> {
        if qd == 0 || qd > MAX_QD || span < 8 * qd as u64 {
            return Err(DriveError::Bad(format!(
                "qd {qd} (1..={MAX_QD}) over {span} sectors"
            )));
        }
        let blocks = span / 8;
        // Per slot: requests issued; a cheap deterministic walk of the disk.
        let mut issued = vec![0u64; qd];
        let (mut started, mut finished) = (0u64, 0u64);
        let plan = |k: usize, j: u64| -> (bool, u64, u8) {
            match mode {
                Mode::Verify => {
                    let per = (blocks / qd as u64).max(1);
                    let b = k as u64 + qd as u64 * ((j / 2) % per);
                    let fill = (k as u64 * 31 + (j / 2) * 7) as u8 | 1;
                    (j.is_multiple_of(2), 8 * b, fill)
                }
                _ => {
                    let b = (k as u64 * 7919 + j * 104_729) % blocks;
                    (mode == Mode::Write, 8 * b, 0xAA)
                }
            }
        };
        let next = |vmm: &mut Vmm, k: usize, issued: &mut [u64]| -> Result<(), DriveError> {
            let (out, sector, fill) = plan(k, issued[k]);
            let fill = if out { fill } else { 0xAA };
            vmm.queue(k as u16, out, sector, fill)
        };
        let old = self.avail;
        for k in 0..qd.min(total as usize) {
            next(self, k, &mut issued)?;
            started += 1;
        }
        self.publish(old)?;
        let mut done = Vec::with_capacity(qd);
        while finished < total {
            done.clear();
            self.reap(&mut done)?;
            if !self.settle.is_zero() {
                std::thread::sleep(self.settle);
            }
            let old = self.avail;
            for &k in &done {
                let k = usize::from(k);
                let st = self.status(k as u16)?;
                if st != VIRTIO_BLK_S_OK as u8 {
                    return Err(DriveError::Bad(format!("slot {k}: status {st}")));
                }
                let (out, sector, fill) = plan(k, issued[k]);
                if mode == Mode::Verify && !out {
                    let d = self.data(k as u16)?;
                    if let Some(i) = d.iter().position(|&b| b != fill) {
                        return Err(DriveError::Bad(format!(
                            "slot {k}, sector {sector}: byte {i} is {:#x}, wrote {fill:#x}",
                            d[i]
                        )));
                    }
                }
                issued[k] += 1;
                finished += 1;
                if started < total {
                    next(self, k, &mut issued)?;
                    started += 1;
                }
            }
            if self.avail != old {
                self.publish(old)?;
            }
        }
        Ok(())
    }

    /// Hang up (the server sees the connection end).
    pub fn close(self) {
        drop(self.fe);
    }
}
