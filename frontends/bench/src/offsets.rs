//! Which I/O comes next: direction (`rw`, `rwmixread`), size (`bs`,
//! `bssplit`) and offset (sequential, random, random without repeats).
//!
//! fio's random map (`norandommap` off) guarantees that random I/O touches
//! every block once per pass over the region; fio keeps a bitmap (axmap)
//! for that. Here a keyed Feistel permutation of the block indices does the
//! same with no memory: block `perm(i)` for `i = 0..n` visits each block
//! exactly once, and a new key starts the next pass (time based jobs run
//! several passes). Cycle-walking keeps the permutation inside `0..n`.
//! With `bssplit` the map is over units of the smallest block size and an
//! offset is aligned down to the chosen size, so coverage is exact only for
//! a single block size (fio has the same limit for mixed sizes).
//!
//! `randrepeat=1` (the default) seeds every generator from `randseed` and
//! the job's thread number, so a rerun issues the same sequence.

use crate::engine::{Geometry, Req};
use crate::spec::{JobSpec, RwMode};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// A bijection on `0..n` from a 4-round Feistel network on the smallest
/// even number of bits covering `n`.
struct Permutation {
    n: u64,
    half_bits: u32,
    half_mask: u64,
    keys: [u64; 4],
    next_index: u64,
}

impl Permutation {
    fn new(n: u64, rng: &mut SmallRng) -> Permutation {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        Permutation {
            n,
            half_bits,
            half_mask: (1u64 << half_bits) - 1,
            keys: rng.gen(),
            next_index: 0,
        }
    }

    #[inline]
    fn round(r: u64, key: u64) -> u64 {
        // A cheap 64-bit mixer (splitmix64 finaliser).
        let mut z = r ^ key;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    #[inline]
    fn feistel(&self, x: u64) -> u64 {
        let mut l = x >> self.half_bits;
        let mut r = x & self.half_mask;
        for &k in &self.keys {
            let nl = r;
            r = l ^ (Self::round(r, k) & self.half_mask);
            l = nl;
        }
        (l << self.half_bits) | r
    }

    /// The next block index of this pass; starts a new pass when done.
    #[inline]
    fn next(&mut self, rng: &mut SmallRng) -> u64 {
        if self.next_index >= self.n {
            self.next_index = 0;
            self.keys = rng.gen();
        }
        let mut x = self.next_index;
        self.next_index += 1;
        loop {
            x = self.feistel(x);
            if x < self.n {
                return x;
            }
        }
    }
}

/// The per-thread request generator.
pub(crate) struct IoGen {
    rw: RwMode,
    rwmixread: u32,
    rng: SmallRng,
    /// `(cumulative percent, bytes)`; a single entry for plain `bs`.
    bs_table: Vec<(u32, u64)>,
    start: u64,
    end: u64,
    min_bs: u64,
    /// Next sequential offset per direction (read, write), as fio keeps
    /// one position per direction.
    seq_pos: [u64; 2],
    perm: Option<Permutation>,
}

impl IoGen {
    pub fn new(spec: &JobSpec, g: &Geometry, thread_number: u32) -> IoGen {
        let mut rng = if spec.randrepeat {
            SmallRng::seed_from_u64(
                spec.randseed ^ (thread_number as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            )
        } else {
            SmallRng::from_entropy()
        };
        let mut cum = 0;
        let bs_table = spec
            .bs
            .split
            .iter()
            .map(|&(b, p)| {
                cum += p;
                (cum, b)
            })
            .collect();
        let min_bs = spec.bs.min();
        let perm = if spec.rw.is_random() && !spec.norandommap {
            Some(Permutation::new((g.end - g.start) / min_bs, &mut rng))
        } else {
            None
        };
        IoGen {
            rw: spec.rw,
            rwmixread: spec.rwmixread,
            rng,
            bs_table,
            start: g.start,
            end: g.end,
            min_bs,
            seq_pos: [g.start, g.start],
            perm,
        }
    }

    #[inline]
    fn pick_bs(&mut self) -> u64 {
        if self.bs_table.len() == 1 {
            return self.bs_table[0].1;
        }
        let r = self.rng.gen_range(0..100u32);
        for &(cum, b) in &self.bs_table {
            if r < cum {
                return b;
            }
        }
        self.bs_table[self.bs_table.len() - 1].1
    }

    #[inline]
    pub fn next(&mut self) -> Req {
        let write = match self.rw {
            RwMode::Read | RwMode::RandRead => false,
            RwMode::Write | RwMode::RandWrite => true,
            RwMode::ReadWrite | RwMode::RandRw => self.rng.gen_range(0..100u32) >= self.rwmixread,
        };
        let bs = self.pick_bs();
        let span = self.end - self.start;
        let offset = if !self.rw.is_random() {
            let pos = &mut self.seq_pos[write as usize];
            if *pos + bs > self.end {
                *pos = self.start;
            }
            let off = *pos;
            *pos += bs;
            off
        } else if let Some(perm) = &mut self.perm {
            let idx = perm.next(&mut self.rng);
            let mut rel = idx * self.min_bs;
            rel -= rel % bs;
            if rel + bs > span {
                rel = (span - bs) / bs * bs;
            }
            self.start + rel
        } else {
            let blocks = span / bs;
            self.start + self.rng.gen_range(0..blocks) * bs
        };
        Req {
            write,
            offset,
            len: bs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::BlockSizes;

    fn geom(start: u64, end: u64, bs: u64) -> Geometry {
        Geometry {
            start,
            end,
            dev_size: end,
            unit: bs,
            max_bs: bs,
            io_limit: end - start,
        }
    }

    #[test]
    fn permutation_visits_every_block_once_per_pass() {
        let mut rng = SmallRng::seed_from_u64(1);
        for n in [1u64, 2, 3, 7, 64, 1000, 4097] {
            let mut p = Permutation::new(n, &mut rng);
            for _pass in 0..2 {
                let mut seen = vec![false; n as usize];
                for _ in 0..n {
                    let x = p.next(&mut rng) as usize;
                    assert!(!seen[x], "block {x} twice in one pass of {n}");
                    seen[x] = true;
                }
                assert!(seen.iter().all(|&s| s));
            }
        }
    }

    #[test]
    fn random_offsets_are_aligned_and_in_range() {
        for norandommap in [false, true] {
            let spec = JobSpec {
                rw: RwMode::RandRw,
                bs: BlockSizes::single(4096),
                norandommap,
                ..JobSpec::default()
            };
            let g = geom(1 << 20, 3 << 20, 4096);
            let mut gen = IoGen::new(&spec, &g, 0);
            let (mut reads, mut writes) = (0, 0);
            for _ in 0..5000 {
                let r = gen.next();
                assert_eq!(r.offset % 4096, 0);
                assert!(r.offset >= g.start && r.offset + r.len <= g.end);
                if r.write {
                    writes += 1
                } else {
                    reads += 1
                }
            }
            assert!(reads > 2000 && writes > 2000, "50/50 mix: {reads}/{writes}");
        }
    }

    #[test]
    fn sequential_wraps_and_randrepeat_repeats() {
        let spec = JobSpec {
            rw: RwMode::Write,
            ..JobSpec::default()
        };
        let g = geom(0, 3 * 4096, 4096);
        let mut gen = IoGen::new(&spec, &g, 0);
        let offs: Vec<u64> = (0..4).map(|_| gen.next().offset).collect();
        assert_eq!(offs, vec![0, 4096, 8192, 0]);

        let spec = JobSpec {
            rw: RwMode::RandRead,
            bs: BlockSizes {
                split: vec![(4096, 50), (65536, 50)],
            },
            ..JobSpec::default()
        };
        let g = geom(0, 1 << 20, 4096);
        let a: Vec<Req> = {
            let mut gen = IoGen::new(&spec, &g, 3);
            (0..100).map(|_| gen.next()).collect()
        };
        let b: Vec<Req> = {
            let mut gen = IoGen::new(&spec, &g, 3);
            (0..100).map(|_| gen.next()).collect()
        };
        assert_eq!(a, b);
        assert!(a
            .iter()
            .all(|r| r.offset % r.len == 0 && r.offset + r.len <= 1 << 20));
        assert!(a.iter().any(|r| r.len == 65536) && a.iter().any(|r| r.len == 4096));
    }
}
