//! The run-scheduling state of a hardware queue: the kernel's
//! `hctx->state` bits that decide whether a queue run is posted, skipped
//! or owed, and the count of requests in the driver that the restart
//! handshake needs (kernel `block/blk-mq.c`, `blk-mq-sched.c`).
//!
//! Kept apart from the queue so that every step of the protocol is one
//! method here, called as is by `queue.rs` and by the loom model
//! (`tests/loom_runstate.rs`), which checks that no request is left on a
//! dispatch list with no run owed:
//! - `WORK_QUEUED` ("blk-mq: avoid repeatedly scheduling the same work to
//!   run hardware queue"): an immediate run is posted and has not
//!   started; a poster that finds it set posts nothing. The run clears it
//!   before it looks at the dispatch list, so a request queued during the
//!   run posts a new one. A delayed post clears it too, so a delayed run
//!   never stands in for the next immediate one (that patch's v2).
//! - `RESTART` (`BLK_MQ_S_SCHED_RESTART`): the driver said busy, so the
//!   next completion runs the queue. If nothing is in flight when it is
//!   armed, no completion will come, and the caller posts a delayed run
//!   instead (`BLK_MQ_RESOURCE_DELAY`). Arming and the completion's check
//!   are ordered (SeqCst) so that at least one side sees the other. While
//!   it is armed and a request is in flight, a submitter's inline run is
//!   skipped (the kernel never skips one; this saves taking a request off
//!   the list only to put it back). With nothing in flight the bit can
//!   outlive every run owed for it: the busy request may have been
//!   dispatched and completed by another run before its submitter armed
//!   the bit, and the resource-delay run then finds the list empty (or a
//!   stop cancels it). No completion is left to honour the bit, so it
//!   must veto nothing, or a request queued behind it waits for ever.
//! - `STOPPED`: the driver asked not to be called.

use crate::sync::AtomicU32;
use crossbeam_utils::CachePadded;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};

const S_STOPPED: u32 = 1 << 0;
const S_WORK_QUEUED: u32 = 1 << 1;
const S_RESTART: u32 = 1 << 2;

/// See the module documentation.
pub struct RunState {
    bits: CachePadded<AtomicU32>,
    /// Requests the driver accepted and has not completed.
    in_driver: CachePadded<AtomicU32>,
}

impl Default for RunState {
    fn default() -> Self {
        RunState::new()
    }
}

impl RunState {
    /// A started queue with no run posted and nothing in the driver.
    pub fn new() -> RunState {
        RunState {
            bits: CachePadded::new(AtomicU32::new(0)),
            in_driver: CachePadded::new(AtomicU32::new(0)),
        }
    }

    /// Whether the queue is stopped (kernel `BLK_MQ_S_STOPPED`).
    pub fn is_stopped(&self) -> bool {
        self.bits.load(Relaxed) & S_STOPPED != 0
    }

    /// Is an immediate run posted and not yet started?
    pub fn work_queued(&self) -> bool {
        self.bits.load(Relaxed) & S_WORK_QUEUED != 0
    }

    /// Requests the driver accepted and has not completed.
    pub fn in_driver(&self) -> u32 {
        self.in_driver.load(Relaxed)
    }

    /// Kernel `blk_mq_stop_hw_queue`'s bit (a posted run is cancelled by
    /// the caller, so the queued bit goes too).
    pub fn stop(&self) {
        self.bits.fetch_or(S_STOPPED, SeqCst);
        self.bits.fetch_and(!S_WORK_QUEUED, SeqCst);
    }

    /// Kernel `blk_mq_start_hw_queue`'s bit: runs may dispatch again. The
    /// caller runs the queue afterwards to send what waited.
    pub fn start(&self) {
        self.bits.fetch_and(!S_STOPPED, SeqCst);
    }

    /// Before posting an immediate run with dedup on: true if the caller
    /// must post it, false if one is already pending (counted as deduped).
    /// The plain load first keeps the common "already queued" case from
    /// writing the shared line.
    pub fn claim_immediate_post(&self) -> bool {
        if self.bits.load(SeqCst) & S_WORK_QUEUED != 0 {
            return false;
        }
        self.bits.fetch_or(S_WORK_QUEUED, SeqCst) & S_WORK_QUEUED == 0
    }

    /// Before posting a delayed run with dedup on.
    pub fn before_delayed_post(&self) {
        self.bits.fetch_and(!S_WORK_QUEUED, SeqCst);
    }

    /// A posted run starts (kernel `blk_mq_run_work_fn`): returns whether
    /// it may dispatch. Clears the queued bit first, so any request that
    /// arrives from here on posts a run of its own.
    pub fn begin_work(&self) -> bool {
        self.bits.fetch_and(!S_WORK_QUEUED, SeqCst);
        !self.is_stopped()
    }

    /// May a submitter run the queue inline? Not while a restart is armed
    /// and a request is in flight: that request's completion will (it
    /// sees the bit, or whoever cleared the bit since runs the queue), and
    /// trying now would only take the request off the list and put it
    /// back. With nothing in flight, yes: see the module documentation.
    /// The bit is read before the count, so a count above zero means a
    /// request that has still to leave the driver after this load: by a
    /// completion, which then reads the bit, or by a busy return, which
    /// arms it again and posts a run if nothing else is in flight.
    pub fn inline_run_allowed(&self) -> bool {
        self.bits.load(SeqCst) & S_RESTART == 0 || self.in_driver.load(SeqCst) == 0
    }

    /// A request goes to the driver.
    #[inline]
    pub fn enter_driver(&self) {
        self.in_driver.fetch_add(1, SeqCst);
    }

    /// The driver said busy for a request the caller has put back at the
    /// head of the dispatch list: arm the restart. Returns true when
    /// nothing is in flight, so no completion will restart the queue and
    /// the caller must post the resource-delay run.
    pub fn requeued_busy(&self) -> bool {
        self.in_driver.fetch_sub(1, SeqCst);
        self.bits.fetch_or(S_RESTART, SeqCst);
        self.in_driver.load(SeqCst) == 0
    }

    /// `n` requests left the driver (completed). Returns true when a
    /// restart was armed and this caller took it: it must run the queue.
    #[inline]
    pub fn left_driver(&self, n: u32) -> bool {
        self.in_driver.fetch_sub(n, SeqCst);
        self.bits.load(SeqCst) & S_RESTART != 0
            && self.bits.fetch_and(!S_RESTART, SeqCst) & S_RESTART != 0
    }
}
