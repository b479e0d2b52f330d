//! Bio prison cells for the cache target's migrations
//! (`drivers/md/dm-bio-prison-v2.c` as `dm-cache-target.c` uses it): a
//! migration locks its origin block, and bios to a locked block wait in
//! the cell until it is unlocked, then are mapped again (never served
//! from a copy half made, never lost).
//!
//! Two lock levels, as the kernel's `WRITE_LOCK_LEVEL` and
//! `READ_WRITE_LOCK_LEVEL`: while the copy runs only writes wait (the
//! data being copied cannot change, reads of it are served), around the
//! metadata change both wait. The kernel's cells also count the shared
//! holders (bios in flight) to quiesce; here the target counts those per
//! cache block and per origin block (`io.rs`) and the migration waits for
//! them, so a cell only holds the lock and the waiting bios.
//!
//! Written by hand: a map of small per-block records, generic over what
//! waits so the logic is tested without devices.

use foldhash::HashMap;

/// How much of the I/O to a locked block waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Writes wait, reads go on (`WRITE_LOCK_LEVEL`).
    Writes,
    /// Reads and writes wait (`READ_WRITE_LOCK_LEVEL`).
    All,
}

struct Cell<T> {
    level: Level,
    /// The held bios in arrival order, each with whether it writes.
    waiting: Vec<(bool, T)>,
}

/// The cells of the blocks under migration (`struct dm_bio_prison_v2`).
pub struct Cells<T> {
    map: HashMap<u64, Cell<T>>,
}

impl<T> Default for Cells<T> {
    fn default() -> Self {
        Cells {
            map: HashMap::default(),
        }
    }
}

impl<T> Cells<T> {
    /// `dm_cell_lock_v2`: lock `block` at `level`; false if another
    /// holder has it (the caller waits for its unlock).
    pub fn lock(&mut self, block: u64, level: Level) -> bool {
        if self.map.contains_key(&block) {
            return false;
        }
        self.map.insert(
            block,
            Cell {
                level,
                waiting: Vec::new(),
            },
        );
        true
    }

    /// Whether a bio to `block` (a write if `write`) must wait.
    pub fn holds(&self, block: u64, write: bool) -> bool {
        self.map
            .get(&block)
            .is_some_and(|c| write || c.level == Level::All)
    }

    /// Hold `item` in `block`'s cell (after [`Cells::holds`] said so).
    /// Given back if the block is not locked.
    pub fn wait(&mut self, block: u64, write: bool, item: T) -> Option<T> {
        match self.map.get_mut(&block) {
            Some(c) => {
                c.waiting.push((write, item));
                None
            }
            None => Some(item),
        }
    }

    /// Lower the lock to [`Level::Writes`]: the reads that waited go on
    /// (returned in arrival order); the writes keep waiting.
    pub fn downgrade(&mut self, block: u64) -> Vec<T> {
        let Some(c) = self.map.get_mut(&block) else {
            return Vec::new();
        };
        c.level = Level::Writes;
        let (writes, reads): (Vec<_>, Vec<_>) = c.waiting.drain(..).partition(|(w, _)| *w);
        c.waiting = writes;
        reads.into_iter().map(|(_, t)| t).collect()
    }

    /// `dm_cell_lock_promote_v2`: raise the lock to [`Level::All`].
    pub fn upgrade(&mut self, block: u64) {
        if let Some(c) = self.map.get_mut(&block) {
            c.level = Level::All;
        }
    }

    /// `dm_cell_unlock_v2`: drop the lock, giving back everything held
    /// in arrival order.
    pub fn unlock(&mut self, block: u64) -> Vec<T> {
        self.map
            .remove(&block)
            .map(|c| c.waiting.into_iter().map(|(_, t)| t).collect())
            .unwrap_or_default()
    }

    /// No block is locked.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One migration's steps in program order, as `migrate.rs` runs them.
    #[derive(Clone, Copy, Debug)]
    enum Mg {
        Lock,
        Downgrade,
        Upgrade,
        Unlock,
    }

    /// Every interleaving of one migration's four steps with a read and a
    /// write arriving: no write goes on while the block is locked, no read
    /// while it is locked at `All`, and every bio goes on exactly once.
    #[test]
    fn every_interleaving_of_a_migration_with_a_read_and_a_write() {
        let mg = [Mg::Lock, Mg::Downgrade, Mg::Upgrade, Mg::Unlock];
        // Positions of the read (r) and the write (w) among the 6 slots.
        let mut runs = 0;
        for r in 0..6 {
            for w in 0..6 {
                if r == w {
                    continue;
                }
                run_interleaving(&mg, r, w);
                runs += 1;
            }
        }
        assert_eq!(runs, 30);
    }

    fn run_interleaving(mg: &[Mg; 4], r: usize, w: usize) {
        let mut cells: Cells<&'static str> = Cells::default();
        let mut went: Vec<(&str, &str)> = Vec::new();
        let mut state = "unlocked";
        let mut steps = mg.iter();
        for slot in 0..6 {
            if slot == r || slot == w {
                let (name, write) = if slot == r {
                    ("read", false)
                } else {
                    ("write", true)
                };
                if cells.holds(7, write) {
                    assert!(cells.wait(7, write, name).is_none());
                } else {
                    went.push((name, state));
                }
                continue;
            }
            match steps.next().expect("four steps") {
                Mg::Lock => {
                    assert!(cells.lock(7, Level::All));
                    assert!(!cells.lock(7, Level::All), "a second holder waits");
                    state = "all";
                }
                Mg::Downgrade => {
                    state = "writes";
                    for b in cells.downgrade(7) {
                        assert_eq!(b, "read", "only reads go on at Writes");
                        went.push((b, state));
                    }
                }
                Mg::Upgrade => {
                    cells.upgrade(7);
                    state = "all";
                }
                Mg::Unlock => {
                    state = "unlocked";
                    for b in cells.unlock(7) {
                        went.push((b, state));
                    }
                    assert!(cells.is_empty());
                }
            }
        }
        let mut names: Vec<&str> = went.iter().map(|(n, _)| *n).collect();
        names.sort_unstable();
        assert_eq!(names, ["read", "write"], "r={r} w={w}: {went:?}");
        for (name, at) in &went {
            match *name {
                "write" => assert_eq!(*at, "unlocked", "r={r} w={w}: {went:?}"),
                _ => assert_ne!(*at, "all", "r={r} w={w}: {went:?}"),
            }
        }
    }

    #[test]
    fn held_bios_come_back_in_arrival_order() {
        let mut cells = Cells::default();
        assert!(cells.lock(1, Level::All));
        for (i, write) in [(0, true), (1, false), (2, true), (3, false)] {
            assert!(cells.holds(1, write));
            assert!(cells.wait(1, write, i).is_none());
        }
        assert!(!cells.holds(2, true), "other blocks are free");
        assert_eq!(cells.wait(2, true, 9), Some(9));
        assert_eq!(cells.downgrade(1), [1, 3]);
        assert!(!cells.holds(1, false) && cells.holds(1, true));
        cells.upgrade(1);
        assert!(cells.holds(1, false));
        assert_eq!(cells.unlock(1), [0, 2]);
        assert!(cells.is_empty());
    }
}
