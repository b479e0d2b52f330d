//! `flakey <dev> <offset> <up interval> <down interval> [<#feature args>
//! [<arg>]...]`: a device that is up for `up` seconds, then misbehaves for
//! `down` seconds, repeatedly (kernel dm-flakey.c, target version 1.5).
//!
//! While down, by default every I/O fails. Features change that, as the
//! kernel's do:
//! - `error_reads` (reads fail; writes follow the other features),
//! - `drop_writes` (writes succeed but are dropped; reads pass),
//! - `error_writes` (writes fail; reads pass),
//! - `corrupt_bio_byte <Nth_byte> <r|w> <value> <flags>` (the Nth byte,
//!   from 1, of matching reads or writes is overwritten with `value`;
//!   `flags` is a mask of the kernel's `bi_opf` bits — the op in the low
//!   byte (write = 1), REQ_FUA = 1<<17, REQ_PREFLUSH = 1<<18, ... — that
//!   must all be set, 0 for any bio),
//! - `random_read_corrupt <p>` / `random_write_corrupt <p>` (a random byte
//!   of a read or write is set to a random value with probability
//!   `p`/1000000000, upstream "dm flakey: introduce random_read_corrupt and
//!   random_write_corrupt options").
//!
//! A corrupted write goes down as a corrupted copy, the submitter's buffer
//! untouched, as the kernel clones the bio's pages for it.
//!
//! With none of error_reads, drop_writes, error_writes, corrupt_bio_byte or
//! the random corruptions, reads and writes both fail: the kernel (6.12)
//! sets both error bits then, and `table` prints them (`2 error_reads
//! error_writes`). The feature list is parsed word for word as
//! dm-flakey's `parse_features`, so the same tables are refused; words
//! after the counted features are ignored, as there. Intervals are whole
//! seconds as in dm, timed from construction on the monotonic clock.

use crate::error::TargetError;
use crate::target::{parse_sscanf, CtrContext, DevArg, Target, TargetRef, TargetType};
use blkstack_core::clock::now_ns;
use blkstack_core::{AlignedBuf, Bio, BioFlags, EndIo, Features, IoBuf, Op, Status, SECTOR_SIZE};
use parking_lot::Mutex;
use std::sync::Arc;

pub const TYPE: TargetType = TargetType {
    name: "flakey",
    version: [1, 5, 0],
    ctr,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    Read,
    Write,
}

#[derive(Clone, Copy, Debug)]
struct Corrupt {
    /// 1-based byte index within the bio.
    byte: u64,
    dir: Dir,
    value: u8,
    /// Kernel `REQ_*` bits (with the op in the low byte) that must all be
    /// set in the bio's [`kernel_opf`]; 0 for any bio.
    flags: u32,
}

/// dm-flakey's `PROBABILITY_BASE`: random corruption probabilities are
/// out of this.
const PROBABILITY_BASE: u32 = 1_000_000_000;

struct Flakey {
    dev: DevArg,
    start: u64,
    up: u64,
    down: u64,
    error_reads: bool,
    drop_writes: bool,
    error_writes: bool,
    corrupt: Option<Corrupt>,
    /// Probabilities out of [`PROBABILITY_BASE`]; 0 for off.
    random_read: u32,
    random_write: u32,
    start_ns: u64,
}

pub struct FlakeyTarget {
    inner: Arc<Flakey>,
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    if args.len() < 4 {
        return Err(TargetError::invalid(format!(
            "invalid argument count: expected '<dev> <offset> <up interval> <down interval> [<#feature args> [<arg>]...]', got {}",
            args.len()
        )));
    }
    let start: u64 = parse_sscanf("device sector", args[1])?;
    let up: u32 = parse_sscanf("up interval", args[2])?;
    let down: u32 = parse_sscanf("down interval", args[3])?;
    if up as u64 + down as u64 == 0 {
        return Err(TargetError::invalid("total (up + down) interval is zero"));
    }
    if up.checked_add(down).is_none() {
        return Err(TargetError::invalid(format!(
            "interval overflow: up {up} + down {down} seconds exceed {}",
            u32::MAX
        )));
    }
    let features = parse_features(&args[4..])?;
    // The kernel looks the device up after the features.
    let dev = ctx.get_device(args[0], start, ctx.len)?;
    let f = Flakey {
        dev,
        start,
        up: up as u64,
        down: down as u64,
        error_reads: features.error_reads,
        drop_writes: features.drop_writes,
        error_writes: features.error_writes,
        corrupt: features.corrupt,
        random_read: features.random_read,
        random_write: features.random_write,
        start_ns: now_ns(),
    };
    Ok(Arc::new(FlakeyTarget { inner: Arc::new(f) }))
}

/// What the feature arguments ask for (kernel `parse_features`' effect on
/// `struct flakey_c`).
#[derive(Default)]
struct FeatureSet {
    error_reads: bool,
    drop_writes: bool,
    error_writes: bool,
    corrupt: Option<Corrupt>,
    random_read: u32,
    random_write: u32,
}

/// Kernel `dm_read_arg`: a `%u` in `min..=max`, or `error`.
fn read_arg(arg: Option<&&str>, min: u32, max: u32, error: &str) -> Result<u32, TargetError> {
    let v: u32 = match arg {
        Some(a) => parse_sscanf(error, a)?,
        None => return Err(TargetError::invalid(error)),
    };
    if v < min || v > max {
        return Err(TargetError::invalid(format!("{error}: {v}")));
    }
    Ok(v)
}

/// dm-flakey's `parse_features`, step for step: the count (0..=11, no
/// more than the arguments left), then that many words; a feature's
/// parameters count against it. Arguments after the counted ones are
/// ignored, as the kernel ignores them. With no error, drop or corrupt
/// feature, reads and writes both fail: the kernel sets both error bits
/// then, and prints them in the table.
fn parse_features(args: &[&str]) -> Result<FeatureSet, TargetError> {
    let mut f = FeatureSet::default();
    let mut it = args.iter();
    // The kernel's `argc` is unsigned and a feature's parameters are read
    // even past the count; a count gone "negative" is a huge number and
    // the loop then fails on the missing next word.
    let mut argc: i64 = match it.next() {
        None => 0,
        Some(count) => {
            let n = read_arg(Some(count), 0, 11, "Invalid number of feature args")?;
            if n as usize > it.len() {
                return Err(TargetError::invalid(format!(
                    "Invalid number of feature args: {n} declared, {} given",
                    it.len()
                )));
            }
            n as i64
        }
    };
    while argc != 0 {
        let Some(name) = it.next() else {
            return Err(TargetError::invalid("Insufficient feature arguments"));
        };
        argc -= 1;
        let name = name.to_ascii_lowercase();
        match name.as_str() {
            "error_reads" | "drop_writes" | "error_writes" => set_flag(&mut f, &name)?,
            "corrupt_bio_byte" => {
                if argc == 0 {
                    return Err(TargetError::invalid(
                        "Feature corrupt_bio_byte requires parameters <Nth_byte> <r|w> <value> <flags>",
                    ));
                }
                f.corrupt = Some(parse_corrupt_bio_byte(&mut it)?);
                argc -= 4;
            }
            "random_read_corrupt" | "random_write_corrupt" => {
                if argc == 0 {
                    return Err(TargetError::invalid(format!(
                        "Feature {name} requires a parameter <probability> (0..={PROBABILITY_BASE})"
                    )));
                }
                let p = read_arg(
                    it.next(),
                    0,
                    PROBABILITY_BASE,
                    "Invalid random corrupt argument",
                )?;
                if name == "random_read_corrupt" {
                    f.random_read = p;
                } else {
                    f.random_write = p;
                }
                argc -= 1;
            }
            _ => {
                return Err(TargetError::invalid(format!(
                    "Unrecognised flakey feature requested: '{name}'"
                )))
            }
        }
    }
    check_write_conflicts(&f)?;
    if f.corrupt.is_none()
        && !f.error_reads
        && !f.drop_writes
        && !f.error_writes
        && f.random_read == 0
        && f.random_write == 0
    {
        f.error_reads = true;
        f.error_writes = true;
    }
    Ok(f)
}

/// `error_reads`, `drop_writes`, `error_writes`: each once, the last two
/// not together.
fn set_flag(f: &mut FeatureSet, name: &str) -> Result<(), TargetError> {
    let (flag, other, other_name) = match name {
        "error_reads" => (&mut f.error_reads, false, ""),
        "drop_writes" => (&mut f.drop_writes, f.error_writes, "error_writes"),
        _ => (&mut f.error_writes, f.drop_writes, "drop_writes"),
    };
    if *flag {
        return Err(TargetError::invalid(format!("Feature {name} duplicated")));
    }
    *flag = true;
    if other {
        return Err(TargetError::invalid(format!(
            "Feature {name} conflicts with feature {other_name}"
        )));
    }
    Ok(())
}

/// `corrupt_bio_byte`'s four parameters: `<Nth_byte> <r|w> <value> <flags>`.
fn parse_corrupt_bio_byte(it: &mut std::slice::Iter<'_, &str>) -> Result<Corrupt, TargetError> {
    let byte = read_arg(it.next(), 1, u32::MAX, "Invalid corrupt bio byte")?;
    let dir = match it.next().map(|d| d.to_ascii_lowercase()).as_deref() {
        Some("r") => Dir::Read,
        Some("w") => Dir::Write,
        _ => {
            return Err(TargetError::invalid(
                "Invalid corrupt bio direction (r or w)",
            ))
        }
    };
    let value = read_arg(
        it.next(),
        0,
        255,
        "Invalid corrupt value to write into bio byte (0-255)",
    )? as u8;
    let flags = read_arg(it.next(), 0, u32::MAX, "Invalid corrupt bio flags mask")?;
    Ok(Corrupt {
        byte: byte as u64,
        dir,
        value,
        flags,
    })
}

/// Dropped or failed writes cannot also be corrupted by `corrupt_bio_byte
/// ... w` (dm-flakey refuses the table; `random_write_corrupt` is allowed
/// beside them, and then never applies).
fn check_write_conflicts(f: &FeatureSet) -> Result<(), TargetError> {
    let corrupts_writes = f.corrupt.is_some_and(|c| c.dir == Dir::Write);
    if corrupts_writes && f.drop_writes {
        return Err(TargetError::invalid(
            "drop_writes is incompatible with corrupt_bio_byte with the WRITE flag set",
        ));
    }
    if corrupts_writes && f.error_writes {
        return Err(TargetError::invalid(
            "error_writes is incompatible with corrupt_bio_byte with the WRITE flag set",
        ));
    }
    Ok(())
}

/// The kernel's `bi_opf` of a bio: the op in the low 8 bits, then the
/// `REQ_*` flag bits blkstack has (include/linux/blk_types.h, 6.12), so
/// that a `corrupt_bio_byte` flags mask means what it means to dm-flakey.
fn kernel_opf(bio: &Bio) -> u32 {
    let op = match bio.op {
        Op::Read => 0,
        Op::Write => 1,
        Op::Flush => 2,
        Op::Discard => 3,
        Op::WriteZeroes => 9,
    };
    let bits = [
        (BioFlags::FAILFAST, 9),
        (BioFlags::FUA, 17),
        (BioFlags::PREFLUSH, 18),
        (BioFlags::POLLED, 22),
        (BioFlags::NOUNMAP, 28),
    ];
    bits.iter()
        .filter(|(f, _)| bio.flags.contains(*f))
        .fold(op, |opf, (_, bit)| opf | 1 << bit)
}

impl Flakey {
    fn is_down(&self) -> bool {
        let elapsed_s = (now_ns() - self.start_ns) / 1_000_000_000;
        elapsed_s % (self.up + self.down) >= self.up
    }

    /// No feature given: the kernel then sets both error bits.
    fn fails_reads(&self) -> bool {
        self.error_reads
    }

    fn fails_writes(&self) -> bool {
        self.error_writes
    }

    /// dm-flakey's `all_corrupt_bio_flags_match`.
    fn corrupt_matches(&self, c: &Corrupt, bio: &Bio) -> bool {
        kernel_opf(bio) & c.flags == c.flags
    }

    fn corrupt_data(c: &Corrupt, bio: &Bio) {
        if bio.op.has_data() && c.byte <= bio.len {
            bio.data_mut()[(c.byte - 1) as usize] = c.value;
        }
    }

    /// True with probability `p` out of [`PROBABILITY_BASE`], drawn as the
    /// kernel does (a random u64 modulo the base, below `p`).
    fn roll(p: u32) -> bool {
        p > 0 && rand::random::<u64>() % u64::from(PROBABILITY_BASE) < u64::from(p)
    }

    /// Set a random byte of the bio's data to a random value (kernel
    /// `corrupt_bio_random`).
    fn corrupt_random(bio: &Bio) {
        if !bio.op.has_data() || bio.len == 0 {
            return;
        }
        let at = rand::random::<u64>() % bio.len;
        bio.data_mut()[at as usize] = rand::random::<u8>();
    }

    fn corrupts_reads(&self) -> bool {
        self.corrupt.is_some_and(|c| c.dir == Dir::Read) || self.random_read > 0
    }

    fn remap(&self, mut bio: Bio) {
        bio.offset += self.start * SECTOR_SIZE;
        self.dev.dev.submit(bio);
    }

    /// Which corruptions apply to this bio in `dir`: (fixed byte, random
    /// byte). The random one is rolled here, once per bio.
    fn corruptions(&self, bio: &Bio, dir: Dir) -> (bool, bool) {
        let fixed = self
            .corrupt
            .is_some_and(|c| c.dir == dir && self.corrupt_matches(&c, bio));
        let p = match dir {
            Dir::Read => self.random_read,
            Dir::Write => self.random_write,
        };
        (fixed, Self::roll(p))
    }

    fn apply(&self, bio: &Bio, (fixed, random): (bool, bool)) {
        if let (true, Some(c)) = (fixed, &self.corrupt) {
            Self::corrupt_data(c, bio);
        }
        if random {
            Self::corrupt_random(bio);
        }
    }

    /// A write (or flush, discard) while down.
    fn map_write_down(&self, bio: Bio) {
        if self.drop_writes {
            bio.complete(Status::Ok);
            return;
        }
        if self.fails_writes() {
            bio.complete(Status::IoError);
            return;
        }
        let which = self.corruptions(&bio, Dir::Write);
        if bio.op.has_data() && (which.0 || which.1) {
            self.submit_corrupted_copy(bio, which);
        } else {
            self.remap(bio);
        }
    }

    /// Corrupt a copy of a write and send that down, so the submitter's
    /// buffer keeps what it wrote (the kernel clones the bio's pages for
    /// the same reason: the page cache must not see the corruption).
    fn submit_corrupted_copy(&self, bio: Bio, which: (bool, bool)) {
        let mut copy = AlignedBuf::new(bio.len as usize);
        copy.as_mut_slice().copy_from_slice(bio.data());
        // SAFETY: the copy's heap memory lives in `WriteCopy`, which the
        // clone's completion frame keeps alive until the clone is done,
        // and nothing else touches it meanwhile.
        let buf = unsafe { IoBuf::from_raw(copy.as_mut_slice().as_mut_ptr(), copy.len()) };
        let (op, flags, offset, len) = (bio.op, bio.flags, bio.offset, bio.len);
        let owner = Arc::new(WriteCopy {
            orig: Mutex::new(Some(bio)),
            _copy: copy,
        });
        let clone = Bio::new(op, offset, len, buf, owner, 0).with_flags(flags);
        self.apply(&clone, which);
        self.remap(clone);
    }
}

/// Owns a corrupted write's copy and the original bio, which completes
/// with the copy's status.
struct WriteCopy {
    orig: Mutex<Option<Bio>>,
    _copy: AlignedBuf,
}

impl EndIo for WriteCopy {
    fn end_io(&self, _clone: Bio, status: Status, _private: u64) {
        if let Some(orig) = self.orig.lock().take() {
            orig.complete(status);
        }
    }
}

/// Completion of a read submitted while down: corrupt it as the features
/// say (kernel `flakey_end_io`).
impl EndIo for Flakey {
    fn end_io(&self, bio: Bio, status: Status, _private: u64) {
        if !status.is_ok() {
            bio.complete(status);
            return;
        }
        self.apply(&bio, self.corruptions(&bio, Dir::Read));
        bio.complete(Status::Ok);
    }
}

impl Target for FlakeyTarget {
    fn map(&self, mut bio: Bio) {
        let f = &self.inner;
        if !f.is_down() {
            f.remap(bio);
            return;
        }
        if bio.op != Op::Read {
            f.map_write_down(bio);
            return;
        }
        if f.fails_reads() {
            bio.complete(Status::IoError);
        } else if f.corrupts_reads() {
            bio.push_end(f.clone(), 0);
            f.remap(bio);
        } else {
            f.remap(bio);
        }
    }

    fn table(&self) -> String {
        let f = &self.inner;
        let nfeat = f.error_reads as u32
            + f.drop_writes as u32
            + f.error_writes as u32
            + if f.corrupt.is_some() { 5 } else { 0 }
            + if f.random_read > 0 { 2 } else { 0 }
            + if f.random_write > 0 { 2 } else { 0 };
        let mut s = format!("{} {} {} {} {nfeat}", f.dev, f.start, f.up, f.down);
        if f.error_reads {
            s.push_str(" error_reads");
        }
        if f.drop_writes {
            s.push_str(" drop_writes");
        } else if f.error_writes {
            s.push_str(" error_writes");
        }
        if let Some(c) = f.corrupt {
            let d = if c.dir == Dir::Write { 'w' } else { 'r' };
            s.push_str(&format!(
                " corrupt_bio_byte {} {d} {} {}",
                c.byte, c.value, c.flags
            ));
        }
        if f.random_read > 0 {
            s.push_str(&format!(" random_read_corrupt {}", f.random_read));
        }
        if f.random_write > 0 {
            s.push_str(&format!(" random_write_corrupt {}", f.random_write));
        }
        s
    }

    fn features(&self) -> Features {
        self.inner.dev.dev.features()
    }
}
