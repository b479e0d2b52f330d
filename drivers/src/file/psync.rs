//! `engine=psync`: the file device served by a small thread pool doing
//! `preadv2`/`pwritev2`/`fsync`/`fallocate`, like fio's psync engine or
//! the loop driver before it had direct AIO. It is also the automatic
//! fallback when io_uring cannot be set up at all (e.g. under a seccomp
//! filter that refuses `io_uring_setup`).

use super::backing::{ensure_bounce, errno, Files, Route};
use super::join_unless_self;
use blkstack_core::{AlignedBuf, Bio, BioFlags, Op, Status};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Threads of the psync engine (at most; fewer with a small queue depth).
const PSYNC_THREADS: u32 = 8;

impl Files {
    /// Synchronous execution of one bio.
    pub(super) fn exec_sync(&self, bio: &Bio, bounce: &mut Option<AlignedBuf>) -> Status {
        if bio.flags.contains(BioFlags::PREFLUSH) || bio.op == Op::Flush {
            // SAFETY: plain syscall on an open descriptor.
            if unsafe { libc::fsync(self.buffered.as_raw_fd()) } < 0 {
                return Status::from_errno(errno());
            }
        }
        match bio.op {
            Op::Flush => Status::Ok,
            Op::Read | Op::Write => self.read_write_sync(bio, bounce),
            Op::Discard | Op::WriteZeroes => self.fallocate_sync(bio),
        }
    }

    /// A read or write, resumed after short transfers, through the route
    /// the bio's alignment allows.
    fn read_write_sync(&self, bio: &Bio, bounce: &mut Option<AlignedBuf>) -> Status {
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
            // SAFETY: iov points into memory valid for len bytes (the bio's
            // buffer contract or our bounce buffer).
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
                    // Past the end of a file someone shortened: zeroes, as
                    // the loop driver returns.
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

    /// Discard punches a hole; write-zeroes zeroes the range or punches it.
    fn fallocate_sync(&self, bio: &Bio) -> Status {
        let mode = if bio.op == Op::Discard {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            self.zero_mode(bio.flags)
        };
        // SAFETY: plain syscall on an open descriptor.
        let r = unsafe {
            libc::fallocate(
                self.buffered.as_raw_fd(),
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

struct PoolShared {
    queue: Mutex<VecDeque<Bio>>,
    cv: Condvar,
    stop: AtomicBool,
    files: Arc<Files>,
}

pub(super) struct Pool {
    shared: Arc<PoolShared>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    pub(super) fn spawn(files: Arc<Files>, depth: u32, name: &str) -> std::io::Result<Pool> {
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

    pub(super) fn submit(&self, bio: Bio) {
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

#[cfg(test)]
mod tests {
    use super::super::backing::Stats;
    use super::*;
    use std::fs::OpenOptions;
    use std::os::unix::fs::OpenOptionsExt;

    /// A filesystem whose O_DIRECT needs 4 KiB offsets (a 4Kn disk): a
    /// 512-byte-aligned bio must take the buffered descriptor, a bio with
    /// misaligned memory the bounce buffer, and both must land in the file.
    #[test]
    fn misaligned_direct_io_takes_the_fallback_routes() {
        use blkstack_core::testing::CompletionRecorder;
        use blkstack_core::{EndIo, IoBuf};
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
        let recorder = CompletionRecorder::new();
        let owner: Arc<dyn EndIo> = recorder.clone();
        let mut bounce = None;
        let mut aligned = AlignedBuf::new(8192);
        aligned.as_mut_slice().fill(0x5a);
        let mut raw = vec![0x6bu8; 8192 + 1];
        let cases: [(u64, IoBuf, u8, Route); 3] = [
            (
                4096,
                // SAFETY: the buffers outlive the synchronous calls below.
                unsafe { aligned.io_buf(0, 4096) },
                0x5a,
                Route::Direct,
            ),
            (
                8192 + 512,
                // SAFETY: as above.
                unsafe { aligned.io_buf(4096, 4096) },
                0x5a,
                Route::Buffered,
            ),
            (
                65536,
                // SAFETY: as above.
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
        // Each bio (a write and a read per case) completed exactly once,
        // in order, with the status it was given.
        let offsets: Vec<u64> = recorder.completions().iter().map(|c| c.offset).collect();
        assert_eq!(offsets, [4096, 4096, 8704, 8704, 65536, 65536]);
        assert_eq!(recorder.statuses(), [Status::Ok; 6]);
    }
}
