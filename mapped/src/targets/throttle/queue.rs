//! The throttle's held requests: a FIFO per direction and one worker
//! thread that sends them on when the buckets allow (qemu's
//! `throttled_reqs[2]` and its throttle timer, block/throttle-groups.c).
//!
//! A request whose direction has nothing held and whose buckets allow it
//! goes straight down from `map`; any other waits at the back of its
//! direction's FIFO, so within a direction nothing is reordered, and a
//! read never waits behind a write held by a write limit. Nothing is
//! ever failed. The worker takes turns between the directions (as qemu's
//! round robin does) and sends on, in one pass, every request the buckets
//! allow at that moment; it then parks until the next one's tokens are
//! due, but never for less than [`MIN_PARK_NS`], so at tens of thousands
//! of IOPS a wake-up sends a batch instead of one request. Tokens come
//! from the clock (see [`super::bucket`]), so waking late only makes a
//! bigger batch, never a lower rate.
//!
//! The timer is the core [`Parker`] (the futex with an absolute
//! CLOCK_MONOTONIC deadline that dm-delay's flush workers sleep on) on a
//! thread of our own: dm-delay's flushers order bios by a deadline known
//! on arrival, while here a request's time depends on every request
//! before it and on `set`, so only the sleep is shared, not the heap.
//!
//! At most [`MAX_HELD`] requests are held; a submitter that finds the
//! queue full waits in `map` until the worker frees a place (the
//! backpressure a full hardware queue gives), and is never failed.

use super::bucket::{Buckets, Dir};
use super::config::Config;
use crate::target::DevArg;
use blkstack_core::clock;
use blkstack_core::timing::{self, Parker};
use blkstack_core::Bio;
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};

/// Requests held at most; past it, submitters wait.
pub const MAX_HELD: usize = 4096;
/// The shortest park of the worker while requests are held.
pub const MIN_PARK_NS: u64 = 1_000_000;
/// Requests sent on per pass under the lock, at most.
const BATCH: usize = 256;
/// The scheduler slice the worker asks for.
const WORKER_SLICE_NS: u64 = 100_000;

struct Held {
    bio: Bio,
    arrival_ns: u64,
}

/// Counters `status` shows.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    pub held_ios: u64,
    pub held_bytes: u64,
    /// Requests that had to wait, and their bytes.
    pub throttled_ios: u64,
    pub throttled_bytes: u64,
    /// Time during which at least one request was held.
    pub throttled_ns: u64,
}

struct State {
    buckets: Buckets,
    fifo: [VecDeque<Held>; 2],
    counts: Counts,
    /// When the held count last went from 0 to 1.
    busy_since: Option<u64>,
    /// False between presuspend and resume: everything passes.
    may_throttle: bool,
    /// Submitters waiting for a place.
    waiters: u32,
    /// The direction the worker serves first next pass.
    turn: usize,
}

impl State {
    fn held(&self) -> usize {
        self.fifo[0].len() + self.fifo[1].len()
    }

    fn note_released(&mut self, h: &Held, now: u64) {
        self.counts.held_ios -= 1;
        self.counts.held_bytes -= h.bio.len;
        if self.counts.held_ios == 0 {
            if let Some(t) = self.busy_since.take() {
                self.counts.throttled_ns += now.saturating_sub(t);
            }
        }
    }

    /// Send on, into `out`, what the buckets allow now (at most [`BATCH`]),
    /// the directions taking turns. Returns the wait for the next held
    /// request, `None` if none is held.
    fn release(&mut self, now: u64, out: &mut Vec<Bio>) -> Option<u64> {
        self.buckets.leak(now);
        let dirs = [Dir::Read, Dir::Write];
        while out.len() < BATCH {
            let mut moved = false;
            for k in 0..2 {
                let d = dirs[(self.turn + k) % 2];
                if self.fifo[d as usize].is_empty() || self.buckets.wait_ns(d) != 0 {
                    continue;
                }
                let Some(h) = self.fifo[d as usize].pop_front() else {
                    continue;
                };
                self.buckets.account(d, h.bio.len);
                self.note_released(&h, now);
                out.push(h.bio);
                moved = true;
            }
            self.turn ^= 1;
            if !moved {
                break;
            }
        }
        dirs.iter()
            .filter(|&&d| !self.fifo[d as usize].is_empty())
            .map(|&d| self.buckets.wait_ns(d))
            .min()
    }

    /// Every held request, oldest first.
    fn take_all(&mut self, now: u64) -> Vec<Bio> {
        let mut all: Vec<Held> = self.fifo.iter_mut().flat_map(|f| f.drain(..)).collect();
        all.sort_by_key(|h| h.arrival_ns);
        for h in &all {
            self.note_released(h, now);
        }
        all.into_iter().map(|h| h.bio).collect()
    }
}

/// The held requests of one throttle and what its worker needs.
pub struct Queue {
    state: Mutex<State>,
    /// Submitters waiting for a place park here.
    space: Condvar,
    worker: Parker,
    stop: AtomicBool,
    dev: DevArg,
}

impl Queue {
    pub fn new(dev: DevArg, cfg: Config) -> Queue {
        Queue {
            state: Mutex::new(State {
                buckets: Buckets::new(cfg, clock::now_ns()),
                fifo: [VecDeque::new(), VecDeque::new()],
                counts: Counts::default(),
                busy_since: None,
                may_throttle: true,
                waiters: 0,
                turn: 0,
            }),
            space: Condvar::new(),
            worker: Parker::new(),
            stop: AtomicBool::new(false),
            dev,
        }
    }

    pub fn dev(&self) -> &DevArg {
        &self.dev
    }

    /// Send `bio` down now if its direction has nothing held and its
    /// buckets allow it, else hold it at the back of its FIFO; wait for a
    /// place while [`MAX_HELD`] are held.
    pub fn submit(&self, bio: Bio, dir: Dir) {
        let d = dir as usize;
        let mut st = self.state.lock();
        loop {
            let now = clock::now_ns();
            if !st.may_throttle || !st.buckets.limits_anything() && st.held() == 0 {
                break;
            }
            st.buckets.leak(now);
            if st.fifo[d].is_empty() && st.buckets.wait_ns(dir) == 0 {
                st.buckets.account(dir, bio.len);
                break;
            }
            if st.held() < MAX_HELD {
                let first = st.fifo[d].is_empty();
                let c = &mut st.counts;
                c.held_ios += 1;
                c.held_bytes += bio.len;
                c.throttled_ios += 1;
                c.throttled_bytes += bio.len;
                if c.held_ios == 1 {
                    st.busy_since = Some(now);
                }
                st.fifo[d].push_back(Held {
                    bio,
                    arrival_ns: now,
                });
                drop(st);
                // A new head may be due before the worker's park ends.
                if first {
                    self.worker.unpark();
                }
                return;
            }
            st.waiters += 1;
            self.space.wait(&mut st);
            st.waiters -= 1;
        }
        drop(st);
        self.dev.dev.submit(bio);
    }

    /// Change the limits; the worker looks again at once.
    pub fn reconfigure(&self, cfg: Config) {
        self.state.lock().buckets.reconfigure(cfg, clock::now_ns());
        self.worker.unpark();
    }

    pub fn config(&self) -> Config {
        self.state.lock().buckets.config().clone()
    }

    /// The counters, with the time of a busy stretch still open.
    pub fn counts(&self) -> Counts {
        let st = self.state.lock();
        let mut c = st.counts;
        if let Some(t) = st.busy_since {
            c.throttled_ns += clock::now_ns().saturating_sub(t);
        }
        c
    }

    /// Stop or restart throttling (suspend and resume): stopping sends on
    /// everything held, in arrival order, and lets waiting submitters go.
    pub fn set_may_throttle(&self, on: bool) {
        let all = {
            let mut st = self.state.lock();
            st.may_throttle = on;
            if on {
                Vec::new()
            } else {
                st.take_all(clock::now_ns())
            }
        };
        self.space.notify_all();
        for bio in all {
            self.dev.dev.submit(bio);
        }
    }

    /// The worker: send on what is due, park until the next is.
    pub fn run(&self) {
        timing::prepare_precise_worker(WORKER_SLICE_NS);
        let mut out: Vec<Bio> = Vec::with_capacity(BATCH);
        while !self.stop.load(Ordering::Acquire) {
            let seen = self.worker.seen();
            let now = clock::now_ns();
            let (next, wake) = {
                let mut st = self.state.lock();
                let next = st.release(now, &mut out);
                (next, st.waiters > 0 && !out.is_empty())
            };
            if wake {
                self.space.notify_all();
            }
            let full = out.len() == BATCH;
            for bio in out.drain(..) {
                self.dev.dev.submit(bio);
            }
            match next {
                _ if full => continue,
                None => {
                    self.worker.park(seen, None);
                }
                Some(w) => {
                    self.worker.park(seen, Some(now + w.max(MIN_PARK_NS)));
                }
            }
        }
    }

    /// Stop the worker (teardown) and send on everything held.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.worker.unpark();
    }

    /// Send on everything still held (after the worker stopped).
    pub fn drain(&self) {
        self.set_may_throttle(false);
    }
}
