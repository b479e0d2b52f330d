//! The shape every target has, after the kernel's `struct target_type`.
//!
//! A target type is a name and a constructor (`ctr`); a constructed target
//! maps bios, and reports `status` (STATUSTYPE_INFO), `table`
//! (STATUSTYPE_TABLE) and answers `message`s. Targets that need to see a
//! completion (`end_io` in dm) push an `EndIo` frame on the bio in `map`.
//! Suspend hooks follow dm's presuspend/postsuspend/resume.
//!
//! `map` receives the bio with `offset` relative to the target's first
//! byte, as `dm_target_offset()` gives it, so a target never needs to know
//! where in the table it sits.

use crate::error::TargetError;
use blkstack_core::device::Extent;
use blkstack_core::{Bio, Device, DeviceRef, Features, QueueShape, SECTOR_SIZE};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The device-mapper major number, used to print device references the way
/// `dmsetup table` does (`253:MINOR`).
pub const DM_MAJOR: u32 = 253;

/// A target: the code behind one table line (kernel `struct target_type`'s
/// methods with the target's private state, `ti->private`). It maps each
/// bio of its sector range, and answers `status`, `message` and the
/// suspend/resume hooks of the device it belongs to.
pub trait Target: Send + Sync {
    /// Handle a bio whose offset is relative to the target's start. The
    /// target owns it: submit it (remapped) to a lower device, queue it, or
    /// complete it.
    fn map(&self, bio: Bio);

    /// Map several bios at once (a plugged batch handed down by the mapped
    /// device); `bios` is left empty. One by one unless the target can
    /// pass the batch on.
    fn map_batch(&self, bios: &mut Vec<Bio>) {
        for bio in bios.drain(..) {
            self.map(bio);
        }
    }

    /// `dmsetup status` text after `start length name ` (may be empty).
    fn status(&self) -> String {
        String::new()
    }

    /// `dmsetup table` arguments after `start length name `: parsing them
    /// again must build the same target.
    fn table(&self) -> String;

    /// `dmsetup message`: `args` are the words after the sector.
    fn message(&self, args: &[&str]) -> Result<String, TargetError> {
        Err(TargetError::UnsupportedMessage(args.join(" ")))
    }

    /// Before suspend stops I/O (dm-delay flushes its queue here).
    fn presuspend(&self) {}

    /// After in-flight I/O has drained.
    fn postsuspend(&self) {}

    /// Before the device resumes with this target live: an error keeps it
    /// suspended (kernel `preresume`; dm-crypt refuses without a key).
    fn preresume(&self) -> Result<(), TargetError> {
        Ok(())
    }

    /// When the device resumes with this target live.
    fn resume(&self) {}

    /// What the target can do (flush, FUA, discard, ...); the device offers
    /// what every line of its table offers ([`Features::intersect`]).
    fn features(&self) -> Features {
        Features::default()
    }

    /// The tag set of a target that is itself a leaf driver; targets
    /// over other devices leave it to the table, which takes the widest
    /// of the devices they opened.
    fn queue_shape(&self) -> Option<QueueShape> {
        None
    }

    /// The smallest I/O unit this target accepts, in bytes (the
    /// `logical_block_size` its `io_hints` sets: dm-crypt's
    /// `sector_size`); the mapped device offers the largest of its lines'.
    fn logical_block_size(&self) -> u32 {
        512
    }

    /// Data/hole map, target-relative, if known.
    fn extents(&self, _offset: u64, _len: u64) -> Option<Vec<Extent>> {
        None
    }

    /// The largest bio `map` accepts starting at this target-relative
    /// offset, in bytes (dm's `max_io_len`); the mapped device splits
    /// larger ones. `u64::MAX` for no limit.
    fn max_io_len(&self, _offset: u64) -> u64 {
        u64::MAX
    }

    /// [`Target::max_io_len`] for a discard: a target that frees whole
    /// units takes a discard across many of them at once (dm's
    /// `max_discard_sectors` with `ti->max_discard_granularity`).
    fn max_discard_len(&self, offset: u64) -> u64 {
        self.max_io_len(offset)
    }

    /// Give `f` each device this target sends
    /// [`blkstack_core::BioFlags::POLLED`] bios straight to (the polling
    /// side of dm's `iterate_devices`, as `dm_table_supports_poll` and
    /// `dm_poll_bio` use it): the mapped device polls those devices. A
    /// target that gives none cannot poll, and the mapped device clears
    /// the flag of the bios it maps to it (kernel `bio_clear_polled`), so
    /// a polled bio never waits below a layer that would not poll it; one
    /// that gives some must pass every polled bio to one of them.
    fn poll_devices<'a>(&'a self, _f: &mut dyn FnMut(&'a dyn Device)) {}

    /// Let a submitter with an event loop of its own complete, on its own
    /// thread, the bios this target holds and sends on from a thread of
    /// its own (see [`blkstack_core::Reaper`]; `delay` offers one). The
    /// mapped device of a one-line table asks its line first, then the
    /// device below ([`Device::reaper`]). `None` (the default) for a
    /// target that holds nothing on a thread.
    fn reaper(&self) -> Option<Box<dyn blkstack_core::Reaper>> {
        None
    }
}

/// A shared handle to a built target, as a table holds it.
pub type TargetRef = Arc<dyn Target>;

/// A mapped device's event counter, which its targets raise (kernel
/// `dm_table_event`: a thin-pool reaching its low water mark, changing
/// mode) and its table swaps count in too; `dmsetup info` shows it as
/// the event number.
#[derive(Clone, Debug, Default)]
pub struct Events(Arc<AtomicU64>);

impl Events {
    /// Count one event (kernel `dm_table_event`).
    pub fn raise(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    /// Events raised so far: the event number `dmsetup info` shows.
    pub fn count(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A device argument of a table line, resolved.
#[derive(Clone)]
pub struct DevArg {
    /// The device's name in the registry.
    pub name: String,
    /// Its minor number, for printing the argument as `253:MINOR`.
    pub minor: u32,
    /// The device itself, for the target to submit to.
    pub dev: DeviceRef,
}

impl fmt::Display for DevArg {
    /// `MAJOR:MINOR`, as `dmsetup table` prints device arguments.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{DM_MAJOR}:{}", self.minor)
    }
}

impl fmt::Debug for DevArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({DM_MAJOR}:{})", self.name, self.minor)
    }
}

/// Resolves a device argument to (registry name, minor, device).
pub type DeviceLookup<'a> = &'a dyn Fn(&str) -> Option<(String, u32, DeviceRef)>;

/// Resolves a device argument to the target of its live table's first
/// line (kernel `dm_get_md` + `dm_get_live_table`).
pub type TargetLookup<'a> = &'a dyn Fn(&str) -> Option<TargetRef>;

/// What a constructor may ask of the world: its place in the table and
/// the devices it refers to (kernel `dm_get_device`).
pub struct CtrContext<'a> {
    /// Start of the line, in sectors.
    pub begin: u64,
    /// Length of the line, in sectors.
    pub len: u64,
    /// The name of the device being built (for worker thread names).
    pub device_name: &'a str,
    /// On a reload, the live table's target on the line starting at the
    /// same sector with the same target type (a `thin-pool` reload keeps
    /// its pool, as dm-thin.c's `__pool_find` does; a `memory` line its
    /// pages).
    pub live_target: Option<TargetRef>,
    /// The events of the device the table is for, for a target to raise.
    pub events: Events,
    /// Whether the table replaces a live one (a reload, made live by a
    /// later resume) rather than making a new device (dm's create, whose
    /// load and resume are one step here, so a target's work that starts
    /// at resume starts when its constructor returns).
    pub reloading: bool,
    lookup: DeviceLookup<'a>,
    target_lookup: Option<TargetLookup<'a>>,
    used: Vec<String>,
    /// The devices behind `used` (dm's `dm_table.devices`, filled by
    /// `dm_get_device`).
    used_devs: Vec<DeviceRef>,
}

impl<'a> CtrContext<'a> {
    /// The context for constructing the line at sector `begin` of `len`
    /// sectors in device `device_name`, resolving device arguments through
    /// `lookup` (kernel `dm_table_add_target` filling `struct dm_target`).
    pub fn new(begin: u64, len: u64, device_name: &'a str, lookup: DeviceLookup<'a>) -> Self {
        CtrContext {
            begin,
            len,
            device_name,
            live_target: None,
            events: Events::default(),
            reloading: false,
            lookup,
            target_lookup: None,
            used: Vec::new(),
            used_devs: Vec::new(),
        }
    }

    /// Let [`CtrContext::live_target_of`] resolve devices.
    pub fn with_target_lookup(mut self, f: TargetLookup<'a>) -> Self {
        self.target_lookup = Some(f);
        self
    }

    /// The target of the live table of the device `arg` names (its first
    /// line), if it has one.
    pub fn live_target_of(&self, arg: &str) -> Option<TargetRef> {
        self.target_lookup.and_then(|f| f(arg))
    }

    /// Length of the line in bytes (the size of a leaf device).
    pub fn len_bytes(&self) -> u64 {
        self.len * SECTOR_SIZE
    }

    /// Resolve `NAME`, `/dev/mapper/NAME` or `253:MINOR`, and check that
    /// `start_sector..start_sector+len_sectors` lies inside it (dm's
    /// `device_area_is_invalid`).
    pub fn get_device(
        &mut self,
        arg: &str,
        start_sector: u64,
        len_sectors: u64,
    ) -> Result<DevArg, TargetError> {
        let (name, minor, dev) =
            (self.lookup)(arg).ok_or_else(|| TargetError::NoDevice(arg.to_string()))?;
        let dev_sectors = dev.size() / SECTOR_SIZE;
        let end = start_sector
            .checked_add(len_sectors)
            .ok_or_else(|| TargetError::RangeOverflows(arg.to_string()))?;
        if end > dev_sectors {
            return Err(TargetError::DeviceTooSmall {
                arg: arg.to_string(),
                start: start_sector,
                end,
                has: dev_sectors,
            });
        }
        if !self.used.contains(&name) {
            self.used.push(name.clone());
            self.used_devs.push(dev.clone());
        }
        Ok(DevArg { name, minor, dev })
    }

    /// The names of the devices this line's target opened.
    pub fn take_used(&mut self) -> Vec<String> {
        std::mem::take(&mut self.used)
    }

    /// The devices this line's target opened, in the order of
    /// [`CtrContext::take_used`]'s names.
    pub fn take_used_devices(&mut self) -> Vec<DeviceRef> {
        std::mem::take(&mut self.used_devs)
    }
}

/// A target type: the name used in tables and its constructor.
pub struct TargetType {
    /// The name tables use (kernel `target_type->name`).
    pub name: &'static str,
    /// dm's target version triple, shown by `dmsetup targets`.
    pub version: [u32; 3],
    /// The constructor: builds a target from its arguments or says why not,
    /// naming the argument (kernel `target_type->ctr` and `ti->error`).
    pub ctr: fn(&mut CtrContext<'_>, &[&str]) -> Result<TargetRef, TargetError>,
}

/// The data/hole map of `offset..offset+len` on a device that a target
/// maps onto from sector `start_sector`, made target-relative again.
pub fn extents_from(dev: &DevArg, start_sector: u64, offset: u64, len: u64) -> Option<Vec<Extent>> {
    let base = start_sector * SECTOR_SIZE;
    dev.dev.extents(offset + base, len).map(|v| {
        v.into_iter()
            .map(|e| Extent {
                offset: e.offset - base,
                ..e
            })
            .collect()
    })
}

/// Parse a number argument, naming it in the error.
pub fn parse_arg<T: std::str::FromStr>(what: &str, s: &str) -> Result<T, TargetError> {
    s.parse::<T>().map_err(|_| TargetError::InvalidArg {
        what: what.to_string(),
        value: s.to_string(),
    })
}

/// Parse a number the way the kernel's `sscanf(s, "%u%c")` /
/// `"%llu%c"` takes it in a constructor: decimal digits only, no sign
/// (`+5` is refused where `str::parse` would take it). A value too large
/// for `T` is refused; the kernel's sscanf wraps it silently (see
/// docs/KERNEL-PARITY.md).
pub fn parse_sscanf<T: std::str::FromStr>(what: &str, s: &str) -> Result<T, TargetError> {
    if !s.bytes().next().is_some_and(|b| b.is_ascii_digit()) {
        return Err(TargetError::InvalidArg {
            what: what.to_string(),
            value: s.to_string(),
        });
    }
    parse_arg(what, s)
}

/// Check an exact argument count, naming the expected syntax.
pub fn expect_args(
    args: &[&str],
    counts: &[usize],
    syntax: &'static str,
) -> Result<(), TargetError> {
    if counts.contains(&args.len()) {
        Ok(())
    } else {
        let want = counts
            .iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(" or ");
        Err(TargetError::ArgCount {
            want,
            syntax,
            got: args.len(),
        })
    }
}
