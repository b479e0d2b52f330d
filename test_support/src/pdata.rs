//! thin-provisioning-tools as the tests run them: one runner for every
//! `*_check`, `*_dump` and `era_invalidate` call on a metadata file, and
//! the parser of `era_invalidate`'s XML, shared by the era and cache tests
//! on the host and beside the kernel VM.

use crate::process::tool;
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// Runs thin-provisioning-tools' `name` with `args` on `meta` and returns
/// its stdout; panics with its whole output if it fails (a tool that
/// finds the metadata wrong fails the test).
pub fn pdata_tool_ok(name: &str, args: &[&str], meta: &Path) -> String {
    let out = Command::new(tool(name))
        .args(args)
        .arg(meta)
        .output()
        .unwrap_or_else(|e| panic!("run {name}: {e}"));
    assert!(
        out.status.success(),
        "{name} {args:?} {} failed:\n{}{}",
        meta.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The blocks in `era_invalidate`'s XML (`<block block=N/>` and
/// `<range begin=A end=B/>`, end exclusive).
pub fn era_invalidated(xml: &str) -> BTreeSet<u64> {
    // era_invalidate writes `begin="0" end = "2"`: spaces around `=`.
    let attr = |line: &str, name: &str| -> u64 {
        let at = line
            .find(&format!(" {name}"))
            .unwrap_or_else(|| panic!("no {name} in {line}"));
        let rest = line[at + name.len() + 1..].trim_start_matches([' ', '=', '"']);
        let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        digits
            .parse()
            .unwrap_or_else(|_| panic!("no {name} in {line}"))
    };
    let mut out = BTreeSet::new();
    for line in xml.lines() {
        if line.contains("<range") {
            out.extend(attr(line, "begin")..attr(line, "end"));
        } else if line.contains("<block ") {
            out.insert(attr(line, "block"));
        }
    }
    out
}

/// The blocks `era_invalidate --metadata-snapshot --written-since era`
/// lists for `meta`.
pub fn era_written_since(meta: &Path, era: u64) -> BTreeSet<u64> {
    let xml = pdata_tool_ok(
        "era_invalidate",
        &["--metadata-snapshot", "--written-since", &era.to_string()],
        meta,
    );
    era_invalidated(&xml)
}

#[cfg(test)]
mod tests {
    use super::era_invalidated;

    #[test]
    fn era_invalidate_xml_is_read_with_spaces_around_equals() {
        let xml = "<blocks>\n  <range begin=\"0\" end = \"2\"/>\n  <block block=\"7\"/>\n</blocks>";
        assert_eq!(
            era_invalidated(xml).into_iter().collect::<Vec<_>>(),
            [0, 1, 7]
        );
    }
}
