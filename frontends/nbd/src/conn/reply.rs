//! The reply side of a connection: the slots of requests in flight, the
//! writer lock every completer sends through, and the completion sink
//! ([`EndIo`]) that turns a finished bio into its NBD reply (simple, or
//! structured with OFFSET_DATA / OFFSET_HOLE chunks). Whoever completes a
//! bio writes its reply; see the parent module for the threading model.
//!
//! Replies go into the connection's output queue ([`Queue`], `outq.rs`):
//! headers and short reads as bytes the queue owns, a larger READ's data
//! as a reference to its slot's buffer, which the device filled, so that
//! the data is never copied again on its way to the socket and many
//! replies still leave in one `sendmsg`. Such a slot stays held (not
//! free, its bytes on the budget) until its data has been sent; the
//! sender then gives it back ([`Shared::give_back`]), on every path: a
//! flush, the reader's inline send, the writer thread, and a dead
//! connection's discard.
//!
//! A completer may be a thread every connection of a device shares (its
//! completion thread, a kblockd worker), so it never blocks on this
//! client's socket: it sends what the socket takes at once
//! (`MSG_DONTWAIT`), and leaves the rest to the connection's own writer
//! thread ([`writer`]), which sends with the connection's send timeout
//! and disconnects a client that takes nothing for that long. The
//! connection's reader is not shared, so what it cannot send at once it
//! sends itself, under the same timeout, without the writer lock and
//! without waking the writer thread (a hand-off per reply would cost a
//! wake-up on every busy connection, over TLS on every reply). While the
//! writer (thread or reader) holds part of the queue, replies are only
//! appended behind it, so the stream stays in order. Unsent bytes count
//! against the connection's budget (the reader stops reading requests
//! while it is spent): owned bytes as such, slot data through its held
//! slot.
//!
//! Lock order: a slot's meta, then the writer lock, then the accounting
//! lock (giving a slot back under the writer lock takes the accounting
//! lock; the reader never waits for the writer lock while it holds the
//! accounting one, and a slot's meta is only tried, never waited for,
//! by whoever gives the slot back).

use super::outq::{Held, Queue};
use super::{COPY_LIMIT, KEEP_BUF, WRITER_STACK};
use crate::proto::*;
use crate::sock::Sock;
use blkstack_core::comp_batch::{self, Unplug};
use blkstack_core::device::Extent;
use blkstack_core::{AlignedBuf, Bio, EndIo, Status};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;

/// Per-request state kept between submission and completion.
pub(super) struct SlotMeta {
    pub(super) handle: u64,
    pub(super) cmd: u16,
    pub(super) flags: u16,
    pub(super) offset: u64,
    pub(super) len: u32,
    /// Allocated on first use, kept between requests, freed when the
    /// connection goes idle (see the parent module).
    pub(super) buf: Option<AlignedBuf>,
    /// Holes and data of a READ's range when the device knows them, so the
    /// reply can use OFFSET_HOLE chunks (empty: all data).
    pub(super) extents: Vec<Extent>,
}

pub(super) struct Slot {
    pub(super) meta: Mutex<SlotMeta>,
    /// Bios still to complete for this request (TRIM/WRITE_ZEROES larger
    /// than the device's limit are split).
    pub(super) pending: AtomicU32,
    /// First failure among those bios (0 = none).
    pub(super) err: AtomicU8,
}

/// The writer side, behind the writer lock.
pub(super) struct Out {
    /// Reply bytes not yet sent, in stream order.
    pub(super) queue: Queue,
    /// The reader is working through buffered requests: append, don't send.
    pub(super) batching: bool,
    /// A send failed: the client is gone; stop writing, keep draining.
    pub(super) dead: bool,
    /// The writer thread owns the socket's sending side: everyone else
    /// appends to `queue` behind what it is sending.
    pub(super) writer_busy: bool,
    /// Owned bytes the writer (or a flush, see `sending`) took from
    /// `queue` and is still sending.
    pub(super) in_writer: usize,
    /// A [`Shared::flush`] is sending outside the writer lock: nobody
    /// else sends meanwhile, replies are appended behind and go in its
    /// next round.
    pub(super) sending: bool,
    /// `queue`'s alternate while a flush sends, so neither is reallocated.
    pub(super) spare: Queue,
    /// The connection is over: the writer sends what is left and ends.
    pub(super) quit: bool,
}

impl Out {
    /// Owned reply bytes produced and not yet sent (slot data is on the
    /// budget through its slot).
    pub(super) fn unsent(&self) -> usize {
        self.queue.owned() + self.in_writer
    }

    /// Someone (the writer thread, the reader sending inline, or a flush)
    /// owns the socket's sending side: append behind it, do not send.
    fn send_owned(&self) -> bool {
        self.writer_busy || self.sending
    }
}

/// Slot accounting, behind its own lock so that the reader can start new
/// requests while a completer is busy sending a large reply.
pub(super) struct Slots {
    pub(super) free: Vec<u16>,
    pub(super) inflight: usize,
    /// Data bytes of the requests in flight (see [`super::INFLIGHT_BYTES`]).
    pub(super) inflight_bytes: usize,
}

/// The transmission-phase state shared by the reader and completers.
pub(super) struct Shared {
    pub(super) sock: Arc<Sock>,
    pub(super) structured: bool,
    pub(super) slots: Box<[Slot]>,
    pub(super) out: Mutex<Out>,
    /// Set with `out.dead`, readable without the writer lock.
    pub(super) dead: AtomicBool,
    pub(super) accounting: Mutex<Slots>,
    /// Signalled when a slot is freed (reader waiting for a slot or for
    /// the drain at the end).
    pub(super) freed: Condvar,
    /// Early wake of a reader blocked for input (see [`IdleWake`]); `None`
    /// when polling is off.
    pub(super) idle_wake: Option<IdleWake>,
    /// Wakes the writer thread (with the writer lock).
    pub(super) writer_wake: Condvar,
    /// The writer thread, started the first time the socket does not
    /// take a reply at once (most connections never need one).
    pub(super) writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// This `Shared`, for the writer thread to own.
    pub(super) me: std::sync::Weak<Shared>,
    /// The connection's reader thread (see [`Shared::flush`]).
    pub(super) reader: std::thread::ThreadId,
    /// How long the writer waits for the client to take any byte.
    pub(super) send_timeout: std::time::Duration,
}

/// Lets a completer wake the blocked reader as soon as the connection's
/// last request in flight is answered. At queue depth 1 the client's next
/// request follows that reply within one client wake-up; a reader that
/// sleeps until the request arrives adds its own wake-up (an idle vCPU's,
/// long on a virtual machine) after the client's. Woken early, the reader wakes while
/// the client does and polls for the request instead. A plain eventfd:
/// the reader sleeps in `poll(2)` on it and the socket, so a wake that is
/// early for nothing costs one poll, never a lost request.
pub(super) struct IdleWake {
    pub(super) efd: OwnedFd,
    /// The reader is (about to be) asleep in that `poll`.
    pub(super) parked: AtomicBool,
}

impl IdleWake {
    pub(super) fn new() -> io::Result<IdleWake> {
        // SAFETY: plain syscall; the fd is checked and then owned.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(IdleWake {
            // SAFETY: a fresh fd nobody else owns.
            efd: unsafe { OwnedFd::from_raw_fd(fd) },
            parked: AtomicBool::new(false),
        })
    }

    pub(super) fn signal(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a valid u64. A full counter (EAGAIN)
        // means a wake is already pending.
        unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    pub(super) fn clear(&self) {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a valid u64; EAGAIN when not signalled.
        unsafe { libc::read(self.efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

impl Shared {
    /// Send what is buffered without blocking; what the socket does not
    /// take goes to the writer thread, or, on the connection's own
    /// reader, is sent there and then. Called with the writer lock held;
    /// the `sendmsg` itself runs without it (`Out::sending`): the send
    /// wakes the client, whose next request can wake the reader on this
    /// CPU at once, and a reader that then found the lock held would spin
    /// and yield until this thread ran again. Replies appended meanwhile
    /// leave in the next round of the loop.
    pub(super) fn flush(&self, out: &mut MutexGuard<'_, Out>) {
        while !out.queue.is_empty() && !out.send_owned() {
            if out.dead {
                return self.discard(out);
            }
            let spare = std::mem::take(&mut out.spare);
            let mut batch = std::mem::replace(&mut out.queue, spare);
            out.sending = true;
            out.in_writer = batch.owned();
            let sent =
                MutexGuard::unlocked(out, || batch.send_nowait(&self.sock, |h| self.give_back(h)));
            out.in_writer = 0;
            out.sending = false;
            match sent {
                _ if out.dead => {
                    self.discard_batch(&mut batch);
                    break;
                }
                Ok(true) => {
                    batch.reset_if_done();
                    out.spare = batch;
                }
                Ok(false) => {
                    // The rest goes first, then what was appended meanwhile.
                    batch.append(&mut out.queue);
                    out.spare = std::mem::replace(&mut out.queue, batch);
                    if self.on_reader() {
                        self.send_inline(out);
                    } else {
                        self.hand_to_writer(out);
                    }
                    return;
                }
                Err(_) => {
                    self.discard_batch(&mut batch);
                    return self.kill(out);
                }
            }
        }
        if out.quit {
            // The writer thread may be waiting for this flush to end.
            self.writer_wake.notify_one();
        }
    }

    /// Give back a held slot whose data has been sent (or will never be):
    /// its big buffer goes too, as at the end of any request. Only tries
    /// the slot's meta lock: the caller may hold the writer lock.
    pub(super) fn give_back(&self, h: Held) {
        let idx = h.idx as usize;
        if let Some(mut m) = self.slots[idx].meta.try_lock() {
            if m.buf.as_ref().is_some_and(|b| b.len() > KEEP_BUF) {
                m.buf = None;
            }
        }
        self.release(idx, h.bytes);
    }

    /// Drop a taken batch's unsent bytes (the client is gone), giving its
    /// held slots back.
    fn discard_batch(&self, batch: &mut Queue) {
        for h in batch.drain_held() {
            self.give_back(h);
        }
        batch.reset_if_done();
    }

    /// Drop the queue's unsent bytes (the client is gone).
    fn discard(&self, out: &mut Out) {
        self.discard_batch(&mut out.queue);
    }

    /// Whether the caller is the connection's reader: a thread of this
    /// connection alone, which may block in a send (bounded by the send
    /// timeout) where a completer shared by other clients must not.
    fn on_reader(&self) -> bool {
        std::thread::current().id() == self.reader
    }

    /// The reader sends what is buffered as the writer thread would:
    /// without the writer lock (completers append behind it meanwhile),
    /// blocking at most the send timeout without progress. Sparing the
    /// hand-off keeps a busy connection off the writer thread.
    fn send_inline(&self, out: &mut MutexGuard<'_, Out>) {
        out.writer_busy = true;
        while !out.dead && !out.queue.is_empty() {
            let spare = std::mem::take(&mut out.spare);
            let mut batch = std::mem::replace(&mut out.queue, spare);
            out.in_writer = batch.owned();
            let sent =
                MutexGuard::unlocked(out, || batch.send_all(&self.sock, |h| self.give_back(h)));
            out.in_writer = 0;
            if let Err(e) = sent {
                self.discard_batch(&mut batch);
                self.disconnect_slow(out, &e);
            }
            batch.reset_if_done();
            out.spare = batch;
        }
        out.writer_busy = false;
    }

    /// A blocking send failed (the send timeout passed without progress,
    /// or the client is gone): disconnect it.
    fn disconnect_slow(&self, out: &mut Out, e: &io::Error) {
        if out.dead {
            return;
        }
        tracing::warn!(
            error = %e,
            send_timeout_s = self.send_timeout.as_secs(),
            "nbd: client takes no replies (or is gone); disconnecting it"
        );
        self.kill(out);
    }

    fn hand_to_writer(&self, out: &mut Out) {
        let mut w = self.writer.lock();
        if w.is_none() {
            let Some(me) = self.me.upgrade() else {
                return self.kill(out);
            };
            let spawned = std::thread::Builder::new()
                .name("nbd-writer".into())
                .stack_size(WRITER_STACK)
                .spawn(move || writer(&me));
            match spawned {
                Ok(t) => *w = Some(t),
                Err(e) => {
                    tracing::warn!(error = %e, "nbd: cannot start a writer thread; disconnecting the client");
                    return self.kill(out);
                }
            }
        }
        drop(w);
        out.writer_busy = true;
        self.writer_wake.notify_one();
    }

    /// The connection is over: let the writer send what is left, then
    /// wait for it to end.
    pub(super) fn stop_writer(&self) {
        let mut out = self.out.lock();
        out.quit = true;
        self.writer_wake.notify_one();
        drop(out);
        if let Some(t) = self.writer.lock().take() {
            let _ = t.join();
        }
    }

    pub(super) fn kill(&self, out: &mut Out) {
        out.dead = true;
        self.discard(out);
        self.dead.store(true, Ordering::Release);
        // Unblock the reader too: nobody is listening any more.
        self.sock.shutdown(std::net::Shutdown::Both);
        // A reader waiting for room in the budget must see it.
        self.writer_wake.notify_one();
    }

    /// Wake a reader waiting for the budget (or a slot) to free up. Takes
    /// the accounting lock: the reader checks under it before it sleeps.
    pub(super) fn notify_room(&self) {
        drop(self.accounting.lock());
        self.freed.notify_all();
    }

    /// Encode a reply with no payload (any command but a successful READ).
    pub(super) fn push_status(&self, out: &mut Out, handle: u64, error: u32, msg: &str) {
        let structured = self.structured;
        out.queue.push_owned(|b| {
            if error != 0 && structured {
                encode_error_chunk(b, handle, error, msg);
            } else {
                encode_simple_reply(b, error, handle);
            }
        });
    }

    pub(super) fn set_batching(&self, on: bool) {
        let mut out = self.out.lock();
        out.batching = on;
        if !on {
            self.flush(&mut out);
        }
    }

    /// Give back a slot (its request is answered, or never reached the
    /// device).
    pub(super) fn release(&self, idx: usize, bytes: usize) {
        let mut a = self.accounting.lock();
        a.free.push(idx as u16);
        a.inflight -= 1;
        a.inflight_bytes -= bytes;
        let idle = a.inflight == 0;
        drop(a);
        self.freed.notify_one();
        if let Some(w) = &self.idle_wake {
            if idle && w.parked.load(Ordering::SeqCst) {
                w.signal();
            }
        }
    }

    /// On a thread completing a batch of bios (`comp_batch`), put the
    /// send off until the batch ends, so that its replies leave in one
    /// `sendmsg`; `false` when the caller must flush now.
    fn defer_flush(&self) -> bool {
        comp_batch::defer(self as *const Shared as usize, || {
            self.me.upgrade().map(|me| me as Arc<dyn Unplug>)
        })
    }

    pub(super) fn reply_now(&self, handle: u64, error: u32, msg: &str) {
        let mut out = self.out.lock();
        self.push_status(&mut out, handle, error, msg);
        if !out.batching {
            self.flush(&mut out);
        }
    }

    /// Write the reply of a finished READ, in slot `idx`. Writer lock
    /// held. Data larger than [`COPY_LIMIT`] is not copied: the queue
    /// refers to the slot's buffer and holds the slot (`true`: the caller
    /// must not give it back, the sender will).
    pub(super) fn push_read(&self, out: &mut Out, m: &SlotMeta, idx: usize) -> bool {
        let data = match &m.buf {
            Some(b) => &b.as_slice()[..m.len as usize],
            None => &[][..],
        };
        let zero_copy = data.len() > COPY_LIMIT && !out.dead;
        let q = &mut out.queue;
        let mut referenced = false;
        let mut put = |q: &mut Queue, d: &[u8]| {
            if zero_copy {
                // SAFETY: `d` lies in slot `idx`'s buffer, which nobody
                // writes or frees until the slot is given back: the slot
                // is not free (no new request can take it), `trim` runs
                // only with nothing in flight, and `end_io` keeps the
                // buffer when the queue holds the slot (`hold` below).
                unsafe { q.push_slot(d) };
                referenced = true;
            } else {
                q.push_owned(|b| b.extend_from_slice(d));
            }
        };
        let (h, off, len) = (m.handle, m.offset, m.len);
        if !self.structured {
            q.push_owned(|b| encode_simple_reply(b, 0, h));
            put(q, data);
        } else if m.extents.is_empty() {
            q.push_owned(|b| encode_data_chunk_header(b, REPLY_FLAG_DONE, h, off, len));
            put(q, data);
        } else {
            let last = m.extents.len() - 1;
            for (i, e) in m.extents.iter().enumerate() {
                let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
                let elen = e.len as u32;
                if e.hole {
                    q.push_owned(|b| encode_hole_chunk(b, flags, h, e.offset, elen));
                } else {
                    let rel = (e.offset - m.offset) as usize;
                    q.push_owned(|b| encode_data_chunk_header(b, flags, h, e.offset, elen));
                    put(q, &data[rel..rel + e.len as usize]);
                }
            }
        }
        if referenced {
            q.hold(idx as u16, data_bytes(m));
        }
        referenced
    }

    /// Answer a READ served outside the slots (an emulated unaligned one)
    /// with `data`, from `offset`: the data is copied into the queue (it
    /// lives in the caller's buffer).
    pub(super) fn reply_read_now(&self, handle: u64, offset: u64, data: &[u8]) {
        let mut out = self.out.lock();
        let structured = self.structured;
        if !out.dead {
            out.queue.push_owned(|b| {
                if structured {
                    let len = data.len() as u32;
                    encode_data_chunk_header(b, REPLY_FLAG_DONE, handle, offset, len);
                } else {
                    encode_simple_reply(b, 0, handle);
                }
                b.extend_from_slice(data);
            });
        }
        if !out.batching {
            self.flush(&mut out);
        }
    }
}

/// The body of a connection's writer thread: send what completers could
/// not, blocking at most the send timeout without progress, then
/// disconnect; wake the reader as room frees up; at the end, send what is
/// left and return.
pub(super) fn writer(shared: &Shared) {
    let mut batch = Queue::default();
    let mut out = shared.out.lock();
    loop {
        if out.dead || (out.queue.is_empty() && out.writer_busy) {
            shared.discard(&mut out);
            out.writer_busy = false;
            parking_lot::MutexGuard::unlocked(&mut out, || shared.notify_room());
        }
        if !out.writer_busy {
            if out.quit && (out.queue.is_empty() || out.dead) && !out.sending {
                return;
            }
            if out.quit && !out.sending {
                out.writer_busy = true;
                continue;
            }
            shared.writer_wake.wait(&mut out);
            continue;
        }
        std::mem::swap(&mut out.queue, &mut batch);
        out.in_writer = batch.owned();
        let sent = parking_lot::MutexGuard::unlocked(&mut out, || {
            batch.send_all(&shared.sock, |h| shared.give_back(h))
        });
        out.in_writer = 0;
        if let Err(e) = sent {
            shared.discard_batch(&mut batch);
            shared.disconnect_slow(&mut out, &e);
        }
        batch.reset_if_done();
        parking_lot::MutexGuard::unlocked(&mut out, || shared.notify_room());
    }
}

/// Data bytes a request holds in its slot's buffer.
pub(super) fn data_bytes(m: &SlotMeta) -> usize {
    if matches!(m.cmd, CMD_READ | CMD_WRITE) {
        m.len as usize
    } else {
        0
    }
}

/// The end of a completion batch that deferred this connection's send.
impl Unplug for Shared {
    fn unplug(&self) {
        let mut out = self.out.lock();
        // A batching reader sends everything when it stops batching.
        if !out.batching {
            self.flush(&mut out);
        }
    }
}

impl EndIo for Shared {
    fn end_io(&self, bio: Bio, status: Status, private: u64) {
        drop(bio);
        let idx = private as usize;
        let slot = &self.slots[idx];
        if !status.is_ok() {
            let _ =
                slot.err
                    .compare_exchange(0, status.as_u8(), Ordering::AcqRel, Ordering::Acquire);
        }
        if slot.pending.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let status = Status::from_u8(slot.err.swap(0, Ordering::AcqRel));
        let mut m = slot.meta.lock();
        let mut out = self.out.lock();
        let held = if status.is_ok() && m.cmd == CMD_READ {
            self.push_read(&mut out, &m, idx)
        } else {
            let err = if m.flags & CMD_FLAG_FAST_ZERO != 0 && status == Status::Again {
                ENOTSUP
            } else {
                nbd_error(status)
            };
            if err == 0 {
                self.push_status(&mut out, m.handle, 0, "");
            } else {
                // Which errno a client got for which request is what decides
                // its next step (a multipath above qemu fails the path on
                // EIO); at debug level, the server's log answers that.
                tracing::debug!(
                    cmd = m.cmd,
                    flags = m.flags,
                    offset = m.offset,
                    len = m.len,
                    errno = err,
                    %status,
                    "nbd: request failed"
                );
                self.push_status(&mut out, m.handle, err, &status.to_string());
            }
            false
        };
        let bytes = data_bytes(&m);
        if !held && m.buf.as_ref().is_some_and(|b| b.len() > KEEP_BUF) {
            m.buf = None;
        }
        // Before the flush: the sender gives back slots (this one too),
        // which tries their meta locks.
        drop(m);
        if !out.batching && !self.defer_flush() {
            self.flush(&mut out);
        }
        drop(out);
        if !held {
            self.release(idx, bytes);
        }
    }
}
