//! A connection's output queue: the reply bytes not yet on the socket, as
//! a list of segments sent with one `sendmsg` of many iovecs (what
//! `writev` batching is in nbdkit and qemu-nbd, without their copy).
//!
//! A segment is either bytes the queue owns (reply headers, chunk headers,
//! the data of short reads, copied) or a range of a request slot's data
//! buffer (a READ's data, never copied: the device wrote it there). A slot
//! whose data the queue refers to is *held*: it stays out of the free list
//! and its bytes stay on the connection's budget until every byte of its
//! data has left, then the sender gives it back ([`Queue::pop_sent`]).
//! That is how a READ reply leaves the server with the device's one copy
//! only, and yet many replies leave in one system call.
//!
//! Bounded: one segment per header run and per data chunk of a held slot
//! (at most [`super::MAX_INFLIGHT`] slots), owned bytes within the
//! connection's budget; a send takes at most [`IOV_CAP`] iovecs per call
//! and loops. Written by hand: the queue's life is tied to the slots and
//! the writer lock, which no crate models.

use crate::sock::Sock;
use std::collections::VecDeque;
use std::io::{self, IoSlice};

/// Iovecs per `sendmsg`: far below IOV_MAX (1024) yet enough for every
/// reply of a full queue of large reads; more segments take more calls.
pub(super) const IOV_CAP: usize = 256;
/// An emptied queue keeps at most this much capacity for its owned bytes:
/// a burst's memory is given back once it has been sent.
const KEEP_OUT: usize = 1 << 20;

#[derive(Clone, Copy)]
enum Seg {
    /// `len` bytes of `Queue::bytes` from `at`.
    Own { at: usize, len: usize },
    /// A held slot's data (see [`Queue::push_slot`]).
    Slot { ptr: *const u8, len: usize },
}

impl Seg {
    fn len(&self) -> usize {
        match *self {
            Seg::Own { len, .. } | Seg::Slot { len, .. } => len,
        }
    }
}

/// A slot the queue refers to, given back once its last segment is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Held {
    pub(super) idx: u16,
    /// Its bytes on the budget (`inflight_bytes`).
    pub(super) bytes: usize,
    /// Index of the segment after its last one.
    end: usize,
}

/// Reply bytes not yet sent, in stream order.
#[derive(Default)]
pub(super) struct Queue {
    bytes: Vec<u8>,
    segs: Vec<Seg>,
    /// First segment not (wholly) sent, and how much of it was.
    head: usize,
    head_off: usize,
    held: VecDeque<Held>,
    /// Owned bytes not yet sent (slot data counts on the budget through
    /// its slot instead).
    owned: usize,
}

// SAFETY: the raw pointers of `Seg::Slot` point into slot buffers that the
// connection's `Shared` owns and that stay allocated and unwritten while
// their slot is held (see `push_slot`); the queue is only used under the
// writer lock or by the one thread that took it from there.
unsafe impl Send for Queue {}

impl Queue {
    pub(super) fn is_empty(&self) -> bool {
        self.head == self.segs.len()
    }

    /// Owned bytes not yet sent.
    pub(super) fn owned(&self) -> usize {
        self.owned
    }

    /// Append owned bytes: whatever `f` appends to the vector (a reply
    /// header, a short read's data).
    pub(super) fn push_owned(&mut self, f: impl FnOnce(&mut Vec<u8>)) {
        let at = self.bytes.len();
        f(&mut self.bytes);
        let len = self.bytes.len() - at;
        if len == 0 {
            return;
        }
        self.owned += len;
        let unsent_tail = self.head < self.segs.len();
        if let Some(Seg::Own { at: a, len: l }) = self.segs.last_mut() {
            if *a + *l == at && unsent_tail {
                *l += len;
                return;
            }
        }
        self.segs.push(Seg::Own { at, len });
    }

    /// Append a reference to a slot's data (not copied).
    ///
    /// # Safety
    /// `data` must stay allocated and unchanged until the slot it lies in
    /// is given back by [`Queue::pop_sent`] or [`Queue::drain_held`]
    /// after a [`Queue::hold`] of that slot following this call.
    pub(super) unsafe fn push_slot(&mut self, data: &[u8]) {
        if !data.is_empty() {
            self.segs.push(Seg::Slot {
                ptr: data.as_ptr(),
                len: data.len(),
            });
        }
    }

    /// The slot `idx` (holding `bytes` of budget) backs the segments
    /// pushed so far: give it back once they are sent.
    pub(super) fn hold(&mut self, idx: u16, bytes: usize) {
        self.held.push_back(Held {
            idx,
            bytes,
            end: self.segs.len(),
        });
    }

    /// A held slot whose data has all been sent, to give back.
    pub(super) fn pop_sent(&mut self) -> Option<Held> {
        if self.held.front().is_some_and(|h| h.end <= self.head) {
            return self.held.pop_front();
        }
        None
    }

    /// Drop everything unsent (the client is gone) and return the slots
    /// it held, to give back.
    pub(super) fn drain_held(&mut self) -> impl Iterator<Item = Held> + '_ {
        self.head = self.segs.len();
        self.head_off = 0;
        self.owned = 0;
        self.held.drain(..)
    }

    /// Forget sent segments, keeping the allocations (up to `KEEP_OUT`).
    /// Only when everything is sent and given back.
    fn reset(&mut self) {
        debug_assert!(self.is_empty() && self.held.is_empty());
        self.segs.clear();
        self.bytes.clear();
        if self.bytes.capacity() > KEEP_OUT {
            self.bytes = Vec::new();
            self.segs = Vec::new();
        }
        self.head = 0;
        self.head_off = 0;
        self.owned = 0;
    }

    /// Reset when everything is sent and given back; whether it was.
    pub(super) fn reset_if_done(&mut self) -> bool {
        let done = self.is_empty() && self.held.is_empty();
        if done {
            self.reset();
        }
        done
    }

    /// Give back the allocations of an empty queue (idle connection).
    pub(super) fn shrink(&mut self) {
        if self.reset_if_done() {
            *self = Queue::default();
        }
    }

    /// Move what `other` holds unsent behind what this one does (after a
    /// partial send: the rest goes first, then what was queued meanwhile).
    /// Sent segments are dropped here, so a queue that never empties
    /// under a slow client does not grow beyond what is unsent.
    pub(super) fn append(&mut self, other: &mut Queue) {
        self.compact();
        for i in other.head..other.segs.len() {
            let skip = if i == other.head { other.head_off } else { 0 };
            match other.segs[i] {
                Seg::Own { at, len } => {
                    // Not merged into the last segment: `held` ends
                    // below count segments one for one.
                    let src = &other.bytes[at + skip..at + len];
                    let at = self.bytes.len();
                    self.bytes.extend_from_slice(src);
                    self.owned += src.len();
                    self.segs.push(Seg::Own { at, len: src.len() });
                }
                Seg::Slot { ptr, len } => self.segs.push(Seg::Slot {
                    // SAFETY: `skip < len`, within the same buffer.
                    ptr: unsafe { ptr.add(skip) },
                    len: len - skip,
                }),
            }
        }
        let base = self.segs.len() as isize - (other.segs.len() as isize);
        for h in other.held.drain(..) {
            self.held.push_back(Held {
                end: (h.end as isize + base).max(0) as usize,
                ..h
            });
        }
        other.head = other.segs.len();
        other.head_off = 0;
        other.owned = 0;
        other.reset();
    }

    /// Drop the segments and owned bytes already sent.
    fn compact(&mut self) {
        if self.head == 0 && self.head_off == 0 {
            return;
        }
        if self.head < self.segs.len() && self.head_off > 0 {
            match &mut self.segs[self.head] {
                Seg::Own { at, len } => {
                    *at += self.head_off;
                    *len -= self.head_off;
                }
                Seg::Slot { ptr, len } => {
                    // SAFETY: `head_off < len`, within the same buffer.
                    *ptr = unsafe { ptr.add(self.head_off) };
                    *len -= self.head_off;
                }
            }
        }
        self.segs.drain(..self.head);
        for h in self.held.iter_mut() {
            h.end = h.end.saturating_sub(self.head);
        }
        self.head = 0;
        self.head_off = 0;
        let first_own = self.segs.iter().find_map(|s| match *s {
            Seg::Own { at, .. } => Some(at),
            Seg::Slot { .. } => None,
        });
        let cut = first_own.unwrap_or(self.bytes.len());
        self.bytes.drain(..cut);
        for s in self.segs.iter_mut() {
            if let Seg::Own { at, .. } = s {
                *at -= cut;
            }
        }
    }

    /// The next unsent bytes as iovecs (at most [`IOV_CAP`]); how many.
    fn iovecs(&self, iov: &mut [IoSlice<'static>; IOV_CAP]) -> usize {
        let mut n = 0;
        for (i, s) in self.segs[self.head..].iter().take(IOV_CAP).enumerate() {
            let skip = if i == 0 { self.head_off } else { 0 };
            let (ptr, len) = match *s {
                Seg::Own { at, len } => (self.bytes[at..at + len].as_ptr(), len),
                Seg::Slot { ptr, len } => (ptr, len),
            };
            // SAFETY: `ptr..ptr + len` is either this queue's own bytes,
            // not touched until the iovecs are used up (`send` holds
            // `&mut self`), or a held slot's data, alive and unchanged
            // until the slot is given back (`push_slot`'s contract). The
            // 'static is a lie the caller never lets escape `send`.
            iov[n] = IoSlice::new(unsafe { std::slice::from_raw_parts(ptr.add(skip), len - skip) });
            n += 1;
        }
        n
    }

    /// Mark `n` more bytes as sent.
    fn consume(&mut self, mut n: usize) {
        while n > 0 && self.head < self.segs.len() {
            let seg = self.segs[self.head];
            let left = seg.len() - self.head_off;
            let take = left.min(n);
            if let Seg::Own { .. } = seg {
                self.owned -= take;
            }
            n -= take;
            if take == left {
                self.head += 1;
                self.head_off = 0;
            } else {
                self.head_off += take;
            }
        }
    }

    /// Send what the socket takes without blocking (`MSG_DONTWAIT`),
    /// giving back each slot as its data leaves; `Ok(true)` when all went.
    /// Over TLS nothing goes here (the records leave from a thread that
    /// may block).
    pub(super) fn send_nowait(
        &mut self,
        sock: &Sock,
        give_back: impl FnMut(Held),
    ) -> io::Result<bool> {
        self.send(sock, false, give_back)
    }

    /// Send everything, blocking at most the socket's send timeout
    /// without progress (then an error), giving back each slot as its
    /// data leaves.
    pub(super) fn send_all(&mut self, sock: &Sock, give_back: impl FnMut(Held)) -> io::Result<()> {
        self.send(sock, true, give_back).map(|_| ())
    }

    fn send(
        &mut self,
        sock: &Sock,
        block: bool,
        mut give_back: impl FnMut(Held),
    ) -> io::Result<bool> {
        if sock.is_tls() && !block {
            return Ok(self.is_empty());
        }
        let mut iov = [IoSlice::new(&[]); IOV_CAP];
        while !self.is_empty() {
            let k = self.iovecs(&mut iov);
            let run = &iov[..k];
            let sent = if sock.is_tls() {
                // rustls encrypts into records (a copy anyway): the whole
                // run at once, as one send of records.
                sock.send_all_iov(run)
                    .map(|()| run.iter().map(|s| s.len()).sum())
            } else {
                sock.send_iov(run, block)
            };
            let n = match sent {
                Ok(0) => Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => Ok(n),
                Err(e) if !block && e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => Err(e),
            }?;
            self.consume(n);
            while let Some(h) = self.pop_sent() {
                give_back(h);
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;

    /// A connected pair: our end as a [`Sock`] with a small send buffer
    /// (so sends stop short), the peer as a plain stream.
    fn pair() -> (Sock, UnixStream) {
        let (a, b) = UnixStream::pair().expect("socketpair");
        let sock = Sock::new(OwnedFd::from(a));
        let small: libc::c_int = 4096;
        // SAFETY: setsockopt on a valid fd with a valid c_int.
        let r = unsafe {
            libc::setsockopt(
                sock.raw(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&small as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(r, 0);
        (sock, b)
    }

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// Sends that stop short (in a header, in a slot's data) resume where
    /// they stopped, after replies queued meanwhile were appended; slots
    /// are given back in order and only once their last byte left; the
    /// peer receives the exact stream.
    #[test]
    fn partial_sends_resume_in_order_and_give_slots_back_once_sent() {
        let (sock, mut peer) = pair();
        let slot_a = bytes(100_000, 1);
        let slot_b = bytes(300_000, 2);
        let mut q = Queue::default();
        let mut want = Vec::new();
        q.push_owned(|b| b.extend_from_slice(b"header-a"));
        // SAFETY: the slot vectors outlive the queue's use of them.
        unsafe { q.push_slot(&slot_a) };
        q.hold(1, slot_a.len());
        want.extend_from_slice(b"header-a");
        want.extend_from_slice(&slot_a);
        let mut given = Vec::new();
        let done = q.send_nowait(&sock, |h| given.push(h.idx)).expect("send");
        assert!(!done, "a 4 KiB send buffer takes less than 100 KB at once");
        assert_eq!(q.owned(), 0, "the header went first");
        assert!(given.is_empty(), "slot 1 is given back only once all sent");
        // Queued meanwhile: a short reply, then a big one and a hole.
        let mut later = Queue::default();
        later.push_owned(|b| b.extend_from_slice(b"short"));
        later.push_owned(|b| b.extend_from_slice(b"header-b"));
        // SAFETY: as above.
        unsafe { later.push_slot(&slot_b[..1000]) };
        later.push_owned(|b| b.extend_from_slice(b"hole"));
        // SAFETY: as above.
        unsafe { later.push_slot(&slot_b[1000..]) };
        later.hold(2, slot_b.len());
        later.push_owned(|b| b.extend_from_slice(b"tail"));
        for p in [
            &b"shortheader-b"[..],
            &slot_b[..1000],
            b"hole",
            &slot_b[1000..],
            b"tail",
        ] {
            want.extend_from_slice(p);
        }
        q.append(&mut later);
        assert!(later.is_empty());
        assert_eq!(q.owned(), 5 + 8 + 4 + 4);
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; want.len()];
            peer.read_exact(&mut got).expect("peer read");
            assert!(got == want, "the stream differs from what was queued");
        });
        q.send_all(&sock, |h| given.push(h.idx)).expect("send all");
        assert_eq!(given, [1, 2]);
        assert!(q.reset_if_done());
        reader.join().expect("peer");
    }

    /// A dead connection: what is unsent is dropped and every held slot
    /// returned, once.
    #[test]
    fn a_discarded_queue_returns_every_held_slot() {
        let data = bytes(10_000, 3);
        let mut q = Queue::default();
        for i in 0..3u16 {
            q.push_owned(|b| b.extend_from_slice(b"hdr"));
            // SAFETY: `data` outlives the queue.
            unsafe { q.push_slot(&data) };
            q.hold(i, data.len());
        }
        let held: Vec<u16> = q.drain_held().map(|h| h.idx).collect();
        assert_eq!(held, [0, 1, 2]);
        assert!(q.reset_if_done());
        assert_eq!(q.owned(), 0);
    }

    /// More segments than one `sendmsg` takes go in several calls.
    #[test]
    fn more_segments_than_iov_cap_all_leave() {
        let (a, mut peer) = UnixStream::pair().expect("socketpair");
        let sock = Sock::new(OwnedFd::from(a));
        let data = bytes(6 * IOV_CAP + 1, 4);
        let mut q = Queue::default();
        for (i, c) in data.chunks(3).enumerate() {
            if i % 2 == 0 {
                // SAFETY: `data` outlives the queue.
                unsafe { q.push_slot(c) };
            } else {
                q.push_owned(|b| b.extend_from_slice(c));
            }
        }
        q.send_all(&sock, |_| {}).expect("send");
        let mut got = vec![0u8; data.len()];
        peer.read_exact(&mut got).expect("read");
        assert_eq!(got, data);
    }
}
