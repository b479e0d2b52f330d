//! The delay target's arguments beyond dm-delay's positional ones: delays
//! in fractions of a millisecond, and the trailing `key=value` options
//! (flush mechanism, its tuning, the latency models), parsed here and
//! printed back by `table` only when not default.

use super::latency::Latency;
use super::{Mode, CLASS_NAMES, FLUSH, MAX_DELAY_NS, READ, WRITE};
use crate::error::TargetError;
use crate::target::parse_arg;

pub(super) const SYNTAX: &str = "<dev> <offset> <delay_ms> [<wdev> <woffset> <wdelay_ms> \
                      [<fdev> <foffset> <fdelay_ms>]] [mode=timer|kthread|hybrid] [hz=N] \
                      [spin_us=N] [affinity=cpu|none] [wake_pct=P] [reap_backstop_ms=MS] \
                      [p99=MS] [<class>_p99=MS] [load_k=K] [<class>_load_k=K]";

/// The default HZ of the emulated timer (x86 distribution kernels).
pub const DEFAULT_HZ: u32 = 250;
/// Hybrid mode's default spin bound, in microseconds: the most a worker
/// spins towards a deadline, and so the most its sleep margin can be.
pub const DEFAULT_SPIN_US: u64 = 100;
/// Hybrid mode's default: sleep short of a deadline by the 80th percentile
/// of the worker's recent wake lateness. Higher percentiles mean longer
/// spins, which use up the worker's short scheduler slice so that its next
/// wake is held back (docs/BENCHMARKS.md compares them).
pub const DEFAULT_WAKE_PCT: u32 = 80;
/// Hybrid mode's default backstop while a submitter reaps the held bios
/// itself (`reap_backstop_ms=`, see `reaper.rs`): one tick of the
/// default [`DEFAULT_HZ`], the most dm-delay's own timer mechanism is
/// late by, so a stalled claimant costs a bio no more than the kernel's
/// timer would.
pub const DEFAULT_REAP_BACKSTOP_NS: u64 = 1_000_000_000 / DEFAULT_HZ as u64;
/// The longest `reap_backstop_ms=` accepted: a minute.
const MAX_REAP_BACKSTOP_NS: u64 = 60_000_000_000;

/// The mechanism options of one table line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Options {
    pub mode: Mode,
    pub hz: u32,
    pub spin_us: u64,
    pub affinity: bool,
    pub wake_pct: u32,
    /// Hybrid: how late a bio may go, past its deadline, while claimed
    /// and left unreaped, before a worker sends it on itself.
    pub reap_backstop_ns: u64,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            mode: Mode::Hybrid,
            hz: DEFAULT_HZ,
            spin_us: DEFAULT_SPIN_US,
            affinity: true,
            wake_pct: DEFAULT_WAKE_PCT,
            reap_backstop_ns: DEFAULT_REAP_BACKSTOP_NS,
        }
    }
}

impl Options {
    /// The non-default options, as `table` prints them.
    pub fn table_words(&self, parts: &mut Vec<String>) {
        if self.mode != Mode::Hybrid {
            parts.push(format!("mode={}", self.mode));
        }
        if self.hz != DEFAULT_HZ {
            parts.push(format!("hz={}", self.hz));
        }
        if self.spin_us != DEFAULT_SPIN_US {
            parts.push(format!("spin_us={}", self.spin_us));
        }
        if self.mode == Mode::Hybrid && !self.affinity {
            parts.push("affinity=none".into());
        }
        if self.mode == Mode::Hybrid && self.wake_pct != DEFAULT_WAKE_PCT {
            parts.push(format!("wake_pct={}", self.wake_pct));
        }
        if self.reap_backstop_ns != DEFAULT_REAP_BACKSTOP_NS {
            parts.push(format!(
                "reap_backstop_ms={}",
                format_ms(self.reap_backstop_ns)
            ));
        }
    }

    /// Apply one `key=value` option to these options or to the classes'
    /// latency models.
    pub fn apply(
        &mut self,
        latency: &mut [Latency; 3],
        k: &str,
        v: &str,
    ) -> Result<(), TargetError> {
        match k {
            "mode" => self.mode = Mode::parse(v)?,
            "hz" => self.hz = parse_in_range("hz", v, 1, 100_000, "1..100000")?,
            "spin_us" => self.spin_us = parse_in_range("spin_us", v, 0, 10_000, "at most 10000")?,
            "affinity" => {
                self.affinity = match v {
                    "cpu" => true,
                    "none" => false,
                    _ => {
                        return Err(TargetError::invalid(format!(
                            "invalid affinity '{v}' (cpu or none)"
                        )))
                    }
                }
            }
            "wake_pct" => self.wake_pct = parse_in_range("wake_pct", v, 1, 100, "1..100")?,
            "reap_backstop_ms" => {
                let ns = parse_ms(v).map_err(|e| e.within(format!("invalid {k} '{v}'")))?;
                if ns == 0 || ns > MAX_REAP_BACKSTOP_NS {
                    return Err(TargetError::invalid(format!(
                        "invalid {k} '{v}': must be more than 0 and at most 60000"
                    )));
                }
                self.reap_backstop_ns = ns;
            }
            _ => apply_latency_option(latency, k, v)?,
        }
        Ok(())
    }
}

/// A number option in `min..=max`; `rule` says the range as the error
/// shows it.
fn parse_in_range<T>(key: &str, v: &str, min: T, max: T, rule: &str) -> Result<T, TargetError>
where
    T: std::str::FromStr + PartialOrd,
{
    let n: T = parse_arg(key, v)?;
    if n < min || n > max {
        let must = if rule.starts_with("at most") {
            rule.to_string()
        } else {
            format!("must be {rule}")
        };
        return Err(TargetError::invalid(format!("invalid {key} '{v}': {must}")));
    }
    Ok(n)
}

/// `p99=`, `load_k=` and their per-class forms.
fn apply_latency_option(latency: &mut [Latency; 3], k: &str, v: &str) -> Result<(), TargetError> {
    if let Some(classes) = option_classes(k, "p99") {
        let ns = parse_ms(v).map_err(|e| e.within(format!("invalid {k} '{v}'")))?;
        for c in classes {
            latency[c].p99_ns = Some(ns);
        }
    } else if let Some(classes) = option_classes(k, "load_k") {
        let kk = parse_load_k(v)?;
        for c in classes {
            latency[c].load_k = Some(kk);
        }
    } else {
        return Err(TargetError::invalid(format!(
            "unknown option '{k}={v}' (known: mode, hz, spin_us, affinity, wake_pct, \
             reap_backstop_ms, p99, \
             read_p99, write_p99, flush_p99, load_k, read_load_k, write_load_k, flush_load_k)"
        )));
    }
    Ok(())
}

/// Which classes a `p99`/`load_k` style key names.
fn option_classes(key: &str, suffix: &str) -> Option<Vec<usize>> {
    if key == suffix {
        return Some(vec![READ, WRITE, FLUSH]);
    }
    let class = key.strip_suffix(suffix)?.strip_suffix('_')?;
    match class {
        "all" => Some(vec![READ, WRITE, FLUSH]),
        _ => CLASS_NAMES
            .iter()
            .position(|c| *c == class)
            .map(|i| vec![i]),
    }
}

/// Positional arguments and `key=value` options of a table line.
pub(super) type SplitArgs<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>);

/// Split trailing `key=value` options from the positional arguments.
pub(super) fn split_options<'a>(args: &[&'a str]) -> Result<SplitArgs<'a>, TargetError> {
    let mut pos = Vec::new();
    let mut opts: Vec<(&str, &str)> = Vec::new();
    for a in args {
        match a.split_once('=') {
            Some((k, v)) => {
                if opts.iter().any(|(ok, _)| *ok == k) {
                    return Err(TargetError::invalid(format!("option '{k}' given twice")));
                }
                opts.push((k, v));
            }
            None => {
                if let Some((k, v)) = opts.first() {
                    return Err(TargetError::invalid(format!(
                        "option '{k}={v}' must come after the positional arguments ('{a}' follows it)"
                    )));
                }
                pos.push(*a);
            }
        }
    }
    Ok((pos, opts))
}

/// A delay in milliseconds with up to six decimals (nanoseconds), as the
/// table and messages write it. dm takes whole milliseconds only.
pub fn parse_ms(s: &str) -> Result<u64, TargetError> {
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i, f),
        None => (s, ""),
    };
    let digits = |t: &str| t.bytes().all(|b| b.is_ascii_digit());
    if int.is_empty() && frac.is_empty() || !digits(int) || !digits(frac) {
        return Err(TargetError::invalid(
            "not a number of milliseconds (e.g. 5 or 0.25)",
        ));
    }
    if frac.len() > 6 {
        return Err(TargetError::invalid(
            "more than 6 decimals (the resolution is 1 ns)",
        ));
    }
    let too_large = || TargetError::invalid(format!("too large (at most {} ms)", u32::MAX));
    let whole: u64 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| too_large())?
    };
    let mut frac_ns: u64 = 0;
    for (i, b) in frac.bytes().enumerate() {
        frac_ns += (b - b'0') as u64 * 10u64.pow(5 - i as u32);
    }
    whole
        .checked_mul(1_000_000)
        .and_then(|n| n.checked_add(frac_ns))
        .filter(|&n| n <= MAX_DELAY_NS)
        .ok_or_else(too_large)
}

/// Nanoseconds as milliseconds the way [`parse_ms`] reads them back:
/// whole numbers stay whole (`5`), fractions lose trailing zeros (`0.25`).
pub fn format_ms(ns: u64) -> String {
    let whole = ns / 1_000_000;
    let frac = ns % 1_000_000;
    if frac == 0 {
        whole.to_string()
    } else {
        let f = format!("{frac:06}");
        format!("{whole}.{}", f.trim_end_matches('0'))
    }
}

/// The `load_k` value: a positive number of I/Os.
pub(super) fn parse_load_k(s: &str) -> Result<f64, TargetError> {
    let k: f64 = s
        .parse()
        .map_err(|_| TargetError::invalid(format!("invalid load_k '{s}': not a number")))?;
    if !k.is_finite() || k <= 0.0 {
        return Err(TargetError::invalid(format!(
            "invalid load_k '{s}': must be a positive number"
        )));
    }
    Ok(k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn milliseconds_parse_and_print_back() {
        assert_eq!(parse_ms("0").ok(), Some(0));
        assert_eq!(parse_ms("5").ok(), Some(5_000_000));
        assert_eq!(parse_ms("0.25").ok(), Some(250_000));
        assert_eq!(parse_ms(".5").ok(), Some(500_000));
        assert_eq!(parse_ms("1.000001").ok(), Some(1_000_001));
        assert!(parse_ms("1.0000001")
            .unwrap_err()
            .report()
            .contains("6 decimals"));
        assert!(parse_ms("-1").is_err());
        assert!(parse_ms("1e3").is_err());
        assert!(parse_ms("").is_err());
        assert!(parse_ms(".").is_err());
        assert!(parse_ms("4294967296")
            .unwrap_err()
            .report()
            .contains("too large"));
        for ns in [0, 1, 250_000, 1_500_000, 20_000_000, 1_000_001] {
            assert_eq!(parse_ms(&format_ms(ns)).ok(), Some(ns));
        }
        assert_eq!(format_ms(1_500_000), "1.5");
        assert_eq!(format_ms(7_000_000), "7");
    }

    #[test]
    fn range_errors_read_as_before() {
        let mut l = [Latency::plain(0); 3];
        let mut o = Options::default();
        let err =
            |o: &mut Options, l: &mut [Latency; 3], k, v| o.apply(l, k, v).unwrap_err().report();
        assert_eq!(
            err(&mut o, &mut l, "hz", "0"),
            "invalid hz '0': must be 1..100000"
        );
        assert_eq!(
            err(&mut o, &mut l, "spin_us", "10001"),
            "invalid spin_us '10001': at most 10000"
        );
        assert_eq!(
            err(&mut o, &mut l, "wake_pct", "101"),
            "invalid wake_pct '101': must be 1..100"
        );
        assert_eq!(err(&mut o, &mut l, "hz", "x"), "invalid hz 'x'");
        assert_eq!(
            err(&mut o, &mut l, "reap_backstop_ms", "0"),
            "invalid reap_backstop_ms '0': must be more than 0 and at most 60000"
        );
        assert!(err(&mut o, &mut l, "reap_backstop_ms", "soon")
            .starts_with("invalid reap_backstop_ms 'soon'"));
        o.apply(&mut l, "reap_backstop_ms", "0.5")
            .expect("half a millisecond");
        assert_eq!(o.reap_backstop_ns, 500_000);
    }
}
