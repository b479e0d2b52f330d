//! Hostile LUKS headers, on stable Rust: the `luks_header` fuzz corpus
//! (headers `cryptsetup luksFormat` made, fuzz/seed-luks-header.sh) and
//! every input a fuzzer ever crashed on (fuzz/regressions/luks_header/)
//! replayed through the fuzz entry point; proptests that mutate those
//! real headers, byte by byte and field by field in the LUKS2 JSON, and
//! require a clean error or a header that passes its checks, never a
//! panic; and the KDF cost, area and nesting bounds refused by name.

use blkstack_mapped::luks::fuzz::{luks_header, repair_checksums, Outcome};
use blkstack_mapped::luks::{parse_image, LuksError, MemImage};
use proptest::prelude::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

fn fuzz_dir(kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz")
        .join(kind)
        .join("luks_header")
}

fn inputs(kind: &str) -> Vec<(String, Vec<u8>)> {
    let Ok(rd) = std::fs::read_dir(fuzz_dir(kind)) else {
        return Vec::new();
    };
    let mut v: Vec<_> = rd
        .map(|e| e.expect("corpus directory entry").path())
        .filter(|p| p.is_file())
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).expect("read corpus input"))
        })
        .collect();
    v.sort();
    v
}

/// The corpus seeds: each parses, the `-unlocks` ones open with the
/// passphrase they were made with (so the fuzzer starts on the whole
/// path), and every regression input runs through without a panic.
#[test]
fn corpus_and_regressions_replay() {
    let corpus = inputs("corpus");
    assert!(
        corpus.len() >= 6,
        "fuzz/corpus/luks_header: {} inputs",
        corpus.len()
    );
    for (name, data) in &corpus {
        let got = luks_header(data);
        if name.ends_with("-unlocks") {
            assert_eq!(got, Outcome::Unlocked, "{name}");
        } else if name.starts_with("luks") {
            assert_eq!(got, Outcome::Parsed, "{name}");
        }
    }
    for (name, data) in inputs("regressions") {
        let got = luks_header(&data);
        tracing::info!("{name}: {got:?}");
    }
}

/// A seed's image: (size, first bytes).
fn seed(name: &str) -> (u64, Vec<u8>) {
    let data = std::fs::read(fuzz_dir("corpus").join(name)).expect("seed");
    let size = u64::from_le_bytes(data[1..9].try_into().unwrap());
    (size, data[9..].to_vec())
}

fn parse(size: u64, bytes: &[u8]) -> Result<blkstack_mapped::luks::Header, LuksError> {
    parse_image(&MemImage { bytes, size })
}

/// The LUKS2 JSON of a seed (primary copy).
fn json_of(bytes: &[u8]) -> Value {
    let hdr = u64::from_be_bytes(bytes[8..16].try_into().unwrap()) as usize;
    let area = &bytes[4096..hdr];
    let end = area.iter().position(|&c| c == 0).unwrap();
    serde_json::from_slice(&area[..end]).unwrap()
}

/// `bytes` with `v` as the JSON of both LUKS2 copies, checksums repaired;
/// `None` when it does not fit the JSON area.
fn with_json(bytes: &[u8], v: &Value) -> Option<Vec<u8>> {
    let hdr = u64::from_be_bytes(bytes[8..16].try_into().unwrap()) as usize;
    let text = serde_json::to_vec(v).unwrap();
    if text.len() >= hdr - 4096 {
        return None;
    }
    let mut out = bytes.to_vec();
    for off in [0, hdr] {
        let area = &mut out[off + 4096..off + hdr];
        area.fill(0);
        area[..text.len()].copy_from_slice(&text);
    }
    repair_checksums(&mut out);
    Some(out)
}

/// Set the field at `path` (keys, `*` for the first member) of `v`.
fn set(v: &mut Value, path: &[&str], to: Value) {
    let mut cur = v;
    for k in &path[..path.len() - 1] {
        cur = if *k == "*" {
            cur.as_object_mut().unwrap().values_mut().next().unwrap()
        } else {
            cur.get_mut(*k).unwrap()
        };
    }
    cur[path[path.len() - 1]] = to;
}

const FIELDS: &[&[&str]] = &[
    &["keyslots", "*", "key_size"],
    &["keyslots", "*", "kdf", "time"],
    &["keyslots", "*", "kdf", "memory"],
    &["keyslots", "*", "kdf", "cpus"],
    &["keyslots", "*", "kdf", "iterations"],
    &["keyslots", "*", "kdf", "salt"],
    &["keyslots", "*", "kdf", "type"],
    &["keyslots", "*", "af", "stripes"],
    &["keyslots", "*", "af", "hash"],
    &["keyslots", "*", "area", "offset"],
    &["keyslots", "*", "area", "size"],
    &["keyslots", "*", "area", "key_size"],
    &["keyslots", "*", "area", "encryption"],
    &["segments", "*", "offset"],
    &["segments", "*", "size"],
    &["segments", "*", "iv_tweak"],
    &["segments", "*", "sector_size"],
    &["segments", "*", "encryption"],
    &["digests", "*", "iterations"],
    &["digests", "*", "digest"],
    &["digests", "*", "keyslots"],
    &["config", "keyslots_size"],
    &["keyslots"],
    &["segments"],
];

fn hostile_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(u32::MAX)),
        Just(json!(u64::MAX)),
        Just(json!(1e300)),
        Just(json!(u64::MAX.to_string())),
        Just(json!("18446744073709551616")),
        Just(json!("-4096")),
        Just(json!("")),
        Just(json!(null)),
        Just(json!([[[[[[[[[[1]]]]]]]]]])),
        Just(json!({})),
        any::<u64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n.to_string())),
        "[a-z0-9()_:-]{0,40}".prop_map(Value::String),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random bytes written over a real header (the binary part, the
    /// JSON, a LUKS1 keyslot), with or without the checksums repaired:
    /// a header that passes its checks, or an error; never a panic.
    #[test]
    fn mutated_real_headers_fail_cleanly(
        which in 0usize..4,
        edits in proptest::collection::vec((0usize..32768, any::<u64>(), 1usize..=8), 1..8),
        repair in any::<bool>(),
        size_delta in -40_000_000i64..40_000_000,
    ) {
        let name = ["luks1-xts512-sha256", "luks2-argon2id", "luks2-argon2i-label-4k",
                    "luks2-pbkdf2-xts256-meta32k"][which];
        let (size, mut bytes) = seed(name);
        for (off, v, n) in edits {
            let off = off % bytes.len().saturating_sub(8).max(1);
            bytes[off..off + n].copy_from_slice(&v.to_be_bytes()[..n]);
        }
        if repair {
            repair_checksums(&mut bytes);
        }
        let size = size.saturating_add_signed(size_delta);
        if let Err(e) = parse(size, &bytes) {
            prop_assert!(!e.to_string().is_empty());
        }
    }

    /// One LUKS2 JSON field set to a hostile value (checksums valid):
    /// a clean error or a header that passes its checks.
    #[test]
    fn hostile_json_fields_fail_cleanly(
        field in 0..FIELDS.len(),
        value in hostile_value(),
        argon in any::<bool>(),
    ) {
        let (size, bytes) = seed(if argon { "luks2-argon2id" } else { "luks2-pbkdf2-xts256-meta32k" });
        let mut v = json_of(&bytes);
        set(&mut v, FIELDS[field], value);
        if let Some(b) = with_json(&bytes, &v) {
            if let Err(e) = parse(size, &b) {
                prop_assert!(!e.to_string().is_empty());
            }
        }
    }
}

fn luks2_err(name: &str, path: &[&str], to: Value) -> String {
    let (size, bytes) = seed(name);
    let mut v = json_of(&bytes);
    set(&mut v, path, to);
    let b = with_json(&bytes, &v).expect("fits");
    parse(size, &b).expect_err("a hostile field").to_string()
}

#[test]
fn kdf_costs_past_the_bounds_are_refused_by_name() {
    let a = "luks2-argon2id";
    let p = "luks2-pbkdf2-xts256-meta32k";
    let kdf = |k| ["keyslots", "*", "kdf", k];
    let e = luks2_err(a, &kdf("memory"), json!((4u64 << 20) + 1));
    assert!(
        e.contains("argon2 cost") && e.contains("memory 4194305"),
        "{e}"
    );
    let e = luks2_err(a, &kdf("time"), json!(1u64 << 20));
    assert!(e.contains("argon2 cost time 1048576"), "{e}");
    // Each within its own bound, the product past the work bound.
    let (size, bytes) = seed(a);
    let mut v = json_of(&bytes);
    set(&mut v, &kdf("memory"), json!(4u64 << 20));
    set(&mut v, &kdf("time"), json!(64));
    let e = parse(size, &with_json(&bytes, &v).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("time × memory"), "{e}");
    let e = luks2_err(a, &kdf("cpus"), json!(64));
    assert!(e.contains("threads 64"), "{e}");
    let e = luks2_err(p, &kdf("iterations"), json!(u32::MAX));
    assert!(e.contains("4294967295 PBKDF2 iterations"), "{e}");
    let e = luks2_err(p, &["digests", "*", "iterations"], json!(1u64 << 31));
    assert!(
        e.contains("volume key digest") && e.contains("PBKDF2 iterations"),
        "{e}"
    );
}

#[test]
fn areas_sizes_and_nesting_are_refused_by_name() {
    let p = "luks2-pbkdf2-xts256-meta32k";
    // A keyslot area past the end of the image, then past the keyslots
    // area, then inside the header copies.
    let area = |k| ["keyslots", "*", "area", k];
    let e = luks2_err(p, &area("offset"), json!("1099511627776"));
    assert!(e.contains("outside"), "{e}");
    let e = luks2_err(p, &area("size"), json!("1073741824"));
    assert!(e.contains("outside"), "{e}");
    let e = luks2_err(p, &area("offset"), json!("4096"));
    assert!(e.contains("outside"), "{e}");
    let e = luks2_err(p, &["keyslots", "*", "key_size"], json!(u64::MAX));
    assert!(e.contains("key size"), "{e}");
    let e = luks2_err(p, &["keyslots", "*", "af", "stripes"], json!(1u64 << 40));
    assert!(e.contains("AF stripes"), "{e}");
    let e = luks2_err(p, &["segments", "*", "offset"], json!("0"));
    assert!(e.contains("inside the metadata"), "{e}");
    let e = luks2_err(
        p,
        &["config", "keyslots_size"],
        json!("18446744073709551615"),
    );
    assert!(e.contains("keyslots_size"), "{e}");
    // JSON nested far deeper than serde_json's recursion limit.
    let (size, mut bytes) = seed(p);
    let deep = format!("{}{}", "[".repeat(10000), "]".repeat(10000));
    for off in [0, 32768] {
        let area = &mut bytes[off + 4096..off + 32768];
        area.fill(0);
        area[..deep.len()].copy_from_slice(deep.as_bytes());
    }
    repair_checksums(&mut bytes);
    let e = parse(size, &bytes).unwrap_err().to_string();
    assert!(e.contains("JSON metadata"), "{e}");
}
