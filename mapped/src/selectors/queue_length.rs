//! `queue-length`: the usable path with the fewest I/Os in flight (kernel
//! dm-ps-queue-length.c). The scan stops at the first idle path, and the
//! chosen path moves to the tail so ties rotate. Per-path arg:
//! `[<repeat_count>]` (values above 1 become 1). Status shows each path's
//! in-flight count.

use super::{
    no_selector_args, repeat_count_arg, PathSelector, SelectorType, StatusType, ValidList,
};
use crate::error::TargetError;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};

/// The `queue-length` selector type (kernel `dm-ps-queue-length.c`).
pub const TYPE: SelectorType = SelectorType {
    name: "queue-length",
    table_args: 1,
    info_args: 1,
    create,
};

const NAME: &str = "queue-length";

struct PathInfo {
    repeat_count: u32,
    /// In-flight I/Os (kernel `atomic_t qlen`).
    qlen: AtomicI64,
}

/// One priority group's queue-length state: the path with the fewest
/// I/Os in flight gets the next one.
pub struct QueueLength {
    valid: Mutex<ValidList>,
    paths: Vec<PathInfo>,
}

fn create(args: &[&str]) -> Result<Box<dyn PathSelector>, TargetError> {
    no_selector_args(NAME, args)?;
    Ok(Box::new(QueueLength {
        valid: Mutex::new(ValidList::default()),
        paths: Vec::new(),
    }))
}

impl PathSelector for QueueLength {
    fn add_path(&mut self, args: &[&str]) -> Result<(), TargetError> {
        let repeat_count = repeat_count_arg(NAME, args)?.min(1);
        let index = self.paths.len();
        self.paths.push(PathInfo {
            repeat_count,
            qlen: AtomicI64::new(0),
        });
        self.valid.get_mut().push_back(index);
        Ok(())
    }

    fn fail_path(&self, path: usize) {
        self.valid.lock().remove(path);
    }

    fn reinstate_path(&self, path: usize) {
        let mut v = self.valid.lock();
        if !v.contains(path) {
            v.push_back(path);
        }
    }

    fn select_path(&self, _nr_bytes: u64) -> Option<usize> {
        let mut v = self.valid.lock();
        let mut best: Option<(usize, i64)> = None;
        for p in v.iter() {
            let q = self.paths[p].qlen.load(Ordering::Relaxed);
            if best.is_none_or(|(_, bq)| q < bq) {
                best = Some((p, q));
            }
            if best.is_some_and(|(_, bq)| bq == 0) {
                break;
            }
        }
        let (p, _) = best?;
        v.move_to_tail(p);
        Some(p)
    }

    fn start_io(&self, path: usize, _nr_bytes: u64) {
        self.paths[path].qlen.fetch_add(1, Ordering::Relaxed);
    }

    fn end_io(&self, path: usize, _nr_bytes: u64, _start_time_ns: u64) {
        self.paths[path].qlen.fetch_sub(1, Ordering::Relaxed);
    }

    fn status(&self, path: Option<usize>, ty: StatusType) -> String {
        match (path, ty) {
            (None, _) => "0 ".to_string(),
            (Some(p), StatusType::Info) => {
                format!("{} ", self.paths[p].qlen.load(Ordering::Relaxed))
            }
            (Some(p), StatusType::Table) => format!("{} ", self.paths[p].repeat_count),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_shortest_queue() {
        let mut s = create(&[]).unwrap();
        for _ in 0..3 {
            s.add_path(&[]).unwrap();
        }
        s.start_io(0, 512);
        s.start_io(0, 512);
        s.start_io(1, 512);
        assert_eq!(s.select_path(512), Some(2));
        s.start_io(2, 512);
        s.start_io(2, 512);
        assert_eq!(s.select_path(512), Some(1));
        assert_eq!(s.status(Some(0), StatusType::Info), "2 ");
        s.end_io(0, 512, 0);
        assert_eq!(s.status(Some(0), StatusType::Info), "1 ");
        s.fail_path(1);
        s.fail_path(0);
        assert_eq!(s.select_path(512), Some(2));
    }
}
