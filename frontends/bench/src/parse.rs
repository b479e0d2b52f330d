//! Values of fio options, as fio's parser (`parse.c`) reads them: sizes
//! take `k/m/g/t/p` suffixes in powers of 1024 (fio's default
//! `kb_base=1024`, so `4k`, `4kb` and `4KiB` are all 4096) and
//! `size`/`offset`/`io_size` also take a percentage of the device; times
//! are seconds unless suffixed (`us`, `ms`, `s`, `m`, `h`, `d`); booleans
//! accept `0/1`, `true/false`, `yes/no`, `on/off`; per-direction values are
//! `read,write,trim` lists; data patterns are `0x` hex, decimal or quoted
//! strings.

use crate::sizes::{BlockSizes, SizeSpec};
use std::time::Duration;

/// A value fio's parser refuses, with the reason in fio's terms
/// (`'4q' is not a size (e.g. 4096, 4k, 1m, 2g)`); the option it was
/// given to is added by the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ValueError(pub String);

/// The reason as text, for the errors that carry it on with the option's
/// name (`options::KeyError`, `jobfile::JobFileError`).
impl From<ValueError> for String {
    fn from(e: ValueError) -> String {
        e.0
    }
}

/// fio's boolean spellings.
pub fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// A plain integer, decimal or `0x` hex.
pub fn parse_int(s: &str) -> Result<u64, ValueError> {
    let t = s.trim();
    let r = if let Some(h) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        u64::from_str_radix(h, 16)
    } else {
        t.parse::<u64>()
    };
    r.map_err(|_| ValueError(format!("'{s}' is not a non-negative integer")))
}

/// A byte count with fio's suffixes: `k`, `m`, `g`, `t`, `p` (optionally
/// followed by `b`/`ib`, any case) in powers of 1024; a trailing `b` alone
/// means bytes.
pub fn parse_size(s: &str) -> Result<u64, ValueError> {
    let t = s.trim();
    let digits_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'x' || c == 'X'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits_end);
    if num.is_empty() {
        return Err(ValueError(format!(
            "'{s}' is not a size (e.g. 4096, 4k, 1m, 2g)"
        )));
    }
    let mult: u64 = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        "p" | "pb" | "pib" => 1 << 50,
        other => {
            return Err(ValueError(format!(
                "'{s}': unknown size suffix '{other}' (use k, m, g, t, p)"
            )))
        }
    };
    if num.contains('.') {
        let f: f64 = num
            .parse()
            .map_err(|_| ValueError(format!("'{s}' is not a size (e.g. 4096, 4k, 1m, 2g)")))?;
        let v = f * mult as f64;
        if !(0.0..1.8e19).contains(&v) {
            return Err(ValueError(format!("'{s}' is out of range")));
        }
        return Ok(v as u64);
    }
    let n = parse_int(num)
        .map_err(|_| ValueError(format!("'{s}' is not a size (e.g. 4096, 4k, 1m, 2g)")))?;
    n.checked_mul(mult)
        .ok_or_else(|| ValueError(format!("'{s}' is out of range")))
}

/// A size or a percentage of the device (`size=50%`).
pub fn parse_size_spec(s: &str) -> Result<SizeSpec, ValueError> {
    let t = s.trim();
    if let Some(p) = t.strip_suffix('%') {
        let v: f64 = p
            .trim()
            .parse()
            .map_err(|_| ValueError(format!("'{s}' is not a percentage")))?;
        if !(v > 0.0 && v <= 100.0) {
            return Err(ValueError(format!(
                "'{s}': a percentage must be in (0, 100]"
            )));
        }
        return Ok(SizeSpec::Percent(v));
    }
    parse_size(t).map(SizeSpec::Bytes)
}

/// The unit a bare number of a time option is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeUnit {
    Seconds,
    Micros,
}

/// A duration with fio's suffixes (`us`/`usec`, `ms`/`msec`, `s`/`sec`,
/// `m`/`min`, `h`, `d`); a bare number is in `bare` units.
pub fn parse_time(s: &str, bare: TimeUnit) -> Result<Duration, ValueError> {
    let t = s.trim();
    let digits_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits_end);
    let v: f64 = num
        .parse()
        .map_err(|_| ValueError(format!("'{s}' is not a time (e.g. 10, 10s, 500ms, 2m)")))?;
    let ns_per: f64 = match suffix.to_ascii_lowercase().as_str() {
        "" => match bare {
            TimeUnit::Seconds => 1e9,
            TimeUnit::Micros => 1e3,
        },
        "ns" | "nsec" => 1.0,
        "us" | "usec" => 1e3,
        "ms" | "msec" => 1e6,
        "s" | "sec" => 1e9,
        "m" | "min" => 60e9,
        "h" | "hour" => 3600e9,
        "d" | "day" => 86400e9,
        other => {
            return Err(ValueError(format!(
                "'{s}': unknown time unit '{other}' (use us, ms, s, m, h, d)"
            )))
        }
    };
    let ns = v * ns_per;
    if !(0.0..1.8e19).contains(&ns) {
        return Err(ValueError(format!("'{s}' is out of range")));
    }
    Ok(Duration::from_nanos(ns as u64))
}

/// The most CPUs a `cpus_allowed` list may name (glibc's `CPU_SETSIZE`).
pub const MAX_CPU: usize = 1024;

/// fio's `cpus_allowed=0-3,6`: CPU numbers and inclusive ranges, comma
/// separated; returned sorted, without duplicates.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, ValueError> {
    let num = |t: &str| -> Result<usize, ValueError> {
        let n: usize = t
            .trim()
            .parse()
            .map_err(|_| ValueError(format!("'{t}' is not a CPU number")))?;
        if n >= MAX_CPU {
            return Err(ValueError(format!(
                "CPU {n} is out of range (at most {})",
                MAX_CPU - 1
            )));
        }
        Ok(n)
    };
    let mut cpus = Vec::new();
    for part in s.split(',').map(str::trim) {
        if part.is_empty() {
            return Err(ValueError(format!("'{s}': empty entry in the CPU list")));
        }
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(ValueError(format!("'{part}': a range must go up")));
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(num(part)?),
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// fio's `percentile_list=50:99:99.9`: at most 20 values in (0, 100],
/// reported in ascending order.
pub fn parse_percentile_list(s: &str) -> Result<Vec<f64>, ValueError> {
    let mut list = Vec::new();
    for part in s.split(':').map(str::trim).filter(|p| !p.is_empty()) {
        let v: f64 = part
            .parse()
            .map_err(|_| ValueError(format!("'{part}' is not a number")))?;
        if !(v > 0.0 && v <= 100.0) {
            return Err(ValueError(format!(
                "{part} is not a percentile in (0, 100]"
            )));
        }
        list.push(v);
    }
    if list.is_empty() || list.len() > 20 {
        return Err(ValueError(format!(
            "'{s}': give 1 to 20 percentiles separated by ':'"
        )));
    }
    list.sort_by(f64::total_cmp);
    Ok(list)
}

/// fio's `bssplit=4k/50:64k/50`. A size without a percentage shares what
/// the others leave, as in fio.
pub fn parse_bssplit(s: &str) -> Result<BlockSizes, ValueError> {
    if s.contains(',') {
        return Err(ValueError(format!(
            "'{s}': per-direction bssplit lists are not supported (one list for reads and writes)"
        )));
    }
    let mut split = Vec::new();
    let mut open = Vec::new();
    let mut total = 0u32;
    for part in s.split(':').map(str::trim).filter(|p| !p.is_empty()) {
        let (size_text, pct) = match part.split_once('/') {
            Some((a, b)) => (a, Some(b)),
            None => (part, None),
        };
        let size = parse_size(size_text)?;
        if size == 0 {
            return Err(ValueError(format!(
                "'{part}': block size must be greater than 0"
            )));
        }
        match pct {
            Some(p) => {
                let p = p.trim().parse::<u32>().map_err(|_| {
                    ValueError(format!("'{part}': '{p}' is not a whole percentage"))
                })?;
                total += p;
                if p > 0 {
                    split.push((size, p));
                }
            }
            None => open.push(size),
        }
    }
    if total > 100 {
        return Err(ValueError(format!(
            "'{s}': percentages add up to {total}, more than 100"
        )));
    }
    if !open.is_empty() {
        let left = 100 - total;
        let n = open.len() as u32;
        for (i, size) in open.into_iter().enumerate() {
            // Spread the remainder so the shares still sum to 100.
            let share = left / n + u32::from((i as u32) < left % n);
            if share > 0 {
                split.push((size, share));
            }
        }
    } else if total != 100 {
        return Err(ValueError(format!(
            "'{s}': percentages add up to {total}, not 100"
        )));
    }
    if split.is_empty() {
        return Err(ValueError(format!(
            "'{s}': no block size with a non-zero share"
        )));
    }
    Ok(BlockSizes { split, range: None })
}

/// A size that may be negative (`rw=read:-8k`).
pub fn parse_signed_size(s: &str) -> Result<i64, ValueError> {
    let t = s.trim();
    let (neg, body) = match t.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, t),
    };
    let v = parse_size(body)?;
    let v = i64::try_from(v).map_err(|_| ValueError(format!("'{s}' is out of range")))?;
    Ok(if neg { -v } else { v })
}

/// fio's `bsrange=4k-64k` (a single size means that size).
pub fn parse_size_range(s: &str) -> Result<(u64, u64), ValueError> {
    let (lo, hi) = match s.split_once('-') {
        Some((a, b)) => (parse_size(a)?, parse_size(b)?),
        None => {
            let v = parse_size(s)?;
            (v, v)
        }
    };
    if lo == 0 || hi < lo {
        return Err(ValueError(format!(
            "'{s}': a range is MIN-MAX with 0 < MIN <= MAX"
        )));
    }
    Ok((lo, hi))
}

/// fio's per-direction lists: `v` for all, `r,w` or `r,w,t`; an empty
/// entry keeps the default. Returns `[read, write, trim]`.
pub fn parse_per_dir<T: Copy>(
    s: &str,
    default: T,
    one: impl Fn(&str) -> Result<T, ValueError>,
) -> Result<[T; 3], ValueError> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    if parts.len() > 3 {
        return Err(ValueError(format!(
            "'{s}': at most three values (read,write,trim)"
        )));
    }
    if parts.len() == 1 {
        let v = one(parts[0])?;
        return Ok([v, v, v]);
    }
    let mut out = [default; 3];
    for (i, p) in parts.iter().enumerate() {
        if !p.is_empty() {
            out[i] = one(p)?;
        }
    }
    Ok(out)
}

/// fio's data patterns (`verify_pattern`, `buffer_pattern`): `0x` hex
/// bytes, a decimal number (its little-endian bytes, as fio stores an
/// int), or a `"quoted string"`; several joined by spaces.
pub fn parse_pattern(s: &str) -> Result<Vec<u8>, ValueError> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        if let Some(q) = rest.strip_prefix('"').or_else(|| rest.strip_prefix('\'')) {
            let quote = rest.as_bytes()[0] as char;
            let end = q
                .find(quote)
                .ok_or_else(|| ValueError(format!("'{s}': unterminated string")))?;
            out.extend_from_slice(&q.as_bytes()[..end]);
            rest = q[end + 1..].trim_start();
            continue;
        }
        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        let tok = &rest[..end];
        rest = rest[end..].trim_start();
        if let Some(h) = tok.strip_prefix("0x").or_else(|| tok.strip_prefix("0X")) {
            if h.is_empty() || !h.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(ValueError(format!("'{tok}' is not a hex pattern")));
            }
            let padded = if h.len() % 2 == 1 {
                format!("0{h}")
            } else {
                h.to_string()
            };
            for i in (0..padded.len()).step_by(2) {
                let b = u8::from_str_radix(&padded[i..i + 2], 16)
                    .map_err(|_| ValueError(format!("'{tok}' is not a hex pattern")))?;
                out.push(b);
            }
        } else {
            let v: u64 = tok.parse().map_err(|_| {
                ValueError(format!(
                    "'{tok}' is not a pattern (0x hex, a number or \"text\")"
                ))
            })?;
            let bytes = v.to_le_bytes();
            let n = 8 - (v.leading_zeros() / 8) as usize;
            out.extend_from_slice(&bytes[..n.max(1)]);
        }
    }
    if out.is_empty() {
        return Err(ValueError(format!("'{s}': empty pattern")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_fio_suffixes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("4KiB").unwrap(), 4096);
        assert_eq!(parse_size("1m").unwrap(), 1 << 20);
        assert_eq!(parse_size("2g").unwrap(), 2 << 30);
        assert_eq!(parse_size("1.5k").unwrap(), 1536);
        assert_eq!(parse_size("0x1000").unwrap(), 4096);
        assert!(parse_size("4q").unwrap_err().0.contains("suffix 'q'"));
        assert!(parse_size("k").is_err());
        assert_eq!(parse_size_spec("50%").unwrap(), SizeSpec::Percent(50.0));
        assert!(parse_size_spec("150%").is_err());
        assert_eq!(SizeSpec::Percent(25.0).resolve(1 << 20), 1 << 18);
    }

    #[test]
    fn times_take_units() {
        assert_eq!(
            parse_time("5", TimeUnit::Seconds).unwrap(),
            Duration::from_secs(5)
        );
        assert_eq!(
            parse_time("5s", TimeUnit::Seconds).unwrap(),
            Duration::from_secs(5)
        );
        assert_eq!(
            parse_time("1m", TimeUnit::Seconds).unwrap(),
            Duration::from_secs(60)
        );
        assert_eq!(
            parse_time("250ms", TimeUnit::Seconds).unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(
            parse_time("10us", TimeUnit::Seconds).unwrap(),
            Duration::from_micros(10)
        );
        assert!(parse_time("5 parsecs", TimeUnit::Seconds).is_err());
        assert!(parse_time("fast", TimeUnit::Seconds).is_err());
    }

    #[test]
    fn bssplit_parses_and_checks_shares() {
        let b = parse_bssplit("4k/50:64k/50").unwrap();
        assert_eq!(b.split, vec![(4096, 50), (65536, 50)]);
        assert_eq!(b.min(), 4096);
        assert_eq!(b.max(), 65536);
        let b = parse_bssplit("4k/10:8k:16k").unwrap();
        assert_eq!(b.split.iter().map(|s| s.1).sum::<u32>(), 100);
        assert!(parse_bssplit("4k/60:8k/60").unwrap_err().0.contains("120"));
        assert!(parse_bssplit("4k/50:8k/30")
            .unwrap_err()
            .0
            .contains("not 100"));
        assert!(parse_bssplit("4k/x").is_err());
    }

    #[test]
    fn patterns_ranges_and_per_dir_lists() {
        assert_eq!(
            parse_pattern("0xaa555aa5").unwrap(),
            vec![0xaa, 0x55, 0x5a, 0xa5]
        );
        assert_eq!(parse_pattern("\"ab\" 0x01").unwrap(), b"ab\x01".to_vec());
        assert_eq!(parse_pattern("258").unwrap(), vec![2, 1]);
        assert!(parse_pattern("0xzz").is_err());
        assert_eq!(parse_size_range("4k-64k").unwrap(), (4096, 65536));
        assert!(parse_size_range("64k-4k").is_err());
        assert_eq!(parse_signed_size("-8k").unwrap(), -8192);
        assert_eq!(
            parse_per_dir("300,,7", 0u64, parse_int).unwrap(),
            [300, 0, 7]
        );
        assert_eq!(parse_per_dir("5", 0u64, parse_int).unwrap(), [5, 5, 5]);
        assert!(parse_per_dir("1,2,3,4", 0u64, parse_int).is_err());
    }
}
