//! The kernel parity suite's corpus and transcripts: the same dm tables,
//! messages and I/O run through Linux 6.12's device-mapper (in the kernel
//! VM) and through blkstack, each side writing a transcript in one
//! normalised form so that the two can be compared line for line.
//!
//! The corpus lives in `tests/data/kernel-parity/`: `bad-tables.txt` (one
//! table per `ti->error` path of the kernel's constructors for linear,
//! striped, zero, error, delay, flakey, multipath and its path selectors,
//! plus dm-table.c's own refusals), `good-tables.txt` (tables with
//! messages and I/O steps), `deliberate.txt` (where blkstack differs on
//! purpose) and `fixed.txt` (differences found and fixed). The kernel's
//! transcript is recorded in `kernel-6.12.transcript` by the VM test, so
//! the blkstack side can be checked against it on any machine.

#![allow(dead_code)] // the two tests use different halves

pub mod blkstack_side;
pub mod kernel_side;
pub mod page;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Legs every case may name: (name, sectors).
pub const LEGS: [(&str, u64); 4] = [("l0", 2048), ("l1", 2048), ("l2", 2048), ("ls", 16)];
/// Sectors of the write pattern file.
pub const PATTERN_SECTORS: u64 = 2048;

pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/kernel-parity")
}

pub fn transcript_path() -> PathBuf {
    data_dir().join("kernel-6.12.transcript")
}

pub fn page_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/KERNEL-PARITY.md")
}

/// Whether the test should rewrite its recorded files instead of
/// comparing against them.
pub fn updating() -> bool {
    std::env::var_os("BLKSTACK_UPDATE_PARITY").is_some()
}

/// One table the kernel refuses (or, for a deliberate difference, the one
/// the two differ on).
#[derive(Clone, Debug)]
pub struct BadCase {
    pub id: String,
    pub file: String,
    /// The `ti->error` (or DMERR) text the kernel's log shows; in
    /// parentheses when the kernel accepts the table.
    pub error: String,
    pub lines: Vec<String>,
}

/// One step of a good case.
#[derive(Clone, Debug)]
pub enum Step {
    Msg {
        sector: u64,
        words: Vec<String>,
    },
    Write {
        sector: u64,
        count: u64,
    },
    Read {
        sector: u64,
        count: u64,
    },
    /// `dmsetup reload` then `resume`: its lines.
    Reload {
        lines: Vec<String>,
    },
    /// A write (or read) still held by a slow target when `table` and
    /// `status` are taken, [`HELD_SNAP_SECS`] after it was issued.
    Held {
        write: bool,
        sector: u64,
        count: u64,
    },
}

/// How long after issuing a held I/O both sides take their snapshot; the
/// cases' delays are longer (2000 ms).
pub const HELD_SNAP_SECS: u64 = 1;

impl Step {
    /// The step as the transcript names it (devices as written, `$l0`).
    pub fn label(&self) -> String {
        match self {
            Step::Msg { sector, words } => format!("msg {sector} {}", words.join(" ")),
            Step::Write { sector, count } => format!("write {sector} {count}"),
            Step::Read { sector, count } => format!("read {sector} {count}"),
            Step::Reload { lines } => format!("reload {}", lines.join(" \\n ")),
            Step::Held {
                write,
                sector,
                count,
            } => format!(
                "held {} {sector} {count}",
                if *write { "write" } else { "read" }
            ),
        }
    }
}

impl Step {
    /// Whether the step can change the table text (a message or a
    /// reload); after I/O only `status` is taken again, which saves a
    /// dmsetup call per step in the guest.
    pub fn changes_table(&self) -> bool {
        matches!(self, Step::Msg { .. } | Step::Reload { .. })
    }
}

#[derive(Clone, Debug)]
pub struct GoodCase {
    pub id: String,
    pub target: String,
    pub feature: String,
    /// Helper devices: (name, table line).
    pub devs: Vec<(String, String)>,
    pub lines: Vec<String>,
    pub steps: Vec<Step>,
}

impl GoodCase {
    /// The legs the case names (its table, helpers and reloads): their
    /// contents are compared after each write. A stray write to another
    /// leg still shows, in the next case that names that leg.
    pub fn legs_used(&self) -> Vec<&'static str> {
        let words: Vec<&str> = self
            .lines
            .iter()
            .chain(self.devs.iter().map(|(_, t)| t))
            .chain(self.steps.iter().flat_map(|s| match s {
                Step::Reload { lines } => lines.iter().collect(),
                _ => Vec::new(),
            }))
            .flat_map(|l| l.split_whitespace())
            .collect();
        LEGS.iter()
            .map(|(n, _)| *n)
            .filter(|n| words.iter().any(|w| w.strip_prefix('$') == Some(n)))
            .collect()
    }
}

/// A documented outcome: `deliberate.txt` or `fixed.txt`.
#[derive(Clone, Debug)]
pub struct Note {
    pub id: String,
    pub target: String,
    pub feature: String,
    pub why: String,
}

fn read(name: &str) -> String {
    let p = data_dir().join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn body_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
}

fn fields(line: &str, n: usize, file: &str, at: usize) -> Vec<String> {
    let f: Vec<String> = line.splitn(n, '|').map(|s| s.trim().to_string()).collect();
    assert_eq!(
        f.len(),
        n,
        "{file}:{at}: want {n} '|'-separated fields: {line}"
    );
    f
}

pub fn bad_cases() -> Vec<BadCase> {
    let text = read("bad-tables.txt");
    body_lines(&text)
        .map(|(at, l)| {
            let f = fields(l, 4, "bad-tables.txt", at);
            BadCase {
                id: f[0].clone(),
                file: f[1].clone(),
                error: f[2].clone(),
                lines: f[3].split(" \\n ").map(|s| s.trim().to_string()).collect(),
            }
        })
        .collect()
}

fn num(s: Option<&str>, at: usize) -> u64 {
    s.and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("good-tables.txt:{at}: want a number, got {s:?}"))
}

pub fn good_cases() -> Vec<GoodCase> {
    let text = read("good-tables.txt");
    let mut out: Vec<GoodCase> = Vec::new();
    let mut cur: Option<GoodCase> = None;
    for (at, l) in body_lines(&text) {
        let (word, rest) = l.split_once(' ').unwrap_or((l, ""));
        let mut w = rest.split_whitespace();
        match (word, cur.as_mut()) {
            ("case", None) => {
                let f = fields(rest, 3, "good-tables.txt", at);
                cur = Some(GoodCase {
                    id: f[0].clone(),
                    target: f[1].clone(),
                    feature: f[2].clone(),
                    devs: Vec::new(),
                    lines: Vec::new(),
                    steps: Vec::new(),
                });
            }
            ("end", Some(_)) => out.extend(cur.take()),
            ("dev", Some(c)) => {
                let (name, table) = rest.split_once(' ').expect("dev NAME TABLE");
                c.devs.push((name.to_string(), table.to_string()));
            }
            ("table", Some(c)) => c.lines.push(rest.to_string()),
            ("msg", Some(c)) => {
                let sector = num(w.next(), at);
                let words = w.map(str::to_string).collect();
                c.steps.push(Step::Msg { sector, words });
            }
            ("reload", Some(c)) => c.steps.push(Step::Reload {
                lines: rest.split(" \\n ").map(|l| l.trim().to_string()).collect(),
            }),
            ("held", Some(c)) => {
                let write = match w.next() {
                    Some("write") => true,
                    Some("read") => false,
                    o => panic!("good-tables.txt:{at}: held read|write, got {o:?}"),
                };
                let (sector, count) = (num(w.next(), at), num(w.next(), at));
                c.steps.push(Step::Held {
                    write,
                    sector,
                    count,
                });
            }
            ("write" | "read", Some(c)) => {
                let (sector, count) = (num(w.next(), at), num(w.next(), at));
                c.steps.push(if word == "write" {
                    Step::Write { sector, count }
                } else {
                    Step::Read { sector, count }
                });
            }
            _ => panic!("good-tables.txt:{at}: unexpected '{l}'"),
        }
    }
    assert!(cur.is_none(), "good-tables.txt: last case has no 'end'");
    out
}

pub fn notes(name: &str) -> Vec<Note> {
    let text = read(name);
    body_lines(&text)
        .map(|(at, l)| {
            let f = fields(l, 4, name, at);
            Note {
                id: f[0].clone(),
                target: f[1].clone(),
                feature: f[2].clone(),
                why: f[3].clone(),
            }
        })
        .collect()
}

/// Substitute `$l0`-style placeholders with what one side calls them.
pub fn subst(text: &str, dev: &dyn Fn(&str) -> String) -> String {
    text.split(' ')
        .map(|w| match w.strip_prefix('$') {
            Some(name) => dev(name),
            None => w.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Replace device numbers (`MAJ:MIN` words) by `<name>` and drop the
/// trailing blanks dmsetup leaves after a target's arguments.
pub fn normalise(line: &str, devnums: &BTreeMap<String, String>) -> String {
    line.split(' ')
        .map(|w| match devnums.get(w) {
            Some(name) => format!("<{name}>"),
            None => w.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
        .trim_end()
        .to_string()
}

/// Transcripts: case id to its lines.
pub type Transcript = BTreeMap<String, Vec<String>>;

pub fn render_transcript(t: &Transcript) -> String {
    let mut s = String::from(
        "# Linux 6.12 device-mapper's answers to tests/data/kernel-parity's cases,\n\
         # recorded in the kernel VM by tests/kernel_parity.rs\n\
         # (BLKSTACK_UPDATE_PARITY=1 rewrites it). Do not edit by hand.\n",
    );
    for (id, lines) in t {
        s.push_str(&format!("== {id}\n"));
        for l in lines {
            s.push_str(l);
            s.push('\n');
        }
    }
    s
}

pub fn parse_transcript(text: &str) -> Transcript {
    let mut t = Transcript::new();
    let mut cur: Option<String> = None;
    for l in text.lines() {
        if l.starts_with('#') {
            continue;
        }
        if let Some(id) = l.strip_prefix("== ") {
            cur = Some(id.to_string());
            t.entry(id.to_string()).or_default();
        } else if let Some(id) = &cur {
            t.entry(id.clone()).or_default().push(l.to_string());
        }
    }
    t
}

/// The lines the two sides must agree on: the kernel's log lines are
/// evidence for the corpus, not part of the comparison.
pub fn compared(lines: &[String]) -> Vec<&String> {
    lines.iter().filter(|l| !l.starts_with("log: ")).collect()
}

/// Deterministic contents: leg `i`'s initial fill and the write pattern.
pub fn fill(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// The write pattern (what `make_images` writes as `pattern`).
pub fn pattern() -> Vec<u8> {
    fill(99, (PATTERN_SECTORS * 512) as usize)
}

/// Whether each cross case's two reads in `t` gave what was written: the
/// kernel's read of blkstack's half and blkstack's read of the kernel's.
pub fn cross_outcomes(cases: &[CrossCase], t: &Transcript) -> BTreeMap<String, bool> {
    let pattern = pattern();
    cases
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let lines = t.get(&c.id).cloned().unwrap_or_default();
            let want = [
                format!(
                    "kernel-read: ok {}",
                    cross_expected(c, k as u64, 0, &pattern)
                ),
                format!(
                    "blkstack-read: ok {}",
                    cross_expected(c, k as u64, 1, &pattern)
                ),
            ];
            (c.id.clone(), lines == want)
        })
        .collect()
}

/// Pattern sectors used by the `k`th write step of the whole corpus.
pub fn pattern_skip(k: u64, count: u64) -> u64 {
    (k * 97) % (PATTERN_SECTORS - count)
}

pub fn md5_hex(data: &[u8]) -> String {
    use md5::{Digest, Md5};
    let d = Md5::digest(data);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes the legs' image files (each filled from its own seed) and the
/// pattern file into `dir`.
pub fn make_images(dir: &Path) {
    for (i, (name, sectors)) in LEGS.iter().enumerate() {
        let data = fill(i as u64 + 1, (*sectors * 512) as usize);
        std::fs::write(dir.join(format!("{name}.img")), data).expect("leg image");
    }
    std::fs::write(dir.join("pattern"), pattern()).expect("pattern");
}

/// A table data is written through by one stack and read by the other.
#[derive(Clone, Debug)]
pub struct CrossCase {
    pub id: String,
    pub target: String,
    pub line: String,
}

impl CrossCase {
    pub fn sectors(&self) -> u64 {
        self.line
            .split_whitespace()
            .nth(1)
            .and_then(|l| l.parse().ok())
            .unwrap_or_else(|| panic!("{}: no length", self.id))
    }

    /// (sector, count) of half 0 (blkstack writes, the kernel reads) or
    /// half 1 (the kernel writes, blkstack reads).
    pub fn half(&self, h: u64) -> (u64, u64) {
        let n = self.sectors() / 2;
        (h * n, n)
    }

    /// The pattern sectors written into half `h` of the `k`th case.
    pub fn pattern_skip(&self, k: u64, h: u64) -> u64 {
        (1000 + (2 * k + h) * 131) % (PATTERN_SECTORS - self.half(h).1)
    }
}

pub fn cross_cases() -> Vec<CrossCase> {
    let text = read("cross.txt");
    body_lines(&text)
        .map(|(at, l)| {
            let f = fields(l, 3, "cross.txt", at);
            CrossCase {
                id: f[0].clone(),
                target: f[1].clone(),
                line: f[2].clone(),
            }
        })
        .collect()
}

/// What each direction of cross case `k` must read: the md5 of the
/// pattern written into that half.
pub fn cross_expected(c: &CrossCase, k: u64, h: u64, pattern: &[u8]) -> String {
    let skip = c.pattern_skip(k, h) as usize * 512;
    let len = c.half(h).1 as usize * 512;
    md5_hex(&pattern[skip..skip + len])
}
