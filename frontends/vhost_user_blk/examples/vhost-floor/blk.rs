//! The probe's data path: one connection's state, its wait (epoll or the
//! io_uring, see [`crate::Wait`]) and the virtio-blk requests of its one
//! split virtqueue (virtio 1.2 sections 2.7 and 5.2.6), done in the guest's
//! pages. Every buffer is sized when the connection starts: the
//! completion slots by the largest queue, the ring by the slots.

use crate::{Kind, Medium, Wait};
use anyhow::{bail, Context as _};
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use std::fs::File;
use std::io::Write as _;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryMmap};

/// The largest virtqueue the probe takes (qemu's default is 128).
pub const QUEUE_MAX: u16 = 1024;
/// The ring: every request of a full queue, plus the polls.
const RING_ENTRIES: u32 = QUEUE_MAX as u32 * 2;
/// `user_data` tags in the ring (the low bits: a head index or a kick's
/// generation).
const TAG_IO: u64 = 1 << 56;
const TAG_KICK: u64 = 2 << 56;
const TAG_SOCK: u64 = 3 << 56;
const TAG_MASK: u64 = 0xff << 56;
/// epoll tokens.
const EV_SOCK: u64 = 0;
const EV_KICK: u64 = 1;
const EV_RING: u64 = 2;

/// One in-flight file request: where its status byte goes and the used
/// length to report (data plus status for reads, status for writes).
#[derive(Clone, Copy, Default)]
struct Slot {
    status: u64,
    len: u32,
    used_len: u32,
}

/// One VMM connection's device: what the protocol set up (`proto.rs`
/// writes these fields) and the running queue.
pub struct Floor {
    pub kind: Kind,
    pub size: u64,
    file_fd: RawFd,
    pub acked_features: u64,
    pub mem: Option<GuestMemoryMmap<()>>,
    /// (VMM address, size, guest address) of each region, for the vring
    /// addresses, which come as VMM addresses.
    pub maps: Vec<(u64, u64, u64)>,
    pub queue: Queue,
    pub kick: Option<File>,
    /// Set by the protocol when `kick` was replaced or dropped.
    pub kick_changed: bool,
    pub call: Option<File>,
    /// The kick being waited on (epoll: registered; ring: polled under
    /// this generation), kept open until it is disarmed.
    armed_kick: Option<(File, u64)>,
    kick_gen: u64,
    pub enabled: bool,
    pub protocol_features: bool,
    epoll: Option<OwnedFd>,
    ring: Option<IoUring>,
    sock_armed: bool,
    slots: Vec<Slot>,
    inflight: u32,
}

impl Floor {
    pub fn new(m: &Medium) -> anyhow::Result<Floor> {
        let epoll = if m.wait == Wait::Epoll {
            // SAFETY: epoll_create1 takes flags only; the result is checked.
            let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
            if fd < 0 {
                return Err(std::io::Error::last_os_error()).context("epoll_create1");
            }
            // SAFETY: fd is a fresh descriptor nothing else owns.
            Some(unsafe { OwnedFd::from_raw_fd(fd) })
        } else {
            None
        };
        let ring = if m.kind == Kind::File || m.wait == Wait::Ring {
            let mut b = IoUring::builder();
            if m.wait == Wait::Ring {
                // Completions run only when this thread waits for them:
                // no task_work interrupting it, no other submitter.
                b.setup_single_issuer().setup_defer_taskrun();
            }
            Some(b.build(RING_ENTRIES).context("io_uring setup")?)
        } else {
            None
        };
        let f = Floor {
            kind: m.kind,
            size: m.size,
            file_fd: m.file.as_ref().map_or(-1, |f| f.as_raw_fd()),
            acked_features: 0,
            mem: None,
            maps: Vec::new(),
            queue: Queue::new(QUEUE_MAX).context("virtqueue")?,
            kick: None,
            kick_changed: false,
            call: None,
            armed_kick: None,
            kick_gen: 0,
            enabled: false,
            protocol_features: false,
            epoll,
            ring,
            sock_armed: false,
            slots: vec![Slot::default(); QUEUE_MAX as usize],
            inflight: 0,
        };
        if let (Some(ring), Some(_)) = (&f.ring, &f.epoll) {
            f.epoll_ctl(
                libc::EPOLL_CTL_ADD,
                ring.as_raw_fd(),
                libc::EPOLLIN as u32,
                EV_RING,
            )?;
        }
        Ok(f)
    }

    fn epoll_ctl(&self, op: i32, fd: RawFd, events: u32, token: u64) -> anyhow::Result<()> {
        let Some(ep) = &self.epoll else { return Ok(()) };
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: ep and fd are open descriptors; ev lives across the call.
        if unsafe { libc::epoll_ctl(ep.as_raw_fd(), op, fd, &mut ev) } < 0 {
            return Err(std::io::Error::last_os_error()).context("epoll_ctl");
        }
        Ok(())
    }

    /// Queue one SQE, submitting first if the ring is full (it holds every
    /// request of a full queue, so that is only ever a stale poll or two).
    fn push(&mut self, sqe: &squeue::Entry) -> anyhow::Result<()> {
        let Some(ring) = &mut self.ring else {
            bail!("no ring")
        };
        // SAFETY: every buffer an SQE names (guest pages, held by `mem` until
        // `drain`) outlives its request.
        if unsafe { ring.submission().push(sqe) }.is_err() {
            ring.submit().context("io_uring submit")?;
            // SAFETY: as above.
            unsafe { ring.submission().push(sqe) }.map_err(|_| anyhow::anyhow!("ring full"))?;
        }
        Ok(())
    }

    /// Wait for the socket (level: one message per readiness).
    pub fn arm_socket(&mut self, fd: RawFd) -> anyhow::Result<()> {
        if self.sock_armed {
            return Ok(());
        }
        if self.epoll.is_some() {
            self.epoll_ctl(libc::EPOLL_CTL_ADD, fd, libc::EPOLLIN as u32, EV_SOCK)?;
        } else {
            let e = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
                .build()
                .user_data(TAG_SOCK);
            self.push(&e)?;
        }
        self.sock_armed = true;
        Ok(())
    }

    /// Follow what a message changed: wait on a new kick eventfd instead of
    /// the old one, and run the queue if it can run (the guest may have
    /// queued and kicked before the ring was enabled).
    pub fn after_message(&mut self) -> anyhow::Result<()> {
        if self.kick_changed {
            if let Some((k, gen)) = self.armed_kick.take() {
                if self.epoll.is_some() {
                    self.epoll_ctl(libc::EPOLL_CTL_DEL, k.as_raw_fd(), 0, EV_KICK)?;
                } else {
                    self.push(&opcode::PollRemove::new(TAG_KICK | gen).build())?;
                }
            }
            if let Some(k) = &self.kick {
                let k = k.try_clone().context("dup kick")?;
                self.kick_gen += 1;
                self.arm_kick(k.as_raw_fd())?;
                self.armed_kick = Some((k, self.kick_gen));
            }
        }
        // After any message (messages are rare): a kick that came while the
        // ring was not yet enabled was consumed by the edge and must not
        // be lost.
        if self.running() {
            self.work(true, self.queue.next_used())?;
        }
        self.kick_changed = false;
        Ok(())
    }

    fn arm_kick(&mut self, fd: RawFd) -> anyhow::Result<()> {
        if self.epoll.is_some() {
            let ev = (libc::EPOLLIN | libc::EPOLLET) as u32;
            self.epoll_ctl(libc::EPOLL_CTL_ADD, fd, ev, EV_KICK)
        } else {
            let e = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
                .multi(true)
                .build()
                .user_data(TAG_KICK | self.kick_gen);
            self.push(&e)
        }
    }

    fn running(&self) -> bool {
        self.kick.is_some() && self.enabled && self.mem.is_some() && self.queue.ready()
    }

    /// Sleep until something happens, then do it: reap the file's
    /// completions, take the guest's new requests, call the guest once.
    /// True when a protocol message waits on the socket.
    pub fn wait_and_work(&mut self) -> anyhow::Result<bool> {
        let (mut kicked, mut message, mut reap) = (false, false, false);
        let used_before = self.queue.next_used();
        if let Some(ep) = &self.epoll {
            let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 4];
            // SAFETY: evs is a live array of 4 events.
            let n = unsafe { libc::epoll_wait(ep.as_raw_fd(), evs.as_mut_ptr(), 4, -1) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e).context("epoll_wait");
                }
                // The ring's task_work (a completion) interrupts the wait.
                reap = true;
            }
            for ev in &evs[..usize::try_from(n).unwrap_or(0)] {
                match ev.u64 {
                    EV_SOCK => message = true,
                    EV_KICK => kicked = true,
                    _ => reap = true,
                }
            }
        } else if let Some(ring) = &self.ring {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) => return Err(e).context("io_uring_enter"),
            }
            reap = true;
        }
        if reap {
            let (k, m) = self.reap()?;
            kicked |= k;
            message |= m;
        }
        if self.running() {
            self.work(kicked, used_before)?;
        }
        Ok(message)
    }

    /// Take every completion in the ring: the file's requests go to the
    /// used ring, a kick's poll says the guest kicked, the socket's that a
    /// message waits. A multishot kick poll the kernel ended (no `MORE`
    /// flag) is re-armed and counted as a kick, so none is lost.
    fn reap(&mut self) -> anyhow::Result<(bool, bool)> {
        let (mut kicked, mut message, mut rearm) = (false, false, false);
        let Some(ring) = &mut self.ring else {
            return Ok((false, false));
        };
        for cqe in ring.completion() {
            let data = cqe.user_data();

            match data & TAG_MASK {
                TAG_IO => {
                    let head = (data & 0xffff) as u16;
                    let slot = self.slots[head as usize];
                    self.inflight = self.inflight.saturating_sub(1);
                    let ok = u32::try_from(cqe.result()).is_ok_and(|n| n == slot.len);
                    if let Some(mem) = &self.mem {
                        let st = if ok {
                            VIRTIO_BLK_S_OK
                        } else {
                            VIRTIO_BLK_S_IOERR
                        } as u8;
                        let len = if ok { slot.used_len } else { 1 };
                        if mem.write_obj(st, GuestAddress(slot.status)).is_err()
                            || self.queue.add_used(mem, head, len).is_err()
                        {
                            tracing::warn!("completion of head {head}: guest memory gone");
                        }
                    }
                }
                TAG_KICK if data & !TAG_MASK == self.kick_gen => {
                    kicked = true;
                    rearm |= !cqueue::more(cqe.flags());
                }
                TAG_SOCK => {
                    message = true;
                    self.sock_armed = false;
                }
                _ => {} // a removed kick poll's last word, or a PollRemove's
            }
        }
        if rearm {
            if let Some((k, _)) = &self.armed_kick {
                let fd = k.as_raw_fd();
                self.arm_kick(fd)?;
            }
        }
        Ok((kicked, message))
    }

    /// Take the new requests (after a kick), submit the file's, and call
    /// the guest if its `used_event` asks for the used entries added since
    /// `used_before` (completions reaped and requests answered at once).
    fn work(&mut self, kicked: bool, used_before: u16) -> anyhow::Result<()> {
        if kicked {
            self.take_requests()?;
        }
        if self.inflight > 0 && self.epoll.is_some() {
            if let Some(ring) = &self.ring {
                ring.submit().context("io_uring submit")?;
            }
        }
        let Some(mem) = &self.mem else { return Ok(()) };
        let added = self.queue.next_used() != used_before;
        if added && self.queue.needs_notification(mem).context("used_event")? {
            if let Some(call) = &mut self.call {
                call.write_all(&1u64.to_ne_bytes())
                    .context("call eventfd")?;
            }
        }
        Ok(())
    }

    /// Pop every available chain, then re-enable the kick (`avail_event`)
    /// and look again: a request queued between the last pop and the
    /// re-enable would otherwise wait for a kick the guest will not send.
    fn take_requests(&mut self) -> anyhow::Result<()> {
        loop {
            while let Some(chain) = {
                let Some(mem) = &self.mem else { return Ok(()) };
                self.queue.pop_descriptor_chain(mem)
            } {
                let head = chain.head_index();
                let (hdr, data, status, n) = split(chain);
                self.request(head, hdr, data, status, n)?;
            }
            let Some(mem) = &self.mem else { return Ok(()) };
            if !self.queue.enable_notification(mem).context("avail_event")? {
                return Ok(());
            }
        }
    }

    /// One request: header, at most one data descriptor, a status byte.
    fn request(
        &mut self,
        head: u16,
        hdr: Option<Descriptor>,
        data: Option<Descriptor>,
        status: Option<Descriptor>,
        n: usize,
    ) -> anyhow::Result<()> {
        let Some(mem) = &self.mem else { return Ok(()) };
        let (Some(hdr), Some(status)) = (hdr, status) else {
            tracing::warn!("request {head}: no header or no status descriptor");
            return self.done(head, 0, None);
        };
        if !status.is_write_only() || status.len() < 1 || hdr.len() < 16 || n > 3 {
            tracing::warn!("request {head}: malformed chain ({n} descriptors)");
            return self.done(head, 0, None);
        }
        let st = status.addr().0;
        let (Ok(kind), Ok(sector)) = (
            mem.read_obj::<u32>(hdr.addr()),
            mem.read_obj::<u64>(GuestAddress(hdr.addr().0.wrapping_add(8))),
        ) else {
            return self.done(head, 0, None);
        };
        let (read, write) = (kind == VIRTIO_BLK_T_IN, kind == VIRTIO_BLK_T_OUT);
        let Some(d) = data.filter(|_| read || write) else {
            return self.done(head, 1, Some((st, VIRTIO_BLK_S_UNSUPP as u8)));
        };
        let len = d.len();
        let off = sector.checked_mul(512);
        let in_disk = off
            .and_then(|o| o.checked_add(u64::from(len)))
            .is_some_and(|e| e <= self.size);
        let ptr = mem
            .get_slice(d.addr(), len as usize)
            .map(|s| s.ptr_guard_mut().as_ptr());
        let (Some(off), true, true, Ok(ptr)) = (
            off,
            in_disk,
            len % 512 == 0 && d.is_write_only() == read,
            ptr,
        ) else {
            return self.done(head, 1, Some((st, VIRTIO_BLK_S_IOERR as u8)));
        };
        let used_len = if read { len + 1 } else { 1 };
        if self.kind == Kind::Null {
            if read {
                // SAFETY: get_slice checked that [ptr, ptr + len) lies in one
                // mapped region of guest memory; the guest gave it to us to
                // fill (it does not read it until the used entry).
                unsafe { std::ptr::write_bytes(ptr, 0, len as usize) };
            }
            return self.done(head, used_len, Some((st, VIRTIO_BLK_S_OK as u8)));
        }
        self.slots[head as usize] = Slot {
            status: st,
            len,
            used_len,
        };
        let fd = types::Fd(self.file_fd);
        let sqe = if read {
            opcode::Read::new(fd, ptr, len).offset(off).build()
        } else {
            opcode::Write::new(fd, ptr, len).offset(off).build()
        };
        self.push(&sqe.user_data(TAG_IO | u64::from(head)))?;
        self.inflight += 1;
        Ok(())
    }

    /// Answer a request at once: its status byte, then its used entry.
    fn done(&mut self, head: u16, len: u32, status: Option<(u64, u8)>) -> anyhow::Result<()> {
        let Some(mem) = &self.mem else { return Ok(()) };
        if let Some((addr, st)) = status {
            if mem.write_obj(st, GuestAddress(addr)).is_err() {
                tracing::warn!("request {head}: status byte outside guest memory");
            }
        }
        self.queue.add_used(mem, head, len).context("used ring")
    }

    /// Finish every file request in flight (before guest memory goes or
    /// the ring is handed back to the VMM): their buffers are its pages.
    pub fn drain(&mut self) {
        while self.inflight > 0 {
            let Some(ring) = &self.ring else { return };
            if let Err(e) = ring.submit_and_wait(1) {
                if e.raw_os_error() != Some(libc::EINTR) {
                    tracing::warn!("draining the ring: {e}");
                    return;
                }
            }
            let ignored = self.reap();
            if let Err(e) = ignored {
                tracing::warn!("draining the ring: {e:#}");
                return;
            }
        }
    }
}

/// A chain's header, single data descriptor and status descriptor (the
/// last one), and how many descriptors it had, without allocating.
fn split<M>(
    chain: virtio_queue::DescriptorChain<M>,
) -> (
    Option<Descriptor>,
    Option<Descriptor>,
    Option<Descriptor>,
    usize,
)
where
    M: std::ops::Deref + Clone,
    M::Target: GuestMemory,
{
    let (mut hdr, mut mid, mut last, mut n) = (None, None, None, 0);
    for d in chain {
        n += 1;
        if hdr.is_none() {
            hdr = Some(d);
        } else {
            if last.is_some() {
                mid = last;
            }
            last = Some(d);
        }
        if n > 3 {
            break;
        }
    }
    (hdr, mid, last, n)
}
