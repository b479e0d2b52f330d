//! Errors of the mapped layer. Every one names what is wrong (the device,
//! the table line, the argument) because a dmsetup user reads them, as the
//! kernel's `ti->error` strings name the argument a constructor refused.
//!
//! Three levels, each wrapping the one below as its `source`:
//! [`DmError`] for registry operations (a device, a line of its table),
//! [`LineError`] for what is wrong with one table line, and
//! [`TargetError`] for what a target's constructor or `message` refused.
//! Printed with its sources (`{:#}` through anyhow, or [`report`]) an error
//! reads `device d: line 2: linear: device 'm9' not found`.

use thiserror::Error;

/// A table line whose RAM-held data a reload or removal would drop
/// (found by the `memory` target, `targets::memory::ram_lost`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RamLoss {
    /// The line as `table` prints it.
    pub line: String,
    /// Bytes it holds (allocated pages).
    pub bytes: u64,
}

impl std::fmt::Display for RamLoss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "'{}' holds {} bytes", self.line, self.bytes)
    }
}

/// A registry operation failed.
#[derive(Debug, Error)]
pub enum DmError {
    /// A table line is wrong: its number, and why as the source.
    #[error("{}line {line}", device_prefix(device))]
    Line {
        device: Option<String>,
        line: usize,
        /// Boxed: a target's error can be large, a registry result should
        /// not be.
        #[source]
        source: Box<LineError>,
    },
    #[error("{}empty table: no target lines", device_prefix(device))]
    EmptyTable { device: Option<String> },
    #[error("device {0} not found")]
    NoSuchDevice(String),
    #[error("device {0} already exists")]
    Exists(String),
    #[error("device {name} is busy: {why}")]
    Busy { name: String, why: String },
    #[error("device {name}: uuid {uuid} is already in use")]
    UuidInUse { name: String, uuid: String },
    #[error("device {name}: minor {minor} is already in use")]
    MinorInUse { name: String, minor: u32 },
    /// A reload, resume or remove would discard data only RAM holds.
    #[error(
        "device {name}: {verb} would discard data held in RAM: {}; {}",
        join_losses(lost),
        force_hint(verb)
    )]
    WouldLoseData {
        name: String,
        verb: &'static str,
        lost: Vec<RamLoss>,
    },
    #[error("device {name}: table would make a cycle through {through}")]
    Cycle { name: String, through: String },
    /// dm-ioctl.c `table_load`: the device's queue type or immutable target
    /// does not allow this table.
    #[error("device {name}: {why}")]
    TableType { name: String, why: String },
    #[error(transparent)]
    Name(#[from] NameError),
    #[error(transparent)]
    Concise(#[from] ConciseError),
    #[error("stack file defines no device")]
    EmptyStack,
    /// `dmsetup message` was refused by the device or its target.
    #[error("{device}: message failed")]
    Message {
        device: String,
        #[source]
        source: Box<TargetError>,
    },
}

fn force_hint(verb: &str) -> &'static str {
    match verb {
        "resume" => "it was written since the reload; reload with --force (or clear) first",
        _ => "use --force to discard it",
    }
}

fn join_losses(lost: &[RamLoss]) -> String {
    lost.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn device_prefix(device: &Option<String>) -> String {
    device
        .as_ref()
        .map(|d| format!("device {d}: "))
        .unwrap_or_default()
}

impl DmError {
    /// This error and its sources on one line, as a user is shown it.
    pub fn report(&self) -> String {
        report(self)
    }

    pub fn line(line: usize, source: LineError) -> DmError {
        DmError::Line {
            device: None,
            line,
            source: Box::new(source),
        }
    }

    /// Attach the device name to a table error (for multi-device input).
    /// Errors that already name their device are returned as they are.
    pub fn in_device(self, name: &str) -> DmError {
        match self {
            DmError::Line {
                device: None,
                line,
                source,
            } => DmError::Line {
                device: Some(name.to_string()),
                line,
                source,
            },
            DmError::EmptyTable { device: None } => DmError::EmptyTable {
                device: Some(name.to_string()),
            },
            e => e,
        }
    }
}

/// What is wrong with one table line.
#[derive(Debug, Error)]
pub enum LineError {
    #[error("expected '<start> <length> <target> [args...]', got '{0}'")]
    Shape(String),
    #[error("bad {what} '{value}': not a non-negative integer")]
    Number { what: &'static str, value: String },
    #[error("zero-length target")]
    ZeroLength,
    #[error("start sector {start} + length {len} overflows u64")]
    Overflow { start: u64, len: u64 },
    /// The length in bytes does not fit in u64 (it would wrap to a small
    /// device).
    #[error("length {len} sectors x 512 bytes overflows u64")]
    LengthBytesOverflow { len: u64 },
    /// The device would reach 2^63 bytes, where a signed 64-bit size
    /// (`off_t`, the kernel's `loff_t`, NBD clients' `int64_t`) goes
    /// negative.
    #[error("start sector {start} + length {len} ends at sector {end}, past the device limit of {max} sectors (below 2^63 bytes)")]
    TooLarge {
        start: u64,
        len: u64,
        end: u64,
        max: u64,
    },
    #[error("sectors {start}..{end} overlap line {prev_line}, which ends at {prev_end}")]
    Overlap {
        start: u64,
        end: u64,
        prev_line: usize,
        prev_end: u64,
    },
    #[error("table must start at sector 0, this line starts at {start}")]
    NotAtZero { start: u64 },
    #[error(
        "gap in table: line {prev_line} ends at sector {prev_end}, this line starts at {start}"
    )]
    Gap {
        prev_line: usize,
        prev_end: u64,
        start: u64,
    },
    #[error("lines out of order: starts at {start} after a line starting at {prev_start}")]
    OutOfOrder { start: u64, prev_start: u64 },
    #[error("unknown target type '{target}' (known: {known})")]
    UnknownTarget { target: String, known: String },
    /// The target's constructor refused its arguments.
    #[error("{target}")]
    Target {
        target: String,
        #[source]
        source: TargetError,
    },
    #[error("device {0} cannot use itself")]
    UsesItself(String),
    /// dm-table.c `dm_table_add_target`: a `DM_TARGET_SINGLETON` type
    /// (multipath) must be the only line of its table.
    #[error("target type {target} must appear alone in table")]
    Singleton { target: String },
    #[error("stack file mixes 'NAME: table line' lines with other text; use one form")]
    MixedStack,
    #[error(transparent)]
    Name(#[from] NameError),
}

/// A device name dm would not accept in `/dev/mapper/`.
#[derive(Debug, Error)]
pub enum NameError {
    #[error("empty device name")]
    Empty,
    #[error("device name '{0}' is longer than 127 characters")]
    TooLong(String),
    #[error("bad device name '{0}': no '/', whitespace or control characters, not '.' or '..'")]
    Bad(String),
}

/// dmsetup's concise format (`name,uuid,minor,flags,table;...`) is wrong.
#[derive(Debug, Error)]
pub enum ConciseError {
    #[error("concise device {which} ('{text}'): expected name,uuid,minor,flags,table[,table...], got {fields} field(s)")]
    Fields {
        which: usize,
        text: String,
        fields: usize,
    },
    #[error("concise device {name}: bad minor '{minor}'")]
    Minor { name: String, minor: String },
    #[error("concise device {name}: bad flags '{flags}' (expected ro or rw)")]
    Flags { name: String, flags: String },
    #[error("concise list names no device")]
    NoDevice,
}

/// What a target's constructor, path selector or `message` refused.
#[derive(Debug, Error)]
pub enum TargetError {
    #[error("expected {want} argument(s) '{syntax}', got {got}")]
    ArgCount {
        want: String,
        syntax: &'static str,
        got: usize,
    },
    #[error("invalid {what} '{value}'")]
    InvalidArg { what: String, value: String },
    /// dm's `dm_read_arg` range check.
    #[error("invalid {what} {value}: must be in {min}..={max}")]
    OutOfRange {
        what: String,
        value: u64,
        min: u64,
        max: u64,
    },
    /// The arguments ended before a required one.
    #[error("missing {0} (the table ends early)")]
    Missing(String),
    /// dm's `dm_read_arg_group`: a count larger than what follows.
    #[error("{what} is {count} but only {left} argument(s) follow")]
    GroupTooLong {
        what: String,
        count: u32,
        left: usize,
    },
    #[error("device '{0}' not found")]
    NoDevice(String),
    #[error("device '{0}': range overflows")]
    RangeOverflows(String),
    #[error("device '{arg}' is too small: sectors {start}..{end} needed, it has {has}")]
    DeviceTooSmall {
        arg: String,
        start: u64,
        end: u64,
        has: u64,
    },
    /// Where in the arguments the wrapped error happened (`stripe 1`,
    /// `priority group 2`).
    #[error("{context}")]
    In {
        context: String,
        #[source]
        source: Box<TargetError>,
    },
    /// The target could not start a worker or open a resource it needs.
    #[error("{what}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A leaf driver refused its arguments or could not start (each
    /// driver's own typed error, which names the driver).
    #[error(transparent)]
    Driver(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// A rule of one target broken, the message says which argument and
    /// why: the kernel's per-target `ti->error` strings.
    #[error("{0}")]
    Invalid(String),
    /// dm-mpath's `setup_scsi_dh`: a hardware handler cannot attach to a
    /// device that is not SCSI (the kernel's `scsi_dh_attach` gives
    /// -ENODEV), and no blkstack device is.
    #[error(
        "error attaching hardware handler '{0}': blkstack devices have no SCSI device handlers"
    )]
    HwHandler(String),
    #[error("empty message")]
    EmptyMessage,
    #[error("sector {sector} is beyond the end of {device}")]
    MessageSector { sector: u64, device: String },
    #[error("message '{0}' not supported by this target")]
    UnsupportedMessage(String),
    /// A message refused with an errno other than EINVAL, as the kernel's
    /// target returns it through the dm ioctl (dm-thin's metadata
    /// messages: EEXIST, ENODATA, EBUSY).
    #[error("{why}")]
    Refused { errno: Refusal, why: String },
}

/// Why a [`TargetError::Refused`] message was refused, by the errno the
/// kernel returns for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// EEXIST: the thing to create is there already.
    Exists,
    /// ENODATA: the thing named is not there.
    NoData,
    /// EBUSY: it is in use.
    Busy,
}

impl TargetError {
    /// This error and its sources on one line, as a user is shown it.
    pub fn report(&self) -> String {
        report(self)
    }

    /// A leaf driver's own error (its arguments, or a queue or connection
    /// it could not start).
    pub fn driver(e: impl std::error::Error + Send + Sync + 'static) -> TargetError {
        TargetError::Driver(Box::new(e))
    }

    /// A target-specific rule broken; `msg` names the argument and the rule.
    pub fn invalid(msg: impl Into<String>) -> TargetError {
        TargetError::Invalid(msg.into())
    }

    /// Say where in the arguments this error happened.
    pub fn within(self, context: impl Into<String>) -> TargetError {
        TargetError::In {
            context: context.into(),
            source: Box::new(self),
        }
    }
}

/// An error and its sources on one line, joined by `: ` as anyhow's `{:#}`
/// prints them: what a user is shown. A source whose text its wrapper
/// already ends with (some errors print their source too) is not
/// repeated.
pub fn report(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        let text = inner.to_string();
        if !s.ends_with(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_joins_the_sources_as_a_user_reads_them() {
        let e = DmError::line(
            2,
            LineError::Target {
                target: "striped".into(),
                source: TargetError::NoDevice("m9".into()).within("stripe 1"),
            },
        )
        .in_device("d");
        assert_eq!(
            report(&e),
            "device d: line 2: striped: stripe 1: device 'm9' not found"
        );
        assert_eq!(
            report(&DmError::EmptyTable { device: None }.in_device("x")),
            "device x: empty table: no target lines"
        );
        // A wrapper that prints its source already is not repeated.
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let shown = format!("cannot open x: {io}");
        let e = TargetError::Io {
            what: "cannot open x: entity not found",
            source: io,
        };
        assert_eq!(report(&e), shown);
    }
}
