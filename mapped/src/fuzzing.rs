//! Fuzzing entry points (cargo-fuzz's `table` and `concise` targets, and
//! the stable regression test that replays their corpora): the table
//! language and dmsetup's concise/stack formats, then every target's
//! constructor through a create on a throwaway [`Registry`].
//!
//! As with dmsetup's `create`, parsing is all or nothing and a table the
//! kernel's `dm_table_add_target` would refuse must come back as an error,
//! never a panic. Two limits keep a fuzzing run harmless: tables naming
//! the `file` target are only parsed (its constructor opens and creates
//! files), and tables longer than [`MAX_SECTORS`] are only parsed, so no
//! input makes the fuzzer allocate much or touch the filesystem.

use crate::registry::Registry;
use crate::table_text::{parse_line, parse_stack, parse_table, TableLine};
use blkstack_core::Device;
use std::sync::Arc;

/// Longest device (in 512-byte sectors) a fuzzed table may build: 1 GiB.
pub const MAX_SECTORS: u64 = 1 << 21;

/// Devices every fuzzed table may name as its underlying devices.
const BASE_DEVICES: &str = "base,,,rw,0 16384 memory;slow,,,rw,0 8192 zero";

/// One table text (the text of `dmsetup create NAME --table`): parse it,
/// check each line prints back to itself, and, when harmless, build it as
/// device `fz` and check its size is the sum of its lines.
pub fn table(input: &[u8]) {
    let Ok(text) = std::str::from_utf8(input) else {
        return;
    };
    let Ok(lines) = parse_table(text) else {
        return;
    };
    for l in &lines {
        check_round_trip(l);
    }
    if !harmless(&lines) {
        return;
    }
    let reg = base_registry();
    if let Ok(dev) = reg.create("fz", text) {
        let sectors: u64 = lines.iter().map(|l| l.len).sum();
        assert_eq!(dev.size(), sectors * 512, "device size of {text:?}");
        let _ = reg.table_text("fz");
        let _ = reg.status_text("fz");
        let _ = reg.info("fz");
    }
    reg.remove_all();
}

/// One stack file or concise list (`blkstack serve --stack`/`--concise`):
/// parse it and, when every table is harmless, create all of its devices.
pub fn concise(input: &[u8]) {
    let Ok(text) = std::str::from_utf8(input) else {
        return;
    };
    let Ok(specs) = parse_stack(text) else {
        return;
    };
    let all_harmless = specs
        .iter()
        .all(|s| parse_table(&s.table).is_ok_and(|l| harmless(&l)));
    if !all_harmless {
        return;
    }
    let reg = base_registry();
    if let Ok(names) = reg.create_specs(&specs) {
        for n in &names {
            let table = reg.table_text(n).expect("a created device has a table");
            assert!(
                parse_table(&table).is_ok(),
                "table of {n} as printed does not parse: {table:?}"
            );
        }
    }
    reg.remove_all();
}

/// A registry holding the devices fuzzed tables may stack on.
fn base_registry() -> Arc<Registry> {
    let reg = Registry::new();
    reg.create_concise(BASE_DEVICES)
        .expect("the fuzzing base devices");
    reg
}

/// Whether building `lines` is safe in a fuzzing run (see the module
/// documentation).
fn harmless(lines: &[TableLine]) -> bool {
    let total = lines.iter().try_fold(0u64, |acc, l| acc.checked_add(l.len));
    lines.iter().all(|l| l.target != "file") && total.is_some_and(|t| t <= MAX_SECTORS)
}

/// A parsed line, printed as `table` prints it, parses to the same line.
fn check_round_trip(l: &TableLine) {
    let text = l.to_text();
    let again = parse_line(&text, l.line)
        .unwrap_or_else(|e| panic!("{text:?}, printed from {l:?}, does not parse: {e}"));
    assert_eq!(
        &again, l,
        "{text:?} does not parse back to the line it came from"
    );
}
