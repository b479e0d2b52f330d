//! The ublk exports of one `serve`, as the control socket sees them
//! (blkstack-control's `ExportHost`): `export --ublk NAME` adds
//! `/dev/ublkbN`, `unexport` ends it, `exports` lists them, and serve's
//! stop (SIGTERM) ends them all. An exported device is held open
//! (`MappedDevice::open`), so `remove` refuses it unless forced, as for
//! NBD.

use crate::error::UblkError;
use crate::export::UblkExport;
use crate::options::UblkOptions;
use blkstack_control::proto::{EBUSY, EINVAL, ENOTSUP};
use blkstack_control::{not_exported, ExportHost, ExportInfo, RpcError};
use blkstack_core::DeviceRef;
use blkstack_mapped::MappedDevice;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;

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
