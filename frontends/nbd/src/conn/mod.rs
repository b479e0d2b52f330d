//! One client connection: the fixed-newstyle handshake (`handshake.rs`),
//! then the transmission phase (`transmission.rs`, replies in `reply.rs`).
//!
//! Threading model (why it looks like this): every connection has exactly
//! one thread, its reader. The reader parses requests and submits bios
//! straight into the export's device — no queue or hand-off between
//! threads per I/O, because a futex wake across vCPUs can cost more than
//! the rest of an I/O on a virtual machine. Whoever
//! completes a bio writes its reply: the device's completion thread, or
//! the reader itself when the device completes inline. Replies go through
//! one per-connection writer lock (`Out`) into the connection's output
//! queue (`outq.rs`), which refers to a large READ's data in its slot
//! rather than copying it; while the reader is working
//! through requests that are already in its receive buffer it marks the
//! connection as "batching", and replies produced meanwhile are only
//! appended to the output queue, to leave in one `sendmsg` when the reader
//! is about to block. A completer that ends several bios in a row inside a
//! completion batch (`blkstack_core::comp_batch`: a delay worker's pass)
//! likewise sends their replies once, when its batch closes. Replies are
//! therefore sent in completion order, not
//! request order, as the protocol allows. No completer ever blocks on the
//! socket (it may be a thread every client of the device shares): what
//! the socket does not take at once goes to the connection's second
//! thread, its writer (`reply.rs`, started the first time it is needed),
//! which sends it under the send timeout and disconnects a client that
//! takes nothing for that long. The reader, this connection's own, sends
//! its overflow itself under the same timeout.
//!
//! Each request in flight owns a slot (its index is the bio's cookie, as a
//! blk-mq tag is a request's index): a reusable, page-aligned data buffer
//! and the few fields needed to write the reply; the slot of a READ
//! larger than [`COPY_LIMIT`] is freed when its reply's data has been
//! sent, not when the device completed it (the reply is sent from the
//! slot's buffer). The [`MAX_INFLIGHT`] slots
//! of a connection exist from the start, but a slot's buffer is allocated
//! when a request first needs it and kept for the next one; a connection
//! idle for [`Limits::idle_trim`] gives every buffer back, so an idle
//! client costs little memory. In steady state no I/O allocates in this
//! file (the one exception: a structured READ on a device that knows its holes asks for the device's extent map, a `Vec`, to answer
//! with OFFSET_HOLE chunks instead of zeroes). Slot accounting has its own
//! lock, apart from the writer lock, so the reader keeps starting requests
//! while a completer is busy sending a large reply. Before blocking for
//! input the reader may poll the socket for a bounded time, yielding the
//! CPU between polls, and only while such polls keep finding requests
//! (`blkstack_core::timing::spin`; with `--poll-us auto` the bound is a
//! window sized from the gaps between requests, as qemu's event loop
//! sizes its poll); a polling reader also asks the scheduler for a short
//! slice so that its wake-up is not queued behind a CPU-bound thread. A
//! reader that does not poll (the default) keeps the default slice: with
//! a short one, it preempted a client on its CPU at every request of a
//! burst, and read the burst one request per wake-up. While requests are
//! in flight it sleeps on the socket, an eventfd that whoever frees the
//! last of their slots signals (`IdleWake`), and, when the export's device
//! lets a submitter reap its completions (a `delay` table's held bios, a
//! `file` ring), that claim's descriptor, completing what is ready on its
//! own thread (`claim.rs`). A fixed poll without
//! those rules loses whenever the next request is slow to come, and costs
//! CPU per I/O. When every slot is busy, or the data of the requests in
//! flight (a READ's until its reply is sent) plus the other reply bytes
//! produced but not yet sent reach [`BUDGET`],
//! the reader stops reading: that is the connection's queue depth limit
//! and the client's backpressure (nbdkit and qemu-nbd stop reading a
//! client whose replies pile up the same way), and it bounds the memory
//! one client can make the server hold, whatever it sends.

mod claim;
mod handshake;
mod inbuf;
mod outq;
mod reply;
mod transmission;
mod unaligned;

pub use handshake::HandshakeError;

use crate::export::Export;
use crate::limits::{HandshakeTicket, Limits};
use crate::sock::Sock;
use crate::tls::TlsPolicy;
use blkstack_core::timing::spin::{PollSetting, SpinPolicy};
use inbuf::InBuf;
use outq::Queue;
use parking_lot::{Condvar, Mutex};
use reply::{IdleWake, Out, Shared, Slot, SlotMeta, Slots};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8};
use std::sync::Arc;
use std::time::Instant;
use transmission::Transmission;

/// Requests one connection may have in flight at once.
pub const MAX_INFLIGHT: usize = 256;
/// Largest option payload accepted during the handshake; anything larger is
/// a client misbehaving (real options are a few hundred bytes).
const MAX_OPTION_LEN: u32 = 1 << 20;
/// Options one connection may send before being cut off (a client looping
/// on NBD_OPT_LIST must not keep a thread for ever).
const MAX_OPTIONS: u32 = 10_000;
/// Reads up to this size are copied into the output queue and their slot
/// freed at once (an iovec and a held slot cost more than such a copy);
/// larger ones are sent straight from the slot's buffer (`outq.rs`).
const COPY_LIMIT: usize = 4 << 10;
const INBUF: usize = 256 << 10;
/// Data buffers larger than this are given back when their request
/// completes, so an idle connection keeps at most this much per slot.
const KEEP_BUF: usize = 256 << 10;
/// Bytes one connection may make the server hold: READ/WRITE data in
/// flight plus replies produced and not yet sent (256 slots of 64 MiB
/// would otherwise pin 16 GiB, and unread replies had no bound at all).
/// At least the largest request ([`crate::export::MAX_REQUEST`]), so any
/// request can go alone.
pub const BUDGET: usize = 64 << 20;
/// Stack of a connection's writer thread: it only sends and logs.
pub(super) const WRITER_STACK: usize = 128 << 10;
/// Context id of `base:allocation` on this server.
const BASE_ALLOCATION_ID: u32 = 1;
/// At most this many block-status descriptors per reply (the spec lets a
/// server stop early; clients ask again from where it stopped).
const MAX_DESCRIPTORS: usize = 1024;

/// Serve one accepted connection until the client leaves, misbehaves
/// beyond recovery, or the server stops (which shuts the socket's read
/// side). Returns once every request it submitted has completed.
///
/// `poll` says how the reader busy-polls the socket before it blocks
/// (off, a fixed bound or an adaptive window); [`SpinPolicy`] decides
/// when polling is worth it.
pub fn serve(
    sock: Arc<Sock>,
    exports: &[Export],
    poll: PollSetting,
    limits: &Limits,
    tls: &TlsPolicy,
    ticket: Option<HandshakeTicket>,
) -> io::Result<()> {
    let mut inb = InBuf::new()?;
    inb.deadline = Some(Instant::now() + limits.handshake_deadline);
    let neg = match handshake::handshake(&sock, &mut inb, exports, tls, ticket) {
        Ok(neg) => neg,
        Err(HandshakeError::Io(e)) => return Err(e),
        Err(e) => {
            // The client's doing (or its choice, NBD_OPT_ABORT): drop it.
            tracing::debug!(error = %e, "nbd: handshake ended without an export");
            return Ok(());
        }
    };
    // This connection's place among the negotiated ones, until it ends.
    let _place = neg.slot;
    inb.deadline = None;
    sock.set_send_timeout(Some(limits.send_timeout))?;
    // Idle connections give their buffers back (`Transmission::fill`).
    sock.set_recv_timeout(Some(limits.idle_trim))?;
    // A polling reader yields between polls and wants its CPU back at
    // once: a short slice (blkstack_core::timing::spin). A blocking one
    // keeps the scheduler's default, so a client sending a burst of
    // requests on the same CPU is not preempted at each one: the reader
    // takes the burst in one read, one wake-up instead of one per request.
    if poll != PollSetting::Off {
        blkstack_core::timing::spin::ask_short_slice();
    }
    let export = &exports[neg.export];
    // Live control: lets `unexport` see and disconnect this client.
    let _listed = export.attach(&sock);
    let shared = new_shared(&sock, neg.structured, poll, limits)?;
    let mut t = Transmission {
        owner: shared.clone(),
        shared: shared.clone(),
        export,
        inb,
        base_allocation: neg.base_allocation,
        any_alignment: !neg.knows_block_size,
        lbs: export.dev.logical_block_size().max(1) as u64,
        max_request: export.max_request(),
        size: export.dev.size(),
        features: export.dev.features(),
        spin: SpinPolicy::from_setting(poll),
        wake_spin: SpinPolicy::from_setting(poll),
        round: 0,
        idle_trim: limits.idle_trim,
        trimmed: false,
        claim: claim::Claim::new(&export.dev),
    };
    let r = t.run();
    t.drain();
    shared.stop_writer();
    r
}

/// The transmission-phase state of a connection: its slots, reply side
/// and accounting, all empty.
fn new_shared(
    sock: &Arc<Sock>,
    structured: bool,
    poll: PollSetting,
    limits: &Limits,
) -> io::Result<Arc<Shared>> {
    let slots: Box<[Slot]> = (0..MAX_INFLIGHT)
        .map(|_| Slot {
            meta: Mutex::new(SlotMeta {
                handle: 0,
                cmd: 0,
                flags: 0,
                offset: 0,
                len: 0,
                buf: None,
                extents: Vec::new(),
            }),
            pending: AtomicU32::new(0),
            err: AtomicU8::new(0),
        })
        .collect();
    let idle_wake = if poll != PollSetting::Off {
        Some(IdleWake::new()?)
    } else {
        None
    };
    Ok(Arc::new_cyclic(|me| Shared {
        sock: sock.clone(),
        structured,
        slots,
        out: Mutex::new(Out {
            // Grows on demand; an idle connection gives it back.
            queue: Queue::default(),
            batching: false,
            dead: false,
            writer_busy: false,
            in_writer: 0,
            sending: false,
            spare: Queue::default(),
            quit: false,
        }),
        dead: AtomicBool::new(false),
        accounting: Mutex::new(Slots {
            free: (0..MAX_INFLIGHT as u16).rev().collect(),
            inflight: 0,
            inflight_bytes: 0,
        }),
        freed: Condvar::new(),
        idle_wake,
        writer_wake: Condvar::new(),
        send_timeout: limits.send_timeout,
        writer: Mutex::new(None),
        me: me.clone(),
        reader: std::thread::current().id(),
    }))
}
