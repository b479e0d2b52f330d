//! The log-writes target's log: the blocks waiting for a flush, the blocks
//! ready to be logged, and the thread that writes them to the log device
//! in order (kernel `log_writes_kthread` and `log_one_block`).
//!
//! A write goes on the unflushed list when it completes; a completed FLUSH
//! moves the writes that had completed before it was issued onto the
//! logging list, then itself; a completed FUA write goes straight there.
//! So the log shows the order in which data reached stable storage, which
//! is what a crash could expose, not the order of submission. Each block
//! is written by a synchronous I/O on the log device: stricter than the
//! kernel's asynchronous bios, and the super block (entry count) is
//! rewritten after every FUA and mark entry, as the kernel does.

use super::format::{LogEntry, LogSuper, LOG_DISCARD_FLAG, LOG_FUA_FLAG, LOG_MARK_FLAG};
use crate::target::DevArg;
use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Op, SECTOR_SIZE};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;

/// One write, flush, discard or mark on its way into the log (kernel
/// `struct pending_block`).
pub(super) struct Block {
    pub flags: u64,
    /// In logical blocks of the data device.
    pub sector: u64,
    pub nr_sectors: u64,
    /// A write's data, or a mark's text.
    pub data: Vec<u8>,
    /// For a flush: the writes that had completed when it was issued.
    pub covers: Vec<Block>,
}

pub(super) struct Lists {
    pub unflushed: Vec<Block>,
    pub logging: VecDeque<Block>,
    /// Blocks made and not yet logged or dropped (kernel `pending_blocks`).
    pub pending: u64,
    /// The logger is writing one block now.
    pub busy: bool,
    pub logged_entries: u64,
    /// Next free 512-byte sector of the log device.
    pub next_sector: u64,
    pub end_sector: u64,
    pub logging_enabled: bool,
    pub stop: bool,
}

pub(super) struct Log {
    pub logdev: DevArg,
    /// The data device's logical block size, the log's unit.
    pub sectorsize: u32,
    pub lists: Mutex<Lists>,
    pub cv: Condvar,
}

impl Log {
    pub fn new(logdev: DevArg, sectorsize: u32) -> Log {
        let end_sector = logdev.dev.size() / SECTOR_SIZE;
        Log {
            logdev,
            sectorsize,
            lists: Mutex::new(Lists {
                unflushed: Vec::new(),
                logging: VecDeque::new(),
                pending: 0,
                busy: false,
                logged_entries: 0,
                next_sector: sectorsize as u64 / SECTOR_SIZE,
                end_sector,
                logging_enabled: true,
                stop: false,
            }),
            cv: Condvar::new(),
        }
    }

    /// 512-byte sectors in one logical block.
    fn block_sectors(&self) -> u64 {
        self.sectorsize as u64 / SECTOR_SIZE
    }

    /// Queue a mark (kernel `log_mark`): its text is cut to what fits in
    /// the entry's block.
    pub fn mark(&self, text: &str) {
        let max = self.sectorsize as usize - super::format::ENTRY_LEN - 1;
        let mut data = text.as_bytes().to_vec();
        data.truncate(max);
        let mut l = self.lists.lock();
        l.pending += 1;
        l.logging.push_back(Block {
            flags: LOG_MARK_FLAG,
            sector: 0,
            nr_sectors: 0,
            data,
            covers: Vec::new(),
        });
        self.cv.notify_all();
    }

    /// The logger thread's loop: log blocks in order until told to stop.
    pub fn run(&self) {
        loop {
            let mut l = self.lists.lock();
            let block = loop {
                if let Some(b) = l.logging.pop_front() {
                    break b;
                }
                if l.stop {
                    return;
                }
                self.cv.wait(&mut l);
            };
            let Some((sector, with_super)) = self.place(&mut l, &block) else {
                l.pending -= 1;
                self.cv.notify_all();
                continue;
            };
            l.busy = true;
            drop(l);
            let ok = self.write_block(&block, sector)
                && match with_super {
                    Some(n) => self.write_super(n),
                    None => true,
                };
            let mut l = self.lists.lock();
            if !ok {
                tracing::error!(log = %self.logdev.name, "log-writes: error writing the log; logging disabled");
                l.logging_enabled = false;
            }
            l.pending -= 1;
            l.busy = false;
            self.cv.notify_all();
        }
    }

    /// The block's place in the log, and the entry count to write in the
    /// super block after it (FUA and mark entries); `None` when it is
    /// dropped: logging is off, or the log device is full (which turns
    /// logging off, as the kernel does).
    fn place(&self, l: &mut Lists, b: &Block) -> Option<(u64, Option<u64>)> {
        if !l.logging_enabled {
            return None;
        }
        let sector = l.next_sector;
        if b.flags & LOG_DISCARD_FLAG == 0 {
            l.next_sector += b.nr_sectors * self.block_sectors();
        }
        l.next_sector += self.block_sectors();
        if l.end_sector != 0 && l.next_sector >= l.end_sector {
            tracing::error!(log = %self.logdev.name, "log-writes: ran out of space on the logdev");
            l.logging_enabled = false;
            return None;
        }
        l.logged_entries += 1;
        let with_super = b.flags & (LOG_FUA_FLAG | LOG_MARK_FLAG) != 0;
        Some((sector, with_super.then_some(l.logged_entries)))
    }

    /// The entry's block at 512-byte `sector` of the log, then its data.
    fn write_block(&self, b: &Block, sector: u64) -> bool {
        let bs = self.sectorsize as usize;
        let mark = b.flags & LOG_MARK_FLAG != 0;
        let entry = LogEntry {
            sector: b.sector,
            nr_sectors: b.nr_sectors,
            flags: b.flags,
            data_len: if mark { b.data.len() as u64 } else { 0 },
        };
        let inline: &[u8] = if mark { &b.data } else { &[] };
        let mut head = entry.encode(inline, bs);
        if !self.write_at(sector, &mut head) {
            return false;
        }
        if mark || b.data.is_empty() {
            return true;
        }
        let mut data = b.data.clone();
        self.write_at(sector + self.block_sectors(), &mut data)
    }

    fn write_super(&self, nr_entries: u64) -> bool {
        let mut b = LogSuper {
            nr_entries,
            sectorsize: self.sectorsize,
        }
        .encode(self.sectorsize as usize);
        self.write_at(0, &mut b)
    }

    fn write_at(&self, sector: u64, buf: &mut [u8]) -> bool {
        let len = buf.len() as u64;
        submit_and_wait(&*self.logdev.dev, Op::Write, sector * SECTOR_SIZE, len, buf).is_ok()
    }

    /// Kernel `log_writes_dtr`: log what never saw a flush, end with the
    /// mark `dm-log-writes-end` (which rewrites the super block), wait for
    /// the logger to write it all, and stop it.
    pub fn finish(&self) {
        {
            let mut l = self.lists.lock();
            let unflushed = std::mem::take(&mut l.unflushed);
            l.logging.extend(unflushed);
        }
        self.mark("dm-log-writes-end");
        let mut l = self.lists.lock();
        while l.pending > 0 {
            self.cv.wait(&mut l);
        }
        l.stop = true;
        self.cv.notify_all();
    }
}
