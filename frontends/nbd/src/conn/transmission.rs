//! The transmission phase of one connection: the reader parses requests
//! from its receive buffer, checks them against the negotiated flags and
//! the device, and submits bios straight into the export's device (see the
//! parent module for the threading model). Replies are written by whoever
//! completes the bio ([`super::reply`]).

use super::claim::Claim;
use super::inbuf::InBuf;
use super::reply::{Shared, SlotMeta, Slots};
use super::{BASE_ALLOCATION_ID, BUDGET, MAX_DESCRIPTORS};
use crate::export::Export;
use crate::proto::*;
use blkstack_core::clock::now_ns;
use blkstack_core::device::Extent;
use blkstack_core::timing::spin::{self, SpinPolicy};
use blkstack_core::{AlignedBuf, Bio, BioFlags, EndIo, IoBuf, Op};
use parking_lot::MutexGuard;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// How often a reader waiting for room in its budget looks again even if
/// nobody woke it.
const ROOM_RECHECK: std::time::Duration = std::time::Duration::from_millis(100);

/// Read a WRITE's payload into `dst`, from the receive buffer and then
/// straight from the socket (no second copy for large writes).
pub(super) fn read_payload(inb: &mut InBuf, shared: &Shared, dst: &mut [u8]) -> io::Result<()> {
    let n = inb.available().min(dst.len());
    dst[..n].copy_from_slice(&inb.buf[inb.start..inb.start + n]);
    inb.start += n;
    let mut rest = &mut dst[n..];
    if !rest.is_empty() {
        shared.set_batching(false);
    }
    while !rest.is_empty() {
        // The socket's idle timeout may fire mid-payload (a slow client):
        // that is not an error, keep waiting for the data.
        match shared.sock.recv(rest) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => rest = &mut rest[k..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The slot's data buffer, allocated (or grown) to hold `len` bytes.
fn slot_buf(m: &mut SlotMeta, len: usize) -> &mut AlignedBuf {
    if m.buf.as_ref().is_some_and(|b| b.len() < len) {
        m.buf = None;
    }
    m.buf
        .get_or_insert_with(|| AlignedBuf::new(len.next_power_of_two()))
}

pub(super) struct Transmission<'a> {
    pub(super) shared: Arc<Shared>,
    /// The same `Shared`, as the completion sink every bio carries.
    pub(super) owner: Arc<dyn EndIo>,
    pub(super) export: &'a Export,
    pub(super) inb: InBuf,
    pub(super) base_allocation: bool,
    /// The client never learnt the block sizes (NBD_OPT_EXPORT_NAME):
    /// unaligned requests are served, not refused (`unaligned.rs`).
    pub(super) any_alignment: bool,
    pub(super) lbs: u64,
    pub(super) max_request: u32,
    pub(super) size: u64,
    pub(super) features: blkstack_core::Features,
    /// Polls right after the reader blocked, when input is due; when
    /// adaptive, every poll of a wait (the window is sized from whole
    /// waits).
    pub(super) spin: SpinPolicy,
    /// Fixed bound: polls after an [`IdleWake`], kept apart because at a
    /// high device latency the first kind always misses while this one
    /// pays. Unused when adaptive.
    pub(super) wake_spin: SpinPolicy,
    /// Requests read since the reader last waited for input.
    pub(super) round: u32,
    /// Idle this long with nothing in flight, the connection frees its
    /// buffers ([`Transmission::trim`]).
    pub(super) idle_trim: std::time::Duration,
    /// Buffers were freed and the socket's idle timeout is off until the
    /// next request arrives.
    pub(super) trimmed: bool,
    /// The claim on the device's completions the reader reaps while it
    /// waits for input.
    pub(super) claim: Claim,
}

/// A request refused before it reaches the device.
pub(super) struct Refusal(u32, &'static str);

impl Transmission<'_> {
    fn set_batching(&self, on: bool) {
        self.shared.set_batching(on);
    }

    /// Block for more input, sending buffered replies first. An adaptive
    /// poll learns from how long the whole wait took, from here (replies
    /// sent) to input: the gap a poll would have had to cover, and the
    /// requests read since the last wait (see [`SpinPolicy::record_wait`]:
    /// a pipelining client is not polled for). The rest of a message
    /// already begun comes at once and teaches nothing.
    fn fill(&mut self) -> io::Result<bool> {
        self.set_batching(false);
        let learn = self.spin.is_adaptive() && self.inb.available() == 0;
        let start = learn.then(now_ns);
        let more = match self.poll(false)? {
            Some(more) => more,
            None => self.wait_input()?,
        };
        if let Some(start) = start {
            let round = std::mem::take(&mut self.round);
            self.spin.record_wait(now_ns().saturating_sub(start), round);
        }
        if more {
            self.set_batching(true);
        }
        Ok(more)
    }

    /// Block until input arrives. While requests are in flight, sleep on
    /// the socket, the [`IdleWake`] and the device's claim together
    /// ([`super::claim`]), completing what the claim has ready on this
    /// thread; when the last of them is answered first, poll for the
    /// client's next request.
    fn wait_input(&mut self) -> io::Result<bool> {
        let shared = self.shared.clone();
        // A shut adaptive window would poll nothing after the wake: sleep
        // on the socket alone, and completers send no wake.
        let wake = !self.spin.is_adaptive() || self.spin.window_ns() > 0;
        let idle = shared.idle_wake.as_ref().filter(|_| wake);
        let mut waited = false;
        loop {
            let claim = self.claim.fd();
            if idle.is_none() && claim.is_none() {
                break;
            }
            if let Some(w) = idle {
                w.parked.store(true, Ordering::SeqCst);
            }
            // Checked after `parked` is set: a completion that empties the
            // connection from here on sees it and signals.
            if shared.accounting.lock().inflight == 0 {
                if let Some(w) = idle {
                    w.parked.store(false, Ordering::SeqCst);
                }
                break;
            }
            let efd = idle.map_or(-1, |w| w.efd.as_raw_fd());
            let [input, woken, ready] = shared.sock.wait_ready([efd, claim.unwrap_or(-1)])?;
            waited = true;
            if let Some(w) = idle {
                if woken {
                    w.clear();
                }
                w.parked.store(false, Ordering::SeqCst);
            }
            if input {
                return self.fill_or_trim();
            }
            if ready {
                // Replies leave in one send when the reap's batch ends.
                self.claim.reap();
            }
        }
        if waited && idle.is_some() {
            if let Some(more) = self.poll(true)? {
                return Ok(more);
            }
        }
        self.fill_or_trim()
    }

    /// Block for input; when none comes for the idle time (the socket's
    /// receive timeout) and nothing is in flight, free the connection's
    /// buffers and block without a timeout until the client speaks again.
    fn fill_or_trim(&mut self) -> io::Result<bool> {
        loop {
            match self.inb.fill(&self.shared.sock) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if self.shared.accounting.lock().inflight == 0 {
                        // An idle connection holds no claim: while one
                        // lives, the device's own threads only back
                        // claimants up, and other submitters would wait
                        // for that backstop (see `claim.rs`).
                        self.claim.hand_back();
                        self.trim();
                        self.shared.sock.set_recv_timeout(None)?;
                        self.trimmed = true;
                    }
                }
                Ok(more) => {
                    if self.trimmed {
                        self.shared.sock.set_recv_timeout(Some(self.idle_trim))?;
                        self.trimmed = false;
                    }
                    return Ok(more);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Give back every slot's data buffer, the receive buffer and the
    /// reply buffer: an idle connection keeps only its bookkeeping.
    fn trim(&mut self) {
        for slot in self.shared.slots.iter() {
            slot.meta.lock().buf = None;
        }
        self.inb.release_if_empty();
        let mut out = self.shared.out.lock();
        out.queue.shrink();
        if !out.sending {
            out.spare = Default::default();
        }
    }

    /// Busy-poll the socket for at most the bound [`SpinPolicy`] allows
    /// (see `blkstack_core::timing::spin` for why); `None` when the caller
    /// must block.
    fn poll(&mut self, after_wake: bool) -> io::Result<Option<bool>> {
        let policy = if after_wake && !self.spin.is_adaptive() {
            &mut self.wake_spin
        } else {
            &mut self.spin
        };
        let sock = &*self.shared.sock;
        let inb = &mut self.inb;
        spin::poll_for(policy, || inb.try_fill(sock))
    }

    /// Make sure `n` bytes are buffered; `Ok(false)` on a clean EOF before
    /// the first byte.
    fn need(&mut self, n: usize) -> io::Result<bool> {
        while self.inb.available() < n {
            if !self.fill()? {
                if self.inb.available() == 0 {
                    return Ok(false);
                }
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(true)
    }

    fn discard_payload(&mut self, mut len: usize) -> io::Result<()> {
        while len > 0 {
            if self.inb.available() == 0 && !self.fill()? {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let n = self.inb.available().min(len);
            self.inb.start += n;
            len -= n;
        }
        Ok(())
    }

    /// Reply bytes not yet sent, read while holding the accounting lock
    /// `a` without ever waiting for the writer lock under it: a sender
    /// gives slots back under the writer lock, which takes `a`.
    fn unsent(&self, a: &mut MutexGuard<'_, Slots>) -> usize {
        if let Some(out) = self.shared.out.try_lock() {
            return out.unsent();
        }
        MutexGuard::unlocked(a, || self.shared.out.lock().unsent())
    }

    /// Wait while replies not yet sent and data in flight hold the whole
    /// budget: the client's backpressure, whatever it asks for next.
    fn wait_for_room(&self) -> io::Result<()> {
        if self.shared.out.lock().unsent() < BUDGET {
            return Ok(());
        }
        self.set_batching(false);
        // Waiting for completions, not input: the device's threads send
        // them (see `claim.rs`).
        self.claim.hand_back();
        let mut a = self.shared.accounting.lock();
        loop {
            if self.shared.dead.load(Ordering::Acquire) {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            if self.unsent(&mut a) + a.inflight_bytes < BUDGET {
                return Ok(());
            }
            // Bounded: unsent bytes that a completer's flush sends wake
            // nobody (only slots given back and the writer thread do).
            self.shared.freed.wait_for(&mut a, ROOM_RECHECK);
        }
    }

    pub(super) fn run(&mut self) -> io::Result<()> {
        loop {
            self.wait_for_room()?;
            if !self.need(Request::SIZE)? {
                return Ok(());
            }
            let hdr = self.inb.take::<{ Request::SIZE }>();
            self.round = self.round.saturating_add(1);
            let req = match Request::parse(&hdr) {
                Ok(r) => r,
                // Without a valid header the stream cannot be resynchronised:
                // hard disconnect, as the spec allows.
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
            };
            if req.cmd == CMD_DISC {
                return Ok(());
            }
            let payload = if req.cmd == CMD_WRITE {
                req.len as usize
            } else {
                0
            };
            if let Err(Refusal(err, msg)) = self.check(&req) {
                if payload > 0 {
                    self.discard_payload(payload)?;
                }
                self.shared.reply_now(req.handle, err, msg);
                continue;
            }
            if self.is_emulated_unaligned(&req) {
                // It waits for its own bios: the device's threads end them.
                self.claim.hand_back();
                self.serve_unaligned(&req)?;
                continue;
            }
            match req.cmd {
                CMD_CACHE => self.shared.reply_now(req.handle, 0, ""),
                CMD_BLOCK_STATUS => self.block_status(&req),
                _ => self.submit(&req)?,
            }
        }
    }

    /// Validate a request against the negotiated flags and the device.
    fn check(&self, r: &Request) -> Result<(), Refusal> {
        let allowed = CMD_FLAG_FUA
            | match r.cmd {
                CMD_READ if self.shared.structured => CMD_FLAG_DF,
                CMD_WRITE_ZEROES => CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
                CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
                _ => 0,
            };
        if r.flags & !allowed != 0 {
            return Err(Refusal(EINVAL, "command flag not valid for this command"));
        }
        let writes = matches!(r.cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
        match r.cmd {
            CMD_FLUSH => return Ok(()),
            CMD_READ | CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES | CMD_CACHE => {}
            CMD_BLOCK_STATUS if self.base_allocation => {}
            CMD_BLOCK_STATUS => {
                return Err(Refusal(EINVAL, "no metadata context was negotiated"));
            }
            _ => return Err(Refusal(EINVAL, "unknown command")),
        }
        if writes && self.export.read_only {
            return Err(Refusal(EPERM, "export is read-only"));
        }
        if r.len == 0 {
            return Err(Refusal(EINVAL, "zero-length request"));
        }
        if matches!(r.cmd, CMD_READ | CMD_WRITE) && r.len > self.max_request {
            // EINVAL, not EOVERFLOW: the protocol keeps EOVERFLOW for a
            // READ with DF whose reply would need fragmenting.
            return Err(Refusal(
                EINVAL,
                "request larger than the maximum block size",
            ));
        }
        let end = r.offset.checked_add(r.len as u64);
        if end.is_none_or(|e| e > self.size) {
            return Err(if writes {
                Refusal(ENOSPC, "request extends beyond the end of the export")
            } else {
                Refusal(EINVAL, "request extends beyond the end of the export")
            });
        }
        if matches!(r.cmd, CMD_CACHE | CMD_BLOCK_STATUS) {
            return Ok(());
        }
        if (!r.offset.is_multiple_of(self.lbs) || !(r.len as u64).is_multiple_of(self.lbs))
            && !self.is_emulated_unaligned(r)
        {
            return Err(Refusal(
                EINVAL,
                "request not aligned to the minimum block size",
            ));
        }
        match r.cmd {
            CMD_TRIM if !self.features.discard => {
                Err(Refusal(EINVAL, "trim is not supported by this export"))
            }
            CMD_WRITE_ZEROES if !self.features.write_zeroes => Err(Refusal(
                EINVAL,
                "write zeroes is not supported by this export",
            )),
            CMD_WRITE_ZEROES if r.flags & CMD_FLAG_FAST_ZERO != 0 && !self.features.fast_zero => {
                Err(Refusal(ENOTSUP, "zeroing is not fast on this export"))
            }
            _ => Ok(()),
        }
    }

    /// Take a free slot for a request moving `bytes` of data, waiting for
    /// completions and for the writer while all slots are busy or the
    /// budget is spent (a request alone may always go, whatever its size,
    /// once every earlier reply has been sent).
    fn alloc_slot(&self, bytes: usize) -> io::Result<usize> {
        let mut flushed = false;
        let mut a = self.shared.accounting.lock();
        loop {
            if self.shared.dead.load(Ordering::Acquire) {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            let unsent = self.unsent(&mut a);
            let fits =
                (a.inflight == 0 && unsent == 0) || a.inflight_bytes + unsent + bytes <= BUDGET;
            if fits {
                if let Some(i) = a.free.pop() {
                    a.inflight += 1;
                    a.inflight_bytes += bytes;
                    return Ok(i as usize);
                }
            }
            if !flushed {
                // About to wait: whatever was batched must go out first
                // (without holding the accounting lock across a send).
                drop(a);
                self.set_batching(false);
                // Waiting for completions, not input: the device's
                // threads send them (see `claim.rs`).
                self.claim.hand_back();
                flushed = true;
                a = self.shared.accounting.lock();
                continue;
            }
            // Bounded: unsent bytes that a completer's flush sends wake
            // nobody (only slots given back and the writer thread do).
            self.shared.freed.wait_for(&mut a, ROOM_RECHECK);
        }
    }

    fn submit(&mut self, r: &Request) -> io::Result<()> {
        let bytes = if matches!(r.cmd, CMD_READ | CMD_WRITE) {
            r.len as usize
        } else {
            0
        };
        let idx = self.alloc_slot(bytes)?;
        let shared = &*self.shared;
        let slot = &shared.slots[idx];
        let mut m = slot.meta.lock();
        m.handle = r.handle;
        m.cmd = r.cmd;
        m.flags = r.flags;
        m.offset = r.offset;
        m.len = r.len;
        m.extents.clear();
        let len = r.len as usize;
        let mut flags = BioFlags::NONE;
        if r.flags & CMD_FLAG_FUA != 0 {
            flags.insert(BioFlags::FUA);
        }
        let (op, buf) = match r.cmd {
            CMD_READ | CMD_WRITE => {
                if r.cmd == CMD_WRITE {
                    let dst = &mut slot_buf(&mut m, len).as_mut_slice()[..len];
                    if let Err(e) = read_payload(&mut self.inb, shared, dst) {
                        drop(m);
                        shared.release(idx, bytes);
                        return Err(e);
                    }
                } else if self.shared.structured
                    && self.features.knows_holes
                    && r.flags & CMD_FLAG_DF == 0
                {
                    self.plan_holes(&mut m);
                }
                // SAFETY: the slot (and with it `m.buf`) belongs to this
                // request until its completion frees it; `Shared`, which
                // owns the slots, outlives the bio through the `owner`
                // Arc the bio carries.
                let buf = unsafe { slot_buf(&mut m, len).io_buf(0, len) };
                let op = if r.cmd == CMD_READ {
                    Op::Read
                } else {
                    Op::Write
                };
                (op, buf)
            }
            CMD_FLUSH => (Op::Flush, IoBuf::empty()),
            CMD_TRIM => (Op::Discard, IoBuf::empty()),
            CMD_WRITE_ZEROES => {
                if r.flags & CMD_FLAG_NO_HOLE != 0 {
                    flags.insert(BioFlags::NOUNMAP);
                }
                if r.flags & CMD_FLAG_FAST_ZERO != 0 {
                    flags.insert(BioFlags::FAST_ZERO);
                }
                (Op::WriteZeroes, IoBuf::empty())
            }
            _ => unreachable!("check() admits only known commands"),
        };
        drop(m);
        let (offset, total) = if op == Op::Flush {
            (0, 0)
        } else {
            (r.offset, r.len as u64)
        };
        // Data ops are capped by max_request; trim and zeroing may be much
        // larger than the device takes at once, so they are split.
        let piece = if op.has_data() || op == Op::Flush {
            total.max(1)
        } else {
            self.max_request as u64
        };
        let count = total.div_ceil(piece).max(1);
        slot.pending.store(count as u32, Ordering::Release);
        let mut off = 0;
        for _ in 0..count {
            let l = piece.min(total - off);
            let b = if op.has_data() { buf } else { IoBuf::empty() };
            let bio =
                Bio::new(op, offset + off, l, b, self.owner.clone(), idx as u64).with_flags(flags);
            off += l;
            self.export.dev.submit(bio);
        }
        Ok(())
    }

    /// For a structured READ on a device that knows its holes: remember
    /// the extents, clipped to the request, if there is at least one hole.
    fn plan_holes(&self, m: &mut SlotMeta) {
        let (start, end) = (m.offset, m.offset + m.len as u64);
        let Some(ext) = self.export.dev.extents(start, end - start) else {
            return;
        };
        let mut pos = start;
        let mut any_hole = false;
        for e in ext {
            let s = e.offset.max(pos);
            let t = (e.offset.saturating_add(e.len)).min(end);
            if s != pos || t <= s {
                if t <= pos {
                    continue; // before the range, or already covered
                }
                m.extents.clear();
                return; // a gap or overlap: do not trust this map
            }
            // Chunks of the same kind next to each other are merged.
            match m.extents.last_mut() {
                Some(l) if l.hole == e.hole => l.len += t - s,
                _ => m.extents.push(Extent {
                    offset: s,
                    len: t - s,
                    hole: e.hole,
                }),
            }
            any_hole |= e.hole;
            pos = t;
            if pos == end {
                break;
            }
        }
        if pos != end || !any_hole {
            m.extents.clear();
        }
    }

    /// NBD_CMD_BLOCK_STATUS for base:allocation, answered synchronously
    /// from the device's extent map (all data if it has none).
    fn block_status(&self, r: &Request) {
        let (start, end) = (r.offset, r.offset + r.len as u64);
        let mut desc: Vec<(u32, u32)> = Vec::new();
        let mut pos = start;
        if self.features.knows_holes {
            if let Some(ext) = self.export.dev.extents(start, end - start) {
                for e in ext {
                    let s = e.offset.max(pos);
                    let t = (e.offset.saturating_add(e.len)).min(end);
                    if s != pos || t <= s {
                        if t <= pos {
                            continue;
                        }
                        break;
                    }
                    let st = if e.hole { STATE_HOLE | STATE_ZERO } else { 0 };
                    match desc.last_mut() {
                        Some(l) if l.1 == st => l.0 += (t - s) as u32,
                        _ => desc.push(((t - s) as u32, st)),
                    }
                    pos = t;
                    if pos == end || desc.len() >= MAX_DESCRIPTORS {
                        break;
                    }
                }
            }
        }
        if desc.is_empty() {
            desc.push((r.len, 0));
        }
        if r.flags & CMD_FLAG_REQ_ONE != 0 {
            desc.truncate(1);
        }
        let mut out = self.shared.out.lock();
        out.queue.push_owned(|b| {
            encode_block_status_chunk(b, REPLY_FLAG_DONE, r.handle, BASE_ALLOCATION_ID, &desc)
        });
        if !out.batching {
            self.shared.flush(&mut out);
        }
    }

    /// Wait until every submitted request has completed and its reply has
    /// been written (the spec: handle all outstanding requests before
    /// closing).
    pub(super) fn drain(&mut self) {
        self.set_batching(false);
        // Nobody reaps from here on: the device's threads end what is left.
        self.claim.hand_back();
        let mut a = self.shared.accounting.lock();
        while a.inflight > 0 {
            self.shared.freed.wait(&mut a);
        }
        drop(a);
        // A completer inside a completion batch may have left its replies
        // for the batch's end; they go now, before the connection closes.
        self.set_batching(false);
    }
}
