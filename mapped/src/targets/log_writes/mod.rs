//! `log-writes <dev> <logdev>`: pass I/O to `dev` and record every write,
//! flush, FUA write, discard and mark on `logdev` (kernel
//! `drivers/md/dm-log-writes.c`, with its table, status, message and log
//! format), so a crash-consistency tester can replay the device to any
//! point a crash could have exposed.
//!
//! Writes are logged in the order they became durable: a write joins the
//! unflushed list when it completes and enters the log only with the
//! flush issued after it (or at once when it is FUA); see `logger.rs`.
//! Reads pass through untouched. `status` is `<logged entries> <highest
//! log sector>` (plus `logging_disabled` once a log write failed or the
//! log filled up); `message 0 mark TEXT` logs a mark. Like the kernel's,
//! the target does not offer write-zeroes (the layer above writes zeroes),
//! so every change reaches the log with its data.

pub mod format;
mod logger;

use crate::error::TargetError;
use crate::target::{CtrContext, DevArg, Target, TargetRef, TargetType};
use blkstack_core::{Bio, BioFlags, EndIo, Features, Op, Status};
use format::{LOG_DISCARD_FLAG, LOG_FLUSH_FLAG, LOG_FUA_FLAG};
use logger::{Block, Log};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;

/// The `log-writes` target type (kernel `dm-log-writes.c`'s `log_writes_target`).
pub const TYPE: TargetType = TargetType {
    name: "log-writes",
    version: [1, 1, 0],
    ctr,
};

/// A built `log-writes` target: the data device and the logger thread
/// writing entries to the log device (kernel `struct log_writes_c`).
pub struct LogWritesTarget {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// What the map path, the completions and the logger thread share.
struct Shared {
    dev: DevArg,
    log: Log,
    /// Blocks of bios in flight, by the id their completion frame carries
    /// (kernel `per_bio_data`).
    in_flight: Mutex<HashMap<u64, Block>>,
    next_id: Mutex<u64>,
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    // The kernel checks for at least two and ignores the rest.
    if args.len() < 2 {
        return Err(TargetError::invalid(format!(
            "Invalid argument count: '<dev> <logdev>', got {}",
            args.len()
        )));
    }
    let dev = ctx
        .get_device(args[0], 0, ctx.len)
        .map_err(|e| in_context("Device lookup failed", e))?;
    // dm_get_device checks no range on the log device: any size will do,
    // and a full log only turns logging off.
    let logdev = ctx
        .get_device(args[1], 0, 0)
        .map_err(|e| in_context("Log device lookup failed", e))?;
    let sectorsize = dev.dev.logical_block_size();
    let shared = Arc::new(Shared {
        dev,
        log: Log::new(logdev, sectorsize),
        in_flight: Mutex::new(HashMap::new()),
        next_id: Mutex::new(0),
    });
    let s = shared.clone();
    let thread = std::thread::Builder::new()
        .name(format!("log-write/{}", ctx.device_name))
        .spawn(move || s.log.run())
        .map_err(|source| TargetError::Io {
            what: "Couldn't alloc kthread",
            source,
        })?;
    Ok(Arc::new(LogWritesTarget {
        shared,
        thread: Some(thread),
    }))
}

fn in_context(context: &str, source: TargetError) -> TargetError {
    TargetError::In {
        context: context.to_string(),
        source: Box::new(source),
    }
}

impl Shared {
    /// Logical blocks of the data device in `bytes`.
    fn blocks(&self, bytes: u64) -> u64 {
        bytes / self.log.sectorsize as u64
    }

    /// Kernel `log_writes_map` for a bio that changes the device.
    fn map_change(self: &Arc<Self>, mut bio: Bio) {
        let flush = bio.op == Op::Flush || bio.flags.contains(BioFlags::PREFLUSH);
        let mut flags = 0;
        if flush {
            flags |= LOG_FLUSH_FLAG;
        }
        if bio.flags.contains(BioFlags::FUA) {
            flags |= LOG_FUA_FLAG;
        }
        let data = match bio.op {
            Op::Write => bio.data().to_vec(),
            // Not offered, but a layer that sends it anyway gets its
            // zeroes logged as the write the block layer would make.
            Op::WriteZeroes => vec![0u8; bio.len as usize],
            _ => Vec::new(),
        };
        if bio.op == Op::Discard {
            flags |= LOG_DISCARD_FLAG;
        }
        let mut block = Block {
            flags,
            sector: self.blocks(bio.offset),
            nr_sectors: if bio.op == Op::Flush {
                0
            } else {
                self.blocks(bio.len)
            },
            data,
            covers: Vec::new(),
        };
        {
            let mut l = self.log.lists.lock();
            l.pending += 1;
            if flush {
                block.covers = std::mem::take(&mut l.unflushed);
            }
        }
        let id = {
            let mut n = self.next_id.lock();
            *n += 1;
            *n
        };
        self.in_flight.lock().insert(id, block);
        bio.push_end(self.clone(), id);
        if bio.op == Op::Discard && !self.dev.dev.features().discard {
            // Kernel: a discard the device cannot do ends at once, logged.
            bio.complete(Status::Ok);
            return;
        }
        self.dev.dev.submit(bio);
    }
}

/// Kernel `normal_end_io`: the completed change joins the log's lists,
/// whatever its status.
impl EndIo for Shared {
    fn end_io(&self, bio: Bio, status: Status, id: u64) {
        if let Some(mut block) = self.in_flight.lock().remove(&id) {
            let mut l = self.log.lists.lock();
            if block.flags & LOG_FLUSH_FLAG != 0 {
                let covered = std::mem::take(&mut block.covers);
                l.logging.extend(covered);
                l.logging.push_back(block);
                self.log.cv.notify_all();
            } else if block.flags & LOG_FUA_FLAG != 0 {
                l.logging.push_back(block);
                self.log.cv.notify_all();
            } else {
                l.unflushed.push(block);
            }
        }
        bio.complete(status);
    }
}

impl Target for LogWritesTarget {
    fn map(&self, bio: Bio) {
        let s = &self.shared;
        let enabled = s.log.lists.lock().logging_enabled;
        let empty = bio.len == 0 && bio.op != Op::Flush && !bio.flags.contains(BioFlags::PREFLUSH);
        if !enabled || bio.op == Op::Read || empty {
            s.dev.dev.submit(bio);
            return;
        }
        s.map_change(bio);
    }

    fn status(&self) -> String {
        let l = self.shared.log.lists.lock();
        let mut s = format!("{} {}", l.logged_entries, l.next_sector - 1);
        if !l.logging_enabled {
            s.push_str(" logging_disabled");
        }
        s
    }

    fn table(&self) -> String {
        format!("{} {}", self.shared.dev, self.shared.log.logdev)
    }

    /// `mark TEXT` (kernel `log_writes_message`: exactly two words).
    fn message(&self, args: &[&str]) -> Result<String, TargetError> {
        if args.len() != 2 {
            return Err(TargetError::invalid(format!(
                "Invalid log-writes message arguments, expect 2 arguments, got {}",
                args.len()
            )));
        }
        if !args[0].eq_ignore_ascii_case("mark") {
            return Err(TargetError::UnsupportedMessage(args.join(" ")));
        }
        self.shared.log.mark(args[1]);
        Ok(String::new())
    }

    fn features(&self) -> Features {
        let below = self.shared.dev.dev.features();
        Features {
            discard: true,
            write_zeroes: false,
            fast_zero: false,
            knows_holes: false,
            ..below
        }
    }
}

impl Drop for LogWritesTarget {
    fn drop(&mut self) {
        self.shared.log.finish();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
