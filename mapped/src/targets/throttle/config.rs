//! The throttle's limits as the table and `set` messages give them: the
//! words (`riops 500`, `wbps 8M`, `wbps_burst 64M 4`, `iops_size 4K`),
//! their normalised form for `table`, and the checks of qemu's
//! `throttle_is_valid` (util/throttle.c), with its rules and limits:
//! a total (`iops`, `bps`) and a read or write limit of the same kind are
//! not given together, a burst is at least its base rate and needs one,
//! lengths are at least one second, no value exceeds 10^15.

use super::bucket::Dir;
use crate::error::TargetError;

/// qemu's `THROTTLE_VALUE_MAX`.
pub const VALUE_MAX: u64 = 1_000_000_000_000_000;

/// How many buckets a throttle has: qemu's `BUCKETS_COUNT`, in its
/// order (`THROTTLE_BPS_TOTAL`, `_READ`, `_WRITE`, `THROTTLE_OPS_TOTAL`,
/// `_READ`, `_WRITE`).
pub const BUCKETS: usize = 6;
const BPS: usize = 0;
const RBPS: usize = 1;
const WBPS: usize = 2;
const IOPS: usize = 3;
const RIOPS: usize = 4;
const WIOPS: usize = 5;

/// Each bucket's key word, in qemu's order.
const KEYS: [&str; BUCKETS] = ["bps", "rbps", "wbps", "iops", "riops", "wiops"];

/// The order `table` prints them in (IOPS first, as the keys are listed).
const TABLE_ORDER: [usize; BUCKETS] = [RIOPS, WIOPS, IOPS, RBPS, WBPS, BPS];

/// One bucket's limit (qemu's `LeakyBucket` `avg`, `max`,
/// `burst_length`). `avg` 0 is no limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    /// Units a second: I/Os or bytes.
    pub avg: u64,
    /// Burst rate, 0 for none.
    pub max: u64,
    /// Seconds the burst may last at `max`.
    pub length: u64,
}

impl Default for Limit {
    fn default() -> Limit {
        Limit {
            avg: 0,
            max: 0,
            length: 1,
        }
    }
}

/// Every limit of one throttle.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Config {
    pub limits: [Limit; BUCKETS],
    /// qemu's `iops-size`: an I/O larger than this counts as
    /// `bytes / iops_size` operations. 0 for one operation per I/O.
    pub iops_size: u64,
}

/// What a word names.
enum Key {
    Base(usize),
    Burst(usize),
    IopsSize,
}

fn key_of(word: &str) -> Option<Key> {
    if word == "iops_size" {
        return Some(Key::IopsSize);
    }
    let (base, burst) = match word.strip_suffix("_burst") {
        Some(b) => (b, true),
        None => (word, false),
    };
    let i = KEYS.iter().position(|k| *k == base)?;
    Some(if burst { Key::Burst(i) } else { Key::Base(i) })
}

const KEY_LIST: &str = "riops, wiops, iops, rbps, wbps, bps, their *_burst, or iops_size";

impl Config {
    /// The buckets an I/O in `dir` is charged to.
    pub fn buckets_of(dir: Dir) -> &'static [usize] {
        match dir {
            Dir::Read => &[BPS, RBPS, IOPS, RIOPS],
            Dir::Write => &[BPS, WBPS, IOPS, WIOPS],
        }
    }

    /// Whether bucket `i` counts bytes (else operations).
    pub fn is_bps(i: usize) -> bool {
        i <= WBPS
    }

    /// Apply one setting (`KEY VALUE`, `KEY_burst MAX SECONDS` or
    /// `iops_size SIZE`) given as exactly its words; the result is
    /// checked whole, and on error `self` is unchanged. Setting a base
    /// limit to 0 lifts it and its burst.
    pub fn set(&mut self, words: &[&str]) -> Result<(), TargetError> {
        let mut next = self.clone();
        let Some(key) = words.first() else {
            return Err(TargetError::invalid(format!("missing key ({KEY_LIST})")));
        };
        let want = match key_of(key) {
            Some(Key::Burst(_)) => 3,
            Some(_) => 2,
            None => {
                return Err(TargetError::invalid(format!(
                    "unknown key '{key}' ({KEY_LIST})"
                )))
            }
        };
        if words.len() != want {
            return Err(TargetError::invalid(format!(
                "{key} takes {} value(s), got {}",
                want - 1,
                words.len() - 1
            )));
        }
        next.apply(words)?;
        next.validate()?;
        *self = next;
        Ok(())
    }

    /// Apply a setting's words (count already checked), unvalidated.
    fn apply(&mut self, words: &[&str]) -> Result<(), TargetError> {
        let key = words[0];
        match key_of(key) {
            Some(Key::Base(i)) => {
                let v = parse_value(i, key, words[1])?;
                self.limits[i].avg = v;
                if v == 0 {
                    self.limits[i] = Limit::default();
                }
            }
            Some(Key::Burst(i)) => {
                let max = parse_value(i, key, words[1])?;
                let length = parse_number(key, words[2])?;
                self.limits[i].max = max;
                self.limits[i].length = length;
            }
            Some(Key::IopsSize) => self.iops_size = parse_size(key, words[1])?,
            None => {
                return Err(TargetError::invalid(format!(
                    "unknown key '{key}' ({KEY_LIST})"
                )))
            }
        }
        Ok(())
    }

    /// qemu's `throttle_is_valid`, naming our keys.
    pub fn validate(&self) -> Result<(), TargetError> {
        let l = &self.limits;
        for (total, r, w) in [(IOPS, RIOPS, WIOPS), (BPS, RBPS, WBPS)] {
            let clash =
                |f: fn(&Limit) -> u64| f(&l[total]) != 0 && (f(&l[r]) != 0 || f(&l[w]) != 0);
            if clash(|x| x.avg) || clash(|x| x.max) {
                return Err(TargetError::invalid(format!(
                    "{} cannot be given with {} or {}: a total and a read/write limit \
                     are exclusive (as in qemu)",
                    KEYS[total], KEYS[r], KEYS[w]
                )));
            }
        }
        if self.iops_size != 0 && l[IOPS].avg == 0 && l[RIOPS].avg == 0 && l[WIOPS].avg == 0 {
            return Err(TargetError::invalid(
                "iops_size needs an iops, riops or wiops limit",
            ));
        }
        for (i, b) in l.iter().enumerate() {
            validate_one(KEYS[i], b)?;
        }
        Ok(())
    }

    /// The setting words in their normalised order and form (`table`).
    pub fn words(&self) -> Vec<String> {
        let mut out = Vec::new();
        for i in TABLE_ORDER {
            let b = &self.limits[i];
            if b.avg == 0 {
                continue;
            }
            out.push(KEYS[i].to_string());
            out.push(format_value(i, b.avg));
            if b.max != 0 {
                out.push(format!("{}_burst", KEYS[i]));
                out.push(format_value(i, b.max));
                out.push(b.length.to_string());
            }
        }
        if self.iops_size != 0 {
            out.push("iops_size".into());
            out.push(format_size(self.iops_size));
        }
        out
    }
}

fn validate_one(key: &str, b: &Limit) -> Result<(), TargetError> {
    if b.avg > VALUE_MAX || b.max > VALUE_MAX {
        return Err(TargetError::invalid(format!(
            "{key}: values must be within 0..={VALUE_MAX}"
        )));
    }
    if b.length == 0 {
        return Err(TargetError::invalid(format!(
            "{key}_burst: the burst length cannot be 0 seconds"
        )));
    }
    if b.length > 1 && b.max == 0 {
        return Err(TargetError::invalid(format!(
            "{key}_burst: a burst length of {} seconds without a burst rate",
            b.length
        )));
    }
    if b.max != 0 && b.length > VALUE_MAX / b.max {
        return Err(TargetError::invalid(format!(
            "{key}_burst: burst length {} too high for the burst rate {}",
            b.length, b.max
        )));
    }
    if b.max != 0 && b.avg == 0 {
        return Err(TargetError::invalid(format!(
            "{key}_burst needs {key} set (a burst is above a base rate)"
        )));
    }
    if b.max != 0 && b.max < b.avg {
        return Err(TargetError::invalid(format!(
            "{key}_burst {} is lower than {key} {}",
            b.max, b.avg
        )));
    }
    Ok(())
}

/// The limit words after the count: settings, each key once.
pub fn parse_limits(words: &[&str]) -> Result<Config, TargetError> {
    let mut cfg = Config::default();
    let mut seen: Vec<&str> = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let key = words[i];
        let n = match key_of(key) {
            Some(Key::Burst(_)) => 3,
            Some(_) => 2,
            None => {
                return Err(TargetError::invalid(format!(
                    "unknown key '{key}' ({KEY_LIST})"
                )))
            }
        };
        if i + n > words.len() {
            return Err(TargetError::invalid(format!(
                "{key} needs {} value(s) and the arguments end",
                n - 1
            )));
        }
        if seen.contains(&key) {
            return Err(TargetError::invalid(format!("{key} given twice")));
        }
        seen.push(key);
        cfg.apply(&words[i..i + n])?;
        i += n;
    }
    cfg.validate()?;
    Ok(cfg)
}

/// A value of bucket `i`: a byte size for bandwidth, a count for IOPS.
fn parse_value(i: usize, key: &str, s: &str) -> Result<u64, TargetError> {
    if Config::is_bps(i) {
        parse_size(key, s)
    } else {
        parse_number(key, s)
    }
}

fn format_value(i: usize, v: u64) -> String {
    if Config::is_bps(i) {
        format_size(v)
    } else {
        v.to_string()
    }
}

/// A plain decimal number.
fn parse_number(key: &str, s: &str) -> Result<u64, TargetError> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(TargetError::invalid(format!(
            "invalid value '{s}' for {key} (a whole number)"
        )));
    }
    s.parse()
        .map_err(|_| TargetError::invalid(format!("invalid value '{s}' for {key}: too large")))
}

/// Bytes, with an optional binary K, M, G or T suffix (`8M` = 8 MiB).
pub fn parse_size(key: &str, s: &str) -> Result<u64, TargetError> {
    let shift = match s.as_bytes().last() {
        Some(b'k' | b'K') => 10,
        Some(b'm' | b'M') => 20,
        Some(b'g' | b'G') => 30,
        Some(b't' | b'T') => 40,
        _ => 0,
    };
    let digits = if shift == 0 { s } else { &s[..s.len() - 1] };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(TargetError::invalid(format!(
            "invalid size '{s}' for {key} (bytes, with an optional K, M, G or T suffix)"
        )));
    }
    digits
        .parse::<u64>()
        .ok()
        .and_then(|v| v.checked_mul(1 << shift))
        .ok_or_else(|| TargetError::invalid(format!("invalid size '{s}' for {key}: too large")))
}

/// The shortest exact form: the largest suffix that divides the value.
pub fn format_size(v: u64) -> String {
    for (shift, suffix) in [(40, 'T'), (30, 'G'), (20, 'M'), (10, 'K')] {
        if v != 0 && v.is_multiple_of(1u64 << shift) {
            return format!("{}{suffix}", v >> shift);
        }
    }
    v.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(words: &[&str]) -> String {
        parse_limits(words).expect_err("refused").to_string()
    }

    #[test]
    fn limits_are_normalised() {
        let c = parse_limits(&[
            "wbps",
            "8192K",
            "riops",
            "500",
            "iops_size",
            "4096",
            "wiops",
            "0",
            "wbps_burst",
            "1G",
            "3",
        ])
        .expect("valid");
        assert_eq!(
            c.words().join(" "),
            "riops 500 wbps 8M wbps_burst 1G 3 iops_size 4K"
        );
        assert_eq!(parse_limits(&[]).expect("none").words().len(), 0);
        assert_eq!(format_size(1536), "1536");
        assert_eq!(format_size(3 << 10), "3K");
    }

    #[test]
    fn qemus_rules_are_kept_with_the_word_named() {
        assert!(err(&["iops", "10", "riops", "5"]).contains("iops cannot be given with riops"));
        assert!(err(&["bps", "1M", "wbps", "1M"]).contains("bps cannot be given with rbps"));
        assert!(err(&["riops", "100", "riops_burst", "50", "2"]).contains("lower than riops"));
        assert!(err(&["riops_burst", "500", "2"]).contains("riops_burst needs riops"));
        assert!(err(&["wbps", "1M", "wbps_burst", "2M", "0"]).contains("length cannot be 0"));
        assert!(err(&["wbps", "1M", "wbps_burst", "0", "5"]).contains("without a burst rate"));
        assert!(err(&["rbps", "1M", "iops_size", "4K"]).contains("iops_size needs"));
        assert!(err(&["riops", "2000000000000000"]).contains("within 0..="));
        assert!(
            err(&["wiops", "1", "wiops_burst", "1000000000000", "100000"]).contains("too high")
        );
    }

    #[test]
    fn bad_words_are_named() {
        assert!(err(&["riops", "fast"]).contains("invalid value 'fast' for riops"));
        assert!(err(&["riops", "-1"]).contains("'-1'"));
        assert!(err(&["wbps", "8X"]).contains("invalid size '8X' for wbps"));
        assert!(err(&["wbps", "99999999999T"]).contains("too large"));
        assert!(err(&["speed", "1"]).contains("unknown key 'speed'"));
        assert!(err(&["riops"]).contains("riops needs 1 value"));
        assert!(err(&["riops_burst", "5"]).contains("riops_burst needs 2 value"));
        assert!(err(&["riops", "5", "riops", "6"]).contains("riops given twice"));
    }

    #[test]
    fn set_checks_the_whole_and_changes_nothing_on_error() {
        let mut c = parse_limits(&["riops", "500", "riops_burst", "1000", "2"]).expect("valid");
        let before = c.clone();
        assert!(c.set(&["iops", "5"]).is_err());
        assert!(c.set(&["riops", "2000"]).is_err(), "above its burst");
        assert!(c.set(&["riops"]).is_err());
        assert!(c.set(&["riops_burst", "9"]).is_err());
        assert!(c.set(&["speed", "1"]).is_err());
        assert_eq!(c, before);
        c.set(&["riops", "0"])
            .expect("lifting a base lifts its burst");
        assert_eq!(c, Config::default());
        c.set(&["wbps", "4M"]).expect("set");
        assert_eq!(c.words().join(" "), "wbps 4M");
    }
}
