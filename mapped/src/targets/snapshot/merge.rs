//! `snapshot-merge <origin> <COW> P|PO <chunksize>`: merge a persistent
//! snapshot back into its origin (kernel `drivers/md/dm-snap.c`,
//! `snapshot_merge_next_chunks`, `merge_callback`, `snapshot_merge_map`).
//!
//! The target takes the origin's place: from its resume a worker copies
//! the exceptions back to the origin newest first, a run of consecutive
//! chunks at a time (`persistent_prepare_merge`), flushes the origin and
//! then drops the run from the store on disk (`persistent_commit_merge`),
//! so `status` counts down to the header and one area; stopped halfway
//! (suspend, remove, a killed process), the store on disk holds exactly
//! the exceptions not merged yet, and a `snapshot-merge` loaded later,
//! here or in the kernel, goes on from there. Before a run is written to
//! the origin, every other snapshot of the origin keeps those chunks
//! (the kernel's `origin_write_extent`).
//!
//! I/O during the merge goes where the data is: a chunk still in the
//! store is read from and written to the COW device, the rest go to the
//! origin (writes there first keep the chunk in other snapshots). A write
//! to a chunk of the run being merged waits for the run (the kernel
//! queues it on `bios_queued_during_merge`), and a run waits for the
//! writes already in flight to COW chunks before it copies (the kernel's
//! tracked chunks). A transient store cannot merge: it is refused.

use super::{snapshots_of, status_of, table_of, NoMerge, Snap, Store};
use crate::error::TargetError;
use crate::target::{CtrContext, DevArg, Target, TargetRef, TargetType};
use blkstack_core::sync::submit_and_wait_flags;
use blkstack_core::{AlignedBuf, Bio, BioFlags, EndIo, Features, Op, Status};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

pub const TYPE: TargetType = TargetType {
    name: "snapshot-merge",
    version: [1, 5, 0],
    ctr,
};

/// The most chunks one merge step copies (the kernel copies a whole
/// consecutive run at once); bounds the step's buffer and how long
/// writes to the run wait.
const MAX_RUN_CHUNKS: u64 = 64;

/// How long a write to a chunk being merged, or a run waiting for writes
/// in flight, sleeps between looks.
const POLL: Duration = Duration::from_millis(1);

pub struct MergeTarget {
    origin: DevArg,
    cow: DevArg,
    snap: Arc<Snap>,
    worker: Mutex<Option<(Arc<AtomicBool>, JoinHandle<()>)>>,
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    let (origin, cow, snap) = super::build(ctx, args)?;
    if !snap.state.lock().store.persistent() {
        return Err(TargetError::invalid(
            "Snapshot exception store does not support snapshot-merge.",
        ));
    }
    snap.merging.store(true, Ordering::Release);
    let target = Arc::new(MergeTarget {
        origin,
        cow,
        snap,
        worker: Mutex::new(None),
    });
    if !ctx.reloading {
        // A new device is live as soon as it is made.
        target.start();
    }
    Ok(target)
}

impl Snap {
    /// One step of `snapshot_merge_next_chunks` + `merge_callback`:
    /// `Ok(false)` once nothing is left to merge.
    fn merge_step(&self) -> Result<bool, NoMerge> {
        let (old, new, n) = {
            let mut st = self.state.lock();
            if !st.valid {
                return Err(NoMerge("Snapshot is invalid: can't merge"));
            }
            let Store::Persistent(p) = &mut st.store else {
                return Err(NoMerge("not a persistent store"));
            };
            let Some((old, new, n)) = p
                .prepare_merge(MAX_RUN_CHUNKS)
                .map_err(|()| NoMerge("Read error in exception store: shutting down merge"))?
            else {
                return Ok(false);
            };
            st.merging = Some((old + 1 - n, n));
            (old + 1 - n, new + 1 - n, n)
        };
        let done = self.merge_run(old, new, n);
        let mut st = self.state.lock();
        st.merging = None;
        done?;
        let Store::Persistent(p) = &mut st.store else {
            return Err(NoMerge("not a persistent store"));
        };
        if !p.commit_merge(n) {
            return Err(NoMerge(
                "Write error in exception store: shutting down merge",
            ));
        }
        for c in old..old + n {
            st.map.remove(&c);
        }
        Ok(true)
    }

    /// Copy COW chunks `new..new+n` over origin chunks `old..old+n`, once
    /// the writes in flight to COW chunks are done and the other
    /// snapshots of the origin hold the old data; then flush the origin.
    fn merge_run(&self, old: u64, new: u64, n: u64) -> Result<(), NoMerge> {
        while self.inflight.load(Ordering::Acquire) > 0 {
            std::thread::sleep(POLL);
        }
        for s in snapshots_of(&self.origin) {
            if !std::ptr::eq(Arc::as_ptr(&s), self) {
                (old..old + n).for_each(|c| s.keep_for_origin(c));
            }
        }
        let cb = self.chunk_bytes();
        let len = (n * cb).min(self.origin.size().saturating_sub(old * cb));
        let mut buf = AlignedBuf::new(len as usize);
        let b = buf.as_mut_slice();
        let none = BioFlags::NONE;
        let r = submit_and_wait_flags(&*self.cow, Op::Read, none, new * cb, len, b);
        let w = if r.is_ok() {
            submit_and_wait_flags(&*self.origin, Op::Write, none, old * cb, len, b)
        } else {
            r
        };
        if !w.is_ok() {
            return Err(NoMerge("Error reading/writing: shutting down merge"));
        }
        let f = submit_and_wait_flags(&*self.origin, Op::Flush, none, 0, 0, &mut []);
        if !f.is_ok() {
            return Err(NoMerge("Flush after merge failed: shutting down merge"));
        }
        Ok(())
    }

    /// The merge worker: steps until done, failed or `stop`.
    fn merge(self: Arc<Snap>, stop: Arc<AtomicBool>) {
        while !stop.load(Ordering::Acquire) {
            match self.merge_step() {
                Ok(true) => {}
                Ok(false) => {
                    tracing::info!("snapshot-merge: merge complete");
                    return;
                }
                Err(NoMerge(why)) => {
                    tracing::error!("snapshot-merge: {why}");
                    self.state.lock().merge_failed = true;
                    self.events.raise();
                    return;
                }
            }
        }
    }
}

/// A write to a COW chunk during a merge, or a snapshot's read of the
/// origin, is done (the kernel's `stop_tracking_chunk`).
impl EndIo for Snap {
    fn end_io(&self, bio: Bio, status: Status, private: u64) {
        if private == super::ORIGIN_READ {
            self.origin_reads.fetch_sub(1, Ordering::AcqRel);
        } else {
            self.inflight.fetch_sub(1, Ordering::AcqRel);
        }
        bio.complete(status);
    }
}

impl MergeTarget {
    /// Start the merge worker unless it runs.
    fn start(&self) {
        let mut w = self.worker.lock();
        if w.as_ref().is_some_and(|(_, h)| !h.is_finished()) {
            return;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let snap = self.snap.clone();
        let s = stop.clone();
        match std::thread::Builder::new()
            .name("snap-merge".into())
            .spawn(move || snap.merge(s))
        {
            Ok(h) => *w = Some((stop, h)),
            Err(e) => tracing::error!(%e, "snapshot-merge: cannot start the merge worker"),
        }
    }

    fn stop(&self) {
        if let Some((stop, handle)) = self.worker.lock().take() {
            stop.store(true, Ordering::Release);
            if handle.join().is_err() {
                tracing::error!("snapshot-merge: the merge worker panicked");
            }
        }
    }

    fn write(&self, mut bio: Bio) {
        let cb = self.snap.chunk_bytes();
        let chunk = bio.offset / cb;
        loop {
            let st = self.snap.state.lock();
            if !st.valid {
                drop(st);
                return bio.complete(Status::IoError);
            }
            if st
                .merging
                .is_some_and(|(first, n)| (first..first + n).contains(&chunk))
            {
                drop(st);
                std::thread::sleep(POLL);
                continue;
            }
            if let Some(&c) = st.map.get(&chunk) {
                self.snap.inflight.fetch_add(1, Ordering::AcqRel);
                drop(st);
                bio.push_end(self.snap.clone(), 0);
                bio.offset = c * cb + bio.offset % cb;
                return self.cow.dev.submit(bio);
            }
            break;
        }
        for s in snapshots_of(&self.origin.dev) {
            if !Arc::ptr_eq(&s, &self.snap) {
                s.keep_for_origin(chunk);
            }
        }
        self.origin.dev.submit(bio);
    }
}

impl Target for MergeTarget {
    fn map(&self, mut bio: Bio) {
        if bio.op == Op::Flush || (bio.len == 0 && bio.flags.contains(BioFlags::PREFLUSH)) {
            // Two flushes, as the kernel's num_flush_bios = 2.
            let f =
                submit_and_wait_flags(&*self.origin.dev, Op::Flush, BioFlags::NONE, 0, 0, &mut []);
            if !f.is_ok() {
                return bio.complete(f);
            }
            return self.cow.dev.submit(bio);
        }
        let cb = self.snap.chunk_bytes();
        match bio.op {
            Op::Read => {
                let st = self.snap.state.lock();
                if !st.valid {
                    drop(st);
                    return bio.complete(Status::IoError);
                }
                match st.map.get(&(bio.offset / cb)) {
                    Some(&c) => {
                        drop(st);
                        bio.offset = c * cb + bio.offset % cb;
                        self.cow.dev.submit(bio);
                    }
                    None => {
                        drop(st);
                        self.origin.dev.submit(bio);
                    }
                }
            }
            Op::Write | Op::WriteZeroes => self.write(bio),
            _ => bio.complete(Status::NotSupported),
        }
    }

    fn status(&self) -> String {
        status_of(&self.snap, &self.cow)
    }

    fn table(&self) -> String {
        table_of(&self.snap, &self.origin, &self.cow)
    }

    /// `snapshot_merge_resume`: start (or go on with) the merge.
    fn resume(&self) {
        self.start();
    }

    /// `snapshot_merge_presuspend`: stop merging after the current step.
    fn presuspend(&self) {
        self.stop();
    }

    fn max_io_len(&self, offset: u64) -> u64 {
        let cb = self.snap.chunk_bytes();
        cb - offset % cb
    }

    fn features(&self) -> Features {
        let cow = self.cow.dev.features();
        Features {
            discard: false,
            write_zeroes: false,
            fast_zero: false,
            knows_holes: false,
            read_only: false,
            ..cow
        }
    }
}

impl Drop for MergeTarget {
    fn drop(&mut self) {
        self.stop();
    }
}
