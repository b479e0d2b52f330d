//! One ublk queue: a thread that fetches the kernel's requests for the
//! queue's tags from /dev/ublkcN (io_uring commands, through libublk),
//! submits each as a bio into the stack, and commits the result when the
//! bio completes. This is the server half of drivers/block/ublk_drv.c's
//! `ublk_queue_rq` -> `UBLK_IO_FETCH_REQ` / `UBLK_IO_COMMIT_AND_FETCH_REQ`
//! exchange.
//!
//! A bio may complete on any thread (a completion thread of `null`, a
//! delay worker) but a tag may only be committed from the queue's own
//! ring. Completions therefore go to the queue's [`Inbox`]; the first one
//! to find it empty writes an eventfd that the ring polls, and the queue
//! thread commits the whole batch when that poll fires. The kernel copies
//! data into (writes) and out of (reads) the per-tag buffer around the
//! exchange, so the bio's buffer is that tag's buffer: no copy here.

use blkstack_core::{Bio, BioFlags, DeviceRef, EndIo, Op, Status};
use libublk::io::{with_task_io_ring_mut, BufDescList, UblkDev, UblkIOCtx, UblkQueue};
use libublk::{sys, BufDesc, UblkIORes};
use parking_lot::Mutex;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The op byte of `ublksrv_io_desc.op_flags`, and its flag bits.
const OP_MASK: u32 = 0xff;

/// Tag value in the eventfd poll's user data: above every real tag.
const POLL_TAG: u16 = u16::MAX;

/// Completed tags waiting for the queue thread, and the eventfd that
/// wakes it. Shared by the queue thread and every completer.
pub struct Inbox {
    done: Mutex<Vec<(u16, i32)>>,
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
            done: Mutex::new(Vec::with_capacity(depth)),
            // SAFETY: fd is fresh and ours.
            efd: unsafe { OwnedFd::from_raw_fd(fd) },
            inflight: AtomicUsize::new(0),
        }))
    }

    fn post(&self, tag: u16, res: i32) {
        let first = {
            let mut d = self.done.lock();
            d.push((tag, res));
            d.len() == 1
        };
        if first {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a valid u64 to our eventfd; a full
            // counter (EAGAIN) still leaves it readable, which is all we need.
            unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
        self.inflight.fetch_sub(1, Ordering::Release);
    }

    /// Reset the eventfd and take what completed, into `out`.
    fn take(&self, out: &mut Vec<(u16, i32)>) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 from our non-blocking eventfd.
        unsafe { libc::read(self.efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        std::mem::swap(&mut *self.done.lock(), out);
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
    iod: &sys::ublksrv_io_desc,
    buf: *mut u8,
    buf_len: usize,
    owner: Arc<dyn EndIo>,
    tag: u16,
) -> Result<Bio, i32> {
    let op = match iod.op_flags & OP_MASK {
        sys::UBLK_IO_OP_READ => Op::Read,
        sys::UBLK_IO_OP_WRITE => Op::Write,
        sys::UBLK_IO_OP_FLUSH => Op::Flush,
        sys::UBLK_IO_OP_DISCARD => Op::Discard,
        sys::UBLK_IO_OP_WRITE_ZEROES => Op::WriteZeroes,
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
    if f & sys::UBLK_IO_F_FUA != 0 {
        flags.insert(BioFlags::FUA);
    }
    if f & sys::UBLK_IO_F_NOUNMAP != 0 {
        flags.insert(BioFlags::NOUNMAP);
    }
    if f & (sys::UBLK_IO_F_FAILFAST_DEV
        | sys::UBLK_IO_F_FAILFAST_TRANSPORT
        | sys::UBLK_IO_F_FAILFAST_DRIVER)
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

/// Commit every completion waiting in the inbox (each commit also
/// fetches the tag's next request). From the poll (`woken`), the eventfd
/// is always reset, so a wake that found the inbox already emptied does
/// not fire the re-armed poll again at once.
fn commit_all(
    q: &UblkQueue,
    inbox: &Inbox,
    bufs: &[libublk::helpers::IoBuf<u8>],
    batch: &mut Vec<(u16, i32)>,
    woken: bool,
) {
    if !woken && inbox.done.lock().is_empty() {
        return;
    }
    inbox.take(batch);
    for (t, res) in batch.drain(..) {
        let b = &bufs[t as usize];
        if let Err(e) =
            q.complete_io_cmd_unified(t, BufDesc::Slice(b.as_slice()), Ok(UblkIORes::Result(res)))
        {
            tracing::error!("ublk queue {}: commit of tag {t}: {e}", q.get_qid());
        }
    }
}

fn arm_poll(q: &UblkQueue, inbox: &Inbox) {
    let sqe = io_uring::opcode::PollAdd::new(
        io_uring::types::Fd(inbox.efd.as_raw_fd()),
        libc::POLLIN as u32,
    )
    .build()
    .user_data(UblkIOCtx::build_user_data(POLL_TAG, 0, 0, true));
    with_task_io_ring_mut(|ring| {
        // SAFETY: the SQE refers to no memory; the eventfd outlives the
        // ring (the inbox is dropped after the queue's thread ends).
        if unsafe { ring.submission().push(&sqe) }.is_err() {
            tracing::error!(
                "ublk queue {}: submission queue full arming the completion poll",
                q.get_qid()
            );
        }
    });
}

/// Serve queue `qid` of `udev` from `target` until the device stops;
/// true once it has served (false: it could not be set up, and said why
/// through `failed`, since the kernel would otherwise wait for its fetch
/// commands for ever).
pub fn run(qid: u16, udev: &UblkDev, target: DeviceRef, failed: impl FnOnce(String)) -> bool {
    let depth = udev.dev_info.queue_depth as usize;
    let inbox = match Inbox::new(depth) {
        Ok(i) => i,
        Err(e) => {
            tracing::error!("ublk queue {qid}: eventfd: {e}");
            failed(format!("queue {qid}: eventfd: {e}"));
            return false;
        }
    };
    let bufs = udev.alloc_queue_io_bufs();
    let queue = match UblkQueue::new(qid, udev)
        .and_then(|q| q.submit_fetch_commands_unified(BufDescList::Slices(Some(&bufs))))
    {
        Ok(q) => q,
        Err(e) => {
            tracing::error!("ublk queue {qid}: setting up: {e}");
            failed(format!("queue {qid} could not be set up: {e}"));
            return false;
        }
    };
    arm_poll(&queue, &inbox);
    let owner: Arc<dyn EndIo> = inbox.clone();
    let mut batch: Vec<(u16, i32)> = Vec::with_capacity(depth);
    queue.wait_and_handle_io(|q, tag, ctx| {
        if ctx.is_tgt_io() {
            commit_all(q, &inbox, &bufs, &mut batch, true);
            // A failed poll (the ring going away) is not re-armed.
            if ctx.result() >= 0 {
                arm_poll(q, &inbox);
            }
            return;
        }
        let iod = q.get_iod(tag);
        let b = &bufs[tag as usize];
        match bio_for(iod, b.as_mut_ptr(), b.len(), owner.clone(), tag) {
            Ok(bio) => {
                inbox.inflight.fetch_add(1, Ordering::Acquire);
                target.submit(bio);
                // A device that completed inline (null, memory) is
                // committed now, not one poll wake later.
                commit_all(q, &inbox, &bufs, &mut batch, false);
            }
            Err(res) => {
                tracing::debug!(
                    qid,
                    tag,
                    op_flags = iod.op_flags,
                    sector = iod.start_sector,
                    sectors = iod.nr_sectors,
                    res,
                    "ublk request refused"
                );
                if let Err(e) = q.complete_io_cmd_unified(
                    tag,
                    BufDesc::Slice(b.as_slice()),
                    Ok(UblkIORes::Result(res)),
                ) {
                    tracing::error!("ublk queue {qid}: commit of tag {tag}: {e}");
                }
            }
        }
    });
    tracing::debug!(qid, "ublk queue: the device stopped");
    if !drain(qid, &inbox) {
        // Bios still write into these: leaking them is the safe end.
        std::mem::forget(bufs);
    }
    true
}

/// How long a stopped queue waits for the stack to complete its bios
/// before it gives their buffers up rather than free them under I/O.
const DRAIN_LIMIT: Duration = Duration::from_secs(120);

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

    fn iod(op: u32, flags: u32, sector: u64, sectors: u32) -> sys::ublksrv_io_desc {
        sys::ublksrv_io_desc {
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
            &iod(sys::UBLK_IO_OP_WRITE, sys::UBLK_IO_F_FUA, 8, 16),
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
            &iod(sys::UBLK_IO_OP_WRITE_ZEROES, sys::UBLK_IO_F_NOUNMAP, 0, 8),
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
            &iod(sys::UBLK_IO_OP_FLUSH, 0, u64::MAX, 0),
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
                &iod(sys::UBLK_IO_OP_READ, 0, 0, 32),
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
                &iod(sys::UBLK_IO_OP_ZONE_OPEN, 0, 0, 8),
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
                            &iod(sys::UBLK_IO_OP_READ, 0, 0, 8),
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
        let r = unsafe { libc::read(inbox.efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        assert_eq!(r, -1);
    }
}
