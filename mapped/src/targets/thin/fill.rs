//! Making a newly provisioned block whole before a partial write lands in
//! it (dm-thin.c `schedule_copy` / `schedule_zero`): a copy of the block
//! it replaces (a snapshot's shared block) or of the external origin, or
//! zeroes unless `skip_block_zeroing`. As in the kernel this happens
//! asynchronously: the read and write are bios of their own, and the
//! write that asked for the block is sent on from their completion, so a
//! submitter keeps its queue depth while blocks are provisioned.
//!
//! Where the block is filled through a buffer (a copy, or zeroes on a
//! device without WRITE_ZEROES), the waiting write's data is laid into
//! the buffer before it is written, and the write completes with that
//! one whole-block write: the kernel copies with kcopyd and then issues
//! the bio (two writes to the new block); the data device ends up
//! holding the same bytes either way, and the mapping still enters the
//! metadata only after the write that carries them completed. A write
//! of the whole block needs no fill at all (`io_overwrites_block`, in
//! `thin_target.rs`).

use crate::target::DevArg;
use blkstack_core::{Bio, EndIo, IoBuf, Op, Status};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// Where the new block's contents come from.
pub enum Source {
    /// The data block it replaces.
    Block(u64),
    /// `len` bytes of the external origin at `offset`.
    Origin {
        offset: u64,
        len: u64,
    },
    Zeroes,
}

/// One block being filled: the write waiting for it and the buffer.
struct Fill {
    bio: Bio,
    buf: Vec<u8>,
    /// The data block being filled.
    block: u64,
    /// Where in the block the waiting write goes.
    offset: u64,
    /// The source was read; the buffer is to be written.
    read_done: bool,
    /// The waiting write's data is in the buffer: the buffer's write
    /// completes it.
    merged: bool,
}

impl Fill {
    /// Lay the waiting write's data into the buffer (a fill through a
    /// buffer, once the source is in it).
    fn merge(&mut self) {
        let (at, data) = (self.offset as usize, self.bio.data());
        if let Some(dst) = self.buf.get_mut(at..at + data.len()) {
            dst.copy_from_slice(data);
            self.merged = true;
        }
    }
}

/// The fills of one thin device in flight.
pub struct Fills {
    me: Weak<Fills>,
    data: DevArg,
    origin: Option<DevArg>,
    block_bytes: u64,
    pending: Mutex<HashMap<u64, Fill>>,
    next: AtomicU64,
}

impl Fills {
    pub fn new(data: DevArg, origin: Option<DevArg>, block_bytes: u64) -> Arc<Fills> {
        Arc::new_cyclic(|me| Fills {
            me: me.clone(),
            data,
            origin,
            block_bytes,
            pending: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
        })
    }

    /// Fill `block` from `src`, then send `bio` (already carrying the
    /// pool's provisioning frame) to `offset` in it.
    pub fn start(&self, bio: Bio, block: u64, offset: u64, src: Source) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let bs = self.block_bytes;
        let mut fill = Fill {
            bio,
            buf: if matches!(src, Source::Zeroes) && self.data.dev.features().write_zeroes {
                Vec::new()
            } else {
                vec![0u8; bs as usize]
            },
            block,
            offset,
            read_done: false,
            merged: false,
        };
        let (dev, op, at, len) = match src {
            Source::Block(b) => (&self.data, Op::Read, b * bs, bs),
            Source::Origin { offset, len } => match &self.origin {
                Some(o) => (o, Op::Read, offset, len),
                None => (&self.data, Op::Write, block * bs, bs),
            },
            Source::Zeroes if self.data.dev.features().write_zeroes => {
                // As kcopyd zeroes a block (`dm_kcopyd_zero`): with
                // WRITE_ZEROES where the data device has it, so no buffer
                // of zeroes is made, sent or stored.
                fill.read_done = true;
                self.pending.lock().insert(id, fill);
                return self.submit(
                    &self.data,
                    Op::WriteZeroes,
                    block * bs,
                    bs,
                    IoBuf::empty(),
                    id,
                );
            }
            Source::Zeroes => {
                fill.read_done = true;
                (&self.data, Op::Write, block * bs, bs)
            }
        };
        if op == Op::Write {
            fill.read_done = true;
            fill.merge();
        }
        // SAFETY: the buffer's heap block does not move when the `Fill`
        // moves into the map, and it stays there until this bio (and the
        // write after it) completed.
        let buf = unsafe { IoBuf::from_slice(&mut fill.buf[..len as usize]) };
        self.pending.lock().insert(id, fill);
        self.submit(dev, op, at, len, buf, id);
    }

    fn submit(&self, dev: &DevArg, op: Op, at: u64, len: u64, buf: IoBuf, id: u64) {
        let Some(me) = self.me.upgrade() else {
            return;
        };
        dev.dev.submit(Bio::new(op, at, len, buf, me, id));
    }
}

impl EndIo for Fills {
    fn end_io(&self, _bio: Bio, status: Status, id: u64) {
        let mut pending = self.pending.lock();
        let Some(fill) = pending.get_mut(&id) else {
            return;
        };
        if status.is_ok() && !fill.read_done {
            fill.read_done = true;
            fill.merge();
            let bs = self.block_bytes;
            let at = fill.block * bs;
            // SAFETY: as in `start`: the buffer lives in the map until the
            // write completes.
            let buf = unsafe { IoBuf::from_slice(&mut fill.buf) };
            drop(pending);
            self.submit(&self.data, Op::Write, at, bs, buf, id);
            return;
        }
        let Some(fill) = pending.remove(&id) else {
            return;
        };
        drop(pending);
        let mut bio = fill.bio;
        if !status.is_ok() || fill.merged {
            return bio.complete(status);
        }
        bio.offset = fill.block * self.block_bytes + fill.offset;
        self.data.dev.submit(bio);
    }
}

/// What a partial write into a new block of `bs` bytes needs first.
pub fn source(
    bs: u64,
    origin: Option<&DevArg>,
    vblock: u64,
    copy_from: Option<u64>,
    zero: bool,
) -> Option<Source> {
    if let Some(b) = copy_from {
        return Some(Source::Block(b));
    }
    if let Some(o) = origin.filter(|o| vblock * bs < o.dev.size()) {
        let len = (o.dev.size() - vblock * bs).min(bs);
        return Some(Source::Origin {
            offset: vblock * bs,
            len,
        });
    }
    zero.then_some(Source::Zeroes)
}
