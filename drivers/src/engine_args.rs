//! The blk-mq engine's knobs as leaf-driver table args, shared by `null`
//! and `memory`: parsed from `key=value` and printed back canonically
//! (only non-defaults, in one fixed order) so that `dmsetup table` output
//! parses back to the same device.
//!
//! Names follow null_blk's module parameters where one exists
//! (`hw_queue_depth`, `submit_queues`, `shared_tags`, `blocking`); the
//! rest select the mechanisms of "blk-mq: avoid repeatedly scheduling the
//! same work to run hardware queue" (`run_dedup`, `run_on_completion`) and
//! "sbitmap: Use single per-bitmap counting to wake up queued tags"
//! (`tag_wakeup`, `tag_wake_weight`), and `kblockd=percpu|unbound` picks
//! the pool queue runs are posted to. `shared_tags=1` shares one tag set
//! among this device's hardware queues (null_blk's `shared_tag_bitmap`),
//! as in the kernel for one device, without a fair share;
//! `tag_fair_share=1` adds blk-mq's fair share per active user, treating
//! each hardware queue as the kernel treats each request queue of a tag
//! set shared by several (`BLK_MQ_F_TAG_QUEUE_SHARED`).
//!
//! The completion knobs (`irqmode`, `completion_nsec`, `iopoll`,
//! `poll_backstop_ms`, `timer_spin_ns`) are null_blk's, not the engine's:
//! they are defined in [`crate::emulation::completion`] and only read and
//! printed here, in the table's order, so that `null` and `memory` lines
//! keep one syntax.

use crate::args::KvArgs;
use crate::emulation::completion::CompletionArgs;
use crate::emulation::{EmulatedDisk, EmulatedQueueError};
use crate::error::ArgError;
use blkstack_mq::sbitmap::{WakeWeight, WakeupAlgo, MAX_DEPTH};
use blkstack_mq::{DiskLimits, Driver, EngineOptions, KblockdKind, MAX_HW_QUEUES};
use std::fmt::Write;

/// Engine options plus the completion mode a leaf driver runs them with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineArgs {
    pub opts: EngineOptions,
    pub completion: CompletionArgs,
}

impl EngineArgs {
    /// Defaults for a leaf driver: inline completion, depth 64, one queue.
    pub fn defaults() -> EngineArgs {
        EngineArgs {
            opts: EngineOptions::default(),
            completion: CompletionArgs::default(),
        }
    }

    /// Engine args built from options set in Rust (for experiments), with
    /// inline completion.
    pub fn from_options(opts: EngineOptions) -> EngineArgs {
        EngineArgs {
            opts,
            completion: CompletionArgs::default(),
        }
    }

    /// Consume the engine and completion keys from `kv`.
    pub fn parse(kv: &mut KvArgs<'_>) -> Result<EngineArgs, ArgError> {
        let completion = CompletionArgs::parse(kv)?;
        let opts = parse_engine_options(kv)?;
        opts.validate().map_err(|e| ArgError::Conflict {
            driver: kv.driver(),
            reason: e.to_string(),
        })?;
        completion.validate(kv.driver())?;
        Ok(EngineArgs { opts, completion })
    }

    /// The emulated disk over `driver` these args ask for: the engine's
    /// options and the completion mode.
    pub fn disk<D: Driver>(
        &self,
        driver: D,
        limits: DiskLimits,
    ) -> Result<EmulatedDisk<D>, EmulatedQueueError> {
        EmulatedDisk::new(driver, self.opts.clone(), self.completion.opts, limits)
    }

    /// Append the non-default args, each preceded by a space.
    pub fn write_table_args(&self, out: &mut String) {
        let d = EngineOptions::default();
        let o = &self.opts;
        self.completion.write_mode_args(out);
        if o.queue_depth != d.queue_depth {
            let _ = write!(out, " hw_queue_depth={}", o.queue_depth);
        }
        if o.hw_queues != d.hw_queues {
            let _ = write!(out, " submit_queues={}", o.hw_queues);
        }
        if o.shared_tags {
            out.push_str(" shared_tags=1");
        }
        if o.tag_fair_share {
            out.push_str(" tag_fair_share=1");
        }
        if o.blocking {
            out.push_str(" blocking=1");
        }
        if o.tag_wakeup != d.tag_wakeup {
            let _ = write!(out, " tag_wakeup={}", o.tag_wakeup.name());
        }
        if o.tag_wake_weight != d.tag_wake_weight {
            let _ = write!(out, " tag_wake_weight={}", o.tag_wake_weight.name());
        }
        if !o.run_dedup {
            out.push_str(" run_dedup=off");
        }
        if o.run_on_completion {
            out.push_str(" run_on_completion=1");
        }
        if o.rescue_timeout_ns != 0 {
            let _ = write!(out, " tag_rescue_ms={}", o.rescue_timeout_ns / 1_000_000);
        }
        if o.kblockd != d.kblockd {
            let _ = write!(out, " kblockd={}", o.kblockd.name());
        }
        self.completion.write_poll_args(out);
    }

    /// The engine configuration as `status` shows it.
    pub fn describe(&self) -> String {
        let o = &self.opts;
        format!(
            "{} hw_queue_depth={} submit_queues={} shared_tags={} tag_fair_share={} tag_wakeup={} tag_wake_weight={} run_dedup={} run_on_completion={} kblockd={}{}",
            self.completion.describe_mode(),
            o.queue_depth,
            o.hw_queues,
            o.shared_tags as u8,
            o.tag_fair_share as u8,
            o.tag_wakeup.name(),
            o.tag_wake_weight.name(),
            if o.run_dedup { "on" } else { "off" },
            o.run_on_completion as u8,
            o.kblockd.name(),
            self.completion.describe_timer(),
        )
    }
}

/// The engine's own keys (not yet validated together).
fn parse_engine_options(kv: &mut KvArgs<'_>) -> Result<EngineOptions, ArgError> {
    let d = EngineOptions::default();
    let queue_depth =
        kv.take_u64("hw_queue_depth", d.queue_depth as u64, 1, MAX_DEPTH as u64)? as u32;
    let hw_queues =
        kv.take_u64("submit_queues", d.hw_queues as u64, 1, MAX_HW_QUEUES as u64)? as u32;
    let shared_tags = kv.take_bool("shared_tags", d.shared_tags)?;
    let tag_fair_share = kv.take_bool("tag_fair_share", d.tag_fair_share)?;
    let blocking = kv.take_bool("blocking", d.blocking)?;
    let tag_wakeup = kv.take_choice(
        "tag_wakeup",
        d.tag_wakeup,
        &[
            ("counter", WakeupAlgo::Counter),
            ("wait_cnt", WakeupAlgo::WaitCnt),
            ("counter_first_queue", WakeupAlgo::CounterFirstQueue),
        ],
    )?;
    let tag_wake_weight = kv.take_choice(
        "tag_wake_weight",
        d.tag_wake_weight,
        &[("plug", WakeWeight::Plug), ("one", WakeWeight::One)],
    )?;
    let run_dedup = kv.take_bool("run_dedup", d.run_dedup)?;
    let run_on_completion = kv.take_bool("run_on_completion", d.run_on_completion)?;
    let rescue_ms = kv.take_u64("tag_rescue_ms", 0, 0, 3_600_000)?;
    let kblockd = kv.take_choice(
        "kblockd",
        d.kblockd,
        &[
            ("percpu", KblockdKind::PerCpu),
            ("unbound", KblockdKind::Unbound),
        ],
    )?;
    Ok(EngineOptions {
        hw_queues,
        queue_depth,
        shared_tags,
        tag_fair_share,
        blocking,
        tag_wakeup,
        tag_wake_weight,
        run_dedup,
        run_on_completion,
        rescue_timeout_ns: rescue_ms * 1_000_000,
        kblockd,
        ..d
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emulation::completion::CompletionMode;

    fn parse(args: &[&str]) -> Result<EngineArgs, ArgError> {
        let mut kv = KvArgs::parse("null", args)?;
        let e = EngineArgs::parse(&mut kv)?;
        kv.finish()?;
        Ok(e)
    }

    #[test]
    fn round_trip_every_key() {
        let args = [
            "irqmode=2",
            "completion_nsec=20000",
            "hw_queue_depth=1024",
            "submit_queues=4",
            "shared_tags=1",
            "tag_fair_share=1",
            "blocking=1",
            "tag_wakeup=wait_cnt",
            "tag_wake_weight=one",
            "run_dedup=off",
            "run_on_completion=1",
            "tag_rescue_ms=500",
            "kblockd=unbound",
            "iopoll=1",
            "poll_backstop_ms=250",
            "timer_spin_ns=100000",
        ];
        let e = parse(&args).unwrap();
        assert_eq!(
            e.completion.opts.mode,
            CompletionMode::Timer { nsec: 20000 }
        );
        assert_eq!(e.opts.queue_depth, 1024);
        assert_eq!(e.opts.tag_wakeup, WakeupAlgo::WaitCnt);
        assert_eq!(e.opts.tag_wake_weight, WakeWeight::One);
        assert!(!e.opts.run_dedup && e.opts.run_on_completion && e.opts.shared_tags);
        assert_eq!(e.opts.kblockd, KblockdKind::Unbound);
        assert!(e.completion.opts.iopoll);
        assert_eq!(e.completion.opts.timer_spin_max_ns, 100_000);
        assert_eq!(e.completion.opts.poll_backstop_ms, 250);
        let mut printed = String::new();
        e.write_table_args(&mut printed);
        assert_eq!(printed.trim(), args.join(" "));
        let again: Vec<&str> = printed.split_whitespace().collect();
        assert_eq!(parse(&again).unwrap(), e);
        let mut none = String::new();
        parse(&[]).unwrap().write_table_args(&mut none);
        assert_eq!(none, "");
    }

    #[test]
    fn bad_values_name_the_key() {
        for (arg, key) in [
            ("irqmode=3", "irqmode"),
            ("hw_queue_depth=0", "hw_queue_depth"),
            ("hw_queue_depth=10241", "hw_queue_depth"),
            ("submit_queues=0", "submit_queues"),
            ("tag_wakeup=fast", "tag_wakeup"),
            ("tag_wake_weight=2", "tag_wake_weight"),
            ("run_dedup=maybe", "run_dedup"),
            ("kblockd=global", "kblockd"),
            ("iopoll=yes", "iopoll"),
            ("iopoll=1", "irqmode=2"),
            ("timer_spin_ns=1000001", "timer_spin_ns"),
            ("timer_spin_ns=1000", "irqmode=2"),
            ("poll_backstop_ms=0", "poll_backstop_ms"),
            ("poll_backstop_ms=60001", "poll_backstop_ms"),
            ("poll_backstop_ms=5", "iopoll=1"),
        ] {
            let e = parse(&[arg]).unwrap_err().to_string();
            assert!(e.contains(key), "{arg}: {e}");
        }
    }
}
