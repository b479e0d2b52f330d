//! What survives a power cut: the `cut` message's modes and the choice of
//! the cached writes that reach the device anyway. No kernel source to
//! follow; the modes are CrashMonkey's (a random subset of an epoch's
//! writes) and ALICE's torn writes (a prefix of a multi-sector write, at
//! the device's atomic unit), applied to a volatile cache that holds only
//! the last write of each sector.
//!
//! The choice is a pure function of the cache's contents and the seed, so
//! the same seed on the same cache state keeps the same writes: writes
//! are visited in the order of their lowest cached sector (never by
//! arrival number, which depends on how threads interleaved), and the
//! random numbers come from SplitMix64, written out here (eight lines)
//! so that a seed means the same cut in every build, whatever a crate's
//! generator does in its next version.

use super::cache::{group_by_write, Extent};
use crate::error::TargetError;
use std::fmt;

/// How a cut treats the writes the cache holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CutMode {
    /// Every cached write is lost.
    Drop,
    /// A seeded random subset of the cached writes survives, each whole.
    Reorder { seed: u64 },
    /// As `Reorder`, and a surviving multi-unit write may keep only a
    /// prefix, cut at a multiple of `sectors` (at least the device's
    /// logical block).
    Torn { seed: u64, sectors: u64 },
}

impl fmt::Display for CutMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CutMode::Drop => write!(f, "drop"),
            CutMode::Reorder { seed } => write!(f, "reorder {seed}"),
            CutMode::Torn { seed, sectors } => write!(f, "torn {seed} {sectors}"),
        }
    }
}

/// The syntax of the message, for errors.
pub(super) const CUT_SYNTAX: &str = "cut [drop | reorder SEED | torn SEED [SECTORS]]";

/// The largest tear unit, in sectors (64 MiB, the largest bio).
const MAX_TEAR_SECTORS: u64 = 1 << 17;

/// Parse the words after `cut`.
pub(super) fn parse(args: &[&str]) -> Result<CutMode, TargetError> {
    let bad = |why: String| TargetError::invalid(format!("{why}; usage: {CUT_SYNTAX}"));
    let seed = |w: Option<&&str>, mode: &str| -> Result<u64, TargetError> {
        let w = w.ok_or_else(|| bad(format!("cut {mode}: missing SEED")))?;
        parse_u64(w).ok_or_else(|| {
            bad(format!(
                "cut {mode}: invalid SEED '{w}' (a decimal number 0..={})",
                u64::MAX
            ))
        })
    };
    let Some(mode) = args.first() else {
        return Ok(CutMode::Drop);
    };
    let (parsed, takes) = match mode.to_ascii_lowercase().as_str() {
        "drop" => (CutMode::Drop, 1),
        "reorder" => (
            CutMode::Reorder {
                seed: seed(args.get(1), "reorder")?,
            },
            2,
        ),
        "torn" => {
            let s = seed(args.get(1), "torn")?;
            let sectors = match args.get(2) {
                None => 1,
                Some(w) => parse_u64(w)
                    .filter(|n| (1..=MAX_TEAR_SECTORS).contains(n))
                    .ok_or_else(|| {
                        bad(format!(
                            "cut torn: invalid SECTORS '{w}' (a number of 512-byte sectors, 1..={MAX_TEAR_SECTORS})"
                        ))
                    })?,
            };
            (CutMode::Torn { seed: s, sectors }, 3)
        }
        other => {
            return Err(bad(format!(
                "cut: unknown mode '{other}' (drop, reorder or torn)"
            )))
        }
    };
    if args.len() > takes {
        return Err(bad(format!(
            "cut {}: unexpected '{}'",
            args[0],
            args[takes..].join(" ")
        )));
    }
    Ok(parsed)
}

/// Decimal digits only (no sign, no spaces), as the kernel's `%llu`.
fn parse_u64(w: &str) -> Option<u64> {
    if w.is_empty() || !w.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    w.parse().ok()
}

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny, well-mixed generator
/// whose output depends on the seed alone.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// What a cut keeps.
pub(super) struct Outcome {
    /// The extents to write down, in sector order.
    pub survivors: Vec<Extent>,
    /// Writes of which something survives.
    pub kept: u64,
    /// Writes of which nothing survives.
    pub lost: u64,
    /// Surviving writes cut short.
    pub torn: u64,
}

/// Choose the survivors among the cache's extents (in sector order, as
/// [`super::cache::Cache::drain`] gives them). `min_sectors` is the
/// device's logical block in sectors: no tear splits one.
pub(super) fn choose(mode: CutMode, extents: Vec<Extent>, min_sectors: u64) -> Outcome {
    let groups = group_by_write(extents);
    let mut out = Outcome {
        survivors: Vec::new(),
        kept: 0,
        lost: 0,
        torn: 0,
    };
    let (seed, tear_unit) = match mode {
        CutMode::Drop => {
            out.lost = groups.len() as u64;
            return out;
        }
        CutMode::Reorder { seed } => (seed, None),
        CutMode::Torn { seed, sectors } => (seed, Some(sectors.max(min_sectors))),
    };
    let mut rng = SplitMix64(seed);
    for group in groups {
        if rng.next() & 1 == 0 {
            out.lost += 1;
            continue;
        }
        let end = match tear_unit {
            Some(unit) => tear_point(&mut rng, &group[0], unit),
            None => None,
        };
        let before = out.survivors.len();
        for e in group {
            let stop = end.unwrap_or(u64::MAX);
            if e.start >= stop {
                continue;
            }
            let len = e.len.min(stop - e.start);
            out.survivors.push(Extent { len, ..e });
        }
        match (end.is_some(), out.survivors.len() > before) {
            (_, false) => out.lost += 1,
            (true, true) => {
                out.kept += 1;
                out.torn += 1;
            }
            (false, true) => out.kept += 1,
        }
    }
    out.survivors.sort_unstable_by_key(|e| e.start);
    out
}

/// Where a surviving write is torn, if it is: a sector inside the write
/// as submitted that is a multiple of `unit` (the media's atomic unit is
/// aligned on the device, not on the write). `None` keeps it whole.
fn tear_point(rng: &mut SplitMix64, e: &Extent, unit: u64) -> Option<u64> {
    let (ws, we) = (e.write.start, e.write.start + e.write.len);
    let first = (ws / unit + 1) * unit;
    if first >= we {
        return None;
    }
    let points = (we - 1 - first) / unit + 1;
    // One draw for whether, one for where, so that every surviving
    // write costs the same draws.
    let torn = rng.next() & 1 == 1;
    let at = first + (rng.next() % points) * unit;
    torn.then_some(at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::targets::powercut::cache::{Cache, Payload};

    fn cache_of(writes: &[(u64, u64)]) -> Cache {
        let mut c = Cache::default();
        for (i, &(s, l)) in writes.iter().enumerate() {
            c.insert(
                s,
                l,
                Payload::Data(vec![i as u8 + 1; (l * 512) as usize].into()),
            );
        }
        c
    }

    fn kept(o: &Outcome) -> Vec<(u64, u64, u64)> {
        o.survivors
            .iter()
            .map(|e| (e.start, e.len, e.write.seq))
            .collect()
    }

    #[test]
    fn parse_modes_and_refusals() {
        assert_eq!(parse(&[]).unwrap(), CutMode::Drop);
        assert_eq!(parse(&["drop"]).unwrap(), CutMode::Drop);
        assert_eq!(
            parse(&["reorder", "7"]).unwrap(),
            CutMode::Reorder { seed: 7 }
        );
        assert_eq!(
            parse(&["TORN", "7"]).unwrap(),
            CutMode::Torn {
                seed: 7,
                sectors: 1
            }
        );
        assert_eq!(
            parse(&["torn", "7", "8"]).unwrap(),
            CutMode::Torn {
                seed: 7,
                sectors: 8
            }
        );
        for (bad, says) in [
            (&["reorder"][..], "missing SEED"),
            (&["reorder", "-1"], "invalid SEED '-1'"),
            (&["reorder", "1", "2"], "unexpected '2'"),
            (&["torn", "1", "0"], "invalid SECTORS '0'"),
            (&["torn", "x"], "invalid SEED 'x'"),
            (&["drop", "now"], "unexpected 'now'"),
            (&["melt"], "unknown mode 'melt'"),
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("usage"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn same_seed_same_cache_same_survivors() {
        let writes: Vec<(u64, u64)> = (0..64).map(|i| (i * 16, 8)).collect();
        let a = choose(CutMode::Reorder { seed: 42 }, cache_of(&writes).drain(), 1);
        let b = choose(CutMode::Reorder { seed: 42 }, cache_of(&writes).drain(), 1);
        assert_eq!(kept(&a), kept(&b));
        assert!(
            a.kept > 0 && a.lost > 0,
            "a subset: {} kept {} lost",
            a.kept,
            a.lost
        );
        let c = choose(CutMode::Reorder { seed: 43 }, cache_of(&writes).drain(), 1);
        assert_ne!(kept(&a), kept(&c), "another seed, another subset");
        // The same cache filled in another order keeps the same sectors.
        let mut rev = writes.clone();
        rev.reverse();
        let d = choose(CutMode::Reorder { seed: 42 }, cache_of(&rev).drain(), 1);
        let sectors = |o: &Outcome| o.survivors.iter().map(|e| e.start).collect::<Vec<_>>();
        assert_eq!(sectors(&a), sectors(&d));
    }

    #[test]
    fn drop_keeps_nothing_reorder_keeps_whole_writes() {
        let writes = [(0, 8), (8, 8), (100, 1)];
        let d = choose(CutMode::Drop, cache_of(&writes).drain(), 1);
        assert!(d.survivors.is_empty());
        assert_eq!(d.lost, 3);
        for seed in 0..32 {
            let o = choose(CutMode::Reorder { seed }, cache_of(&writes).drain(), 1);
            assert!(o.survivors.iter().all(|e| e.len == e.write.len));
            assert_eq!(o.kept + o.lost, 3);
        }
    }

    #[test]
    fn torn_keeps_prefixes_at_the_unit() {
        let mut seen_tear = false;
        for seed in 0..64 {
            let o = choose(
                CutMode::Torn { seed, sectors: 8 },
                cache_of(&[(4, 64)]).drain(),
                1,
            );
            if let Some(e) = o.survivors.first() {
                assert_eq!(e.start, 4, "a prefix starts where the write does");
                let end = e.start + e.len;
                assert!(
                    end == 68 || end % 8 == 0,
                    "seed {seed}: torn at {end}, not a multiple of 8"
                );
                seen_tear |= o.torn == 1;
                assert_eq!(o.torn == 1, end != 68);
            }
        }
        assert!(seen_tear, "64 seeds tore nothing");
    }

    #[test]
    fn the_device_block_bounds_the_tear_unit() {
        for seed in 0..64 {
            let o = choose(
                CutMode::Torn { seed, sectors: 1 },
                cache_of(&[(0, 64)]).drain(),
                8,
            );
            for e in &o.survivors {
                assert_eq!(e.len % 8, 0, "seed {seed}: a tear inside a 4 KiB block");
            }
        }
    }
}
