//! Path selectors for the `multipath` target, after the kernel's
//! `struct path_selector_type` (drivers/md/dm-path-selector.h).
//!
//! A selector owns the per-path state of one priority group and answers
//! one question per I/O: which path next. It is told about every I/O's
//! start and end (so load- and latency-based selectors can learn), about
//! path failures and reinstatements, and it renders its part of the
//! target's `status` and `table` text. Paths are named by their index in
//! the group, in the order `add_path` saw them.
//!
//! Each selector is one file with the same shape; adding one is a file
//! here and a line in [`TYPES`]. Selector state sits behind a
//! `parking_lot` mutex where the kernel uses a spinlock, and in atomics
//! where the kernel uses `atomic_t`.

pub mod historical_service_time;
pub mod queue_length;
pub mod round_robin;
pub mod service_time;

use crate::error::TargetError;

/// Which view of the state a `status` call renders (kernel
/// `status_type_t`): live counters for `dmsetup status`, constructor
/// arguments for `dmsetup table`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusType {
    /// `dmsetup status`: the live per-path counters (kernel `STATUSTYPE_INFO`).
    Info,
    /// `dmsetup table`: the per-path constructor arguments (kernel
    /// `STATUSTYPE_TABLE`).
    Table,
}

/// One constructed selector, owning the paths of one priority group.
pub trait PathSelector: Send + Sync {
    /// Register the next path (index = number of paths added before) with
    /// its per-path table arguments. Called only while the table is built.
    fn add_path(&mut self, args: &[&str]) -> Result<(), TargetError>;

    /// Take a path out of selection.
    fn fail_path(&self, path: usize);

    /// Put a failed path back into selection.
    fn reinstate_path(&self, path: usize);

    /// The path for the next I/O of `nr_bytes`, or `None` if no path of
    /// this group is usable.
    fn select_path(&self, nr_bytes: u64) -> Option<usize>;

    /// An I/O of `nr_bytes` was sent down `path`.
    fn start_io(&self, _path: usize, _nr_bytes: u64) {}

    /// An I/O sent down `path` at `start_time_ns` (on the
    /// [`blkstack_core::clock::now_ns`] clock, possibly truncated to a
    /// jiffy by the target's `start_time` feature) has ended.
    fn end_io(&self, _path: usize, _nr_bytes: u64, _start_time_ns: u64) {}

    /// Does `end_io` use its start time? The target only reads the clock
    /// per I/O for selectors that do (the kernel's `PS_NEED_HR_TIMER_FL`
    /// idea: other selectors should not pay for a timestamp).
    fn needs_start_time(&self) -> bool {
        false
    }

    /// The selector's status words, each followed by a space as the
    /// kernel's `DMEMIT` leaves them: for the group when `path` is `None`
    /// (`"<#args> [args]... "`), else for one path.
    fn status(&self, path: Option<usize>, ty: StatusType) -> String;
}

impl std::fmt::Debug for dyn PathSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PathSelector({})",
            self.status(None, StatusType::Table).trim_end()
        )
    }
}

/// A selector constructor: the selector args in, a selector or the
/// reason out.
pub type SelectorCtr = fn(&[&str]) -> Result<Box<dyn PathSelector>, TargetError>;

/// A selector type: its table name, how many per-path words its `status`
/// prints in each view, and its constructor taking the selector args.
pub struct SelectorType {
    /// The name a multipath table line gives (kernel `ps_type->name`).
    pub name: &'static str,
    /// Per-path words in `table` output (kernel `table_args`).
    pub table_args: u32,
    /// Per-path words in `status` output (kernel `info_args`).
    pub info_args: u32,
    /// Builds a selector for one priority group from its arguments (kernel
    /// `ps_type->create`).
    pub create: SelectorCtr,
}

/// Every known selector type.
pub static TYPES: &[SelectorType] = &[
    round_robin::TYPE,
    queue_length::TYPE,
    service_time::TYPE,
    historical_service_time::TYPE,
];

/// The selector type a multipath table names (kernel `dm_get_path_selector`);
/// `None` for an unknown name.
pub fn lookup(name: &str) -> Option<&'static SelectorType> {
    TYPES.iter().find(|t| t.name == name)
}

/// Every selector name, for help texts and error messages.
pub fn names() -> Vec<&'static str> {
    TYPES.iter().map(|t| t.name).collect()
}

/// Parse an unsigned selector argument the way the kernel's
/// `sscanf("%u%c")` accepts it: digits only, nothing after.
/// A per-path number as the kernel's `sscanf(s, "%u%c")` takes it.
pub(crate) fn parse_u32(selector: &str, what: &str, s: &str) -> Result<u32, TargetError> {
    crate::target::parse_sscanf::<u32>(what, s)
        .map_err(|_| TargetError::invalid(format!("{selector} ps: invalid {what} '{s}'")))
}

/// The selector's own arguments: round-robin, queue-length and
/// service-time take none, and their kernel `create` ignores whatever
/// `<#selector args>` counted (dm-ps-round-robin.c `rr_create`), so the
/// table is accepted and prints `0` selector args back.
pub(crate) fn no_selector_args(selector: &str, args: &[&str]) -> Result<(), TargetError> {
    if !args.is_empty() {
        tracing::debug!(
            selector,
            ?args,
            "selector arguments ignored, as the kernel does"
        );
    }
    Ok(())
}

/// The optional `[<repeat_count>]` per-path argument (1 when absent), as
/// written; selectors that cap it, as the kernel's round-robin and
/// queue-length do, cap it themselves.
pub(crate) fn repeat_count_arg(selector: &str, args: &[&str]) -> Result<u32, TargetError> {
    if args.len() > 1 {
        return Err(TargetError::invalid(format!(
            "{selector} ps: incorrect number of arguments: expected at most 1 '[<repeat_count>]', got {}",
            args.len()
        )));
    }
    match args.first() {
        Some(a) => parse_u32(selector, "repeat count", a),
        None => Ok(1),
    }
}

/// The ordered list of usable paths that every kernel selector keeps
/// (`valid_paths`); failed paths are simply absent from it.
#[derive(Debug, Default)]
pub(crate) struct ValidList {
    order: Vec<usize>,
}

impl ValidList {
    pub fn push_back(&mut self, p: usize) {
        self.order.push(p);
    }

    pub fn push_front(&mut self, p: usize) {
        self.order.insert(0, p);
    }

    /// `list_move` to the failed list: drop it from the valid order.
    pub fn remove(&mut self, p: usize) -> bool {
        match self.order.iter().position(|&x| x == p) {
            Some(i) => {
                self.order.remove(i);
                true
            }
            None => false,
        }
    }

    pub fn contains(&self, p: usize) -> bool {
        self.order.contains(&p)
    }

    /// `list_move_tail` of a valid path: least preferred on ties next time.
    pub fn move_to_tail(&mut self, p: usize) {
        if self.remove(p) {
            self.order.push(p);
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.order.iter().copied()
    }

    pub fn first(&self) -> Option<usize> {
        self.order.first().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_is_found_by_name() {
        for t in TYPES {
            assert_eq!(lookup(t.name).map(|x| x.name), Some(t.name));
        }
        assert!(lookup("nosuch").is_none());
    }

    #[test]
    fn valid_list_moves_like_kernel_lists() {
        let mut l = ValidList::default();
        for p in 0..3 {
            l.push_back(p);
        }
        l.move_to_tail(0);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![1, 2, 0]);
        assert!(l.remove(2));
        assert!(!l.remove(2));
        l.push_front(2);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![2, 1, 0]);
        l.move_to_tail(7);
        assert_eq!(l.iter().count(), 3);
    }
}
