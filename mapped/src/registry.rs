//! The registry of named devices, device-mapper's control interface as a
//! library: create, reload, suspend, resume, remove, message, and the
//! `table`/`status`/`info`/`ls` views.
//!
//! Every change is all or nothing: a batch of devices (a stack file, a
//! concise list) is built completely, every constructor run, before any of
//! it becomes visible; a failed reload leaves the live and staged tables
//! as they were. Devices refer to each other by name, `/dev/mapper/NAME` or
//! `253:MINOR`; a device used by another cannot be removed, and a reload
//! that would make a device use itself (directly or through others) is
//! refused.

use crate::device::MappedDevice;
use crate::error::{DmError, LineError};
use crate::table::{Table, TableEntry};
use crate::table_text::{parse_concise, parse_stack, parse_table, DeviceSpec};
use crate::target::{CtrContext, Events, TargetRef, DM_MAJOR};
use crate::targets;
use crate::targets::memory::ram_lost;
use blkstack_core::{Device, DeviceRef};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;

/// What `dmsetup info` shows for a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's name.
    pub name: String,
    /// Its uuid, if it has one.
    pub uuid: Option<String>,
    /// Its major number: always [`crate::target::DM_MAJOR`].
    pub major: u32,
    /// Its minor number.
    pub minor: u32,
    /// Whether it is suspended ("State: SUSPENDED").
    pub suspended: bool,
    /// Whether it refuses writes.
    pub read_only: bool,
    /// Whether it has a live table ("Tables present: LIVE").
    pub live_table: bool,
    /// Whether a reload staged a table not yet resumed ("INACTIVE").
    pub inactive_table: bool,
    /// Holders outside the registry ("Open count").
    pub open_count: u64,
    /// Events so far ("Event number"): table swaps plus target events.
    pub event_nr: u64,
    /// Lines in the live table ("Number of targets").
    pub target_count: usize,
    /// Size of the device in bytes.
    pub size_bytes: u64,
}

#[derive(Default)]
struct State {
    devices: BTreeMap<String, Arc<MappedDevice>>,
    /// Names, uuids and minors of devices being built by a `create` that
    /// runs its constructors without the lock.
    reserved: Vec<Reservation>,
}

struct Reservation {
    name: String,
    uuid: Option<String>,
    minor: u32,
}

impl State {
    fn resolve(&self, staged: &[Arc<MappedDevice>], arg: &str) -> Option<Arc<MappedDevice>> {
        let all = || self.devices.values().chain(staged.iter());
        if let Some((maj, min)) = arg.split_once(':') {
            if let (Ok(maj), Ok(min)) = (maj.parse::<u32>(), min.parse::<u32>()) {
                if maj != DM_MAJOR {
                    return None;
                }
                return all().find(|d| d.minor == min).cloned();
            }
        }
        let name = arg.strip_prefix("/dev/mapper/").unwrap_or(arg);
        all().find(|d| d.name == name).cloned()
    }

    fn next_minor(&self, staged: &[Arc<MappedDevice>]) -> u32 {
        let used: Vec<u32> = self
            .devices
            .values()
            .chain(staged.iter())
            .map(|d| d.minor)
            .chain(self.reserved.iter().map(|r| r.minor))
            .collect();
        (0..).find(|m| !used.contains(m)).unwrap_or(0)
    }

    /// Check `spec` against the devices and reservations and reserve its
    /// name, uuid and minor.
    fn reserve(&mut self, spec: &DeviceSpec) -> Result<(), DmError> {
        crate::table_text::validate_name(&spec.name)?;
        if self.devices.contains_key(&spec.name)
            || self.reserved.iter().any(|r| r.name == spec.name)
        {
            return Err(DmError::Exists(spec.name.clone()));
        }
        if let Some(u) = &spec.uuid {
            let taken = self.devices.values().any(|d| d.uuid.as_deref() == Some(u))
                || self.reserved.iter().any(|r| r.uuid.as_deref() == Some(u));
            if taken {
                return Err(DmError::UuidInUse {
                    name: spec.name.clone(),
                    uuid: u.clone(),
                });
            }
        }
        let minor = match spec.minor {
            Some(m) => {
                let taken = self.devices.values().any(|d| d.minor == m)
                    || self.reserved.iter().any(|r| r.minor == m);
                if taken {
                    return Err(DmError::MinorInUse {
                        name: spec.name.clone(),
                        minor: m,
                    });
                }
                m
            }
            None => self.next_minor(&[]),
        };
        self.reserved.push(Reservation {
            name: spec.name.clone(),
            uuid: spec.uuid.clone(),
            minor,
        });
        Ok(())
    }

    fn reserved_minor(&self, name: &str) -> u32 {
        self.reserved
            .iter()
            .find(|r| r.name == name)
            .map_or(0, |r| r.minor)
    }

    /// Devices whose live or staged table uses `name`.
    fn users_of(&self, name: &str) -> Vec<String> {
        self.devices
            .values()
            .filter(|d| {
                d.name != name
                    && (d.live_table().deps().iter().any(|x| x == name)
                        || d.inactive_table()
                            .is_some_and(|t| t.deps().iter().any(|x| x == name)))
            })
            .map(|d| d.name.clone())
            .collect()
    }

    /// Does `from` reach `to` through live or staged tables?
    fn reaches(&self, from: &str, to: &str, depth: usize) -> bool {
        if from == to {
            return true;
        }
        if depth > 64 {
            return true;
        }
        let Some(d) = self.devices.get(from) else {
            return false;
        };
        let mut deps = d.live_table().deps();
        if let Some(t) = d.inactive_table() {
            deps.extend(t.deps());
        }
        deps.iter().any(|x| self.reaches(x, to, depth + 1))
    }
}

/// The set of named devices. Cheap to share (`Arc<Registry>`).
#[derive(Default)]
pub struct Registry {
    state: Mutex<State>,
}

impl Registry {
    /// An empty registry, shared by the frontends and control paths that
    /// create and look up devices in it.
    pub fn new() -> Arc<Registry> {
        Arc::new(Registry::default())
    }

    /// Build a table for device `name`, resolving device arguments among
    /// the registered devices and `staged` ones.
    /// `live` is the table a reload replaces: a `memory` line with the same
    /// start and length as one of its `memory` lines keeps that line's pages.
    fn build_table(
        resolve: &dyn Fn(&str) -> Option<Arc<MappedDevice>>,
        name: &str,
        text: &str,
        live: Option<&Table>,
        events: &Events,
    ) -> Result<Table, DmError> {
        let lines = parse_table(text).map_err(|e| e.in_device(name))?;
        let lookup = |arg: &str| -> Option<(String, u32, DeviceRef)> {
            resolve(arg).map(|d| (d.name.clone(), d.minor, d.clone() as DeviceRef))
        };
        let target_lookup = |arg: &str| -> Option<TargetRef> {
            resolve(arg).and_then(|d| d.live_table().entries.first().map(|e| e.target.clone()))
        };
        if let Some(l) = lines
            .iter()
            .find(|l| lines.len() > 1 && targets::is_singleton(&l.target))
        {
            let target = l.target.clone();
            return Err(DmError::line(l.line, LineError::Singleton { target }).in_device(name));
        }
        let mut entries = Vec::with_capacity(lines.len());
        for line in lines {
            let tt = targets::lookup(&line.target).ok_or_else(|| {
                DmError::line(
                    line.line,
                    LineError::UnknownTarget {
                        target: line.target.clone(),
                        known: targets::names().join(", "),
                    },
                )
                .in_device(name)
            })?;
            let mut ctx = CtrContext::new(line.start, line.len, name, &lookup)
                .with_target_lookup(&target_lookup);
            ctx.live_target = live.and_then(|t| t.target_at(line.start, &line.target));
            ctx.events = events.clone();
            ctx.reloading = live.is_some();
            let args: Vec<&str> = line.args.iter().map(String::as_str).collect();
            let target = (tt.ctr)(&mut ctx, &args).map_err(|source| {
                let target = line.target.clone();
                DmError::line(line.line, LineError::Target { target, source }).in_device(name)
            })?;
            let deps = ctx.take_used();
            let devs = ctx.take_used_devices();
            if deps.iter().any(|d| d == name) {
                return Err(
                    DmError::line(line.line, LineError::UsesItself(name.to_string()))
                        .in_device(name),
                );
            }
            entries.push(TableEntry {
                line,
                target,
                deps,
                devs,
            });
        }
        Ok(Table {
            entries,
            drops_ram: false,
        })
    }

    /// Create one device from a table text.
    pub fn create(&self, name: &str, table: &str) -> Result<Arc<MappedDevice>, DmError> {
        let spec = DeviceSpec {
            name: name.to_string(),
            uuid: None,
            minor: None,
            read_only: false,
            table: table.to_string(),
            origin_lines: None,
        };
        self.create_specs(&[spec])?;
        self.get(name)
            .ok_or_else(|| DmError::NoSuchDevice(name.to_string()))
    }

    /// Create several devices, in order (later ones may use earlier
    /// ones); all of them or none.
    ///
    /// The constructors run without the registry's lock (an `nbd` leaf's
    /// handshake may take its whole timeout): the names, uuids and minors
    /// are reserved first, and the devices the new tables use are checked
    /// to be still there when the batch is published. Queries, `message`
    /// and changes to other devices go on meanwhile, as the kernel's
    /// `dm_create` builds a table outside `_hash_lock`.
    pub fn create_specs(&self, specs: &[DeviceSpec]) -> Result<Vec<String>, DmError> {
        {
            let mut state = self.state.lock();
            let before = state.reserved.len();
            for spec in specs {
                if let Err(e) = state.reserve(spec) {
                    state.reserved.truncate(before);
                    return Err(e);
                }
            }
        }
        let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
        let built = self.build_reserved(specs);
        let mut state = self.state.lock();
        state.reserved.retain(|r| !names.contains(&r.name));
        let staged = built?;
        for d in &staged {
            for dep in d.live_table().deps() {
                let there = state.devices.contains_key(&dep) || names.contains(&dep);
                if !there {
                    return Err(DmError::NoSuchDevice(dep));
                }
            }
        }
        for d in staged {
            state.devices.insert(d.name.clone(), d);
        }
        Ok(names)
    }

    /// Build the devices of reserved `specs`, taking the lock only to
    /// resolve the devices their tables name.
    fn build_reserved(&self, specs: &[DeviceSpec]) -> Result<Vec<Arc<MappedDevice>>, DmError> {
        let mut staged: Vec<Arc<MappedDevice>> = Vec::new();
        for spec in specs {
            let minor = self.state.lock().reserved_minor(&spec.name);
            let resolve = |arg: &str| self.state.lock().resolve(&staged, arg);
            let events = Events::default();
            let table = Self::build_table(&resolve, &spec.name, &spec.table, None, &events)
                .map_err(|e| match (e, &spec.origin_lines) {
                    (
                        DmError::Line {
                            device,
                            line,
                            source,
                        },
                        Some(origin),
                    ) => DmError::Line {
                        device,
                        line: origin.get(line.wrapping_sub(1)).copied().unwrap_or(line),
                        source,
                    },
                    (e, _) => e,
                })?;
            staged.push(Arc::new(MappedDevice::new(
                spec.name.clone(),
                spec.uuid.clone(),
                minor,
                spec.read_only,
                table,
                events,
            )));
        }
        Ok(staged)
    }

    /// dmsetup `create --concise`.
    pub fn create_concise(&self, s: &str) -> Result<Vec<String>, DmError> {
        self.create_specs(&parse_concise(s)?)
    }

    /// A stack file: concise text or `NAME: <table line>` lines.
    pub fn create_stack(&self, text: &str) -> Result<Vec<String>, DmError> {
        self.create_specs(&parse_stack(text)?)
    }

    /// The device called `name`, if there is one.
    pub fn get(&self, name: &str) -> Option<Arc<MappedDevice>> {
        let state = self.state.lock();
        state.resolve(&[], name)
    }

    /// The device as a `Device` to submit bios to.
    pub fn device(&self, name: &str) -> Result<DeviceRef, DmError> {
        self.get(name)
            .map(|d| d as DeviceRef)
            .ok_or_else(|| DmError::NoSuchDevice(name.to_string()))
    }

    fn must_get(&self, name: &str) -> Result<Arc<MappedDevice>, DmError> {
        self.get(name)
            .ok_or_else(|| DmError::NoSuchDevice(name.to_string()))
    }

    /// Stage a new table; it goes live at the next `resume`. On error the
    /// device keeps its live and staged tables. A `memory` line kept at the
    /// same place and size keeps its data; a table that would drop data
    /// held in RAM is refused (see [`Registry::reload_forced`]).
    pub fn reload(&self, name: &str, table: &str) -> Result<(), DmError> {
        self.reload_forced(name, table, false)
    }

    /// [`Registry::reload`]; with `force`, a table that drops RAM-held data
    /// is staged too (the data goes when it becomes live).
    pub fn reload_forced(&self, name: &str, table: &str, force: bool) -> Result<(), DmError> {
        let state = self.state.lock();
        let dev = state
            .resolve(&[], name)
            .ok_or_else(|| DmError::NoSuchDevice(name.to_string()))?;
        let live = dev.live_table();
        let resolve = |arg: &str| state.resolve(&[], arg);
        let mut t = Self::build_table(&resolve, &dev.name, table, Some(&live), dev.events())?;
        crate::table_type::check_reload(&dev.name, dev.queue_type, &live, &t)?;
        t.drops_ram = force;
        let lost = ram_lost(&live, Some(&t));
        if !lost.is_empty() && !force {
            return Err(DmError::WouldLoseData {
                name: dev.name.clone(),
                verb: "reload",
                lost,
            });
        }
        for d in t.deps() {
            if state.reaches(&d, &dev.name, 0) {
                return Err(DmError::Cycle {
                    name: dev.name.clone(),
                    through: d,
                });
            }
        }
        let new_size = t.size_bytes();
        let users = state.users_of(&dev.name);
        if new_size < dev.size() && !users.is_empty() {
            return Err(DmError::Busy {
                name: dev.name.clone(),
                why: format!(
                    "shrinking from {} to {} sectors under {}",
                    dev.size() / 512,
                    new_size / 512,
                    users.join(", ")
                ),
            });
        }
        dev.stage(t);
        Ok(())
    }

    /// `dmsetup suspend`: stop mapping new bios and wait for those in flight
    /// (kernel `dm_suspend`).
    pub fn suspend(&self, name: &str) -> Result<(), DmError> {
        let dev = self.must_get(name)?;
        dev.suspend();
        Ok(())
    }

    /// Resume, swapping in a staged table. A table staged without force
    /// whose swap would now drop RAM-held data (written since the reload)
    /// is refused, and the device stays as it was. Whether a table was
    /// swapped in.
    pub fn resume(&self, name: &str) -> Result<bool, DmError> {
        let dev = self.must_get(name)?;
        if let Some(staged) = dev.inactive_table().filter(|t| !t.drops_ram) {
            let lost = ram_lost(&dev.live_table(), Some(&staged));
            if !lost.is_empty() {
                return Err(DmError::WouldLoseData {
                    name: dev.name.clone(),
                    verb: "resume",
                    lost,
                });
            }
        }
        Ok(dev.resume())
    }

    /// Drop a staged table (dmsetup `clear`).
    pub fn clear(&self, name: &str) -> Result<(), DmError> {
        self.must_get(name)?.clear_staged();
        Ok(())
    }

    /// Remove a device. Refused while another device uses it, and while it
    /// is open (exported) or holds data in RAM (a written `memory` target)
    /// unless `force`.
    pub fn remove(&self, name: &str, force: bool) -> Result<(), DmError> {
        let mut state = self.state.lock();
        let dev = state
            .resolve(&[], name)
            .ok_or_else(|| DmError::NoSuchDevice(name.to_string()))?;
        let users = state.users_of(&dev.name);
        if !users.is_empty() {
            return Err(DmError::Busy {
                name: dev.name.clone(),
                why: format!("used by {}", users.join(", ")),
            });
        }
        if dev.open_count() > 0 && !force {
            return Err(DmError::Busy {
                name: dev.name.clone(),
                why: format!("open count {} (exported?); use force", dev.open_count()),
            });
        }
        let lost = ram_lost(&dev.live_table(), None);
        if !lost.is_empty() && !force {
            return Err(DmError::WouldLoseData {
                name: dev.name.clone(),
                verb: "remove",
                lost,
            });
        }
        state.devices.remove(&dev.name);
        drop(state);
        // Drain what is in flight before the targets go away; what a
        // suspend held can never be resumed now: it fails.
        dev.suspend();
        dev.fail_held();
        Ok(())
    }

    /// Remove every device, users before the devices they use.
    pub fn remove_all(&self) {
        loop {
            let names = self.names();
            if names.is_empty() {
                return;
            }
            let mut progressed = false;
            for n in names {
                if self.remove(&n, true).is_ok() {
                    progressed = true;
                }
            }
            if !progressed {
                return;
            }
        }
    }

    /// The names of every device, in name order (`dmsetup ls`).
    pub fn names(&self) -> Vec<String> {
        self.state.lock().devices.keys().cloned().collect()
    }

    /// `dmsetup table NAME`: the device's live table as text.
    pub fn table_text(&self, name: &str) -> Result<String, DmError> {
        Ok(self.must_get(name)?.table_text())
    }

    /// The staged table (`dmsetup table --inactive`), if any.
    pub fn inactive_table_text(&self, name: &str) -> Result<Option<String>, DmError> {
        Ok(self
            .must_get(name)?
            .inactive_table()
            .map(|t| t.table_text()))
    }

    /// `dmsetup status NAME`: the live table's status text.
    pub fn status_text(&self, name: &str) -> Result<String, DmError> {
        Ok(self.must_get(name)?.status_text())
    }

    /// `dmsetup message NAME SECTOR ARGS...`: pass `args` to the target of
    /// the line holding `sector` (kernel `target_message`) and return its
    /// reply.
    pub fn message(&self, name: &str, sector: u64, args: &[&str]) -> Result<String, DmError> {
        let dev = self.must_get(name)?;
        dev.message(sector, args)
            .map_err(|source| DmError::Message {
                device: dev.name.clone(),
                source: Box::new(source),
            })
    }

    /// `dmsetup info NAME`.
    pub fn info(&self, name: &str) -> Result<DeviceInfo, DmError> {
        let d = self.must_get(name)?;
        let t = d.live_table();
        Ok(DeviceInfo {
            name: d.name.clone(),
            uuid: d.uuid.clone(),
            major: DM_MAJOR,
            minor: d.minor,
            suspended: d.is_suspended(),
            read_only: d.is_read_only(),
            live_table: true,
            inactive_table: d.inactive_table().is_some(),
            open_count: d.open_count(),
            event_nr: d.event_nr(),
            target_count: t.entries.len(),
            size_bytes: t.size_bytes(),
        })
    }

    /// Names of the devices `name`'s live table uses.
    pub fn deps(&self, name: &str) -> Result<Vec<String>, DmError> {
        Ok(self.must_get(name)?.live_table().deps())
    }

    /// Names of the devices using `name`.
    pub fn users(&self, name: &str) -> Result<Vec<String>, DmError> {
        let state = self.state.lock();
        let d = state
            .resolve(&[], name)
            .ok_or_else(|| DmError::NoSuchDevice(name.to_string()))?;
        Ok(state.users_of(&d.name))
    }
}
