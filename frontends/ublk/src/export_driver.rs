//! ublk as one of `serve`'s export frontends (blkstack-control's
//! [`ExportDriver`] and [`ExportHost`], qemu's `BlockExportDriver` as
//! `block/export/export.c` drives it; the same file in nbd and
//! vhost-user-blk does the same for those): serve's `--ublk` flags,
//! starting serve's ublk exports once its stack exists, and the control
//! socket's view of them: `export --ublk NAME` adds `/dev/ublkbN`,
//! `unexport` ends it, `exports` lists them, and serve's stop (SIGTERM)
//! ends them all. An exported device is held open
//! (`MappedDevice::open`), so `remove` refuses it unless forced, as for
//! NBD.

use crate::error::UblkError;
use crate::export::UblkExport;
use crate::options::{self, UblkOptions};
use anyhow::Context;
use blkstack_control::proto::{EBUSY, EINVAL, ENOTSUP};
use blkstack_control::{not_exported, ExportDriver, ExportHost, ExportInfo, RpcError};
use blkstack_core::DeviceRef;
use blkstack_mapped::{MappedDevice, Registry};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;

/// `serve`'s ublk flags.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct UblkArgs {
    /// Also present these devices as kernel block devices, /dev/ublkbN
    /// (comma-separated or repeated; `NAME:ro` read-only). Needs root (or
    /// --ublk-unprivileged) and the ublk_drv module. A device a killed
    /// serve left (same name) is taken over and its queued I/O goes on.
    #[arg(long, value_name = "NAME[:ro][,NAME[:ro]...]", value_delimiter = ',')]
    pub ublk: Vec<String>,

    /// Accept `export --ublk` on the control socket even when --ublk names
    /// no device at start.
    #[arg(long)]
    pub ublk_enable: bool,

    /// ublk queues per device. Default: one per hardware queue of the
    /// stack's tag set (e.g. a `memory submit_queues=N` leaf's N), each
    /// with its own thread; fewer may be asked for, more are refused.
    #[arg(long, value_name = "N")]
    pub ublk_queues: Option<u16>,

    /// Requests in flight per ublk queue. Default: the stack's tags per
    /// hardware queue (`hw_queue_depth`, a file's `queue_depth`); a
    /// shallower queue may be asked for, a deeper one is refused.
    #[arg(long, value_name = "N")]
    pub ublk_depth: Option<u16>,

    /// Largest request the kernel sends, in bytes (a buffer of this size
    /// is reserved per tag); the device's own limit applies too.
    #[arg(long, value_name = "BYTES", default_value_t = options::DEFAULT_IO_BUF_BYTES)]
    pub ublk_max_io: u32,

    /// Without recovery: a killed serve's devices fail their I/O and go,
    /// instead of waiting for a restarted serve to take them over.
    #[arg(long)]
    pub ublk_no_recovery: bool,

    /// Add devices as UBLK_F_UNPRIVILEGED_DEV (a non-root user where
    /// /dev/ublk-control is open to them; the kernel allows no recovery
    /// for such devices).
    #[arg(long)]
    pub ublk_unprivileged: bool,
}

impl UblkArgs {
    pub fn options(&self) -> UblkOptions {
        UblkOptions {
            queues: self.ublk_queues,
            depth: self.ublk_depth,
            io_buf_bytes: self.ublk_max_io,
            recovery: !self.ublk_no_recovery,
            unprivileged: self.ublk_unprivileged,
        }
    }

    /// `(name, read_only)` for each --ublk entry.
    pub fn names(&self) -> anyhow::Result<Vec<(String, bool)>> {
        blkstack_control::cli::parse_named_modes("--ublk", &self.ublk)
    }
}

impl ExportDriver for UblkArgs {
    fn frontend(&self) -> &'static str {
        "ublk"
    }

    /// `--ublk NAME`, or `--ublk-enable` for `export --ublk` later.
    fn requested(&self) -> bool {
        self.ublk_enable || !self.ublk.is_empty()
    }

    fn usage(&self) -> &'static str {
        "--ublk NAME (/dev/ublkbN)"
    }

    fn start(&self, reg: &Arc<Registry>) -> anyhow::Result<Arc<dyn ExportHost>> {
        let opts = self.options();
        opts.validate()?;
        let names = self.names()?;
        let host = Arc::new(UblkHost::new(opts));
        for (name, ro) in names {
            if let Err(e) = start_one(&host, reg, &name, ro) {
                host.stop_all();
                return Err(e).with_context(|| format!("--ublk {name}"));
            }
        }
        Ok(host)
    }
}

/// Export `name` of `reg` on `host` and say where.
fn start_one(host: &UblkHost, reg: &Registry, name: &str, ro: bool) -> anyhow::Result<()> {
    let dev = reg
        .get(name)
        .ok_or_else(|| blkstack_mapped::DmError::NoSuchDevice(name.into()))?;
    let size = blkstack_core::Device::size(&*dev);
    let info = host.add(name, dev, ro)?;
    writeln!(
        std::io::stdout().lock(),
        "serving {name} ({size} bytes{}) at {}",
        if info.read_only { ", read-only" } else { "" },
        info.uris.join(" ")
    )?;
    Ok(())
}

struct Held {
    export: UblkExport,
    dev: Arc<MappedDevice>,
}

pub struct UblkHost {
    opts: UblkOptions,
    exports: Mutex<BTreeMap<String, Held>>,
}

impl UblkHost {
    pub fn new(opts: UblkOptions) -> UblkHost {
        UblkHost {
            opts,
            exports: Mutex::new(BTreeMap::new()),
        }
    }

    /// Export `dev` (named `name`) on ublk; the block device's path.
    pub fn add(
        &self,
        name: &str,
        dev: Arc<MappedDevice>,
        read_only: bool,
    ) -> Result<ExportInfo, UblkError> {
        let mut ex = self.exports.lock();
        if ex.contains_key(name) {
            return Err(UblkError::AlreadyExported(name.into()));
        }
        let export = UblkExport::start(name, dev.clone() as DeviceRef, read_only, &self.opts)?;
        dev.open();
        let info = info_of(&export, &dev);
        ex.insert(name.to_string(), Held { export, dev });
        Ok(info)
    }

    /// End every ublk device (serve's stop).
    pub fn stop_all(&self) {
        let all = std::mem::take(&mut *self.exports.lock());
        for (_, h) in all {
            h.export.stop();
            h.dev.close();
        }
    }
}

/// Whether someone holds the block device exclusively (a mounted
/// filesystem, a device-mapper table over it): the kernel answers EBUSY
/// to an O_EXCL open then, as it does for any block device.
fn in_use(path: &str) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    matches!(
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_EXCL).open(path),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY)
    )
}

fn info_of(e: &UblkExport, dev: &MappedDevice) -> ExportInfo {
    let path = e.block_device();
    ExportInfo {
        name: e.name.clone(),
        read_only: e.read_only,
        connections: u64::from(in_use(&path)),
        uris: vec![path],
        device: dev.name.clone(),
    }
}

fn rpc(e: UblkError) -> RpcError {
    let code = match &e {
        UblkError::AlreadyExported(_) => EBUSY,
        UblkError::NoControl(_) | UblkError::Permission(_) => ENOTSUP,
        _ => EINVAL,
    };
    RpcError::new(code, e.to_string())
}

impl ExportHost for UblkHost {
    fn export(
        &self,
        name: &str,
        dev: Arc<MappedDevice>,
        read_only: bool,
    ) -> Result<ExportInfo, RpcError> {
        self.add(name, dev, read_only).map_err(rpc)
    }

    fn unexport(&self, name: &str, force: bool) -> Result<(), RpcError> {
        let mut ex = self.exports.lock();
        let Some(h) = ex.get(name) else {
            return Err(not_exported(name));
        };
        let path = h.export.block_device();
        if !force && in_use(&path) {
            return Err(RpcError::new(
                EBUSY,
                format!("{name}: {path} is in use (mounted or held); unmount it or use force"),
            ));
        }
        if let Some(h) = ex.remove(name) {
            h.export.stop();
            h.dev.close();
        }
        Ok(())
    }

    fn exports(&self) -> Vec<ExportInfo> {
        self.exports
            .lock()
            .values()
            .map(|h| info_of(&h.export, &h.dev))
            .collect()
    }

    fn frontend(&self) -> &'static str {
        "ublk"
    }

    fn shutdown(&self) {
        self.stop_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_like_export() {
        let a = UblkArgs {
            ublk: vec!["a".into(), "b:ro".into()],
            ..UblkArgs::default()
        };
        assert_eq!(
            a.names().unwrap(),
            vec![("a".into(), false), ("b".into(), true)]
        );
        let a = UblkArgs {
            ublk: vec!["a".into(), "a".into()],
            ..UblkArgs::default()
        };
        assert!(a.names().unwrap_err().to_string().contains("twice"));
        let a = UblkArgs {
            ublk: vec!["a:rx".into()],
            ..UblkArgs::default()
        };
        assert!(a.names().unwrap_err().to_string().contains("unknown mode"));
    }
}
