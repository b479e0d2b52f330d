//! `zonemode=zbd` on a device that is not zoned: fio's zone emulation
//! (`zbd.c` `init_zone_info`), sequential-write-required zones of
//! `zonesize` with a write pointer each.
//!
//! As in fio, every job on the same device shares the zones' write
//! pointers (fio keeps one `zoned_block_device_info` per file). A write
//! goes at its zone's write pointer, which moves on when the write is
//! issued (fio advances it under the zone lock at issue); a random write
//! picks among at most `max_open_zones` open zones; a trim resets the
//! zones it covers; a read goes below a zone's write pointer
//! (`read_beyond_wp=0`, fio's default). When every zone of the job's
//! region is full, the zone a write picked is reset first, as a
//! garbage-collecting host would (fio's `zone_reset_threshold` policy;
//! the thresholds themselves are not modelled).

use rand::rngs::SmallRng;
use rand::Rng;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The emulated zones of one device.
pub(crate) struct ZoneSet {
    zone_size: u64,
    wp: Mutex<Vec<u64>>,
}

/// The zones of `device` for `zone_size`, shared by every job on it.
pub(crate) fn zone_set(device: &str, dev_size: u64, zone_size: u64) -> Arc<ZoneSet> {
    type Sets = Mutex<HashMap<(String, u64), Arc<ZoneSet>>>;
    static SETS: OnceLock<Sets> = OnceLock::new();
    let sets = SETS.get_or_init(Default::default);
    let mut g = sets.lock().unwrap_or_else(|e| e.into_inner());
    g.entry((device.to_string(), zone_size))
        .or_insert_with(|| {
            let n = dev_size.div_ceil(zone_size);
            Arc::new(ZoneSet {
                zone_size,
                wp: Mutex::new((0..n).map(|i| i * zone_size).collect()),
            })
        })
        .clone()
}

/// A job thread's view: its region's zones and its open zones.
pub(crate) struct ZoneCursor {
    set: Arc<ZoneSet>,
    first: usize,
    last: usize,
    max_open: usize,
    open: Vec<usize>,
    /// Zone of the next sequential read and write.
    seq_zone: [usize; 2],
    read_pos: u64,
    read_beyond_wp: bool,
}

impl ZoneCursor {
    pub fn new(set: Arc<ZoneSet>, start: u64, end: u64, max_open: u32, beyond: bool) -> ZoneCursor {
        let zs = set.zone_size;
        let first = (start / zs) as usize;
        let last = (end.div_ceil(zs) as usize).max(first + 1);
        ZoneCursor {
            set,
            first,
            last,
            max_open: if max_open == 0 {
                usize::MAX
            } else {
                max_open as usize
            },
            open: Vec::new(),
            seq_zone: [first; 2],
            read_pos: 0,
            read_beyond_wp: beyond,
        }
    }

    fn zone_start(&self, z: usize) -> u64 {
        z as u64 * self.set.zone_size
    }

    /// Offset for a `bs`-byte write: at a zone's write pointer.
    pub fn write(&mut self, bs: u64, random: bool, rng: &mut SmallRng) -> u64 {
        let zs = self.set.zone_size;
        let mut wp = self.set.wp.lock().unwrap_or_else(|e| e.into_inner());
        let fits = |wp: &Vec<u64>, z: usize| wp[z] + bs <= z as u64 * zs + zs;
        let z = if random {
            self.open.retain(|&o| fits(&wp, o));
            if self.open.len() < self.max_open {
                let n = self.last - self.first;
                let pick = self.first + rng.gen_range(0..n);
                // The first zone from `pick` on with room.
                if let Some(f) = (0..n)
                    .map(|i| self.first + (pick - self.first + i) % n)
                    .find(|&z| fits(&wp, z))
                {
                    if !self.open.contains(&f) {
                        self.open.push(f);
                    }
                }
            }
            match self.open.len() {
                0 => self.first + rng.gen_range(0..self.last - self.first),
                n => self.open[rng.gen_range(0..n)],
            }
        } else {
            let mut z = self.seq_zone[1];
            let mut tried = 0;
            while !fits(&wp, z) && tried < self.last - self.first {
                z = if z + 1 >= self.last {
                    self.first
                } else {
                    z + 1
                };
                tried += 1;
            }
            self.seq_zone[1] = z;
            z
        };
        if !fits(&wp, z) {
            // Every zone is full: reset this one (host garbage collection).
            wp[z] = self.zone_start(z);
        }
        let off = wp[z];
        wp[z] += bs;
        off
    }

    /// Offset for a `bs`-byte read below a write pointer; `None` when no
    /// zone of the region holds `bs` bytes of data.
    pub fn read(&mut self, bs: u64, random: bool, rng: &mut SmallRng) -> Option<u64> {
        let wp = self.set.wp.lock().unwrap_or_else(|e| e.into_inner());
        let zs = self.set.zone_size;
        let data = |z: usize| {
            if self.read_beyond_wp {
                zs
            } else {
                wp[z] - self.zone_start(z)
            }
        };
        let n = self.last - self.first;
        let from = if random {
            self.first + rng.gen_range(0..n)
        } else {
            self.seq_zone[0]
        };
        let z = (0..n)
            .map(|i| self.first + (from - self.first + i) % n)
            .find(|&z| data(z) >= bs)?;
        let (zstart, zdata) = (self.zone_start(z), data(z));
        drop(wp);
        let off = if random {
            zstart + rng.gen_range(0..zdata / bs) * bs
        } else {
            if self.read_pos < zstart || self.read_pos + bs > zstart + zdata {
                self.read_pos = zstart;
            }
            let off = self.read_pos;
            self.read_pos += bs;
            if self.read_pos + bs > zstart + zdata {
                self.seq_zone[0] = if z + 1 >= self.last {
                    self.first
                } else {
                    z + 1
                };
            }
            off
        };
        Some(off)
    }

    /// A trim from `offset` for `len` bytes: reset the zones it covers.
    pub fn trim(&mut self, offset: u64, len: u64) {
        let zs = self.set.zone_size;
        let mut wp = self.set.wp.lock().unwrap_or_else(|e| e.into_inner());
        let first = (offset / zs) as usize;
        let last = ((offset + len).div_ceil(zs) as usize).min(wp.len());
        for (z, w) in wp.iter_mut().enumerate().take(last).skip(first) {
            *w = z as u64 * zs;
        }
        self.open.retain(|&o| o < first || o >= last);
    }

    /// The start of a random zone of the region (random trims).
    pub fn random_zone(&self, rng: &mut SmallRng) -> u64 {
        self.zone_start(self.first + rng.gen_range(0..self.last - self.first))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn writes_follow_write_pointers_and_reads_stay_below() {
        let set = zone_set("zbd-test", 1 << 20, 1 << 16);
        let mut rng = SmallRng::seed_from_u64(1);
        let mut c = ZoneCursor::new(set, 0, 1 << 20, 2, false);
        assert_eq!(
            c.read(4096, true, &mut rng),
            None,
            "empty zones hold nothing"
        );
        let a = c.write(4096, false, &mut rng);
        let b = c.write(4096, false, &mut rng);
        assert_eq!((a, b), (0, 4096));
        let r = c.read(4096, true, &mut rng).unwrap();
        assert!(r < 8192);
        for _ in 0..100 {
            let w = c.write(4096, true, &mut rng);
            let zone = w >> 16;
            assert!(c.open.len() <= 2 && c.open.contains(&(zone as usize)) || c.open.is_empty());
        }
        c.trim(0, 1 << 16);
        assert_eq!(c.write(4096, false, &mut rng) >> 16, 0);
    }
}
