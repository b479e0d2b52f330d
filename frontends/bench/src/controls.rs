//! The per-thread controls a job loop consults around each I/O: pacing
//! (rate, thinktime, flow), the queue depth `latency_target` allows,
//! `number_ios`, `fsync`/`fdatasync` every N writes, steady-state
//! detection and the log files.
//!
//! They sit beside the engine rather than in it so that the engine stays
//! the submit/reap loop of fio's `do_io`, and each fio option's mechanism
//! is in its own module ([`crate::rate`], [`crate::logs`]); this type only
//! ties them to one job thread.

use crate::logs::JobLogs;
use crate::rate::{DepthProbe, FlowMember, Pacer, SteadyTracker};
use crate::spec::{Ddir, JobSpec};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::time::Duration;

/// May the loop issue now?
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gate {
    Go,
    /// Not before this time (rate or thinktime).
    Until(u64),
    /// Not until another job of the flow group catches up.
    Flow(Duration),
    /// The job has done all it may (`number_ios`) or is steady.
    Done,
}

pub(crate) struct Controls {
    pacer: Option<Pacer>,
    flow: Option<FlowMember>,
    flow_sleep: Duration,
    pub probe: Option<DepthProbe>,
    steady: Option<SteadyTracker>,
    pub logs: Option<JobLogs>,
    rng: SmallRng,
    number_ios: Option<u64>,
    pub issued_ios: u64,
    sync_every: u32,
    writes_since_sync: u32,
    /// A flush is owed (fsync/fdatasync count reached).
    pub sync_owed: bool,
    pub steady_attained: bool,
}

impl Controls {
    pub fn new(spec: &JobSpec, thread_number: u32, now: u64, depth: u32) -> Controls {
        let paced = spec.rate.limited() || !spec.thinktime.time.is_zero();
        let sync_every = match (spec.fsync, spec.fdatasync) {
            (0, d) => d,
            (f, 0) => f,
            (f, d) => f.min(d),
        };
        Controls {
            pacer: paced.then(|| Pacer::new(&spec.rate, &spec.thinktime, now)),
            flow: FlowMember::join(&spec.flow),
            flow_sleep: spec.flow.sleep,
            probe: spec
                .latency_target
                .as_ref()
                .filter(|t| !t.target.is_zero())
                .map(|t| DepthProbe::new(t, depth, now)),
            steady: spec
                .steadystate
                .as_ref()
                .filter(|s| !s.dur.is_zero())
                .map(|s| SteadyTracker::new(s, now)),
            logs: JobLogs::new(&spec.logs, thread_number, now),
            rng: SmallRng::seed_from_u64(spec.randseed ^ 0x7261_7465 ^ thread_number as u64),
            number_ios: spec.number_ios,
            issued_ios: 0,
            sync_every,
            writes_since_sync: 0,
            sync_owed: false,
            steady_attained: false,
        }
    }

    /// The measured phase starts at `now` (after the ramp).
    pub fn restart(&mut self, now: u64) {
        if let Some(p) = &mut self.pacer {
            p.restart(now);
        }
        if let Some(l) = &mut self.logs {
            l.restart(now);
        }
        self.issued_ios = 0;
    }

    /// The depth the loop may fill to.
    pub fn depth(&self, max: u32) -> u32 {
        self.probe.as_ref().map_or(max, |p| p.depth.min(max))
    }

    /// May an I/O of `dir` go at `now`?
    pub fn gate(&mut self, dir: Ddir, now: u64) -> Gate {
        if self.steady_attained || self.number_ios.is_some_and(|n| self.issued_ios >= n) {
            return Gate::Done;
        }
        if let Some(p) = &self.pacer {
            let due = p.due_ns(dir as usize);
            if due > now {
                return Gate::Until(due);
            }
        }
        if let Some(f) = &mut self.flow {
            if !f.may_issue() {
                return Gate::Flow(self.flow_sleep);
            }
        }
        Gate::Go
    }

    /// An I/O of `dir` and `bytes` went out at `now`.
    pub fn issued(&mut self, dir: Ddir, bytes: u64, now: u64) {
        self.issued_ios += 1;
        if let Some(p) = &mut self.pacer {
            p.issued(dir as usize, bytes, now, &mut self.rng);
        }
        if dir == Ddir::Write && self.sync_every > 0 {
            self.writes_since_sync += 1;
            if self.writes_since_sync >= self.sync_every {
                self.writes_since_sync = 0;
                self.sync_owed = true;
            }
        }
    }

    /// `thinktime_spin`: spin this long of a think before sleeping.
    pub fn spin_ns(&self) -> u64 {
        self.pacer.as_ref().map_or(0, |p| p.spin_ns())
    }

    /// A completion at `done_ns` (measured phase only).
    pub fn completed(&mut self, dir: Ddir, len: u64, offset: u64, lat_ns: u64, done_ns: u64) {
        if let Some(p) = &mut self.probe {
            p.completed(lat_ns, done_ns);
        }
        if let Some(l) = &mut self.logs {
            l.completed(done_ns, dir as usize, len, offset, lat_ns);
        }
    }

    /// Feed the steady-state tracker the job's totals; true once steady.
    pub fn steady_tick(&mut self, now: u64, totals: (u64, u64, u64, u64)) -> bool {
        if let Some(s) = &mut self.steady {
            if s.tick(now, totals) {
                self.steady_attained = true;
            }
        }
        self.steady_attained
    }
}
