//! The vhost-user-blk device as rust-vmm's `vhost-user-backend` wants it:
//! features and config from the stack, one worker thread per virtqueue
//! (each virtqueue is one hardware queue of ours), event-idx
//! notification suppression, and the requests of each kick handed to
//! [`crate::request`]. Follows the device model of qemu's
//! hw/block/vhost-user-blk.c and the virtio-blk device of virtio 1.2.
//!
//! The requests a round takes from the ring run under one completion
//! batch, so those that complete inline call the guest once for the
//! round ([`crate::request`]). With the event index, a queue may poll
//! its ring a bounded, adaptive while after a round before it sleeps
//! ([`crate::poll`]; off unless `--vhost-poll-us` asks for it).
//!
//! A device whose completions a thread can wait for (the `file` device's
//! io_uring, [`blkstack_core::Reaper`]) is reaped by the queues' own
//! threads: its descriptor sits in each queue thread's epoll beside the
//! kicks ([`BlkBackend::attach_reaper`]), so a request is taken, submitted
//! and completed on one thread and the guest called once per reap, as
//! qemu-storage-daemon's one AioContext does with its ring. While such a
//! claim lives, a round's submissions are plugged
//! ([`blkstack_core::plug`]): the ring is entered once per round, not
//! once per request (qemu's `blk_io_plug` around a virtqueue's requests).
//!
//! Kicks are waited for edge-triggered and never read ([`crate::vring`]):
//! the first event of a queue after vhost-user-backend (re)registered its
//! kick turns the kick's item in that worker's epoll to `EPOLLET`
//! ([`BlkBackend::set_epolls`] tells the backend each worker's epoll), so
//! a kick costs the wait alone, as the floor probe's does.
//!
//! One backend serves one connection. Its guest memory is checked and
//! watched by [`crate::guard`]: a memory table whose regions overrun
//! their files is refused, and once a region has lost its pages the
//! connection is dead: no request is taken from it any more and the
//! connection is shut down. The backend also tells the server when the
//! peer has shown it speaks vhost-user ([`BlkBackend::wait_setup`]).

use crate::config::{BlkGeometry, CONFIG_LEN};
use crate::guard::{self, Regions};
use crate::poll::{self, PollWindow};
use crate::request::{self, Limits, Mem, ID_LEN};
use crate::vring::BlkVring;
use blkstack_core::comp_batch::CompletionBatch;
use blkstack_core::plug::SubmitPlug;
use blkstack_core::{DeviceRef, Reaper};
use parking_lot::{Condvar, Mutex, RwLock};
use std::os::fd::RawFd;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::ShutdownHandle;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

type AtomicMem = GuestMemoryAtomic<GuestMemoryMmap<()>>;

/// Descriptors per virtqueue the guest may use.
pub const QUEUE_SIZE: usize = 256;

pub struct BlkBackend {
    dev: DeviceRef,
    geo: BlkGeometry,
    limits: Limits,
    event_idx: AtomicBool,
    /// Each queue's polling window (a queue is served by one thread).
    polls: Vec<Mutex<PollWindow>>,
    mem: RwLock<Option<(AtomicMem, Arc<Regions>)>>,
    /// The connection failed for good (a refused memory table, guest
    /// memory that vanished): serve nothing more on it.
    dead: AtomicBool,
    /// Has the peer spoken the vhost-user setup (see `wait_setup`)?
    setup: Mutex<bool>,
    setup_cv: Condvar,
    /// Shuts this backend's connection down.
    conn: Mutex<Option<ShutdownHandle>>,
    /// The exit events handed to the current connection's worker threads
    /// (a new set per connection): written to stop them.
    exits: parking_lot::Mutex<Vec<EventNotifier>>,
    /// The read ends of those exit events. vhost-user-backend 0.24 turns
    /// each into a raw fd for its epoll (`VringEpollHandler::new`,
    /// `consumer.into_raw_fd()`) and never closes it: one descriptor per
    /// connection, so a VMM that reconnects would exhaust the process's
    /// descriptors. Closed here once the connection's workers are gone.
    exit_consumers: parking_lot::Mutex<Vec<std::os::fd::RawFd>>,
    /// This connection's claim on the device's completions, if it has
    /// one ([`BlkBackend::attach_reaper`]).
    reaper: Mutex<Option<Box<dyn Reaper>>>,
    /// A claim lives: plug each round's submissions (the claimed
    /// device's submissions never wait, so a plug cannot hold up its
    /// own thread).
    plug: AtomicBool,
    /// Each worker thread's epoll (by thread index), where its queue's
    /// kick is turned edge-triggered; owned by the connection's daemon.
    epolls: Mutex<Vec<RawFd>>,
}

impl BlkBackend {
    /// A backend whose queues never poll; see [`BlkBackend::with_poll`].
    pub fn new(
        name: &str,
        dev: DeviceRef,
        read_only: bool,
        queues: u16,
    ) -> std::io::Result<Arc<BlkBackend>> {
        Self::with_poll(name, dev, read_only, queues, Duration::ZERO)
    }

    /// A backend whose queues poll their rings up to `poll_limit` after
    /// a round of requests before they sleep (adaptive; zero: never).
    pub fn with_poll(
        name: &str,
        dev: DeviceRef,
        read_only: bool,
        queues: u16,
        poll_limit: Duration,
    ) -> std::io::Result<Arc<BlkBackend>> {
        let geo = BlkGeometry::of(&*dev, read_only, queues);
        let mut id = [0u8; ID_LEN];
        let label = format!("blkstack-{name}");
        let n = label.len().min(ID_LEN);
        id[..n].copy_from_slice(&label.as_bytes()[..n]);
        Ok(Arc::new(BlkBackend {
            dev,
            limits: Limits {
                max_bytes: (geo.max_sectors() as u64) << 9,
                read_only: geo.read_only,
                id,
            },
            geo,
            event_idx: AtomicBool::new(false),
            polls: (0..queues)
                .map(|_| Mutex::new(PollWindow::new(poll_limit)))
                .collect(),
            mem: RwLock::new(None),
            dead: AtomicBool::new(false),
            setup: Mutex::new(false),
            setup_cv: Condvar::new(),
            conn: Mutex::new(None),
            exits: parking_lot::Mutex::new(Vec::new()),
            exit_consumers: parking_lot::Mutex::new(Vec::new()),
            reaper: Mutex::new(None),
            plug: AtomicBool::new(false),
            epolls: Mutex::new(Vec::new()),
        }))
    }

    /// Stop every worker thread (serve is stopping or the guest went).
    pub fn stop_workers(&self) {
        for n in self.exits.lock().drain(..) {
            let _ = n.notify();
        }
    }

    /// The connection ended: drop its guest memory (the guard unmaps it
    /// once nothing else holds it), its failure and the exit events' read
    /// ends the handler left open, so that the next connection starts
    /// afresh. Call it only once the connection's daemon is dropped (its
    /// worker threads joined and their epolls closed).
    pub fn end_connection(&self) {
        for fd in self.exit_consumers.lock().drain(..) {
            // SAFETY: `fd` is an exit event's read end that the handler
            // took with `into_raw_fd` and never closes; its worker and
            // epoll are gone, so nothing uses it, and nothing else owns it.
            drop(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) });
        }
        *self.conn.lock() = None;
        self.epolls.lock().clear();
        // The device's own thread completes what is still in flight.
        self.detach_reaper();
        *self.mem.write() = None;
        guard::release_unused();
        *self.setup.lock() = false;
        self.dead.store(false, Ordering::SeqCst);
    }

    /// The epoll event id of the device's completions: past the queues'
    /// ids and the exit event's (`num_queues`), which vhost-user-backend
    /// keeps for itself.
    pub fn reap_event(&self) -> u16 {
        self.geo.num_queues + 1
    }

    /// Claim the device's completions for the queues' threads, if the
    /// device offers that; the descriptor to add to each queue thread's
    /// epoll (level-triggered, exclusive: one idle thread wakes per
    /// completion) under [`BlkBackend::reap_event`]. The claim ends with
    /// the connection ([`BlkBackend::end_connection`]); until then the
    /// device's own thread reaps only what the queue threads leave
    /// waiting (a bounded backstop).
    pub fn attach_reaper(&self) -> Option<std::os::fd::RawFd> {
        let r = self.dev.reaper()?;
        let fd = r.fd();
        *self.reaper.lock() = Some(r);
        self.plug.store(true, Ordering::Relaxed);
        Some(fd)
    }

    /// The connection's worker epolls, by thread index (its daemon's
    /// `get_epoll_handlers`), set before the daemon serves anything;
    /// they live as long as the daemon, which ends before
    /// [`BlkBackend::end_connection`].
    pub fn set_epolls(&self, fds: Vec<RawFd>) {
        *self.epolls.lock() = fds;
    }

    /// The first event of a queue since its kick was (re)registered: make
    /// the kick's item in this thread's epoll edge-triggered. Without an
    /// epoll to change (or if the change fails) the item stays
    /// level-triggered and the kick is read, as vhost-user-backend does,
    /// so the thread never spins on an unread kick.
    fn arm_edge(&self, vring: &BlkVring, thread: usize, device_event: u16) {
        if !vring.take_rearm() {
            return;
        }
        let ep = self.epolls.lock().get(thread).copied();
        let kick = vring.get_ref().get_kick().as_ref().map(|k| k.as_raw_fd());
        let (Some(ep), Some(kick)) = (ep, kick) else {
            vring.rearm_later();
            vring.consume_kick();
            return;
        };
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLET) as u32,
            u64: u64::from(device_event),
        };
        // SAFETY: epoll_ctl on the worker's live epoll (the daemon that
        // owns it is serving this event) and the vring's kick, with one
        // valid event.
        let r = unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_MOD, kick, &mut ev) };
        if r != 0 {
            tracing::debug!(
                "vhost-user-blk: kick stays level-triggered: {}",
                std::io::Error::last_os_error()
            );
            vring.rearm_later();
            vring.consume_kick();
        }
    }

    /// Give the device's completions back to its own thread.
    pub fn detach_reaper(&self) {
        self.plug.store(false, Ordering::Relaxed);
        *self.reaper.lock() = None;
    }

    /// Complete the device's ready completions on this thread.
    fn reap(&self) {
        if let Some(r) = self.reaper.lock().as_ref() {
            r.reap();
        }
    }

    /// The connection this backend serves, to shut down if it fails.
    pub fn set_connection(&self, h: Option<ShutdownHandle>) {
        let dead = self.dead.load(Ordering::SeqCst);
        *self.conn.lock() = h;
        if dead {
            self.fail("the connection failed before it was set up");
        }
    }

    /// Wait until the peer has spoken vhost-user's setup (asked for the
    /// protocol features or the config, or set a memory table), at most
    /// until `deadline`. False: it has not, or the connection failed.
    pub fn wait_setup(&self, deadline: Instant) -> bool {
        let mut done = self.setup.lock();
        while !*done && !self.dead.load(Ordering::SeqCst) {
            if self.setup_cv.wait_until(&mut done, deadline).timed_out() {
                break;
            }
        }
        *done && !self.dead.load(Ordering::SeqCst)
    }

    fn set_up(&self) {
        let mut done = self.setup.lock();
        if !*done {
            *done = true;
            self.setup_cv.notify_all();
        }
    }

    /// Serve nothing more on this connection and shut it down.
    fn fail(&self, why: &str) {
        if !self.dead.load(Ordering::SeqCst) {
            tracing::error!("vhost-user-blk: closing the connection: {why}");
        }
        self.close();
    }

    /// Shut the connection down (serve is stopping, or it failed); ends
    /// a [`BlkBackend::wait_setup`] at once.
    pub fn close(&self) {
        self.dead.store(true, Ordering::SeqCst);
        {
            let _g = self.setup.lock();
            self.setup_cv.notify_all();
        }
        if let Some(h) = self.conn.lock().as_ref() {
            h.shutdown();
        }
    }

    fn memory(&self) -> Option<(Mem, Arc<Regions>)> {
        self.mem
            .read()
            .as_ref()
            .map(|(m, r)| (m.memory().into_inner(), r.clone()))
    }

    /// Start every request the ring holds; how many were taken.
    fn process(&self, vring: &VringRwLock, mem: &Mem, regions: &Arc<Regions>) -> usize {
        if self.dead.load(Ordering::SeqCst) {
            return 0;
        }
        let mut taken = 0;
        // Entered once when this ends (before the round's batch does).
        let _plug = self.plug.load(Ordering::Relaxed).then(SubmitPlug::start);
        loop {
            let chain = vring
                .get_mut()
                .get_queue_mut()
                .pop_descriptor_chain(mem.clone());
            if regions.poisoned() {
                self.fail("guest memory vanished (its file was shrunk)");
                return taken;
            }
            let Some(chain) = chain else {
                return taken;
            };
            taken += 1;
            request::start(chain, vring, &self.dev, &self.limits, Some(regions));
            if regions.poisoned() {
                self.fail("guest memory vanished (its file was shrunk)");
                return taken;
            }
        }
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = BlkVring;

    fn num_queues(&self) -> usize {
        self.geo.num_queues as usize
    }

    fn max_queue_size(&self) -> usize {
        QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
            | 1 << VIRTIO_RING_F_EVENT_IDX
            | 1 << VIRTIO_RING_F_INDIRECT_DESC
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
            | self.geo.device_features()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        self.set_up();
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        self.set_up();
        let c = self.geo.config();
        let start = (offset as usize).min(CONFIG_LEN);
        let end = start.saturating_add(size as usize).min(CONFIG_LEN);
        let mut v = c[start..end].to_vec();
        v.resize(size as usize, 0);
        v
    }

    fn update_memory(&self, mem: GuestMemoryAtomic<GuestMemoryMmap<()>>) -> std::io::Result<()> {
        // Watched before it is checked: the handler has mapped it already.
        let table = mem.memory().into_inner();
        let checked = guard::watch(table.clone()).and_then(|r| {
            guard::check_files(&table)?;
            Ok(r)
        });
        drop(table);
        let regions = match checked {
            Ok(r) => Arc::new(r),
            Err(e) => {
                *self.mem.write() = None;
                let why = format!("SET_MEM_TABLE refused: {e}");
                self.fail(&why);
                return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, why));
            }
        };
        *self.mem.write() = Some((mem, regions));
        guard::release_unused();
        self.set_up();
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.geo.num_queues).map(|q| 1u64 << q).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        let (c, n) = new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()?;
        self.exits.lock().push(n.try_clone().ok()?);
        self.exit_consumers.lock().push(c.as_raw_fd());
        Some((c, n))
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[BlkVring],
        thread_id: usize,
    ) -> std::io::Result<()> {
        if evset != EventSet::IN {
            return Err(std::io::Error::other("vhost-user-blk: unexpected event"));
        }
        if device_event == self.reap_event() {
            self.reap();
            return Ok(());
        }
        let Some(bv) = vrings.get(device_event as usize) else {
            return Ok(());
        };
        self.arm_edge(bv, thread_id, device_event);
        let vring = bv.ring();
        if self.event_idx.load(Ordering::Relaxed) {
            // One queue per thread (`queues_per_thread`): the thread's
            // index is its queue's.
            let Some(window) = self.polls.get(thread_id) else {
                return Ok(());
            };
            let mut window = window.lock();
            window.woke(Instant::now());
            self.serve_kick(vring, &window);
            window.sleeping(Instant::now());
        } else {
            let _batch = CompletionBatch::start();
            if let Some((mem, regions)) = self.memory() {
                self.process(vring, &mem, &regions);
            }
        }
        Ok(())
    }
}

impl BlkBackend {
    /// A kick with the event index: take requests in rounds until the
    /// guest has added nothing new since notifications were turned back
    /// on, polling the ring `window`'s while after each round that took
    /// some, notifications still off.
    fn serve_kick(&self, vring: &VringRwLock, window: &PollWindow) {
        // Work until the guest has added nothing new since notifications
        // were turned back on (the event-index protocol, virtio 2.7.10).
        // A ring that keeps saying "more" but gives nothing (an avail
        // index beyond the queue's length, which virtio-queue refuses
        // to walk) is broken: fail it, as qemu's virtio_error and the
        // kernel's vq_err do, instead of spinning on it for ever. One
        // empty round is allowed: the guest may add a request just
        // before notifications come back on.
        //
        // One look at the memory table per kick, and the queue's
        // notification calls with it (VringState's own would load the
        // table again for each).
        let Some((mem, regions)) = self.memory() else {
            return;
        };
        let mut empty_rounds = 0;
        loop {
            let _ = vring.get_mut().get_queue_mut().disable_notification(&*mem);
            let taken = {
                // The round's inline completions call the guest once.
                let _batch = CompletionBatch::start();
                self.process(vring, &mem, &regions)
            };
            empty_rounds = if taken == 0 { empty_rounds + 1 } else { 0 };
            if taken > 0 && self.poll_ring(vring, &mem, window) {
                continue;
            }
            let enabled = vring.get_mut().get_queue_mut().enable_notification(&*mem);
            match enabled {
                Ok(true) if empty_rounds < 2 => continue,
                Ok(true) => {
                    self.fail("the guest's available ring announces requests it does not hold (a corrupt avail index)");
                    break;
                }
                _ => break,
            }
        }
    }

    /// Watch the avail ring for the window's while: true as soon as the
    /// guest has added a request (notifications are still off, so it
    /// did not kick), false once the window has passed (or is closed).
    fn poll_ring(&self, vring: &VringRwLock, mem: &Mem, window: &PollWindow) -> bool {
        if window.window().is_zero() || self.dead.load(Ordering::Relaxed) {
            return false;
        }
        poll::spin(window.window(), || {
            let v = vring.get_ref();
            let q = v.get_queue();
            q.avail_idx(&**mem, Ordering::Acquire)
                .is_ok_and(|idx| idx.0 != q.next_avail())
        })
    }
}
