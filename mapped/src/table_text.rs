//! The dmsetup table language, parsed by hand (no crate speaks it).
//!
//! Three forms, as dmsetup accepts them:
//! - a table: `start length target args...` lines in 512-byte sectors,
//!   `#` comments and blank lines ignored, arguments split on whitespace
//!   with backslash escaping one character (kernel `dm_split_args`);
//! - dmsetup's `--concise` list: `name,uuid,minor,flags,table[,table]...`
//!   devices separated by `;`, with `\,` `\;` `\\` escapes;
//! - a stack file: either concise text, or one `NAME: <table line>` per
//!   line (several lines with one NAME make a multi-line table), devices
//!   created in the order they first appear.
//!
//! Validation follows `dm_table_add_target`/`dm_table_complete`: the lines,
//! in order, must start at sector 0 and abut with no gap or overlap.

use crate::error::{ConciseError, DmError, LineError, NameError};
use std::fmt::Write as _;

/// One parsed table line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableLine {
    /// 1-based line number in the text it came from (for errors).
    pub line: usize,
    /// First sector the line covers (dm's `logical_start_sector`).
    pub start: u64,
    /// Sectors the line covers (dm's `num_sectors`); never 0.
    pub len: u64,
    /// The target type's name (`linear`, `thin-pool`, ...).
    pub target: String,
    /// The target's arguments, split on whitespace, as its constructor gets
    /// them (`argv`).
    pub args: Vec<String>,
}

impl TableLine {
    /// The line as `table` prints it (target and args re-escaped, so the
    /// text parses back to this line whatever characters they hold).
    pub fn to_text(&self) -> String {
        let target = escape_arg(&self.target);
        let mut s = format!("{} {} {target}", self.start, self.len);
        for a in &self.args {
            s.push(' ');
            s.push_str(&escape_arg(a));
        }
        s
    }
}

/// Backslash-escape whitespace and backslashes so `split_args` gives `a` back.
pub fn escape_arg(a: &str) -> String {
    let mut out = String::with_capacity(a.len());
    for c in a.chars() {
        if c.is_whitespace() || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Kernel `dm_split_args`: whitespace separates, backslash escapes.
pub fn split_args(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(n) = chars.next() {
                cur.push(n);
                in_word = true;
            }
        } else if c.is_whitespace() {
            if in_word {
                out.push(std::mem::take(&mut cur));
                in_word = false;
            }
        } else {
            cur.push(c);
            in_word = true;
        }
    }
    if in_word {
        out.push(cur);
    }
    out
}

const SECTOR_BYTES: u64 = 512;

/// The largest device end, in sectors: the last whole sector below 2^63
/// bytes. From 2^63 on a size no longer fits the signed 64-bit sizes
/// (`loff_t`, `off_t`) the kernel and NBD clients use, so a larger table
/// would show a negative size.
pub const MAX_SECTORS: u64 = (i64::MAX as u64) / SECTOR_BYTES;

fn parse_u64(what: &'static str, s: &str, line: usize) -> Result<u64, DmError> {
    s.parse::<u64>().map_err(|_| {
        DmError::line(
            line,
            LineError::Number {
                what,
                value: s.to_string(),
            },
        )
    })
}

/// Parse one table line (already stripped of comments) at `line`.
pub fn parse_line(text: &str, line: usize) -> Result<TableLine, DmError> {
    let words = split_args(text);
    if words.len() < 3 {
        return Err(DmError::line(
            line,
            LineError::Shape(text.trim().to_string()),
        ));
    }
    let start = parse_u64("start sector", &words[0], line)?;
    let len = parse_u64("length", &words[1], line)?;
    if len == 0 {
        return Err(DmError::line(line, LineError::ZeroLength));
    }
    let Some(end) = start.checked_add(len) else {
        return Err(DmError::line(line, LineError::Overflow { start, len }));
    };
    if len.checked_mul(SECTOR_BYTES).is_none() {
        return Err(DmError::line(line, LineError::LengthBytesOverflow { len }));
    }
    if end > MAX_SECTORS {
        return Err(DmError::line(
            line,
            LineError::TooLarge {
                start,
                len,
                end,
                max: MAX_SECTORS,
            },
        ));
    }
    Ok(TableLine {
        line,
        start,
        len,
        target: words[2].clone(),
        args: words[3..].to_vec(),
    })
}

/// Parse a whole table and check that its lines tile `0..size` exactly.
pub fn parse_table(text: &str) -> Result<Vec<TableLine>, DmError> {
    let mut lines = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let body = raw.trim();
        if body.is_empty() || body.starts_with('#') {
            continue;
        }
        lines.push(parse_line(body, i + 1)?);
    }
    check_layout(&lines)?;
    Ok(lines)
}

/// Lines must be in order, start at 0, and abut (dm: "Gap in table",
/// overlapping targets are refused too).
pub fn check_layout(lines: &[TableLine]) -> Result<(), DmError> {
    if lines.is_empty() {
        return Err(DmError::EmptyTable { device: None });
    }
    let mut sorted: Vec<&TableLine> = lines.iter().collect();
    sorted.sort_by_key(|l| l.start);
    let mut next = 0u64;
    let mut prev: Option<&TableLine> = None;
    for l in sorted {
        if l.start < next {
            let p = prev.map(|p| p.line).unwrap_or(0);
            return Err(DmError::line(
                l.line,
                LineError::Overlap {
                    start: l.start,
                    end: l.start + l.len,
                    prev_line: p,
                    prev_end: next,
                },
            ));
        }
        if l.start > next {
            return Err(match prev {
                None => DmError::line(l.line, LineError::NotAtZero { start: l.start }),
                Some(p) => DmError::line(
                    l.line,
                    LineError::Gap {
                        prev_line: p.line,
                        prev_end: next,
                        start: l.start,
                    },
                ),
            });
        }
        next = l.start + l.len;
        prev = Some(l);
    }
    // Lines must also appear in sector order, as the kernel requires.
    for w in lines.windows(2) {
        if w[1].start < w[0].start {
            return Err(DmError::line(
                w[1].line,
                LineError::OutOfOrder {
                    start: w[1].start,
                    prev_start: w[0].start,
                },
            ));
        }
    }
    Ok(())
}

/// Render a table as `dmsetup table` does (one line each, newline-ended).
pub fn render_table(lines: &[TableLine]) -> String {
    let mut s = String::new();
    for l in lines {
        let _ = writeln!(s, "{}", l.to_text());
    }
    s
}

/// One device of a `--concise` list or a stack file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSpec {
    /// The device's name (dmsetup's `--concise` `<name>`).
    pub name: String,
    /// Its uuid, if the spec gave one (`dmsetup create -u`).
    pub uuid: Option<String>,
    /// Its requested minor number, if the spec gave one.
    pub minor: Option<u32>,
    /// Whether the device is created read-only (`ro` instead of `rw`).
    pub read_only: bool,
    /// The table, one line per entry, in order.
    pub table: String,
    /// For a stack file: the file line each table line came from, so
    /// errors name the line the user wrote.
    pub origin_lines: Option<Vec<usize>>,
}

/// Split `s` on unescaped `sep`, keeping escapes of other characters intact
/// for the next level, and unescaping `\sep`.
fn split_escaped(s: &str, sep: char) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some(n) if n == sep => cur.push(n),
                Some(n) => {
                    cur.push('\\');
                    cur.push(n);
                }
                None => cur.push('\\'),
            }
        } else if c == sep {
            out.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    out.push(cur);
    out
}

/// Parse dmsetup's concise format: `name,uuid,minor,flags,table[,table]...`
/// with devices separated by `;`.
pub fn parse_concise(s: &str) -> Result<Vec<DeviceSpec>, DmError> {
    let mut out = Vec::new();
    for (i, dev) in split_escaped(s.trim(), ';').into_iter().enumerate() {
        let dev = dev.trim();
        if dev.is_empty() {
            continue;
        }
        let fields = split_escaped(dev, ',');
        let which = i + 1;
        if fields.len() < 5 {
            return Err(ConciseError::Fields {
                which,
                text: dev.to_string(),
                fields: fields.len(),
            }
            .into());
        }
        let name = fields[0].trim().to_string();
        validate_name(&name)?;
        let uuid = Some(fields[1].trim().to_string()).filter(|u| !u.is_empty());
        let minor = match fields[2].trim() {
            "" => None,
            m => Some(m.parse::<u32>().map_err(|_| ConciseError::Minor {
                name: name.clone(),
                minor: m.to_string(),
            })?),
        };
        let read_only = match fields[3].trim() {
            "" | "rw" => false,
            "ro" => true,
            f => {
                return Err(ConciseError::Flags {
                    name,
                    flags: f.to_string(),
                }
                .into())
            }
        };
        let table = fields[4..]
            .iter()
            .map(|t| t.trim())
            .collect::<Vec<_>>()
            .join("\n");
        out.push(DeviceSpec {
            name,
            uuid,
            minor,
            read_only,
            table,
            origin_lines: None,
        });
    }
    if out.is_empty() {
        return Err(ConciseError::NoDevice.into());
    }
    Ok(out)
}

/// Render devices in dmsetup's concise format.
pub fn render_concise(devs: &[DeviceSpec]) -> String {
    let esc = |s: &str| {
        s.replace('\\', "\\\\")
            .replace(',', "\\,")
            .replace(';', "\\;")
    };
    devs.iter()
        .map(|d| {
            let mut f = vec![
                esc(&d.name),
                esc(d.uuid.as_deref().unwrap_or("")),
                d.minor.map(|m| m.to_string()).unwrap_or_default(),
                if d.read_only {
                    "ro".into()
                } else {
                    "rw".into()
                },
            ];
            f.extend(d.table.lines().filter(|l| !l.trim().is_empty()).map(esc));
            f.join(",")
        })
        .collect::<Vec<_>>()
        .join(";")
}

/// Device names: what dm accepts in a `/dev/mapper/` name.
pub fn validate_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > 127 {
        return Err(NameError::TooLong(name.to_string()));
    }
    if name == "."
        || name == ".."
        || name.contains('/')
        || name.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(NameError::Bad(name.to_string()));
    }
    Ok(())
}

/// Parse a stack file: concise text, or `NAME: <table line>` lines.
pub fn parse_stack(text: &str) -> Result<Vec<DeviceSpec>, DmError> {
    let body: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
        .collect();
    if body.is_empty() {
        return Err(DmError::EmptyStack);
    }
    let is_named = |l: &str| {
        l.split_whitespace()
            .next()
            .is_some_and(|w| w.ends_with(':') && w.len() > 1)
    };
    if !body.iter().all(|(_, l)| is_named(l)) {
        if body.iter().any(|(_, l)| is_named(l)) {
            let (n, _) = body
                .iter()
                .find(|(_, l)| !is_named(l))
                .copied()
                .unwrap_or((0, ""));
            return Err(DmError::line(n, LineError::MixedStack));
        }
        let joined = body.iter().map(|(_, l)| *l).collect::<Vec<_>>().join("");
        return parse_concise(&joined);
    }
    let mut devs: Vec<DeviceSpec> = Vec::new();
    for (n, l) in body {
        let (name, rest) = l.split_once(':').unwrap_or((l, ""));
        let name = name.trim();
        validate_name(name).map_err(|e| DmError::line(n, e.into()))?;
        let rest = rest.trim();
        if let Some(args) = rest.strip_prefix("--luks") {
            let lines = crate::luks::stack_lines(name, args)
                .map_err(|e| DmError::line(n, LineError::Luks(e)))?;
            for (dev, table) in lines {
                devs.push(DeviceSpec {
                    name: dev,
                    uuid: None,
                    minor: None,
                    read_only: false,
                    table,
                    origin_lines: Some(vec![n]),
                });
            }
            continue;
        }
        // Validate the line syntax now, with its real line number.
        parse_line(rest, n).map_err(|e| e.in_device(name))?;
        match devs.iter_mut().find(|d| d.name == name) {
            Some(d) => {
                d.table.push('\n');
                d.table.push_str(rest);
                d.origin_lines.get_or_insert_with(Vec::new).push(n);
            }
            None => devs.push(DeviceSpec {
                name: name.to_string(),
                uuid: None,
                minor: None,
                read_only: false,
                table: rest.to_string(),
                origin_lines: Some(vec![n]),
            }),
        }
    }
    Ok(devs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printed_line_with_escaped_whitespace_in_the_target_parses_back() {
        // Found by the `table` fuzz target: the target name was printed
        // unescaped, so an escaped blank in it split the printed line.
        let l = parse_line("0 8 bad\\\ttarget arg\\ one", 1).unwrap();
        assert_eq!(l.target, "bad\ttarget");
        assert_eq!(l.args, vec!["arg one"]);
        assert_eq!(parse_line(&l.to_text(), 1).unwrap(), l);
    }

    #[test]
    fn parses_lines_comments_and_escapes() {
        let t = parse_table("# a comment\n\n0 100 linear zero0 0\n100 50 error\n").unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].line, 3);
        assert_eq!(t[0].args, vec!["zero0", "0"]);
        assert_eq!(t[1].target, "error");
        assert_eq!(split_args(r"a\ b  c\\d"), vec!["a b", r"c\d"]);
        assert_eq!(split_args(&escape_arg("x y\\z")), vec!["x y\\z"]);
    }

    #[test]
    fn rejects_bad_layouts_naming_the_line() {
        let e = parse_table("0 100 zero\n50 100 zero\n")
            .unwrap_err()
            .report();
        assert!(e.contains("line 2") && e.contains("overlap"), "{e}");
        let e = parse_table("0 100 zero\n200 100 zero\n")
            .unwrap_err()
            .report();
        assert!(e.contains("line 2") && e.contains("gap"), "{e}");
        let e = parse_table("10 100 zero\n").unwrap_err().report();
        assert!(e.contains("line 1") && e.contains("sector 0"), "{e}");
        let e = parse_table("0 1x0 zero\n").unwrap_err().report();
        assert!(
            e.contains("line 1") && e.contains("bad length '1x0'"),
            "{e}"
        );
        let e = parse_table("0 100\n").unwrap_err().report();
        assert!(e.contains("line 1"), "{e}");
        let e = parse_table("0 0 zero\n").unwrap_err().report();
        assert!(e.contains("zero-length"), "{e}");
        assert!(parse_table("# nothing\n").is_err());
    }

    #[test]
    fn sizes_past_the_limits_are_refused_naming_line_and_field() {
        // 2^55 + 8 sectors: x 512 wraps to 4096 bytes.
        let e = parse_table("0 36028797018963976 memory\n")
            .unwrap_err()
            .report();
        assert!(
            e.contains("line 1") && e.contains("length 36028797018963976 sectors x 512"),
            "{e}"
        );
        let e = parse_table(&format!("0 {} zero\n", u64::MAX))
            .unwrap_err()
            .report();
        assert!(e.contains("line 1") && e.contains("length"), "{e}");
        let e = parse_table(&format!("0 100 zero\n100 {} zero\n", u64::MAX - 50))
            .unwrap_err()
            .report();
        assert!(
            e.contains("line 2") && e.contains("start sector 100 + length"),
            "{e}"
        );
        // One sector past the limit, reached by a start and a length that
        // each fit.
        let half = MAX_SECTORS / 2;
        let rest = MAX_SECTORS - half;
        let text = format!("0 {half} zero\n{half} {} zero\n", rest + 1);
        let e = parse_table(&text).unwrap_err().report();
        assert!(
            e.contains("line 2")
                && e.contains("below 2^63 bytes")
                && e.contains(&format!("sector {}", MAX_SECTORS + 1)),
            "{e}"
        );
        // The last sector below 2^63 bytes ends the largest device.
        let t = parse_table(&format!("0 {half} zero\n{half} {rest} zero\n")).unwrap();
        assert_eq!(t[1].start + t[1].len, MAX_SECTORS);
    }

    #[test]
    fn concise_round_trip() {
        let s = "a,,,rw,0 100 zero;b,uuid-b,5,ro,0 50 linear a 0,50 50 linear a 50";
        let d = parse_concise(s).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d[1].minor, Some(5));
        assert!(d[1].read_only);
        assert_eq!(d[1].table, "0 50 linear a 0\n50 50 linear a 50");
        assert_eq!(parse_concise(&render_concise(&d)).unwrap(), d);
        assert!(parse_concise("a,,x,rw,0 1 zero")
            .unwrap_err()
            .report()
            .contains("minor"));
        assert!(parse_concise("a,,,zz,0 1 zero")
            .unwrap_err()
            .report()
            .contains("flags"));
        assert!(parse_concise("a,,,rw").is_err());
    }

    #[test]
    fn stack_named_lines_group_by_name() {
        let d = parse_stack(
            "# stack\nm0: 0 100 memory\nlin: 0 50 linear m0 0\nlin: 50 50 linear m0 50\n",
        )
        .unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d[1].table, "0 50 linear m0 0\n50 50 linear m0 50");
        let e = parse_stack("m0: 0 x memory\n").unwrap_err().report();
        assert!(e.contains("line 1") && e.contains("m0"), "{e}");
        let c = parse_stack("z,,,rw,0 8 zero\n").unwrap();
        assert_eq!(c[0].name, "z");
    }
}
