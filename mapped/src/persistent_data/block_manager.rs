//! The block manager (`persistent-data/dm-block-manager.c`): a metadata
//! device seen as 4 KiB blocks, read, written (one with FUA, or many in
//! flight at once) and flushed. The kernel's keeps the blocks it hands
//! out in dm-bufio; here the transaction manager (`tm.rs`) keeps the
//! decoded nodes it works on, so this is only the device I/O.

use super::{PdError, BLOCK_SIZE};
use blkstack_core::sync::{submit_and_wait, submit_and_wait_flags};
use blkstack_core::{Bio, BioFlags, DeviceRef, EndIo, IoBuf, Op, Status};
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;

/// Writes in flight at once, counted down by their completions.
#[derive(Default)]
struct Batch {
    left: Mutex<(usize, bool)>,
    cv: Condvar,
}

impl EndIo for Batch {
    fn end_io(&self, _bio: Bio, status: Status, _private: u64) {
        let mut g = self.left.lock();
        g.0 -= 1;
        g.1 |= !status.is_ok();
        if g.0 == 0 {
            self.cv.notify_all();
        }
    }
}

/// One metadata device's blocks (kernel `struct dm_block_manager`).
pub struct BlockManager {
    dev: DeviceRef,
}

impl BlockManager {
    /// The blocks of `dev`.
    pub fn new(dev: DeviceRef) -> BlockManager {
        BlockManager { dev }
    }

    /// The device's size in bytes, as it is now (it may have grown).
    pub fn size_bytes(&self) -> u64 {
        self.dev.size()
    }

    /// Read block `b`.
    pub fn read_block(&self, b: u64) -> Result<Vec<u8>, PdError> {
        let mut buf = vec![0u8; BLOCK_SIZE];
        let st = submit_and_wait(
            &*self.dev,
            Op::Read,
            b * BLOCK_SIZE as u64,
            BLOCK_SIZE as u64,
            &mut buf,
        );
        io(st, "read", b)?;
        Ok(buf)
    }

    /// Write block `b` (with FUA when `fua`: a superblock).
    pub fn write_block(&self, b: u64, data: &mut [u8], fua: bool) -> Result<(), PdError> {
        let flags = if fua { BioFlags::FUA } else { BioFlags::NONE };
        let st = submit_and_wait_flags(
            &*self.dev,
            Op::Write,
            flags,
            b * BLOCK_SIZE as u64,
            BLOCK_SIZE as u64,
            data,
        );
        io(st, "write", b)
    }

    /// Flush the device's cache (`dm_bm_flush`).
    pub fn flush(&self) -> Result<(), PdError> {
        let st = submit_and_wait(&*self.dev, Op::Flush, 0, 0, &mut []);
        io(st, "flush", 0)
    }

    /// Write every (block, contents) of `writes`, all in flight at once,
    /// and wait for them all.
    pub fn write_all(&self, writes: &mut [(u64, Vec<u8>)]) -> Result<(), PdError> {
        let batch = Arc::new(Batch::default());
        batch.left.lock().0 = writes.len();
        for (b, data) in writes.iter_mut() {
            // SAFETY: `writes` outlives the bios: we wait below until every
            // one has completed before returning.
            let buf = unsafe { IoBuf::from_slice(data) };
            let bio = Bio::new(
                Op::Write,
                *b * BLOCK_SIZE as u64,
                BLOCK_SIZE as u64,
                buf,
                batch.clone(),
                0,
            );
            self.dev.submit(bio);
        }
        let mut g = batch.left.lock();
        while g.0 > 0 {
            batch.cv.wait(&mut g);
        }
        if g.1 {
            return Err(PdError::Io {
                what: "write",
                block: writes.first().map(|w| w.0).unwrap_or(0),
                status: Status::IoError,
            });
        }
        Ok(())
    }
}

fn io(st: Status, what: &'static str, block: u64) -> Result<(), PdError> {
    if st.is_ok() {
        Ok(())
    } else {
        Err(PdError::Io {
            what,
            block,
            status: st,
        })
    }
}
