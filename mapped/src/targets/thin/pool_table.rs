//! The table of running pools, keyed by their metadata device
//! (dm-thin.c `dm_thin_pool_table`, `__pool_table_lookup_metadata_dev`,
//! `__pool_find`), and the thin-pool targets running each
//! (`__pool_table_lookup`: a `thin` line finds its pool through the pool
//! device's live target, as the kernel finds it by the pool's mapped
//! device; a reloaded `thin-pool` line finds the pool it keeps).
//!
//! Two pools over one metadata device would each keep their own
//! in-memory copy of the btrees and space maps, hand out the same free
//! blocks, and commit over each other: one thin device then reads
//! another's data. The kernel refuses a second pool's constructor with
//! EBUSY; this table lets `pool_ctr` do the same. A pool is in the table
//! while it runs (a `Weak`: it leaves when the last table or thin device
//! holding it drops it, as `__pool_dec` removes it).
//!
//! Devices are keyed by the address of the `Device` they resolve to:
//! the registry hands out one `Arc` per device, and the pool holds it,
//! so the address cannot be reused while the entry is alive.

use super::pool::Pool;
use crate::target::{Target, TargetRef};
use blkstack_core::DeviceRef;
use parking_lot::{Mutex, MutexGuard};
use std::sync::{Arc, Weak};

struct Entry {
    metadata: usize,
    data: usize,
    /// The mapped device whose table holds the pool (`pool->pool_md`).
    owner: String,
    pool: Weak<Pool>,
    /// The thin-pool targets running the pool (of the owner's live and
    /// staged tables).
    targets: Vec<Weak<dyn Target>>,
}

impl Entry {
    fn runs(&self, target: &TargetRef) -> bool {
        // A dead Weak keeps its allocation, so a live target never shares
        // an address with one.
        let want = Arc::as_ptr(target) as *const ();
        self.targets.iter().any(|w| w.as_ptr() as *const () == want)
    }
}

static TABLE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

/// The identity of a device: the address of its shared handle.
pub fn key(dev: &DeviceRef) -> usize {
    Arc::as_ptr(dev) as *const () as usize
}

/// Why `__pool_find` refuses a pool over `metadata` for `owner`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolFindError {
    /// Another mapped device's pool runs over this metadata device.
    #[error("metadata device already in use by a pool")]
    MetadataInUse,
    /// This device's pool runs over this metadata but another data device.
    #[error("data device already in use by a pool")]
    DataInUse,
}

/// The table, held across a constructor's lookup and the start of a new
/// pool (`dm_thin_pool_table.mutex` in `pool_ctr`): two constructors
/// over one metadata device cannot both find it free.
pub struct Table(MutexGuard<'static, Vec<Entry>>);

pub fn lock() -> Table {
    let mut t = TABLE.lock();
    t.retain(|e| e.pool.strong_count() > 0);
    for e in t.iter_mut() {
        e.targets.retain(|w| w.strong_count() > 0);
    }
    Table(t)
}

/// `__pool_table_lookup`: the pool `target` runs, if it is a thin-pool
/// target.
pub fn lookup(target: &TargetRef) -> Option<Arc<Pool>> {
    lock().by_target(target)
}

impl Table {
    /// `__pool_find`'s first case: a running pool over `metadata`
    /// belongs to `owner` and uses `data`, or there is none. Returns
    /// that pool, if any.
    pub fn find(
        &self,
        metadata: &DeviceRef,
        data: &DeviceRef,
        owner: &str,
    ) -> Result<Option<Arc<Pool>>, PoolFindError> {
        let Some(e) = self.0.iter().find(|e| e.metadata == key(metadata)) else {
            return Ok(None);
        };
        let Some(pool) = e.pool.upgrade() else {
            return Ok(None);
        };
        if e.owner != owner {
            return Err(PoolFindError::MetadataInUse);
        }
        if e.data != key(data) {
            return Err(PoolFindError::DataInUse);
        }
        Ok(Some(pool))
    }

    /// `__pool_table_insert`: a pool just created for `owner`.
    pub fn insert(&mut self, pool: &Arc<Pool>, owner: &str) {
        self.0.push(Entry {
            metadata: key(&pool.shared.metadata_dev.dev),
            data: key(&pool.shared.data_dev.dev),
            owner: owner.to_string(),
            pool: Arc::downgrade(pool),
            targets: Vec::new(),
        });
    }

    /// [`lookup`] under a lock already held.
    pub fn by_target(&self, target: &TargetRef) -> Option<Arc<Pool>> {
        self.0
            .iter()
            .find(|e| e.runs(target))
            .and_then(|e| e.pool.upgrade())
    }

    /// A thin-pool target just built over `pool`, which must be in the
    /// table (inserted when it started).
    pub fn add_target(&mut self, pool: &Arc<Pool>, target: &TargetRef) {
        let want = Arc::as_ptr(pool);
        if let Some(e) = self.0.iter_mut().find(|e| e.pool.as_ptr() == want) {
            e.targets.push(Arc::downgrade(target));
        }
    }
}
