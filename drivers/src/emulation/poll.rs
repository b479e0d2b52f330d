//! The emulated disk's poll list (`iopoll=1` with `irqmode=2`): a
//! timer-mode request whose bio is `POLLED` is not completed by the timer thread but waits
//! here, in deadline order, for the submitter's own poll to end it once
//! due, like a request on one of null_blk's poll queues reaped by
//! `null_poll` (kernel `blk_mq_poll` → `mq_ops->poll`; io_uring IOPOLL).
//! Unlike null_blk's poll queues, which complete on the first poll, the
//! service time is kept.
//!
//! null_blk's poll queues complete a request only when polled. Here the
//! completion thread is a backstop: a request nobody polls for the
//! table's `poll_backstop_ms` past its deadline (1 ms by default) is ended
//! by it, so a submitter that stops polling never leaves one behind and
//! the wait stays bounded (at most a minute). With a long backstop, the
//! poll is in practice the only way a polled bio ends, whatever the load:
//! the tests that check the submitter's poll reaps its bios set it to a
//! minute, so a descheduled poller cannot lose one to the backstop.

use blkstack_core::clock::{now_ns, sleep_until_ns};
use blkstack_core::Status;
use blkstack_mq::CompleterRef;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

/// How often an idle completion thread looks for polled requests past
/// their backstop.
pub(super) const POLL_BACKSTOP_CHECK: std::time::Duration = std::time::Duration::from_millis(10);

/// One hardware queue's polled requests: `(deadline, tag, status)`.
pub(super) struct PollList {
    list: Mutex<VecDeque<(u64, u32, Status)>>,
}

impl PollList {
    pub(super) fn new(depth: usize) -> PollList {
        PollList {
            list: Mutex::new(VecDeque::with_capacity(depth)),
        }
    }

    #[inline]
    pub(super) fn push(&self, deadline: u64, tag: u32, status: Status) {
        self.list.lock().push_back((deadline, tag, status));
    }

    /// End, through `completer`, the requests of hardware queue `hctx` due
    /// at least `grace_ns` ago, a few at a time so the list's lock is not
    /// held while requests end; adds how many and how late to `done` and
    /// `late_ns`. A list another thread is polling is skipped.
    pub(super) fn end_due(
        &self,
        hctx: u32,
        grace_ns: u64,
        completer: &CompleterRef<'_>,
        done: &AtomicU64,
        late_ns: &AtomicU64,
    ) -> usize {
        const CHUNK: usize = 32;
        let mut ended = 0;
        loop {
            let mut due = [(0u32, Status::Ok); CHUNK];
            let (mut n, mut late) = (0, 0u64);
            let now = now_ns();
            {
                let Some(mut list) = self.list.try_lock() else {
                    break;
                };
                while n < CHUNK {
                    match list.front() {
                        Some(&(deadline, tag, status))
                            if deadline.saturating_add(grace_ns) <= now =>
                        {
                            list.pop_front();
                            due[n] = (tag, status);
                            late += now - deadline;
                            n += 1;
                        }
                        _ => break,
                    }
                }
            }
            if n > 0 {
                done.fetch_add(n as u64, Relaxed);
                late_ns.fetch_add(late, Relaxed);
            }
            for &(tag, status) in &due[..n] {
                completer.end_request(hctx, tag, status);
            }
            ended += n;
            if n < CHUNK {
                break;
            }
        }
        ended
    }

    /// At teardown: end every request left, each no earlier than its
    /// deadline.
    pub(super) fn drain(&self, hctx: u32, completer: &CompleterRef<'_>) {
        loop {
            let Some((deadline, tag, status)) = self.list.lock().pop_front() else {
                return;
            };
            if now_ns() < deadline {
                sleep_until_ns(deadline);
            }
            completer.end_request(hctx, tag, status);
        }
    }
}
