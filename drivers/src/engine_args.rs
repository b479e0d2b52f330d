//! The blk-mq engine's knobs as leaf-driver table args, shared by `null`
//! and `memory`: parsed from `key=value` and printed back canonically
//! (only non-defaults, in one fixed order) so that `dmsetup table` output
//! parses back to the same device.
//!
//! Names follow null_blk's module parameters where one exists (`irqmode`,
//! `completion_nsec`, `hw_queue_depth`, `submit_queues`, `shared_tags`,
//! `blocking`); the rest select the mechanisms of seeds 001 and 003
//! (`run_dedup`, `run_on_completion`, `tag_wakeup`, `tag_wake_weight`),
//! `kblockd=percpu|unbound` picks the pool queue runs are posted to, and
//! `iopoll=1` (with `irqmode=2`) lets submitters reap polled bios, and
//! `timer_spin_ns=N` (with `irqmode=2`) lets the completion thread spin up
//! to N ns before each deadline instead of trusting a sleep to wake on time
//! (see `blkstack_mq::queue`'s `DeadlineClock`).
//! `shared_tags=1` shares one tag set among this device's hardware queues
//! (null_blk's `shared_tag_bitmap`), which is the sharing seed 003
//! measures: as in the kernel for one device, without a fair share.
//! `tag_fair_share=1` adds blk-mq's fair share per active user, treating
//! each hardware queue as the kernel treats each request queue of a tag
//! set shared by several (`BLK_MQ_F_TAG_QUEUE_SHARED`).

use crate::args::KvArgs;
use crate::error::ArgError;
use blkstack_mq::queue::{CompletionMode, EngineOptions, KblockdKind};
use blkstack_mq::sbitmap::{WakeWeight, WakeupAlgo, MAX_DEPTH};
use std::fmt::Write;

/// null_blk's default `completion_nsec`.
pub const DEFAULT_COMPLETION_NSEC: u64 = 10_000;

/// Engine options plus the one value they do not keep when the
/// completion mode is not the timer (`completion_nsec`), so that it
/// round-trips through `table_args`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineArgs {
    pub opts: EngineOptions,
    pub completion_nsec: u64,
}

impl EngineArgs {
    /// Defaults for a leaf driver: inline completion, depth 64, one queue.
    pub fn defaults() -> EngineArgs {
        EngineArgs {
            opts: EngineOptions::default(),
            completion_nsec: DEFAULT_COMPLETION_NSEC,
        }
    }

    /// Engine args built from options set in Rust (for experiments).
    pub fn from_options(opts: EngineOptions) -> EngineArgs {
        let completion_nsec = match opts.completion {
            CompletionMode::Timer { nsec } => nsec,
            _ => DEFAULT_COMPLETION_NSEC,
        };
        EngineArgs {
            opts,
            completion_nsec,
        }
    }

    /// Consume the engine keys from `kv`.
    pub fn parse(kv: &mut KvArgs<'_>) -> Result<EngineArgs, ArgError> {
        let d = EngineOptions::default();
        let irqmode = kv.take_u64("irqmode", 0, 0, 2)?;
        let completion_nsec = kv.take_u64(
            "completion_nsec",
            DEFAULT_COMPLETION_NSEC,
            0,
            60_000_000_000,
        )?;
        let queue_depth =
            kv.take_u64("hw_queue_depth", d.queue_depth as u64, 1, MAX_DEPTH as u64)? as u32;
        let hw_queues = kv.take_u64(
            "submit_queues",
            d.hw_queues as u64,
            1,
            blkstack_mq::queue::MAX_HW_QUEUES as u64,
        )? as u32;
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
        let iopoll = kv.take_bool("iopoll", d.iopoll)?;
        let timer_spin_max_ns = kv.take_u64(
            "timer_spin_ns",
            d.timer_spin_max_ns,
            0,
            blkstack_mq::queue::MAX_TIMER_SPIN_NS,
        )?;
        let kblockd = kv.take_choice(
            "kblockd",
            d.kblockd,
            &[
                ("percpu", KblockdKind::PerCpu),
                ("unbound", KblockdKind::Unbound),
            ],
        )?;
        let completion = match irqmode {
            0 => CompletionMode::Inline,
            1 => CompletionMode::Softirq,
            _ => CompletionMode::Timer {
                nsec: completion_nsec,
            },
        };
        let opts = EngineOptions {
            hw_queues,
            queue_depth,
            shared_tags,
            tag_fair_share,
            blocking,
            completion,
            tag_wakeup,
            tag_wake_weight,
            run_dedup,
            run_on_completion,
            rescue_timeout_ns: rescue_ms * 1_000_000,
            kblockd,
            iopoll,
            timer_spin_max_ns,
            ..d
        };
        opts.validate().map_err(|reason| ArgError::Conflict {
            driver: kv.driver(),
            reason,
        })?;
        Ok(EngineArgs {
            opts,
            completion_nsec,
        })
    }

    /// Append the non-default engine args, each preceded by a space.
    pub fn write_table_args(&self, out: &mut String) {
        let d = EngineOptions::default();
        let o = &self.opts;
        if o.completion.irqmode() != 0 {
            let _ = write!(out, " irqmode={}", o.completion.irqmode());
        }
        if self.completion_nsec != DEFAULT_COMPLETION_NSEC {
            let _ = write!(out, " completion_nsec={}", self.completion_nsec);
        }
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
        if o.iopoll {
            out.push_str(" iopoll=1");
        }
        if o.timer_spin_max_ns != 0 {
            let _ = write!(out, " timer_spin_ns={}", o.timer_spin_max_ns);
        }
    }

    /// The engine configuration as `status` shows it.
    pub fn describe(&self) -> String {
        let o = &self.opts;
        let mut s = format!(
            "irqmode={} hw_queue_depth={} submit_queues={} shared_tags={} tag_fair_share={} tag_wakeup={} tag_wake_weight={} run_dedup={} run_on_completion={} kblockd={}",
            o.completion.irqmode(),
            o.queue_depth,
            o.hw_queues,
            o.shared_tags as u8,
            o.tag_fair_share as u8,
            o.tag_wakeup.name(),
            o.tag_wake_weight.name(),
            if o.run_dedup { "on" } else { "off" },
            o.run_on_completion as u8,
            o.kblockd.name(),
        );
        if let CompletionMode::Timer { nsec } = o.completion {
            let _ = write!(
                s,
                " completion_nsec={nsec} iopoll={} timer_spin_ns={}",
                o.iopoll as u8, o.timer_spin_max_ns
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            "timer_spin_ns=100000",
        ];
        let e = parse(&args).unwrap();
        assert_eq!(e.opts.completion, CompletionMode::Timer { nsec: 20000 });
        assert_eq!(e.opts.queue_depth, 1024);
        assert_eq!(e.opts.tag_wakeup, WakeupAlgo::WaitCnt);
        assert_eq!(e.opts.tag_wake_weight, WakeWeight::One);
        assert!(!e.opts.run_dedup && e.opts.run_on_completion && e.opts.shared_tags);
        assert_eq!(e.opts.kblockd, KblockdKind::Unbound);
        assert!(e.opts.iopoll);
        assert_eq!(e.opts.timer_spin_max_ns, 100_000);
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
        ] {
            let e = parse(&[arg]).unwrap_err().to_string();
            assert!(e.contains(key), "{arg}: {e}");
        }
    }
}
