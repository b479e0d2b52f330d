//! fio's `random_distribution`: where random offsets fall when they should
//! not be uniform (hot and cold data).
//!
//! Follows fio's generators (`lib/zipf.c`, `lib/gauss.c`, `io_u.c`'s zoned
//! split): Zipf by Gray et al.'s closed-form inversion with the zeta sum
//! capped at ten million terms, Pareto by a power of a uniform draw
//! (`pow = ln h / ln(1 - h)`), normal as the mean of twelve uniform draws
//! plus a uniform deviation, and zoned/zoned_abs as a weighted choice of a
//! zone then a uniform block in it. As in fio, Zipf, Pareto and normal pass
//! the rank through a 64-bit hash so the hot blocks are scattered over the
//! device rather than packed at its start, which keeps the share of
//! accesses that hit the hottest blocks (what a cache sees) the same as
//! fio's. `sequence` replays fixed block indices.

use crate::parse::parse_size;
use crate::parse::ValueError;
use rand::rngs::SmallRng;
use rand::Rng;

/// fio's cap on the Zipf zeta sum (`ZIPF_MAX_GEN`).
const ZIPF_MAX_GEN: u64 = 10_000_000;
/// fio's number of uniform draws averaged for the normal distribution.
const GAUSS_ITERS: u64 = 12;
/// fio's limit on zones and sequence elements.
const MAX_ZONES: usize = 256;
const MAX_SEQUENCE: usize = 64;

/// One zone of `zoned` (percent of accesses to percent of the region) or
/// `zoned_abs` (to a number of bytes).
#[derive(Clone, Debug, PartialEq)]
pub struct Zone {
    pub access_pct: u32,
    pub size: ZoneSize,
}

/// A zone's extent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ZoneSize {
    Percent(u32),
    Bytes(u64),
}

/// `random_distribution=`.
#[derive(Clone, Debug, PartialEq, Default)]
pub enum Distribution {
    #[default]
    Random,
    /// `zipf:THETA[:CENTER]`.
    Zipf { theta: f64, center: Option<f64> },
    /// `pareto:H[:CENTER]`.
    Pareto { h: f64, center: Option<f64> },
    /// `normal:DEV%[:CENTER]`.
    Normal { dev: f64, center: Option<f64> },
    /// `zoned:A/S:...` or `zoned_abs:A/SIZE:...`.
    Zoned(Vec<Zone>),
    /// `sequence:I,J,...`; `stride` from `random_sequence_stride`.
    Sequence { blocks: Vec<u64>, stride: bool },
}

impl Distribution {
    /// Parse fio's text (`zipf:1.2`, `zoned:60/10:30/20:10/`, ...).
    pub fn parse(s: &str) -> Result<Distribution, ValueError> {
        let (kind, args) = match s.find([':', '=']) {
            Some(i) => (&s[..i], s[i + 1..].trim()),
            None => (s, ""),
        };
        let floats = || -> Result<(f64, Option<f64>), ValueError> {
            let mut it = args.split(':');
            let v: f64 = it
                .next()
                .filter(|t| !t.is_empty())
                .ok_or_else(|| ValueError(format!("'{s}': {kind} needs a value ({kind}:VALUE)")))?
                .trim()
                .parse()
                .map_err(|_| ValueError(format!("'{s}': '{args}' is not a number")))?;
            let center = match it.next() {
                Some(c) => {
                    let c: f64 = c
                        .trim()
                        .parse()
                        .map_err(|_| ValueError(format!("'{s}': center '{c}' is not a number")))?;
                    if !(0.0..=1.0).contains(&c) {
                        return Err(ValueError(format!("'{s}': the center must be in [0, 1]")));
                    }
                    Some(c)
                }
                None => None,
            };
            Ok((v, center))
        };
        match kind.trim() {
            "random" => Ok(Distribution::Random),
            "zipf" => {
                let (theta, center) = floats()?;
                if theta <= 0.0 || theta == 1.0 {
                    return Err(ValueError(format!(
                        "'{s}': zipf theta must be > 0 and not 1"
                    )));
                }
                Ok(Distribution::Zipf { theta, center })
            }
            "pareto" => {
                let (h, center) = floats()?;
                if !(h > 0.0 && h < 1.0) {
                    return Err(ValueError(format!("'{s}': pareto power must be in (0, 1)")));
                }
                Ok(Distribution::Pareto { h, center })
            }
            "normal" | "gauss" => {
                let (dev, center) = floats()?;
                if !(0.0..=100.0).contains(&dev) {
                    return Err(ValueError(format!(
                        "'{s}': normal deviation must be in 0..100"
                    )));
                }
                Ok(Distribution::Normal { dev, center })
            }
            "zoned" => parse_zones(s, args, false).map(Distribution::Zoned),
            "zoned_abs" => parse_zones(s, args, true).map(Distribution::Zoned),
            "sequence" => parse_sequence(s, args),
            other => Err(ValueError(format!(
                "'{other}' is not one of random, zipf, pareto, normal, zoned, zoned_abs, sequence"
            ))),
        }
    }

    /// Non-uniform distributions turn fio's random map off.
    pub fn is_uniform(&self) -> bool {
        matches!(self, Distribution::Random)
    }
}

/// `A/S:A/S:...`: a missing access or size share splits what the others
/// leave (fio's `zone_split_ddir`); accesses must add up to 100.
fn parse_zones(s: &str, args: &str, absolute: bool) -> Result<Vec<Zone>, ValueError> {
    if args.contains(',') {
        return Err(ValueError(format!(
            "'{s}': per-direction zone lists are not supported (one list for all directions)"
        )));
    }
    let mut raw: Vec<(Option<u32>, Option<u64>)> = Vec::new();
    for part in args.split(':').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('/').unwrap_or((part, ""));
        let access = match a.trim() {
            "" => None,
            t => Some(
                t.parse::<u32>()
                    .map_err(|_| ValueError(format!("'{s}': '{t}' is not a whole percentage")))?,
            ),
        };
        let size = match b.trim() {
            "" => None,
            t if absolute => Some(parse_size(t)?),
            t => Some(
                t.parse::<u64>()
                    .map_err(|_| ValueError(format!("'{s}': '{t}' is not a whole percentage")))?,
            ),
        };
        raw.push((access, size));
    }
    if raw.is_empty() || raw.len() > MAX_ZONES {
        return Err(ValueError(format!("'{s}': give 1 to {MAX_ZONES} zones")));
    }
    let access_sum: u32 = raw.iter().filter_map(|r| r.0).sum();
    let access_missing = raw.iter().filter(|r| r.0.is_none()).count() as u32;
    let size_sum: u64 = raw.iter().filter_map(|r| r.1).sum();
    let size_missing = raw.iter().filter(|r| r.1.is_none()).count() as u64;
    if access_sum > 100 || (!absolute && size_sum > 100) {
        return Err(ValueError(format!(
            "'{s}': zone percentages add to more than 100"
        )));
    }
    if access_missing == 0 && access_sum < 100 {
        return Err(ValueError(format!(
            "'{s}': access percentages add up to {access_sum}, not 100"
        )));
    }
    let zones = raw
        .into_iter()
        .map(|(a, z)| Zone {
            access_pct: a.unwrap_or((100 - access_sum) / access_missing.max(1)),
            size: match (absolute, z) {
                (true, Some(b)) => ZoneSize::Bytes(b),
                (true, None) => ZoneSize::Bytes(0),
                (false, Some(p)) => ZoneSize::Percent(p as u32),
                (false, None) => ZoneSize::Percent(((100 - size_sum) / size_missing.max(1)) as u32),
            },
        })
        .collect();
    Ok(zones)
}

fn parse_sequence(s: &str, args: &str) -> Result<Distribution, ValueError> {
    let blocks = args
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u64>()
                .map_err(|_| ValueError(format!("'{s}': '{t}' is not a block index")))
        })
        .collect::<Result<Vec<u64>, ValueError>>()?;
    if blocks.is_empty() || blocks.len() > MAX_SEQUENCE {
        return Err(ValueError(format!(
            "'{s}': give 1 to {MAX_SEQUENCE} block indices"
        )));
    }
    Ok(Distribution::Sequence {
        blocks,
        stride: false,
    })
}

/// A 64-bit mixer standing in for fio's `__hash_u64`: spreads ranks over
/// the device.
fn hash_u64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A sampler of block indices in `0..n` for one job thread.
pub(crate) enum BlockSampler {
    Zipf {
        n: u64,
        theta: f64,
        zetan: f64,
        zeta2: f64,
        off: u64,
    },
    Pareto {
        n: u64,
        pow: f64,
        off: u64,
    },
    Normal {
        n: u64,
        stddev: u64,
        off: i64,
    },
    /// `(cumulative access percent, first block, blocks)`.
    Zoned(Vec<(u32, u64, u64)>),
    Sequence {
        blocks: Vec<u64>,
        stride: bool,
        pos: usize,
        base: u64,
        n: u64,
    },
}

impl BlockSampler {
    /// `None` for the uniform distribution (the caller's own generator).
    pub fn new(d: &Distribution, n: u64, unit: u64, rng: &mut SmallRng) -> Option<BlockSampler> {
        let n = n.max(1);
        let offset_of = |center: Option<f64>, rng: &mut SmallRng| match center {
            Some(c) => (n as f64 * c) as u64,
            None => rng.gen::<u32>() as u64,
        };
        Some(match d {
            Distribution::Random => return None,
            Distribution::Zipf { theta, center } => {
                let zetan = (0..n.min(ZIPF_MAX_GEN))
                    .map(|i| (1.0 / (i + 1) as f64).powf(*theta))
                    .sum();
                BlockSampler::Zipf {
                    n,
                    theta: *theta,
                    zetan,
                    zeta2: 1.0 + 0.5f64.powf(*theta),
                    off: offset_of(*center, rng),
                }
            }
            Distribution::Pareto { h, center } => BlockSampler::Pareto {
                n,
                pow: h.ln() / (1.0 - h).ln(),
                off: offset_of(*center, rng),
            },
            Distribution::Normal { dev, center } => BlockSampler::Normal {
                n,
                stddev: ((n as f64 * dev / 100.0).ceil() as u64).min(n / 2),
                off: center.map_or(0, |c| (n as f64 * (c - 0.5)) as i64),
            },
            Distribution::Zoned(zones) => BlockSampler::Zoned(zone_table(zones, n, unit)),
            Distribution::Sequence { blocks, stride } => BlockSampler::Sequence {
                blocks: blocks.clone(),
                stride: *stride,
                pos: 0,
                base: 0,
                n,
            },
        })
    }

    /// The next block index.
    pub fn next(&mut self, rng: &mut SmallRng) -> u64 {
        match self {
            BlockSampler::Zipf {
                n,
                theta,
                zetan,
                zeta2,
                off,
            } => {
                let nf = *n as f64;
                let alpha = 1.0 / (1.0 - *theta);
                let eta = (1.0 - (2.0 / nf).powf(1.0 - *theta)) / (1.0 - *zeta2 / *zetan);
                let u: f64 = rng.gen();
                let z = u * *zetan;
                let val = if z < 1.0 {
                    1
                } else if z < 1.0 + 0.5f64.powf(*theta) {
                    2
                } else {
                    1 + (nf * (eta * u - eta + 1.0).powf(alpha)) as u64
                };
                hash_u64(val - 1).wrapping_add(*off) % *n
            }
            BlockSampler::Pareto { n, pow, off } => {
                let u: f64 = rng.gen();
                let v = ((*n - 1) as f64 * u.powf(*pow)) as u64;
                hash_u64(v).wrapping_add(*off) % *n
            }
            BlockSampler::Normal { n, stddev, off } => {
                let mut sum: u64 = (0..GAUSS_ITERS).map(|_| rng.gen_range(0..=*n)).sum();
                sum = sum.div_ceil(GAUSS_ITERS);
                if *stddev > 0 {
                    let mut dev = rng.gen_range(0..*stddev) as i64 - (*stddev / 2) as i64;
                    while sum as i64 + dev >= *n as i64 {
                        dev /= 2;
                    }
                    sum = (sum as i64 + dev).max(0) as u64;
                }
                (hash_u64(sum) as i64)
                    .wrapping_add(*off)
                    .rem_euclid(*n as i64) as u64
            }
            BlockSampler::Zoned(table) => {
                let r = rng.gen_range(0..100u32);
                let &(_, first, blocks) = table
                    .iter()
                    .find(|z| r < z.0)
                    .unwrap_or(&table[table.len() - 1]);
                first + rng.gen_range(0..blocks.max(1))
            }
            BlockSampler::Sequence {
                blocks,
                stride,
                pos,
                base,
                n,
            } => {
                let b = (*base + blocks[*pos]) % *n;
                *pos += 1;
                if *pos == blocks.len() {
                    *pos = 0;
                    if *stride {
                        *base += blocks.len() as u64;
                    }
                }
                b
            }
        }
    }
}

/// Zones laid end to end over `n` blocks of `unit` bytes.
fn zone_table(zones: &[Zone], n: u64, unit: u64) -> Vec<(u32, u64, u64)> {
    let mut out = Vec::with_capacity(zones.len());
    let (mut cum, mut first) = (0u32, 0u64);
    for z in zones {
        let blocks = match z.size {
            ZoneSize::Percent(p) => n * p as u64 / 100,
            ZoneSize::Bytes(0) => n.saturating_sub(first),
            ZoneSize::Bytes(b) => b / unit.max(1),
        };
        let blocks = blocks.min(n.saturating_sub(first)).max(1);
        cum += z.access_pct;
        out.push((cum, first.min(n - 1), blocks));
        first += blocks;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// Share of accesses that hit the hottest `frac` of the blocks hit at
    /// all (fio-genzipf's rows).
    fn hot_share(d: &Distribution, n: u64, draws: usize, frac: f64) -> f64 {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut s = BlockSampler::new(d, n, 4096, &mut rng).unwrap();
        let mut counts = vec![0u64; n as usize];
        for _ in 0..draws {
            counts[s.next(&mut rng) as usize] += 1;
        }
        counts.sort_unstable_by(|a, b| b.cmp(a));
        let hit = counts.iter().filter(|&&c| c > 0).count();
        let top = (hit as f64 * frac).ceil() as usize;
        counts[..top].iter().sum::<u64>() as f64 / draws as f64
    }

    /// Top-5 % and top-10 % shares as `fio-genzipf -b 4096 -g 1` prints
    /// them (262144 blocks, as many draws) for the same inputs.
    #[test]
    fn hot_shares_match_fio_genzipf() {
        let n = 262_144;
        for (text, top5, top10) in [
            ("zipf:1.2", 0.8569, 0.8876),
            ("zipf:0.8", 0.4286, 0.5154),
            ("pareto:0.9", 0.1806, 0.3185),
            ("pareto:0.5", 0.1185, 0.2133),
        ] {
            let d = Distribution::parse(text).unwrap();
            let (a, b) = (
                hot_share(&d, n, n as usize, 0.05),
                hot_share(&d, n, n as usize, 0.10),
            );
            assert!(
                (a - top5).abs() < 0.03 && (b - top10).abs() < 0.03,
                "{text}: top 5% {a:.4} (fio {top5}), top 10% {b:.4} (fio {top10})"
            );
        }
    }

    #[test]
    fn zoned_parses_fio_examples_and_hits_zones() {
        let d = Distribution::parse("zoned:50/5:30/15:20/").unwrap();
        let Distribution::Zoned(z) = &d else {
            panic!("zoned")
        };
        assert_eq!(z[2].size, ZoneSize::Percent(80));
        let mut rng = SmallRng::seed_from_u64(1);
        let mut s = BlockSampler::new(&d, 1000, 4096, &mut rng).unwrap();
        let first5 = (0..10_000).filter(|_| s.next(&mut rng) < 50).count();
        assert!((4700..5300).contains(&first5), "{first5}");
        assert!(Distribution::parse("zoned:50/5:30/15").is_err());
        assert!(Distribution::parse("zipf").is_err());
        assert!(Distribution::parse("lognormal:1").is_err());
        let seq = Distribution::parse("sequence:2,0,1").unwrap();
        let mut s = BlockSampler::new(&seq, 10, 4096, &mut rng).unwrap();
        let v: Vec<u64> = (0..4).map(|_| s.next(&mut rng)).collect();
        assert_eq!(v, vec![2, 0, 1, 2]);
    }
}
