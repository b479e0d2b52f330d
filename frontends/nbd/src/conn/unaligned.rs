//! Requests not aligned to the device's logical block size, from a client
//! that never learnt it. A client that chose its export with
//! NBD_OPT_EXPORT_NAME gets no NBD_INFO_BLOCK_SIZE, so per the protocol's
//! block-size section it assumes a minimum block size of 1; the server
//! then serves such requests rather than refusing them, the way the kernel
//! serves a byte-granular `pread`/`pwrite` on a block device through the
//! page cache: the enclosing blocks are read, patched and written back
//! (read-modify-write).
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
        let part = &mut buf.as_mut_slice()[lo..hi];
        if r.cmd == CMD_WRITE {
            part.copy_from_slice(&payload);
        } else {
            part.fill(0);
        }
        let flags = if r.flags & CMD_FLAG_FUA != 0 {
            BioFlags::FUA
        } else {
            BioFlags::NONE
        };
        let st = submit_and_wait_flags(dev, Op::Write, flags, a, b - a, buf.as_mut_slice());
        self.shared.reply_now(r.handle, nbd_error(st), "");
        Ok(())
    }
}
