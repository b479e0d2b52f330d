//! docs/FIO.md's option lists are the option table's, and together they
//! cover every option fio's `options.c` defines: a new option in the
//! table, or a fio option left out, fails here until the page says so.

use blkstack_bench::option_table::{option_support, Support, IMPLEMENTED, NOT_APPLICABLE, REFUSED};
use blkstack_bench::JobSpec;
use std::collections::BTreeSet;
use std::path::Path;

fn doc() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/FIO.md");
    std::fs::read_to_string(&path).expect("docs/FIO.md")
}

/// The `- \`name\`` entries under a `### heading`.
fn listed(doc: &str, heading: &str) -> BTreeSet<String> {
    let start = doc
        .find(&format!("### {heading}"))
        .unwrap_or_else(|| panic!("docs/FIO.md has no '### {heading}'"));
    let rest = &doc[start + 4..];
    let end = rest.find("\n#").unwrap_or(rest.len());
    rest[..end]
        .lines()
        .filter_map(|l| l.strip_prefix("- `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_string)
        .collect()
}

#[test]
fn doc_lists_match_the_option_table() {
    let doc = doc();
    let table = |v: Vec<&str>| -> BTreeSet<String> { v.into_iter().map(String::from).collect() };
    assert_eq!(listed(&doc, "Implemented"), table(IMPLEMENTED.to_vec()));
    assert_eq!(
        listed(&doc, "Accepted, not applicable in process"),
        table(NOT_APPLICABLE.iter().map(|(k, _)| *k).collect())
    );
    assert_eq!(
        listed(&doc, "Refused"),
        table(REFUSED.iter().map(|(k, _)| *k).collect())
    );
}

#[test]
fn every_fio_option_is_implemented_accepted_or_refused() {
    let names = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fio-option-names.txt"),
    )
    .unwrap();
    let missing: Vec<&str> = names
        .lines()
        .map(str::trim)
        .filter(|n| !n.is_empty() && option_support(n).is_none())
        .collect();
    assert!(
        missing.is_empty(),
        "fio options not in the table: {missing:?}"
    );
}

#[test]
fn the_table_says_what_apply_does() {
    for &k in IMPLEMENTED {
        // Whatever a bad value gets, it is never "unknown" or "refused".
        let mut j = JobSpec::default();
        if let Err(e) = j.apply(k, Some("\u{1}bad")) {
            assert!(
                e.message != "unknown option" && !e.message.starts_with("not supported"),
                "{k}: {e}"
            );
        }
    }
    for &(k, _) in NOT_APPLICABLE {
        let mut j = JobSpec::default();
        j.apply(k, Some("1")).unwrap_or_else(|e| panic!("{k}: {e}"));
        assert_eq!(option_support(k), Some(Support::NotApplicable));
    }
    for &(k, why) in REFUSED {
        let e = JobSpec::default().apply(k, Some("1")).unwrap_err();
        assert_eq!(e.key, k);
        assert!(e.message.contains(why), "{k}: {e}");
    }
    let e = JobSpec::default().apply("bsize", Some("4k")).unwrap_err();
    assert_eq!(
        (e.key.as_str(), e.message.as_str()),
        ("bsize", "unknown option")
    );
}

#[test]
fn bare_booleans_and_engine_mappings() {
    let mut j = JobSpec::default();
    for k in [
        "hipri",
        "refill_buffers",
        "zero_buffers",
        "exitall",
        "sqthread_poll",
        "fixedbufs",
    ] {
        j.apply(k, None).unwrap_or_else(|e| panic!("{k}: {e}"));
    }
    assert_eq!(
        j.wait,
        blkstack_bench::WaitMode::Poll,
        "hipri is polled completion"
    );
    assert!(j.buffers.refill && j.buffers.zero && j.exitall);
    assert_eq!(j.not_applicable, vec!["sqthread_poll", "fixedbufs"]);
}
