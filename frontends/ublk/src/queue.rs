//! One ublk queue: a thread that fetches the kernel's requests for the
//! queue's tags from /dev/ublkcN (`UBLK_U_IO_FETCH_REQ` io_uring commands
//! on a ring of its own), submits each as a bio into the stack, and
//! commits the result when the bio completes (`UBLK_U_IO_COMMIT_AND_FETCH_REQ`,
//! which also fetches the tag's next request). This is the server half of
//! drivers/block/ublk_drv.c's `ublk_queue_rq` -> `ublk_ch_uring_cmd`
//! exchange, with the request descriptors read from the array the driver
//! shares per queue (`ublk_ch_mmap`).
//!
//! A bio may complete on any thread (a completion thread of `null`, a
//! delay worker) but a tag may only be committed from the queue's own
//! ring: the driver takes a queue's io commands from one task only.
//! Completions therefore go to the queue's [`Inbox`]; the first one to
//! find it empty writes an eventfd that the ring polls, and the queue
//! thread commits the whole batch when that poll fires. While the queue
//! thread handles a batch of the ring's completions it collects the
//! inbox itself at the batch's end, so a completion in that window (a
//! device that completes inline, as `null` and `memory` do) costs no
//! eventfd write, read or poll wake: the commits of the whole batch go
//! to the kernel in the queue's next `io_uring_enter`, as kublk's do
//! (tools/testing/selftests/ublk/kublk.c, `ublk_process_io`). The kernel copies
//! data into (writes) and out of (reads) the per-tag buffer around the
//! exchange, so the bio's buffer is that tag's buffer: no copy here.
//!
//! The device's stop aborts the fetches (`UBLK_IO_RES_ABORT`); once the
//! kernel holds none of the queue's commands the thread ends, after the
//! stack has completed every bio it was given (bounded), since those
//! write into the tags' buffers.

use crate::uapi::{self, ublksrv_io_cmd, ublksrv_io_desc};
use blkstack_core::{Bio, BioFlags, DeviceRef, EndIo, Op, Status};
use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The op byte of `ublksrv_io_desc.op_flags`, and its flag bits.
const OP_MASK: u32 = 0xff;

/// User data of the eventfd poll: above every tag.
const POLL_TOKEN: u64 = u64::MAX;
/// One wait for the kernel: the loop looks at its state between two.
const WAIT_SLICE: Duration = Duration::from_secs(1);
/// How long a stopping queue waits for the kernel to hand back the io
/// commands it still holds before it drops its ring (which cancels them).
const ABORT_LIMIT: Duration = Duration::from_secs(30);
/// `prctl(PR_SET_IO_FLUSHER)` (include/uapi/linux/prctl.h).
const PR_SET_IO_FLUSHER: libc::c_int = 57;

/// Completed tags not yet taken by the queue thread.
struct Pending {
    done: Vec<(u16, i32)>,
    /// The queue thread takes `done` at the end of the batch it is in:
    /// a completion needs no wake. Set and cleared under the lock that
    /// guards `done`, so no completion falls between the two.
    collecting: bool,
}

/// Completed tags waiting for the queue thread, and the eventfd that
/// wakes it. Shared by the queue thread and every completer.
pub struct Inbox {
    pending: Mutex<Pending>,
    efd: OwnedFd,
    /// Bios submitted and not yet completed: their buffers must outlive
    /// them, so the queue keeps its buffers until this drains.
    inflight: AtomicUsize,
}

impl Inbox {
    fn new(depth: usize) -> std::io::Result<Arc<Inbox>> {
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Arc::new(Inbox {
            pending: Mutex::new(Pending {
                done: Vec::with_capacity(depth),
                collecting: false,
            }),
            // SAFETY: fd is fresh and ours.
            efd: unsafe { OwnedFd::from_raw_fd(fd) },
            inflight: AtomicUsize::new(0),
        }))
    }

    fn post(&self, tag: u16, res: i32) {
        let wake = {
            let mut p = self.pending.lock();
            p.done.push((tag, res));
            !p.collecting && p.done.len() == 1
        };
        if wake {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a valid u64 to our eventfd; a full
            // counter (EAGAIN) still leaves it readable, which is all we need.
            unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
        self.inflight.fetch_sub(1, Ordering::Release);
    }

    /// Reset the eventfd and take what completed, into `out` (empty).
    fn take(&self, out: &mut Vec<(u16, i32)>) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 from our non-blocking eventfd.
        unsafe { libc::read(self.efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        std::mem::swap(&mut self.pending.lock().done, out);
    }

    /// From now until [`Inbox::end_collect`], completions do not wake the
    /// queue thread: it takes them itself.
    fn begin_collect(&self) {
        self.pending.lock().collecting = true;
    }

    /// Take what completed, into `out` (empty), and let completions wake
    /// the queue thread again. An eventfd written before the window stays
    /// readable: its poll fires once more and finds little or nothing.
    fn end_collect(&self, out: &mut Vec<(u16, i32)>) {
        let mut p = self.pending.lock();
        p.collecting = false;
        std::mem::swap(&mut p.done, out);
    }
}

impl EndIo for Inbox {
    fn end_io(&self, bio: Bio, status: Status, tag: u64) {
        let res = if status.is_ok() {
            if bio.op.has_data() {
                bio.len as i32
            } else {
                0
            }
        } else {
            tracing::debug!(
                op = bio.op.name(),
                offset = bio.offset,
                len = bio.len,
                ?status,
                "ublk request failed"
            );
            -status.errno()
        };
        drop(bio);
        self.post(tag as u16, res);
    }
}

/// The bio for the request the kernel put in `iod`, or the errno to
/// answer at once.
fn bio_for(
    iod: &ublksrv_io_desc,
    buf: *mut u8,
    buf_len: usize,
    owner: Arc<dyn EndIo>,
    tag: u16,
) -> Result<Bio, i32> {
    let op = match iod.op_flags & OP_MASK {
        uapi::UBLK_IO_OP_READ => Op::Read,
        uapi::UBLK_IO_OP_WRITE => Op::Write,
        uapi::UBLK_IO_OP_FLUSH => Op::Flush,
        uapi::UBLK_IO_OP_DISCARD => Op::Discard,
        uapi::UBLK_IO_OP_WRITE_ZEROES => Op::WriteZeroes,
        _ => return Err(-libc::EOPNOTSUPP),
    };
    // A flush has no position (the block layer leaves it at -1).
    let offset = if op == Op::Flush {
        0
    } else {
        iod.start_sector.checked_mul(512).ok_or(-libc::EINVAL)?
    };
    let len = (iod.nr_sectors as u64) << 9;
    let data = if op.has_data() {
        if len as usize > buf_len {
            return Err(-libc::EINVAL);
        }
        // SAFETY: the tag's buffer is this request's alone until it is
        // committed, which happens only after the bio completes, and the
        // queue keeps its buffers until every bio has completed.
        unsafe { blkstack_core::IoBuf::from_raw(buf, len as usize) }
    } else {
        blkstack_core::IoBuf::empty()
    };
    let mut flags = BioFlags::NONE;
    let f = iod.op_flags;
    if f & uapi::UBLK_IO_F_FUA != 0 {
        flags.insert(BioFlags::FUA);
    }
    if f & uapi::UBLK_IO_F_NOUNMAP != 0 {
        flags.insert(BioFlags::NOUNMAP);
    }
    if f & (uapi::UBLK_IO_F_FAILFAST_DEV
        | uapi::UBLK_IO_F_FAILFAST_TRANSPORT
        | uapi::UBLK_IO_F_FAILFAST_DRIVER)
        != 0
    {
        flags.insert(BioFlags::FAILFAST);
    }
    Ok(Bio::new(
        op,
        offset,
        if op == Op::Flush { 0 } else { len },
        data,
        owner,
        tag as u64,
    )
    .with_flags(flags))
}

/// What a queue thread serves: which queue of which device, how deep,
/// and how large each tag's buffer is (the device's `max_io_buf_bytes`).
#[derive(Clone, Copy, Debug)]
pub struct QueueSpec {
    pub dev_id: u32,
    pub qid: u16,
    pub depth: u16,
    pub io_buf_bytes: u32,
}

/// A mapping of ours, unmapped when dropped.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn map(len: usize, prot: i32, flags: i32, fd: RawFd, off: u64) -> std::io::Result<Mapping> {
        let off = libc::off_t::try_from(off)
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: a new mapping at an address of the kernel's choosing; it
        // overlaps nothing of ours, and a failure is checked.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, off) };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping { ptr: p.cast(), len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: exactly the region `map` made; nothing refers into it
        // any more (the queue leaks the buffers instead while bios may).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as usize,
        _ => 4096,
    }
}

/// One queue's ring, descriptors, buffers and state, owned by its thread.
struct Queue {
    spec: QueueSpec,
    ring: IoUring,
    /// The driver's descriptor array for this queue (read-only to us).
    iods: Mapping,
    /// `depth` buffers of `io_buf_bytes`; `None` once leaked.
    bufs: Option<Mapping>,
    inbox: Arc<Inbox>,
    owner: Arc<dyn EndIo>,
    /// Io commands the kernel holds (fetches waiting for a request).
    cmds: usize,
    /// The kernel aborted a fetch: the device is going, commit nothing.
    stopping: bool,
    batch: Vec<(u16, i32)>,
    cqes: Vec<(u64, i32)>,
}

impl Queue {
    /// The ring (the char device as its fixed file 0), the descriptor
    /// array, the buffers; the caller then fetches.
    fn new(spec: QueueSpec, cdev: RawFd) -> std::io::Result<Queue> {
        let depth = spec.depth as usize;
        let inbox = Inbox::new(depth)?;
        // One slot more than the tags: the eventfd poll.
        let ring = IoUring::builder()
            .setup_coop_taskrun()
            .build(spec.depth as u32 + 1)?;
        ring.submitter().register_files(&[cdev])?;
        let page = page_size();
        let iods = Mapping::map(
            uapi::queue_cmd_buf_size(spec.depth, page),
            libc::PROT_READ,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            cdev,
            uapi::queue_cmd_buf_offset(spec.qid, page),
        )?;
        // Address space, touched only as requests use it.
        let bufs = Mapping::map(
            depth * spec.io_buf_bytes as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )?;
        let owner: Arc<dyn EndIo> = inbox.clone();
        Ok(Queue {
            spec,
            ring,
            iods,
            bufs: Some(bufs),
            inbox,
            owner,
            cmds: 0,
            stopping: false,
            batch: Vec::with_capacity(depth),
            cqes: Vec::with_capacity(2 * depth + 2),
        })
    }

    fn buf(&self, tag: u16) -> *mut u8 {
        let base = self.bufs.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr);
        base.wrapping_add(tag as usize * self.spec.io_buf_bytes as usize)
    }

    /// The kernel's descriptor of the request on `tag`.
    fn iod(&self, tag: u16) -> ublksrv_io_desc {
        debug_assert!(tag < self.spec.depth);
        // SAFETY: tag < depth, so the descriptor lies inside the mapping,
        // which is aligned to a page; the kernel wrote it before it
        // completed the tag's fetch, whose completion we have read.
        unsafe {
            std::ptr::read_volatile(self.iods.ptr.cast::<ublksrv_io_desc>().add(tag as usize))
        }
    }

    fn push(&mut self, sqe: &io_uring::squeue::Entry) -> std::io::Result<()> {
        // The ring has a slot per tag and one for the poll, so one flush
        // always makes room.
        for _ in 0..2 {
            // SAFETY: the SQE carries no pointer but a tag buffer's
            // address, which lives as long as the queue (or is leaked).
            if unsafe { self.ring.submission().push(sqe) }.is_ok() {
                return Ok(());
            }
            self.ring.submit()?;
        }
        Err(std::io::Error::from_raw_os_error(libc::EBUSY))
    }

    /// FETCH_REQ (`result` unused) or COMMIT_AND_FETCH_REQ for `tag`.
    fn io_cmd(&mut self, op: u32, tag: u16, result: i32) -> std::io::Result<()> {
        let cmd = ublksrv_io_cmd {
            q_id: self.spec.qid,
            tag,
            result,
            addr: self.buf(tag) as u64,
        };
        let sqe = opcode::UringCmd16::new(types::Fixed(0), op)
            .cmd(uapi::cmd_bytes(&cmd))
            .build()
            .user_data(tag as u64);
        self.push(&sqe)?;
        self.cmds += 1;
        Ok(())
    }

    fn commit(&mut self, tag: u16, res: i32) -> std::io::Result<()> {
        if self.stopping {
            return Ok(());
        }
        self.io_cmd(uapi::UBLK_U_IO_COMMIT_AND_FETCH_REQ, tag, res)
    }

    fn arm_poll(&mut self) -> std::io::Result<()> {
        let sqe = opcode::PollAdd::new(types::Fd(self.inbox.efd.as_raw_fd()), libc::POLLIN as u32)
            .build()
            .user_data(POLL_TOKEN);
        self.push(&sqe)
    }

    /// Commit every completion waiting in the inbox (each commit also
    /// fetches the tag's next request): from the poll (`woken`), which
    /// always resets the eventfd, so a wake that found the inbox already
    /// emptied does not fire the re-armed poll again at once; else at
    /// the end of a batch, which also ends the collecting window.
    fn commit_all(&mut self, woken: bool) -> std::io::Result<()> {
        let mut batch = std::mem::take(&mut self.batch);
        if woken {
            self.inbox.take(&mut batch);
        } else {
            self.inbox.end_collect(&mut batch);
        }
        let r = batch.drain(..).try_for_each(|(t, res)| self.commit(t, res));
        self.batch = batch;
        r
    }

    /// A request arrived on `tag`: into the stack, or refused at once.
    fn on_request(&mut self, tag: u16, target: &DeviceRef) -> std::io::Result<()> {
        let iod = self.iod(tag);
        let len = self.spec.io_buf_bytes as usize;
        match bio_for(&iod, self.buf(tag), len, self.owner.clone(), tag) {
            Ok(bio) => {
                self.inbox.inflight.fetch_add(1, Ordering::Acquire);
                // A device that completes inline (null, memory) leaves
                // the tag in the inbox, committed at the batch's end.
                target.submit(bio);
                Ok(())
            }
            Err(res) => {
                tracing::debug!(
                    qid = self.spec.qid,
                    tag,
                    op_flags = iod.op_flags,
                    sector = iod.start_sector,
                    sectors = iod.nr_sectors,
                    res,
                    "ublk request refused"
                );
                self.commit(tag, res)
            }
        }
    }

    fn on_cqe(&mut self, user_data: u64, res: i32, target: &DeviceRef) -> std::io::Result<()> {
        if user_data == POLL_TOKEN {
            self.commit_all(true)?;
            // A failed poll (the ring going away) is not re-armed.
            if res >= 0 && !self.stopping {
                self.arm_poll()?;
            }
            return Ok(());
        }
        self.cmds = self.cmds.saturating_sub(1);
        let tag = match u16::try_from(user_data) {
            Ok(t) if t < self.spec.depth => t,
            _ => return Err(std::io::Error::from_raw_os_error(libc::EINVAL)),
        };
        match res {
            // A request that came with the abort of others is the
            // kernel's to fail now.
            uapi::UBLK_IO_RES_OK if !self.stopping => self.on_request(tag, target)?,
            uapi::UBLK_IO_RES_OK => {}
            uapi::UBLK_IO_RES_ABORT => self.stopping = true,
            r => {
                // The kernel refused a command: the tag is lost to us, so
                // the queue ends (and the device is failed-stopped).
                tracing::error!(
                    dev_id = self.spec.dev_id,
                    qid = self.spec.qid,
                    tag,
                    "ublk io command failed: {}",
                    std::io::Error::from_raw_os_error(-r)
                );
                self.stopping = true;
            }
        }
        Ok(())
    }

    /// Until the kernel holds no command of ours after the abort (or a
    /// bound past it, or a ring error).
    fn serve(&mut self, target: &DeviceRef) -> std::io::Result<()> {
        let ts = types::Timespec::from(WAIT_SLICE);
        let mut stop_seen: Option<Instant> = None;
        loop {
            if self.stopping {
                let since = *stop_seen.get_or_insert_with(Instant::now);
                if self.cmds == 0 {
                    return Ok(());
                }
                if since.elapsed() > ABORT_LIMIT {
                    tracing::warn!(
                        dev_id = self.spec.dev_id,
                        qid = self.spec.qid,
                        "ublk queue: {} io command(s) not handed back {ABORT_LIMIT:?} after the abort",
                        self.cmds
                    );
                    return Ok(());
                }
            }
            crate::ctrl::submit_and_wait(&self.ring.submitter(), &ts)?;
            self.cqes.clear();
            self.cqes
                .extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            self.inbox.begin_collect();
            let mut r = Ok(());
            for i in 0..self.cqes.len() {
                let (user_data, res) = self.cqes[i];
                r = self.on_cqe(user_data, res, target);
                if r.is_err() {
                    break;
                }
            }
            // What completed in the batch (always: it ends the window).
            let c = self.commit_all(false);
            r.and(c)?;
        }
    }
}

/// Why the queues did not all reach the kernel with their fetches, so the
/// device cannot start.
#[derive(Debug, thiserror::Error)]
pub enum QueueStartError {
    #[error("queue {qid} could not be set up: {err}")]
    Setup { qid: u16, err: std::io::Error },
    #[error("queue {qid}: spawning its thread: {err}")]
    Spawn { qid: u16, err: std::io::Error },
    #[error("the queues were not fetching within {0:?}")]
    Timeout(Duration),
    #[error("a queue thread ended before it fetched")]
    ThreadEnded,
}

/// Serve queue `spec` of the device whose char device is `cdev` from
/// `target` until the device stops. `ready` hears once, when the queue's
/// fetches are with the kernel (START_DEV waits for them) or why the
/// queue could not be set up. True once it has served (false: it could
/// not be set up).
pub fn run(
    spec: QueueSpec,
    cdev: RawFd,
    target: DeviceRef,
    ready: impl FnOnce(Result<(), QueueStartError>),
) -> bool {
    let qid = spec.qid;
    // SAFETY: prctl with PR_SET_IO_FLUSHER takes plain integers; without
    // the capability it fails, which only costs the reclaim hint.
    unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) };
    let fetched = Queue::new(spec, cdev).and_then(|mut q| {
        for tag in 0..spec.depth {
            q.io_cmd(uapi::UBLK_U_IO_FETCH_REQ, tag, 0)?;
        }
        q.arm_poll()?;
        q.ring.submit()?;
        Ok(q)
    });
    let mut q = match fetched {
        Ok(q) => q,
        Err(e) => {
            tracing::error!(dev_id = spec.dev_id, qid, "ublk queue: setting up: {e}");
            ready(Err(QueueStartError::Setup { qid, err: e }));
            return false;
        }
    };
    ready(Ok(()));
    if let Err(e) = q.serve(&target) {
        tracing::error!(dev_id = spec.dev_id, qid, "ublk queue: {e}");
    }
    tracing::debug!(qid, "ublk queue: the device stopped");
    // Bios still write into the buffers, or the kernel still holds
    // commands naming them: leaking them is the safe end.
    if !drain(qid, &q.inbox) || q.cmds > 0 {
        std::mem::forget(q.bufs.take());
    }
    true
}

/// How long a stopped queue waits for the stack to complete its bios
/// before it gives their buffers up rather than free them under I/O.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(120);

/// Wait for every submitted bio to complete (the buffers they write into
/// are freed next). Bounded: false past the limit, and said, so the caller
/// leaks the buffers instead.
fn drain(qid: u16, inbox: &Inbox) -> bool {
    let t0 = Instant::now();
    let mut pause = Duration::from_micros(100);
    while inbox.inflight.load(Ordering::Acquire) > 0 {
        if t0.elapsed() > DRAIN_LIMIT {
            tracing::error!(
                "ublk queue {qid}: {} request(s) still in the stack after {:?}; keeping their buffers",
                inbox.inflight.load(Ordering::Relaxed),
                DRAIN_LIMIT
            );
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkstack_core::testing::CompletionRecorder;

    fn iod(op: u32, flags: u32, sector: u64, sectors: u32) -> ublksrv_io_desc {
        ublksrv_io_desc {
            op_flags: op | flags,
            nr_sectors: sectors,
            start_sector: sector,
            addr: 0,
        }
    }

    #[test]
    fn requests_become_bios_with_their_flags() {
        let mut buf = vec![0u8; 8192];
        let rec = Arc::new(CompletionRecorder::default());
        let owner: Arc<dyn EndIo> = rec.clone();
        let b = bio_for(
            &iod(uapi::UBLK_IO_OP_WRITE, uapi::UBLK_IO_F_FUA, 8, 16),
            buf.as_mut_ptr(),
            buf.len(),
            owner.clone(),
            3,
        )
        .unwrap();
        assert_eq!((b.op, b.offset, b.len), (Op::Write, 4096, 8192));
        assert!(b.flags.contains(BioFlags::FUA));
        b.complete(Status::Ok);
        let b = bio_for(
            &iod(uapi::UBLK_IO_OP_WRITE_ZEROES, uapi::UBLK_IO_F_NOUNMAP, 0, 8),
            buf.as_mut_ptr(),
            buf.len(),
            owner.clone(),
            4,
        )
        .unwrap();
        assert_eq!((b.op, b.len, b.buf.len()), (Op::WriteZeroes, 4096, 0));
        assert!(b.flags.contains(BioFlags::NOUNMAP));
        b.complete(Status::Ok);
        // As the block layer sends it: no sectors, at position -1.
        let b = bio_for(
            &iod(uapi::UBLK_IO_OP_FLUSH, 0, u64::MAX, 0),
            buf.as_mut_ptr(),
            buf.len(),
            owner.clone(),
            5,
        )
        .unwrap();
        assert_eq!((b.op, b.offset, b.len), (Op::Flush, 0, 0));
        b.complete(Status::Ok);
        // Larger than the tag's buffer, or an op we do not know.
        assert_eq!(
            bio_for(
                &iod(uapi::UBLK_IO_OP_READ, 0, 0, 32),
                buf.as_mut_ptr(),
                buf.len(),
                owner.clone(),
                6
            )
            .unwrap_err(),
            -libc::EINVAL
        );
        assert_eq!(
            bio_for(
                &iod(uapi::UBLK_IO_OP_ZONE_OPEN, 0, 0, 8),
                buf.as_mut_ptr(),
                buf.len(),
                owner,
                7
            )
            .unwrap_err(),
            -libc::EOPNOTSUPP
        );
    }

    #[test]
    fn completions_from_other_threads_reach_the_inbox_once_each() {
        let inbox = Inbox::new(64).unwrap();
        let owner: Arc<dyn EndIo> = inbox.clone();
        let mut buf = vec![0u8; 4096];
        let threads: Vec<_> = (0..4u16)
            .map(|t| {
                let owner = owner.clone();
                let inbox = inbox.clone();
                let p = buf.as_mut_ptr() as usize;
                std::thread::spawn(move || {
                    for i in 0..16u16 {
                        let tag = t * 16 + i;
                        inbox.inflight.fetch_add(1, Ordering::Acquire);
                        let bio = bio_for(
                            &iod(uapi::UBLK_IO_OP_READ, 0, 0, 8),
                            p as *mut u8,
                            4096,
                            owner.clone(),
                            tag,
                        )
                        .unwrap();
                        let st = if tag % 5 == 0 {
                            Status::Medium
                        } else {
                            Status::Ok
                        };
                        bio.complete(st);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let mut got = Vec::new();
        inbox.take(&mut got);
        got.sort();
        assert_eq!(got.len(), 64);
        for (i, (tag, res)) in got.iter().enumerate() {
            assert_eq!(*tag as usize, i);
            let want = if tag % 5 == 0 { -libc::ENODATA } else { 4096 };
            assert_eq!(*res, want, "tag {tag}");
        }
        assert_eq!(inbox.inflight.load(Ordering::Relaxed), 0);
        // The eventfd was reset by take: nothing more to read.
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 from the non-blocking eventfd.
        let r = unsafe { libc::read(inbox.efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        assert_eq!(r, -1);
    }

    fn efd_count(inbox: &Inbox) -> u64 {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 from the non-blocking eventfd.
        let r = unsafe { libc::read(inbox.efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        if r == 8 {
            v
        } else {
            0
        }
    }

    #[test]
    fn completions_in_the_collecting_window_need_no_wake_and_none_is_lost() {
        let inbox = Inbox::new(64).unwrap();
        // Inline completions inside the window: taken at its end, no wake.
        inbox.begin_collect();
        for tag in 0..8u16 {
            inbox.inflight.fetch_add(1, Ordering::Acquire);
            inbox.post(tag, 4096 + tag as i32);
        }
        let mut got = Vec::new();
        inbox.end_collect(&mut got);
        assert_eq!(
            got,
            (0..8u16).map(|t| (t, 4096 + t as i32)).collect::<Vec<_>>()
        );
        assert_eq!(efd_count(&inbox), 0);
        // After the window the first completion wakes the queue again.
        inbox.inflight.fetch_add(1, Ordering::Acquire);
        inbox.post(9, 0);
        assert_eq!(efd_count(&inbox), 1);
        got.clear();
        inbox.take(&mut got);
        assert_eq!(got, vec![(9, 0)]);
        // Another thread completing while windows open and close: every
        // tag is taken exactly once, and what is left after the last
        // window was announced on the eventfd.
        let owner = inbox.clone();
        let poster = std::thread::spawn(move || {
            for tag in 0..2000u32 {
                owner.inflight.fetch_add(1, Ordering::Acquire);
                owner.post((tag % 64) as u16, tag as i32);
            }
        });
        let mut seen = Vec::new();
        let mut batch = Vec::new();
        while !poster.is_finished() {
            inbox.begin_collect();
            std::thread::yield_now();
            // Wakes from before the window, consumed: inside it none come.
            efd_count(&inbox);
            inbox.end_collect(&mut batch);
            seen.extend(batch.drain(..).map(|(_, r)| r));
        }
        poster.join().unwrap();
        let woken = efd_count(&inbox) > 0;
        inbox.take(&mut batch);
        assert!(
            woken || batch.is_empty(),
            "{} left unannounced",
            batch.len()
        );
        seen.extend(batch.drain(..).map(|(_, r)| r));
        seen.sort_unstable();
        assert_eq!(seen, (0..2000).collect::<Vec<i32>>());
        assert_eq!(inbox.inflight.load(Ordering::Relaxed), 0);
    }
}
