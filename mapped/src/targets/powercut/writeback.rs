//! Writing cached extents down to the device: what the cache does at a
//! flush, a FUA write, when it is full, and for a cut's survivors. As a
//! disk's firmware does, it writes the whole batch at once (one plugged
//! submission) in sector order, merging runs of adjacent extents into
//! one request, and then waits for all of them (dm-kcopyd and dm-writecache
//! batch their writeback the same way, `drivers/md/dm-writecache.c`'s
//! `writecache_flush`).
//!
//! The buffers stay alive until the last request completes, whoever
//! stops waiting first: each request's completion frame holds the
//! [`Tracker`] that owns them. The end of a writeback runs a continuation
//! on the thread that completes its last request (the flush of the device
//! after the writes, then the end of the batch), so no thread waits for
//! it; a cut's survivors are waited for, with a bound.

use super::cache::{Extent, Payload};
use blkstack_core::{AlignedBuf, Bio, BioFlags, DeviceRef, EndIo, IoBuf, Op, Status, SECTOR_SHIFT};
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A merged write is at most this long: large enough that sequential
/// writes go down in few requests, small enough that the copy stays
/// cheap.
const MERGE_MAX: u64 = 1 << 20;

/// Requests handed to the device per `submit_batch`.
const PLUG: usize = 64;

/// How long one wait lasts before the caller looks at its stop flag.
pub(super) const WAIT_SLICE: Duration = Duration::from_millis(100);

/// Why a writeback did not finish.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum WritebackError {
    /// A request failed on the device.
    Failed(Status),
    /// The requests did not all complete in time (they may still).
    TimedOut,
}

/// What runs when the last request of a writeback completes.
type Then = Box<dyn FnOnce(Result<(), WritebackError>) + Send>;

/// What keeps a writeback's buffers alive, counts its requests, and runs
/// its continuation when the last one completes.
struct Tracker {
    /// Requests not yet completed, plus one until the submitter lets go
    /// ([`Pending::then`] or [`Pending::wait`]).
    remaining: AtomicUsize,
    first_error: Mutex<Option<Status>>,
    then: Mutex<Option<Then>>,
    done: Mutex<bool>,
    cv: Condvar,
    /// Buffers the requests point into.
    hold: Mutex<Vec<Hold>>,
}

/// Memory a request points into, owned only to be dropped after it.
#[allow(dead_code)]
enum Hold {
    Write(Arc<super::cache::Write>),
    Buf(AlignedBuf),
}

impl Tracker {
    fn new() -> Arc<Tracker> {
        Arc::new(Tracker {
            remaining: AtomicUsize::new(1),
            first_error: Mutex::new(None),
            then: Mutex::new(None),
            done: Mutex::new(false),
            cv: Condvar::new(),
            hold: Mutex::new(Vec::new()),
        })
    }

    fn result(&self) -> Result<(), WritebackError> {
        match *self.first_error.lock() {
            Some(s) => Err(WritebackError::Failed(s)),
            None => Ok(()),
        }
    }

    fn put(&self, n: usize) {
        if self.remaining.fetch_sub(n, Ordering::AcqRel) != n {
            return;
        }
        // The buffers can go: every request is done with them.
        self.hold.lock().clear();
        *self.done.lock() = true;
        self.cv.notify_all();
        let then = self.then.lock().take();
        if let Some(f) = then {
            f(self.result());
        }
    }
}

impl EndIo for Tracker {
    fn end_io(&self, _bio: Bio, status: Status, _private: u64) {
        if !status.is_ok() {
            self.first_error.lock().get_or_insert(status);
        }
        self.put(1);
    }
}

/// A writeback whose requests are submitted; the submitter still holds
/// it open until it says what to do at the end.
pub(super) struct Pending {
    tracker: Arc<Tracker>,
}

impl Pending {
    /// Run `f` with the result once every request completed (at once, on
    /// this thread, if they all have; else on the thread completing the
    /// last one).
    pub fn then(self, f: impl FnOnce(Result<(), WritebackError>) + Send + 'static) {
        *self.tracker.then.lock() = Some(Box::new(f));
        self.tracker.put(1);
    }

    /// Wait until every request completed or `limit` passed.
    pub fn wait(self, limit: Duration) -> Result<(), WritebackError> {
        self.tracker.put(1);
        let t0 = Instant::now();
        let mut done = self.tracker.done.lock();
        while !*done {
            if t0.elapsed() >= limit {
                return Err(WritebackError::TimedOut);
            }
            self.tracker.cv.wait_for(&mut done, WAIT_SLICE);
        }
        drop(done);
        self.tracker.result()
    }
}

/// One request to build: a run of extents that go down together.
struct Run<'a> {
    start: u64,
    len: u64,
    parts: &'a [Extent],
}

/// Whether `b` can join a run ending with `a`.
fn joins(a: &Extent, b: &Extent, run_len: u64) -> bool {
    let same_kind = match (&a.write.payload, &b.write.payload) {
        (Payload::Data(_), Payload::Data(_)) => true,
        (Payload::Zeroes { nounmap: x }, Payload::Zeroes { nounmap: y }) => x == y,
        (Payload::Discard, Payload::Discard) => true,
        _ => false,
    };
    let bytes = (run_len + b.len) << SECTOR_SHIFT;
    same_kind
        && a.start + a.len == b.start
        && a.fua == b.fua
        && (bytes <= MERGE_MAX || !matches!(b.write.payload, Payload::Data(_)))
}

fn runs(extents: &[Extent]) -> Vec<Run<'_>> {
    let mut out: Vec<Run<'_>> = Vec::new();
    let mut i = 0;
    while i < extents.len() {
        let mut j = i + 1;
        let mut len = extents[i].len;
        while j < extents.len() && joins(&extents[j - 1], &extents[j], len) {
            len += extents[j].len;
            j += 1;
        }
        out.push(Run {
            start: extents[i].start,
            len,
            parts: &extents[i..j],
        });
        i = j;
    }
    out
}

/// The request(s) for one run, their buffers added to `hold`.
fn requests(
    run: &Run<'_>,
    zeroes_ok: bool,
    owner: &Arc<Tracker>,
    hold: &mut Vec<Hold>,
    out: &mut Vec<Bio>,
) {
    let first = &run.parts[0];
    let mut flags = if first.fua {
        BioFlags::FUA
    } else {
        BioFlags::NONE
    };
    let offset = run.start << SECTOR_SHIFT;
    let bytes = run.len << SECTOR_SHIFT;
    let owner_dyn: Arc<dyn EndIo> = owner.clone();
    match &first.write.payload {
        Payload::Data(_) if run.parts.len() == 1 => {
            let data = first.write.data(first.start, first.len).unwrap_or(&[]);
            // SAFETY: the write's buffer lives in `hold` (an Arc of the
            // write) inside the tracker the request's frame keeps alive,
            // and a cached write's data is never written to again: the
            // device only reads it.
            let buf = unsafe { IoBuf::from_raw(data.as_ptr() as *mut u8, data.len()) };
            hold.push(Hold::Write(first.write.clone()));
            out.push(Bio::new(Op::Write, offset, bytes, buf, owner_dyn, 0).with_flags(flags));
        }
        Payload::Data(_) => {
            let mut copy = AlignedBuf::new(bytes as usize);
            for p in run.parts {
                let base = run.start;
                super::cache::copy_piece(&p.write, p.start, p.len, base, copy.as_mut_slice());
            }
            // SAFETY: `copy` moves into `hold` (its heap memory does not
            // move), kept by the tracker until the request completes.
            let buf = unsafe { copy.io_buf(0, bytes as usize) };
            hold.push(Hold::Buf(copy));
            out.push(Bio::new(Op::Write, offset, bytes, buf, owner_dyn, 0).with_flags(flags));
        }
        Payload::Zeroes { nounmap } if zeroes_ok => {
            if *nounmap {
                flags.insert(BioFlags::NOUNMAP);
            }
            out.push(
                Bio::new(Op::WriteZeroes, offset, bytes, IoBuf::empty(), owner_dyn, 0)
                    .with_flags(flags),
            );
        }
        Payload::Zeroes { .. } => {
            // The device lost write-zeroes since it was cached (a
            // reconnected nbd leg): write real zeroes.
            let mut at = 0;
            while at < bytes {
                let n = (bytes - at).min(MERGE_MAX);
                let zeroes = AlignedBuf::new(n as usize);
                // SAFETY: as for a merged copy above.
                let buf = unsafe { zeroes.io_buf(0, n as usize) };
                hold.push(Hold::Buf(zeroes));
                out.push(
                    Bio::new(Op::Write, offset + at, n, buf, owner.clone(), 0).with_flags(flags),
                );
                at += n;
            }
        }
        Payload::Discard => {
            out.push(
                Bio::new(Op::Discard, offset, bytes, IoBuf::empty(), owner_dyn, 0)
                    .with_flags(flags),
            );
        }
    }
}

/// Send `extents` (sorted by sector, none overlapping) to `dev` at once;
/// discards are skipped if the device no longer takes them (a discard
/// promises nothing about what is read back).
pub(super) fn submit(dev: &DeviceRef, extents: &[Extent]) -> Pending {
    let features = dev.features();
    let tracker = Tracker::new();
    let mut hold = Vec::new();
    let mut bios = Vec::with_capacity(PLUG);
    for run in runs(extents) {
        if matches!(run.parts[0].write.payload, Payload::Discard) && !features.discard {
            continue;
        }
        requests(&run, features.write_zeroes, &tracker, &mut hold, &mut bios);
        if bios.len() >= PLUG {
            send(dev, &tracker, &mut hold, &mut bios);
        }
    }
    send(dev, &tracker, &mut hold, &mut bios);
    Pending { tracker }
}

/// Count the requests, park their buffers in the tracker, submit them.
fn send(dev: &DeviceRef, t: &Arc<Tracker>, hold: &mut Vec<Hold>, bios: &mut Vec<Bio>) {
    let n = bios.len();
    if n == 0 {
        return;
    }
    t.remaining.fetch_add(n, Ordering::AcqRel);
    t.hold.lock().append(hold);
    dev.submit_batch(bios);
}

/// Flush the device's cache, if it has one.
pub(super) fn flush(dev: &DeviceRef) -> Pending {
    let tracker = Tracker::new();
    if dev.features().flush {
        tracker.remaining.fetch_add(1, Ordering::AcqRel);
        dev.submit(Bio::new(
            Op::Flush,
            0,
            0,
            IoBuf::empty(),
            tracker.clone(),
            0,
        ));
    }
    Pending { tracker }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::targets::powercut::cache::Cache;

    #[test]
    fn adjacent_extents_merge_up_to_the_limit() {
        let mut c = Cache::default();
        for i in 0..4 {
            c.insert(i * 8, 8, Payload::Data(vec![i as u8; 4096].into()));
        }
        c.insert(100, 8, Payload::Data(vec![9; 4096].into()));
        c.insert(108, 8, Payload::Zeroes { nounmap: false });
        let mut ext = Vec::new();
        c.take_all(&mut ext);
        let r = runs(&ext);
        let shape: Vec<(u64, u64, usize)> =
            r.iter().map(|r| (r.start, r.len, r.parts.len())).collect();
        assert_eq!(shape, vec![(0, 32, 4), (100, 8, 1), (108, 8, 1)]);
    }
}
