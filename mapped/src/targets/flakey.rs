//! `flakey <dev> <offset> <up interval> <down interval> [<#feature args>
//! [<arg>]...]`: a device that is up for `up` seconds, then misbehaves for
//! `down` seconds, repeatedly (kernel dm-flakey.c, target version 1.5).
//!
//! While down, by default every I/O fails. Features change that:
//! `drop_writes` (writes succeed but are dropped; reads pass),
//! `error_writes` (writes fail; reads pass), and
//! `corrupt_bio_byte <Nth_byte> <r|w> <value> <flags>` (the Nth byte, from
//! 1, of matching reads or writes is overwritten with `value`; `flags` is a
//! mask of blkstack's bio flag bits — FUA=1, PREFLUSH=2 — that must all be
//! set, 0 for any bio). Intervals are whole seconds as in dm, timed from
//! construction on the monotonic clock.

use crate::error::TargetError;
use crate::target::{parse_arg, CtrContext, DevArg, Target, TargetRef, TargetType};
use blkstack_core::clock::now_ns;
use blkstack_core::{Bio, EndIo, Features, Op, Status, SECTOR_SIZE};
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

struct Flakey {
    dev: DevArg,
    start: u64,
    up: u64,
    down: u64,
    drop_writes: bool,
    error_writes: bool,
    corrupt: Option<Corrupt>,
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
        drop_writes: false,
        error_writes: false,
        corrupt: None,
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
    if n > 6 {
        return Err(TargetError::invalid(format!(
            "invalid number of feature args {n} (at most 6)"
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
                if rest.len() < i + 5 {
                    return Err(TargetError::invalid("feature corrupt_bio_byte requires parameters <Nth_byte> <r|w> <value> <flags>"));
                }
                let byte: u32 = parse_arg("corrupt bio byte", rest[i + 1])?;
                if byte == 0 {
                    return Err(TargetError::invalid(
                        "invalid corrupt bio byte 0 (bytes count from 1)",
                    ));
                }
                let dir = match rest[i + 2].to_ascii_lowercase().as_str() {
                    "r" => Dir::Read,
                    "w" => Dir::Write,
                    d => {
                        return Err(TargetError::invalid(format!(
                            "invalid corrupt bio direction '{d}' (r or w)"
                        )))
                    }
                };
                let value: u8 =
                    parse_arg("corrupt value to write into bio byte (0-255)", rest[i + 3])?;
                let flags: u8 = parse_arg("corrupt bio flags mask", rest[i + 4])?;
                f.corrupt = Some(Corrupt {
                    byte: byte as u64,
                    dir,
                    value,
                    flags,
                });
                i += 5;
            }
            other => {
                return Err(TargetError::invalid(format!(
                    "unrecognised flakey feature '{other}'"
                )))
            }
        }
    }
    if let Some(c) = f.corrupt {
        if c.dir == Dir::Write && f.drop_writes {
            return Err(TargetError::invalid(
                "drop_writes is incompatible with corrupt_bio_byte with the WRITE flag set",
            ));
        }
        if c.dir == Dir::Write && f.error_writes {
            return Err(TargetError::invalid(
                "error_writes is incompatible with corrupt_bio_byte with the WRITE flag set",
            ));
        }
    }
    Ok(())
}

impl Flakey {
    fn is_down(&self) -> bool {
        let elapsed_s = (now_ns() - self.start_ns) / 1_000_000_000;
        elapsed_s % (self.up + self.down) >= self.up
    }

    fn corrupt_matches(&self, c: &Corrupt, bio: &Bio) -> bool {
        bio.flags.bits() & c.flags == c.flags
    }

    fn corrupt_data(c: &Corrupt, bio: &Bio) {
        if bio.op.has_data() && c.byte <= bio.len {
            bio.data_mut()[(c.byte - 1) as usize] = c.value;
        }
    }

    fn remap(&self, mut bio: Bio) {
        bio.offset += self.start * SECTOR_SIZE;
        self.dev.dev.submit(bio);
    }
}

/// Completion of a read submitted while down: corrupt it or fail it.
impl EndIo for Flakey {
    fn end_io(&self, bio: Bio, status: Status, _private: u64) {
        if !status.is_ok() {
            bio.complete(status);
            return;
        }
        if let Some(c) = &self.corrupt {
            if c.dir == Dir::Read && self.corrupt_matches(c, &bio) {
                Self::corrupt_data(c, &bio);
            }
            bio.complete(Status::Ok);
        } else if !self.drop_writes && !self.error_writes {
            bio.complete(Status::IoError);
        } else {
            bio.complete(Status::Ok);
        }
    }
}

impl Target for FlakeyTarget {
    fn map(&self, mut bio: Bio) {
        let f = &self.inner;
        if !f.is_down() {
            f.remap(bio);
            return;
        }
        if bio.op == Op::Read {
            if f.corrupt.is_none() && !f.drop_writes && !f.error_writes {
                bio.complete(Status::IoError);
                return;
            }
            bio.push_end(f.clone(), 0);
            f.remap(bio);
            return;
        }
        if f.drop_writes {
            bio.complete(Status::Ok);
        } else if f.error_writes {
            bio.complete(Status::IoError);
        } else if let Some(c) = &f.corrupt {
            if c.dir == Dir::Write && f.corrupt_matches(c, &bio) {
                Flakey::corrupt_data(c, &bio);
            }
            f.remap(bio);
        } else {
            bio.complete(Status::IoError);
        }
    }

    fn table(&self) -> String {
        let f = &self.inner;
        let nfeat =
            f.drop_writes as u32 + f.error_writes as u32 + if f.corrupt.is_some() { 5 } else { 0 };
        let mut s = format!("{} {} {} {} {nfeat}", f.dev, f.start, f.up, f.down);
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
        s
    }

    fn features(&self) -> Features {
        self.inner.dev.dev.features()
    }
}
