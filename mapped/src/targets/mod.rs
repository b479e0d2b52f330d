//! The target types a table may name. Adding a target is one file here and
//! one line in [`TYPES`].

pub mod cache;
pub mod crypt;
pub mod delay;
pub(crate) mod dust;
pub mod era;
pub(crate) mod error;
pub(crate) mod file;
pub(crate) mod flakey;
pub(crate) mod leaf;
pub(crate) mod linear;
pub mod log_writes;
pub mod memory;
pub mod multipath;
pub mod nbd;
pub(crate) mod null;
pub(crate) mod powercut;
pub(crate) mod snapshot;
pub(crate) mod striped;
pub mod thin;
pub mod throttle;
pub mod verity;
pub(crate) mod zero;

use crate::target::TargetType;

/// Every known target type.
pub static TYPES: &[TargetType] = &[
    zero::TYPE,
    error::TYPE,
    linear::TYPE,
    striped::TYPE,
    null::TYPE,
    memory::TYPE,
    delay::TYPE,
    multipath::TYPE,
    flakey::TYPE,
    dust::TYPE,
    file::TYPE,
    nbd::TYPE,
    log_writes::TYPE,
    thin::pool_target::TYPE,
    thin::thin_target::TYPE,
    snapshot::TYPE,
    powercut::TYPE,
    throttle::TYPE,
    verity::TYPE,
    snapshot::origin::TYPE,
    snapshot::merge::TYPE,
    era::TYPE,
    crypt::TYPE,
    cache::TYPE,
];

/// The target type a table line names (kernel `dm_get_target_type`);
/// `None` for an unknown name.
pub fn lookup(name: &str) -> Option<&'static TargetType> {
    TYPES.iter().find(|t| t.name == name)
}

/// Target types the kernel marks `DM_TARGET_SINGLETON`: alone in their
/// table (dm-mpath.c's `multipath_target`).
pub fn is_singleton(name: &str) -> bool {
    name == "multipath"
}

/// Every target type's name, as `dmsetup targets` lists them.
pub fn names() -> Vec<&'static str> {
    TYPES.iter().map(|t| t.name).collect()
}
