//! The control methods: what each JSON-RPC method does to the registry
//! and to the NBD exports, with device-mapper's semantics.
//!
//! - `reload` stages a table; only `resume` makes it live, atomically
//!   (the mapped device suspends, swaps, resumes).
//! - `suspend` returns once in-flight I/O has drained; bios arriving while
//!   suspended are held by the mapped device, not failed, so an NBD client
//!   sees slow I/O, never an error.
//! - `remove` refuses a device that another device uses, and one that is
//!   open (exported over NBD) unless `force`; `force` also withdraws the
//!   export so no client keeps a device that is gone.
//! - Every change is all or nothing: the registry validates and builds
//!   before it publishes, and this layer checks what it adds (exports)
//!   before touching anything.
//!
//! Suspend, resume, reload, remove, export and unexport of one device are
//! serialised by a per-device lock, as the kernel's `suspend_lock` does;
//! queries and `message` take no lock, so a `reinstate_path` can always
//! reach a multipath device that a pending suspend is waiting on.

use crate::proto::{RpcError, EBUSY, ENOTSUP, ENXIO, METHOD_NOT_FOUND};
use blkstack_mapped::table_text::DeviceSpec;
use blkstack_mapped::{MappedDevice, Registry};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;

/// `dmsetup info` prints the device's read-ahead; the kernel's default
/// for a dm device is 256 sectors and blkstack has no page cache to tune
/// it for, so it is the constant the kernel would show.
pub const READ_AHEAD_SECTORS: u32 = 256;

/// One export (NBD, ublk or vhost-user-blk) as the control layer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub read_only: bool,
    /// Clients connected to it now.
    pub connections: u64,
    /// Addresses a client can use (`nbd://…/NAME`, `nbd+unix:///NAME?socket=…`).
    pub uris: Vec<String>,
    /// Registry name of the device behind the export (the export may be
    /// named otherwise, e.g. `serve --export /dev/mapper/NAME`).
    pub device: String,
}

/// What the control server needs from each export frontend of serve
/// (NBD, ublk, vhost-user-blk: the running side of an
/// [`ExportDriver`](crate::ExportDriver), in the frontend's
/// `export_driver.rs`). Implementations must make each call all or
/// nothing, and must `open()` a device while it is exported and
/// `close()` it when the export goes, so that `remove` sees it busy.
pub trait ExportHost: Send + Sync {
    /// Offer `dev` to new clients under `name`.
    fn export(
        &self,
        name: &str,
        dev: Arc<MappedDevice>,
        read_only: bool,
    ) -> Result<ExportInfo, RpcError>;
    /// Withdraw export `name`. With clients connected, refuse (EBUSY)
    /// unless `force`, which disconnects them once their in-flight
    /// requests are answered.
    fn unexport(&self, name: &str, force: bool) -> Result<(), RpcError>;
    fn exports(&self) -> Vec<ExportInfo>;
    /// Which frontend this is (`nbd`, `ublk`): `export --ublk` picks by it
    /// and `exports` shows it.
    fn frontend(&self) -> &'static str {
        "nbd"
    }
    /// End every export (serve is stopping): no new clients, in-flight
    /// requests answered, devices flushed or removed. Called once.
    fn shutdown(&self) {}
    /// Client connections served since start (NBD's), for serve's last
    /// line; frontends without connections report 0.
    fn connections_served(&self) -> u64 {
        0
    }
}

/// The state behind a control socket.
pub struct Control {
    reg: Arc<Registry>,
    /// The export frontends of this server (NBD, ublk), each at most once.
    hosts: Vec<Arc<dyn ExportHost>>,
    device_locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

fn params<T: DeserializeOwned>(p: Option<Value>) -> Result<T, RpcError> {
    serde_json::from_value(p.unwrap_or_else(|| json!({})))
        .map_err(|e| RpcError::invalid_params(format!("bad params: {e}")))
}

/// The params of a method that takes none: `{}` or absent; any name in
/// it is refused, as for every other method.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoParams {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NameParams {
    name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OptNamesParams {
    #[serde(default)]
    names: Vec<String>,
    #[serde(default)]
    inactive: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateParams {
    name: Option<String>,
    table: Option<String>,
    concise: Option<String>,
    stack: Option<String>,
    uuid: Option<String>,
    #[serde(default)]
    readonly: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReloadParams {
    name: String,
    table: String,
    /// Stage a table that drops data held in RAM.
    #[serde(default)]
    force: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveParams {
    name: String,
    #[serde(default)]
    force: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MessageParams {
    name: String,
    sector: u64,
    message: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportParams {
    name: String,
    #[serde(default)]
    readonly: bool,
    /// `nbd` (the default) or `ublk`.
    frontend: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UnexportParams {
    name: String,
    #[serde(default)]
    force: bool,
    /// Which frontend's export; needed only when two share the name.
    frontend: Option<String>,
}

/// Every method, for `METHOD_NOT_FOUND` messages and the docs test.
pub const METHODS: &[&str] = &[
    "version", "create", "reload", "clear", "suspend", "resume", "remove", "table", "status",
    "info", "deps", "ls", "message", "export", "unexport", "exports",
];

impl Control {
    pub fn new(reg: Arc<Registry>, host: Option<Arc<dyn ExportHost>>) -> Control {
        Control::with_hosts(reg, host.into_iter().collect())
    }

    /// A control over several export frontends (NBD and ublk).
    pub fn with_hosts(reg: Arc<Registry>, hosts: Vec<Arc<dyn ExportHost>>) -> Control {
        Control {
            reg,
            hosts,
            device_locks: Mutex::new(HashMap::new()),
        }
    }

    /// End every frontend's exports (serve is stopping).
    pub fn shutdown(&self) {
        for h in &self.hosts {
            h.shutdown();
        }
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.reg
    }

    /// The lock serialising state changes of the device `name` resolves
    /// to (keyed by the registry's name, so `/dev/mapper/x` and `x` share
    /// it).
    fn device_lock(&self, name: &str) -> Result<(String, Arc<Mutex<()>>), RpcError> {
        let dev = self
            .reg
            .get(name)
            .ok_or_else(|| RpcError::from(blkstack_mapped::DmError::NoSuchDevice(name.into())))?;
        let lock = self
            .device_locks
            .lock()
            .entry(dev.name.clone())
            .or_default()
            .clone();
        Ok((dev.name.clone(), lock))
    }

    fn host(&self, frontend: &str) -> Result<&Arc<dyn ExportHost>, RpcError> {
        self.hosts
            .iter()
            .find(|h| h.frontend() == frontend)
            .ok_or_else(|| {
                RpcError::new(
                    ENOTSUP,
                    format!(
                        "this server has no {frontend} frontend to export with{}",
                        if frontend == "ublk" {
                            " (start serve with --ublk or --ublk-enable)"
                        } else {
                            ""
                        }
                    ),
                )
            })
    }

    /// Every export of every frontend, with the frontend's name.
    fn all_exports(&self) -> Vec<(&'static str, ExportInfo)> {
        self.hosts
            .iter()
            .flat_map(|h| h.exports().into_iter().map(move |e| (h.frontend(), e)))
            .collect()
    }

    /// Run one method.
    pub fn call(&self, method: &str, p: Option<Value>) -> Result<Value, RpcError> {
        match method {
            "version" => {
                let NoParams {} = params(p)?;
                Ok(json!({
                    "server": "blkstack",
                    "version": env!("CARGO_PKG_VERSION"),
                    "methods": METHODS,
                }))
            }
            "create" => self.create(params(p)?),
            "reload" => self.reload(params(p)?),
            "clear" | "suspend" | "resume" => self.suspend_resume(method, params(p)?),
            "remove" => self.remove(params(p)?),
            "table" => self.table(params(p)?),
            "status" => self.status(params(p)?),
            "info" => self.info(params(p)?),
            "deps" => self.deps(params(p)?),
            "ls" => {
                let NoParams {} = params(p)?;
                self.ls()
            }
            "message" => {
                let p: MessageParams = params(p)?;
                let words: Vec<&str> = p.message.iter().map(String::as_str).collect();
                let reply = self.reg.message(&p.name, p.sector, &words)?;
                Ok(json!({ "name": p.name, "reply": reply }))
            }
            "export" => self.export(params(p)?),
            "unexport" => self.unexport(params(p)?),
            "exports" => {
                let NoParams {} = params(p)?;
                self.exports()
            }
            other => Err(RpcError::new(
                METHOD_NOT_FOUND,
                format!("unknown method '{other}' (known: {})", METHODS.join(", ")),
            )),
        }
    }

    fn reload(&self, p: ReloadParams) -> Result<Value, RpcError> {
        let (name, lock) = self.device_lock(&p.name)?;
        let _g = lock.lock();
        self.reg.reload_forced(&name, &p.table, p.force)?;
        Ok(json!({ "name": name }))
    }

    /// `clear`, `suspend` and `resume`: one device's table state, under
    /// its lock.
    fn suspend_resume(&self, method: &str, p: NameParams) -> Result<Value, RpcError> {
        let (name, lock) = self.device_lock(&p.name)?;
        let _g = lock.lock();
        match method {
            "clear" => self.reg.clear(&name)?,
            "suspend" => self.reg.suspend(&name)?,
            _ => {
                let swapped = self.reg.resume(&name)?;
                return Ok(json!({ "name": name, "table_swapped": swapped }));
            }
        }
        Ok(json!({ "name": name }))
    }

    fn table(&self, p: OptNamesParams) -> Result<Value, RpcError> {
        let inactive = p.inactive;
        self.per_device(p.names, |name| {
            let text = if inactive {
                self.reg.inactive_table_text(name)?.map(Value::String)
            } else {
                Some(Value::String(self.reg.table_text(name)?))
            };
            Ok(json!({ "name": name, "table": text }))
        })
    }

    fn status(&self, p: OptNamesParams) -> Result<Value, RpcError> {
        if p.inactive {
            return Err(RpcError::invalid_params(
                "status has no inactive form (an inactive table has no state)",
            ));
        }
        self.per_device(p.names, |name| {
            Ok(json!({ "name": name, "status": self.reg.status_text(name)? }))
        })
    }

    fn info(&self, p: OptNamesParams) -> Result<Value, RpcError> {
        if p.inactive {
            return Err(RpcError::invalid_params("info has no inactive form"));
        }
        self.per_device(p.names, |name| {
            let i = self.reg.info(name)?;
            Ok(json!({
                "name": i.name,
                "uuid": i.uuid,
                "major": i.major,
                "minor": i.minor,
                "suspended": i.suspended,
                "read_only": i.read_only,
                "live_table": i.live_table,
                "inactive_table": i.inactive_table,
                "open_count": i.open_count,
                "event_nr": i.event_nr,
                "target_count": i.target_count,
                "size_bytes": i.size_bytes,
                "read_ahead": READ_AHEAD_SECTORS,
            }))
        })
    }

    fn deps(&self, p: OptNamesParams) -> Result<Value, RpcError> {
        if p.inactive {
            return Err(RpcError::invalid_params("deps has no inactive form"));
        }
        self.per_device(p.names, |name| {
            let dev = self
                .reg
                .get(name)
                .ok_or_else(|| blkstack_mapped::DmError::NoSuchDevice(name.into()))?;
            Ok(json!({ "name": dev.name, "deps": self.dep_list(&dev.name)? }))
        })
    }

    fn export(&self, p: ExportParams) -> Result<Value, RpcError> {
        let frontend = p.frontend.as_deref().unwrap_or("nbd");
        let host = self.host(frontend)?;
        let (name, lock) = self.device_lock(&p.name)?;
        let _g = lock.lock();
        let dev = self
            .reg
            .get(&name)
            .ok_or_else(|| RpcError::from(blkstack_mapped::DmError::NoSuchDevice(name.clone())))?;
        let e = host.export(&name, dev, p.readonly)?;
        Ok(export_json(host.frontend(), &e))
    }

    fn unexport(&self, p: UnexportParams) -> Result<Value, RpcError> {
        let host = match p.frontend.as_deref() {
            Some(f) => self.host(f)?,
            None => {
                let owners: Vec<&Arc<dyn ExportHost>> = self
                    .hosts
                    .iter()
                    .filter(|h| h.exports().iter().any(|e| e.name == p.name))
                    .collect();
                match owners.as_slice() {
                    [] => return Err(not_exported(&p.name)),
                    [h] => *h,
                    _ => {
                        return Err(RpcError::invalid_params(format!(
                        "{} is exported on several frontends; say which (frontend: nbd or ublk)",
                        p.name
                    )))
                    }
                }
            }
        };
        host.unexport(&p.name, p.force)?;
        Ok(json!({ "name": p.name }))
    }

    fn exports(&self) -> Result<Value, RpcError> {
        if self.hosts.is_empty() {
            self.host("nbd")?;
        }
        let list = self.all_exports();
        Ok(json!({ "exports": list.iter().map(|(f, e)| export_json(f, e)).collect::<Vec<_>>() }))
    }

    fn create(&self, p: CreateParams) -> Result<Value, RpcError> {
        let specs = match (&p.name, &p.table, &p.concise, &p.stack) {
            (Some(name), Some(table), None, None) => vec![DeviceSpec {
                name: name.clone(),
                uuid: p.uuid.clone(),
                minor: None,
                read_only: p.readonly,
                table: table.clone(),
                origin_lines: None,
            }],
            (None, None, Some(c), None) if p.uuid.is_none() && !p.readonly => {
                blkstack_mapped::table_text::parse_concise(c)?
            }
            (None, None, None, Some(s)) if p.uuid.is_none() && !p.readonly => {
                blkstack_mapped::table_text::parse_stack(s)?
            }
            _ => {
                return Err(RpcError::invalid_params(
                    "create takes either name and table (with optional uuid, readonly), \
                     or concise, or stack",
                ))
            }
        };
        let names = self.reg.create_specs(&specs)?;
        Ok(json!({ "created": names }))
    }

    fn remove(&self, p: RemoveParams) -> Result<Value, RpcError> {
        let (name, lock) = self.device_lock(&p.name)?;
        let _g = lock.lock();
        let exported: Vec<(&'static str, String)> = self
            .all_exports()
            .into_iter()
            .filter(|(_, e)| e.device == name)
            .map(|(f, e)| (f, e.name))
            .collect();
        // Check what the registry would refuse before withdrawing the
        // export, so a refused remove leaves the export in place.
        let users = self.reg.users(&name)?;
        if !users.is_empty() {
            return Err(blkstack_mapped::DmError::Busy {
                name,
                why: format!("used by {}", users.join(", ")),
            }
            .into());
        }
        if !exported.is_empty() {
            if !p.force {
                return Err(RpcError::new(
                    EBUSY,
                    format!(
                        "device {name} is busy: exported {}; unexport it or use force",
                        exported
                            .iter()
                            .map(|(f, e)| if *f == "nbd" {
                                format!("over NBD as {e}")
                            } else {
                                format!("on {f} as {e}")
                            })
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
            for (f, e) in &exported {
                self.host(f)?.unexport(e, true)?;
            }
        }
        self.reg.remove(&name, p.force)?;
        self.device_locks.lock().remove(&name);
        Ok(json!({ "name": name }))
    }

    /// Run `f` for each named device, or for every device when `names`
    /// is empty (skipping any removed meanwhile); a named device that does
    /// not exist is an error.
    fn per_device(
        &self,
        names: Vec<String>,
        f: impl Fn(&str) -> Result<Value, blkstack_mapped::DmError>,
    ) -> Result<Value, RpcError> {
        let mut out = Vec::new();
        if names.is_empty() {
            for n in self.reg.names() {
                match f(&n) {
                    Ok(v) => out.push(v),
                    Err(blkstack_mapped::DmError::NoSuchDevice(_)) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        } else {
            for n in &names {
                out.push(f(n)?);
            }
        }
        Ok(json!({ "devices": out }))
    }

    /// The devices `name`'s live table uses, with their numbers.
    fn dep_list(&self, name: &str) -> Result<Vec<Value>, blkstack_mapped::DmError> {
        Ok(self
            .reg
            .deps(name)?
            .iter()
            .filter_map(|dn| self.reg.get(dn))
            .map(|x| json!({ "name": x.name, "major": blkstack_mapped::target::DM_MAJOR, "minor": x.minor }))
            .collect())
    }

    fn ls(&self) -> Result<Value, RpcError> {
        let mut out = Vec::new();
        for n in self.reg.names() {
            let (Some(d), Ok(deps)) = (self.reg.get(&n), self.dep_list(&n)) else {
                continue;
            };
            out.push(json!({
                "name": d.name,
                "major": blkstack_mapped::target::DM_MAJOR,
                "minor": d.minor,
                "deps": deps,
            }));
        }
        Ok(json!({ "devices": out }))
    }
}

fn export_json(frontend: &str, e: &ExportInfo) -> Value {
    json!({
        "name": e.name,
        "frontend": frontend,
        "read_only": e.read_only,
        "connections": e.connections,
        "uris": e.uris,
        "device": e.device,
    })
}

/// `ENXIO` for a name that is not exported, for [`ExportHost`] impls.
pub fn not_exported(name: &str) -> RpcError {
    RpcError::new(ENXIO, format!("{name} is not exported"))
}
