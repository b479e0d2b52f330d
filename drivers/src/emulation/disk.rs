//! A blk-mq disk whose driver's completions are delivered the way
//! null_blk's `irqmode` says: at once, from a per-hardware-queue thread
//! (softirq), or from that thread after `completion_nsec` (timer), with
//! `POLLED` bios of timer mode reaped by the submitter's poll. The driver
//! under it only says "done" from `queue_rq`; [`Emulated`] turns that into
//! an issued request and ends it later through the engine's
//! [`RequestCompleter`], like any driver with an interrupt handler, so the
//! engine (`blkstack_mq`) knows nothing of irqmode, as blk-mq knows
//! nothing of it in Linux (`drivers/block/null_blk/main.c`:
//! `null_handle_cmd`, `null_cmd_end_timer`, `null_poll`). `null` and
//! `memory` both run on it.

use super::completion::{CompletionMode, CompletionOptions};
use super::timer::{completion_thread, IrqQueue, TimerStats};
use crate::error::EmulatedQueueError;
use blkstack_core::clock::now_ns;
use blkstack_core::device::Extent;
use blkstack_core::BioFlags;
use blkstack_core::Status;
use blkstack_mq::{
    CompleterRef, Disk, DiskLimits, Driver, EngineOptions, QueueRq, QueueStats, RequestCompleter,
    Rq,
};
use std::ops::Deref;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

/// The completion state shared by the driver wrapper and the threads.
struct Irq {
    opts: CompletionOptions,
    queues: Box<[IrqQueue]>,
    completer: OnceLock<RequestCompleter>,
}

/// Driver `D` with null_blk's completion modes around it.
pub struct Emulated<D: Driver> {
    inner: D,
    irq: Arc<Irq>,
}

impl<D: Driver> Driver for Emulated<D> {
    #[inline]
    fn queue_rq(&self, rq: Rq<'_>) -> QueueRq {
        let (deadline, polled) = match self.irq.opts.mode {
            CompletionMode::Inline => return self.inner.queue_rq(rq),
            CompletionMode::Softirq => (0, false),
            CompletionMode::Timer { nsec } => (
                now_ns() + nsec,
                self.irq.opts.iopoll && rq.bio.flags.contains(BioFlags::POLLED),
            ),
        };
        let (hctx, tag) = (rq.hctx as usize, rq.tag);
        match self.inner.queue_rq(rq) {
            QueueRq::Done(status) => {
                let q = &self.irq.queues[hctx];
                if polled {
                    q.polled.push(deadline, tag, status);
                } else {
                    q.push(deadline, tag, status);
                }
                QueueRq::Issued
            }
            other => other,
        }
    }

    #[inline]
    fn complete(&self, rq: Rq<'_>, status: Status) -> Status {
        self.inner.complete(rq, status)
    }

    fn attach(&self, completer: RequestCompleter) {
        let _ = self.irq.completer.set(completer.clone());
        self.inner.attach(completer);
    }

    /// Timer mode with `iopoll`: see [`super::poll`].
    fn polls(&self) -> bool {
        self.irq.opts.iopoll
    }

    fn poll(&self, completer: &CompleterRef<'_>) -> usize {
        if !self.irq.opts.iopoll {
            return 0;
        }
        let mut n = 0;
        for (i, q) in self.irq.queues.iter().enumerate() {
            n += q
                .polled
                .end_due(i as u32, 0, completer, &q.timer_done, &q.timer_late_ns);
        }
        n
    }

    fn extents(&self, offset: u64, end: u64) -> Option<Vec<Extent>> {
        self.inner.extents(offset, end)
    }
}

/// A blk-mq disk over `D` with null_blk's completion modes, and the
/// completion threads it needs (joined on drop, after they have ended
/// every request they hold). It derefs to its [`Disk`], the leaf device.
pub struct EmulatedDisk<D: Driver> {
    disk: Disk<Emulated<D>>,
    irq: Arc<Irq>,
    threads: Vec<JoinHandle<()>>,
}

impl<D: Driver> EmulatedDisk<D> {
    /// A disk over `driver` with engine options `engine`, completion mode
    /// `completion` and geometry `limits`.
    pub fn new(
        driver: D,
        engine: EngineOptions,
        completion: CompletionOptions,
        limits: DiskLimits,
    ) -> Result<Self, EmulatedQueueError> {
        let depth = engine.queue_depth as usize;
        let irq = Arc::new(Irq {
            opts: completion,
            queues: (0..engine.hw_queues)
                .map(|_| IrqQueue::new(depth))
                .collect(),
            completer: OnceLock::new(),
        });
        let wrapped = Emulated {
            inner: driver,
            irq: irq.clone(),
        };
        let disk = Disk::new(wrapped, engine, limits)?;
        let mut q = EmulatedDisk {
            disk,
            irq,
            threads: Vec::new(),
        };
        if completion.mode != CompletionMode::Inline {
            q.start_threads(depth)?;
        }
        Ok(q)
    }

    /// One completion thread per hardware queue; returns once each is
    /// running and set up, so no thread's start-up lands in the device's
    /// first I/Os.
    fn start_threads(&mut self, depth: usize) -> Result<(), EmulatedQueueError> {
        let opts = self.irq.opts;
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(self.irq.queues.len());
        for i in 0..self.irq.queues.len() {
            let completer = self
                .irq
                .completer
                .get()
                .and_then(RequestCompleter::hold)
                .ok_or(EmulatedQueueError::NoCompleter)?;
            let irq = self.irq.clone();
            let ready = ready_tx.clone();
            let h = std::thread::Builder::new()
                .name(format!("blkmq-cpl/{i}"))
                .spawn(move || {
                    completion_thread(
                        &irq.queues[i],
                        i as u32,
                        opts.iopoll
                            .then_some(opts.poll_backstop_ms.saturating_mul(1_000_000)),
                        opts.timer_spin_max_ns,
                        depth,
                        completer,
                        ready,
                    )
                })
                .map_err(EmulatedQueueError::Thread)?;
            let _ = self.irq.queues[i].thread.set(h.thread().clone());
            self.threads.push(h);
        }
        drop(ready_tx);
        // Each thread says so once set up; a thread that died first drops
        // its sender unsent, and the last one gone ends the wait.
        for _ in 0..self.threads.len() {
            ready_rx
                .recv()
                .map_err(|_| EmulatedQueueError::ThreadDied)?;
        }
        Ok(())
    }

    /// The driver under the emulation.
    pub fn inner_driver(&self) -> &D {
        &self.disk.driver().inner
    }

    pub fn completion(&self) -> &CompletionOptions {
        &self.irq.opts
    }

    /// The engine's counters.
    pub fn stats(&self) -> QueueStats {
        self.disk.queue().stats()
    }

    /// Timer-mode counters.
    pub fn timer_stats(&self) -> TimerStats {
        let mut s = TimerStats::default();
        for q in self.irq.queues.iter() {
            q.add_stats(&mut s);
        }
        s
    }

    /// The engine part of a `dmsetup status` line, then the timer
    /// counters once there are any.
    pub fn status(&self) -> String {
        self.disk.queue().status() + &self.timer_stats().status_suffix()
    }
}

impl<D: Driver> Deref for EmulatedDisk<D> {
    type Target = Disk<Emulated<D>>;

    fn deref(&self) -> &Disk<Emulated<D>> {
        &self.disk
    }
}

impl<D: Driver> Drop for EmulatedDisk<D> {
    fn drop(&mut self) {
        for q in self.irq.queues.iter() {
            q.stop();
        }
        let me = std::thread::current().id();
        for t in self.threads.drain(..) {
            // The last owner may drop the device from a completion callback
            // running on one of these threads: that one ends what it holds
            // and exits by itself (its completer keeps the engine's request
            // state alive until then).
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}
