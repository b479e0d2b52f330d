//! `file`: a block device backed by a regular file (or a block device
//! node), driven through io_uring, like the kernel's loop driver with
//! `LO_FLAGS_DIRECT_IO` or nbdkit's file plugin.
//!
//! Table line: `file PATH [direct] [iopoll|hybrid_iopoll] [create]
//! [queue_depth=N] [engine=uring|psync] [reap_backstop_ms=N]`. The device is the line's length;
//! the file must already hold that many bytes (a longer file is fine: only
//! the first `length` bytes are exposed, as `losetup --sizelimit` does). A
//! missing or shorter file is refused unless `create` is given, in which
//! case it is created and/or extended sparsely with `ftruncate`; a file is
//! never shortened, so a typo in a length cannot destroy data.
//!
//! Operations map to the file the way the loop driver maps them: read and
//! write to `pread`/`pwrite` (io_uring READ/WRITE), flush to `fsync`, FUA to
//! `RWF_DSYNC` on the write itself, discard to
//! `fallocate(PUNCH_HOLE|KEEP_SIZE)`, write-zeroes to
//! `fallocate(ZERO_RANGE|KEEP_SIZE)` when the request forbids unmapping
//! (NOUNMAP) and to a punched hole otherwise. A filesystem without
//! ZERO_RANGE gets the zeroes written instead (refused with `Again` when the
//! request asked for a fast zero).
//!
//! `direct` opens the file with `O_DIRECT`. The kernel then wants the
//! buffer address and the file offset/length aligned (statx
//! `STATX_DIOALIGN`). Bios normally carry page-aligned `AlignedBuf` memory
//! (bench, NBD); a bio whose memory is misaligned goes through a per-slot
//! bounce buffer, and one whose offset or length is misaligned for the
//! filesystem goes through a second, buffered descriptor of the same file
//! (Linux keeps the page cache coherent with direct I/O on one inode).
//!
//! The mechanisms live one per file: `options` (the table words),
//! `backing` (descriptors, alignment routes, fallocate, holes), `ring`
//! (the io_uring engine and its completion thread), `poll` (the IOPOLL /
//! hybrid IOPOLL ring and its fallback when the kernel refuses polling)
//! and `psync` (the thread-pool engine, also the automatic fallback when
//! io_uring cannot be set up at all, e.g. under a seccomp filter). Every
//! fallback is logged once through `tracing` and shown by `status`.

mod backing;
#[cfg(test)]
mod idle_tests;
mod options;
mod poll;
mod psync;
mod refusal;
mod ring;

pub use options::{EngineKind, FileOptions, PollMode, DEFAULT_QUEUE_DEPTH};

use crate::args::check_size;
use crate::error::FileError;
use backing::{Files, Route};
use blkstack_core::device::{check_bio, Extent};
use blkstack_core::{Bio, BioFlags, Device, Features, QueueShape};
use psync::Pool;
use refusal::PollRefusal;
use ring::{setup_ring, Ring, RingShared};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Join an I/O thread, unless this is that thread: the last reference to a
/// device can be dropped by the thread completing its last bio (an upper
/// layer's completion frame held it), and joining oneself fails. That
/// thread then exits on its own once it returns to its loop (`stop` is
/// set and nothing is in flight).
fn join_unless_self(t: JoinHandle<()>) {
    if t.thread().id() != std::thread::current().id() {
        let _ = t.join();
    }
}

enum Backend {
    Uring {
        /// Interrupt-driven ring: everything that is not polled.
        normal: Ring,
        /// The IOPOLL ring, when asked for and set up.
        polled: Option<Ring>,
    },
    Psync(Pool),
}

/// The engine that was started, and how it differs from what was asked.
struct Started {
    backend: Backend,
    engine: EngineKind,
    engine_fallback: Option<String>,
    poll_setup: PollMode,
    poll_setup_fallback: Option<String>,
}

/// A file-backed block device. See the module documentation.
pub struct FileDevice {
    opts: FileOptions,
    size: u64,
    files: Arc<Files>,
    /// Dropped before `files` (field order): threads stop first.
    backend: Backend,
    /// The engine actually running and, if it differs from the request,
    /// why.
    engine: EngineKind,
    engine_fallback: Option<String>,
    /// The polling mode actually set up (before any per-I/O refusal).
    poll_setup: PollMode,
    poll_setup_fallback: Option<String>,
    refusal: Arc<PollRefusal>,
}

impl FileDevice {
    /// Build from a table line's length (bytes) and its args.
    pub fn from_args(size_bytes: u64, args: &[&str]) -> Result<FileDevice, FileError> {
        let opts = FileOptions::parse(args)?;
        FileDevice::open(size_bytes, opts)
    }

    /// Open the backing file and start the engine the options ask for (or
    /// the fallback the kernel leaves), then probe polling.
    pub fn open(size: u64, opts: FileOptions) -> Result<FileDevice, FileError> {
        check_size("file", size, 512)?;
        let files = Arc::new(Files::open(&opts, size)?);
        let name = opts
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "file".into());
        let refusal = Arc::new(PollRefusal::default());
        let started = start_engine(&opts, &files, &name, &refusal)?;
        let dev = FileDevice {
            opts,
            size,
            files,
            backend: started.backend,
            engine: started.engine,
            engine_fallback: started.engine_fallback,
            poll_setup: started.poll_setup,
            poll_setup_fallback: started.poll_setup_fallback,
            refusal,
        };
        dev.probe_polling();
        Ok(dev)
    }

    pub fn options(&self) -> &FileOptions {
        &self.opts
    }

    /// The polling mode in effect now: what was set up, unless the
    /// kernel has since refused it per I/O.
    pub fn effective_poll(&self) -> PollMode {
        if self.refusal.is_refused() {
            PollMode::Interrupt
        } else {
            self.poll_setup
        }
    }

    /// Why the device runs differently from what the table asked, if it does.
    pub fn fallback_reason(&self) -> Option<String> {
        let mut v = Vec::new();
        if let Some(r) = &self.engine_fallback {
            v.push(r.clone());
        }
        if let Some(r) = &self.poll_setup_fallback {
            v.push(r.clone());
        }
        if let Some(r) = self.refusal.reason() {
            v.push(r.to_string());
        }
        (!v.is_empty()).then(|| v.join("; "))
    }

    pub fn table_args(&self) -> String {
        self.opts.table_args()
    }

    /// `dmsetup status` text: one line of `key=value` words.
    pub fn status(&self) -> String {
        let s = &self.files.stats;
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = format!(
            "engine={} mode={} requested={} direct={} queue_depth={}",
            self.engine.name(),
            self.effective_poll().name(),
            self.opts.poll.name(),
            u8::from(self.opts.direct),
            self.opts.queue_depth,
        );
        if self.engine != self.opts.engine {
            out.push_str(&format!(" requested_engine={}", self.opts.engine.name()));
        }
        if self.fallback_reason().is_some() {
            let why = if self.engine_fallback.is_some() {
                "io_uring_unavailable"
            } else if self.refusal.is_refused() {
                "EOPNOTSUPP"
            } else {
                "setup_refused"
            };
            out.push_str(&format!(" fallback={why}"));
        }
        out.push_str(&format!(
            " reads={} writes={} flushes={} discards={} write_zeroes={} errors={} polled={} poll_refused={} bounced={} buffered={} zeroes_written={}",
            g(&s.reads),
            g(&s.writes),
            g(&s.flushes),
            g(&s.discards),
            g(&s.zeroes),
            g(&s.errors),
            g(&s.polled),
            g(&s.poll_refused),
            g(&s.bounced),
            g(&s.buffered),
            g(&s.zeroes_written),
        ));
        out
    }
}

fn thread_error(what: &'static str) -> impl FnOnce(std::io::Error) -> FileError {
    move |source| FileError::Thread { what, source }
}

/// Start io_uring when asked and the kernel allows it, else the psync
/// thread pool.
fn start_engine(
    opts: &FileOptions,
    files: &Arc<Files>,
    name: &str,
    refusal: &Arc<PollRefusal>,
) -> Result<Started, FileError> {
    let mut engine_fallback = None;
    if opts.engine == EngineKind::Uring {
        let entries = opts.queue_depth.next_power_of_two();
        match setup_ring(entries, 0) {
            Ok(ring) => return start_uring(ring, entries, opts, files, name, refusal),
            Err(e) => {
                let why = format!("io_uring_setup failed: {e}");
                tracing::warn!(
                    path = %opts.path.display(),
                    reason = %why,
                    "file: falling back to the psync thread pool"
                );
                engine_fallback = Some(why);
            }
        }
    }
    let pool =
        Pool::spawn(files.clone(), opts.queue_depth, name).map_err(thread_error("I/O threads"))?;
    Ok(Started {
        backend: Backend::Psync(pool),
        engine: EngineKind::Psync,
        engine_fallback,
        poll_setup: PollMode::Interrupt,
        poll_setup_fallback: None,
    })
}

/// Start the interrupt-driven ring's completion thread and, when polling
/// is asked for, the polled ring the kernel agrees to.
fn start_uring(
    ring: io_uring::IoUring,
    entries: u32,
    opts: &FileOptions,
    files: &Arc<Files>,
    name: &str,
    refusal: &Arc<PollRefusal>,
) -> Result<Started, FileError> {
    let depth = opts.queue_depth;
    let mut shared = RingShared::new(name.to_string(), ring, depth, files.clone(), None);
    shared.backstop = std::time::Duration::from_millis(opts.reap_backstop_ms);
    let normal = Ring::spawn(shared).map_err(thread_error("a completion thread"))?;
    let mut poll_setup = PollMode::Interrupt;
    let mut poll_setup_fallback = None;
    let mut polled = None;
    if opts.poll != PollMode::Interrupt {
        let setup = poll::setup_polled_ring(opts.poll, entries, &opts.path);
        poll_setup_fallback = setup.fallback;
        if let Some((mode, r)) = setup.ring {
            poll_setup = mode;
            let fallback = Some((normal.shared.clone(), refusal.clone()));
            let shared = RingShared::new(format!("{name}-poll"), r, depth, files.clone(), fallback);
            polled = Some(Ring::spawn(shared).map_err(thread_error("a completion thread"))?);
        }
    }
    Ok(Started {
        backend: Backend::Uring { normal, polled },
        engine: EngineKind::Uring,
        engine_fallback: None,
        poll_setup,
        poll_setup_fallback,
    })
}

impl Device for FileDevice {
    fn submit(&self, bio: Bio) {
        if let Err(st) = check_bio(self, &bio) {
            bio.complete(st);
            return;
        }
        self.files.stats.count(&bio);
        match &self.backend {
            Backend::Psync(pool) => pool.submit(bio),
            Backend::Uring { normal, polled } => match polled {
                Some(p)
                    if bio.op.has_data()
                        && !bio.flags.contains(BioFlags::PREFLUSH)
                        && !self.refusal.is_refused()
                        && self.files.route(&bio) != Route::Buffered =>
                {
                    p.shared.submit(bio)
                }
                _ => normal.shared.submit(bio),
            },
        }
    }

    fn size(&self) -> u64 {
        self.size
    }

    /// One ring, `queue_depth` deep: the loop driver's single hardware
    /// queue (`nr_hw_queues = 1`, `hw_queue_depth`).
    fn queue_shape(&self) -> Option<QueueShape> {
        Some(QueueShape {
            hw_queues: 1,
            depth: self.opts.queue_depth.max(1),
        })
    }

    fn features(&self) -> Features {
        Features {
            flush: true,
            fua: true,
            discard: self.files.punch_hole,
            discard_granularity: 0,
            write_zeroes: true,
            fast_zero: self.files.punch_hole || self.files.zero_range.load(Ordering::Relaxed),
            read_only: false,
            flush_is_global: true,
            knows_holes: true,
        }
    }

    /// Data and holes from SEEK_DATA/SEEK_HOLE.
    fn extents(&self, offset: u64, len: u64) -> Option<Vec<Extent>> {
        let end = offset.checked_add(len)?.min(self.size);
        self.files.extents(offset, end)
    }

    /// The interrupt-driven ring's completions (see `ring`), when it is
    /// the only ring: a polled ring's CQEs never show on a descriptor.
    fn reaper(&self) -> Option<Box<dyn blkstack_core::Reaper>> {
        match &self.backend {
            Backend::Uring {
                normal,
                polled: None,
            } => Some(normal.shared.claim()),
            _ => None,
        }
    }
}

impl Drop for FileDevice {
    fn drop(&mut self) {
        // Stop the polled ring first: its refused I/O moves to the normal one.
        if let Backend::Uring { polled, .. } = &mut self.backend {
            drop(polled.take());
        }
    }
}
