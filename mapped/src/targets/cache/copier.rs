//! Asynchronous block copies for the cache's migrations (what
//! `dm-cache-target.c` hands to `dm_kcopyd_copy`): a read of the source
//! is submitted, its completion submits the write of the destination, and
//! the write's completion calls the migration's continuation. No thread
//! waits for either I/O, so many copies are in flight at once.
//!
//! Bounded: one copy per migration in flight, which `migrate.rs` bounds.
//! Unlike kcopyd the block is copied in one read and one write (no split
//! into sub-jobs, no `kcopyd_throttle`). Written by hand after thin's
//! `fill.rs`: a table of jobs keyed by the bios' private word.

use blkstack_core::{AlignedBuf, Bio, DeviceRef, EndIo, IoBuf, Op, Status};
use foldhash::HashMap;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// Called once when a copy ends, with its status, from the completion of
/// its last I/O (so it must not block).
pub type Done = Box<dyn FnOnce(Status) + Send>;

struct Job {
    /// Where the read lands and the write comes from: kept here, lent to
    /// one bio at a time, until the copy ends.
    _buf: AlignedBuf,
    to: DeviceRef,
    dst: u64,
    done: Done,
}

/// `struct dm_kcopyd_client`, for one cache.
pub struct Copier {
    jobs: Mutex<HashMap<u64, Job>>,
    next: AtomicU64,
    /// Itself, to own the write a read's completion submits.
    me: Weak<Copier>,
}

impl Copier {
    /// A copier with no copy in flight.
    pub fn new() -> Arc<Copier> {
        Arc::new_cyclic(|me| Copier {
            jobs: Mutex::new(HashMap::default()),
            next: AtomicU64::new(0),
            me: me.clone(),
        })
    }

    /// Copies in flight.
    #[cfg(test)]
    pub fn in_flight(&self) -> usize {
        self.jobs.lock().len()
    }

    /// `dm_kcopyd_copy`: copy `len` bytes from `from` at `src` to `to` at
    /// `dst`, then call `done`.
    pub fn copy(
        self: &Arc<Self>,
        from: &DeviceRef,
        src: u64,
        to: DeviceRef,
        dst: u64,
        len: u64,
        done: Done,
    ) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut buf = AlignedBuf::new(len as usize);
        // SAFETY: the buffer lives in the job until the job is removed,
        // which happens only after the write that last carries it ends;
        // nothing else touches it while a bio has it.
        let io = unsafe { IoBuf::from_slice(buf.as_mut_slice()) };
        self.jobs.lock().insert(
            id,
            Job {
                _buf: buf,
                to,
                dst,
                done,
            },
        );
        from.submit(Bio::new(Op::Read, src, len, io, self.clone(), id));
    }
}

/// The job's write, or its end.
const WRITE: u64 = 1 << 63;

impl EndIo for Copier {
    fn end_io(&self, mut bio: Bio, status: Status, private: u64) {
        let id = private & !WRITE;
        if private & WRITE == 0 && status == Status::Ok {
            let next = {
                let jobs = self.jobs.lock();
                jobs.get(&id).map(|j| (j.to.clone(), j.dst))
            };
            if let Some((to, dst)) = next {
                // The read's bio becomes the write: same buffer, length
                // and owner (this copier, by the frame it just popped).
                // Alive: the read's frame held a strong reference.
                let Some(owner) = self.me.upgrade() else {
                    return;
                };
                let (len, buf) = (bio.len, bio.buf);
                bio.cookie = id | WRITE;
                bio.rearm(owner, Op::Write, dst, len, buf);
                return to.submit(bio);
            }
        }
        let job = self.jobs.lock().remove(&id);
        if let Some(j) = job {
            (j.done)(status);
        }
    }
}
