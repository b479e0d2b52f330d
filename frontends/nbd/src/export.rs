//! An export: a named device as one NBD client sees it, and what the
//! device's [`Features`](blkstack_core::Features) become on the wire
//! (transmission flags, block-size constraints).

use crate::proto::*;
use crate::sock::Sock;
use blkstack_core::DeviceRef;
use parking_lot::Mutex;
use std::sync::Arc;

/// Largest READ/WRITE we accept: 64 MiB as nbdkit (the protocol's default
/// is 32 MiB; nbd-server takes more), or the device's own limit if
/// smaller. Advertised in NBD_INFO_BLOCK_SIZE; a client that never asked
/// (NBD_OPT_EXPORT_NAME) stays within the 32 MiB default anyway. The
/// connection's memory budget ([`crate::conn::BUDGET`]) bounds how many
/// such requests are in flight at once.
pub const MAX_REQUEST: u32 = 64 << 20;

pub struct Export {
    pub name: String,
    /// Shown by `nbdinfo` (NBD_INFO_DESCRIPTION) and in NBD_OPT_LIST.
    pub description: String,
    pub dev: DeviceRef,
    /// Set by the user (`NAME:ro`, `--readonly`) or by the device itself.
    pub read_only: bool,
    /// Live control (blkstack-control): the connections serving this
    /// export, so `unexport` can refuse while clients use it, or shut
    /// their sockets' read side (in-flight requests still answered).
    pub clients: Arc<Mutex<Vec<Arc<Sock>>>>,
}

/// Live control: keeps a connection listed in [`Export::clients`] while
/// it lives.
pub struct ClientGuard {
    clients: Arc<Mutex<Vec<Arc<Sock>>>>,
    sock: Arc<Sock>,
}

impl Drop for ClientGuard {
    fn drop(&mut self) {
        self.clients.lock().retain(|s| !Arc::ptr_eq(s, &self.sock));
    }
}

/// Live control (blkstack-control): the exports of a running server, which
/// `export`/`unexport` change. A connection takes a snapshot when it is
/// accepted, so a change never alters the list under a handshake.
#[derive(Clone, Default)]
pub struct ExportTable(Arc<Mutex<Arc<Vec<Export>>>>);

impl ExportTable {
    pub fn new(exports: Vec<Export>) -> ExportTable {
        ExportTable(Arc::new(Mutex::new(Arc::new(exports))))
    }

    pub fn snapshot(&self) -> Arc<Vec<Export>> {
        self.0.lock().clone()
    }

    /// Replace the list with `f(current)`; `f` may refuse.
    pub fn update<E>(&self, f: impl FnOnce(&[Export]) -> Result<Vec<Export>, E>) -> Result<(), E> {
        let mut g = self.0.lock();
        let next = f(&g)?;
        *g = Arc::new(next);
        Ok(())
    }
}

impl Clone for Export {
    fn clone(&self) -> Export {
        Export {
            name: self.name.clone(),
            description: self.description.clone(),
            dev: self.dev.clone(),
            read_only: self.read_only,
            clients: self.clients.clone(),
        }
    }
}

impl Export {
    pub fn new(name: impl Into<String>, dev: DeviceRef, read_only: bool) -> Export {
        let read_only = read_only || dev.features().read_only;
        let name = name.into();
        let description = format!(
            "blkstack device {name} ({} bytes{})",
            dev.size(),
            if read_only { ", read-only" } else { "" }
        );
        Export {
            name,
            description,
            dev,
            read_only,
            clients: Arc::default(),
        }
    }

    /// Live control: list `sock` as a client of this export until the
    /// guard drops.
    pub fn attach(&self, sock: &Arc<Sock>) -> ClientGuard {
        self.clients.lock().push(sock.clone());
        ClientGuard {
            clients: self.clients.clone(),
            sock: sock.clone(),
        }
    }

    /// Transmission flags for a client that did (or did not) negotiate
    /// structured replies.
    pub fn transmission_flags(&self, structured: bool) -> u16 {
        let f = self.dev.features();
        let mut t = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_CACHE;
        if f.fua {
            t |= TFLAG_SEND_FUA;
        }
        if self.read_only {
            t |= TFLAG_READ_ONLY;
        } else {
            if f.discard {
                t |= TFLAG_SEND_TRIM;
            }
            if f.write_zeroes {
                // FAST_ZERO is always answerable: either the device is
                // fast, or the request is refused at once with ENOTSUP.
                t |= TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO;
            }
        }
        if structured {
            t |= TFLAG_SEND_DF;
        }
        // Only when a flush on one connection covers writes completed on
        // every other one (the spec's condition for multi-conn).
        if f.flush_is_global {
            t |= TFLAG_CAN_MULTI_CONN;
        }
        t
    }

    /// (minimum, preferred, maximum) block sizes for NBD_INFO_BLOCK_SIZE.
    /// The minimum is the logical block size because misaligned requests
    /// are refused (EINVAL) rather than emulated with read-modify-write.
    pub fn block_sizes(&self) -> (u32, u32, u32) {
        let min = self.dev.logical_block_size().max(1);
        let preferred = self.dev.physical_block_size().max(4096).max(min);
        let max = self.max_request().max(preferred);
        (min, preferred, max)
    }

    /// Largest READ/WRITE, a multiple of the logical block size.
    pub fn max_request(&self) -> u32 {
        let lbs = self.dev.logical_block_size().max(1) as u64;
        let m = self.dev.max_io_bytes().min(MAX_REQUEST as u64);
        let m = m - m % lbs;
        m.max(lbs) as u32
    }
}
