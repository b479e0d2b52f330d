//! Which I/O comes next: direction (`rw`, `rwmixread`, trims), size (`bs`
//! per direction, `bssplit`, `bsrange`) and offset (sequential with fio's
//! `rw=MODE:N` skip, random, random without repeats, a
//! `random_distribution`, `percentage_random` mixes, `blockalign`).
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
//! A random job draws a sequential I/O instead with probability
//! `100 - percentage_random` %, and with `rw=randread:N` only every Nth
//! offset is random, the others continuing from it (fio's
//! `should_do_random` and `ddir_seq_nr`). `trimwrite` trims a block, then
//! writes it.
//!
//! `randrepeat=1` (the default) seeds every generator from `randseed` and
//! the job's thread number, so a rerun issues the same sequence.

use crate::distribution::BlockSampler;
use crate::geometry::Geometry;
use crate::spec::{BlockSizes, Ddir, JobSpec, RwMode, RwModifier};
use crate::zbd::{zone_set, ZoneCursor};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// One I/O the generator asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Req {
    pub dir: Ddir,
    pub offset: u64,
    pub len: u64,
}

/// A bijection on `0..n` from a 4-round Feistel network on the smallest
/// number of bits covering `n` (unbalanced when that number is odd: the
/// halves swap widths each round), so cycle-walking back into `0..n`
/// takes fewer than two steps on average.
struct Permutation {
    n: u64,
    /// Width of the high half `a` and the low half `b` (`a >= b`).
    hi_bits: u32,
    lo_bits: u32,
    keys: [u64; 4],
    next_index: u64,
}

impl Permutation {
    fn new(n: u64, rng: &mut SmallRng) -> Permutation {
        let bits = (64 - n.saturating_sub(1).leading_zeros()).max(2);
        Permutation {
            n,
            hi_bits: bits.div_ceil(2),
            lo_bits: bits / 2,
            keys: rng.gen(),
            next_index: 0,
        }
    }

    /// The round function: one multiply by an odd constant, whose high
    /// bits (folded down) depend on every bit of the input. Any function
    /// keeps a Feistel network a bijection; this one only has to scatter.
    #[inline]
    fn round(r: u64, key: u64) -> u64 {
        let z = (r ^ key).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        z ^ (z >> 32)
    }

    #[inline]
    fn feistel(&self, x: u64) -> u64 {
        let mask = |w: u32| (1u64 << w) - 1;
        // (l, r) of widths (wl, wr); a round makes (r, l ^ F(r)), so the
        // widths swap, and after four rounds they are back in place.
        let (mut wl, mut wr) = (self.hi_bits, self.lo_bits);
        let mut l = x >> wr;
        let mut r = x & mask(wr);
        for &k in &self.keys {
            let nr = l ^ (Self::round(r, k) & mask(wl));
            l = r;
            r = nr;
            std::mem::swap(&mut wl, &mut wr);
        }
        (l << wr) | r
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

/// How a direction picks its block size.
enum BsTable {
    /// `(cumulative percent, bytes)`; a single entry for plain `bs`.
    Split(Vec<(u32, u64)>),
    /// `bsrange`: a multiple of `step` in `lo..=hi`.
    Range { lo: u64, hi: u64, step: u64 },
}

impl BsTable {
    fn new(b: &BlockSizes, unaligned: bool, lbs: u64) -> BsTable {
        if let Some((lo, hi)) = b.range {
            let step = if unaligned { lbs.max(1) } else { lo };
            return BsTable::Range { lo, hi, step };
        }
        let mut cum = 0;
        BsTable::Split(
            b.split
                .iter()
                .map(|&(b, p)| {
                    cum += p;
                    (cum, b)
                })
                .collect(),
        )
    }

    #[inline]
    fn pick(&self, rng: &mut SmallRng) -> u64 {
        match self {
            BsTable::Split(t) if t.len() == 1 => t[0].1,
            BsTable::Split(t) => {
                let r = rng.gen_range(0..100u32);
                t.iter().find(|e| r < e.0).unwrap_or(&t[t.len() - 1]).1
            }
            BsTable::Range { lo, hi, step } => {
                let steps = (hi - lo) / step;
                lo + rng.gen_range(0..=steps) * step
            }
        }
    }
}

/// The per-thread request generator.
pub(crate) struct IoGen {
    rw: RwMode,
    rwmixread: u32,
    rng: SmallRng,
    /// Block sizes per direction (read, write, trim).
    bs: [BsTable; 3],
    start: u64,
    end: u64,
    min_bs: u64,
    blockalign: Option<u64>,
    /// Next sequential offset per direction (read, write, trim), as fio
    /// keeps one position per direction.
    seq_pos: [u64; 3],
    /// `rw=MODE:N` on a sequential job: bytes to move past each I/O.
    skip: i64,
    /// `rw=randMODE:N`: I/Os left before the next random offset.
    random_every: u32,
    run_left: u32,
    percentage_random: u32,
    perm: Option<Permutation>,
    sampler: Option<BlockSampler>,
    /// `trimwrite`: the write that follows a trim of the same block.
    pending_write: Option<Req>,
    /// `zonemode=strided`: `(zonesize, zonerange, zoneskip)`, and per
    /// direction the current zone's start and bytes done in it.
    zones: Option<(u64, u64, u64)>,
    zone_start: [u64; 3],
    zone_done: [u64; 3],
    /// `zonemode=zbd`: the emulated zones' write pointers.
    zbd: Option<ZoneCursor>,
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
        let min_bs = g.unit;
        let units = (g.end - g.start) / min_bs;
        let perm = if spec.rw.is_random() && !spec.norandommap && spec.distribution.is_uniform() {
            Some(Permutation::new(units, &mut rng))
        } else {
            None
        };
        let sampler = BlockSampler::new(&spec.distribution, units, min_bs, &mut rng);
        let table = |d: usize| BsTable::new(spec.bs_for(d), spec.bs_unaligned, g.lbs);
        let (skip, random_every) = match spec.rw_modifier {
            RwModifier::None => (0, 1),
            RwModifier::Skip(s) => (s, 1),
            RwModifier::RandomEvery(n) => (0, n.max(1)),
        };
        IoGen {
            rw: spec.rw,
            rwmixread: spec.rwmixread,
            rng,
            bs: [table(0), table(1), table(2)],
            start: g.start,
            end: g.end,
            min_bs,
            blockalign: spec.blockalign,
            // Backwards jobs start from the end (fio).
            seq_pos: [if skip < 0 { g.end } else { g.start }; 3],
            skip,
            random_every,
            run_left: 0,
            percentage_random: spec.percentage_random,
            perm,
            sampler,
            pending_write: None,
            zones: spec.strided_zones.filter(|z| z.0 > 0 && !spec.zbd),
            zone_start: [g.start; 3],
            zone_done: [0; 3],
            zbd: None,
        }
    }

    /// `zonemode=zbd` on `device`: writes, reads and trims follow the
    /// emulated zones of `zone_size`.
    pub fn with_zones(mut self, spec: &JobSpec, device: &str, dev_size: u64) -> IoGen {
        if let (true, Some((zs, _, _))) = (spec.zbd, spec.strided_zones) {
            if zs > 0 {
                let set = zone_set(device, dev_size, zs);
                self.zbd = Some(ZoneCursor::new(
                    set,
                    self.start,
                    self.end,
                    spec.max_open_zones,
                    spec.read_beyond_wp,
                ));
            }
        }
        self
    }

    /// The offset of a zoned I/O, `None` when there is nothing to read.
    fn next_zoned(&mut self, dir: Ddir, bs: u64) -> Option<u64> {
        let random = self.rw.is_random();
        let z = self.zbd.as_mut()?;
        match dir {
            Ddir::Write => Some(z.write(bs, random, &mut self.rng)),
            Ddir::Read => z.read(bs, random, &mut self.rng),
            Ddir::Trim => {
                let off = if random {
                    z.random_zone(&mut self.rng)
                } else {
                    self.seq_pos[2].max(self.start)
                };
                let off = if off + bs > self.end { self.start } else { off };
                self.seq_pos[2] = off + bs;
                z.trim(off, bs);
                Some(off)
            }
        }
    }

    fn pick_dir(&mut self) -> Ddir {
        match self.rw {
            RwMode::Read | RwMode::RandRead => Ddir::Read,
            RwMode::Write | RwMode::RandWrite => Ddir::Write,
            RwMode::Trim | RwMode::RandTrim | RwMode::TrimWrite => Ddir::Trim,
            RwMode::ReadWrite | RwMode::RandRw => {
                if self.rng.gen_range(0..100u32) >= self.rwmixread {
                    Ddir::Write
                } else {
                    Ddir::Read
                }
            }
        }
    }

    /// The next offset in sequence for direction `d`, moving its position.
    fn next_sequential(&mut self, d: usize, bs: u64) -> u64 {
        let pos = self.seq_pos[d];
        let off = if pos < self.start || pos + bs > self.end {
            if self.skip < 0 {
                // Going backwards: from the end, as fio's
                // get_next_seq_offset wraps (end + skip).
                let back = self.end.checked_add_signed(self.skip).unwrap_or(self.start);
                back.clamp(self.start, self.end - bs)
            } else {
                self.start
            }
        } else {
            pos
        };
        // Past the start going backwards: `end` forces the wrap above.
        self.seq_pos[d] = (off + bs)
            .checked_add_signed(self.skip)
            .filter(|&p| p >= self.start)
            .unwrap_or(self.end);
        if let Some((size, range, skip)) = self.zones {
            if off < self.zone_start[d] {
                // Wrapped: the first zone again.
                (self.zone_start[d], self.zone_done[d]) = (self.start, 0);
            }
            self.zone_done[d] += bs;
            if self.zone_done[d] >= size {
                let mut next = self.zone_start[d] + range.max(size) + skip;
                if next + bs > self.end {
                    next = self.start;
                }
                (self.zone_start[d], self.zone_done[d]) = (next, 0);
                self.seq_pos[d] = next;
            }
        }
        off
    }

    /// A random offset for a `bs`-byte I/O, aligned to `blockalign` (the
    /// block size by default).
    fn next_random(&mut self, bs: u64) -> u64 {
        let span = self.end - self.start;
        let align = self.blockalign.unwrap_or(bs).max(1);
        let rel = if let Some(s) = &mut self.sampler {
            s.next(&mut self.rng) * self.min_bs
        } else if let Some(perm) = &mut self.perm {
            perm.next(&mut self.rng) * self.min_bs
        } else {
            let slots = ((span - bs) / align + 1).max(1);
            return self.start + self.rng.gen_range(0..slots) * align;
        };
        let mut rel = rel - rel % align;
        if rel + bs > span {
            rel = (span - bs) / align * align;
        }
        self.start + rel
    }

    /// Should this I/O of a random job be random? (`percentage_random`,
    /// `rw=randMODE:N`.)
    fn take_random(&mut self) -> bool {
        if self.run_left > 0 {
            self.run_left -= 1;
            return false;
        }
        if self.percentage_random < 100 && self.rng.gen_range(0..100u32) >= self.percentage_random {
            return false;
        }
        self.run_left = self.random_every - 1;
        true
    }

    /// The next request; `None` when a zoned read finds no data.
    #[inline]
    pub fn next(&mut self) -> Option<Req> {
        if let Some(w) = self.pending_write.take() {
            return Some(w);
        }
        let dir = self.pick_dir();
        let d = dir as usize;
        let bs = self.bs[d].pick(&mut self.rng);
        let offset = if self.zbd.is_some() {
            self.next_zoned(dir, bs)?
        } else if self.rw.is_random() && self.take_random() {
            let off = self.next_random(bs);
            self.seq_pos[d] = off + bs;
            off
        } else {
            self.next_sequential(d, bs)
        };
        let req = Req {
            dir,
            offset,
            len: bs,
        };
        if self.rw == RwMode::TrimWrite {
            self.pending_write = Some(Req {
                dir: Ddir::Write,
                ..req
            });
        }
        Some(req)
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
            lbs: 512,
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
        // It scatters: few neighbours in a row, as a random order has.
        let n = 1 << 16;
        let mut p = Permutation::new(n, &mut rng);
        let v: Vec<u64> = (0..n).map(|_| p.next(&mut rng)).collect();
        let runs = v.windows(2).filter(|w| w[1] == w[0] + 1).count();
        assert!(runs < (n as usize) / 100, "{runs} neighbours in a row");
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
                let r = gen.next().unwrap();
                assert_eq!(r.offset % 4096, 0);
                assert!(r.offset >= g.start && r.offset + r.len <= g.end);
                if r.dir == Ddir::Write {
                    writes += 1
                } else {
                    reads += 1
                }
            }
            assert!(reads > 2000 && writes > 2000, "50/50 mix: {reads}/{writes}");
        }
    }

    #[test]
    fn modifiers_strides_zones_and_trimwrite() {
        let g = geom(0, 1 << 20, 4096);
        let offs = |spec: &JobSpec, n: usize| -> Vec<(Ddir, u64)> {
            let mut gen = IoGen::new(spec, &g, 0);
            (0..n)
                .map(|_| gen.next().unwrap())
                .map(|r| (r.dir, r.offset))
                .collect()
        };
        // fio's backwards-read.fio: rw=read:-8k with bs=4k steps back 4k.
        let mut back = JobSpec::default();
        back.apply("rw", Some("read:-8k")).unwrap();
        let o = offs(&back, 3);
        assert_eq!(o[1].1, o[0].1 - 4096);
        assert_eq!(o[2].1, o[1].1 - 4096);
        // cross-stripe-verify.fio: rw=write:112k with bs=16k strides 128k.
        let mut fwd = JobSpec::default();
        fwd.apply("rw", Some("write:112k")).unwrap();
        fwd.apply("bs", Some("16k")).unwrap();
        let g16 = geom(0, 1 << 20, 16384);
        let mut gen = IoGen::new(&fwd, &g16, 0);
        let o: Vec<u64> = (0..3).map(|_| gen.next().unwrap().offset).collect();
        assert_eq!(o, vec![0, 131072, 262144]);
        // zonemode=strided: 8k per zone, then skip 16k.
        let mut z = JobSpec::default();
        for (k, v) in [
            ("zonemode", "strided"),
            ("zonesize", "8k"),
            ("zoneskip", "16k"),
        ] {
            z.apply(k, Some(v)).unwrap();
        }
        let o: Vec<u64> = offs(&z, 4).iter().map(|x| x.1).collect();
        assert_eq!(o, vec![0, 4096, 24576, 28672]);
        // trimwrite: a trim, then a write of the same block.
        let mut tw = JobSpec::default();
        tw.apply("rw", Some("trimwrite")).unwrap();
        let o = offs(&tw, 4);
        assert_eq!((o[0].0, o[1].0), (Ddir::Trim, Ddir::Write));
        assert_eq!(o[0].1, o[1].1);
        // percentage_random=0 on a random job is sequential.
        let mut pr = JobSpec::default();
        pr.apply("rw", Some("randread")).unwrap();
        pr.apply("percentage_random", Some("0")).unwrap();
        let o: Vec<u64> = offs(&pr, 3).iter().map(|x| x.1).collect();
        assert_eq!(o, vec![0, 4096, 8192]);
    }

    #[test]
    fn sequential_wraps_and_randrepeat_repeats() {
        let spec = JobSpec {
            rw: RwMode::Write,
            ..JobSpec::default()
        };
        let g = geom(0, 3 * 4096, 4096);
        let mut gen = IoGen::new(&spec, &g, 0);
        let offs: Vec<u64> = (0..4).map(|_| gen.next().unwrap().offset).collect();
        assert_eq!(offs, vec![0, 4096, 8192, 0]);

        let spec = JobSpec {
            rw: RwMode::RandRead,
            bs: BlockSizes {
                split: vec![(4096, 50), (65536, 50)],
                range: None,
            },
            ..JobSpec::default()
        };
        let g = geom(0, 1 << 20, 4096);
        let a: Vec<Req> = {
            let mut gen = IoGen::new(&spec, &g, 3);
            (0..100).map(|_| gen.next().unwrap()).collect()
        };
        let b: Vec<Req> = {
            let mut gen = IoGen::new(&spec, &g, 3);
            (0..100).map(|_| gen.next().unwrap()).collect()
        };
        assert_eq!(a, b);
        assert!(a
            .iter()
            .all(|r| r.offset % r.len == 0 && r.offset + r.len <= 1 << 20));
        assert!(a.iter().any(|r| r.len == 65536) && a.iter().any(|r| r.len == 4096));
    }
}
