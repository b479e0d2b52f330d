//! Requests not aligned to the device's logical block size, from a client
//! that never learnt it. A client that chose its export with
//! NBD_OPT_EXPORT_NAME gets no NBD_INFO_BLOCK_SIZE, so per the protocol's
//! block-size section it assumes a minimum block size of 1; the server
//! then serves such requests rather than refusing them, the way the kernel
//! serves a byte-granular `pread`/`pwrite` on a block device through the
//! page cache: the enclosing blocks are read, patched and written back
//! (read-modify-write).
//!
//! An unaligned WRITE_ZEROES (up to 4 GiB in one request) never gets a
//! buffer of its length: the partial blocks at each end are patched one
//! block at a time and the whole blocks between are zeroed by the
//! device's own write-zeroes, in pieces of the export's largest request,
//! as the kernel's `blkdev_issue_zeroout` zeroes a range.
//!
//! These requests are rare, so they are served synchronously on the reader
//! thread after every request of this connection in flight has been
//! answered: nothing of the same client can then race the read-modify-
//! write. (Another connection writing the same block at the same moment
//! can still race it, as with any client-side read-modify-write.)

use super::transmission::{read_payload, Transmission};
use crate::proto::*;
use blkstack_core::sync::{submit_and_wait, submit_and_wait_flags};
use blkstack_core::{AlignedBuf, BioFlags, Op, Status};
use std::io;

impl Transmission<'_> {
    /// Whether `r` must go through this file: a data command not aligned
    /// to the logical block size, from a client that may send one.
    pub(super) fn is_emulated_unaligned(&self, r: &Request) -> bool {
        self.any_alignment
            && matches!(r.cmd, CMD_READ | CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES)
            && (!r.offset.is_multiple_of(self.lbs) || !(r.len as u64).is_multiple_of(self.lbs))
    }

    /// Serve a request [`Self::is_emulated_unaligned`] selected (already
    /// validated otherwise); a WRITE's payload is still on the socket.
    pub(super) fn serve_unaligned(&mut self, r: &Request) -> io::Result<()> {
        let mut payload = Vec::new();
        if r.cmd == CMD_WRITE {
            payload.resize(r.len as usize, 0);
            read_payload(&mut self.inb, &self.shared, &mut payload)?;
        }
        self.drain();
        let (start, end) = (r.offset, r.offset + r.len as u64);
        if r.cmd == CMD_TRIM {
            // A trim is advisory: discard the whole blocks inside the range.
            let (a, b) = (start.next_multiple_of(self.lbs), end - end % self.lbs);
            let st = if a < b {
                submit_and_wait(&*self.export.dev, Op::Discard, a, b - a, &mut [])
            } else {
                Status::Ok
            };
            self.shared.reply_now(r.handle, nbd_error(st), "");
            return Ok(());
        }
        if r.cmd == CMD_WRITE_ZEROES {
            let st = self.zero_unaligned(r);
            self.shared.reply_now(r.handle, nbd_error(st), "");
            return Ok(());
        }
        let a = start - start % self.lbs;
        let b = end.next_multiple_of(self.lbs).min(self.size);
        let mut buf = AlignedBuf::new((b - a) as usize);
        let dev = &*self.export.dev;
        let st = submit_and_wait(dev, Op::Read, a, b - a, buf.as_mut_slice());
        let (lo, hi) = ((start - a) as usize, (end - a) as usize);
        if r.cmd == CMD_READ || !st.is_ok() {
            if st.is_ok() {
                self.shared
                    .reply_read_now(r.handle, r.offset, &buf.as_slice()[lo..hi]);
            } else {
                self.shared
                    .reply_now(r.handle, nbd_error(st), "read failed");
            }
            return Ok(());
        }
        buf.as_mut_slice()[lo..hi].copy_from_slice(&payload);
        let st = submit_and_wait_flags(dev, Op::Write, fua(r), a, b - a, buf.as_mut_slice());
        self.shared.reply_now(r.handle, nbd_error(st), "");
        Ok(())
    }

    /// Zero `r`'s range: partial blocks at the ends by read-modify-write
    /// of one block each, whole blocks by the device's write-zeroes.
    fn zero_unaligned(&self, r: &Request) -> Status {
        let (start, end) = (r.offset, r.offset + r.len as u64);
        let lbs = self.lbs;
        let (a, b) = (start.next_multiple_of(lbs), end - end % lbs);
        let head = start - start % lbs;
        if start % lbs != 0 {
            let hi = end.min(head + lbs);
            let st = self.zero_in_block(head, start - head, hi - head, fua(r));
            if !st.is_ok() {
                return st;
            }
        }
        let tail = end - end % lbs;
        if end % lbs != 0 && (start % lbs == 0 || tail != head) {
            let st = self.zero_in_block(tail, start.max(tail) - tail, end - tail, fua(r));
            if !st.is_ok() {
                return st;
            }
        }
        let mut flags = fua(r);
        if r.flags & CMD_FLAG_NO_HOLE != 0 {
            flags.insert(BioFlags::NOUNMAP);
        }
        let piece = (self.max_request as u64 / lbs * lbs).max(lbs);
        let mut at = a;
        while at < b {
            let n = piece.min(b - at);
            let st =
                submit_and_wait_flags(&*self.export.dev, Op::WriteZeroes, flags, at, n, &mut []);
            if !st.is_ok() {
                return st;
            }
            at += n;
        }
        Status::Ok
    }

    /// Zero bytes `lo..hi` of the block at `at` (read, patch, write).
    fn zero_in_block(&self, at: u64, lo: u64, hi: u64, flags: BioFlags) -> Status {
        let dev = &*self.export.dev;
        let mut buf = AlignedBuf::new(self.lbs as usize);
        let st = submit_and_wait(dev, Op::Read, at, self.lbs, buf.as_mut_slice());
        if !st.is_ok() {
            return st;
        }
        buf.as_mut_slice()[lo as usize..hi as usize].fill(0);
        submit_and_wait_flags(dev, Op::Write, flags, at, self.lbs, buf.as_mut_slice())
    }
}

fn fua(r: &Request) -> BioFlags {
    if r.flags & CMD_FLAG_FUA != 0 {
        BioFlags::FUA
    } else {
        BioFlags::NONE
    }
}
