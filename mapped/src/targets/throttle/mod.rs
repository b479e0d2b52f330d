//! `throttle <dev> [<#args> <arg>...]`: IOPS and bandwidth caps, read and
//! write apart or in total, with bursts, changed while it runs. There is
//! no kernel dm target for this; the model is qemu's I/O throttling
//! (util/throttle.c's leaky buckets, block/throttle-groups.c's queues,
//! the `iops_rd`, `bps_wr`, `*_max`, `*_max_length`, `iops_size` options),
//! in dm-flakey's shape: a device, then a count of the words that follow
//! (`0 2097152 throttle 253:0 4 riops 500 wbps 8M`).
//!
//! Keys ([`config`]): `riops N`, `wiops N`, `iops N`, `rbps SIZE`,
//! `wbps SIZE`, `bps SIZE`, `KEY_burst MAX SECONDS` for each (qemu's
//! `*_max` and `*_max_length`), `iops_size SIZE`. Sizes are bytes with
//! K, M, G or T (binary). 0 or absent is no limit. qemu's checks hold: a
//! total and a read or write limit of the same kind are exclusive, a
//! burst is at least its base rate, lengths are at least a second.
//!
//! Reads are charged to the read and total buckets, writes, discards and
//! write-zeroes (qemu's throttle filter counts them as writes, by their
//! bytes) to the write and total ones. An empty flush is not throttled:
//! it goes straight down, as qemu's throttle filter passes flushes; it
//! only has to cover writes that completed, and a held write has not.
//! Requests wait in a FIFO per direction ([`queue`]), never reordered
//! within it and never failed. A suspend sends on everything held and
//! passes I/O unthrottled until resume (as dm-delay's presuspend does).
//!
//! `message 0 set KEY VALUE` (or `set KEY_burst MAX SECONDS`) changes one
//! limit at once, for held requests too; `set KEY 0` lifts a limit and its
//! burst. A changed bucket keeps how full it is as a share of its size
//! ([`bucket::Buckets::reconfigure`]), so a `set` hands out no burst.
//! `status`: `<#args> <args>... <held_ios> <held_bytes>
//! <throttled_ios> <throttled_bytes> <throttled_ms>`.

mod bucket;
mod config;
mod queue;

use self::bucket::Dir;
use self::config::parse_limits;
use self::queue::Queue;
use crate::error::TargetError;
use crate::target::{extents_from, CtrContext, Target, TargetRef, TargetType};
use blkstack_core::device::Extent;
use blkstack_core::{Bio, Features, Op};
use parking_lot::Mutex;
use std::sync::Arc;
use std::thread::JoinHandle;

pub use self::config::{format_size, parse_size};
pub use self::queue::{MAX_HELD, MIN_PARK_NS};

/// The `throttle` target type.
pub const TYPE: TargetType = TargetType {
    name: "throttle",
    version: [1, 0, 0],
    ctr,
};

const SYNTAX: &str = "<dev> [<#args> <arg>...]";

/// A built `throttle` target: its queue and the worker that empties it.
pub struct ThrottleTarget {
    queue: Arc<Queue>,
    worker: Option<JoinHandle<()>>,
    /// Serialises `set` messages (read, change, write back).
    set_lock: Mutex<()>,
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    let Some(dev_arg) = args.first() else {
        return Err(TargetError::invalid(format!(
            "missing device: expected '{SYNTAX}'"
        )));
    };
    let words = match args.get(1) {
        None => &[][..],
        Some(n) => {
            let count: usize = n
                .parse()
                .ok()
                .filter(|_| n.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| {
                    TargetError::invalid(format!(
                        "invalid argument count '{n}': expected '{SYNTAX}'"
                    ))
                })?;
            let given = args.len() - 2;
            if count != given {
                return Err(TargetError::invalid(format!(
                    "argument count {count} but {given} argument(s) follow"
                )));
            }
            &args[2..]
        }
    };
    let cfg = parse_limits(words)?;
    let dev = ctx.get_device(dev_arg, 0, ctx.len)?;
    let queue = Arc::new(Queue::new(dev, cfg));
    let q = queue.clone();
    let name: String = ctx.device_name.chars().take(8).collect();
    let worker = std::thread::Builder::new()
        .name(format!("thr-{name}"))
        .spawn(move || q.run())
        .map_err(|source| TargetError::Io {
            what: "cannot start the throttle worker",
            source,
        })?;
    Ok(Arc::new(ThrottleTarget {
        queue,
        worker: Some(worker),
        set_lock: Mutex::new(()),
    }))
}

const USAGE: &str = "usage: set <key> <value> or set <key>_burst <max> <seconds> \
                     (keys riops, wiops, iops, rbps, wbps, bps, iops_size)";

impl Target for ThrottleTarget {
    fn map(&self, bio: Bio) {
        let dir = match bio.op {
            Op::Flush => {
                self.queue.dev().dev.submit(bio);
                return;
            }
            Op::Read => Dir::Read,
            Op::Write | Op::Discard | Op::WriteZeroes => Dir::Write,
        };
        self.queue.submit(bio, dir);
    }

    /// `<#args> <args>... <held_ios> <held_bytes> <throttled_ios>
    /// <throttled_bytes> <throttled_ms>`.
    fn status(&self) -> String {
        let words = self.queue.config().words();
        let c = self.queue.counts();
        let mut s = words.len().to_string();
        for w in &words {
            s.push(' ');
            s.push_str(w);
        }
        s.push_str(&format!(
            " {} {} {} {} {}",
            c.held_ios,
            c.held_bytes,
            c.throttled_ios,
            c.throttled_bytes,
            c.throttled_ns / 1_000_000
        ));
        s
    }

    fn table(&self) -> String {
        let words = self.queue.config().words();
        let mut s = format!("{} {}", self.queue.dev(), words.len());
        for w in &words {
            s.push(' ');
            s.push_str(w);
        }
        s
    }

    fn message(&self, args: &[&str]) -> Result<String, TargetError> {
        match args.split_first() {
            Some((&"set", rest)) => {
                let _g = self.set_lock.lock();
                let mut cfg = self.queue.config();
                cfg.set(rest)
                    .map_err(|e| e.within(format!("throttle: set {}", rest.join(" "))))?;
                self.queue.reconfigure(cfg);
                Ok(String::new())
            }
            Some((verb, _)) => Err(TargetError::invalid(format!(
                "throttle: unknown message '{verb}'; {USAGE}"
            ))),
            None => Err(TargetError::invalid(format!("throttle: {USAGE}"))),
        }
    }

    fn presuspend(&self) {
        self.queue.set_may_throttle(false);
    }

    fn resume(&self) {
        self.queue.set_may_throttle(true);
    }

    fn features(&self) -> Features {
        self.queue.dev().dev.features()
    }

    fn extents(&self, offset: u64, len: u64) -> Option<Vec<Extent>> {
        extents_from(self.queue.dev(), 0, offset, len)
    }
}

impl Drop for ThrottleTarget {
    fn drop(&mut self) {
        self.queue.stop();
        if let Some(h) = self.worker.take() {
            // A table dropped from a completion running on the worker
            // cannot wait for it; the worker exits on `stop` by itself.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        self.queue.drain();
    }
}
