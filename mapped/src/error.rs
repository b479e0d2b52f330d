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
        /// The device the table is for, once known (see
        /// [`DmError::in_device`]).
        device: Option<String>,
        /// 1-based number of the line in its table text.
        line: usize,
        /// Boxed: a target's error can be large, a registry result should
        /// not be.
        #[source]
        source: Box<LineError>,
    },
    /// A table with no lines: dm refuses to make a device of nothing.
    #[error("{}empty table: no target lines", device_prefix(device))]
    EmptyTable {
        /// The device the table is for, once known.
        device: Option<String>,
    },
    /// No device has this name (kernel `-ENXIO` from `dm_get_md`).
    #[error("device {0} not found")]
    NoSuchDevice(String),
    /// `create` named a device that exists (kernel `-EBUSY` from
    /// `dm_hash_insert`).
    #[error("device {0} already exists")]
    Exists(String),
    /// The device cannot be removed or shrunk now: it is open, or another
    /// device's table uses it.
    #[error("device {name} is busy: {why}")]
    Busy {
        /// The device refused.
        name: String,
        /// Who holds it: the user reads this.
        why: String,
    },
    /// `create -u` gave a uuid another device has.
    #[error("device {name}: uuid {uuid} is already in use")]
    UuidInUse {
        /// The device being created.
        name: String,
        /// The uuid asked for.
        uuid: String,
    },
    /// `create` asked for a minor number another device has.
    #[error("device {name}: minor {minor} is already in use")]
    MinorInUse {
        /// The device being created.
        name: String,
        /// The minor asked for.
        minor: u32,
    },
    /// A reload, resume or remove would discard data only RAM holds.
    #[error(
        "device {name}: {verb} would discard data held in RAM: {}; {}",
        join_losses(lost),
        force_hint(verb)
    )]
    WouldLoseData {
        /// The device.
        name: String,
        /// The operation refused (`reload`, `resume`, `remove`).
        verb: &'static str,
        /// The lines whose RAM-held data would go.
        lost: Vec<RamLoss>,
    },
    /// The table names, directly or through other devices, the device it
    /// is for.
    #[error("device {name}: table would make a cycle through {through}")]
    Cycle {
        /// The device the table is for.
        name: String,
        /// The device through which the table reaches it again.
        through: String,
    },
    /// dm-ioctl.c `table_load`: the device's queue type or immutable target
    /// does not allow this table.
    #[error("device {name}: {why}")]
    TableType {
        /// The device.
        name: String,
        /// Which rule the table breaks.
        why: String,
    },
    /// A device name dm would not accept.
    #[error(transparent)]
    Name(#[from] NameError),
    /// A `--concise` device list is malformed.
    #[error(transparent)]
    Concise(#[from] ConciseError),
    /// A stack file with no device in it.
    #[error("stack file defines no device")]
    EmptyStack,
    /// `dmsetup message` was refused by the device or its target.
    #[error("{device}: message failed")]
    Message {
        /// The device messaged.
        device: String,
        /// What the target said.
        #[source]
        source: Box<TargetError>,
    },
    /// A target refused to resume (kernel `preresume`, dm-crypt without
    /// a key); the device stays suspended.
    #[error("{device}: resume refused")]
    Resume {
        /// The device resumed.
        device: String,
        /// What the target said.
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

    /// Line `line` of a table is wrong because of `source`; the device is
    /// added by [`DmError::in_device`] once known.
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
    /// Fewer than three words: not a table line (the text is kept).
    #[error("expected '<start> <length> <target> [args...]', got '{0}'")]
    Shape(String),
    /// The start or length is not a sector count.
    #[error("bad {what} '{value}': not a non-negative integer")]
    Number {
        /// Which word (`start`, `length`).
        what: &'static str,
        /// The text given.
        value: String,
    },
    /// A line of length 0 (kernel `dm_table_add_target`: "zero-length
    /// target").
    #[error("zero-length target")]
    ZeroLength,
    /// The line's end does not fit in a sector number.
    #[error("start sector {start} + length {len} overflows u64")]
    Overflow {
        /// The line's first sector.
        start: u64,
        /// Its length in sectors.
        len: u64,
    },
    /// The length in bytes does not fit in u64 (it would wrap to a small
    /// device).
    #[error("length {len} sectors x 512 bytes overflows u64")]
    LengthBytesOverflow {
        /// The length in sectors.
        len: u64,
    },
    /// The device would reach 2^63 bytes, where a signed 64-bit size
    /// (`off_t`, the kernel's `loff_t`, NBD clients' `int64_t`) goes
    /// negative.
    #[error("start sector {start} + length {len} ends at sector {end}, past the device limit of {max} sectors (below 2^63 bytes)")]
    TooLarge {
        /// The line's first sector.
        start: u64,
        /// Its length in sectors.
        len: u64,
        /// The sector it would end at.
        end: u64,
        /// The most sectors a device may have.
        max: u64,
    },
    /// The line starts before the previous one ends (kernel
    /// `dm_table_add_target`'s adjacency check).
    #[error("sectors {start}..{end} overlap line {prev_line}, which ends at {prev_end}")]
    Overlap {
        /// The line's first sector.
        start: u64,
        /// The sector after its last.
        end: u64,
        /// The number of the line it overlaps.
        prev_line: usize,
        /// Where that line ends.
        prev_end: u64,
    },
    /// The first line does not start at sector 0.
    #[error("table must start at sector 0, this line starts at {start}")]
    NotAtZero {
        /// Where it starts.
        start: u64,
    },
    /// The line starts after the previous one ends: sectors no line maps.
    #[error(
        "gap in table: line {prev_line} ends at sector {prev_end}, this line starts at {start}"
    )]
    Gap {
        /// The number of the previous line.
        prev_line: usize,
        /// Where it ends.
        prev_end: u64,
        /// Where this line starts.
        start: u64,
    },
    /// The lines are not in sector order.
    #[error("lines out of order: starts at {start} after a line starting at {prev_start}")]
    OutOfOrder {
        /// Where this line starts.
        start: u64,
        /// Where the line before it starts.
        prev_start: u64,
    },
    /// No target type has this name (kernel `dm_get_target_type` fails).
    #[error("unknown target type '{target}' (known: {known})")]
    UnknownTarget {
        /// The name given.
        target: String,
        /// The known names, comma-separated, for the reader.
        known: String,
    },
    /// The target's constructor refused its arguments.
    #[error("{target}")]
    Target {
        /// The target type's name.
        target: String,
        /// What the constructor refused.
        #[source]
        source: TargetError,
    },
    /// The line names, as an underlying device, the device its table is
    /// for.
    #[error("device {0} cannot use itself")]
    UsesItself(String),
    /// dm-table.c `dm_table_add_target`: a `DM_TARGET_SINGLETON` type
    /// (multipath) must be the only line of its table.
    #[error("target type {target} must appear alone in table")]
    Singleton {
        /// The target type's name.
        target: String,
    },
    /// A stack file in both its forms at once.
    #[error("stack file mixes 'NAME: table line' lines with other text; use one form")]
    MixedStack,
    /// A `NAME: --luks IMAGE KEY_FILE` stack line whose volume does not
    /// open.
    #[error("--luks: {0}")]
    Luks(crate::luks::StackLineError),
    /// A device name in the line dm would not accept.
    #[error(transparent)]
    Name(#[from] NameError),
}

/// A device name dm would not accept in `/dev/mapper/`.
#[derive(Debug, Error)]
pub enum NameError {
    /// The empty name.
    #[error("empty device name")]
    Empty,
    /// Longer than dm's `DM_NAME_LEN` allows.
    #[error("device name '{0}' is longer than 127 characters")]
    TooLong(String),
    /// A name that could not be a file in `/dev/mapper/`.
    #[error("bad device name '{0}': no '/', whitespace or control characters, not '.' or '..'")]
    Bad(String),
}

/// dmsetup's concise format (`name,uuid,minor,flags,table;...`) is wrong.
#[derive(Debug, Error)]
pub enum ConciseError {
    /// A device with fewer than five fields.
    #[error("concise device {which} ('{text}'): expected name,uuid,minor,flags,table[,table...], got {fields} field(s)")]
    Fields {
        /// 1-based position of the device in the list.
        which: usize,
        /// The device's text.
        text: String,
        /// How many comma-separated fields it has.
        fields: usize,
    },
    /// The minor field is neither empty nor a number.
    #[error("concise device {name}: bad minor '{minor}'")]
    Minor {
        /// The device.
        name: String,
        /// The text given.
        minor: String,
    },
    /// The flags field is neither `ro` nor `rw`.
    #[error("concise device {name}: bad flags '{flags}' (expected ro or rw)")]
    Flags {
        /// The device.
        name: String,
        /// The text given.
        flags: String,
    },
    /// The list is empty.
    #[error("concise list names no device")]
    NoDevice,
}

/// What a target's constructor, path selector or `message` refused.
#[derive(Debug, Error)]
pub enum TargetError {
    /// The wrong number of arguments (kernel `ti->error = "Invalid
    /// argument count"`).
    #[error("expected {want} argument(s) '{syntax}', got {got}")]
    ArgCount {
        /// How many it takes (`3`, `at least 2`).
        want: String,
        /// The target's argument syntax, for the reader.
        syntax: &'static str,
        /// How many it got.
        got: usize,
    },
    /// An argument that does not parse as what it should be.
    #[error("invalid {what} '{value}'")]
    InvalidArg {
        /// Which argument.
        what: String,
        /// The text given.
        value: String,
    },
    /// dm's `dm_read_arg` range check.
    #[error("invalid {what} {value}: must be in {min}..={max}")]
    OutOfRange {
        /// Which argument.
        what: String,
        /// The value given.
        value: u64,
        /// The smallest allowed.
        min: u64,
        /// The largest allowed.
        max: u64,
    },
    /// The arguments ended before a required one.
    #[error("missing {0} (the table ends early)")]
    Missing(String),
    /// dm's `dm_read_arg_group`: a count larger than what follows.
    #[error("{what} is {count} but only {left} argument(s) follow")]
    GroupTooLong {
        /// Which count.
        what: String,
        /// Its value.
        count: u32,
        /// Arguments left after it.
        left: usize,
    },
    /// A device argument names no device (kernel `dm_get_device` fails).
    #[error("device '{0}' not found")]
    NoDevice(String),
    /// A device argument's offset plus the line's length overflows.
    #[error("device '{0}': range overflows")]
    RangeOverflows(String),
    /// A device argument is too small for the range the line maps onto
    /// it (kernel `device_area_is_invalid`).
    #[error("device '{arg}' is too small: sectors {start}..{end} needed, it has {has}")]
    DeviceTooSmall {
        /// The device argument as given.
        arg: String,
        /// First sector needed on it.
        start: u64,
        /// The sector after the last needed.
        end: u64,
        /// Sectors it has.
        has: u64,
    },
    /// Where in the arguments the wrapped error happened (`stripe 1`,
    /// `priority group 2`).
    #[error("{context}")]
    In {
        /// Where (`stripe 1`).
        context: String,
        /// What went wrong there.
        #[source]
        source: Box<TargetError>,
    },
    /// The target could not start a worker or open a resource it needs.
    #[error("{what}")]
    Io {
        /// What could not be done.
        what: &'static str,
        /// The system's error.
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
    /// `dmsetup message` with no words.
    #[error("empty message")]
    EmptyMessage,
    /// `dmsetup message` named a sector no line of the table covers.
    #[error("sector {sector} is beyond the end of {device}")]
    MessageSector {
        /// The sector given.
        sector: u64,
        /// The device messaged.
        device: String,
    },
    /// The target takes no message of this name (kernel: "Unsupported
    /// message").
    #[error("message '{0}' not supported by this target")]
    UnsupportedMessage(String),
    /// A message refused with an errno other than EINVAL, as the kernel's
    /// target returns it through the dm ioctl (dm-thin's metadata
    /// messages: EEXIST, ENODATA, EBUSY).
    #[error("{why}")]
    Refused {
        /// The errno class to return.
        errno: Refusal,
        /// The target's message.
        why: String,
    },
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
    /// E2BIG: a size or count past what the target can hold (dm-verity's
    /// "Hash device is too small").
    TooBig,
    /// ENOENT: a named thing that does not exist (dm-verity's unknown
    /// hash algorithm, from `crypto_alloc_ahash`; dm-crypt's crypto API
    /// name with no algorithm behind it).
    NotFound,
    /// ENXIO: the device does not hold what the table says it holds
    /// (dm-snap-persistent.c's "Invalid or corrupt snapshot").
    NoAddress,
    /// EAGAIN: not now (dm-crypt's resume without a key).
    Again,
    /// ENOKEY: a keyring key that is not there (dm-crypt's `:SIZE:logon:`).
    NoKey,
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
