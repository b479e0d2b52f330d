//! `memory [key=value...]`: a sparse RAM disk that really stores data, as
//! a table target; see `blkstack_drivers::memory`.
//!
//! Its data lives only in RAM, so the target hands its pages over across
//! a reload itself, as dm keeps the underlying device across a table
//! swap: a reloaded line with the same start and length takes the live
//! target's page store (found through [`HandOff`], keyed by the live
//! target, as dm-thin finds a pool through its pool table), and
//! [`ram_lost`] names the lines whose written pages a reload, resume or
//! remove would drop, which the registry refuses unless forced. Nothing
//! of this is known to the generic layer (`Target`, `Table`).

use super::leaf::{leaf_type, LeafDriver, LeafTarget};
use crate::error::{RamLoss, TargetError};
use crate::table::Table;
use crate::target::{CtrContext, Target, TargetRef, TargetType};
use blkstack_drivers::memory::{MemoryDevice, PageStore, PAGE_SIZE};
use parking_lot::Mutex;
use std::sync::{Arc, Weak};

/// The process-wide budget of RAM every `memory` target draws on (serve's
/// `--memory-limit`) and the size syntax of `max_alloc=`, for frontends,
/// which reach the leaf drivers only through this crate.
pub use blkstack_drivers::memory::{parse_alloc_size, process_budget, AllocBudget};

/// The `memory` target type: a RAM-backed leaf device from `blkstack-drivers`.
pub const TYPE: TargetType = leaf_type("memory", ctr);

/// One running memory target and its pages.
struct Held {
    target: Weak<dyn Target>,
    store: Weak<PageStore>,
    len_bytes: u64,
}

/// The running memory targets, to find a target's pages by the target
/// (the live one a reload replaces, or one of a table being checked).
struct HandOff(Vec<Held>);

static HAND_OFF: Mutex<HandOff> = Mutex::new(HandOff(Vec::new()));

impl HandOff {
    /// The pages of `target`, if it is a running memory target.
    fn store_of(&self, target: &TargetRef) -> Option<(Arc<PageStore>, u64)> {
        // A dead Weak keeps its allocation, so a live target never shares
        // an address with one.
        let want = Arc::as_ptr(target) as *const ();
        let held = self
            .0
            .iter()
            .find(|h| h.target.as_ptr() as *const () == want)?;
        Some((held.store.upgrade()?, held.len_bytes))
    }

    fn insert(&mut self, target: &TargetRef, store: &Arc<PageStore>, len_bytes: u64) {
        self.0.retain(|h| h.target.strong_count() > 0);
        self.0.push(Held {
            target: Arc::downgrade(target),
            store: Arc::downgrade(store),
            len_bytes,
        });
    }
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    let len_bytes = ctx.len_bytes();
    // The live table's memory line at this start, if it has this length:
    // its pages carry over.
    let kept = ctx
        .live_target
        .as_ref()
        .and_then(|t| HAND_OFF.lock().store_of(t))
        .filter(|(_, len)| *len == len_bytes)
        .map(|(store, _)| store);
    let driver =
        MemoryDevice::from_args_with_store(len_bytes, args, kept).map_err(TargetError::driver)?;
    let store = driver.shared_store();
    let target: TargetRef = Arc::new(LeafTarget { driver });
    HAND_OFF.lock().insert(&target, &store, len_bytes);
    Ok(target)
}

/// The lines of `live` holding written pages that `next` (a new table;
/// `None` for removal) does not keep.
pub fn ram_lost(live: &Table, next: Option<&Table>) -> Vec<RamLoss> {
    let hand_off = HAND_OFF.lock();
    let kept = |store: &Arc<PageStore>| {
        next.is_some_and(|t| {
            t.entries
                .iter()
                .filter_map(|e| hand_off.store_of(&e.target))
                .any(|(s, _)| Arc::ptr_eq(&s, store))
        })
    };
    live.entries
        .iter()
        .filter_map(|e| {
            let (store, _) = hand_off.store_of(&e.target)?;
            let bytes = store.allocated_pages() * PAGE_SIZE;
            (bytes > 0 && !kept(&store)).then(|| RamLoss {
                line: e.line.to_text(),
                bytes,
            })
        })
        .collect()
}

/// A leaf target submitting to the engine's `Disk` the device derefs to.
impl LeafDriver for MemoryDevice {
    type Device = <MemoryDevice as std::ops::Deref>::Target;
    fn device(&self) -> &Self::Device {
        self
    }
    fn status(&self) -> String {
        MemoryDevice::status(self)
    }
    fn table_args(&self) -> String {
        MemoryDevice::table_args(self)
    }
}
