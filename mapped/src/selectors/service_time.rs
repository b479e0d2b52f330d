//! `service-time`: the path whose in-flight bytes plus this I/O, divided
//! by its relative throughput, is smallest (kernel dm-ps-service-time.c).
//! Per-path args: `[<repeat_count> [<relative_throughput>]]`, throughput
//! in 0..=100 (0: use only when no positive-throughput path is usable).
//!
//! `compare_load` keeps the kernel's integer arithmetic, including its
//! casts of differences to `int`, so ties and near-ties resolve the same.

use super::{no_selector_args, parse_u32, PathSelector, SelectorType, StatusType, ValidList};
use crate::error::TargetError;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// The `service-time` selector type (kernel `dm-ps-service-time.c`).
pub const TYPE: SelectorType = SelectorType {
    name: "service-time",
    table_args: 2,
    info_args: 2,
    create,
};

const NAME: &str = "service-time";
const MAX_RELATIVE_THROUGHPUT: u32 = 100;
const MAX_RELATIVE_THROUGHPUT_SHIFT: u32 = 7;
const MAX_INFLIGHT_SIZE: u64 = u64::MAX >> MAX_RELATIVE_THROUGHPUT_SHIFT;

struct PathInfo {
    repeat_count: u32,
    relative_throughput: u32,
    in_flight_size: AtomicU64,
}

/// One priority group's service-time state: the path whose in-flight
/// bytes divided by its relative throughput is smallest gets the next I/O.
pub struct ServiceTime {
    valid: Mutex<ValidList>,
    paths: Vec<PathInfo>,
}

fn create(args: &[&str]) -> Result<Box<dyn PathSelector>, TargetError> {
    no_selector_args(NAME, args)?;
    Ok(Box::new(ServiceTime {
        valid: Mutex::new(ValidList::default()),
        paths: Vec::new(),
    }))
}

impl ServiceTime {
    /// Kernel `st_compare_load`: < 0 if `p1` is better for an I/O of
    /// `incoming` bytes, > 0 if `p2` is.
    fn compare_load(&self, p1: usize, p2: usize, incoming: u64) -> i32 {
        let (a, b) = (&self.paths[p1], &self.paths[p2]);
        let mut sz1 = a.in_flight_size.load(Ordering::Relaxed);
        let mut sz2 = b.in_flight_size.load(Ordering::Relaxed);
        let (rt1, rt2) = (a.relative_throughput, b.relative_throughput);
        // Case 1: same throughput: the less loaded path.
        if rt1 == rt2 {
            return sz1.wrapping_sub(sz2) as i32;
        }
        // Case 2: same load, or one path without throughput: the faster.
        if sz1 == sz2 || rt1 == 0 || rt2 == 0 {
            return rt2.wrapping_sub(rt1) as i32;
        }
        // Case 3: (sz + incoming) / rt compared without dividing.
        sz1 = sz1.wrapping_add(incoming);
        sz2 = sz2.wrapping_add(incoming);
        if sz1 >= MAX_INFLIGHT_SIZE || sz2 >= MAX_INFLIGHT_SIZE {
            sz1 >>= MAX_RELATIVE_THROUGHPUT_SHIFT;
            sz2 >>= MAX_RELATIVE_THROUGHPUT_SHIFT;
        }
        let st1 = sz1.wrapping_mul(rt2 as u64);
        let st2 = sz2.wrapping_mul(rt1 as u64);
        if st1 != st2 {
            return st1.wrapping_sub(st2) as i32;
        }
        // Case 4: equal service time: the faster.
        rt2.wrapping_sub(rt1) as i32
    }
}

impl PathSelector for ServiceTime {
    fn add_path(&mut self, args: &[&str]) -> Result<(), TargetError> {
        if args.len() > 2 {
            return Err(TargetError::invalid(format!(
                "{NAME} ps: incorrect number of arguments: expected at most 2 '[<repeat_count> [<relative_throughput>]]', got {}",
                args.len()
            )));
        }
        let repeat_count = match args.first() {
            Some(a) => parse_u32(NAME, "repeat count", a)?.min(1),
            None => 1,
        };
        let relative_throughput = match args.get(1) {
            Some(a) => {
                let v = parse_u32(NAME, "relative_throughput value", a)?;
                if v > MAX_RELATIVE_THROUGHPUT {
                    return Err(TargetError::invalid(format!(
                        "{NAME} ps: invalid relative_throughput value {v}: must be 0..={MAX_RELATIVE_THROUGHPUT}"
                    )));
                }
                v
            }
            None => 1,
        };
        let index = self.paths.len();
        self.paths.push(PathInfo {
            repeat_count,
            relative_throughput,
            in_flight_size: AtomicU64::new(0),
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

    fn select_path(&self, nr_bytes: u64) -> Option<usize> {
        let mut v = self.valid.lock();
        let mut best: Option<usize> = None;
        for p in v.iter() {
            if best.is_none_or(|b| self.compare_load(p, b, nr_bytes) < 0) {
                best = Some(p);
            }
        }
        let p = best?;
        // Most recently used becomes least preferred, to balance ties.
        v.move_to_tail(p);
        Some(p)
    }

    fn start_io(&self, path: usize, nr_bytes: u64) {
        self.paths[path]
            .in_flight_size
            .fetch_add(nr_bytes, Ordering::Relaxed);
    }

    fn end_io(&self, path: usize, nr_bytes: u64, _start_time_ns: u64) {
        self.paths[path]
            .in_flight_size
            .fetch_sub(nr_bytes, Ordering::Relaxed);
    }

    fn status(&self, path: Option<usize>, ty: StatusType) -> String {
        match (path, ty) {
            (None, _) => "0 ".to_string(),
            (Some(p), StatusType::Info) => {
                let pi = &self.paths[p];
                format!(
                    "{} {} ",
                    pi.in_flight_size.load(Ordering::Relaxed) as i32,
                    pi.relative_throughput
                )
            }
            (Some(p), StatusType::Table) => {
                let pi = &self.paths[p];
                format!("{} {} ", pi.repeat_count, pi.relative_throughput)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(paths: &[&[&str]]) -> Box<dyn PathSelector> {
        let mut s = create(&[]).unwrap();
        for a in paths {
            s.add_path(a).unwrap();
        }
        s
    }

    #[test]
    fn weighs_in_flight_bytes_by_relative_throughput() {
        // Path 0 is four times as fast as path 1.
        let s = st(&[&["1", "4"], &["1", "1"]]);
        // Empty and equal load: the faster path.
        assert_eq!(s.select_path(4096), Some(0));
        // Path 0 with 3 I/Os in flight still finishes a 4th sooner than
        // idle path 1: (3+1)*4096/4 = 4096 vs 4096/1: tie, faster wins.
        for _ in 0..3 {
            s.start_io(0, 4096);
        }
        assert_eq!(s.select_path(4096), Some(0));
        s.start_io(0, 4096);
        // 5*4096/4 > 4096/1: path 1 now.
        assert_eq!(s.select_path(4096), Some(1));
        assert_eq!(s.status(Some(0), StatusType::Info), "16384 4 ");
        assert_eq!(s.status(Some(1), StatusType::Table), "1 1 ");
    }

    #[test]
    fn zero_throughput_is_a_last_resort() {
        let s = st(&[&["1", "0"], &["1", "1"]]);
        for _ in 0..10 {
            s.start_io(1, 4096);
        }
        assert_eq!(s.select_path(4096), Some(1));
        s.fail_path(1);
        assert_eq!(s.select_path(4096), Some(0));
    }

    #[test]
    fn bad_path_args_are_named() {
        let mut s = create(&[]).unwrap();
        assert!(s
            .add_path(&["1", "101"])
            .unwrap_err()
            .report()
            .contains("relative_throughput"));
        assert!(s
            .add_path(&["1", "2", "3"])
            .unwrap_err()
            .report()
            .contains("incorrect number"));
    }
}
