//! thin-pool and thin as their users see them, judged by Debian's
//! `thin_check` and `thin_dump` (thin-provisioning-tools): every pool a
//! test makes (after writes, snapshots, deletions, a metadata snapshot)
//! passes `thin_check`, `thin_dump` lists the mappings the test made, and
//! a pool opened again from its files sees everything committed.

mod thin_support;

use blkstack_core::Status;
use blkstack_mapped::Registry;
use std::process::Command;
use thin_support::*;

#[test]
fn a_fresh_pool_passes_thin_check_and_reports_like_the_kernel() {
    let f = files();
    let reg = pool(&f, 32768, "");
    let s = status(&reg, "pool");
    // <trans id> <used meta>/<total meta> <used data>/<total data> <held>
    // <mode> <discard> <no space> <needs_check> <metadata threshold>
    assert_eq!(s[0], "0");
    assert!(s[1].ends_with("/1024"), "{s:?}");
    assert_eq!(s[2], "0/256");
    let used: u64 = s[1].split('/').next().unwrap().parse().unwrap();
    assert!(
        (103..120).contains(&used),
        "the reserve of 102 blocks counts as used: {s:?}"
    );
    assert_eq!(
        &s[3..9],
        [
            "-",
            "rw",
            "discard_passdown",
            "queue_if_no_space",
            "-",
            "256"
        ]
    );
    assert_eq!(
        reg.table_text("pool").unwrap().trim(),
        format!(
            "0 32768 thin-pool 253:{} 253:{} 128 0 0",
            reg.info("meta").unwrap().minor,
            reg.info("data").unwrap().minor
        )
    );
    reg.remove_all();
    thin_check(&f.meta);
    assert!(thin_dump(&f.meta).contains("nr_data_blocks=\"256\""));
}

#[test]
fn writes_snapshots_and_deletes_pass_thin_check_and_survive_a_reopen() {
    let f = files();
    let reg = pool(&f, 65536, "");
    msg(&reg, "create_thin 1");
    reg.create("thin", "0 204800 thin pool 1").unwrap();
    let thin = reg.device("thin").unwrap();
    // Whole blocks, partial blocks (zeroed around), far apart.
    let writes: Vec<(u64, usize)> = vec![
        (0, BLOCK as usize),
        (BLOCK * 3 + 4096, 8192),
        (BLOCK * 100, 4096),
        (BLOCK * 1500 + 512, 512),
        (BLOCK * 7, BLOCK as usize * 2),
    ];
    for (i, &(off, len)) in writes.iter().enumerate() {
        write(&*thin, off, &pattern(i as u64, off, len));
    }
    assert_eq!(
        read(&*thin, BLOCK * 3, 4096),
        vec![0u8; 4096],
        "zeroed around a partial write"
    );
    assert_eq!(
        read(&*thin, BLOCK * 50, 4096),
        vec![0u8; 4096],
        "unmapped reads zeroes"
    );
    let s = status(&reg, "thin");
    // Blocks 0, 3, 7, 8, 100, 1500 mapped: 6 * 128 sectors.
    assert_eq!(s, ["768", &format!("{}", 1501 * 128 - 1)]);

    // A snapshot shares every block until one side writes it.
    msg(&reg, "create_snap 2 1");
    reg.create("snap", "0 204800 thin pool 2").unwrap();
    let snap = reg.device("snap").unwrap();
    write(&*thin, 0, &pattern(99, 0, 4096));
    write(&*snap, BLOCK * 100, &pattern(98, BLOCK * 100, 4096));
    assert_eq!(
        read(&*snap, 0, 4096),
        pattern(0, 0, 4096),
        "the snapshot keeps the old data"
    );
    assert_eq!(read(&*thin, 0, 4096), pattern(99, 0, 4096));
    assert!(
        read(&*thin, 4096, 4096) == pattern(0, 4096, 4096),
        "copied, then overwritten in part"
    );
    assert_eq!(
        read(&*thin, BLOCK * 100, 4096),
        pattern(2, BLOCK * 100, 4096)
    );
    assert_eq!(
        read(&*snap, BLOCK * 100, 4096),
        pattern(98, BLOCK * 100, 4096)
    );
    // 6 shared + 2 broken = 8 data blocks in use.
    assert_eq!(status(&reg, "pool")[2], "8/512");
    // A snapshot of the snapshot, then a thin to delete.
    msg(&reg, "create_snap 3 2");
    msg(&reg, "create_thin 4");
    reg.create("t4", "0 8192 thin pool 4").unwrap();
    write(&*reg.device("t4").unwrap(), 0, &pattern(4, 0, 4096));
    flush(&*thin);
    assert!(
        reg.message("pool", 0, &["delete", "4"]).is_err(),
        "an open thin cannot go"
    );
    reg.remove("t4", false).unwrap();
    msg(&reg, "delete 4");
    assert_eq!(
        status(&reg, "pool")[2],
        "8/512",
        "the deleted thin's block came back"
    );
    msg(&reg, "delete 3");
    msg(&reg, "set_transaction_id 0 7");
    assert!(reg
        .message("pool", 0, &["set_transaction_id", "0", "8"])
        .is_err());
    assert!(
        reg.message("pool", 0, &["create_thin", "1"]).is_err(),
        "id in use"
    );
    assert_eq!(status(&reg, "pool")[0], "7");
    reg.remove_all();
    thin_check(&f.meta);
    let dump = thin_dump(&f.meta);
    assert!(dump.contains("transaction=\"7\""), "{dump}");
    assert!(dump.contains("dev_id=\"1\" mapped_blocks=\"6\""), "{dump}");
    assert!(dump.contains("dev_id=\"2\" mapped_blocks=\"6\""), "{dump}");
    assert!(!dump.contains("dev_id=\"3\""), "{dump}");

    // Open again from the files: everything committed is there.
    let reg = pool(&f, 65536, "");
    reg.create("thin", "0 204800 thin pool 1").unwrap();
    reg.create("snap", "0 204800 thin pool 2").unwrap();
    let thin = reg.device("thin").unwrap();
    let snap = reg.device("snap").unwrap();
    assert_eq!(read(&*thin, 0, 4096), pattern(99, 0, 4096));
    assert_eq!(read(&*snap, 0, 4096), pattern(0, 0, 4096));
    for (i, &(off, len)) in writes.iter().enumerate().skip(1) {
        let want = if off == BLOCK * 100 {
            pattern(98, off, 4096)
        } else {
            pattern(i as u64, off, len)
        };
        assert_eq!(read(&*snap, off, want.len()), want, "snapshot at {off}");
    }
    assert_eq!(status(&reg, "pool")[0], "7");
    reg.remove_all();
    thin_check(&f.meta);
}

/// A block freed by a deletion and handed out again must not show its
/// old contents around a partial write: the zeroing (WRITE_ZEROES to a
/// data device that has it) covers the whole block.
#[test]
fn a_reused_block_is_zeroed_around_a_partial_write() {
    let f = files();
    let reg = pool(&f, 8 * 128, "");
    msg(&reg, "create_thin 1");
    reg.create("old", "0 1024 thin pool 1").unwrap();
    let old = reg.device("old").unwrap();
    for b in 0..8 {
        write(&*old, b * BLOCK, &vec![0xa5; BLOCK as usize]);
    }
    flush(&*old);
    drop(old);
    reg.remove("old", false).unwrap();
    msg(&reg, "delete 1");
    msg(&reg, "create_thin 2");
    reg.create("new", "0 1024 thin pool 2").unwrap();
    let new = reg.device("new").unwrap();
    flush(&*new);
    for b in 0..8 {
        write(&*new, b * BLOCK + 4096, &[0x5a; 4096]);
    }
    for b in 0..8 {
        let got = read(&*new, b * BLOCK, BLOCK as usize);
        assert!(
            got[..4096].iter().all(|&x| x == 0),
            "block {b} before the write"
        );
        assert!(
            got[4096..8192].iter().all(|&x| x == 0x5a),
            "block {b} the write"
        );
        assert!(
            got[8192..].iter().all(|&x| x == 0),
            "block {b} after the write"
        );
    }
    drop(new);
    reg.remove_all();
    thin_check(&f.meta);
}

#[test]
fn a_held_metadata_snapshot_passes_thin_check() {
    let f = files();
    let reg = pool(&f, 32768, "1 skip_block_zeroing");
    msg(&reg, "create_thin 0");
    reg.create("thin", "0 32768 thin pool 0").unwrap();
    let thin = reg.device("thin").unwrap();
    for i in 0..40u64 {
        write(&*thin, i * BLOCK, &pattern(i, 0, 4096));
    }
    msg(&reg, "reserve_metadata_snap");
    let held = status(&reg, "pool")[3].clone();
    assert_ne!(held, "-");
    assert!(reg.message("pool", 0, &["reserve_metadata_snap"]).is_err());
    for i in 0..40u64 {
        write(&*thin, i * BLOCK + 8192, &pattern(i + 100, 0, 4096));
    }
    flush(&*thin);
    reg.remove_all();
    thin_check(&f.meta);
    let out = Command::new(tool("thin_dump"))
        .arg(format!("--metadata-snap={held}"))
        .arg(&f.meta)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let held_dump = String::from_utf8_lossy(&out.stdout);
    assert!(
        held_dump.contains("dev_id=\"0\" mapped_blocks=\"40\""),
        "{held_dump}"
    );
    let reg = pool(&f, 32768, "1 skip_block_zeroing");
    msg(&reg, "release_metadata_snap");
    assert_eq!(status(&reg, "pool")[3], "-");
    reg.remove_all();
    thin_check(&f.meta);
}

/// A small deterministic generator (no seed to pass around).
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

#[test]
fn multi_level_trees_shared_by_snapshots_pass_thin_check() {
    let f = files();
    // 4096 data blocks; thousands of mappings make trees of two levels.
    let reg = pool(&f, 4096 * 128, "1 skip_block_zeroing");
    msg(&reg, "create_thin 1");
    reg.create("thin", "0 1048576 thin pool 1").unwrap();
    let thin = reg.device("thin").unwrap();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut blocks: Vec<u64> = (0..8192).collect();
    for i in (1..blocks.len()).rev() {
        blocks.swap(i, (next(&mut x) % (i as u64 + 1)) as usize);
    }
    let first: Vec<u64> = blocks[..1500].to_vec();
    for &b in &first {
        write(&*thin, b * BLOCK, &pattern(1, b * BLOCK, 4096));
    }
    msg(&reg, "create_snap 2 1");
    // Overwrite half the origin's blocks (breaking sharing) and add more.
    for &b in first.iter().step_by(2).chain(&blocks[1500..2500]) {
        write(&*thin, b * BLOCK, &pattern(2, b * BLOCK, 4096));
    }
    msg(&reg, "create_snap 3 2");
    msg(&reg, "create_snap 4 1");
    reg.create("snap", "0 1048576 thin pool 2").unwrap();
    let snap = reg.device("snap").unwrap();
    for &b in first.iter().skip(1).step_by(4) {
        write(&*snap, b * BLOCK, &pattern(3, b * BLOCK, 4096));
    }
    flush(&*snap);
    let s = status(&reg, "thin");
    assert_eq!(s[0], (2500 * 128).to_string());
    drop(snap);
    reg.remove("snap", false).unwrap();
    msg(&reg, "delete 2");
    reg.remove_all();
    thin_check(&f.meta);
    let dump = thin_dump(&f.meta);
    assert!(
        dump.contains("dev_id=\"1\" mapped_blocks=\"2500\""),
        "dev 1"
    );
    assert!(
        dump.contains("dev_id=\"3\" mapped_blocks=\"1500\""),
        "dev 3"
    );
    assert!(
        dump.contains("dev_id=\"4\" mapped_blocks=\"2500\""),
        "dev 4"
    );

    let reg = pool(&f, 4096 * 128, "1 skip_block_zeroing");
    for (dev, name) in [(1, "t1"), (3, "t3"), (4, "t4")] {
        reg.create(name, &format!("0 1048576 thin pool {dev}"))
            .unwrap();
    }
    let (t1, t3, t4) = (
        reg.device("t1").unwrap(),
        reg.device("t3").unwrap(),
        reg.device("t4").unwrap(),
    );
    for (i, &b) in first.iter().enumerate() {
        let off = b * BLOCK;
        let origin_tag = if i % 2 == 0 { 2 } else { 1 };
        assert!(
            read(&*t1, off, 4096) == pattern(origin_tag, off, 4096),
            "t1 block {b}"
        );
        assert!(
            read(&*t4, off, 4096) == pattern(origin_tag, off, 4096),
            "t4 block {b}"
        );
        assert!(
            read(&*t3, off, 4096) == pattern(1, off, 4096),
            "t3 block {b}"
        );
    }
    reg.remove_all();
    thin_check(&f.meta);
}

#[test]
fn concurrent_partial_writes_to_the_same_new_blocks_all_land() {
    let f = files();
    let reg = pool(&f, 65536, "");
    msg(&reg, "create_thin 1");
    reg.create("thin", "0 65536 thin pool 1").unwrap();
    let thin = reg.device("thin").unwrap();
    // Sixteen threads write their own 4 KiB of the same 64 new blocks,
    // so most writes find the block being provisioned by another.
    std::thread::scope(|s| {
        for t in 0..16u64 {
            let thin = thin.clone();
            s.spawn(move || {
                for b in 0..64u64 {
                    let off = b * BLOCK + t * 4096;
                    write(&*thin, off, &pattern(t, off, 4096));
                }
            });
        }
    });
    for b in 0..64u64 {
        for t in 0..16u64 {
            let off = b * BLOCK + t * 4096;
            assert!(
                read(&*thin, off, 4096) == pattern(t, off, 4096),
                "block {b} thread {t}"
            );
        }
    }
    assert_eq!(status(&reg, "pool")[2], "64/512");
    reg.remove_all();
    thin_check(&f.meta);
}

#[test]
fn low_water_out_of_data_space_and_a_larger_pool() {
    let f = files();
    let reg = small_pool(&f, 8, 16, 8192, "2");
    msg(&reg, "create_thin 1");
    reg.create("thin", "0 8192 thin pool 1").unwrap();
    let thin = reg.device("thin").unwrap();
    let events = reg.info("pool").unwrap().event_nr;
    for b in 0..5 {
        assert_eq!(try_write(&*thin, b * BLOCK), Status::Ok);
    }
    assert_eq!(
        reg.info("pool").unwrap().event_nr,
        events,
        "3 free blocks: above the mark"
    );
    assert_eq!(try_write(&*thin, 5 * BLOCK), Status::Ok);
    assert_eq!(
        reg.info("pool").unwrap().event_nr,
        events + 1,
        "low water mark event"
    );
    for b in 6..8 {
        assert_eq!(try_write(&*thin, b * BLOCK), Status::Ok);
    }
    // Out of data space: the write waits (queue_if_no_space) ...
    let t = thin.clone();
    let waiter = std::thread::spawn(move || try_write(&*t, 8 * BLOCK));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while status(&reg, "pool")[4] != "out_of_data_space" {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            status(&reg, "pool")
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(!waiter.is_finished(), "the write waits for space");
    assert_eq!(
        try_write(&*thin, 0),
        Status::Ok,
        "mapped blocks still take writes"
    );
    // ... until the pool is reloaded over a larger data device.
    reg.reload("pool", "0 2048 thin-pool meta data 128 2")
        .unwrap();
    reg.resume("pool").unwrap();
    assert_eq!(waiter.join().unwrap(), Status::Ok);
    let s = status(&reg, "pool");
    assert_eq!((s[2].as_str(), s[4].as_str()), ("9/16", "rw"));
    assert!(
        reg.reload("pool", "0 1024 thin-pool meta data 128 2")
            .is_err(),
        "a pool cannot shrink"
    );
    // error_if_no_space fails at once.
    reg.reload(
        "pool",
        "0 2048 thin-pool meta data 128 2 1 error_if_no_space",
    )
    .unwrap();
    reg.resume("pool").unwrap();
    for b in 9..16 {
        assert_eq!(try_write(&*thin, b * BLOCK), Status::Ok);
    }
    assert_eq!(try_write(&*thin, 16 * BLOCK), Status::NoSpace);
    let s = status(&reg, "pool");
    assert_eq!(
        (s[4].as_str(), s[6].as_str()),
        ("out_of_data_space", "error_if_no_space")
    );
    drop(thin);
    reg.remove_all();
    thin_check(&f.meta);
}

#[test]
fn out_of_metadata_space_turns_the_pool_read_only() {
    let f = files();
    // 64 metadata blocks, 6 of them the kernel's reserve.
    let reg = small_pool(&f, 4096, 4096, 512, "0 1 skip_block_zeroing");
    msg(&reg, "create_thin 1");
    reg.create("thin", "0 1048576 thin pool 1").unwrap();
    let thin = reg.device("thin").unwrap();
    for b in 0..300 {
        assert_eq!(try_write(&*thin, b * BLOCK), Status::Ok);
    }
    // Each snapshot then write copies the origin's path: metadata fills.
    let mut snaps = 0;
    for id in 2..200u64 {
        if reg
            .message("pool", 0, &["create_snap", &id.to_string(), "1"])
            .is_err()
        {
            break;
        }
        snaps += 1;
        if try_write(&*thin, (id % 300) * BLOCK) != Status::Ok {
            break;
        }
    }
    assert!(snaps > 5 && snaps < 190, "{snaps} snapshots");
    let s = status(&reg, "pool");
    assert_eq!(s[4], "ro", "{s:?}");
    assert_ne!(try_write(&*thin, 1000 * BLOCK), Status::Ok, "no new blocks");
    assert!(
        read(&*thin, BLOCK, 4096) == pattern(7, BLOCK, 4096),
        "reads still work"
    );
    assert!(reg.message("pool", 0, &["create_thin", "500"]).is_err());
    drop(thin);
    reg.remove_all();
    thin_check(&f.meta);
}

#[test]
fn an_external_origin_shows_through_until_written() {
    let f = files();
    let reg = pool(&f, 32768, "");
    let origin = f.meta.with_file_name("origin");
    reg.create(
        "origin",
        &format!("0 1000 file {} create", origin.display()),
    )
    .unwrap();
    let o = reg.device("origin").unwrap();
    let base = pattern(5, 0, 1000 * 512);
    write(&*o, 0, &base);
    msg(&reg, "create_thin 1");
    // Longer than the origin: beyond it, zeroes.
    reg.create("thin", "0 4096 thin pool 1 origin").unwrap();
    let table = reg.table_text("thin").unwrap();
    let minor = reg.info("origin").unwrap().minor;
    assert!(
        table.trim_end().ends_with(&format!(" 253:{minor}")),
        "{table}"
    );
    let thin = reg.device("thin").unwrap();
    assert!(
        read(&*thin, 0, 4096) == base[..4096],
        "unmapped reads see the origin"
    );
    write(&*thin, 4096, &pattern(6, 4096, 4096));
    let mut want = base[..BLOCK as usize].to_vec();
    want[4096..8192].copy_from_slice(&pattern(6, 4096, 4096));
    assert!(
        read(&*thin, 0, BLOCK as usize) == want,
        "the block was copied from the origin"
    );
    // The block holding the origin's end: its tail reads as zeroes.
    let mut tail = vec![0u8; BLOCK as usize];
    tail[..(1000 * 512 - 7 * BLOCK as usize)].copy_from_slice(&base[7 * BLOCK as usize..]);
    assert!(
        read(&*thin, 7 * BLOCK, BLOCK as usize) == tail,
        "origin's end"
    );
    write(&*thin, 7 * BLOCK + 8192, &pattern(8, 0, 512));
    tail[8192..8704].copy_from_slice(&pattern(8, 0, 512));
    assert!(
        read(&*thin, 7 * BLOCK, BLOCK as usize) == tail,
        "copied across the origin's end"
    );
    assert_eq!(
        read(&*o, 4096, 4096),
        base[4096..8192].to_vec(),
        "the origin is not written"
    );
    drop((thin, o));
    reg.remove_all();
    thin_check(&f.meta);
}

#[test]
fn damaged_metadata_is_refused_with_a_clear_error_and_nothing_changes() {
    let f = files();
    let reg = pool(&f, 32768, "");
    msg(&reg, "create_thin 1");
    reg.remove_all();
    let good = std::fs::read(&f.meta).unwrap();
    // A flipped byte in the superblock's device-details root.
    let mut bad = good.clone();
    bad[330] ^= 0x40;
    std::fs::write(&f.meta, &bad).unwrap();
    let reg = Registry::new();
    reg.create("meta", &format!("0 8192 file {}", f.meta.display()))
        .unwrap();
    reg.create("data", &format!("0 32768 file {}", f.data.display()))
        .unwrap();
    let err = refused(&reg, "pool", "0 32768 thin-pool meta data 128 0");
    let text = err.clone();
    assert!(text.contains("checksum"), "{text}");
    // A data block size other than the pool's.
    std::fs::write(&f.meta, &good).unwrap();
    let err = refused(&reg, "pool", "0 32768 thin-pool meta data 256 0");
    assert!(err.contains("data block size"), "{err}");
    // A data device smaller than the pool recorded.
    let err = refused(&reg, "pool", "0 16384 thin-pool meta data 128 0");
    assert!(err.contains("too small"), "{err}");
    reg.remove_all();
    assert!(
        std::fs::read(&f.meta).unwrap() == good,
        "refusals wrote nothing"
    );
    thin_check(&f.meta);
}

#[test]
fn refused_tables_and_messages_name_what_is_wrong() {
    let f = files();
    let reg = pool(&f, 32768, "");
    for (table, why) in [
        ("0 32768 thin-pool meta data 128", "Invalid argument count"),
        (
            "0 32768 thin-pool meta meta 128 0",
            "Error setting metadata or data device",
        ),
        ("0 32768 thin-pool meta data 100 0", "Invalid block size"),
        (
            "0 32768 thin-pool meta data 128 x",
            "Invalid low water mark",
        ),
        (
            "0 32768 thin-pool meta data 128 0 1 bogus",
            "Unrecognised pool feature requested",
        ),
        (
            "0 32768 thin-pool meta data 128 0 2 read_only",
            "Invalid number of pool feature arguments",
        ),
        (
            "0 32768 thin-pool meta none 128 0",
            "Error getting data device",
        ),
    ] {
        let e = refused(&reg, "p2", table);
        assert!(e.contains(why), "{table}: {e}");
    }
    for (table, why) in [
        ("0 64 thin pool", "Invalid argument count"),
        ("0 64 thin pool x", "Invalid device id"),
        ("0 64 thin pool 16777216", "Invalid device id"),
        ("0 64 thin data 1", "Couldn't find pool object"),
        ("0 64 thin pool 9", "Couldn't open thin internal device"),
        ("0 64 thin pool 1 pool", "Error setting origin device"),
    ] {
        let e = refused(&reg, "t", table);
        assert!(e.contains(why), "{table}: {e}");
    }
    for (m, why) in [
        ("create_thin", "arguments instead of 2"),
        ("create_thin -1", "invalid device id"),
        ("create_snap 2 7", "does not exist"),
        ("delete 7", "does not exist"),
        ("release_metadata_snap", "No pool metadata snapshot"),
        ("set_transaction_id 1 2", "mismatch"),
        ("frobnicate", "Unrecognised thin pool target message"),
    ] {
        let args: Vec<&str> = m.split_whitespace().collect();
        let e = reg.message("pool", 0, &args).unwrap_err();
        assert!(format!("{e:?}").contains(why), "{m}: {e:?}");
    }
    reg.remove_all();
    thin_check(&f.meta);
    let dump = thin_dump(&f.meta);
    assert!(
        !dump.contains("<device"),
        "no refused message changed the pool: {dump}"
    );
}
