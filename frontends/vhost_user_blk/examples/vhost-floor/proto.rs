//! The probe's side of the vhost-user protocol (qemu's
//! docs/interop/vhost-user.rst): what a VMM needs to start one
//! virtio-blk queue and nothing more. The `vhost` crate parses and checks
//! each message and its file descriptors; these are its requests, applied
//! to the connection's [`Floor`]. One queue, no log, no inflight region,
//! no postcopy, no memory hot-add: those are refused with
//! `InvalidOperation`, which ends the connection (qemu does not send
//! them unless offered).

use crate::blk::{Floor, QUEUE_MAX};
use std::fs::File;
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight,
    VhostUserLog, VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig,
    VhostUserSharedMsg, VhostUserSingleMemoryRegion, VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{
    Error as VuError, GpuBackend, Result as VuResult, VhostUserBackendReqHandlerMut,
    VhostUserVirtioFeatures,
};
use vhost::VhostUserMemoryRegionBase;
use virtio_bindings::virtio_blk::{VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_SEG_MAX};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap, GuestRegionMmap};

/// The virtio-blk config we fill: capacity, size_max, seg_max, geometry,
/// blk_size (virtio 1.2 section 5.2.4); the rest reads as zeros.
const CONFIG_LEN: usize = 60;

fn features() -> u64 {
    1 << VIRTIO_F_VERSION_1
        | 1 << VIRTIO_RING_F_EVENT_IDX
        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
        // One data segment per request: every request the probe takes is
        // one range of guest memory (Linux's default without SEG_MAX too).
        | 1 << VIRTIO_BLK_F_SEG_MAX
        | 1 << VIRTIO_BLK_F_BLK_SIZE
}

fn config(size: u64) -> [u8; CONFIG_LEN] {
    let mut c = [0u8; CONFIG_LEN];
    c[0..8].copy_from_slice(&(size / 512).to_le_bytes());
    c[12..16].copy_from_slice(&1u32.to_le_bytes()); // seg_max
    c[20..24].copy_from_slice(&512u32.to_le_bytes()); // blk_size
    c
}

fn refuse<T>(what: &'static str) -> VuResult<T> {
    Err(VuError::InvalidOperation(what))
}

fn only_queue_0(index: u32) -> VuResult<()> {
    if index == 0 {
        Ok(())
    } else {
        Err(VuError::InvalidParam)
    }
}

impl Floor {
    fn vmm_to_guest(&self, va: u64) -> VuResult<GuestAddress> {
        self.maps
            .iter()
            .find(|(vmm, size, _)| va >= *vmm && va - vmm < *size)
            .map(|(vmm, _, gpa)| GuestAddress(va - vmm + gpa))
            .ok_or(VuError::InvalidParam)
    }
}

impl VhostUserBackendReqHandlerMut for Floor {
    fn set_owner(&mut self) -> VuResult<()> {
        Ok(())
    }
    fn reset_owner(&mut self) -> VuResult<()> {
        Ok(())
    }
    fn reset_device(&mut self) -> VuResult<()> {
        refuse("reset_device")
    }
    fn get_features(&mut self) -> VuResult<u64> {
        Ok(features())
    }
    fn set_features(&mut self, f: u64) -> VuResult<()> {
        if f & !features() != 0 {
            return Err(VuError::InvalidParam);
        }
        self.acked_features = f;
        self.queue
            .set_event_idx(f & (1 << VIRTIO_RING_F_EVENT_IDX) != 0);
        // Without protocol features a ring runs as soon as it is kicked.
        self.protocol_features = f & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0;
        if !self.protocol_features {
            self.enabled = true;
        }
        Ok(())
    }
    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        postcopy: Option<bool>,
    ) -> VuResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        if postcopy.is_some() {
            return refuse("postcopy");
        }
        // Requests in flight point into the old table.
        self.drain();
        let mut regions = Vec::with_capacity(ctx.len());
        let mut maps = Vec::with_capacity(ctx.len());
        for (r, file) in ctx.iter().zip(files) {
            let region =
                GuestRegionMmap::new(r.mmap_region(file)?, GuestAddress(r.guest_phys_addr))
                    .ok_or(VuError::InvalidParam)?;
            maps.push((r.user_addr, r.memory_size, r.guest_phys_addr));
            regions.push(region);
        }
        let mem = GuestMemoryMmap::from_regions(regions).map_err(|_| VuError::InvalidParam)?;
        self.mem = Some(mem);
        self.maps = maps;
        Ok(None)
    }
    fn set_vring_num(&mut self, index: u32, num: u32) -> VuResult<()> {
        only_queue_0(index)?;
        let n = u16::try_from(num).map_err(|_| VuError::InvalidParam)?;
        if n > QUEUE_MAX {
            return Err(VuError::InvalidParam);
        }
        self.queue
            .try_set_size(n)
            .map_err(|_| VuError::InvalidParam)
    }
    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VuResult<()> {
        only_queue_0(index)?;
        let (d, u, a) = (
            self.vmm_to_guest(descriptor)?,
            self.vmm_to_guest(used)?,
            self.vmm_to_guest(available)?,
        );
        let bad = |_| VuError::InvalidParam;
        self.queue.try_set_desc_table_address(d).map_err(bad)?;
        self.queue.try_set_avail_ring_address(a).map_err(bad)?;
        self.queue.try_set_used_ring_address(u).map_err(bad)?;
        // The used index is the guest's ring's (a rebooted guest starts at
        // 0), as libvhost-user and vhost-user-backend take it.
        // (`flags` then `idx`, two u16s, virtio 1.2 section 2.7.8).
        if let Some(mem) = &self.mem {
            let idx: u16 = mem
                .read_obj(GuestAddress(u.0.wrapping_add(2)))
                .map_err(|_| VuError::InvalidParam)?;
            self.queue.set_next_used(idx);
        }
        Ok(())
    }
    fn set_vring_base(&mut self, index: u32, base: u32) -> VuResult<()> {
        only_queue_0(index)?;
        let b = u16::try_from(base).map_err(|_| VuError::InvalidParam)?;
        self.queue.set_next_avail(b);
        Ok(())
    }
    fn get_vring_base(&mut self, index: u32) -> VuResult<VhostUserVringState> {
        only_queue_0(index)?;
        // The ring stops: finish what is in flight, wait for no more kicks.
        self.drain();
        self.kick = None;
        self.kick_changed = true;
        self.queue.set_ready(false);
        if self.protocol_features {
            self.enabled = false;
        }
        Ok(VhostUserVringState::new(
            index,
            u32::from(self.queue.next_avail()),
        ))
    }
    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        only_queue_0(u32::from(index))?;
        // A ring without a kick would have to be polled: not offered.
        let Some(fd) = fd else {
            return refuse("a vring without a kick eventfd");
        };
        let Some(mem) = &self.mem else {
            return refuse("a kick before the memory table");
        };
        // `is_valid` checks the ring's layout in memory, of a ready queue.
        self.queue.set_ready(true);
        if !self.queue.is_valid(mem) {
            self.queue.set_ready(false);
            return Err(VuError::InvalidParam);
        }
        self.kick = Some(fd);
        self.kick_changed = true;
        Ok(())
    }
    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        only_queue_0(u32::from(index))?;
        self.call = fd;
        Ok(())
    }
    fn set_vring_err(&mut self, index: u8, _fd: Option<File>) -> VuResult<()> {
        only_queue_0(u32::from(index))
    }
    fn get_protocol_features(&mut self) -> VuResult<VhostUserProtocolFeatures> {
        Ok(VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ)
    }
    fn set_protocol_features(&mut self, f: u64) -> VuResult<()> {
        // REPLY_ACK is the vhost crate's own, always offered.
        let offered = (VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK)
            .bits();
        if f & !offered != 0 {
            return Err(VuError::InvalidParam);
        }
        Ok(())
    }
    fn get_queue_num(&mut self) -> VuResult<u64> {
        Ok(1)
    }
    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VuResult<()> {
        only_queue_0(index)?;
        self.enabled = enable;
        Ok(())
    }
    fn get_config(&mut self, offset: u32, size: u32, _: VhostUserConfigFlags) -> VuResult<Vec<u8>> {
        let c = config(self.size);
        let start = (offset as usize).min(CONFIG_LEN);
        let end = start.saturating_add(size as usize).min(CONFIG_LEN);
        let mut v = c[start..end].to_vec();
        v.resize(size as usize, 0);
        Ok(v)
    }
    fn set_config(&mut self, _: u32, _: &[u8], _: VhostUserConfigFlags) -> VuResult<()> {
        refuse("set_config (the config is read-only)")
    }
    fn set_gpu_socket(&mut self, _: GpuBackend) -> VuResult<()> {
        refuse("gpu socket")
    }
    fn get_shared_object(&mut self, _: VhostUserSharedMsg) -> VuResult<File> {
        refuse("shared objects")
    }
    fn get_inflight_fd(&mut self, _: &VhostUserInflight) -> VuResult<(VhostUserInflight, File)> {
        refuse("inflight region")
    }
    fn set_inflight_fd(&mut self, _: &VhostUserInflight, _: File) -> VuResult<()> {
        refuse("inflight region")
    }
    fn get_max_mem_slots(&mut self) -> VuResult<u64> {
        refuse("memory slots")
    }
    fn add_mem_region(
        &mut self,
        _: &VhostUserSingleMemoryRegion,
        _: File,
        _: Option<bool>,
    ) -> VuResult<Option<VhostUserMemoryRegionBase>> {
        refuse("memory hot-add")
    }
    fn remove_mem_region(&mut self, _: &VhostUserSingleMemoryRegion) -> VuResult<()> {
        refuse("memory hot-remove")
    }
    fn set_device_state_fd(
        &mut self,
        _: VhostTransferStateDirection,
        _: VhostTransferStatePhase,
        _: File,
    ) -> VuResult<Option<File>> {
        refuse("device state transfer")
    }
    fn check_device_state(&mut self) -> VuResult<()> {
        refuse("device state transfer")
    }
    fn get_shmem_config(&mut self) -> VuResult<VhostUserShMemConfig> {
        refuse("shared memory regions")
    }
    fn set_log_base(&mut self, _: &VhostUserLog, _: File) -> VuResult<()> {
        refuse("dirty log")
    }
}
