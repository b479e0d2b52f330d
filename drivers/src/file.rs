//! `file`: a block device backed by a regular file (or a block device
//! node), driven through io_uring, like the kernel's loop driver with
//! `LO_FLAGS_DIRECT_IO` or nbdkit's file plugin.
//!
//! Table line: `file PATH [direct] [iopoll|hybrid_iopoll] [create]
//! [queue_depth=N] [engine=uring|psync]`. The device is the line's length;
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
//! Rings. One io_uring per device: submitters (any thread) push an SQE
//! under a mutex and enter the kernel at once; one completion thread waits
//! for CQEs (`submit_and_wait(1)`) and completes bios. Slots are
//! preallocated (`queue_depth` of them) and an SQE's `user_data` is its slot
//! index, so nothing is allocated per I/O. Bios that find every slot busy
//! wait in a backlog the completion thread drains as slots free up (it
//! must never block on a slot itself: upper layers resubmit from `end_io`).
//!
//! `iopoll` / `hybrid_iopoll` add a second ring created with
//! `IORING_SETUP_IOPOLL` (and `IORING_SETUP_HYBRID_IOPOLL`, Linux 6.13,
//! seed 002: the first I/O never sleeps, later ones sleep half the
//! shortest completion time seen, then poll). Only aligned O_DIRECT reads
//! and writes may go to a polled ring; flushes, discards and buffered
//! fallbacks use the interrupt-driven ring. The kernel may refuse polling
//! at setup (old kernel: EINVAL) or per I/O (a device without poll queues,
//! such as virtio-blk: the ring is created but each CQE carries
//! -EOPNOTSUPP). Both are detected, logged once on stderr and shown by
//! `status`; a refused I/O is resubmitted on the interrupt ring, so the
//! caller never sees the refusal. A one-block probe read at construction
//! finds the per-I/O refusal before the device is used.
//!
//! `engine=psync` (also the automatic fallback when io_uring cannot be set
//! up at all, e.g. under a seccomp filter) serves bios from a small thread
//! pool with `pread`/`pwritev2`/`fsync`/`fallocate`.

use crate::args::KvArgs;
use crate::error::FileError;
use blkstack_core::device::{check_bio, Extent};
use blkstack_core::{AlignedBuf, Bio, BioFlags, Device, Features, Op, Status};
use io_uring::{opcode, squeue, types, IoUring};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

/// Default number of requests one ring keeps in flight.
pub const DEFAULT_QUEUE_DEPTH: u32 = 128;
const MAX_QUEUE_DEPTH: u64 = 4096;
/// Threads of the psync engine (at most; fewer with a small queue depth).
const PSYNC_THREADS: u32 = 8;
/// The kernel's `IORING_SETUP_IOPOLL` / `IORING_SETUP_HYBRID_IOPOLL` /
/// `IORING_SETUP_CQSIZE` (include/uapi/linux/io_uring.h).
const SETUP_IOPOLL: u32 = 1 << 0;
const SETUP_CQSIZE: u32 = 1 << 3;
const SETUP_HYBRID_IOPOLL: u32 = 1 << 17;

/// How completions of O_DIRECT reads and writes are found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollMode {
    /// Interrupt-driven: the completion thread sleeps in the kernel.
    Interrupt,
    /// `IORING_SETUP_IOPOLL`: the completion thread spins in the kernel.
    Iopoll,
    /// `IORING_SETUP_HYBRID_IOPOLL`: sleep about half the shortest
    /// completion time seen, then poll.
    Hybrid,
}

impl PollMode {
    pub fn name(self) -> &'static str {
        match self {
            PollMode::Interrupt => "interrupt",
            PollMode::Iopoll => "iopoll",
            PollMode::Hybrid => "hybrid_iopoll",
        }
    }
}

/// Which I/O engine serves the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    Uring,
    Psync,
}

impl EngineKind {
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Uring => "uring",
            EngineKind::Psync => "psync",
        }
    }
}

/// Everything the table line asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileOptions {
    pub path: PathBuf,
    pub direct: bool,
    pub poll: PollMode,
    pub create: bool,
    pub queue_depth: u32,
    pub engine: EngineKind,
}

impl FileOptions {
    /// Parse `PATH [direct] [iopoll|hybrid_iopoll] [create] [key=value...]`.
    pub fn parse(args: &[&str]) -> Result<FileOptions, FileError> {
        let (path, rest) = args.split_first().ok_or(FileError::MissingPath)?;
        if path.contains('=') || path.is_empty() {
            return Err(FileError::BadPath(path.to_string()));
        }
        let mut direct = false;
        let mut create = false;
        let mut poll: Option<PollMode> = None;
        let mut kv_words = Vec::new();
        for w in rest {
            let set_flag = |flag: &mut bool, name: &'static str| -> Result<(), FileError> {
                if std::mem::replace(flag, true) {
                    return Err(FileError::FlagTwice(name));
                }
                Ok(())
            };
            match *w {
                "direct" => set_flag(&mut direct, "direct")?,
                "create" => set_flag(&mut create, "create")?,
                "iopoll" | "hybrid_iopoll" => {
                    let mode = if *w == "iopoll" {
                        PollMode::Iopoll
                    } else {
                        PollMode::Hybrid
                    };
                    if let Some(prev) = poll {
                        return Err(FileError::PollConflict {
                            given: mode.name(),
                            previous: prev.name(),
                        });
                    }
                    poll = Some(mode);
                }
                w if w.contains('=') => kv_words.push(w),
                w => return Err(FileError::UnknownFlag(w.to_string())),
            }
        }
        let mut kv = KvArgs::parse("file", &kv_words)?;
        let queue_depth = kv.take_u64(
            "queue_depth",
            DEFAULT_QUEUE_DEPTH as u64,
            1,
            MAX_QUEUE_DEPTH,
        )? as u32;
        let engine = kv.take_choice(
            "engine",
            EngineKind::Uring,
            &[("uring", EngineKind::Uring), ("psync", EngineKind::Psync)],
        )?;
        kv.finish()?;
        let poll = poll.unwrap_or(PollMode::Interrupt);
        if poll != PollMode::Interrupt && !direct {
            return Err(FileError::PollNeedsDirect(poll.name()));
        }
        if poll != PollMode::Interrupt && engine == EngineKind::Psync {
            return Err(FileError::PollNeedsUring(poll.name()));
        }
        Ok(FileOptions {
            path: PathBuf::from(path),
            direct,
            poll,
            create,
            queue_depth,
            engine,
        })
    }

    /// The canonical argument text (`dmsetup table`): parsing it again
    /// gives the same options.
    pub fn table_args(&self) -> String {
        let mut words = vec![self.path.display().to_string()];
        if self.direct {
            words.push("direct".into());
        }
        if self.poll != PollMode::Interrupt {
            words.push(self.poll.name().into());
        }
        if self.create {
            words.push("create".into());
        }
        if self.queue_depth != DEFAULT_QUEUE_DEPTH {
            words.push(format!("queue_depth={}", self.queue_depth));
        }
        if self.engine != EngineKind::Uring {
            words.push(format!("engine={}", self.engine.name()));
        }
        words.join(" ")
    }
}

/// Per-device counters shown by `status`.
#[derive(Default)]
struct Stats {
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    discards: AtomicU64,
    zeroes: AtomicU64,
    errors: AtomicU64,
    /// Direct I/O whose memory was misaligned and went through a bounce buffer.
    bounced: AtomicU64,
    /// Direct I/O whose offset/length was misaligned and went buffered.
    buffered: AtomicU64,
    /// I/O completed on a polled ring.
    polled: AtomicU64,
    /// I/O the polled ring refused and the interrupt ring redid.
    poll_refused: AtomicU64,
    /// Write-zeroes done by writing zeroes (no ZERO_RANGE).
    zeroes_written: AtomicU64,
}

impl Stats {
    fn count(&self, bio: &Bio) {
        let c = match bio.op {
            Op::Read => &self.reads,
            Op::Write => &self.writes,
            Op::Flush => &self.flushes,
            Op::Discard => &self.discards,
            Op::WriteZeroes => &self.zeroes,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// The backing file, opened once buffered and (with `direct`) once more
/// with O_DIRECT.
struct Files {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    /// O_DIRECT memory alignment (statx `stx_dio_mem_align`).
    mem_align: usize,
    /// O_DIRECT file offset/length alignment (`stx_dio_offset_align`).
    off_align: u64,
    punch_hole: bool,
    /// Cleared when the filesystem refuses FALLOC_FL_ZERO_RANGE once.
    zero_range: AtomicBool,
    stats: Stats,
}

/// Where one read/write goes and through which memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Route {
    /// O_DIRECT with the bio's own memory.
    Direct,
    /// O_DIRECT through the slot's bounce buffer.
    Bounce,
    /// The buffered descriptor.
    Buffered,
}

impl Files {
    fn route(&self, bio: &Bio) -> Route {
        if self.direct.is_none() {
            return Route::Buffered;
        }
        if !bio.offset.is_multiple_of(self.off_align) || !bio.len.is_multiple_of(self.off_align) {
            return Route::Buffered;
        }
        if !(bio.buf.as_ptr() as usize).is_multiple_of(self.mem_align) {
            return Route::Bounce;
        }
        Route::Direct
    }

    fn fd_for(&self, route: Route) -> RawFd {
        match (route, &self.direct) {
            (Route::Direct | Route::Bounce, Some(d)) => d.as_raw_fd(),
            _ => self.buffered.as_raw_fd(),
        }
    }

    fn zero_mode(&self, flags: BioFlags) -> i32 {
        if flags.contains(BioFlags::NOUNMAP) || !self.punch_hole {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        }
    }

    /// Write-zeroes without fallocate: write zero pages through the
    /// buffered descriptor. Slow, so a FAST_ZERO request is refused.
    fn write_zeroes_by_writing(&self, bio: &Bio) -> Status {
        if bio.flags.contains(BioFlags::FAST_ZERO) {
            return Status::Again;
        }
        static ZEROES: [u8; 64 << 10] = [0; 64 << 10];
        self.stats.zeroes_written.fetch_add(1, Ordering::Relaxed);
        let fd = self.buffered.as_raw_fd();
        let mut off = bio.offset;
        let end = bio.offset + bio.len;
        while off < end {
            let n = (end - off).min(ZEROES.len() as u64) as usize;
            // SAFETY: ZEROES is a valid buffer of at least n bytes.
            let r = unsafe { libc::pwrite(fd, ZEROES.as_ptr().cast(), n, off as libc::off_t) };
            if r < 0 {
                let e = errno();
                if e == libc::EINTR {
                    continue;
                }
                return Status::from_errno(e);
            }
            off += r as u64;
        }
        if bio.flags.contains(BioFlags::FUA) {
            // SAFETY: plain syscall on an open descriptor.
            if unsafe { libc::fdatasync(fd) } < 0 {
                return Status::from_errno(errno());
            }
        }
        Status::Ok
    }

    /// Synchronous execution of one bio (the psync engine).
    fn exec_sync(&self, bio: &Bio, bounce: &mut Option<AlignedBuf>) -> Status {
        let buffered_fd = self.buffered.as_raw_fd();
        if bio.flags.contains(BioFlags::PREFLUSH) || bio.op == Op::Flush {
            // SAFETY: plain syscall on an open descriptor.
            if unsafe { libc::fsync(buffered_fd) } < 0 {
                return Status::from_errno(errno());
            }
            if bio.op == Op::Flush {
                return Status::Ok;
            }
        }
        match bio.op {
            Op::Flush => Status::Ok,
            Op::Read | Op::Write => {
                let route = self.route(bio);
                self.count_route(route);
                let fd = self.fd_for(route);
                let len = bio.len as usize;
                let mem: *mut u8 = if route == Route::Bounce {
                    let b = ensure_bounce(bounce, len);
                    if bio.op == Op::Write {
                        b.as_mut_slice()[..len].copy_from_slice(bio.data());
                    }
                    b.as_mut_slice().as_mut_ptr()
                } else {
                    bio.buf.as_ptr()
                };
                let rw_flags = if bio.op == Op::Write && bio.flags.contains(BioFlags::FUA) {
                    libc::RWF_DSYNC
                } else {
                    0
                };
                let mut done = 0usize;
                while done < len {
                    let iov = libc::iovec {
                        // SAFETY: in bounds of the len-byte buffer.
                        iov_base: unsafe { mem.add(done) }.cast(),
                        iov_len: len - done,
                    };
                    let off = (bio.offset + done as u64) as libc::off_t;
                    // SAFETY: iov points into memory valid for len bytes
                    // (the bio's buffer contract or our bounce buffer).
                    let r = unsafe {
                        if bio.op == Op::Read {
                            libc::preadv2(fd, &iov, 1, off, 0)
                        } else {
                            libc::pwritev2(fd, &iov, 1, off, rw_flags)
                        }
                    };
                    if r < 0 {
                        let e = errno();
                        if e == libc::EINTR || e == libc::EAGAIN {
                            continue;
                        }
                        return Status::from_errno(e);
                    }
                    if r == 0 {
                        if bio.op == Op::Read {
                            // Past the end of a file someone shortened:
                            // zeroes, as the loop driver returns.
                            // SAFETY: in bounds of the buffer.
                            unsafe { std::ptr::write_bytes(mem.add(done), 0, len - done) };
                            break;
                        }
                        return Status::IoError;
                    }
                    done += r as usize;
                }
                if route == Route::Bounce && bio.op == Op::Read {
                    if let Some(b) = bounce {
                        bio.data_mut().copy_from_slice(&b.as_slice()[..len]);
                    }
                }
                Status::Ok
            }
            Op::Discard | Op::WriteZeroes => {
                let mode = if bio.op == Op::Discard {
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
                } else {
                    self.zero_mode(bio.flags)
                };
                // SAFETY: plain syscall on an open descriptor.
                let r = unsafe {
                    libc::fallocate(
                        buffered_fd,
                        mode,
                        bio.offset as libc::off_t,
                        bio.len as libc::off_t,
                    )
                };
                let st = if r < 0 {
                    Status::from_errno(errno())
                } else {
                    Status::Ok
                };
                self.after_fallocate(bio, st)
            }
        }
    }

    /// What a fallocate result means for the bio: a write-zeroes the
    /// filesystem cannot do with fallocate is done by writing zeroes.
    fn after_fallocate(&self, bio: &Bio, st: Status) -> Status {
        if bio.op == Op::WriteZeroes && st == Status::NotSupported {
            self.zero_range.store(false, Ordering::Relaxed);
            return self.write_zeroes_by_writing(bio);
        }
        if st.is_ok() && bio.op == Op::WriteZeroes && bio.flags.contains(BioFlags::FUA) {
            // SAFETY: plain syscall on an open descriptor.
            if unsafe { libc::fdatasync(self.buffered.as_raw_fd()) } < 0 {
                return Status::from_errno(errno());
            }
        }
        st
    }

    fn count_route(&self, route: Route) {
        match route {
            Route::Bounce => self.stats.bounced.fetch_add(1, Ordering::Relaxed),
            Route::Buffered if self.direct.is_some() => {
                self.stats.buffered.fetch_add(1, Ordering::Relaxed)
            }
            _ => 0,
        };
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// A bounce buffer of at least `len` bytes, reusing the one kept.
fn ensure_bounce(bounce: &mut Option<AlignedBuf>, len: usize) -> &mut AlignedBuf {
    if bounce.as_ref().is_none_or(|b| b.len() < len) {
        *bounce = Some(AlignedBuf::new(len));
    }
    bounce.as_mut().expect("bounce buffer just ensured")
}

// ---------------------------------------------------------------- io_uring

/// Which SQE a slot's bio is waiting for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stage {
    /// The fsync a PREFLUSH bio needs before its own operation.
    PreFlush,
    Main,
}

struct Slot {
    bio: Option<Bio>,
    stage: Stage,
    route: Route,
    /// Bytes of a read/write already transferred (short transfers resume).
    done: u64,
    bounce: Option<AlignedBuf>,
}

struct FreeList {
    free: Vec<u32>,
    /// Bios that arrived while every slot was busy.
    backlog: VecDeque<Bio>,
}

/// The kernel's `struct io_uring_params` (include/uapi/linux/io_uring.h),
/// to set up rings with flags the io-uring crate's builder has no setter
/// for (`IORING_SETUP_HYBRID_IOPOLL`).
#[repr(C)]
#[derive(Default)]
struct RawParams {
    sq_entries: u32,
    cq_entries: u32,
    flags: u32,
    sq_thread_cpu: u32,
    sq_thread_idle: u32,
    features: u32,
    wq_fd: u32,
    resv: [u32; 3],
    sq_off: [u64; 5],
    cq_off: [u64; 5],
}

const _: () = assert!(std::mem::size_of::<RawParams>() == 120);
const _: () =
    assert!(std::mem::size_of::<RawParams>() == std::mem::size_of::<io_uring::Parameters>());

/// `io_uring_setup(entries, {flags})` and wrap the result.
fn setup_ring(entries: u32, flags: u32) -> std::io::Result<IoUring> {
    let mut p = RawParams {
        flags: flags | SETUP_CQSIZE,
        cq_entries: entries * 2,
        ..Default::default()
    };
    // SAFETY: io_uring_setup reads and fills a correctly laid-out params struct.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_io_uring_setup,
            entries as libc::c_long,
            &mut p as *mut RawParams,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `Parameters` is a transparent wrapper of `io_uring_params`
    // (sizes checked above), filled in by the kernel for this very fd, and
    // the fd is a fresh ring we hand over.
    unsafe {
        let params: io_uring::Parameters = std::mem::transmute(p);
        IoUring::from_fd(fd as RawFd, params).inspect_err(|_| {
            libc::close(fd as RawFd);
        })
    }
}

struct RingShared {
    name: String,
    ring: IoUring,
    /// Serializes access to the submission queue (submitters are many).
    sq: Mutex<()>,
    slots: Box<[Mutex<Slot>]>,
    free: Mutex<FreeList>,
    /// SQEs submitted and not yet reaped.
    inflight: AtomicU32,
    files: Arc<Files>,
    /// Set for a polled ring: where refused I/O goes, and the shared flag
    /// that says polling was refused.
    fallback: Option<(Arc<RingShared>, Arc<PollRefusal>)>,
    stop: AtomicBool,
    thread: OnceLock<std::thread::Thread>,
}

/// Why and whether polling was turned off, shared by the device and its
/// polled ring.
#[derive(Default)]
struct PollRefusal {
    refused: AtomicBool,
    reason: OnceLock<String>,
}

impl PollRefusal {
    fn refuse(&self, reason: String, path: &Path) {
        if self.reason.set(reason.clone()).is_ok() {
            eprintln!(
                "blkstack file {}: polled completions refused ({reason}); falling back to interrupt-driven completions",
                path.display()
            );
        }
        self.refused.store(true, Ordering::Release);
    }

    fn is_refused(&self) -> bool {
        self.refused.load(Ordering::Acquire)
    }
}

impl RingShared {
    fn new(
        name: String,
        ring: IoUring,
        depth: u32,
        files: Arc<Files>,
        fallback: Option<(Arc<RingShared>, Arc<PollRefusal>)>,
    ) -> RingShared {
        let slots = (0..depth)
            .map(|_| {
                Mutex::new(Slot {
                    bio: None,
                    stage: Stage::Main,
                    route: Route::Buffered,
                    done: 0,
                    bounce: None,
                })
            })
            .collect();
        RingShared {
            name,
            ring,
            sq: Mutex::new(()),
            slots,
            free: Mutex::new(FreeList {
                free: (0..depth).rev().collect(),
                backlog: VecDeque::with_capacity(depth as usize),
            }),
            inflight: AtomicU32::new(0),
            files,
            fallback,
            stop: AtomicBool::new(false),
            thread: OnceLock::new(),
        }
    }

    fn is_polled(&self) -> bool {
        self.fallback.is_some()
    }

    fn submit(&self, bio: Bio) {
        let idx = {
            let mut f = self.free.lock();
            match f.free.pop() {
                Some(i) => i,
                None => {
                    f.backlog.push_back(bio);
                    return;
                }
            }
        };
        self.start(idx, bio);
    }

    /// Put `bio` in slot `idx` and issue its first SQE.
    fn start(&self, idx: u32, bio: Bio) {
        let mut slot = self.slots[idx as usize].lock();
        slot.stage = if bio.flags.contains(BioFlags::PREFLUSH) && bio.op != Op::Flush {
            Stage::PreFlush
        } else {
            Stage::Main
        };
        slot.done = 0;
        slot.route = if bio.op.has_data() {
            self.files.route(&bio)
        } else {
            Route::Buffered
        };
        if bio.op.has_data() {
            self.files.count_route(slot.route);
        }
        if slot.route == Route::Bounce {
            let len = bio.len as usize;
            let b = ensure_bounce(&mut slot.bounce, len);
            if bio.op == Op::Write {
                b.as_mut_slice()[..len].copy_from_slice(bio.data());
            }
        }
        slot.bio = Some(bio);
        let sqe = self.build_sqe(idx, &slot);
        drop(slot);
        self.push(sqe);
    }

    fn build_sqe(&self, idx: u32, slot: &Slot) -> squeue::Entry {
        let bio = slot.bio.as_ref().expect("a slot being issued holds a bio");
        let files = &self.files;
        let buffered = types::Fd(files.buffered.as_raw_fd());
        let sqe = if slot.stage == Stage::PreFlush {
            opcode::Fsync::new(buffered).build()
        } else {
            match bio.op {
                Op::Read | Op::Write => {
                    let fd = types::Fd(files.fd_for(slot.route));
                    let base = match (&slot.bounce, slot.route) {
                        (Some(b), Route::Bounce) => b.as_slice().as_ptr() as *mut u8,
                        _ => bio.buf.as_ptr(),
                    };
                    // SAFETY: done < len, in bounds of the buffer.
                    let ptr = unsafe { base.add(slot.done as usize) };
                    let len = (bio.len - slot.done) as u32;
                    let off = bio.offset + slot.done;
                    if bio.op == Op::Read {
                        opcode::Read::new(fd, ptr, len).offset(off).build()
                    } else {
                        let flags = if bio.flags.contains(BioFlags::FUA) {
                            libc::RWF_DSYNC
                        } else {
                            0
                        };
                        opcode::Write::new(fd, ptr, len)
                            .offset(off)
                            .rw_flags(flags)
                            .build()
                    }
                }
                Op::Flush => opcode::Fsync::new(buffered).build(),
                Op::Discard => opcode::Fallocate::new(buffered, bio.len)
                    .offset(bio.offset)
                    .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                    .build(),
                Op::WriteZeroes => opcode::Fallocate::new(buffered, bio.len)
                    .offset(bio.offset)
                    .mode(files.zero_mode(bio.flags))
                    .build(),
            }
        };
        sqe.user_data(idx as u64)
    }

    /// Queue one SQE and enter the kernel right away.
    fn push(&self, sqe: squeue::Entry) {
        if self.inflight.fetch_add(1, Ordering::AcqRel) == 0 {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
        {
            let _g = self.sq.lock();
            // SAFETY: the `sq` mutex makes this the only submission queue
            // handle alive.
            let mut sq = unsafe { self.ring.submission_shared() };
            // Each slot has at most one SQE outstanding and there are no
            // more slots than SQ entries, so the queue has room.
            // SAFETY: the SQE's buffer (bio memory or the slot's bounce
            // buffer) stays valid until its CQE is reaped.
            while unsafe { sq.push(&sqe) }.is_err() {
                drop(sq);
                let _ = self.ring.submit();
                // SAFETY: as above.
                sq = unsafe { self.ring.submission_shared() };
            }
            sq.sync();
        }
        loop {
            match self.ring.submit() {
                Ok(_) => break,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                    ) =>
                {
                    // The completion thread's next enter submits it too.
                    if e.raw_os_error() != Some(libc::EINTR) {
                        break;
                    }
                }
                Err(e) => {
                    eprintln!(
                        "blkstack file ring {}: io_uring_enter failed: {e}",
                        self.name
                    );
                    break;
                }
            }
        }
    }

    /// The completion thread: reap CQEs, finish or continue their bios.
    fn run_completions(self: Arc<Self>) {
        let mut batch: Vec<(u64, i32)> = Vec::with_capacity(self.slots.len() * 2);
        loop {
            if self.inflight.load(Ordering::Acquire) == 0 {
                if self.stop.load(Ordering::Acquire) {
                    break;
                }
                std::thread::park();
                continue;
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                if !matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                ) {
                    eprintln!(
                        "blkstack file ring {}: waiting for completions: {e}",
                        self.name
                    );
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            {
                // SAFETY: this thread is the only completion queue reader.
                let cq = unsafe { self.ring.completion_shared() };
                batch.extend(cq.map(|c| (c.user_data(), c.result())));
            }
            for (idx, res) in batch.drain(..) {
                self.inflight.fetch_sub(1, Ordering::AcqRel);
                self.on_cqe(idx as u32, res);
            }
        }
    }

    fn on_cqe(&self, idx: u32, res: i32) {
        let mut guard = self.slots[idx as usize].lock();
        // A plain reference, so that fields borrow separately.
        let slot: &mut Slot = &mut guard;
        let Some(bio) = slot.bio.as_ref() else {
            debug_assert!(false, "CQE for an idle slot {idx}");
            return;
        };
        if slot.stage == Stage::PreFlush {
            if res < 0 {
                drop(guard);
                return self.finish(idx, Status::from_errno(res));
            }
            slot.stage = Stage::Main;
            let sqe = self.build_sqe(idx, slot);
            drop(guard);
            return self.push(sqe);
        }
        match bio.op {
            Op::Read | Op::Write => {
                if res == -libc::EOPNOTSUPP {
                    if let Some((normal, refusal)) = &self.fallback {
                        // The device cannot poll: redo this bio on the
                        // interrupt ring, and send later ones there.
                        refusal.refuse(
                            "the kernel returned EOPNOTSUPP for a polled read/write: the device has no poll queues".into(),
                            &self.files.path,
                        );
                        self.files
                            .stats
                            .poll_refused
                            .fetch_add(1, Ordering::Relaxed);
                        let bio = slot.bio.take().expect("checked above");
                        drop(guard);
                        self.release(idx);
                        normal.submit(bio);
                        return;
                    }
                }
                if res == -libc::EAGAIN || res == -libc::EINTR {
                    let sqe = self.build_sqe(idx, slot);
                    drop(guard);
                    return self.push(sqe);
                }
                if res < 0 {
                    drop(guard);
                    return self.finish(idx, Status::from_errno(res));
                }
                let len = bio.len;
                if res == 0 && slot.done < len {
                    if bio.op == Op::Write {
                        drop(guard);
                        return self.finish(idx, Status::IoError);
                    }
                    // A read past the end of a file someone shortened
                    // reads zeroes, as the loop driver does.
                    let done = slot.done as usize;
                    match (slot.route, &mut slot.bounce) {
                        (Route::Bounce, Some(b)) => b.as_mut_slice()[done..len as usize].fill(0),
                        _ => bio.data_mut()[done..].fill(0),
                    }
                    slot.done = len;
                } else {
                    slot.done += res as u64;
                }
                if slot.done < len {
                    let sqe = self.build_sqe(idx, slot);
                    drop(guard);
                    return self.push(sqe);
                }
                if bio.op == Op::Read && slot.route == Route::Bounce {
                    if let Some(b) = &slot.bounce {
                        bio.data_mut()
                            .copy_from_slice(&b.as_slice()[..len as usize]);
                    }
                }
                if self.is_polled() {
                    self.files.stats.polled.fetch_add(1, Ordering::Relaxed);
                }
                drop(guard);
                self.finish(idx, Status::Ok)
            }
            Op::Discard | Op::WriteZeroes => {
                let st = if res < 0 {
                    Status::from_errno(res)
                } else {
                    Status::Ok
                };
                // Possibly slow (writing zeroes): rare, and only when the
                // filesystem lacks ZERO_RANGE.
                let st = self.files.after_fallocate(bio, st);
                drop(guard);
                self.finish(idx, st)
            }
            Op::Flush => {
                drop(guard);
                self.finish(
                    idx,
                    if res < 0 {
                        Status::from_errno(res)
                    } else {
                        Status::Ok
                    },
                )
            }
        }
    }

    /// Complete the slot's bio and reuse the slot for a waiting one.
    fn finish(&self, idx: u32, status: Status) {
        let bio = self.slots[idx as usize]
            .lock()
            .bio
            .take()
            .expect("finishing a slot that holds a bio");
        if !status.is_ok() {
            self.files.stats.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.release(idx);
        bio.complete(status);
    }

    /// Give slot `idx` to the oldest waiting bio, or back to the free list.
    fn release(&self, idx: u32) {
        let next = {
            let mut f = self.free.lock();
            match f.backlog.pop_front() {
                Some(b) => Some(b),
                None => {
                    f.free.push(idx);
                    None
                }
            }
        };
        if let Some(b) = next {
            self.start(idx, b);
        }
    }
}

/// A ring and its completion thread.
struct Ring {
    shared: Arc<RingShared>,
    thread: Option<JoinHandle<()>>,
}

impl Ring {
    fn spawn(shared: RingShared) -> std::io::Result<Ring> {
        let shared = Arc::new(shared);
        let s2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("file-cq-{}", shared.name))
            .spawn(move || s2.run_completions())?;
        let _ = shared.thread.set(thread.thread().clone());
        Ok(Ring {
            shared,
            thread: Some(thread),
        })
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            join_unless_self(t);
        }
    }
}

// ------------------------------------------------------------------ psync

struct PoolShared {
    queue: Mutex<VecDeque<Bio>>,
    cv: Condvar,
    stop: AtomicBool,
    files: Arc<Files>,
}

struct Pool {
    shared: Arc<PoolShared>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    fn spawn(files: Arc<Files>, depth: u32, name: &str) -> std::io::Result<Pool> {
        let shared = Arc::new(PoolShared {
            queue: Mutex::new(VecDeque::with_capacity(depth as usize)),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            files,
        });
        let mut threads = Vec::new();
        for i in 0..depth.clamp(1, PSYNC_THREADS) {
            let s = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("file-psync-{name}-{i}"))
                    .spawn(move || Pool::worker(s))?,
            );
        }
        Ok(Pool { shared, threads })
    }

    fn worker(s: Arc<PoolShared>) {
        let mut bounce = None;
        loop {
            let bio = {
                let mut q = s.queue.lock();
                loop {
                    if let Some(b) = q.pop_front() {
                        break b;
                    }
                    if s.stop.load(Ordering::Acquire) {
                        return;
                    }
                    s.cv.wait(&mut q);
                }
            };
            let st = s.files.exec_sync(&bio, &mut bounce);
            if !st.is_ok() {
                s.files.stats.errors.fetch_add(1, Ordering::Relaxed);
            }
            bio.complete(st);
        }
    }

    fn submit(&self, bio: Bio) {
        self.shared.queue.lock().push_back(bio);
        self.shared.cv.notify_one();
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Workers finish what is queued before they see `stop`.
        self.shared.stop.store(true, Ordering::Release);
        {
            let _q = self.shared.queue.lock();
            self.shared.cv.notify_all();
        }
        for t in self.threads.drain(..) {
            join_unless_self(t);
        }
    }
}

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

// ----------------------------------------------------------------- device

enum Backend {
    Uring {
        /// Interrupt-driven ring: everything that is not polled.
        normal: Ring,
        /// The IOPOLL ring, when asked for and set up.
        polled: Option<Ring>,
    },
    Psync(Pool),
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

    pub fn open(size: u64, opts: FileOptions) -> Result<FileDevice, FileError> {
        crate::args::check_size("file", size, 512)?;
        let path = &opts.path;
        let exists = path.exists();
        if !exists && !opts.create {
            return Err(FileError::NotFound { path: path.clone() });
        }
        if let Ok(m) = std::fs::metadata(path) {
            let ft = m.file_type();
            if !ft.is_file() && !ft.is_block_device() {
                return Err(FileError::NotFileOrBlockDevice { path: path.clone() });
            }
        }
        let buffered = OpenOptions::new()
            .read(true)
            .write(true)
            .create(opts.create)
            .open(path)
            .map_err(|e| FileError::io(path, "cannot open", e))?;
        let meta = buffered
            .metadata()
            .map_err(|e| FileError::io(path, "cannot stat", e))?;
        let ft = meta.file_type();
        let is_blockdev = ft.is_block_device();
        if !ft.is_file() && !is_blockdev {
            return Err(FileError::NotFileOrBlockDevice { path: path.clone() });
        }
        let current = if is_blockdev {
            // SAFETY: lseek on an open descriptor.
            let end = unsafe { libc::lseek(buffered.as_raw_fd(), 0, libc::SEEK_END) };
            if end < 0 {
                return Err(FileError::io(
                    path,
                    "cannot size",
                    std::io::Error::last_os_error(),
                ));
            }
            end as u64
        } else {
            meta.len()
        };
        if current < size {
            if opts.create && !is_blockdev {
                buffered
                    .set_len(size)
                    .map_err(|e| FileError::io(path, "cannot extend", e))?;
            } else {
                return Err(FileError::TooSmall {
                    path: path.clone(),
                    current,
                    size,
                    block_device: is_blockdev,
                });
            }
        }
        let direct = if opts.direct {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
                .map_err(|e| {
                    if e.raw_os_error() == Some(libc::EINVAL) {
                        FileError::DirectRefused {
                            path: path.clone(),
                            source: e,
                        }
                    } else {
                        FileError::io(path, "cannot open (O_DIRECT)", e)
                    }
                })?;
            Some(f)
        } else {
            None
        };
        let (mem_align, off_align) = dio_alignment(direct.as_ref().unwrap_or(&buffered));
        let punch_hole = probe_punch_hole(&buffered, current.max(size));
        let files = Arc::new(Files {
            path: path.clone(),
            buffered,
            direct,
            mem_align,
            off_align,
            punch_hole,
            zero_range: AtomicBool::new(true),
            stats: Stats::default(),
        });
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "file".into());
        let refusal = Arc::new(PollRefusal::default());
        let mut engine_fallback = None;
        let mut poll_setup_fallback = None;
        let mut poll_setup = PollMode::Interrupt;
        let backend = match opts.engine {
            EngineKind::Psync => None,
            EngineKind::Uring => {
                let entries = opts.queue_depth.next_power_of_two();
                match setup_ring(entries, 0) {
                    Err(e) => {
                        let why = format!("io_uring_setup failed: {e}");
                        eprintln!(
                            "blkstack file {}: {why}; falling back to the psync thread pool",
                            path.display()
                        );
                        engine_fallback = Some(why);
                        None
                    }
                    Ok(ring) => {
                        let normal = Ring::spawn(RingShared::new(
                            name.clone(),
                            ring,
                            opts.queue_depth,
                            files.clone(),
                            None,
                        ))
                        .map_err(|source| FileError::Thread {
                            what: "a completion thread",
                            source,
                        })?;
                        let polled = match opts.poll {
                            PollMode::Interrupt => None,
                            want => {
                                let mut tries = vec![(want, poll_flags(want))];
                                if want == PollMode::Hybrid {
                                    tries.push((PollMode::Iopoll, poll_flags(PollMode::Iopoll)));
                                }
                                let mut got = None;
                                let mut reasons = Vec::new();
                                for (mode, flags) in tries {
                                    match setup_ring(entries, flags) {
                                        Ok(r) => {
                                            got = Some((mode, r));
                                            break;
                                        }
                                        Err(e) => reasons.push(format!(
                                            "{} ring setup failed: {e}",
                                            mode.name()
                                        )),
                                    }
                                }
                                if !reasons.is_empty() {
                                    let why = reasons.join("; ");
                                    eprintln!(
                                        "blkstack file {}: {why}; using {}",
                                        path.display(),
                                        got.as_ref()
                                            .map(|g| g.0.name())
                                            .unwrap_or("interrupt-driven completions")
                                    );
                                    poll_setup_fallback = Some(why);
                                }
                                match got {
                                    None => None,
                                    Some((mode, r)) => {
                                        poll_setup = mode;
                                        Some(
                                            Ring::spawn(RingShared::new(
                                                format!("{name}-poll"),
                                                r,
                                                opts.queue_depth,
                                                files.clone(),
                                                Some((normal.shared.clone(), refusal.clone())),
                                            ))
                                            .map_err(|source| FileError::Thread {
                                                what: "a completion thread",
                                                source,
                                            })?,
                                        )
                                    }
                                }
                            }
                        };
                        Some(Backend::Uring { normal, polled })
                    }
                }
            }
        };
        let (backend, engine) = match backend {
            Some(b) => (b, EngineKind::Uring),
            None => (
                Backend::Psync(Pool::spawn(files.clone(), opts.queue_depth, &name).map_err(
                    |source| FileError::Thread {
                        what: "I/O threads",
                        source,
                    },
                )?),
                EngineKind::Psync,
            ),
        };
        let dev = FileDevice {
            opts,
            size,
            files,
            backend,
            engine,
            engine_fallback,
            poll_setup,
            poll_setup_fallback,
            refusal,
        };
        dev.probe_polling();
        Ok(dev)
    }

    /// Read one block through the polled ring, so that a device without
    /// poll queues is found (and logged) before anyone relies on it. The
    /// probe counts as one read in `status`.
    fn probe_polling(&self) {
        let Backend::Uring {
            polled: Some(_), ..
        } = &self.backend
        else {
            return;
        };
        let len = self.files.off_align.max(512).min(self.size);
        // Reading a hole completes without reaching the disk (and so
        // without being refused): probe the first block that holds data.
        // An all-hole file cannot be probed without writing; its first
        // real I/O finds the refusal instead.
        let Some(at) = self
            .extents(0, self.size)
            .and_then(|v| v.into_iter().find(|e| !e.hole))
            .map(|e| e.offset - e.offset % len)
        else {
            return;
        };
        if at + len > self.size {
            return;
        }
        let mut buf = AlignedBuf::new(len as usize);
        let st = blkstack_core::submit_and_wait(self, Op::Read, at, len, buf.as_mut_slice());
        if !st.is_ok() {
            eprintln!(
                "blkstack file {}: probe read failed: {st}",
                self.opts.path.display()
            );
        }
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
        if let Some(r) = self.refusal.reason.get() {
            v.push(r.clone());
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

fn poll_flags(mode: PollMode) -> u32 {
    match mode {
        PollMode::Interrupt => 0,
        PollMode::Iopoll => SETUP_IOPOLL,
        PollMode::Hybrid => SETUP_IOPOLL | SETUP_HYBRID_IOPOLL,
    }
}

/// O_DIRECT alignment of memory and of file offsets (statx
/// STATX_DIOALIGN, Linux 6.1); 4096 for both when the kernel does not say.
fn dio_alignment(f: &File) -> (usize, u64) {
    // SAFETY: a zeroed statx is a valid out-parameter.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let empty = c"";
    // SAFETY: valid fd, empty path with AT_EMPTY_PATH, valid out pointer.
    let r = unsafe {
        libc::statx(
            f.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if r == 0
        && stx.stx_mask & libc::STATX_DIOALIGN != 0
        && stx.stx_dio_mem_align != 0
        && stx.stx_dio_offset_align != 0
    {
        (
            stx.stx_dio_mem_align as usize,
            stx.stx_dio_offset_align as u64,
        )
    } else {
        (4096, 4096)
    }
}

/// Can this filesystem punch holes? Punching past the end of the file
/// with KEEP_SIZE changes nothing, and fails with EOPNOTSUPP where
/// unsupported.
fn probe_punch_hole(f: &File, end: u64) -> bool {
    let at = end.next_multiple_of(4096);
    // SAFETY: plain syscall on an open descriptor.
    let r = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            at as libc::off_t,
            4096,
        )
    };
    r == 0 || errno() != libc::EOPNOTSUPP
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

    fn features(&self) -> Features {
        Features {
            flush: true,
            fua: true,
            discard: self.files.punch_hole,
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
        let fd = self.files.buffered.as_raw_fd();
        let mut out: Vec<Extent> = Vec::new();
        let mut push = |off: u64, l: u64, hole: bool| {
            if l == 0 {
                return;
            }
            match out.last_mut() {
                Some(last) if last.hole == hole && last.offset + last.len == off => last.len += l,
                _ => out.push(Extent {
                    offset: off,
                    len: l,
                    hole,
                }),
            }
        };
        let mut pos = offset;
        while pos < end {
            // SAFETY: lseek on an open descriptor; I/O never uses the file
            // position, so moving it is harmless.
            let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
            if data < 0 {
                if errno() == libc::ENXIO {
                    push(pos, end - pos, true);
                    break;
                }
                return None;
            }
            let data = (data as u64).min(end);
            if data > pos {
                push(pos, data - pos, true);
                pos = data;
                continue;
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_HOLE) };
            if hole < 0 {
                return None;
            }
            let hole = (hole as u64).min(end).max(pos + 1);
            push(pos, hole - pos, false);
            pos = hole;
        }
        Some(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_and_round_trip() {
        let o =
            FileOptions::parse(&["/tmp/x", "direct", "hybrid_iopoll", "queue_depth=32"]).unwrap();
        assert!(o.direct);
        assert_eq!(o.poll, PollMode::Hybrid);
        assert_eq!(o.queue_depth, 32);
        let text = o.table_args();
        let words: Vec<&str> = text.split_whitespace().collect();
        assert_eq!(FileOptions::parse(&words).unwrap(), o);
        assert_eq!(
            FileOptions::parse(&["/tmp/x"]).unwrap().table_args(),
            "/tmp/x"
        );
    }

    #[test]
    fn options_errors_name_the_problem() {
        let e = |a: &[&str]| FileOptions::parse(a).unwrap_err().to_string();
        assert!(e(&[]).contains("missing PATH"));
        assert!(e(&["queue_depth=4"]).contains("PATH"));
        assert!(e(&["/x", "iopoll"]).contains("needs 'direct'"));
        assert!(e(&["/x", "direct", "iopoll", "hybrid_iopoll"]).contains("conflicts"));
        assert!(e(&["/x", "fast"]).contains("unknown flag 'fast'"));
        assert!(e(&["/x", "queue_depth=0"]).contains("queue_depth=0"));
        assert!(e(&["/x", "engine=aio"]).contains("engine='aio'"));
        assert!(e(&["/x", "direct", "direct"]).contains("twice"));
        assert!(e(&["/x", "direct", "iopoll", "engine=psync"]).contains("engine=uring"));
        assert!(e(&["/x", "colour=red"]).contains("'colour'"));
    }

    /// A filesystem whose O_DIRECT needs 4 KiB offsets (a 4Kn disk): a
    /// 512-byte-aligned bio must take the buffered descriptor, a bio with
    /// misaligned memory the bounce buffer, and both must land in the file.
    #[test]
    fn misaligned_direct_io_takes_the_fallback_routes() {
        use blkstack_core::{EndIo, IoBuf};
        struct Owner;
        impl EndIo for Owner {
            fn end_io(&self, _bio: Bio, _status: Status, _private: u64) {}
        }
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("r.img");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(true);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(&path).unwrap()
        };
        let files = Files {
            path: path.clone(),
            buffered: open(false),
            direct: Some(open(true)),
            mem_align: 4096,
            off_align: 4096,
            punch_hole: true,
            zero_range: AtomicBool::new(true),
            stats: Stats::default(),
        };
        let owner: Arc<dyn EndIo> = Arc::new(Owner);
        let mut bounce = None;
        let mut aligned = AlignedBuf::new(8192);
        aligned.as_mut_slice().fill(0x5a);
        let mut raw = vec![0x6bu8; 8192 + 1];
        let cases: [(u64, IoBuf, u8, Route); 3] = [
            // SAFETY: the buffers outlive the synchronous calls below.
            (
                4096,
                unsafe { aligned.io_buf(0, 4096) },
                0x5a,
                Route::Direct,
            ),
            (
                8192 + 512,
                unsafe { aligned.io_buf(4096, 4096) },
                0x5a,
                Route::Buffered,
            ),
            (
                65536,
                unsafe { IoBuf::from_slice(&mut raw[1..]) },
                0x6b,
                Route::Bounce,
            ),
        ];
        for (off, buf, byte, route) in cases {
            let bio = Bio::new(Op::Write, off, buf.len() as u64, buf, owner.clone(), 0);
            assert_eq!(files.route(&bio), route, "write at {off}");
            assert_eq!(files.exec_sync(&bio, &mut bounce), Status::Ok);
            bio.complete(Status::Ok);
            let on_disk = std::fs::read(&path).unwrap();
            let range = off as usize..off as usize + buf.len();
            assert!(
                on_disk[range].iter().all(|&b| b == byte),
                "write at {off} via {route:?}"
            );
            let back = AlignedBuf::new(buf.len() + 4096);
            // Read back through the same route shape (misaligned memory
            // for the bounce case).
            let rb = if route == Route::Bounce {
                // SAFETY: as above.
                unsafe { back.io_buf(1, buf.len()) }
            } else {
                // SAFETY: as above.
                unsafe { back.io_buf(0, buf.len()) }
            };
            let bio = Bio::new(Op::Read, off, rb.len() as u64, rb, owner.clone(), 0);
            assert_eq!(files.route(&bio), route, "read at {off}");
            assert_eq!(files.exec_sync(&bio, &mut bounce), Status::Ok);
            assert!(
                bio.data().iter().all(|&b| b == byte),
                "read at {off} via {route:?}"
            );
            bio.complete(Status::Ok);
        }
        assert_eq!(files.stats.buffered.load(Ordering::Relaxed), 2);
        assert_eq!(files.stats.bounced.load(Ordering::Relaxed), 2);
    }
}
