//! One NBD connection as one blk-mq hardware queue, as the kernel's nbd
//! client (`drivers/block/nbd.c`) maps `nbd->socks[hctx->queue_num]`:
//! requests of hardware queue `i` go out on connection `i`, and a
//! request's NBD cookie is its tag with the hardware queue index in the
//! high bits (`nbd_cmd_handle`: `blk_mq_unique_tag`), so the reply finds
//! its request without a lookup table.
//!
//! Each tag owns a preallocated [`Slot`] holding what is needed to send
//! the request again (a lost server's requests are resent on the new
//! connection) and to place the reply's data. Sending takes the
//! connection's send lock and writes header and payload with one
//! `writev`; replies are read by the connection's own thread
//! (`reconnect.rs` runs it), which ends requests through the engine's
//! completer. Nothing here is shared between connections.
//!
//! A bio larger than the server's maximum block size is sent as several
//! NBD requests (parts) under one tag, the part index in the cookie's
//! middle bits; a `PREFLUSH` write adds a FLUSH part, which covers every
//! write completed before it as the flag asks.
//!
//! A poll queue's connection has no reading thread: its submitters read
//! the replies themselves (`poll.rs`), as nvme-tcp's poll queues are
//! reaped by `nvme_tcp_poll` in the submitter's context.

use super::handshake::ExportInfo;
use super::proto::*;
use super::wire::{ReadSide, Sender, ThreadWake};
use blkstack_core::bio::IoBuf;
use blkstack_core::clock::now_ns;
use blkstack_core::{BioFlags, Op, Status};
use blkstack_mq::{QueueRq, Rq};
use parking_lot::Mutex;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// Zeroes sent as the payload of an emulated WRITE_ZEROES.
pub(super) static ZEROES: [u8; ZERO_CHUNK] = [0u8; ZERO_CHUNK];
const ZERO_CHUNK: usize = 64 * 1024;

/// Cookie layout: hardware queue (16 bits) | part (32 bits) | tag (16 bits).
pub fn cookie(hctx: u32, part: u32, tag: u32) -> u64 {
    ((hctx as u64) << 48) | ((part as u64) << 16) | (tag as u64 & 0xffff)
}

pub fn split_cookie(c: u64) -> (u32, u32, u32) {
    ((c >> 48) as u32, (c >> 16) as u32, (c & 0xffff) as u32)
}

/// The NBD error number a server answered, as a bio status.
pub fn status_of(error: u32) -> Status {
    match error {
        0 => Status::Ok,
        EPERM => Status::Permission,
        EINVAL => Status::Invalid,
        ENOSPC => Status::NoSpace,
        EOVERFLOW => Status::Overflow,
        ENOTSUP => Status::NotSupported,
        ENOMEM => Status::Resource,
        // The server is going away: another path (or the reconnected
        // server) may well succeed.
        ESHUTDOWN => Status::Transport,
        _ => Status::IoError,
    }
}

/// What the device learnt from the handshake that every connection needs.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    pub info: ExportInfo,
    /// Largest part, a multiple of the logical block size.
    pub max_part: u64,
}

/// One request's state, reused by every request that gets its tag.
#[derive(Clone, Copy)]
pub struct SlotData {
    pub active: bool,
    pub cmd: u16,
    pub flags: u16,
    pub offset: u64,
    pub len: u64,
    pub buf: IoBuf,
    /// Data parts, plus one FLUSH part for `PREFLUSH`.
    pub parts: u32,
    pub data_parts: u32,
    pub remaining: u32,
    pub status: Status,
    /// Connection generation it was last sent on (0: not yet).
    pub sent_gen: u64,
    pub queued_ns: u64,
    pub sent_ns: u64,
    /// WRITE_ZEROES emulated with WRITEs of zeroes.
    pub zero_fill: bool,
    /// Bytes of a READ the replies have covered (data or hole chunks,
    /// simple replies' payloads), checked when the last part ends.
    pub covered: u64,
    /// Connections that died while it was in flight on them without
    /// having answered anything since it was sent (see
    /// `reconnect::MAX_FAILED_SENDS`).
    pub failed_sends: u32,
}

impl SlotData {
    const IDLE: SlotData = SlotData {
        active: false,
        cmd: 0,
        flags: 0,
        offset: 0,
        len: 0,
        buf: IoBuf::empty(),
        parts: 0,
        data_parts: 0,
        remaining: 0,
        status: Status::Ok,
        sent_gen: 0,
        queued_ns: 0,
        sent_ns: 0,
        zero_fill: false,
        covered: 0,
        failed_sends: 0,
    };

    /// The byte range of data part `p`, relative to the request.
    pub fn part_range(&self, p: u32, max_part: u64) -> (u64, u64) {
        let at = p as u64 * max_part;
        (at, max_part.min(self.len - at))
    }
}

pub struct Slot(pub Mutex<SlotData>);

/// The sending side: the socket (None while disconnected) and its
/// generation, bumped by every reconnect.
pub struct TxState {
    pub sender: Option<Sender>,
    pub gen: u64,
}

/// Counters `status` shows.
#[derive(Default)]
pub struct ConnStats {
    pub up: AtomicBool,
    pub in_flight: AtomicU32,
    pub reconnects: AtomicU64,
    pub timeouts: AtomicU64,
    pub failed: AtomicU64,
    /// When the connection went down (ns; 0 while up).
    pub down_since: AtomicU64,
    /// When it first failed since it last made progress (ns; 0: never).
    /// A reconnect alone is no progress: only an answered request is, so
    /// the dead timeout runs from here across reconnects.
    pub failing_since: AtomicU64,
    /// When a request last ended with a reply from the server (ns).
    pub progress_ns: AtomicU64,
    /// The reconnect backoff to resume from while no progress is made
    /// (ms; 0: start from `reconnect_delay_ms`).
    pub backoff_ms: AtomicU64,
}

impl ConnStats {
    /// Failing since when (ns), if it has not made progress since.
    pub fn failing(&self) -> Option<u64> {
        let since = self.failing_since.load(Ordering::Relaxed);
        (since != 0 && self.progress_ns.load(Ordering::Relaxed) < since).then_some(since)
    }
}

pub struct Connection {
    pub index: u32,
    pub geo: Geometry,
    pub dead_timeout_ns: u64,
    pub slots: Box<[Slot]>,
    pub tx: Mutex<TxState>,
    pub stats: ConnStats,
    pub last_error: Mutex<Option<String>>,
    pub stop: AtomicBool,
    /// Held by whoever reads replies into request buffers: the
    /// connection's thread (see `reconnect::run`), or on a poll queue the
    /// polling submitter, which finds the socket's read side in it
    /// (`None` while disconnected; see `poll`).
    pub reader_lock: Mutex<Option<ReadSide>>,
    /// A poll queue (kernel `HCTX_TYPE_POLL`): only `POLLED` requests,
    /// whose replies their submitters read.
    pub polled: bool,
    /// The connection's thread, for a poller that finds the connection
    /// dead, or a sender that finds it full, to wake.
    pub wake: Arc<ThreadWake>,
}

/// What to send for a bio, or how to finish it at once.
fn command(geo: &Geometry, op: Op, flags: BioFlags) -> Result<(u16, u16, bool), Status> {
    let info = &geo.info;
    if op.is_write() && info.has(TFLAG_READ_ONLY) {
        return Err(Status::Permission);
    }
    let fua = if flags.contains(BioFlags::FUA) && info.has(TFLAG_SEND_FUA) {
        CMD_FLAG_FUA
    } else {
        0
    };
    Ok(match op {
        Op::Read => (CMD_READ, 0, false),
        Op::Write => (CMD_WRITE, fua, false),
        // The kernel's nbd client: a server without SEND_FLUSH has no
        // volatile cache to flush, so a flush has nothing to do.
        Op::Flush if !info.has(TFLAG_SEND_FLUSH) => return Err(Status::Ok),
        Op::Flush => (CMD_FLUSH, 0, false),
        Op::Discard if !info.has(TFLAG_SEND_TRIM) => return Err(Status::NotSupported),
        Op::Discard => (CMD_TRIM, fua, false),
        Op::WriteZeroes if info.has(TFLAG_SEND_WRITE_ZEROES) => {
            let mut f = fua;
            if flags.contains(BioFlags::NOUNMAP) {
                f |= CMD_FLAG_NO_HOLE;
            }
            if flags.contains(BioFlags::FAST_ZERO) {
                if !info.has(TFLAG_SEND_FAST_ZERO) {
                    return Err(Status::Again);
                }
                f |= CMD_FLAG_FAST_ZERO;
            }
            (CMD_WRITE_ZEROES, f, false)
        }
        // Not advertised: written as zeroes, unless the caller only wants
        // a zeroing that costs nothing.
        Op::WriteZeroes if flags.contains(BioFlags::FAST_ZERO) => return Err(Status::Again),
        Op::WriteZeroes => (CMD_WRITE, fua, true),
    })
}

impl Connection {
    /// The connection is lost: stop sending on it, count the requests it
    /// never answered, and let its thread reconnect.
    pub fn mark_down(&self, why: &str) {
        let mut tx = self.tx.lock();
        if let Some(s) = tx.sender.take() {
            s.shutdown();
        }
        let now = now_ns();
        let progress = self.stats.progress_ns.load(Ordering::Relaxed);
        if self.stats.failing().is_none() {
            self.stats.failing_since.store(now, Ordering::Relaxed);
            if progress > 0 {
                // It had recovered: the backoff starts over.
                self.stats.backoff_ms.store(0, Ordering::Relaxed);
            }
        }
        // Requests on this connection that it never answered anything after.
        for slot in self.slots.iter() {
            let mut d = slot.0.lock();
            if d.active && d.sent_gen == tx.gen && progress < d.sent_ns {
                d.failed_sends += 1;
            }
        }
        self.stats.up.store(false, Ordering::Relaxed);
        self.stats.down_since.store(now, Ordering::Relaxed);
        drop(tx);
        tracing::warn!(
            connection = self.index,
            reason = why,
            "nbd: connection lost, reconnecting"
        );
        self.set_error(why.to_string());
    }

    pub fn new(
        index: u32,
        geo: Geometry,
        depth: u32,
        dead_timeout_ns: u64,
        polled: bool,
    ) -> Connection {
        Connection {
            index,
            geo,
            dead_timeout_ns,
            slots: (0..depth)
                .map(|_| Slot(Mutex::new(SlotData::IDLE)))
                .collect(),
            tx: Mutex::new(TxState {
                sender: None,
                gen: 0,
            }),
            stats: ConnStats::default(),
            last_error: Mutex::new(None),
            stop: AtomicBool::new(false),
            reader_lock: Mutex::new(None),
            polled,
            wake: Arc::default(),
        }
    }

    /// Blk-mq `queue_rq`: fill the tag's slot and send it if connected;
    /// while disconnected the request waits in its slot for the
    /// reconnect (or the dead timeout).
    pub fn queue_rq(&self, rq: Rq<'_>) -> QueueRq {
        let bio = rq.bio;
        let (cmd, flags, zero_fill) = match command(&self.geo, bio.op, bio.flags) {
            Ok(c) => c,
            Err(st) => return QueueRq::Done(st),
        };
        let data_parts = if cmd == CMD_FLUSH {
            1
        } else {
            bio.len.div_ceil(self.chunk(zero_fill)).max(1) as u32
        };
        let preflush = bio.flags.contains(BioFlags::PREFLUSH)
            && cmd != CMD_FLUSH
            && self.geo.info.has(TFLAG_SEND_FLUSH);
        let parts = data_parts + preflush as u32;
        let Some(slot) = self.slots.get(rq.tag as usize) else {
            return QueueRq::Done(Status::Resource);
        };
        let mut tx = self.tx.lock();
        if tx.sender.is_none() && self.dead_timeout_ns == 0 {
            return QueueRq::Done(Status::IoError);
        }
        *slot.0.lock() = SlotData {
            active: true,
            cmd,
            flags,
            offset: bio.offset,
            len: bio.len,
            buf: bio.buf,
            parts,
            data_parts,
            remaining: parts,
            status: Status::Ok,
            sent_gen: 0,
            queued_ns: now_ns(),
            sent_ns: 0,
            zero_fill,
            covered: 0,
            failed_sends: 0,
        };
        self.stats.in_flight.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.send_slot(&mut tx, rq.tag) {
            // The reader sees the dead socket and reconnects; this request
            // is resent then.
            self.note_send_error(&mut tx, e);
        }
        QueueRq::Issued
    }

    /// Send every part of request `tag` on the current socket (if any
    /// and not sent on it yet). The slot's lock is let go before
    /// sending, so the reader can take replies to the first parts of a
    /// large request while later parts still go out.
    pub fn send_slot(&self, tx: &mut TxState, tag: u32) -> io::Result<()> {
        let r = self.send_parts(tx, tag);
        // Whatever stalled is sent (or failed): no more reading for it.
        // Only this sender (it holds the send lock) can have raised it.
        if self.polled && self.wake.send_stalled.load(Ordering::Acquire) {
            self.wake.send_stalled.store(false, Ordering::Release);
        }
        r
    }

    fn send_parts(&self, tx: &mut TxState, tag: u32) -> io::Result<()> {
        let Some(sender) = tx.sender.as_mut() else {
            return Ok(());
        };
        let d = {
            let mut d = self.slots[tag as usize].0.lock();
            if !d.active || d.sent_gen == tx.gen {
                return Ok(());
            }
            d.sent_gen = tx.gen;
            d.sent_ns = now_ns();
            d.remaining = d.parts;
            d.status = Status::Ok;
            d.covered = 0;
            *d
        };
        let chunk = self.chunk(d.zero_fill);
        for p in 0..d.parts {
            let handle = cookie(self.index, p, tag);
            if p == d.data_parts {
                let h = Request {
                    flags: 0,
                    cmd: CMD_FLUSH,
                    handle,
                    offset: 0,
                    len: 0,
                }
                .encode();
                sender.send(&h, &[])?;
                continue;
            }
            let (at, n) = if d.cmd == CMD_FLUSH {
                (0, 0)
            } else {
                d.part_range(p, chunk)
            };
            let h = Request {
                flags: d.flags,
                cmd: d.cmd,
                handle,
                offset: d.offset + at,
                len: n as u32,
            }
            .encode();
            let payload: &[u8] = if d.zero_fill {
                &ZEROES[..n as usize]
            } else if d.cmd == CMD_WRITE {
                &d.buf.as_slice()[at as usize..(at + n) as usize]
            } else {
                &[]
            };
            sender.send(&h, payload)?;
        }
        Ok(())
    }

    /// Install a new connection's sending half (a poll queue's raises
    /// the stall flag when the socket stays full).
    pub fn attach_sender(&self, tx: &mut TxState, mut sender: Sender) {
        if self.polled {
            if let Err(e) = sender.set_stall(self.wake.clone()) {
                tracing::warn!(connection = self.index, error = %e, "nbd: cannot set a send timeout");
            }
        }
        tx.sender = Some(sender);
    }

    /// A send failed: drop the socket (waking the reader, which
    /// reconnects).
    pub fn note_send_error(&self, tx: &mut TxState, e: io::Error) {
        if let Some(s) = tx.sender.take() {
            s.shutdown();
        }
        self.set_error(format!("send: {e}"));
    }

    pub fn set_error(&self, e: String) {
        *self.last_error.lock() = Some(e);
    }

    /// Size of a request's data parts (emulated zeroing sends the shared
    /// zero buffer, so its parts are no larger).
    pub fn chunk(&self, zero_fill: bool) -> u64 {
        if zero_fill {
            self.geo.max_part.min(ZERO_CHUNK as u64)
        } else {
            self.geo.max_part
        }
    }

    /// The oldest sent request's age, for the request timeout.
    pub fn oldest_sent_ns(&self, now: u64) -> u64 {
        let mut oldest = 0;
        for s in self.slots.iter() {
            let d = s.0.lock();
            if d.active && d.sent_gen != 0 {
                oldest = oldest.max(now.saturating_sub(d.sent_ns));
            }
        }
        oldest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookie_round_trip() {
        for (h, p, t) in [(0, 0, 0), (3, 7, 63), (255, 70_000, 4095)] {
            assert_eq!(split_cookie(cookie(h, p, t)), (h, p, t));
        }
    }

    #[test]
    fn server_errors_map_to_statuses() {
        assert_eq!(status_of(0), Status::Ok);
        assert_eq!(status_of(EPERM), Status::Permission);
        assert_eq!(status_of(EIO), Status::IoError);
        assert!(status_of(ESHUTDOWN).is_path_error());
        assert!(!status_of(ENOSPC).is_path_error());
    }

    fn geo(tflags: u16) -> Geometry {
        Geometry {
            info: ExportInfo {
                size: 1 << 20,
                tflags: TFLAG_HAS_FLAGS | tflags,
                min_block: 1,
                preferred_block: 4096,
                max_block: 1 << 16,
                structured: true,
                allocation_context: None,
            },
            max_part: 1 << 16,
        }
    }

    #[test]
    fn commands_follow_the_advertised_flags() {
        let none = geo(0);
        assert_eq!(command(&none, Op::Flush, BioFlags::NONE), Err(Status::Ok));
        assert_eq!(
            command(&none, Op::Discard, BioFlags::NONE),
            Err(Status::NotSupported)
        );
        assert_eq!(
            command(&none, Op::WriteZeroes, BioFlags::NONE),
            Ok((CMD_WRITE, 0, true))
        );
        assert_eq!(
            command(&none, Op::Write, BioFlags::FUA),
            Ok((CMD_WRITE, 0, false))
        );
        let all =
            geo(TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES);
        assert_eq!(
            command(&all, Op::Flush, BioFlags::NONE),
            Ok((CMD_FLUSH, 0, false))
        );
        assert_eq!(
            command(&all, Op::Write, BioFlags::FUA),
            Ok((CMD_WRITE, CMD_FLAG_FUA, false))
        );
        assert_eq!(
            command(&all, Op::WriteZeroes, BioFlags::NOUNMAP),
            Ok((CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, false))
        );
        let ro = geo(TFLAG_READ_ONLY);
        assert_eq!(
            command(&ro, Op::Write, BioFlags::NONE),
            Err(Status::Permission)
        );
        assert_eq!(
            command(&ro, Op::Read, BioFlags::NONE),
            Ok((CMD_READ, 0, false))
        );
    }
}
