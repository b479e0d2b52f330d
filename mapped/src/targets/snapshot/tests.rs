//! The snapshot target's unit tests: both stores over `memory` devices.

use crate::Registry;
use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Op, Status};

fn write(reg: &Registry, dev: &str, off: u64, byte: u8, len: usize) {
    let d = reg.device(dev).unwrap();
    let mut b = vec![byte; len];
    assert_eq!(
        submit_and_wait(&*d, Op::Write, off, len as u64, &mut b),
        Status::Ok
    );
}

fn read(reg: &Registry, dev: &str, off: u64, len: usize) -> Vec<u8> {
    let d = reg.device(dev).unwrap();
    let mut b = vec![0u8; len];
    assert_eq!(
        submit_and_wait(&*d, Op::Read, off, len as u64, &mut b),
        Status::Ok
    );
    b
}

fn setup(cow_sectors: u64) -> std::sync::Arc<Registry> {
    let reg = Registry::new();
    reg.create("o", "0 2048 memory").unwrap();
    reg.create("c", &format!("0 {cow_sectors} memory")).unwrap();
    write(&reg, "o", 0, b'o', 1 << 20);
    reg.create("s", "0 2048 snapshot o c N 8").unwrap();
    reg
}

#[test]
fn writes_land_in_the_overlay_and_the_origin_stays() {
    let reg = setup(1024);
    // A partial write copies the rest of its chunk from the origin.
    write(&reg, "s", 4096 + 512, b'x', 512);
    let got = read(&reg, "s", 4096, 4096);
    assert!(got[..512].iter().all(|&b| b == b'o'));
    assert!(got[512..1024].iter().all(|&b| b == b'x'));
    assert!(got[1024..].iter().all(|&b| b == b'o'));
    // A write across chunks is split; the origin never changes.
    write(&reg, "s", 8192 - 1024, b'y', 2048);
    assert!(read(&reg, "o", 0, 1 << 20).iter().all(|&b| b == b'o'));
    let got = read(&reg, "s", 8192 - 1024, 2048);
    assert!(got.iter().all(|&b| b == b'y'));
    // Chunks 1 and 2 (8 sectors each) are held.
    assert_eq!(reg.status_text("s").unwrap(), "0 2048 snapshot 16/1024 0\n");
    assert!(reg.table_text("s").unwrap().ends_with(" N 8\n"));
}

/// Threads writing different sectors of the same chunks at once: each
/// chunk is copied out once, before any write lands in it, so every
/// write survives and every sector nobody wrote keeps the origin's.
#[test]
fn concurrent_partial_writes_to_one_chunk_all_survive() {
    let reg = setup(2048);
    let d = reg.device("s").unwrap();
    std::thread::scope(|sc| {
        for t in 0..4u8 {
            let d = d.clone();
            sc.spawn(move || {
                for chunk in 0..32u64 {
                    let mut b = vec![b'a' + t; 512];
                    let off = chunk * 4096 + t as u64 * 1024;
                    assert_eq!(
                        submit_and_wait(&*d, Op::Write, off, 512, &mut b),
                        Status::Ok
                    );
                }
            });
        }
    });
    for chunk in 0..32u64 {
        let got = read(&reg, "s", chunk * 4096, 4096);
        for (i, sector) in got.chunks(512).enumerate() {
            let want = if i % 2 == 0 && i / 2 < 4 {
                b'a' + (i / 2) as u8
            } else {
                b'o'
            };
            assert!(
                sector.iter().all(|&x| x == want),
                "chunk {chunk} sector {i}"
            );
        }
    }
    assert_eq!(
        reg.status_text("s").unwrap(),
        "0 2048 snapshot 256/2048 0\n"
    );
}

#[test]
fn a_reload_drops_the_overlay() {
    let reg = setup(1024);
    write(&reg, "s", 0, b'z', 4096);
    let table = "0 2048 snapshot o c N 8";
    reg.reload("s", table).unwrap();
    reg.resume("s").unwrap();
    assert!(read(&reg, "s", 0, 4096).iter().all(|&b| b == b'o'));
    assert_eq!(reg.status_text("s").unwrap(), "0 2048 snapshot 0/1024 0\n");
}

#[test]
fn a_full_overlay_invalidates_the_snapshot() {
    let reg = setup(16);
    write(&reg, "s", 0, b'a', 4096);
    write(&reg, "s", 4096, b'a', 4096);
    let d = reg.device("s").unwrap();
    let mut b = vec![0u8; 4096];
    assert_eq!(
        submit_and_wait(&*d, Op::Write, 8192, 4096, &mut b),
        Status::IoError
    );
    assert_eq!(
        submit_and_wait(&*d, Op::Read, 0, 4096, &mut b),
        Status::IoError
    );
    assert_eq!(reg.status_text("s").unwrap(), "0 2048 snapshot Invalid\n");
}

#[test]
fn bad_tables_are_refused_naming_the_problem() {
    let reg = setup(1024);
    for (table, want) in [
        ("0 2048 snapshot o c N", "requires 4 or more arguments"),
        ("0 2048 snapshot o c N 6", "not a power of 2"),
        ("0 2048 snapshot o c N 0", "Chunk size not set"),
        ("0 2048 snapshot o c N x", "Invalid chunk size"),
        (
            "0 2048 snapshot o c Q 8",
            "Exception store type is not P or N",
        ),
        (
            "0 2048 snapshot o c transient 8",
            "Exception store type is not P or N",
        ),
        (
            "0 2048 snapshot o c PX 8",
            "Unsupported persistent store option",
        ),
        (
            "0 2048 snapshot o c N 8 3 a b c",
            "Invalid number of feature arguments",
        ),
        (
            "0 2048 snapshot o c N 8 1 bogus",
            "Unrecognised feature requested",
        ),
        (
            "0 2048 snapshot o c N 8 1 discard_passdown_origin",
            "depends on discard_zeroes_cow",
        ),
        (
            "0 2048 snapshot o c N 8 1 discard_zeroes_cow",
            "not supported",
        ),
        ("0 2048 snapshot o o N 8", "cannot be the same"),
        ("0 4096 snapshot o c N 8", "too small"),
        ("0 2048 snapshot nope c N 8", "Cannot get origin device"),
    ] {
        let Err(e) = reg.create("bad", table) else {
            panic!("{table} was taken");
        };
        let mut text = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            text.push_str(&format!(": {s}"));
            src = s.source();
        }
        assert!(text.contains(want), "{table}: {text} (want {want})");
        assert!(reg.get("bad").is_none());
    }
}

/// A persistent snapshot `s` of `o` over COW `c` with `chunk` sectors.
fn setup_p(cow_sectors: u64, kind: &str, chunk: u64) -> std::sync::Arc<Registry> {
    let reg = Registry::new();
    reg.create("o", "0 2048 memory").unwrap();
    reg.create("c", &format!("0 {cow_sectors} memory")).unwrap();
    write(&reg, "o", 0, b'o', 1 << 20);
    reg.create("s", &format!("0 2048 snapshot o c {kind} {chunk}"))
        .unwrap();
    reg
}

fn status(reg: &Registry) -> String {
    reg.status_text("s").unwrap()
}

#[test]
fn a_persistent_store_writes_the_kernels_format_and_reads_it_back() {
    let reg = setup_p(1024, "P", 8);
    // A new store: header and first area, next_free past both.
    assert_eq!(status(&reg), "0 2048 snapshot 16/1024 16\n");
    write(&reg, "s", 4096 + 512, b'x', 512);
    write(&reg, "s", 3 * 4096, b'y', 4096);
    assert_eq!(status(&reg), "0 2048 snapshot 32/1024 16\n");
    let cow = read(&reg, "c", 0, 3 * 4096);
    // disk_header: magic "SnAp", valid 1, version 1, chunk size 8.
    assert_eq!(&cow[..16], b"SnAp\x01\0\0\0\x01\0\0\0\x08\0\0\0");
    // Area 0 (chunk 1): (old 1, new 2), (old 3, new 3), then the end.
    let pair = |i: usize| {
        let p = &cow[4096 + 16 * i..4096 + 16 * i + 16];
        (
            u64::from_le_bytes(p[..8].try_into().unwrap()),
            u64::from_le_bytes(p[8..].try_into().unwrap()),
        )
    };
    assert_eq!([pair(0), pair(1), pair(2)], [(1, 2), (3, 3), (0, 0)]);
    assert!(cow[2 * 4096..2 * 4096 + 512].iter().all(|&b| b == b'o'));
    assert!(cow[2 * 4096 + 512..2 * 4096 + 1024]
        .iter()
        .all(|&b| b == b'x'));
    // A new table over the same COW device reads the exceptions back.
    reg.remove("s", false).unwrap();
    reg.create("s", "0 2048 snapshot o c P 0").unwrap();
    assert!(
        reg.table_text("s").unwrap().ends_with(" P 8\n"),
        "header's chunk size"
    );
    assert_eq!(status(&reg), "0 2048 snapshot 32/1024 16\n");
    let got = read(&reg, "s", 4096, 3 * 4096);
    assert!(got[..512].iter().all(|&b| b == b'o'));
    assert!(got[512..1024].iter().all(|&b| b == b'x'));
    assert!(got[1024..2 * 4096].iter().all(|&b| b == b'o'));
    assert!(got[2 * 4096..].iter().all(|&b| b == b'y'));
    assert!(read(&reg, "o", 0, 1 << 20).iter().all(|&b| b == b'o'));
}

/// One-sector chunks: an area holds 32 exceptions, so 40 writes fill
/// area 0, skip the metadata chunk of area 1 and go on there.
#[test]
fn exceptions_past_a_full_area_survive_a_reload() {
    let reg = setup_p(1024, "P", 1);
    for c in 0..40u64 {
        write(&reg, "s", c * 2 * 512, b'a' + (c % 20) as u8, 512);
    }
    // Chunks: header 0, area 0 at 1, data 2..=33, area 1 at 34, data
    // 35..=42: next_free 43; metadata is the header and two areas.
    assert_eq!(status(&reg), "0 2048 snapshot 43/1024 3\n");
    reg.remove("s", false).unwrap();
    reg.create("s", "0 2048 snapshot o c P 1").unwrap();
    assert_eq!(status(&reg), "0 2048 snapshot 43/1024 3\n");
    for c in 0..40u64 {
        let got = read(&reg, "s", c * 2 * 512, 1024);
        assert!(
            got[..512].iter().all(|&b| b == b'a' + (c % 20) as u8),
            "chunk {c}"
        );
        assert!(got[512..].iter().all(|&b| b == b'o'), "chunk {c}");
    }
    write(&reg, "s", 81 * 512, b'z', 512);
    assert_eq!(status(&reg), "0 2048 snapshot 44/1024 3\n");
}

#[test]
fn a_reload_hands_a_persistent_store_over() {
    let reg = setup_p(1024, "P", 8);
    write(&reg, "s", 0, b'z', 4096);
    reg.reload("s", "0 2048 snapshot o c PO 8").unwrap();
    reg.resume("s").unwrap();
    assert!(read(&reg, "s", 0, 4096).iter().all(|&b| b == b'z'));
    assert_eq!(status(&reg), "0 2048 snapshot 24/1024 16\n");
    assert!(reg.table_text("s").unwrap().ends_with(" PO 8\n"));
}

#[test]
fn a_full_persistent_store_is_invalid_for_good_and_po_overflows() {
    // Room for the header, area 0 and two data chunks.
    let reg = setup_p(32, "P", 8);
    write(&reg, "s", 0, b'a', 4096);
    write(&reg, "s", 4096, b'a', 4096);
    let d = reg.device("s").unwrap();
    let mut b = vec![0u8; 4096];
    assert_eq!(
        submit_and_wait(&*d, Op::Write, 8192, 4096, &mut b),
        Status::IoError
    );
    assert_eq!(status(&reg), "0 2048 snapshot Invalid\n");
    drop(d);
    reg.remove("s", false).unwrap();
    reg.create("s", "0 2048 snapshot o c P 8").unwrap();
    assert_eq!(
        status(&reg),
        "0 2048 snapshot Invalid\n",
        "the header says invalid"
    );

    let reg = setup_p(32, "PO", 8);
    write(&reg, "s", 0, b'a', 4096);
    write(&reg, "s", 4096, b'a', 4096);
    let d = reg.device("s").unwrap();
    assert_eq!(
        submit_and_wait(&*d, Op::Write, 8192, 4096, &mut b),
        Status::IoError
    );
    assert_eq!(status(&reg), "0 2048 snapshot Overflow\n");
    // Reads still work, and what was written stays.
    assert_eq!(submit_and_wait(&*d, Op::Read, 0, 4096, &mut b), Status::Ok);
    assert!(b.iter().all(|&x| x == b'a'));
    assert_eq!(
        submit_and_wait(&*d, Op::Write, 0, 4096, &mut b),
        Status::IoError
    );
}

#[test]
fn a_corrupt_header_is_refused() {
    let reg = Registry::new();
    reg.create("o", "0 2048 memory").unwrap();
    reg.create("c", "0 1024 memory").unwrap();
    write(&reg, "c", 0, b'o', 4096);
    let Err(e) = reg.create("s", "0 2048 snapshot o c P 8") else {
        panic!("a COW device of 'o's was taken");
    };
    let text = e.report();
    assert!(text.contains("Failed to read snapshot metadata"), "{text}");
    assert!(text.contains("Invalid or corrupt snapshot"), "{text}");
    // A new store with no chunk size takes the default (32 sectors).
    write(&reg, "c", 0, 0, 4096);
    reg.create("s", "0 2048 snapshot o c P 0").unwrap();
    assert!(reg.table_text("s").unwrap().ends_with(" P 32\n"));
}

/// Writes through `snapshot-origin` reach the origin, and every snapshot
/// of it (one transient, one persistent, different chunk sizes) keeps
/// the data as it was; a reload of the persistent one still has it.
#[test]
fn origin_writes_copy_the_chunk_to_every_snapshot_first() {
    let reg = setup_p(1024, "P", 8);
    reg.create("c2", "0 1024 memory").unwrap();
    reg.create("s2", "0 2048 snapshot o c2 N 16").unwrap();
    reg.create("base", "0 2048 snapshot-origin o").unwrap();
    assert!(reg
        .table_text("base")
        .unwrap()
        .starts_with("0 2048 snapshot-origin 253:"));
    // A write across chunks 1..=2 of s (and chunk 0..=1 of s2).
    write(&reg, "base", 4096 + 2048, b'n', 4096);
    assert!(read(&reg, "s", 0, 1 << 20).iter().all(|&b| b == b'o'));
    assert!(read(&reg, "s2", 0, 1 << 20).iter().all(|&b| b == b'o'));
    let got = read(&reg, "o", 4096, 8192);
    assert!(got[..2048].iter().all(|&b| b == b'o'));
    assert!(got[2048..6144].iter().all(|&b| b == b'n'));
    assert_eq!(status(&reg), "0 2048 snapshot 32/1024 16\n");
    assert_eq!(
        reg.status_text("s2").unwrap(),
        "0 2048 snapshot 32/1024 0\n"
    );
    // Writing the same chunks again copies nothing more; the snapshot's
    // own write to a chunk it holds goes to its COW.
    write(&reg, "base", 4096, b'm', 8192);
    write(&reg, "s", 4096, b's', 512);
    assert_eq!(status(&reg), "0 2048 snapshot 32/1024 16\n");
    reg.remove("s", false).unwrap();
    reg.create("s", "0 2048 snapshot o c P 8").unwrap();
    let got = read(&reg, "s", 4096, 8192);
    assert!(got[..512].iter().all(|&b| b == b's'));
    assert!(got[512..].iter().all(|&b| b == b'o'));
    assert!(read(&reg, "base", 4096, 8192).iter().all(|&b| b == b'm'));
}

#[test]
fn a_full_snapshot_is_invalidated_by_origin_writes_and_the_write_goes_on() {
    let reg = setup_p(32, "PO", 8);
    reg.create("base", "0 2048 snapshot-origin o").unwrap();
    write(&reg, "base", 0, b'n', 3 * 4096);
    // Two chunks fit; the third invalidates it, even with PO.
    assert_eq!(status(&reg), "0 2048 snapshot Invalid\n");
    assert!(read(&reg, "o", 0, 3 * 4096).iter().all(|&b| b == b'n'));
    for (table, want) in [
        (
            "0 2048 snapshot-origin",
            "origin: incorrect number of arguments",
        ),
        (
            "0 2048 snapshot-origin o o",
            "origin: incorrect number of arguments",
        ),
        ("0 2048 snapshot-origin nope", "Cannot get target device"),
    ] {
        let Err(e) = reg.create("bad", table) else {
            panic!("{table} was taken");
        };
        assert!(e.report().contains(want), "{table}: {}", e.report());
    }
}

/// Status polled until it is `want` (the merge worker runs on its own
/// thread); bounded so that a merge that never ends fails the test.
fn wait_status(reg: &Registry, dev: &str, want: &str) {
    for _ in 0..2000 {
        if reg.status_text(dev).unwrap() == want {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    panic!(
        "{dev}: status {} never became {want}",
        reg.status_text(dev).unwrap()
    );
}

/// Writes through a persistent snapshot, then `snapshot-merge` over the
/// same COW device puts them into the origin (a run of consecutive
/// chunks and single ones), the merge device reading the snapshot's data
/// all along, and status counting down to the header and one area.
#[test]
fn a_merge_puts_the_snapshot_back_into_the_origin() {
    let reg = setup_p(1024, "P", 8);
    write(&reg, "s", 0, b'a', 3 * 4096);
    write(&reg, "s", 10 * 4096 + 512, b'b', 512);
    write(&reg, "s", 20 * 4096, b'c', 4096);
    let want = read(&reg, "s", 0, 1 << 20);
    assert_eq!(status(&reg), "0 2048 snapshot 56/1024 16\n");
    reg.remove("s", false).unwrap();
    let Err(e) = reg.create("m", "0 2048 snapshot-merge o c N 8") else {
        panic!("a transient merge was taken");
    };
    assert!(
        e.report().contains("does not support snapshot-merge"),
        "{}",
        e.report()
    );
    reg.create("m", "0 2048 snapshot-merge o c P 8").unwrap();
    assert!(
        read(&reg, "m", 0, 1 << 20) == want,
        "the merge device reads the snapshot"
    );
    // Writes during the merge land where the data is.
    write(&reg, "m", 20 * 4096 + 1024, b'd', 512);
    write(&reg, "m", 30 * 4096, b'e', 512);
    let mut want = want;
    want[20 * 4096 + 1024..20 * 4096 + 1536].fill(b'd');
    want[30 * 4096..30 * 4096 + 512].fill(b'e');
    wait_status(&reg, "m", "0 2048 snapshot-merge 16/1024 16\n");
    assert!(
        read(&reg, "o", 0, 1 << 20) == want,
        "the origin holds the merged data"
    );
    assert!(read(&reg, "m", 0, 1 << 20) == want);
    // The store on disk is empty: a new snapshot over it starts clean.
    reg.remove("m", false).unwrap();
    reg.create("s", "0 2048 snapshot o c P 8").unwrap();
    assert_eq!(status(&reg), "0 2048 snapshot 16/1024 16\n");
}

/// A merge stopped after it began (the device removed) goes on from
/// what the store on disk holds when a merge is loaded again.
#[test]
fn a_stopped_merge_goes_on_where_it_stopped() {
    let reg = setup_p(2048, "P", 1);
    for c in 0..100u64 {
        write(&reg, "s", c * 3 * 512, b'a' + (c % 26) as u8, 512);
    }
    let want = read(&reg, "s", 0, 1 << 20);
    reg.remove("s", false).unwrap();
    reg.create("m", "0 2048 snapshot-merge o c P 1").unwrap();
    reg.remove("m", false).unwrap();
    reg.create("m", "0 2048 snapshot-merge o c P 1").unwrap();
    wait_status(&reg, "m", "0 2048 snapshot-merge 2/2048 2\n");
    assert!(read(&reg, "o", 0, 1 << 20) == want);
}
