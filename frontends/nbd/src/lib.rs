//! NBD server: exports blkstack devices to real NBD clients (fio's nbd
//! engine, qemu-img/qemu-io, nbdinfo/nbdcopy, the kernel's nbd-client).
//! It is one of `serve`'s export frontends (blkstack-serve), beside ublk
//! and vhost-user-blk, through [`export_driver`].
//!
//! The protocol (`doc/proto.md` of the NetworkBlockDevice/nbd project) is
//! implemented here by hand — no maintained Rust crate implements its
//! server side — in [`proto`] (constants and wire format, unit-tested on
//! its own), [`conn`] (handshake and transmission for one connection) and
//! [`server`] (listeners, accept loop, graceful stop). Supported: fixed
//! newstyle with NO_ZEROES; OPT_EXPORT_NAME, OPT_GO, OPT_INFO (EXPORT,
//! NAME, DESCRIPTION, BLOCK_SIZE), OPT_LIST, OPT_ABORT,
//! OPT_STRUCTURED_REPLY, OPT_LIST/SET_META_CONTEXT (`base:allocation`);
//! READ (OFFSET_DATA and, where the device knows its holes, OFFSET_HOLE),
//! WRITE, FLUSH, FUA, TRIM, WRITE_ZEROES (NO_HOLE, FAST_ZERO), CACHE,
//! BLOCK_STATUS, DISC; replies out of order; many connections.
//! NBD_OPT_STARTTLS with rustls ([`tls`]). Not supported: TLS-PSK,
//! extended headers, RESIZE.

pub mod client;
pub mod conn;
pub mod export;
/// `serve`'s NBD flags and running exports (blkstack-control's
/// `ExportDriver` and `ExportHost`).
pub mod export_driver;
/// Entry points of the cargo-fuzz targets in fuzz/ (and their corpus replay tests).
#[doc(hidden)]
pub mod fuzzing;
pub mod limits;
/// The NBD wire format, shared with the client leaf driver (reached
/// through the mapped layer's `nbd` target).
pub use blkstack_mapped::targets::nbd::proto;
pub mod server;
pub mod sock;
pub mod tls;
pub mod uri;

#[cfg(test)]
mod tests;

pub use export::Export;
pub use export_driver::{parse_exports, NbdArgs, NbdHost};
pub use server::{Server, Stopper};
pub use uri::ListenUri;
