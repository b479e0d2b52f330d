//! `round-robin`: each I/O goes to the next usable path in turn (kernel
//! dm-ps-round-robin.c). Per-path arg: `[<repeat_count>]`, where values
//! above 1 are accepted and replaced by 1, as the kernel has done since it
//! deprecated request repetition. A reinstated path goes to the head of
//! the rotation (the kernel's `list_move`, not `list_move_tail`).

use super::{
    no_selector_args, repeat_count_arg, PathSelector, SelectorType, StatusType, ValidList,
};
use crate::error::TargetError;
use parking_lot::Mutex;

/// The `round-robin` selector type (kernel `dm-ps-round-robin.c`).
pub const TYPE: SelectorType = SelectorType {
    name: "round-robin",
    table_args: 1,
    info_args: 0,
    create,
};

const NAME: &str = "round-robin";

/// One priority group's round-robin state: paths take turns, each for
/// its `repeat_count` I/Os.
pub struct RoundRobin {
    valid: Mutex<ValidList>,
    repeat_count: Vec<u32>,
}

fn create(args: &[&str]) -> Result<Box<dyn PathSelector>, TargetError> {
    no_selector_args(NAME, args)?;
    Ok(Box::new(RoundRobin {
        valid: Mutex::new(ValidList::default()),
        repeat_count: Vec::new(),
    }))
}

impl PathSelector for RoundRobin {
    fn add_path(&mut self, args: &[&str]) -> Result<(), TargetError> {
        let repeat = repeat_count_arg(NAME, args)?.min(1);
        let index = self.repeat_count.len();
        self.repeat_count.push(repeat);
        self.valid.get_mut().push_back(index);
        Ok(())
    }

    fn fail_path(&self, path: usize) {
        self.valid.lock().remove(path);
    }

    fn reinstate_path(&self, path: usize) {
        let mut v = self.valid.lock();
        if !v.contains(path) {
            v.push_front(path);
        }
    }

    fn select_path(&self, _nr_bytes: u64) -> Option<usize> {
        let mut v = self.valid.lock();
        let p = v.first()?;
        v.move_to_tail(p);
        Some(p)
    }

    fn status(&self, path: Option<usize>, ty: StatusType) -> String {
        match (path, ty) {
            (None, _) => "0 ".to_string(),
            (Some(_), StatusType::Info) => String::new(),
            (Some(p), StatusType::Table) => format!("{} ", self.repeat_count[p]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rr(n: usize) -> Box<dyn PathSelector> {
        let mut s = create(&[]).unwrap();
        for _ in 0..n {
            s.add_path(&[]).unwrap();
        }
        s
    }

    #[test]
    fn rotates_and_skips_failed_paths() {
        let s = rr(3);
        let picks: Vec<_> = (0..6).map(|_| s.select_path(4096).unwrap()).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        s.fail_path(1);
        let picks: Vec<_> = (0..4).map(|_| s.select_path(4096).unwrap()).collect();
        assert_eq!(picks, vec![0, 2, 0, 2]);
        s.reinstate_path(1);
        assert_eq!(s.select_path(4096), Some(1));
        s.fail_path(0);
        s.fail_path(1);
        s.fail_path(2);
        assert_eq!(s.select_path(4096), None);
    }

    #[test]
    fn repeat_count_above_one_becomes_one_and_bad_args_are_refused_as_in_kernel() {
        let mut s = create(&[]).unwrap();
        s.add_path(&["5"]).unwrap();
        assert_eq!(s.status(Some(0), StatusType::Table), "1 ");
        assert!(s
            .add_path(&["x"])
            .unwrap_err()
            .report()
            .contains("invalid repeat count"));
        assert!(s
            .add_path(&["1", "2"])
            .unwrap_err()
            .report()
            .contains("incorrect number"));
        assert!(s.add_path(&["+1"]).is_err(), "sscanf %u takes no sign");
        // Selector arguments are ignored, as rr_create ignores them.
        assert_eq!(
            create(&["1"]).unwrap().status(None, StatusType::Table),
            "0 "
        );
    }
}
