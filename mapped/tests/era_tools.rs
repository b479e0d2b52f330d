//! The era target as its users see it, judged by thin-provisioning-tools'
//! `era_check`, `era_dump` and `era_invalidate`: writes in several eras,
//! checkpoints and a metadata snapshot leave metadata `era_check`
//! passes, and `era_invalidate --written-since N` lists exactly the
//! blocks written since era N; the metadata opened again carries on.

mod thin_support;

use blkstack_mapped::Registry;
use blkstack_test_support::{era_invalidated, pdata_tool_ok};
use std::collections::BTreeSet;
use thin_support::*;

const SECTORS: u64 = 32768;
const BLOCK_SECTORS: u64 = 128;

fn era_registry(f: &Files) -> std::sync::Arc<Registry> {
    let reg = files_registry(f, SECTORS);
    reg.create("era", &format!("0 {SECTORS} era meta data {BLOCK_SECTORS}"))
        .unwrap();
    reg
}

fn era_msg(reg: &Registry, text: &str) {
    reg.message("era", 0, &[text])
        .unwrap_or_else(|e| panic!("message {text}: {e}: {:?}", std::error::Error::source(&e)));
}

fn write_blocks(reg: &Registry, blocks: &[u64]) {
    let dev = reg.device("era").unwrap();
    for &b in blocks {
        let off = b * BLOCK_SECTORS * 512 + 4096;
        write(&*dev, off, &pattern(b, off, 4096));
    }
}

#[test]
fn eras_checkpoints_and_a_snapshot_pass_era_check_and_era_invalidate() {
    let f = files();
    let reg = era_registry(&f);
    // <metadata block size> <used>/<total> <current era> <held root>
    let s = status(&reg, "era");
    assert_eq!(s[0], "8");
    assert!(s[1].ends_with("/1024"), "{s:?}");
    assert_eq!((s[2].as_str(), s[3].as_str()), ("1", "-"), "{s:?}");

    write_blocks(&reg, &[0, 5, 100]);
    era_msg(&reg, "checkpoint");
    write_blocks(&reg, &[5, 7, 200, 255]);
    era_msg(&reg, "checkpoint");
    write_blocks(&reg, &[9]);
    era_msg(&reg, "take_metadata_snap");
    let s = status(&reg, "era");
    assert_eq!(s[2], "4", "{s:?}");
    assert_ne!(s[3], "-", "a held snapshot: {s:?}");
    assert!(
        reg.message("era", 0, &["take_metadata_snap"]).is_err(),
        "only one snapshot"
    );

    let since = |n: u32| {
        era_invalidated(&pdata_tool_ok(
            "era_invalidate",
            &["--metadata-snapshot", "--written-since", &n.to_string()],
            &f.meta,
        ))
    };
    assert_eq!(since(1), BTreeSet::from([0, 5, 7, 9, 100, 200, 255]));
    assert_eq!(since(2), BTreeSet::from([5, 7, 9, 200, 255]));
    assert_eq!(since(3), BTreeSet::from([9]));
    assert_eq!(since(4), BTreeSet::new());
    pdata_tool_ok("era_check", &[], &f.meta);

    // Writes after the snapshot are not in it, and data reads back.
    write_blocks(&reg, &[11]);
    let dev = reg.device("era").unwrap();
    let off = 7 * BLOCK_SECTORS * 512 + 4096;
    assert_eq!(read(&*dev, off, 4096), pattern(7, off, 4096));
    drop(dev);
    assert!(!since(1).contains(&11), "written after the snapshot");
    era_msg(&reg, "drop_metadata_snap");
    assert_eq!(status(&reg, "era")[3], "-");
    assert!(
        reg.message("era", 0, &["drop_metadata_snap"]).is_err(),
        "no snapshot to drop"
    );
    assert!(reg.message("era", 0, &["bogus"]).is_err());
    assert!(reg.message("era", 0, &["checkpoint", "x"]).is_err());
    reg.remove_all();
    pdata_tool_ok("era_check", &[], &f.meta);
    let dump = pdata_tool_ok("era_dump", &[], &f.meta);
    assert!(dump.contains("nr_blocks=\"256\""), "{dump}");
    assert!(dump.contains("block_size=\"128\""), "{dump}");

    // Opened again: the next era, and the history kept.
    let reg = era_registry(&f);
    let s = status(&reg, "era");
    assert_eq!(
        s[2], "5",
        "removal archived era 4, the reopen starts era 5: {s:?}"
    );
    era_msg(&reg, "take_metadata_snap");
    assert_eq!(since(4), BTreeSet::from([11]));
    assert_eq!(since(2), BTreeSet::from([5, 7, 9, 11, 200, 255]));
    reg.remove_all();
    pdata_tool_ok("era_check", &[], &f.meta);
}

#[test]
fn bad_tables_are_refused_with_the_kernels_errors() {
    let f = files();
    let reg = files_registry(&f, SECTORS);
    let cases = [
        ("era meta data", "Invalid argument count"),
        ("era nosuch data 128", "Error opening metadata device"),
        ("era meta nosuch 128", "Error opening data device"),
        ("era meta data x", "Error parsing block size"),
        ("era meta data 12", "Invalid block size"),
        ("era meta data 0", "Invalid block size"),
    ];
    for (t, want) in cases {
        let e = refused(&reg, "era", &format!("0 {SECTORS} {t}"));
        assert!(e.contains(want), "{t}: {e}");
    }
    reg.create("era", &format!("0 {SECTORS} era meta data 128"))
        .unwrap();
    reg.remove("era", false).unwrap();
    let e = refused(&reg, "era", &format!("0 {SECTORS} era meta data 256"));
    assert!(
        e.contains("Error reading metadata"),
        "a changed block size: {e}"
    );
    // A superblock whose checksum fails is refused, and left as it was.
    reg.remove_all();
    let mut raw = std::fs::read(&f.meta).unwrap();
    raw[300] ^= 0xff;
    std::fs::write(&f.meta, &raw).unwrap();
    let reg = files_registry(&f, SECTORS);
    let e = refused(&reg, "era", &format!("0 {SECTORS} era meta data 128"));
    assert!(
        e.contains("Error reading metadata"),
        "a corrupt superblock: {e}"
    );
    reg.remove_all();
    assert_eq!(std::fs::read(&f.meta).unwrap(), raw, "nothing written");
}
