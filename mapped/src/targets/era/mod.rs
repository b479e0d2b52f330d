//! `era <metadata dev> <origin dev> <block size>`: changed-block
//! tracking (kernel `drivers/md/dm-era-target.c`). I/O passes to the
//! origin; the first write to a block in an era marks it in the era's
//! writeset, and that mark is committed to the metadata before the write
//! is issued (`era_map` defers it to the worker, which marks, commits,
//! then submits), so after any crash the metadata names every block a
//! completed write touched. `checkpoint` starts a new era;
//! `take_metadata_snap` / `drop_metadata_snap` hold a copy of the
//! metadata for `era_invalidate`. The metadata format is the kernel's
//! (`metadata.rs`), judged by `era_check`, `era_dump`, `era_invalidate`
//! and the kernel's own dm-era.

pub mod metadata;

use crate::error::TargetError;
use crate::target::{parse_sscanf, CtrContext, DevArg, Target, TargetRef, TargetType};
use blkstack_core::{Bio, DeviceRef, Features, Op, Status, SECTOR_SIZE};
use metadata::{EraError, EraMetadata, LOCATION};
use parking_lot::{Condvar, Mutex, RwLock};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The `era` target type.
pub const TYPE: TargetType = TargetType {
    name: "era",
    version: [1, 0, 0],
    ctr,
};

/// `MIN_BLOCK_SIZE`: block sizes are multiples of 8 sectors.
const MIN_BLOCK_SIZE: u32 = 8;

/// How long the idle worker sleeps before looking again (it is woken
/// for every deferred bio; this only bounds a missed wake-up).
const IDLE_WAIT: Duration = Duration::from_millis(500);

fn invalid(s: &str) -> TargetError {
    TargetError::Invalid(s.to_string())
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    if args.len() != 3 {
        return Err(invalid("Invalid argument count"));
    }
    if ctx.live_target.is_some() {
        // dm-era's reload opens a second copy of the metadata beside the
        // live one's; blkstack refuses rather than let the two diverge.
        return Err(invalid(
            "reloading a live era table is not supported: remove and create it again",
        ));
    }
    let metadata = ctx
        .get_device(args[0], 0, 0)
        .map_err(|_| invalid("Error opening metadata device"))?;
    let origin = match ctx.get_device(args[1], 0, ctx.len) {
        Err(TargetError::NoDevice(_)) => return Err(invalid("Error opening data device")),
        r => r?,
    };
    let sectors_per_block: u32 =
        parse_sscanf("block size", args[2]).map_err(|_| invalid("Error parsing block size"))?;
    if sectors_per_block == 0 || !sectors_per_block.is_multiple_of(MIN_BLOCK_SIZE) {
        return Err(invalid("Invalid block size"));
    }
    let mut md = EraMetadata::open(metadata.dev.clone(), sectors_per_block).map_err(|e| {
        tracing::error!(error = %e, "era: couldn't open metadata");
        invalid("Error reading metadata")
    })?;
    let nr_blocks = ctx.len.div_ceil(sectors_per_block as u64);
    preresume(&mut md, nr_blocks).map_err(|e| {
        tracing::error!(error = %e, "era: preresume failed");
        TargetError::Invalid(format!("Error preparing metadata: {e}"))
    })?;
    let shared = Arc::new(Shared {
        md: Mutex::new(md),
        marks: RwLock::new(vec![0; (nr_blocks as usize).div_ceil(64)]),
        queue: Mutex::new(Queue::default()),
        cv: Condvar::new(),
        origin: origin.dev.clone(),
        block_bytes: sectors_per_block as u64 * SECTOR_SIZE,
        suspended: AtomicBool::new(false),
    });
    let s = shared.clone();
    let worker = std::thread::Builder::new()
        .name(format!("era-{}", ctx.device_name))
        .spawn(move || s.run())
        .map_err(|source| TargetError::Io {
            what: "could not start the era worker",
            source,
        })?;
    Ok(Arc::new(EraTarget {
        shared,
        metadata,
        origin,
        sectors_per_block,
        worker: Mutex::new(Some(worker)),
    }))
}

/// `era_preresume`: track the origin's blocks, then a new era.
fn preresume(md: &mut EraMetadata, nr_blocks: u64) -> Result<(), EraError> {
    if md.nr_blocks() as u64 != nr_blocks {
        md.resize(nr_blocks)?;
        md.commit()?;
    }
    md.rollover()?;
    md.commit()
}

#[derive(Default)]
struct Queue {
    /// Writes waiting for their block's mark to be committed; bounded by
    /// the bios in flight above (the frontends' queue depths).
    bios: VecDeque<Bio>,
    stop: bool,
}

/// What the target and its worker share (`struct era`).
struct Shared {
    md: Mutex<EraMetadata>,
    /// The current writeset's committed marks, in core (`ws->bits`):
    /// a write to a marked block goes straight to the origin.
    marks: RwLock<Vec<u64>>,
    queue: Mutex<Queue>,
    cv: Condvar,
    origin: DeviceRef,
    block_bytes: u64,
    suspended: AtomicBool,
}

fn is_marked(marks: &[u64], block: u64) -> bool {
    marks
        .get((block / 64) as usize)
        .is_some_and(|w| w & (1 << (block % 64)) != 0)
}

impl Shared {
    /// `do_work`: digest archived writesets a step at a time, and mark,
    /// commit and issue deferred writes.
    fn run(&self) {
        let mut more_digest = true;
        loop {
            let batch: Vec<Bio> = {
                let mut q = self.queue.lock();
                if q.bios.is_empty() && !q.stop && !more_digest {
                    self.cv.wait_for(&mut q, IDLE_WAIT);
                }
                if q.stop && q.bios.is_empty() {
                    return;
                }
                q.bios.drain(..).collect()
            };
            let mut md = self.md.lock();
            more_digest = match md.digest_step() {
                Ok(more) => more,
                Err(e) => {
                    tracing::error!(error = %e, "era: digest step failed, stopping digestion");
                    false
                }
            };
            if batch.is_empty() {
                continue;
            }
            let ok = self.mark_and_commit(&mut md, &batch);
            drop(md);
            for bio in batch {
                if ok {
                    self.origin.submit(bio);
                } else {
                    bio.complete(Status::IoError);
                }
            }
        }
    }

    /// `process_deferred_bios`: mark each bio's block on disk, commit,
    /// and only then mark it in core.
    fn mark_and_commit(&self, md: &mut EraMetadata, batch: &[Bio]) -> bool {
        let blocks: Vec<u64> = {
            let marks = self.marks.read();
            batch
                .iter()
                .map(|b| b.offset / self.block_bytes)
                .filter(|&b| !is_marked(&marks, b))
                .collect()
        };
        if blocks.is_empty() {
            return true;
        }
        let r = blocks
            .iter()
            .try_for_each(|&b| md.mark(b))
            .and_then(|_| md.commit());
        if let Err(e) = r {
            tracing::error!(error = %e, "era: marking written blocks failed");
            return false;
        }
        let mut marks = self.marks.write();
        for b in blocks {
            if let Some(w) = marks.get_mut((b / 64) as usize) {
                *w |= 1 << (b % 64);
            }
        }
        true
    }

    fn defer(&self, bio: Bio) {
        self.queue.lock().bios.push_back(bio);
        self.cv.notify_one();
    }

    fn clear_marks(&self) {
        self.marks.write().iter_mut().for_each(|w| *w = 0);
    }

    /// Run a message's metadata change and commit, as `process_rpc_calls`
    /// does (the commit happens even when the change failed).
    fn rpc(
        &self,
        f: impl FnOnce(&mut EraMetadata) -> Result<(), EraError>,
    ) -> Result<(), EraError> {
        let mut md = self.md.lock();
        let before = md.current_era();
        let r = f(&mut md);
        if md.current_era() != before {
            self.clear_marks();
        }
        let c = md.commit();
        self.cv.notify_one();
        r.and(c)
    }
}

/// A constructed era target.
pub struct EraTarget {
    shared: Arc<Shared>,
    metadata: DevArg,
    origin: DevArg,
    sectors_per_block: u32,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Target for EraTarget {
    /// `era_map`: writes to a block not yet marked in this era wait for
    /// the worker; everything else goes to the origin now.
    fn map(&self, bio: Bio) {
        let writes = matches!(bio.op, Op::Write | Op::Discard | Op::WriteZeroes) && bio.len > 0;
        if writes {
            let block = bio.offset / self.shared.block_bytes;
            if !is_marked(&self.shared.marks.read(), block) {
                self.shared.defer(bio);
                return;
            }
        }
        self.shared.origin.submit(bio);
    }

    /// `era_status`: the statistics through the worker, which commits
    /// after them as `process_rpc_calls` does (so the count shows the
    /// running transaction's new blocks, and the next one what the commit
    /// left); "Error" when the commit fails.
    fn status(&self) -> String {
        let s = {
            let mut md = self.shared.md.lock();
            let s = md.stats();
            if let Err(e) = md.commit() {
                tracing::error!(error = %e, "era: commit after the status failed");
                return "Error".to_string();
            }
            s
        };
        let snap = if s.snap == LOCATION {
            "-".to_string()
        } else {
            s.snap.to_string()
        };
        format!("8 {}/{} {} {snap}", s.used, s.total, s.era)
    }

    fn table(&self) -> String {
        format!(
            "{} {} {}",
            self.metadata, self.origin, self.sectors_per_block
        )
    }

    fn message(&self, args: &[&str]) -> Result<String, TargetError> {
        if args.len() != 1 {
            return Err(invalid("incorrect number of message arguments"));
        }
        let r = match args[0].to_ascii_lowercase().as_str() {
            "checkpoint" => self.shared.rpc(|md| md.rollover()),
            "take_metadata_snap" => self.shared.rpc(|md| md.take_snap()),
            "drop_metadata_snap" => self.shared.rpc(|md| md.drop_snap()),
            other => {
                return Err(TargetError::Invalid(format!(
                    "unsupported message '{other}'"
                )))
            }
        };
        r.map(|_| String::new())
            .map_err(|e| TargetError::Invalid(e.to_string()))
    }

    /// `era_postsuspend`: archive the current era's writeset and commit.
    fn postsuspend(&self) {
        if self.shared.suspended.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Err(e) = self.shared.rpc(|md| md.archive()) {
            tracing::error!(error = %e, "era: couldn't archive current era");
        }
    }

    /// `era_preresume`: a new era.
    fn resume(&self) {
        if !self.shared.suspended.swap(false, Ordering::SeqCst) {
            return;
        }
        let nr = self.shared.md.lock().nr_blocks() as u64;
        let r = self.shared.rpc(|md| preresume(md, nr));
        if let Err(e) = r {
            tracing::error!(error = %e, "era: metadata_era_rollover failed");
        }
    }

    fn features(&self) -> Features {
        self.origin.dev.features()
    }

    /// `dm_set_target_max_io_len(ti, sectors_per_block)`: no bio spans
    /// two blocks, so one mark covers it.
    fn max_io_len(&self, offset: u64) -> u64 {
        self.shared.block_bytes - offset % self.shared.block_bytes
    }
}

impl Drop for EraTarget {
    /// Removal suspends a live device first (`__dm_destroy`), so the
    /// writeset is archived and committed before the worker stops.
    fn drop(&mut self) {
        self.postsuspend();
        self.shared.queue.lock().stop = true;
        self.shared.cv.notify_all();
        if let Some(w) = self.worker.lock().take() {
            if w.thread().id() != std::thread::current().id() {
                let _ = w.join();
            }
        }
    }
}
