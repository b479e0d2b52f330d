//! Hardware queues (kernel `struct blk_mq_hw_ctx`): where requests that
//! could not be issued directly wait (the dispatch list), the state that
//! governs queue runs ([`RunState`]: stopped, the queued bit of "blk-mq:
//! avoid repeatedly scheduling the same work to run hardware queue", the
//! restart handshake), and the counters an experiment reads. The run logic
//! itself lives with the queue in `queue.rs`, which knows the driver.

use crate::kblockd::DelayedWork;
use crate::runstate::RunState;
use crate::sbitmap::WaitIndex;
use crate::tags::{HctxTagState, Tags};
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::{Arc, OnceLock};

/// Counters of one hardware queue (all monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HctxStats {
    /// Queue runs done inline by the calling thread.
    pub runs_inline: u64,
    /// Queue runs posted to kblockd (each one took the pool's lock).
    pub runs_posted: u64,
    /// Zero-delay runs not posted because one was already pending.
    pub runs_deduped: u64,
    /// Queue runs executed by kblockd workers.
    pub runs_from_work: u64,
    /// Requests the driver refused as busy and that went back on the
    /// dispatch list.
    pub requeues: u64,
    /// Requests issued from the dispatch list (not directly).
    pub dispatched_from_list: u64,
    /// Runs triggered by the restart bit on completion.
    pub restarts: u64,
    /// Inline runs skipped because a restart is already armed.
    pub runs_skipped_restart: u64,
}

#[derive(Default)]
pub(crate) struct HctxCounters {
    pub runs_inline: AtomicU64,
    pub runs_posted: AtomicU64,
    pub runs_deduped: AtomicU64,
    pub runs_from_work: AtomicU64,
    pub requeues: AtomicU64,
    pub dispatched_from_list: AtomicU64,
    pub restarts: AtomicU64,
    pub runs_skipped_restart: AtomicU64,
}

/// One hardware queue.
pub struct HwQueue {
    pub(crate) index: u32,
    pub(crate) run: RunState,
    pub(crate) tags: Arc<Tags>,
    pub(crate) tag_state: HctxTagState,
    pub(crate) wait_index: WaitIndex,
    dispatch: Mutex<VecDeque<u32>>,
    dispatch_len: CachePadded<AtomicU32>,
    pub(crate) run_work: OnceLock<Arc<DelayedWork>>,
    pub(crate) counters: CachePadded<HctxCounters>,
}

impl HwQueue {
    pub(crate) fn new(index: u32, tags: Arc<Tags>) -> HwQueue {
        let depth = tags.depth() as usize;
        HwQueue {
            index,
            run: RunState::new(),
            tags,
            tag_state: HctxTagState::default(),
            wait_index: WaitIndex::new(),
            dispatch: Mutex::new(VecDeque::with_capacity(depth)),
            dispatch_len: CachePadded::new(AtomicU32::new(0)),
            run_work: OnceLock::new(),
            counters: CachePadded::new(HctxCounters::default()),
        }
    }

    /// Index of this hardware queue in its request queue (kernel `queue_num`).
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The tag set this hardware queue allocates from (kernel `hctx->tags`).
    pub fn tags(&self) -> &Arc<Tags> {
        &self.tags
    }

    /// Whether the driver stopped this queue (kernel `blk_mq_hctx_stopped`):
    /// runs do nothing until it is started again.
    pub fn is_stopped(&self) -> bool {
        self.run.is_stopped()
    }

    /// Is a zero-delay run posted and not yet started?
    pub fn work_queued(&self) -> bool {
        self.run.work_queued()
    }

    /// Requests waiting on the dispatch list (kernel
    /// `blk_mq_hctx_has_pending`, without software queues or scheduler).
    #[inline]
    pub fn has_pending(&self) -> bool {
        self.dispatch_len.load(SeqCst) != 0
    }

    /// Requests on the dispatch list now, for stats (a relaxed read).
    pub fn dispatch_len(&self) -> u32 {
        self.dispatch_len.load(Relaxed)
    }

    /// Requests the driver accepted and has not completed.
    pub fn in_driver(&self) -> u32 {
        self.run.in_driver()
    }

    /// Tags this queue holds (counted only for tag sets with a fair share,
    /// where the share needs it, as in the kernel).
    pub fn nr_active(&self) -> u32 {
        self.tag_state.nr_active()
    }

    pub(crate) fn push_tail(&self, tag: u32) {
        let mut d = self.dispatch.lock();
        d.push_back(tag);
        self.dispatch_len.fetch_add(1, SeqCst);
    }

    pub(crate) fn push_head(&self, tag: u32) {
        let mut d = self.dispatch.lock();
        d.push_front(tag);
        self.dispatch_len.fetch_add(1, SeqCst);
    }

    pub(crate) fn pop(&self) -> Option<u32> {
        if self.dispatch_len.load(Relaxed) == 0 {
            return None;
        }
        let mut d = self.dispatch.lock();
        let t = d.pop_front()?;
        self.dispatch_len.fetch_sub(1, SeqCst);
        Some(t)
    }

    /// A snapshot of this queue's run and dispatch counters.
    pub fn stats(&self) -> HctxStats {
        let c = &self.counters;
        HctxStats {
            runs_inline: c.runs_inline.load(Relaxed),
            runs_posted: c.runs_posted.load(Relaxed),
            runs_deduped: c.runs_deduped.load(Relaxed),
            runs_from_work: c.runs_from_work.load(Relaxed),
            requeues: c.requeues.load(Relaxed),
            dispatched_from_list: c.dispatched_from_list.load(Relaxed),
            restarts: c.restarts.load(Relaxed),
            runs_skipped_restart: c.runs_skipped_restart.load(Relaxed),
        }
    }
}
