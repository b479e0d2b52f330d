//! `dust <dev> <offset> <blksz>`: a disk with bad blocks that fail reads,
//! like a drive returning "Read Medium Error" (kernel dm-dust.c, 1.0).
//!
//! Bad blocks are added and removed by message while the device runs:
//! `addbadblock N [write_fail_count]`, `removebadblock N`, `queryblock N`,
//! `countbadblocks`, `clearbadblocks`, `listbadblocks`, `enable` (fail
//! reads of bad blocks; off at creation, as in dm), `disable`, `quiet`. A
//! write to a bad block fails `write_fail_count` times, then clears the
//! block (the drive remapped it). Block numbers count `blksz` blocks of
//! the underlying device including `offset`, as dm-dust's do. No bio spans
//! two blocks (`max_io_len` is the block size).

use crate::error::TargetError;
use crate::target::{expect_args, parse_arg, CtrContext, DevArg, Target, TargetRef, TargetType};
use blkstack_core::{Bio, Features, Op, Status, SECTOR_SIZE};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub const TYPE: TargetType = TargetType {
    name: "dust",
    version: [1, 0, 0],
    ctr,
};

pub struct DustTarget {
    dev: DevArg,
    start: u64,
    blksz: u64,
    /// block -> remaining write failures
    bad: Mutex<BTreeMap<u64, u8>>,
    fail_read_on_bb: AtomicBool,
    quiet: AtomicBool,
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    expect_args(args, &[3], "<dev> <offset> <blksz>")?;
    let blksz: u64 = parse_arg("block size parameter", args[2])?;
    if blksz == 0 {
        return Err(TargetError::invalid("invalid block size parameter 0"));
    }
    if blksz < 512 {
        return Err(TargetError::invalid(format!(
            "block size {blksz} must be at least 512"
        )));
    }
    if !blksz.is_power_of_two() {
        return Err(TargetError::invalid(format!(
            "block size {blksz} must be a power of 2"
        )));
    }
    if blksz / SECTOR_SIZE > ctx.len.min(2_097_152) {
        return Err(TargetError::invalid(format!(
            "block size {blksz} is too large"
        )));
    }
    let start: u64 = parse_arg("device offset sector", args[1])?;
    let dev = ctx.get_device(args[0], start, ctx.len)?;
    Ok(Arc::new(DustTarget {
        dev,
        start,
        blksz,
        bad: Mutex::new(BTreeMap::new()),
        fail_read_on_bb: AtomicBool::new(false),
        quiet: AtomicBool::new(false),
    }))
}

impl DustTarget {
    fn dev_blocks(&self) -> u64 {
        self.dev.dev.size() / self.blksz
    }

    fn parse_block(&self, s: &str) -> Result<u64, TargetError> {
        let b: u64 = parse_arg("block", s)?;
        if b > self.dev_blocks() {
            return Err(TargetError::invalid(format!(
                "selected block value {b} out of range (device has {} blocks)",
                self.dev_blocks()
            )));
        }
        Ok(b)
    }
}

impl Target for DustTarget {
    fn map(&self, mut bio: Bio) {
        bio.offset += self.start * SECTOR_SIZE;
        if self.fail_read_on_bb.load(Ordering::Relaxed) && bio.op != Op::Flush {
            let block = bio.offset / self.blksz;
            let mut bad = self.bad.lock();
            if bio.op == Op::Read {
                if bad.contains_key(&block) {
                    drop(bad);
                    bio.complete(Status::IoError);
                    return;
                }
            } else if let Some(left) = bad.get_mut(&block) {
                if *left > 0 {
                    *left -= 1;
                    drop(bad);
                    bio.complete(Status::IoError);
                    return;
                }
                bad.remove(&block);
            }
        }
        self.dev.dev.submit(bio);
    }

    fn max_io_len(&self, offset: u64) -> u64 {
        self.blksz - (offset + self.start * SECTOR_SIZE) % self.blksz
    }

    fn status(&self) -> String {
        format!(
            "{} {} {}",
            self.dev,
            if self.fail_read_on_bb.load(Ordering::Relaxed) {
                "fail_read_on_bad_block"
            } else {
                "bypass"
            },
            if self.quiet.load(Ordering::Relaxed) {
                "quiet"
            } else {
                "verbose"
            }
        )
    }

    fn table(&self) -> String {
        format!("{} {} {}", self.dev, self.start, self.blksz)
    }

    fn message(&self, args: &[&str]) -> Result<String, TargetError> {
        let verb = args[0].to_ascii_lowercase();
        match (verb.as_str(), args.len()) {
            ("addbadblock" | "removebadblock" | "queryblock", 1) => Err(TargetError::invalid(
                format!("{verb} requires an additional argument"),
            )),
            ("enable", 1) => {
                self.fail_read_on_bb.store(true, Ordering::Relaxed);
                Ok(String::new())
            }
            ("disable", 1) => {
                self.fail_read_on_bb.store(false, Ordering::Relaxed);
                Ok(String::new())
            }
            ("quiet", 1) => {
                self.quiet.fetch_xor(true, Ordering::Relaxed);
                Ok(String::new())
            }
            ("countbadblocks", 1) => Ok(format!(
                "countbadblocks: {} badblock(s) found",
                self.bad.lock().len()
            )),
            ("clearbadblocks", 1) => {
                let mut bad = self.bad.lock();
                let had = !bad.is_empty();
                bad.clear();
                Ok(if had {
                    "dust_clear_badblocks: badblocks cleared".into()
                } else {
                    "dust_clear_badblocks: no badblocks found".into()
                })
            }
            ("listbadblocks", 1) => {
                let bad = self.bad.lock();
                if bad.is_empty() {
                    Ok("No blocks in badblocklist".into())
                } else {
                    Ok(bad.keys().map(|b| format!("{b}\n")).collect())
                }
            }
            ("addbadblock", 2 | 3) => {
                let block = self.parse_block(args[1])?;
                let fails: u8 = match args.get(2) {
                    Some(s) => parse_arg("write fail count (0-255)", s)?,
                    None => 0,
                };
                let mut bad = self.bad.lock();
                if bad.contains_key(&block) {
                    return Err(TargetError::invalid(format!(
                        "block {block} already in badblocklist"
                    )));
                }
                bad.insert(block, fails);
                Ok(String::new())
            }
            ("removebadblock", 2) => {
                let block = self.parse_block(args[1])?;
                match self.bad.lock().remove(&block) {
                    Some(_) => Ok(String::new()),
                    None => Err(TargetError::invalid(format!(
                        "block {block} not found in badblocklist"
                    ))),
                }
            }
            ("queryblock", 2) => {
                let block = self.parse_block(args[1])?;
                let found = self.bad.lock().contains_key(&block);
                Ok(format!(
                    "dust_query_block: block {block} {}found in badblocklist",
                    if found { "" } else { "not " }
                ))
            }
            _ => Err(TargetError::invalid(format!(
                "unrecognized message '{}' ({} argument(s))",
                args[0],
                args.len()
            ))),
        }
    }

    fn features(&self) -> Features {
        self.dev.dev.features()
    }
}
