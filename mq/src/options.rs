//! The engine's options: how many hardware queues and tags, how tags are
//! shared and woken, and how queue runs are made (kernel `struct
//! blk_mq_tag_set`'s `nr_hw_queues`, `queue_depth`, `reserved_tags`,
//! `flags`). How a driver completes its requests is the driver's business
//! (null_blk's completion mode lives in `drivers/block/null_blk/main.c`,
//! not in blk-mq), so it is not here.

use crate::sbitmap::{WakeWeight, WakeupAlgo, MAX_DEPTH};

/// Largest number of hardware queues.
pub const MAX_HW_QUEUES: u32 = 256;

/// Options of a queue (the engine-level knobs a leaf driver exposes as
/// `key=value` table args).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineOptions {
    /// Hardware queues (`submit_queues`), 1..=256.
    pub hw_queues: u32,
    /// Of which the last ones serve only `POLLED` bios (kernel
    /// `HCTX_TYPE_POLL`, the `poll_queues` of nvme and null_blk): their
    /// requests are completed by the submitters' polls, never by a
    /// completion thread. The others (at least one) take every other bio.
    pub poll_queues: u32,
    /// Tags per hardware queue, or in total when shared (`hw_queue_depth`).
    pub queue_depth: u32,
    /// Of which reserved.
    pub reserved_tags: u32,
    /// One tag set shared by all hardware queues.
    pub shared_tags: bool,
    /// With `shared_tags`: a fair share of it per active hardware queue
    /// (see `tags`).
    pub tag_fair_share: bool,
    /// The driver may sleep in `queue_rq`: queue runs always go to kblockd.
    pub blocking: bool,
    /// Which wakeup algorithm the tag sets' waiters use: the batched
    /// counters of "sbitmap: Use single per-bitmap counting to wake up queued
    /// tags" or the per-waitqueue countdown before it.
    pub tag_wakeup: WakeupAlgo,
    /// What a woken tag sleeper counts for (`WakeWeight`).
    pub tag_wake_weight: WakeWeight,
    /// The queued bit of "blk-mq: avoid repeatedly scheduling the same
    /// work to run hardware queue" (true) or post every time (false).
    pub run_dedup: bool,
    /// Run all hardware queues asynchronously on every completion.
    pub run_on_completion: bool,
    /// Tags in order (`BLK_MQ_F_TAG_RR`).
    pub round_robin_tags: bool,
    /// See `SbitmapQueue::with_rescue_timeout_ns` (0: never).
    pub rescue_timeout_ns: u64,
    /// Which process-wide kblockd pool posted queue runs go to.
    pub kblockd: KblockdKind,
}

/// The kblockd pool a queue posts its runs to (see `kblockd`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KblockdKind {
    /// One worker bound to each CPU; a run goes to the poster's CPU, as
    /// the kernel's kblockd (a per-CPU workqueue) does.
    #[default]
    PerCpu,
    /// Two unbound workers, any of them woken for any post.
    Unbound,
}

impl KblockdKind {
    /// The option value naming this kind, as `kblockd=` spells it.
    pub fn name(self) -> &'static str {
        match self {
            KblockdKind::PerCpu => "percpu",
            KblockdKind::Unbound => "unbound",
        }
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            hw_queues: 1,
            poll_queues: 0,
            queue_depth: 64,
            reserved_tags: 0,
            shared_tags: false,
            tag_fair_share: false,
            blocking: false,
            tag_wakeup: WakeupAlgo::Counter,
            tag_wake_weight: WakeWeight::Plug,
            run_dedup: true,
            run_on_completion: false,
            round_robin_tags: false,
            rescue_timeout_ns: 0,
            kblockd: KblockdKind::PerCpu,
        }
    }
}

/// An [`EngineOptions`] value out of range, named by its table key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EngineOptionsError {
    /// `submit_queues` was 0 or above the maximum.
    #[error("submit_queues={0} is out of range 1..={MAX_HW_QUEUES}")]
    HwQueues(u32),
    /// Every hardware queue would be a poll queue, leaving none for bios
    /// that do not poll.
    #[error("poll_queues={poll} must leave at least one of submit_queues={hw} for unpolled I/O")]
    PollQueues {
        /// The `poll_queues` asked for.
        poll: u32,
        /// The `submit_queues` they would be taken from.
        hw: u32,
    },
    /// `hw_queue_depth` was 0 or above the maximum.
    #[error("hw_queue_depth={0} is out of range 1..={MAX_DEPTH}")]
    QueueDepth(u32),
    /// `reserved_tags` would leave no tag for ordinary requests.
    #[error("reserved_tags={reserved} must be below hw_queue_depth={depth}")]
    ReservedTags {
        /// The `reserved_tags` asked for.
        reserved: u32,
        /// The `hw_queue_depth` they must stay below.
        depth: u32,
    },
}

impl EngineOptions {
    /// What a queue with these options offers a submitter: the hardware
    /// queues that take unpolled bios and the tags each may use (a shared
    /// set's fair share, as blk-mq's `hctx_may_queue` divides one among
    /// its active users), reserved tags left out.
    pub fn queue_shape(&self) -> blkstack_core::QueueShape {
        let hw_queues = self.hw_queues.saturating_sub(self.poll_queues).max(1);
        let tags = self.queue_depth.saturating_sub(self.reserved_tags).max(1);
        let depth = if self.shared_tags {
            tags.div_ceil(self.hw_queues.max(1)).max(1)
        } else {
            tags
        };
        blkstack_core::QueueShape { hw_queues, depth }
    }

    /// Check the options before a queue is built from them, so a bad table
    /// line fails at load with a message, not later at I/O.
    pub fn validate(&self) -> Result<(), EngineOptionsError> {
        if self.hw_queues == 0 || self.hw_queues > MAX_HW_QUEUES {
            return Err(EngineOptionsError::HwQueues(self.hw_queues));
        }
        if self.poll_queues >= self.hw_queues {
            return Err(EngineOptionsError::PollQueues {
                poll: self.poll_queues,
                hw: self.hw_queues,
            });
        }
        if self.queue_depth == 0 || self.queue_depth > MAX_DEPTH {
            return Err(EngineOptionsError::QueueDepth(self.queue_depth));
        }
        if self.reserved_tags >= self.queue_depth {
            return Err(EngineOptionsError::ReservedTags {
                reserved: self.reserved_tags,
                depth: self.queue_depth,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shape_leaves_out_poll_queues_and_reserved_tags() {
        let o = EngineOptions {
            hw_queues: 4,
            poll_queues: 1,
            queue_depth: 64,
            reserved_tags: 4,
            ..EngineOptions::default()
        };
        assert_eq!(
            o.queue_shape(),
            blkstack_core::QueueShape {
                hw_queues: 3,
                depth: 60
            }
        );
        let shared = EngineOptions {
            hw_queues: 4,
            queue_depth: 64,
            shared_tags: true,
            ..EngineOptions::default()
        };
        assert_eq!(shared.queue_shape().depth, 16);
    }

    #[test]
    fn options_are_validated() {
        let bad = [
            EngineOptions {
                hw_queues: 0,
                ..EngineOptions::default()
            },
            EngineOptions {
                queue_depth: MAX_DEPTH + 1,
                ..EngineOptions::default()
            },
            EngineOptions {
                reserved_tags: 64,
                ..EngineOptions::default()
            },
            EngineOptions {
                hw_queues: 2,
                poll_queues: 2,
                ..EngineOptions::default()
            },
        ];
        let keys = [
            "submit_queues",
            "hw_queue_depth",
            "reserved_tags",
            "poll_queues=2",
        ];
        for (o, key) in bad.iter().zip(keys) {
            let e = o.validate().expect_err("out of range");
            assert!(e.to_string().contains(key), "{e}");
        }
        assert_eq!(EngineOptions::default().validate(), Ok(()));
    }
}
