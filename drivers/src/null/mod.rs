//! `null`: a device that does nothing, quickly (Linux `null_blk`), driven
//! through the blk-mq engine.
//!
//! Reads return zeroes, writes are dropped, every request succeeds. It
//! exists to measure the stack above it and the engine itself, the way
//! the blk-mq queue-run and sbitmap wakeup changes were measured against
//! null_blk, so it takes null_blk's knobs as table args: `bs=` (logical
//! block size, power of two in 512..=4096), its completion knobs
//! ([`crate::emulation::completion`]: `irqmode`, `completion_nsec`,
//! `iopoll`, `timer_spin_ns`), the engine args of [`crate::engine_args`]
//! (`hw_queue_depth`, `submit_queues`, `shared_tags`, `blocking`,
//! `tag_wakeup`, `tag_wake_weight`, `run_dedup`, `run_on_completion`,
//! `tag_rescue_ms`, `kblockd`), and `max_inflight=` (per hardware queue;
//! above it the driver answers busy, like a SCSI device whose queue is
//! full: the dispatch-list and queue-run paths need a driver that pushes
//! back; 0 = never busy, the default), and `zero_reads=0|1`.
//!
//! As in `drivers/block/null_blk/main.c`, the emulation (completion
//! threads, timer, poll list) is the driver's, in [`crate::emulation`],
//! which `memory` shares; the engine only sees a driver that ends its
//! requests later. The device itself is the engine's one leaf
//! [`Disk`], which [`NullDevice`] derefs to.
//!
//! `zero_reads=1` (the default) fills read buffers with zeroes, so what a
//! client reads agrees with the hole the device reports and never shows it
//! bytes from an earlier request (nbdkit's `null` plugin does the same).
//! `zero_reads=0` is null_blk's own behaviour without `memory_backed`: the
//! buffer is not touched, as a DMA device costs the CPU nothing per byte.
//! That is the right model when the CPU cost of the I/O path is what is
//! measured (fio's `null` engine does not touch buffers either); extents
//! then report data, since the contents are unknown.

use crate::args::{check_block_size, check_size, KvArgs};
use crate::emulation::{
    CompletionArgs, CompletionOptions, Emulated, EmulatedDisk, EmulatedQueueError, TimerStats,
};
use crate::engine_args::EngineArgs;
use crate::error::ArgError;
use blkstack_core::device::Extent;
use blkstack_core::{Features, Op, Status};
use blkstack_mq::{Disk, DiskLimits, Driver, EngineOptions, QueueRq, QueueStats, Rq};
use crossbeam_utils::CachePadded;
use std::fmt::Write;
use std::ops::Deref;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::Relaxed;

/// The null driver under the engine.
pub struct NullDriver {
    max_inflight: u32,
    zero_reads: bool,
    inflight: Box<[CachePadded<AtomicU32>]>,
}

impl Driver for NullDriver {
    #[inline]
    fn queue_rq(&self, rq: Rq<'_>) -> QueueRq {
        if self.max_inflight > 0 {
            let n = &self.inflight[rq.hctx as usize];
            if n.load(Relaxed) >= self.max_inflight {
                return QueueRq::Busy;
            }
            n.fetch_add(1, Relaxed);
        }
        if self.zero_reads && rq.bio.op == Op::Read {
            rq.bio.data_mut().fill(0);
        }
        QueueRq::Done(Status::Ok)
    }

    #[inline]
    fn complete(&self, rq: Rq<'_>, status: Status) -> Status {
        if self.max_inflight > 0 {
            self.inflight[rq.hctx as usize].fetch_sub(1, Relaxed);
        }
        status
    }

    /// Nothing is stored: one hole if reads give zeroes, else one run of
    /// data whose contents are unknown.
    fn extents(&self, offset: u64, end: u64) -> Option<Vec<Extent>> {
        if offset >= end {
            return Some(Vec::new());
        }
        Some(vec![Extent {
            offset,
            len: end - offset,
            hole: self.zero_reads,
        }])
    }
}

/// A null device: its table options and its disk.
pub struct NullDevice {
    block_size: u32,
    max_inflight: u32,
    zero_reads: bool,
    engine: EngineArgs,
    disk: EmulatedDisk<NullDriver>,
}

/// A `null` table line or device that cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum NullError {
    #[error(transparent)]
    Args(#[from] ArgError),
    /// The engine refused the options or a completion thread would not
    /// start (its reason as the engine words it).
    #[error("null: {0}")]
    Queue(#[from] EmulatedQueueError),
}

impl NullDevice {
    /// Build from a table line's length (in bytes) and its optional
    /// `key=value` args.
    pub fn from_args(size_bytes: u64, args: &[&str]) -> Result<Self, NullError> {
        let mut kv = KvArgs::parse("null", args)?;
        let block_size = kv.take_block_size("bs")?;
        let max_inflight = kv.take_u64("max_inflight", 0, 0, u32::MAX as u64)? as u32;
        let zero_reads = kv.take_bool("zero_reads", true)?;
        let engine = EngineArgs::parse(&mut kv)?;
        kv.finish()?;
        Self::build(size_bytes, block_size, max_inflight, zero_reads, engine)
    }

    /// Build with engine and completion options set from Rust
    /// (experiments, benches).
    pub fn with_options(
        size_bytes: u64,
        block_size: u32,
        max_inflight: u32,
        opts: EngineOptions,
        completion: CompletionOptions,
    ) -> Result<Self, NullError> {
        let block_size = check_block_size("null", "bs", block_size.into())?;
        opts.validate().map_err(|e| ArgError::Conflict {
            driver: "null",
            reason: e.to_string(),
        })?;
        let completion = CompletionArgs::from_options(completion);
        completion.validate("null")?;
        Self::build(
            size_bytes,
            block_size,
            max_inflight,
            true,
            EngineArgs { opts, completion },
        )
    }

    fn build(
        size_bytes: u64,
        block_size: u32,
        max_inflight: u32,
        zero_reads: bool,
        engine: EngineArgs,
    ) -> Result<Self, NullError> {
        check_size("null", size_bytes, block_size)?;
        let driver = NullDriver {
            max_inflight,
            zero_reads,
            inflight: (0..engine.opts.hw_queues)
                .map(|_| CachePadded::new(AtomicU32::new(0)))
                .collect(),
        };
        let features = Features {
            discard: true,
            write_zeroes: true,
            fast_zero: true,
            knows_holes: zero_reads,
            ..Features::default()
        };
        let disk = engine.disk(driver, DiskLimits::new(size_bytes, block_size, features))?;
        Ok(NullDevice {
            block_size,
            max_inflight,
            zero_reads,
            engine,
            disk,
        })
    }

    /// The args as `dmsetup table` prints them: only non-defaults, in a fixed
    /// order, so that parsing them again gives the same device.
    pub fn table_args(&self) -> String {
        let mut s = String::new();
        if self.block_size != 512 {
            let _ = write!(s, " bs={}", self.block_size);
        }
        if self.max_inflight != 0 {
            let _ = write!(s, " max_inflight={}", self.max_inflight);
        }
        if !self.zero_reads {
            s.push_str(" zero_reads=0");
        }
        self.engine.write_table_args(&mut s);
        s.trim_start().to_string()
    }

    /// Configuration, then the engine's live counters (tag use, waits,
    /// wakeups, queue runs posted vs deduplicated, requeues).
    pub fn status(&self) -> String {
        format!(
            "bs={} max_inflight={} zero_reads={} {} {}",
            self.block_size,
            self.max_inflight,
            u8::from(self.zero_reads),
            self.engine.describe(),
            self.disk.status()
        )
    }

    /// The engine's counters, for experiments.
    pub fn engine_stats(&self) -> QueueStats {
        self.disk.stats()
    }

    /// The timer-mode counters (irqmode=2): completions, how late, and
    /// the spin budget's CPU time.
    pub fn timer_stats(&self) -> TimerStats {
        self.disk.timer_stats()
    }
}

/// The device is the engine's leaf [`Disk`] (submission, checks, polling).
impl Deref for NullDevice {
    type Target = Disk<Emulated<NullDriver>>;

    fn deref(&self) -> &Disk<Emulated<NullDriver>> {
        &self.disk
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkstack_core::clock::now_ns;
    use blkstack_core::submit_and_wait;
    use blkstack_core::{Bio, Device};
    use std::time::Duration;

    #[test]
    fn reads_zero_writes_dropped() {
        for irq in ["irqmode=0", "irqmode=1", "irqmode=2"] {
            let d = NullDevice::from_args(1 << 20, &[irq]).unwrap();
            let mut buf = vec![0xabu8; 4096];
            assert_eq!(
                submit_and_wait(&*d, Op::Write, 0, 4096, &mut buf),
                Status::Ok
            );
            assert_eq!(
                submit_and_wait(&*d, Op::Read, 0, 4096, &mut buf),
                Status::Ok
            );
            assert!(buf.iter().all(|&b| b == 0));
            assert_eq!(submit_and_wait(&*d, Op::Flush, 0, 0, &mut []), Status::Ok);
            assert_eq!(
                submit_and_wait(&*d, Op::Discard, 0, 8192, &mut []),
                Status::Ok
            );
            assert_eq!(d.engine_stats().tags_in_use, 0);
        }
    }

    #[test]
    fn zero_reads_0_leaves_the_buffer_alone_and_reports_data() {
        let d = NullDevice::from_args(1 << 20, &["zero_reads=0"]).unwrap();
        let mut buf = vec![0xabu8; 4096];
        assert_eq!(
            submit_and_wait(&*d, Op::Read, 0, 4096, &mut buf),
            Status::Ok
        );
        assert!(buf.iter().all(|&b| b == 0xab));
        assert_eq!(d.table_args(), "zero_reads=0");
        let e = d.extents(0, 8192).unwrap();
        assert_eq!(e.len(), 1);
        assert!(!e[0].hole);
        assert!(!d.features().knows_holes);
        assert!(NullDevice::from_args(1 << 20, &["zero_reads=2"]).is_err());
    }

    #[test]
    fn bad_bios_are_refused() {
        let d = NullDevice::from_args(1 << 20, &["bs=4096"]).unwrap();
        let mut buf = vec![0u8; 512];
        assert_eq!(
            submit_and_wait(&*d, Op::Read, 0, 512, &mut buf),
            Status::Invalid
        );
        let mut buf = vec![0u8; 4096];
        assert_eq!(
            submit_and_wait(&*d, Op::Read, 1 << 20, 4096, &mut buf),
            Status::Invalid
        );
    }

    #[test]
    fn a_batch_refuses_bad_bios_and_completes_every_bio_once() {
        use blkstack_core::testing::CompletionRecorder;
        use blkstack_core::IoBuf;
        for irq in ["irqmode=0", "irqmode=1"] {
            let d = NullDevice::from_args(1 << 20, &["bs=4096", "zero_reads=0", irq]).unwrap();
            let rec = CompletionRecorder::new();
            let mut mem = vec![0xabu8; 100 * 4096];
            let mut bios: Vec<Bio> = (0..100u64)
                .map(|i| {
                    // Every 7th bio is misaligned for bs=4096, every 11th
                    // past the end.
                    let off = match i {
                        _ if i % 7 == 3 => 512,
                        _ if i % 11 == 5 => 1 << 20,
                        _ => (i % 256) * 4096,
                    };
                    // SAFETY: `mem` outlives the bios (all waited for).
                    let buf =
                        unsafe { IoBuf::from_raw(mem.as_mut_ptr().add(i as usize * 4096), 4096) };
                    Bio::new(Op::Read, off, 4096, buf, rec.clone(), i)
                })
                .collect();
            d.submit_batch(&mut bios);
            assert!(bios.is_empty());
            let Some(mut got) = rec.try_wait(100, Duration::from_secs(10)) else {
                panic!("stuck: {}", d.status());
            };
            got.sort_by_key(|c| c.cookie);
            assert_eq!(got.len(), 100, "a bio completed twice");
            let cookies: Vec<u64> = got.iter().map(|c| c.cookie).collect();
            assert_eq!(
                cookies,
                (0..100).collect::<Vec<u64>>(),
                "a bio completed twice"
            );
            for (i, st) in got.iter().map(|c| (c.cookie, c.status)) {
                let bad = i % 7 == 3 || i % 11 == 5;
                assert_eq!(
                    st,
                    if bad { Status::Invalid } else { Status::Ok },
                    "bio {i}"
                );
            }
            assert_eq!(d.engine_stats().tags_in_use, 0);
            assert!(
                mem.iter().all(|&b| b == 0xab),
                "zero_reads=0 touched a buffer"
            );
        }
    }

    #[test]
    fn timer_mode_is_never_early() {
        let d = NullDevice::from_args(1 << 20, &["irqmode=2", "completion_nsec=200000"]).unwrap();
        let mut buf = vec![0u8; 4096];
        for _ in 0..10 {
            let t0 = now_ns();
            assert_eq!(
                submit_and_wait(&*d, Op::Read, 0, 4096, &mut buf),
                Status::Ok
            );
            assert!(now_ns() - t0 >= 200_000);
        }
    }

    #[test]
    fn args_round_trip_and_errors() {
        let d = NullDevice::from_args(
            1 << 20,
            &[
                "bs=4096",
                "max_inflight=8",
                "irqmode=1",
                "hw_queue_depth=256",
                "run_dedup=off",
            ],
        )
        .unwrap();
        assert_eq!(d.logical_block_size(), 4096);
        assert_eq!(
            d.table_args(),
            "bs=4096 max_inflight=8 irqmode=1 hw_queue_depth=256 run_dedup=off"
        );
        let printed = d.table_args();
        let again: Vec<&str> = printed.split_whitespace().collect();
        let d2 = NullDevice::from_args(1 << 20, &again).unwrap();
        assert_eq!(d2.table_args(), d.table_args());
        assert_eq!(
            NullDevice::from_args(1 << 20, &[]).unwrap().table_args(),
            ""
        );
        assert!(NullDevice::from_args(1 << 20, &["bs=3000"])
            .err()
            .unwrap()
            .to_string()
            .contains("bs"));
        assert!(NullDevice::from_args(1 << 20, &["x=1"])
            .err()
            .unwrap()
            .to_string()
            .contains("'x'"));
        assert!(NullDevice::from_args(1 << 20, &["irqmode=5"])
            .err()
            .unwrap()
            .to_string()
            .contains("irqmode"));
        assert!(NullDevice::from_args(1000, &[]).is_err());
    }

    #[test]
    fn status_shows_tag_use_and_engine_counters() {
        let d = NullDevice::from_args(1 << 20, &["hw_queue_depth=32"]).unwrap();
        let st = d.status();
        assert!(st.contains("tags=0/32"), "{st}");
        assert!(st.contains("runs_deduped="), "{st}");
        assert!(st.contains("tag_wakeup=counter"), "{st}");
    }

    #[test]
    fn busy_driver_requeues_and_restarts() {
        use blkstack_core::testing::CompletionRecorder;
        use blkstack_core::IoBuf;
        let d = NullDevice::from_args(
            1 << 20,
            &[
                "irqmode=2",
                "completion_nsec=100000",
                "max_inflight=2",
                "run_on_completion=1",
            ],
        )
        .unwrap();
        let c = CompletionRecorder::new();
        for i in 0..40u64 {
            d.submit(Bio::new(Op::Write, 0, 0, IoBuf::empty(), c.clone(), i));
        }
        let Some(done) = c.try_wait(40, Duration::from_secs(10)) else {
            panic!("stuck: {}", d.status());
        };
        assert!(done.iter().all(|x| x.status == Status::Ok));
        let s = d.engine_stats();
        assert!(
            s.hctx.requeues > 0 || s.hctx.dispatched_from_list > 0,
            "{}",
            d.status()
        );
        assert!(s.hctx.runs_posted > 0, "{}", d.status());
        assert_eq!(s.tags_in_use, 0);
    }
}
