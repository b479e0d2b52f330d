//! A virtqueue whose kicks the queue's thread never reads (issue 40).
//!
//! vhost-user-backend's worker waits in a level-triggered epoll and reads
//! the kick eventfd (`VringT::read_kick`) before every event it hands to
//! the backend: one `read` per kick on top of the wait. This vring is
//! rust-vmm's `VringRwLock` with that read taken out: [`BlkVring`]'s
//! `read_kick` only says whether the queue is enabled, and the backend
//! turns the kick's epoll item edge-triggered (`EPOLL_CTL_MOD` with
//! `EPOLLET`, [`crate::backend`]) the first time it sees the queue after
//! the handler (re)registered it, as the floor probe
//! (examples/vhost-floor) and qemu's fdmon-io_uring wait for kicks.
//!
//! Why an unread eventfd still wakes the thread for every kick: its
//! `write` (the VMM's `event_notifier_set`) and KVM's ioeventfd
//! (`eventfd_signal`) wake its waiters on every signal, whether or not
//! the counter was already non-zero (fs/eventfd.c), and each wake puts
//! an edge-triggered item back on epoll's ready list (fs/eventpoll.c,
//! `ep_poll_callback`). A kick that lands while the thread is mid-round
//! therefore wakes its next `epoll_wait`; a drained ring is re-checked
//! after notifications come back on (the event-index protocol,
//! `serve_kick`). The counter only grows: 2^64 - 2 kicks before a
//! `write` would block.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLockReadGuard, RwLockWriteGuard};
use vhost_user_backend::{VringRwLock, VringState, VringStateGuard, VringStateMutGuard, VringT};
use virtio_queue::Error as VirtQueError;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

type AtomicMem = GuestMemoryAtomic<GuestMemoryMmap<()>>;

/// rust-vmm's `VringRwLock`, its kicks left unread (see the module doc).
#[derive(Clone)]
pub struct BlkVring {
    inner: VringRwLock<AtomicMem>,
    /// The handler may have (re)registered the kick level-triggered since
    /// the backend last made it edge-triggered.
    rearm: Arc<AtomicBool>,
}

impl BlkVring {
    /// The vring itself, for the request path.
    pub fn ring(&self) -> &VringRwLock<AtomicMem> {
        &self.inner
    }

    /// Whether the kick's epoll item must be made edge-triggered (again);
    /// clears the flag. Put it back with [`BlkVring::rearm_later`] if
    /// that failed.
    pub fn take_rearm(&self) -> bool {
        self.rearm.load(Ordering::Relaxed) && self.rearm.swap(false, Ordering::AcqRel)
    }

    pub fn rearm_later(&self) {
        self.rearm.store(true, Ordering::Release);
    }

    /// Read the kick's counter (the fallback when its item could not be
    /// made edge-triggered: a level-triggered item must be drained).
    pub fn consume_kick(&self) {
        if let Some(k) = self.inner.get_ref().get_kick() {
            let _ = k.consume();
        }
    }
}

impl<'a> VringStateGuard<'a, AtomicMem> for BlkVring {
    type G = RwLockReadGuard<'a, VringState<AtomicMem>>;
}

impl<'a> VringStateMutGuard<'a, AtomicMem> for BlkVring {
    type G = RwLockWriteGuard<'a, VringState<AtomicMem>>;
}

impl VringT<AtomicMem> for BlkVring {
    fn new(mem: AtomicMem, max_queue_size: u16) -> Result<Self, VirtQueError> {
        Ok(BlkVring {
            inner: VringRwLock::new(mem, max_queue_size)?,
            rearm: Arc::new(AtomicBool::new(true)),
        })
    }

    fn get_ref(&self) -> <Self as VringStateGuard<'_, AtomicMem>>::G {
        self.inner.get_ref()
    }

    fn get_mut(&self) -> <Self as VringStateMutGuard<'_, AtomicMem>>::G {
        self.inner.get_mut()
    }

    fn add_used(&self, desc_index: u16, len: u32) -> Result<(), VirtQueError> {
        self.inner.add_used(desc_index, len)
    }

    fn signal_used_queue(&self) -> io::Result<()> {
        self.inner.signal_used_queue()
    }

    fn enable_notification(&self) -> Result<bool, VirtQueError> {
        self.inner.enable_notification()
    }

    fn disable_notification(&self) -> Result<(), VirtQueError> {
        self.inner.disable_notification()
    }

    fn needs_notification(&self) -> Result<bool, VirtQueError> {
        self.inner.needs_notification()
    }

    fn set_enabled(&self, enabled: bool) {
        self.inner.set_enabled(enabled);
        if enabled {
            self.rearm_later();
        }
    }

    fn set_queue_info(
        &self,
        desc_table: u64,
        avail_ring: u64,
        used_ring: u64,
    ) -> Result<(), VirtQueError> {
        self.inner.set_queue_info(desc_table, avail_ring, used_ring)
    }

    fn queue_next_avail(&self) -> u16 {
        self.inner.queue_next_avail()
    }

    fn set_queue_next_avail(&self, base: u16) {
        self.inner.set_queue_next_avail(base)
    }

    fn set_queue_next_used(&self, idx: u16) {
        self.inner.set_queue_next_used(idx)
    }

    fn queue_used_idx(&self) -> Result<u16, VirtQueError> {
        self.inner.queue_used_idx()
    }

    fn set_queue_size(&self, num: u16) {
        self.inner.set_queue_size(num)
    }

    fn set_queue_event_idx(&self, enabled: bool) {
        self.inner.set_queue_event_idx(enabled)
    }

    fn set_queue_ready(&self, ready: bool) {
        self.inner.set_queue_ready(ready);
        if ready {
            self.rearm_later();
        }
    }

    fn set_kick(&self, file: Option<File>) {
        self.inner.set_kick(file);
        self.rearm_later();
    }

    /// Whether the queue is enabled; the kick is left unread (see the
    /// module doc).
    fn read_kick(&self) -> io::Result<bool> {
        Ok(self.inner.get_ref().is_enabled())
    }

    fn set_call(&self, file: Option<File>) {
        self.inner.set_call(file)
    }

    fn set_err(&self, file: Option<File>) {
        self.inner.set_err(file)
    }
}
