//! Live control (added for blkstack-control, issue 8): the NBD server's
//! side of `blkstack export`/`unexport`. The control crate calls this
//! through its `ExportHost` trait; this file is the only place the NBD
//! server knows about it.
//!
//! An exported device is held open (`MappedDevice::open`), as a block
//! device an NBD server has open is in the kernel, so `remove` refuses it
//! until it is unexported.

use crate::export::{Export, ExportTable};
use crate::uri::ListenUri;
use blkstack_control::proto::{EBUSY, EINVAL};
use blkstack_control::{not_exported, ExportHost, ExportInfo, RpcError};
use blkstack_core::DeviceRef;
use blkstack_mapped::MappedDevice;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

pub struct NbdExportHost {
    table: ExportTable,
    addresses: Vec<ListenUri>,
    /// The mapped devices behind the exports, to `close()` on unexport.
    held: Mutex<HashMap<String, Arc<MappedDevice>>>,
}

impl NbdExportHost {
    /// `held` are the devices the server was started with: they are
    /// opened here, as later exports are.
    pub fn new(
        table: ExportTable,
        addresses: Vec<ListenUri>,
        held: Vec<(String, Arc<MappedDevice>)>,
    ) -> NbdExportHost {
        for (_, d) in &held {
            d.open();
        }
        NbdExportHost {
            table,
            addresses,
            held: Mutex::new(held.into_iter().collect()),
        }
    }

    fn info(&self, e: &Export, device: &str) -> ExportInfo {
        ExportInfo {
            device: device.to_string(),
            name: e.name.clone(),
            read_only: e.read_only,
            connections: e.clients.lock().len() as u64,
            uris: self
                .addresses
                .iter()
                .map(|a| a.client_uri(&e.name))
                .collect(),
        }
    }
}

impl ExportHost for NbdExportHost {
    fn export(
        &self,
        name: &str,
        dev: Arc<MappedDevice>,
        read_only: bool,
    ) -> Result<ExportInfo, RpcError> {
        if name.is_empty() {
            return Err(RpcError::new(EINVAL, "an export needs a name"));
        }
        let mut held = self.held.lock();
        let mut added = None;
        self.table.update(|cur| {
            if cur.iter().any(|e| e.name == name) {
                return Err(RpcError::new(EBUSY, format!("{name} is already exported")));
            }
            let e = Export::new(name, dev.clone() as DeviceRef, read_only);
            added = Some(e.clone());
            let mut next = cur.to_vec();
            next.push(e);
            Ok(next)
        })?;
        dev.open();
        let device = dev.name.clone();
        held.insert(name.to_string(), dev);
        let e = added.ok_or_else(|| RpcError::new(EINVAL, "export vanished"))?;
        Ok(self.info(&e, &device))
    }

    fn unexport(&self, name: &str, force: bool) -> Result<(), RpcError> {
        let mut held = self.held.lock();
        let mut gone = None;
        self.table.update(|cur| {
            let Some(i) = cur.iter().position(|e| e.name == name) else {
                return Err(not_exported(name));
            };
            let clients = cur[i].clients.lock().len();
            if clients > 0 && !force {
                return Err(RpcError::new(
                    EBUSY,
                    format!(
                        "{name} has {clients} client(s) connected; use force to disconnect them"
                    ),
                ));
            }
            let mut next = cur.to_vec();
            gone = Some(next.remove(i));
            Ok(next)
        })?;
        if let Some(e) = gone {
            // As a graceful server stop does: no new requests, the ones
            // in flight answered, then the connection ends.
            for s in e.clients.lock().iter() {
                s.shutdown(std::net::Shutdown::Read);
            }
        }
        if let Some(d) = held.remove(name) {
            d.close();
        }
        Ok(())
    }

    fn exports(&self) -> Vec<ExportInfo> {
        let held = self.held.lock();
        self.table
            .snapshot()
            .iter()
            .map(|e| {
                let device = held.get(&e.name).map(|d| d.name.as_str()).unwrap_or("");
                self.info(e, device)
            })
            .collect()
    }
}
