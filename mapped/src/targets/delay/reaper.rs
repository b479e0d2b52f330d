//! A submitter's claim on the bios the hybrid flush holds
//! ([`blkstack_core::Reaper`]). A thread with an event loop of its own
//! (an NBD connection's reader) polls one more descriptor, a
//! CLOCK_MONOTONIC timerfd armed for the earliest deadline held, and when
//! it polls readable sends on every bio that is due, on its own thread.
//! The device below completes them there too when it completes inline
//! (`zero`, `memory`), so a request is read, held, sent on and answered
//! by one thread, with no worker woken: qemu's block/io_uring.c hands its
//! ring's descriptor to the AioContext that submits in the same way, and
//! so does the `file` device (drivers/src/file/ring.rs). dm-delay has no
//! such path (its bios always leave from its kthread or workqueue); the
//! rule per bio is the same: never before its deadline, checked by the
//! same `pop_due` as the workers use.
//!
//! While a claim lives the workers stand aside. Each keeps its timer
//! armed between half and all of the backstop bound (`reap_backstop_ms=`,
//! one tick of the default HZ) past its lane's earliest deadline, and
//! submitters and claimants move it on as the head moves, so a worker
//! wakes only when a bio has been left unreaped at least half the bound,
//! and then sends on everything due. A stalled claimant (its thread
//! blocked elsewhere) thus holds no bio back more than the bound, plus the
//! worker's wake-up; a claimant that keeps up costs a timer re-arm per
//! half bound of time, never a worker wake. Several claims may live at
//! once: they poll the same timer, and any of them sends on every due bio,
//! in whichever lane it waits. With `affinity=cpu` the lanes stay one per
//! submitting CPU and a claim covers them all: its holder reaps what any
//! CPU submitted, and the per-CPU workers are its backstops. Dropping the
//! last claim wakes every worker with bios held, which take over at once.

use super::held::{pop_due, Held};
use super::hybrid::{ClaimState, Hybrid, Lane, Lanes, Shard};
use blkstack_core::clock;
use blkstack_core::timing::DeadlineTimer;
use blkstack_core::Reaper;
use parking_lot::{Mutex, MutexGuard};
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl ClaimState {
    /// Arm the claimants' timer for `next` (disarm for `u64::MAX`) if it
    /// has fired by `now` (re-arming clears it) or would fire later than
    /// `next`.
    fn arm(&self, lanes: &mut Lanes, next: u64, now: u64) {
        if lanes.claim_armed_ns > now && next >= lanes.claim_armed_ns {
            return;
        }
        if let Some(t) = self.timer.get() {
            match next {
                u64::MAX => t.disarm(),
                at => t.arm(at),
            }
        }
        lanes.claim_armed_ns = next;
    }
}

/// Keep a worker's backstop between half and all of the bound past its
/// lane's earliest deadline `head`: earlier would wake it for nothing,
/// later would leave a bio of a stalled claimant late beyond the bound.
/// Re-armed only when out of that window, so a moving head costs a
/// timer re-arm per half bound, not per bio.
fn keep_backstop(lane: &mut Lane, shard: &Shard, head: u64, bound: u64) {
    let (lo, hi) = (head.saturating_add(bound / 2), head.saturating_add(bound));
    if lane.armed_ns < lo || lane.armed_ns > hi {
        shard.timer.arm(hi);
        lane.armed_ns = hi;
    }
}

/// The earliest deadline any lane holds.
fn earliest(lanes: &Lanes) -> u64 {
    lanes
        .used
        .iter()
        .filter_map(|&i| lanes[i].heap.peek().map(|h| h.deadline_ns))
        .min()
        .unwrap_or(u64::MAX)
}

impl Hybrid {
    /// A new claim; `None` if the claimants' timer cannot be made.
    pub(super) fn claim(self: &Arc<Self>) -> Option<Box<dyn Reaper>> {
        if self.claim.timer.get().is_none() {
            // Two first claims may race: one timer wins, the other closes.
            let _ = self.claim.timer.set(DeadlineTimer::new().ok()?);
        }
        let mut lanes = self.lanes.lock();
        lanes.claims += 1;
        if lanes.claims == 1 {
            // Until now nobody kept this timer: arm it for what is held.
            lanes.claim_armed_ns = 0;
            let next = earliest(&lanes);
            self.claim.arm(&mut lanes, next, clock::now_ns());
        }
        Some(Box::new(Claim {
            h: self.clone(),
            batch: Mutex::new(Vec::with_capacity(64)),
        }))
    }

    /// A submitter's bio was just pushed on lane `shard.idx` while
    /// claimed: bring the claimants' timer forward to its deadline and keep
    /// the lane's backstop in its window. The worker is not woken.
    pub(super) fn hold_claimed(&self, lanes: &mut Lanes, shard: &Shard, deadline_ns: u64) {
        if deadline_ns < lanes.claim_armed_ns {
            if let Some(t) = self.claim.timer.get() {
                t.arm(deadline_ns);
            }
            lanes.claim_armed_ns = deadline_ns;
        }
        let lane = &mut lanes[shard.idx];
        if let Some(head) = lane.heap.peek().map(|h| h.deadline_ns) {
            keep_backstop(lane, shard, head, self.claim.backstop_ns);
        }
    }

    /// A worker's turn while claimed, lanes locked: send on what is due
    /// if its lane's head has waited half the bound past its deadline (a
    /// claimant is stalled or far behind), else sleep on the backstop.
    /// Returns whether it slept.
    pub(super) fn stand_aside(
        &self,
        shard: &Shard,
        mut lanes: MutexGuard<'_, Lanes>,
        batch: &mut Vec<Held>,
    ) -> bool {
        let bound = self.claim.backstop_ns;
        let now = clock::now_ns();
        let lane = &mut lanes[shard.idx];
        match lane.heap.peek().map(|h| h.deadline_ns) {
            Some(head) if head.saturating_add(bound / 2) <= now => {
                pop_due(&self.sh, &mut lane.heap, now, |d| d, batch);
                drop(lanes);
                self.claim
                    .backstopped
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
                self.sh.send_expired_batch(batch);
                return false;
            }
            Some(head) => keep_backstop(lane, shard, head, bound),
            None => {}
        }
        lane.awake = false;
        drop(lanes);
        shard.timer.wait();
        true
    }

    /// A claimant's reap: send on, on the calling thread, every due bio
    /// of every lane; re-arm the claimants' timer for the next deadline
    /// and move each lane's backstop along with its head.
    fn reap_due(&self, batch: &mut Vec<Held>) -> usize {
        let bound = self.claim.backstop_ns;
        {
            let mut lanes = self.lanes.lock();
            let now = clock::now_ns();
            let mut next = u64::MAX;
            for k in 0..lanes.used.len() {
                let i = lanes.used[k];
                let lane = &mut lanes[i];
                pop_due(&self.sh, &mut lane.heap, now, |d| d, batch);
                let Some(head) = lane.heap.peek().map(|h| h.deadline_ns) else {
                    continue;
                };
                next = next.min(head);
                if let Some(shard) = self.shards[i].get() {
                    keep_backstop(lane, shard, head, bound);
                }
            }
            self.claim.arm(&mut lanes, next, now);
        }
        let n = batch.len();
        if n > 0 {
            self.claim.reaped.fetch_add(n as u64, Ordering::Relaxed);
            self.sh.send_expired_batch(batch);
        }
        n
    }
}

/// One claim on a hybrid delay target's held bios.
struct Claim {
    h: Arc<Hybrid>,
    /// The bios of one reap, kept so a reap allocates nothing.
    batch: Mutex<Vec<Held>>,
}

impl Reaper for Claim {
    fn fd(&self) -> RawFd {
        // `claim` made the timer before it made this claim.
        self.h.claim.timer.get().map_or(-1, DeadlineTimer::fd)
    }

    fn reap(&self) -> usize {
        match self.batch.try_lock() {
            Some(mut b) => self.h.reap_due(&mut b),
            // Reaped from a completion of this very reap: a batch of its own.
            None => self.h.reap_due(&mut Vec::new()),
        }
    }
}

impl Drop for Claim {
    /// The last claim gone, every worker with bios held wakes now and
    /// takes them over.
    fn drop(&mut self) {
        let h = &self.h;
        let mut lanes = h.lanes.lock();
        lanes.claims -= 1;
        if lanes.claims > 0 {
            return;
        }
        if let Some(t) = h.claim.timer.get() {
            t.disarm();
        }
        lanes.claim_armed_ns = u64::MAX;
        let now = clock::now_ns();
        for k in 0..lanes.used.len() {
            let i = lanes.used[k];
            let lane = &mut lanes[i];
            if lane.heap.is_empty() {
                continue;
            }
            if let Some(shard) = h.shards[i].get() {
                shard.timer.arm(now);
                lane.armed_ns = now;
            }
        }
    }
}
