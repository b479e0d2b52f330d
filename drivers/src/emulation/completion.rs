//! null_blk's completion knobs: `irqmode` (0 none: at once on the
//! submitting thread; 1 softirq: on a per-hardware-queue completion
//! thread; 2 timer: on that thread `completion_nsec` after issue), and two
//! of this project's: `iopoll=1` (timer mode: a `POLLED` bio waits on a
//! poll list for the submitter's own poll, as on null_blk's poll queues
//! and io_uring IOPOLL) and `timer_spin_ns=N` (timer mode: the completion
//! thread spins up to N ns before each deadline instead of trusting a
//! sleep to wake on time), and with `iopoll=1`, `poll_backstop_ms=N`: how
//! long past its due time a polled bio waits for a poll before the
//! completion thread ends it (see [`super::poll`]). As in Linux, where
//! `irqmode` is a parameter of `drivers/block/null_blk/main.c` and blk-mq
//! knows nothing of it, these are the driver's options, not the engine's.

use crate::args::KvArgs;
use crate::error::ArgError;
use std::fmt::Write;

/// null_blk's default `completion_nsec`.
pub const DEFAULT_COMPLETION_NSEC: u64 = 10_000;
/// Largest `timer_spin_ns`: a spin is only meant to cover a late wake.
pub const MAX_TIMER_SPIN_NS: u64 = 1_000_000;
/// Largest `completion_nsec` (a minute).
const MAX_COMPLETION_NSEC: u64 = 60_000_000_000;
/// Default `poll_backstop_ms`: a submitter that stops polling gets its
/// bios back soon after they are due.
pub const DEFAULT_POLL_BACKSTOP_MS: u64 = 1;
/// Largest `poll_backstop_ms` (a minute): a polled bio nobody polls is
/// always ended, so the wait stays bounded.
pub const MAX_POLL_BACKSTOP_MS: u64 = 60_000;

/// Where a request the driver finished is completed (null_blk `irqmode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CompletionMode {
    /// 0: at once, on the thread that issued it.
    #[default]
    Inline,
    /// 1: on the hardware queue's completion thread.
    Softirq,
    /// 2: on the completion thread, `nsec` after issue.
    Timer { nsec: u64 },
}

impl CompletionMode {
    /// null_blk's `irqmode` number.
    pub fn irqmode(self) -> u32 {
        match self {
            CompletionMode::Inline => 0,
            CompletionMode::Softirq => 1,
            CompletionMode::Timer { .. } => 2,
        }
    }
}

/// How a device completes its requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompletionOptions {
    pub mode: CompletionMode,
    /// Timer mode only: submitters may poll for `POLLED` bios.
    pub iopoll: bool,
    /// Timer mode only: the most the completion thread spins before a
    /// deadline (0 = it only sleeps, as null_blk's hrtimer).
    pub timer_spin_max_ns: u64,
    /// With `iopoll`: how long past its deadline a polled bio nobody
    /// polled waits before the completion thread ends it.
    pub poll_backstop_ms: u64,
}

impl Default for CompletionOptions {
    fn default() -> Self {
        CompletionOptions {
            mode: CompletionMode::default(),
            iopoll: false,
            timer_spin_max_ns: 0,
            poll_backstop_ms: DEFAULT_POLL_BACKSTOP_MS,
        }
    }
}

/// Completion options that do not go together.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CompletionOptionsError {
    #[error("timer_spin_ns={0} is out of range 0..={MAX_TIMER_SPIN_NS}")]
    SpinOutOfRange(u64),
    #[error("timer_spin_ns needs irqmode=2 (it times the timer completions)")]
    SpinNeedsTimer,
    #[error("iopoll=1 needs irqmode=2 (a timer completion the poller can reap)")]
    IopollNeedsTimer,
    #[error("poll_backstop_ms={0} is out of range 1..={MAX_POLL_BACKSTOP_MS}")]
    BackstopOutOfRange(u64),
    #[error("poll_backstop_ms needs iopoll=1 (it bounds how long a polled bio waits for a poll)")]
    BackstopNeedsIopoll,
}

impl CompletionOptions {
    pub fn validate(&self) -> Result<(), CompletionOptionsError> {
        let timer = matches!(self.mode, CompletionMode::Timer { .. });
        if self.timer_spin_max_ns > MAX_TIMER_SPIN_NS {
            return Err(CompletionOptionsError::SpinOutOfRange(
                self.timer_spin_max_ns,
            ));
        }
        if self.timer_spin_max_ns > 0 && !timer {
            return Err(CompletionOptionsError::SpinNeedsTimer);
        }
        if self.iopoll && !timer {
            return Err(CompletionOptionsError::IopollNeedsTimer);
        }
        if !(1..=MAX_POLL_BACKSTOP_MS).contains(&self.poll_backstop_ms) {
            return Err(CompletionOptionsError::BackstopOutOfRange(
                self.poll_backstop_ms,
            ));
        }
        if self.poll_backstop_ms != DEFAULT_POLL_BACKSTOP_MS && !self.iopoll {
            return Err(CompletionOptionsError::BackstopNeedsIopoll);
        }
        Ok(())
    }
}

/// The completion options as table args, plus `completion_nsec` when the
/// mode does not keep it (so that it round-trips through `table`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompletionArgs {
    pub opts: CompletionOptions,
    pub completion_nsec: u64,
}

impl Default for CompletionArgs {
    fn default() -> Self {
        CompletionArgs {
            opts: CompletionOptions::default(),
            completion_nsec: DEFAULT_COMPLETION_NSEC,
        }
    }
}

impl CompletionArgs {
    /// Args for options set from Rust.
    pub fn from_options(opts: CompletionOptions) -> CompletionArgs {
        let completion_nsec = match opts.mode {
            CompletionMode::Timer { nsec } => nsec,
            _ => DEFAULT_COMPLETION_NSEC,
        };
        CompletionArgs {
            opts,
            completion_nsec,
        }
    }

    /// Consume `irqmode`, `completion_nsec`, `iopoll`, `timer_spin_ns`
    /// and `poll_backstop_ms` from `kv` (their combination is checked by
    /// [`Self::validate`]).
    pub fn parse(kv: &mut KvArgs<'_>) -> Result<CompletionArgs, ArgError> {
        let irqmode = kv.take_u64("irqmode", 0, 0, 2)?;
        let completion_nsec = kv.take_u64(
            "completion_nsec",
            DEFAULT_COMPLETION_NSEC,
            0,
            MAX_COMPLETION_NSEC,
        )?;
        let iopoll = kv.take_bool("iopoll", false)?;
        let timer_spin_max_ns = kv.take_u64("timer_spin_ns", 0, 0, MAX_TIMER_SPIN_NS)?;
        let poll_backstop_ms = kv.take_u64(
            "poll_backstop_ms",
            DEFAULT_POLL_BACKSTOP_MS,
            1,
            MAX_POLL_BACKSTOP_MS,
        )?;
        let mode = match irqmode {
            0 => CompletionMode::Inline,
            1 => CompletionMode::Softirq,
            _ => CompletionMode::Timer {
                nsec: completion_nsec,
            },
        };
        Ok(CompletionArgs {
            opts: CompletionOptions {
                mode,
                iopoll,
                timer_spin_max_ns,
                poll_backstop_ms,
            },
            completion_nsec,
        })
    }

    /// [`CompletionOptions::validate`], worded for `driver`'s table line.
    pub fn validate(&self, driver: &'static str) -> Result<(), ArgError> {
        self.opts.validate().map_err(|e| ArgError::Conflict {
            driver,
            reason: e.to_string(),
        })
    }

    /// The non-default `irqmode` and `completion_nsec`, each preceded by
    /// a space (they come first in a table line).
    pub fn write_mode_args(&self, out: &mut String) {
        let irqmode = self.opts.mode.irqmode();
        if irqmode != 0 {
            let _ = write!(out, " irqmode={irqmode}");
        }
        if self.completion_nsec != DEFAULT_COMPLETION_NSEC {
            let _ = write!(out, " completion_nsec={}", self.completion_nsec);
        }
    }

    /// The non-default `iopoll`, `poll_backstop_ms` and `timer_spin_ns`
    /// (they come last).
    pub fn write_poll_args(&self, out: &mut String) {
        if self.opts.iopoll {
            out.push_str(" iopoll=1");
        }
        if self.opts.poll_backstop_ms != DEFAULT_POLL_BACKSTOP_MS {
            let _ = write!(out, " poll_backstop_ms={}", self.opts.poll_backstop_ms);
        }
        if self.opts.timer_spin_max_ns != 0 {
            let _ = write!(out, " timer_spin_ns={}", self.opts.timer_spin_max_ns);
        }
    }

    /// `irqmode=N`, as `status` starts the configuration.
    pub fn describe_mode(&self) -> String {
        format!("irqmode={}", self.opts.mode.irqmode())
    }

    /// In timer mode, ` completion_nsec=.. iopoll=.. timer_spin_ns=..`,
    /// then ` poll_backstop_ms=..` with `iopoll=1`; otherwise nothing.
    pub fn describe_timer(&self) -> String {
        match self.opts.mode {
            CompletionMode::Timer { nsec } => {
                let mut s = format!(
                    " completion_nsec={nsec} iopoll={} timer_spin_ns={}",
                    self.opts.iopoll as u8, self.opts.timer_spin_max_ns
                );
                if self.opts.iopoll {
                    let _ = write!(s, " poll_backstop_ms={}", self.opts.poll_backstop_ms);
                }
                s
            }
            _ => String::new(),
        }
    }
}
