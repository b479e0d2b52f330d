//! The contract between `serve` and each of its export frontends (NBD,
//! ublk, vhost-user-blk), after qemu's `BlockExportDriver`
//! (`include/block/export.h`, driven by `block/export/export.c`): serve
//! holds a table of drivers, starts the ones its flags ask for, hands the
//! running exports to the control socket ([`ExportHost`]) and shuts them
//! down when it stops. Every frontend implements it in a file of the same
//! name, `src/export_driver.rs`, so none knows another, and serve knows
//! none beyond this trait.
//!
//! It lives here, beside [`ExportHost`], because both serve and every
//! frontend depend on this crate: serve sits above its frontends.

use crate::methods::ExportHost;
use blkstack_mapped::Registry;
use std::sync::Arc;

/// One export frontend as `serve`'s flags configure it, before it starts
/// (qemu's `BlockExportDriver` with its `BlockExportOptions`).
///
/// `start` turns it into the running frontend, an [`ExportHost`]: what
/// the control socket's `export`/`unexport`/`exports` drive, and what
/// serve's stop ends (`ExportHost::shutdown`, qemu's
/// `request_shutdown` and `delete`).
pub trait ExportDriver {
    /// The frontend's name, as `export --FRONTEND` and `exports` show it
    /// (`nbd`, `ublk`, `vhost-user-blk`); the host it starts reports the
    /// same.
    fn frontend(&self) -> &'static str;

    /// Whether the flags ask for this frontend on their own (a device to
    /// export, or an explicit enable). A serve with no such frontend has
    /// nothing to do and refuses to start.
    fn requested(&self) -> bool;

    /// Whether serve runs this frontend: when requested, or when its
    /// flags prepare it for exports the control socket adds later (NBD's
    /// `--listen` beside another frontend).
    fn enabled(&self) -> bool {
        self.requested()
    }

    /// How a user asks for this frontend, for serve's error when none is
    /// asked for: e.g. `--ublk NAME (/dev/ublkbN)`.
    fn usage(&self) -> &'static str;

    /// Export the devices the flags name, looked up in `reg`, all or
    /// none (on error nothing of this frontend is left running), print
    /// one `serving …` line for each on stdout, and return the running
    /// frontend. The error names the flag at fault: this runs at the
    /// command line's edge.
    fn start(&self, reg: &Arc<Registry>) -> anyhow::Result<Arc<dyn ExportHost>>;
}
