//! dm-delay's flush before the kthread change, emulated faithfully: the
//! timer and the kdelayd workqueue. `expires = jiffies +
//! msecs_to_jiffies(delay)` at HZ `hz`, one timer per device armed with
//! `timer_reduce` semantics, placed in the timer wheel the way
//! `calc_wheel_index` does (the bucket is rounded up past `expires`, so a
//! level-0 timer fires one tick after it), fired at a tick boundary by a
//! timer thread, which queues work on a second thread (the workqueue hop)
//! that sends on every bio with `jiffies >= expires` and re-arms the timer
//! for the earliest one left. The lost accuracy at small delays that the
//! kthread change fixed comes from these roundings and the hop.

use super::held::{pop_due, Held};
use super::{Flusher, Shared, WORKER_SLICE_NS};
use crate::error::TargetError;
use blkstack_core::clock::{wheel_bucket_expiry, Jiffies};
use blkstack_core::timing::{self, Parker};
use parking_lot::Mutex;
use std::collections::BinaryHeap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub(super) struct TimerFlusher(Arc<TimerWq>);

/// The emulated `delay_timer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TimerArm {
    /// `timer->expires`.
    expires: u64,
    /// The jiffy at which the wheel bucket holding it is run.
    fires_at: u64,
}

struct State {
    /// Every held bio, earliest expiry first.
    heap: BinaryHeap<Held>,
    /// The armed timer, if pending.
    timer: Option<TimerArm>,
    /// The work item's pending bit (`queue_work` is a no-op while set).
    work_pending: bool,
}

struct TimerWq {
    sh: Arc<Shared>,
    jiffies: Jiffies,
    state: Mutex<State>,
    /// The timer thread.
    timer: Parker,
    /// The workqueue thread.
    worker: Parker,
}

impl TimerFlusher {
    pub fn start(sh: &Arc<Shared>, hz: u32) -> Result<TimerFlusher, TargetError> {
        let t = Arc::new(TimerWq {
            sh: sh.clone(),
            jiffies: Jiffies::new(hz),
            state: Mutex::new(State {
                heap: BinaryHeap::with_capacity(64),
                timer: None,
                work_pending: false,
            }),
            timer: Parker::new(),
            worker: Parker::new(),
        });
        let (a, b) = (t.clone(), t.clone());
        sh.spawn(format!("dlyt-{}", sh.name), move || a.timer_thread())?;
        if let Err(e) = sh.spawn(format!("kdlyd-{}", sh.name), move || b.workqueue_thread()) {
            // No target will exist to stop the timer thread: stop it here.
            sh.stop.store(true, Ordering::Release);
            t.timer.unpark();
            return Err(e);
        }
        Ok(TimerFlusher(t))
    }
}

impl TimerWq {
    /// dm's `queue_timeout` (`timer_reduce`): arm the timer for `expires`
    /// unless it is already pending for an earlier or equal expiry.
    /// Returns whether the timer thread must look again.
    fn queue_timeout(&self, st: &mut State, expires: u64) -> bool {
        if st.timer.is_some_and(|t| t.expires <= expires) {
            return false;
        }
        let clk = self.jiffies.now();
        st.timer = Some(TimerArm {
            expires,
            fires_at: wheel_bucket_expiry(expires, clk, self.jiffies.hz),
        });
        true
    }

    /// Jiffies covering `delay_ns`: `msecs_to_jiffies` generalised to
    /// fractions of a millisecond (rounds up, as the kernel does).
    fn delay_jiffies(&self, delay_ns: u64) -> u64 {
        let j = (delay_ns as u128 * self.jiffies.hz as u128).div_ceil(1_000_000_000) as u64;
        // A tick of a HZ that does not divide 1e9 is truncated to whole
        // nanoseconds; never let that make the expiry early.
        j.max(delay_ns.div_ceil(self.jiffies.tick_ns()))
    }

    /// The timer: fires at the tick its wheel bucket runs and queues the
    /// flush work (`handle_delayed_timer`).
    fn timer_thread(&self) {
        timing::prepare_precise_worker(WORKER_SLICE_NS);
        while !self.sh.stop.load(Ordering::Acquire) {
            let (seen, arm) = {
                let st = self.state.lock();
                (self.timer.seen(), st.timer)
            };
            let Some(arm) = arm else {
                self.timer.park(seen, None);
                continue;
            };
            let fire_ns = self.jiffies.to_ns(arm.fires_at);
            if blkstack_core::clock::now_ns() < fire_ns {
                self.timer.park(seen, Some(fire_ns));
                continue;
            }
            let queue_work = {
                let mut st = self.state.lock();
                if st.timer == Some(arm) {
                    st.timer = None;
                    !std::mem::replace(&mut st.work_pending, true)
                } else {
                    false
                }
            };
            if queue_work {
                self.worker.unpark();
            }
        }
    }

    /// The kdelayd work: `flush_expired_bios`.
    fn workqueue_thread(&self) {
        timing::prepare_precise_worker(WORKER_SLICE_NS);
        let mut batch: Vec<Held> = Vec::with_capacity(64);
        while !self.sh.stop.load(Ordering::Acquire) {
            let rearm = {
                let mut st = self.state.lock();
                if !st.work_pending {
                    let seen = self.worker.seen();
                    drop(st);
                    self.worker.park(seen, None);
                    continue;
                }
                // The pending bit is cleared as the work starts running.
                st.work_pending = false;
                let now = self.jiffies.now();
                pop_due(
                    &self.sh,
                    &mut st.heap,
                    now,
                    |d| self.jiffies.from_ns(d),
                    &mut batch,
                );
                match st.heap.peek().map(|h| h.key) {
                    Some(next) => self.queue_timeout(&mut st, next),
                    None => false,
                }
            };
            if rearm {
                self.timer.unpark();
            }
            self.sh.send_expired_batch(&mut batch);
        }
    }
}

impl Flusher for TimerFlusher {
    fn key(&self, now_ns: u64, delay_ns: u64) -> u64 {
        self.0.jiffies.from_ns(now_ns) + self.0.delay_jiffies(delay_ns)
    }

    fn hold(&self, _queue: usize, held: Held) {
        let t = &self.0;
        let wake_timer = {
            let mut st = t.state.lock();
            let key = held.key;
            st.heap.push(held);
            t.queue_timeout(&mut st, key)
        };
        if wake_timer {
            t.timer.unpark();
        }
    }

    fn take_all(&self) -> Vec<Held> {
        let mut st = self.0.state.lock();
        st.timer = None;
        std::mem::take(&mut st.heap).into_vec()
    }

    fn wake_for_stop(&self) {
        self.0.worker.unpark();
        self.0.timer.unpark();
    }
}
