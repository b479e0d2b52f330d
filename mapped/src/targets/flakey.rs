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
//!   `flags` is a mask of blkstack's bio flag bits — FUA=1, PREFLUSH=2 —
//!   that must all be set, 0 for any bio),
//! - `random_read_corrupt <p>` / `random_write_corrupt <p>` (a random byte
//!   of a read or write is set to a random value with probability
//!   `p`/1000000000, upstream "dm flakey: introduce random_read_corrupt and
//!   random_write_corrupt options").
//!
//! A corrupted write goes down as a corrupted copy, the submitter's buffer
//! untouched, as the kernel clones the bio's pages for it.
//!
//! With none of error_reads, drop_writes, error_writes, corrupt_bio_byte or
//! the random corruptions, reads and writes both fail, as the kernel sets
//! both error bits then (without printing them in the table). Intervals
//! are whole seconds as in dm, timed from construction on the monotonic
//! clock.

use crate::error::TargetError;
use crate::target::{parse_arg, CtrContext, DevArg, Target, TargetRef, TargetType};
use blkstack_core::clock::now_ns;
use blkstack_core::{AlignedBuf, Bio, EndIo, Features, IoBuf, Op, Status, SECTOR_SIZE};
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
    flags: u8,
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
    let start: u64 = parse_arg("device sector", args[1])?;
    let up: u32 = parse_arg("up interval", args[2])?;
    let down: u32 = parse_arg("down interval", args[3])?;
    if up as u64 + down as u64 == 0 {
        return Err(TargetError::invalid("total (up + down) interval is zero"));
    }
    let mut f = Flakey {
        dev: ctx.get_device(args[0], start, ctx.len)?,
        start,
        up: up as u64,
        down: down as u64,
        error_reads: false,
        drop_writes: false,
        error_writes: false,
        corrupt: None,
        random_read: 0,
        random_write: 0,
        start_ns: now_ns(),
    };
    parse_features(&mut f, &args[4..])?;
    Ok(Arc::new(FlakeyTarget { inner: Arc::new(f) }))
}

fn parse_features(f: &mut Flakey, args: &[&str]) -> Result<(), TargetError> {
    let Some((count, rest)) = args.split_first() else {
        return Ok(());
    };
    let n: usize = parse_arg("number of feature args", count)?;
    if n > 11 {
        return Err(TargetError::invalid(format!(
            "invalid number of feature args {n} (at most 11)"
        )));
    }
    if rest.len() != n {
        return Err(TargetError::invalid(format!(
            "{n} feature args declared, {} given",
            rest.len()
        )));
    }
    let mut i = 0;
    while i < rest.len() {
        match rest[i].to_ascii_lowercase().as_str() {
            "error_reads" => {
                if f.error_reads {
                    return Err(TargetError::invalid("feature error_reads duplicated"));
                }
                f.error_reads = true;
                i += 1;
            }
            name @ ("random_read_corrupt" | "random_write_corrupt") => {
                let p = parse_probability(name, rest.get(i + 1))?;
                if name == "random_read_corrupt" {
                    f.random_read = p;
                } else {
                    f.random_write = p;
                }
                i += 2;
            }
            "drop_writes" => {
                if f.drop_writes {
                    return Err(TargetError::invalid("feature drop_writes duplicated"));
                }
                if f.error_writes {
                    return Err(TargetError::invalid(
                        "feature drop_writes conflicts with feature error_writes",
                    ));
                }
                f.drop_writes = true;
                i += 1;
            }
            "error_writes" => {
                if f.error_writes {
                    return Err(TargetError::invalid("feature error_writes duplicated"));
                }
                if f.drop_writes {
                    return Err(TargetError::invalid(
                        "feature error_writes conflicts with feature drop_writes",
                    ));
                }
                f.error_writes = true;
                i += 1;
            }
            "corrupt_bio_byte" => {
                f.corrupt = Some(parse_corrupt_bio_byte(&rest[i + 1..])?);
                i += 5;
            }
            other => {
                return Err(TargetError::invalid(format!(
                    "unrecognised flakey feature '{other}'"
                )))
            }
        }
    }
    check_write_conflicts(f)
}

/// `random_*_corrupt <probability>`: out of [`PROBABILITY_BASE`].
fn parse_probability(name: &str, arg: Option<&&str>) -> Result<u32, TargetError> {
    let Some(arg) = arg else {
        return Err(TargetError::invalid(format!(
            "feature {name} requires a parameter <probability> (0..={PROBABILITY_BASE})"
        )));
    };
    let p: u32 = parse_arg("random corrupt argument", arg)?;
    if p > PROBABILITY_BASE {
        return Err(TargetError::invalid(format!(
            "invalid random corrupt argument {p} (0..={PROBABILITY_BASE})"
        )));
    }
    Ok(p)
}

/// `corrupt_bio_byte`'s four parameters: `<Nth_byte> <r|w> <value> <flags>`.
fn parse_corrupt_bio_byte(args: &[&str]) -> Result<Corrupt, TargetError> {
    if args.len() < 4 {
        return Err(TargetError::invalid(
            "feature corrupt_bio_byte requires parameters <Nth_byte> <r|w> <value> <flags>",
        ));
    }
    let byte: u32 = parse_arg("corrupt bio byte", args[0])?;
    if byte == 0 {
        return Err(TargetError::invalid(
            "invalid corrupt bio byte 0 (bytes count from 1)",
        ));
    }
    let dir = match args[1].to_ascii_lowercase().as_str() {
        "r" => Dir::Read,
        "w" => Dir::Write,
        d => {
            return Err(TargetError::invalid(format!(
                "invalid corrupt bio direction '{d}' (r or w)"
            )))
        }
    };
    let value: u8 = parse_arg("corrupt value to write into bio byte (0-255)", args[2])?;
    let flags: u8 = parse_arg("corrupt bio flags mask", args[3])?;
    Ok(Corrupt {
        byte: byte as u64,
        dir,
        value,
        flags,
    })
}

/// Dropped or failed writes cannot also be corrupted (dm-flakey refuses
/// the table).
fn check_write_conflicts(f: &Flakey) -> Result<(), TargetError> {
    let corrupts_writes = f.corrupt.is_some_and(|c| c.dir == Dir::Write) || f.random_write > 0;
    if corrupts_writes && f.drop_writes {
        return Err(TargetError::invalid(
            "drop_writes is incompatible with random_write_corrupt or corrupt_bio_byte with the WRITE flag set",
        ));
    }
    if corrupts_writes && f.error_writes {
        return Err(TargetError::invalid(
            "error_writes is incompatible with random_write_corrupt or corrupt_bio_byte with the WRITE flag set",
        ));
    }
    Ok(())
}

impl Flakey {
    fn is_down(&self) -> bool {
        let elapsed_s = (now_ns() - self.start_ns) / 1_000_000_000;
        elapsed_s % (self.up + self.down) >= self.up
    }

    /// No feature given: the kernel then sets both error bits.
    fn no_features(&self) -> bool {
        !self.error_reads
            && !self.drop_writes
            && !self.error_writes
            && self.corrupt.is_none()
            && self.random_read == 0
            && self.random_write == 0
    }

    fn fails_reads(&self) -> bool {
        self.error_reads || self.no_features()
    }

    fn fails_writes(&self) -> bool {
        self.error_writes || self.no_features()
    }

    fn corrupt_matches(&self, c: &Corrupt, bio: &Bio) -> bool {
        bio.flags.bits() & c.flags == c.flags
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
