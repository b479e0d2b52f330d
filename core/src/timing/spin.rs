//! When a socket reader may busy-poll its socket before blocking, and for
//! how long: the NBD server's connection readers wait for requests this
//! way, and the `nbd` client leaf's reply readers for replies.
//!
//! Why: on a small VM an idle vCPU wakes long after the interrupt that
//! wakes it, often several times the whole cost of serving a 4 KiB request,
//! so at low queue depth the round trip is mostly the reader's wake-up.
//! Polling the socket for a short while instead of sleeping keeps the vCPU
//! awake for the next request; it is a loss whenever the next request does
//! not come soon (a 1 ms device, an idle client) or when another runnable
//! thread — the client itself, on a machine with few CPUs — needs the CPU the
//! poller holds.
//!
//! The policy follows the kernel's `net.core.busy_read` / `SO_BUSY_POLL`
//! (a bounded poll of one socket before the normal sleep; Unix sockets
//! have no kernel busy-poll, so it is done here with non-blocking `recv`)
//! and the way
//! adaptive mutexes and io_uring's hybrid poll keep spinning only while it
//! pays: each poll has a time bound; a poll that ends without data (a
//! miss) or that was interrupted because the CPU went to another thread
//! (preempted) makes the next few waits block at once, twice as many after
//! every further failure, up to [`MAX_BACKOFF`]; a hit resets that. So a
//! stream of short gaps keeps the reader polling, and long gaps or a busy
//! CPU cost at most one bounded poll per [`MAX_BACKOFF`] waits. The poller
//! yields the CPU between polls, so a runnable thread on the same CPU (the
//! client, often) runs at once instead of waiting for the poll to end; a
//! yield that kept the poller off its CPU for [`PREEMPT_GAP_NS`] counts as
//! preempted. No load average or clock of other threads is consulted: the
//! signals are this thread's own success rate and whether its own poll
//! loop was descheduled.
//!
//! Adaptive mode ([`SpinPolicy::adaptive`], `serve --poll-us auto`)
//! sizes the bound itself, as qemu's event loop does (util/aio-posix.c,
//! `adjust_polling_time`, with its default `poll-grow` 2 and
//! `poll-shrink` 0): the caller reports how long each whole wait for
//! input lasted (poll and sleep together, [`SpinPolicy::record_block`]);
//! a wait the current window covered changes nothing, one longer than the
//! limit closes the window (a slow device, an idle client), and a shorter
//! one grows it, from [`ADAPTIVE_START_NS`], doubling, up to the limit
//! ([`adjust_window`]). A closed window costs no poll at all, so a caller
//! that finds input waiting or waits long never spins; a preempted poll
//! closes the window too and holds it shut with the same backoff. A
//! request reader also says how many requests it read since its last
//! wait ([`SpinPolicy::record_wait`]): after several (a client that
//! pipelines) the wait counts as too long, so only a client in lockstep
//! is polled for.

use crate::clock::now_ns;

/// Waits blocked without polling after at most this many failures in a row
/// (so a 50 µs bound costs at most 50 µs / 64 per wait when polls never
/// pay).
pub const MAX_BACKOFF: u32 = 64;

/// A gap this long between two consecutive polls means the poller was not
/// running in between: the scheduler gave the CPU to another thread (or
/// the hypervisor to another vCPU). One poll iteration is a non-blocking
/// `recv`, well under a microsecond.
pub const PREEMPT_GAP_NS: u64 = 20_000;

/// How one bounded poll ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpinOutcome {
    /// Data arrived while polling.
    Hit,
    /// The bound passed without data.
    Miss,
    /// The poller lost its CPU to another thread: someone else needs it.
    Preempted,
}

/// Where an adaptive window opens (qemu's 4 µs).
pub const ADAPTIVE_START_NS: u64 = 4_000;

/// Limit of an adaptive window unless one is given (`auto` alone):
/// the fixed bound that paid at queue depth 1 in the benchmarks.
pub const ADAPTIVE_DEFAULT_MAX_NS: u64 = 50_000;

/// Largest poll bound `serve` takes, fixed or adaptive (the `nbd` leaf's
/// `poll_us` limit too): a poll is spent spinning, and anything longer is
/// a sleep's job.
pub const MAX_POLL_NS: u64 = 10_000_000;

/// qemu's `adjust_polling_time` (grow 2, shrink to 0) as a pure function:
/// the next window after a wait that lasted `block_ns` (poll and sleep
/// together) under `window`, with `max_ns` the limit.
pub fn adjust_window(window: u64, block_ns: u64, max_ns: u64) -> u64 {
    if block_ns <= window {
        // The window caught it: the sweet spot.
        window
    } else if block_ns > max_ns {
        // Polling would have had to last too long: stop.
        0
    } else if window < max_ns {
        match window {
            0 => ADAPTIVE_START_NS,
            w => w.saturating_mul(2),
        }
        .min(max_ns)
    } else {
        window
    }
}

/// How a reader polls, as `serve --poll-us` gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollSetting {
    /// Never poll: always block.
    Off,
    /// Poll up to this many ns per wait, with the miss backoff.
    Fixed(u64),
    /// Size the bound from the observed waits, up to this many ns.
    Adaptive(u64),
}

/// A `--poll-us` value that is neither a number of µs nor `auto[:MAX]`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PollSettingError {
    /// Not a number nor `auto[:MAX]`.
    #[error("poll bound {0:?}: want microseconds (0 = off), `auto` or `auto:MAX` (MAX in µs)")]
    Syntax(String),
    /// Past [`MAX_POLL_NS`].
    #[error("poll bound {0} µs: at most {max} µs", max = MAX_POLL_NS / 1000)]
    TooLong(u64),
    /// `auto:0`.
    #[error("poll bound `auto:0`: an adaptive limit must be at least 1 µs (0 is `--poll-us 0`)")]
    ZeroLimit,
}

impl std::str::FromStr for PollSetting {
    type Err = PollSettingError;
    fn from_str(s: &str) -> Result<PollSetting, PollSettingError> {
        let syntax = || PollSettingError::Syntax(s.to_string());
        let us = |v: &str| -> Result<u64, PollSettingError> {
            let us: u64 = v.parse().map_err(|_| syntax())?;
            if us > MAX_POLL_NS / 1000 {
                return Err(PollSettingError::TooLong(us));
            }
            Ok(us * 1000)
        };
        match s.split_once(':') {
            None if s == "auto" => Ok(PollSetting::Adaptive(ADAPTIVE_DEFAULT_MAX_NS)),
            None => Ok(match us(s)? {
                0 => PollSetting::Off,
                ns => PollSetting::Fixed(ns),
            }),
            Some(("auto", max)) => match us(max)? {
                0 => Err(PollSettingError::ZeroLimit),
                ns => Ok(PollSetting::Adaptive(ns)),
            },
            Some(_) => Err(syntax()),
        }
    }
}

impl std::fmt::Display for PollSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            PollSetting::Off => write!(f, "0"),
            PollSetting::Fixed(ns) => write!(f, "{}", ns / 1000),
            PollSetting::Adaptive(ns) => write!(f, "auto:{}", ns / 1000),
        }
    }
}

/// Per-connection polling state; owned by the connection's reader.
#[derive(Debug)]
pub struct SpinPolicy {
    /// Poll bound (adaptive: the current window); 0 = never poll.
    budget_ns: u64,
    /// Adaptive: the window's limit; 0 for a fixed bound.
    max_ns: u64,
    /// Waits left that block without polling.
    skip: u32,
    /// Waits to skip after the next failure.
    backoff: u32,
    /// The current wait is one of the skipped ones.
    held: bool,
}

impl SpinPolicy {
    /// A policy that polls for up to `budget_ns` per wait before blocking
    /// (0: never poll).
    pub fn new(budget_ns: u64) -> SpinPolicy {
        SpinPolicy {
            budget_ns,
            max_ns: 0,
            skip: 0,
            backoff: 1,
            held: false,
        }
    }

    /// An adaptive policy whose window (closed at first) follows the
    /// waits reported to [`record_block`](Self::record_block), up to
    /// `max_ns`.
    pub fn adaptive(max_ns: u64) -> SpinPolicy {
        SpinPolicy {
            budget_ns: 0,
            max_ns: max_ns.min(MAX_POLL_NS),
            skip: 0,
            backoff: 1,
            held: false,
        }
    }

    /// The policy a [`PollSetting`] asks for.
    pub fn from_setting(s: PollSetting) -> SpinPolicy {
        match s {
            PollSetting::Off => SpinPolicy::new(0),
            PollSetting::Fixed(ns) => SpinPolicy::new(ns),
            PollSetting::Adaptive(max) => SpinPolicy::adaptive(max),
        }
    }

    /// Whether the bound adapts to the waits ([`Self::adaptive`]).
    pub fn is_adaptive(&self) -> bool {
        self.max_ns > 0
    }

    /// The bound the next poll would get (adaptive: the window).
    pub fn window_ns(&self) -> u64 {
        self.budget_ns
    }

    /// Adaptive: one whole wait for input (from running out of input to
    /// having some, poll and sleep included) lasted `block_ns`. Nothing
    /// for a fixed bound; ignored for the waits a preemption holds the
    /// window shut.
    pub fn record_block(&mut self, block_ns: u64) {
        if self.max_ns > 0 && !self.held {
            self.budget_ns = adjust_window(self.budget_ns, block_ns, self.max_ns);
        }
    }

    /// Adaptive, for a request stream: a wait of `block_ns` that followed
    /// `round` requests read since the previous wait. Only a client in
    /// lockstep (at most one request: it sent it and waits for the reply
    /// before the next) is served by a poll. A client with several out
    /// keeps sending while the reader sleeps, and what it sends meanwhile
    /// is taken in one read and answered in one send, where a poll would
    /// take it piecemeal: a round of system calls and a client wake-up for
    /// every few requests. Such a wait counts as one too long to poll for
    /// (it shuts the window). qemu needs no such rule: it polls virtqueue
    /// and completion rings, where a try that finds one request is a
    /// memory load, not a system call.
    pub fn record_wait(&mut self, block_ns: u64, round: u32) {
        self.record_block(if round > 1 { u64::MAX } else { block_ns });
    }

    /// Called once per wait for input: `Some(bound)` to poll that long
    /// first, `None` to block at once.
    pub fn next_wait(&mut self) -> Option<u64> {
        // Skips count down first: an adaptive window a preemption shut
        // reopens only after them.
        self.held = self.skip > 0;
        if self.held {
            self.skip -= 1;
            return None;
        }
        if self.budget_ns == 0 {
            return None;
        }
        Some(self.budget_ns)
    }

    /// How the poll that [`next_wait`](Self::next_wait) allowed ended.
    pub fn record(&mut self, outcome: SpinOutcome) {
        if self.max_ns > 0 {
            return self.record_adaptive(outcome);
        }
        match outcome {
            SpinOutcome::Hit => self.backoff = 1,
            SpinOutcome::Miss | SpinOutcome::Preempted => {
                self.skip = self.backoff;
                // A preempted poll means the CPU is contended: back off
                // faster than after a plain miss.
                let step = if outcome == SpinOutcome::Preempted {
                    4
                } else {
                    2
                };
                self.backoff = (self.backoff * step).min(MAX_BACKOFF);
            }
        }
    }
}

impl SpinPolicy {
    /// Adaptive: a miss says nothing the wait's length will not
    /// ([`Self::record_block`]); a preempted poll means another thread
    /// needs this CPU, so the window closes and stays shut for the next
    /// few waits, more after every further preemption.
    fn record_adaptive(&mut self, outcome: SpinOutcome) {
        match outcome {
            SpinOutcome::Hit => self.backoff = 1,
            SpinOutcome::Miss => {}
            SpinOutcome::Preempted => {
                self.budget_ns = 0;
                self.skip = self.backoff;
                self.backoff = (self.backoff * 4).min(MAX_BACKOFF);
            }
        }
    }
}

/// Slice asked of the scheduler for a connection's reader.
pub const READER_SLICE_NS: u64 = 100_000;

/// Ask the scheduler for a short slice for the calling reader (see
/// [`super::set_thread_sched_slice_ns`]): a reader that polls yields
/// between polls and runs a few microseconds per request, so a short
/// slice costs it nothing and gets its CPU back at once. A reader that
/// only blocks should not ask: at wake-up it would preempt a client
/// still sending on its CPU, once per request of the client's burst.
pub fn ask_short_slice() {
    super::set_thread_sched_slice_ns(READER_SLICE_NS);
}

/// One bounded poll as `policy` allows: call `try_once` (a non-blocking
/// read) until it gives data, the bound passes, or the poller is found to
/// have lost its CPU; yield between tries. `Ok(None)` when the caller
/// must block instead (the outcome is recorded in `policy` either way).
pub fn poll_for<T>(
    policy: &mut SpinPolicy,
    mut try_once: impl FnMut() -> std::io::Result<Option<T>>,
) -> std::io::Result<Option<T>> {
    let Some(bound) = policy.next_wait() else {
        return Ok(None);
    };
    let start = now_ns();
    let mut prev = start;
    loop {
        if let Some(v) = try_once()? {
            policy.record(SpinOutcome::Hit);
            return Ok(Some(v));
        }
        let now = now_ns();
        if now - prev > PREEMPT_GAP_NS {
            policy.record(SpinOutcome::Preempted);
            return Ok(None);
        }
        if now - start >= bound {
            policy.record(SpinOutcome::Miss);
            return Ok(None);
        }
        prev = now;
        // Polling must not keep a runnable thread off this CPU (on a small
        // machine often the peer that has to run to send what is polled
        // for): yield between polls. With nobody else runnable this is a
        // cheap syscall; with someone, they run, and the gap check above
        // ends the poll if they held the CPU long.
        // SAFETY: plain syscall without arguments.
        unsafe { libc::sched_yield() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Count how many of `waits` waits poll, given each poll's outcome.
    fn polls(p: &mut SpinPolicy, waits: usize, outcome: SpinOutcome) -> usize {
        let mut n = 0;
        for _ in 0..waits {
            if p.next_wait().is_some() {
                n += 1;
                p.record(outcome);
            }
        }
        n
    }

    #[test]
    fn poll_for_returns_what_arrives_and_records_a_hit() {
        // poll_for yields between tries; on a loaded machine a yield can
        // lose the CPU for longer than the preemption gap, which ends that
        // poll as it should (and backs off). Such runs are retried.
        for _ in 0..100 {
            let mut p = SpinPolicy::new(1_000_000_000);
            let mut calls = 0;
            let got = poll_for(&mut p, || {
                calls += 1;
                Ok((calls == 3).then_some(7))
            });
            match got.unwrap() {
                Some(v) => {
                    assert_eq!((v, calls), (7, 3));
                    assert_eq!((p.skip, p.backoff), (0, 1));
                    return;
                }
                None => assert!(p.next_wait().is_none(), "ended early: preempted"),
            }
        }
        panic!("100 polls in a row were preempted");
    }

    #[test]
    fn poll_for_gives_up_at_the_bound_and_backs_off() {
        let mut p = SpinPolicy::new(1);
        let got = poll_for(&mut p, || Ok(None::<u8>));
        assert_eq!(got.unwrap(), None);
        // Missed (or preempted): the next wait blocks without polling.
        assert_eq!(p.next_wait(), None);
        let mut never = SpinPolicy::new(0);
        let got = poll_for(&mut never, || -> std::io::Result<Option<u8>> {
            panic!("a zero budget must not poll")
        });
        assert_eq!(got.unwrap(), None);
    }

    #[test]
    fn poll_for_passes_errors_through() {
        let mut p = SpinPolicy::new(1_000_000);
        let got = poll_for(&mut p, || -> std::io::Result<Option<u8>> {
            Err(std::io::ErrorKind::ConnectionReset.into())
        });
        assert_eq!(got.unwrap_err().kind(), std::io::ErrorKind::ConnectionReset);
    }

    #[test]
    fn zero_budget_never_polls() {
        let mut p = SpinPolicy::new(0);
        assert_eq!(polls(&mut p, 100, SpinOutcome::Hit), 0);
    }

    #[test]
    fn hits_keep_polling_every_wait() {
        let mut p = SpinPolicy::new(50_000);
        assert_eq!(polls(&mut p, 100, SpinOutcome::Hit), 100);
        assert_eq!(p.next_wait(), Some(50_000));
    }

    #[test]
    fn misses_back_off_exponentially_to_the_cap() {
        let mut p = SpinPolicy::new(50_000);
        // Skips after each miss: 1, 2, 4, ..., 64, 64, ...
        let mut seen = Vec::new();
        let mut since = 0;
        for _ in 0..400 {
            match p.next_wait() {
                Some(_) => {
                    seen.push(since);
                    since = 0;
                    p.record(SpinOutcome::Miss);
                }
                None => since += 1,
            }
        }
        assert_eq!(&seen[..9], &[0, 1, 2, 4, 8, 16, 32, 64, 64]);
    }

    #[test]
    fn preemption_backs_off_faster_than_a_miss() {
        let mut miss = SpinPolicy::new(50_000);
        let mut pre = SpinPolicy::new(50_000);
        assert!(
            polls(&mut pre, 200, SpinOutcome::Preempted) < polls(&mut miss, 200, SpinOutcome::Miss)
        );
    }

    #[test]
    fn a_hit_after_misses_resets_the_backoff() {
        let mut p = SpinPolicy::new(50_000);
        polls(&mut p, 100, SpinOutcome::Miss);
        // Drain the current skip, then poll once and hit.
        while p.next_wait().is_none() {}
        p.record(SpinOutcome::Hit);
        assert_eq!(polls(&mut p, 10, SpinOutcome::Hit), 10);
    }

    const US: u64 = 1_000;

    /// Feed `gaps` (whole waits, ns) to an adaptive policy of limit
    /// `max`: the windows it polls with, one per wait (0: blocked at once).
    fn windows(max: u64, gaps: &[u64]) -> Vec<u64> {
        let mut p = SpinPolicy::adaptive(max);
        gaps.iter()
            .map(|&g| {
                let w = p.next_wait().unwrap_or(0);
                if w > 0 {
                    let o = if g <= w {
                        SpinOutcome::Hit
                    } else {
                        SpinOutcome::Miss
                    };
                    p.record(o);
                }
                p.record_block(g);
                w
            })
            .collect()
    }

    #[test]
    fn adjust_window_follows_qemu() {
        let mut w = 0;
        let mut seen = Vec::new();
        for _ in 0..6 {
            w = adjust_window(w, 40 * US, 50 * US);
            seen.push(w / US);
        }
        assert_eq!(seen, [4, 8, 16, 32, 50, 50]);
        // A wait the window covered changes nothing.
        assert_eq!(adjust_window(16 * US, 10 * US, 50 * US), 16 * US);
        assert_eq!(adjust_window(0, 0, 50 * US), 0);
        // Longer than the limit: polling could not have caught it.
        assert_eq!(adjust_window(50 * US, 51 * US, 50 * US), 0);
        assert_eq!(adjust_window(0, 1_000 * US, 50 * US), 0);
        // A limit below the start opens at the limit.
        assert_eq!(adjust_window(0, 2 * US, 3 * US), 3 * US);
    }

    #[test]
    fn short_gaps_open_the_window_up_to_the_limit() {
        // A QD1 client answering within 20 µs: polled from the 2nd wait,
        // and every wait from the 4th on is caught (window 32 >= 20).
        let w = windows(50 * US, &[20 * US; 8]);
        assert_eq!(w, [0, 4, 8, 16, 32, 32, 32, 32].map(|x| x * US));
    }

    #[test]
    fn a_slow_device_never_opens_the_window() {
        // Every wait lasts a 1 ms device's latency: never polled.
        assert!(windows(50 * US, &[1_000 * US; 100]).iter().all(|&w| w == 0));
        // Opened by short gaps, one long wait closes it at once.
        let mut gaps = vec![10 * US; 5];
        gaps.extend([1_000 * US, 10 * US]);
        let w = windows(50 * US, &gaps);
        assert_eq!(w[5], 16 * US);
        assert_eq!(w[6], 0);
    }

    #[test]
    fn input_already_waiting_costs_no_poll() {
        // A deep queue whose reader always finds the next request queued.
        assert!(windows(50 * US, &[0; 100]).iter().all(|&w| w == 0));
    }

    #[test]
    fn preemption_shuts_the_window_for_a_growing_number_of_waits() {
        let mut p = SpinPolicy::adaptive(50 * US);
        for _ in 0..5 {
            p.record_block(40 * US);
        }
        assert_eq!(p.next_wait(), Some(50 * US));
        p.record(SpinOutcome::Preempted);
        // Shut; the next wait blocks and teaches nothing.
        assert_eq!((p.window_ns(), p.next_wait()), (0, None));
        p.record_block(10 * US);
        assert_eq!(p.window_ns(), 0);
        // Then it learns again from the start.
        assert_eq!(p.next_wait(), None);
        p.record_block(10 * US);
        assert_eq!(p.next_wait(), Some(ADAPTIVE_START_NS));
        // A second preemption without a hit between: 4 waits held shut.
        p.record(SpinOutcome::Preempted);
        for _ in 0..4 {
            assert_eq!(p.next_wait(), None);
            p.record_block(10 * US);
        }
        assert_eq!(p.window_ns(), 0);
        assert_eq!(p.next_wait(), None);
        p.record_block(10 * US);
        assert_eq!(p.next_wait(), Some(ADAPTIVE_START_NS));
        // A hit resets the hold-off to one wait.
        p.record(SpinOutcome::Hit);
        p.record_block(US);
        assert_eq!(p.next_wait(), Some(ADAPTIVE_START_NS));
        p.record(SpinOutcome::Preempted);
        assert_eq!(p.next_wait(), None);
        p.record_block(10 * US);
        assert_eq!(p.next_wait(), None);
        p.record_block(10 * US);
        assert_eq!(p.next_wait(), Some(ADAPTIVE_START_NS));
    }

    #[test]
    fn a_pipelining_client_is_not_polled_for() {
        let mut p = SpinPolicy::adaptive(50 * US);
        // Short gaps, but several requests per round (a deep queue).
        for round in [2, 5, 64, 2] {
            p.record_wait(10 * US, round);
            assert_eq!(p.next_wait(), None);
        }
        // Lockstep (one request, or a partial one: 0): qemu's rule.
        for (round, want) in [(1, 4), (0, 8), (1, 16)] {
            p.record_wait(10 * US, round);
            assert_eq!(p.next_wait(), Some(want * US));
        }
        // One pipelined round shuts it again.
        p.record_wait(US, 3);
        assert_eq!(p.window_ns(), 0);
    }

    #[test]
    fn a_fixed_bound_ignores_wait_lengths() {
        let mut p = SpinPolicy::new(50 * US);
        assert!(!p.is_adaptive());
        p.record_block(1_000 * US);
        assert_eq!(p.next_wait(), Some(50 * US));
    }

    #[test]
    fn poll_settings_parse_and_print() {
        let ok = [
            ("0", PollSetting::Off),
            ("50", PollSetting::Fixed(50 * US)),
            ("auto", PollSetting::Adaptive(ADAPTIVE_DEFAULT_MAX_NS)),
            ("auto:80", PollSetting::Adaptive(80 * US)),
            ("10000", PollSetting::Fixed(MAX_POLL_NS)),
        ];
        for (s, want) in ok {
            let got: PollSetting = s.parse().unwrap();
            assert_eq!(got, want, "{s}");
            assert_eq!(got.to_string().parse::<PollSetting>().unwrap(), want);
        }
        let bad = [
            ("fast", PollSettingError::Syntax("fast".into())),
            ("auto:", PollSettingError::Syntax("auto:".into())),
            ("auto:x", PollSettingError::Syntax("auto:x".into())),
            ("on:50", PollSettingError::Syntax("on:50".into())),
            ("-1", PollSettingError::Syntax("-1".into())),
            ("10001", PollSettingError::TooLong(10_001)),
            ("auto:20000", PollSettingError::TooLong(20_000)),
            ("auto:0", PollSettingError::ZeroLimit),
        ];
        for (s, want) in bad {
            assert_eq!(s.parse::<PollSetting>().unwrap_err(), want, "{s}");
        }
    }
}
