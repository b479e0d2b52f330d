//! Waiting for one bio synchronously: for tests, control paths and callers
//! that have no queue depth to fill. The hot paths (bench runner, NBD
//! server) have their own completion queues and never use this.

use crate::bio::{Bio, EndIo, IoBuf, Op};
use crate::device::Device;
use crate::status::Status;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;

/// A one-shot completion: `end_io` stores the status and wakes the waiter.
#[derive(Default)]
pub struct Completion {
    done: Mutex<Option<Status>>,
    cv: Condvar,
}

impl Completion {
    /// A completion nobody has completed yet, shared so one clone can be the
    /// bio's owner and the other the waiter.
    pub fn new() -> Arc<Completion> {
        Arc::new(Completion::default())
    }

    /// Block until the bio completes, and return its status.
    pub fn wait(&self) -> Status {
        let mut g = self.done.lock();
        while g.is_none() {
            self.cv.wait(&mut g);
        }
        g.take().unwrap_or(Status::IoError)
    }
}

impl EndIo for Completion {
    fn end_io(&self, _bio: Bio, status: Status, _private: u64) {
        *self.done.lock() = Some(status);
        self.cv.notify_one();
    }
}

/// Submit one request and block until it completes.
///
/// For `Read`/`Write`, `buf` is the data (its length is the request
/// length); for the other ops pass an empty slice and the length in `len`.
pub fn submit_and_wait(dev: &dyn Device, op: Op, offset: u64, len: u64, buf: &mut [u8]) -> Status {
    submit_and_wait_flags(dev, op, crate::BioFlags::NONE, offset, len, buf)
}

/// As [`submit_and_wait`] with request flags (FUA, PREFLUSH, ...).
pub fn submit_and_wait_flags(
    dev: &dyn Device,
    op: Op,
    flags: crate::BioFlags,
    offset: u64,
    len: u64,
    buf: &mut [u8],
) -> Status {
    let c = Completion::new();
    let (iobuf, len) = if op.has_data() {
        // SAFETY: we block below until the request completes, so `buf`
        // outlives it and nothing else touches it meanwhile.
        (unsafe { IoBuf::from_slice(buf) }, buf.len() as u64)
    } else {
        (IoBuf::empty(), len)
    };
    let bio = Bio::new(op, offset, len, iobuf, c.clone(), 0).with_flags(flags);
    dev.submit(bio);
    c.wait()
}
