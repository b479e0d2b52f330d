//! `verity VERSION DATA_DEV HASH_DEV DATA_BLOCK HASH_BLOCK NUM_DATA_BLOCKS
//! HASH_START ALGORITHM DIGEST SALT [#opt opt...]`: a read-only device
//! whose every data block is checked against a hash tree before a read
//! returns it (kernel drivers/md/dm-verity-target.c, Linux 6.12, target
//! version 1.10.0).
//!
//! A read goes to the data device; its completion is checked against
//! the tree ([`verify`]): on the completing thread when every hash block
//! it needs is cached and verified already and no digest fails (the
//! kernel's `try_verify_in_tasklet` path, taken here always because it
//! costs nothing when it cannot finish), else on a small worker pool
//! ("kverityd", the kernel's `verify_wq`), which may read hash blocks
//! and so must not run where a lower device completes. A block that
//! fails its digest fails the read with EIO, is logged (the first 100,
//! as the kernel's `DM_VERITY_MAX_CORRUPTED_ERRS`) and turns `status`
//! from `V` to `C`; the data device is never written: the target offers
//! a read-only device, and writes fail with EPERM as on the kernel's
//! read-only dm device.
//!
//! Options: `ignore_corruption` (log, mark `C`, return the data),
//! `ignore_zero_blocks` (a block whose digest is the zero block's reads
//! as zeroes unread), `check_at_most_once` (a bitmap of verified data
//! blocks), `try_verify_in_tasklet` (accepted and shown; see above).
//! There is no machine to restart or panic here: `restart_on_corruption`
//! and `panic_on_corruption` (and `restart_on_error`/`panic_on_error`
//! for I/O errors of the legs) are taken, and where the kernel would
//! restart or panic the target stops instead: that read and every later
//! one fail with EIO, and the log says why. Forward error correction
//! (`use_fec_from_device`, `fec_roots`, `fec_blocks`, `fec_start`) and
//! `root_hash_sig_key_desc` (the kernel keyring) are refused by name.

mod ctr;
pub mod format;
pub mod tree;
mod verify;

use crate::error::TargetError;
use crate::target::{DevArg, Target, TargetRef, TargetType};
use blkstack_core::{Bio, EndIo, Features, Op, Status};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use tree::{BlockCache, Geometry, Hasher};
use verify::WorkQueue;

/// The target type.
pub const TYPE: TargetType = TargetType {
    name: "verity",
    version: [1, 10, 0],
    ctr: ctr::ctr,
};

/// What happens on a corrupt block (kernel `enum verity_mode`), or, as
/// the error mode, on a leg's I/O error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Fail the read with EIO (the default).
    Eio,
    /// `ignore_corruption`: log and return the data.
    Logging,
    /// `restart_on_corruption` / `restart_on_error`.
    Restart,
    /// `panic_on_corruption` / `panic_on_error`.
    Panic,
}

/// The kind of block that failed (kernel `enum verity_block_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockType {
    Data,
    Metadata,
}

/// The most corruptions logged (kernel `DM_VERITY_MAX_CORRUPTED_ERRS`).
const MAX_CORRUPTED_ERRS: u32 = 100;

/// Hash blocks the cache holds (kernel dm-bufio bounds its buffers by
/// memory); with 4 KiB blocks of sha256 this covers 2 GiB of data per
/// cached level-0 set, so a sequential read never reads a block twice.
const CACHE_BLOCKS: usize = 4096;

/// The `verity` target: the table's values and the shared state the
/// read completions use.
pub struct VerityTarget {
    v: Arc<Verity>,
    queue: Arc<WorkQueue>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

/// The kernel's `struct dm_verity`.
pub(crate) struct Verity {
    /// This value's own handle, for queueing its bios on a worker.
    me: std::sync::Weak<Verity>,
    data: DevArg,
    hash: DevArg,
    geo: Geometry,
    hasher: Hasher,
    root: Vec<u8>,
    mode: Mode,
    error_mode: Mode,
    /// `ignore_zero_blocks`: the digest of a zero data block.
    zero_digest: Option<Vec<u8>>,
    /// `check_at_most_once`: a bit per data block verified.
    validated: Option<Vec<AtomicU64>>,
    tasklet: bool,
    hash_failed: AtomicBool,
    corrupted_errs: AtomicU32,
    /// Set where the kernel would restart or panic: every read fails.
    halted: AtomicBool,
    cache: BlockCache,
    queue: Arc<WorkQueue>,
}

impl Verity {
    fn block_bytes(&self) -> u64 {
        u64::from(self.geo.data_block_size)
    }

    /// Kernel `verity_handle_err`: mark the device corrupt, log (up to
    /// [`MAX_CORRUPTED_ERRS`]), and say whether the I/O must fail.
    fn handle_err(&self, ty: BlockType, block: u64) -> bool {
        self.hash_failed.store(true, Ordering::Relaxed);
        let n = self.corrupted_errs.load(Ordering::Relaxed);
        if n < MAX_CORRUPTED_ERRS {
            let n = self.corrupted_errs.fetch_add(1, Ordering::Relaxed) + 1;
            let what = match ty {
                BlockType::Data => "data",
                BlockType::Metadata => "metadata",
            };
            tracing::error!(
                "verity: {}: {what} block {block} is corrupted",
                self.data.name
            );
            if n == MAX_CORRUPTED_ERRS {
                tracing::error!("verity: {}: reached maximum errors", self.data.name);
            }
        }
        match self.mode {
            Mode::Logging => false,
            Mode::Eio => true,
            Mode::Restart | Mode::Panic => {
                self.halt(self.mode, "dm-verity device corrupted");
                true
            }
        }
    }

    /// Where the kernel restarts or panics the machine, stop the target.
    fn halt(&self, mode: Mode, why: &str) {
        if !self.halted.swap(true, Ordering::Relaxed) {
            let act = if mode == Mode::Panic {
                "panic"
            } else {
                "restart"
            };
            tracing::error!(
                "verity: {}: {why}: the kernel would {act} the machine here; blkstack has none \
                 to {act}, so this target fails every read from now on (reload or remove it)",
                self.data.name
            );
        }
    }

    /// A leg's I/O error: kernel 6.12's `restart_on_error`/`panic_on_error`.
    fn io_error(&self, status: Status) -> Status {
        if self.error_mode != Mode::Eio {
            self.halt(self.error_mode, "dm-verity device has I/O error");
        }
        status
    }

    /// Whether data block `b` was verified before (`check_at_most_once`).
    fn is_validated(&self, b: u64) -> bool {
        self.validated.as_ref().is_some_and(|v| {
            v.get((b / 64) as usize)
                .is_some_and(|w| w.load(Ordering::Relaxed) & (1 << (b % 64)) != 0)
        })
    }

    fn set_validated(&self, b: u64) {
        if let Some(w) = self
            .validated
            .as_ref()
            .and_then(|v| v.get((b / 64) as usize))
        {
            w.fetch_or(1 << (b % 64), Ordering::Relaxed);
        }
    }
}

impl EndIo for Verity {
    /// The data read completed (kernel `verity_end_io`): check it here if
    /// nothing must be read, else on a worker.
    fn end_io(&self, bio: Bio, status: Status, _private: u64) {
        if !status.is_ok() {
            bio.complete(self.io_error(status));
            return;
        }
        match self.verify_bio(&bio, 0, false) {
            verify::Outcome::Done(st) => bio.complete(st),
            verify::Outcome::Defer(from) => self.defer(bio, from),
        }
    }
}

impl Target for VerityTarget {
    /// Kernel `verity_map`: reads of whole data blocks inside the tree go
    /// to the data device; anything else fails.
    fn map(&self, mut bio: Bio) {
        let v = &self.v;
        match bio.op {
            Op::Read => {}
            // Nothing is ever written, so there is nothing to make durable.
            Op::Flush => return bio.complete(Status::Ok),
            // The device is read-only: the kernel's block layer refuses
            // these with EPERM before dm-verity sees them.
            Op::Write | Op::Discard | Op::WriteZeroes => return bio.complete(Status::Permission),
        }
        let bs = v.block_bytes();
        if !bio.offset.is_multiple_of(bs) || !bio.len.is_multiple_of(bs) {
            tracing::error!("verity: unaligned io");
            return bio.complete(Status::IoError);
        }
        if (bio.offset + bio.len) / bs > v.geo.data_blocks {
            tracing::error!("verity: io out of range");
            return bio.complete(Status::IoError);
        }
        if v.halted.load(Ordering::Relaxed) {
            return bio.complete(Status::IoError);
        }
        bio.push_end(self.v.clone(), 0);
        v.data.dev.submit(bio);
    }

    /// `V` (valid) or `C` (corruption found), as `verity_status`.
    fn status(&self) -> String {
        if self.v.hash_failed.load(Ordering::Relaxed) {
            "C".into()
        } else {
            "V".into()
        }
    }

    fn table(&self) -> String {
        ctr::table(&self.v)
    }

    /// Read-only, no discards (`verity_io_hints` makes the logical block
    /// the data block; the table's length is checked against it in
    /// `map`).
    fn features(&self) -> Features {
        Features {
            flush: false,
            fua: false,
            discard: false,
            write_zeroes: false,
            fast_zero: false,
            read_only: true,
            knows_holes: false,
            ..self.v.data.dev.features()
        }
    }
}

impl Drop for VerityTarget {
    fn drop(&mut self) {
        self.queue.shut_down();
        // The last table reference may go with a bio a worker completes:
        // that worker is not joined (it exits when it returns here).
        let me = std::thread::current().id();
        for w in self.workers.drain(..) {
            if w.thread().id() != me {
                let _ = w.join();
            }
        }
    }
}

/// Build the target from parsed values and start its workers.
fn start(v: Verity, queue: Arc<WorkQueue>, device: &str) -> Result<TargetRef, TargetError> {
    let v = Arc::new_cyclic(|me| Verity {
        me: me.clone(),
        ..v
    });
    let n = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, 8);
    let mut workers = Vec::with_capacity(n);
    for i in 0..n {
        let q = queue.clone();
        let w = std::thread::Builder::new()
            .name(format!("kverityd/{device}/{i}"))
            .spawn(move || q.run())
            .map_err(|source| TargetError::Io {
                what: "Cannot allocate workqueue",
                source,
            });
        match w {
            Ok(w) => workers.push(w),
            Err(e) => {
                queue.shut_down();
                for w in workers {
                    let _ = w.join();
                }
                return Err(e);
            }
        }
    }
    Ok(Arc::new(VerityTarget { v, queue, workers }))
}

#[cfg(test)]
mod tests;
