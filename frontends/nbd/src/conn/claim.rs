//! A connection's claim on its export device's completions
//! ([`blkstack_core::Reaper`]): a `delay` table's held bios, a `file`
//! ring's CQEs. The reader, while it has requests in flight and would
//! block for input, sleeps on the claim's descriptor beside the socket and
//! completes what is ready on its own thread, so the replies leave from
//! the thread that read the requests, with no completion thread woken
//! (qemu's AioContext polls its io_uring fd beside its sockets the same
//! way). Any claimant completes every ready bio, whichever connection
//! submitted it: another connection's reply is only appended, and sent
//! without blocking, as from any shared completer (`reply.rs`).
//!
//! The reader reaps only while it waits for input. Where it waits for
//! the completions themselves (slots or budget spent, an emulated
//! unaligned request, the drain at the end) it hands the claim back, so
//! the device's own threads complete them at once rather than after their
//! backstop; it claims again the next time it waits for input. Where it
//! blocks on the client (the rest of a WRITE's payload, its own overflow
//! sent under the send timeout) the device's backstop bounds how long a
//! ready bio waits. A connection idle for its trim time (nothing in
//! flight, no input) hands the claim back too: while any claim lives, a
//! `delay` device's workers stand aside, so a bio from a submitter that
//! reaps nothing (another frontend on the same device) would leave at the
//! backstop bound, late, for as long as an idle client stayed connected.

use blkstack_core::{DeviceRef, Reaper};
use std::cell::{Cell, RefCell};
use std::os::fd::RawFd;

/// The reader's claim, taken when its connection starts.
pub(super) struct Claim {
    dev: DeviceRef,
    held: RefCell<Option<Box<dyn Reaper>>>,
    /// The device offered a claim (the last time it was asked): worth
    /// asking again after a hand-back.
    offered: Cell<bool>,
}

impl Claim {
    /// Claim `dev`'s completions, if it lets the caller reap them.
    pub(super) fn new(dev: &DeviceRef) -> Claim {
        let held = dev.reaper();
        Claim {
            dev: dev.clone(),
            offered: Cell::new(held.is_some()),
            held: RefCell::new(held),
        }
    }

    /// The descriptor to sleep on beside the socket, claiming again if
    /// the claim was handed back; `None` when the device offers none.
    pub(super) fn fd(&self) -> Option<RawFd> {
        let mut held = self.held.borrow_mut();
        if held.is_none() && self.offered.get() {
            *held = self.dev.reaper();
            self.offered.set(held.is_some());
        }
        held.as_ref().map(|r| r.fd())
    }

    /// Complete what is ready, on this thread.
    pub(super) fn reap(&self) -> usize {
        self.held.borrow().as_ref().map_or(0, |r| r.reap())
    }

    /// Give the completions back to the device's threads while the reader
    /// waits for them elsewhere (see the module documentation).
    pub(super) fn hand_back(&self) {
        drop(self.held.borrow_mut().take());
    }
}
