//! `snapshot-origin <device>`: the origin as its users see it while it has
//! snapshots (kernel `drivers/md/dm-snap.c`, `origin_ctr`/`origin_map`/
//! `do_origin`). Reads and flushes go straight to the device; a write
//! (or write-zeroes, or discard: anything that changes data) first has
//! every snapshot of that device that lacks a chunk it touches copy the
//! chunk out (`__origin_write`), so the snapshots keep showing the data
//! as it was. Snapshots find their origin by device (the snapshot table's
//! `ORIGIN` argument is the same device as this line's), as the kernel's
//! `_origins` hash; a snapshot whose COW device fills up is invalidated
//! and the origin write goes on.
//!
//! The kernel splits origin bios at the smallest chunk size of the
//! snapshots (`split_boundary`); here a write that spans chunks has each
//! of them copied out before it is passed on, so no split is needed.
//! `status` is empty and `table` is the device, as the kernel's.

use super::{in_context, snapshots_of};
use crate::error::TargetError;
use crate::target::{CtrContext, DevArg, Target, TargetRef, TargetType};
use blkstack_core::{Bio, Features, Op};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

pub const TYPE: TargetType = TargetType {
    name: "snapshot-origin",
    version: [1, 9, 0],
    ctr,
};

pub struct OriginTarget {
    dev: DevArg,
}

/// How many `snapshot-origin` targets exist: while none does, snapshot
/// reads of the origin need not be tracked.
static LIVE_ORIGINS: AtomicUsize = AtomicUsize::new(0);

/// Whether any `snapshot-origin` target exists.
pub(super) fn any_live() -> bool {
    LIVE_ORIGINS.load(Ordering::Acquire) > 0
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    if args.len() != 1 {
        return Err(TargetError::invalid(
            "origin: incorrect number of arguments",
        ));
    }
    let dev = ctx
        .get_device(args[0], 0, ctx.len)
        .map_err(|e| in_context("Cannot get target device", e))?;
    LIVE_ORIGINS.fetch_add(1, Ordering::AcqRel);
    Ok(Arc::new(OriginTarget { dev }))
}

impl Drop for OriginTarget {
    fn drop(&mut self) {
        LIVE_ORIGINS.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Target for OriginTarget {
    fn map(&self, bio: Bio) {
        let changes = matches!(bio.op, Op::Write | Op::WriteZeroes | Op::Discard);
        if changes && bio.len > 0 {
            for snap in snapshots_of(&self.dev.dev) {
                let cb = snap.chunk_bytes();
                for chunk in bio.offset / cb..=(bio.offset + bio.len - 1) / cb {
                    snap.keep_for_origin(chunk);
                }
            }
        }
        self.dev.dev.submit(bio);
    }

    fn table(&self) -> String {
        self.dev.to_string()
    }

    fn features(&self) -> Features {
        self.dev.dev.features()
    }
}
