//! Discards to thin devices as dm-thin (6.12) handles them: whole pool
//! blocks in the range are unmapped, partial ones left; blocks a
//! snapshot shares stay; blocks nothing maps any more return to the
//! data space map and are discarded on the data device unless
//! `no_discard_passdown` (or the data device takes no discards, when
//! the status says so); `ignore_discard` offers none. `thin_check` and
//! `thin_dump` judge the pool after every test.

mod thin_support;

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Device, Op, Status};
use blkstack_mapped::Registry;
use thin_support::*;

fn discard(dev: &dyn Device, off: u64, len: u64) -> Status {
    submit_and_wait(dev, Op::Discard, off, len, &mut [])
}

/// Bytes of the data file that hold data (not holes).
fn data_bytes(reg: &Registry) -> u64 {
    let d = reg.device("data").unwrap();
    d.extents(0, d.size())
        .expect("the file device knows its holes")
        .iter()
        .filter(|e| !e.hole)
        .map(|e| e.len)
        .sum()
}

/// The `discards=` counter of the data file's status.
fn data_discards(reg: &Registry) -> u64 {
    let s = reg.status_text("data").unwrap();
    let v = s
        .split_whitespace()
        .find_map(|w| w.strip_prefix("discards="))
        .unwrap_or_else(|| panic!("no discards= in {s}"));
    v.parse().unwrap()
}

#[test]
fn discards_unmap_whole_blocks_pass_down_and_keep_a_snapshots_blocks() {
    let f = files();
    let reg = pool(&f, 32768, "");
    msg(&reg, "create_thin 1");
    reg.create("thin", "0 65536 thin pool 1").unwrap();
    let thin = reg.device("thin").unwrap();
    let feats = thin.features();
    assert!(feats.discard, "a thin device takes discards");
    assert_eq!(feats.discard_granularity, BLOCK as u32, "thin_io_hints");
    for b in 0..8 {
        write(&*thin, b * BLOCK, &pattern(b, b * BLOCK, BLOCK as usize));
    }
    msg(&reg, "create_snap 2 1");
    reg.create("snap", "0 65536 thin pool 2").unwrap();
    let snap = reg.device("snap").unwrap();
    // Blocks 4..8 of the origin get blocks of their own; 20..24 are new.
    for b in (4..8).chain(20..24) {
        write(
            &*thin,
            b * BLOCK,
            &pattern(b + 100, b * BLOCK, BLOCK as usize),
        );
    }
    flush(&*thin);
    assert_eq!(status(&reg, "pool")[2], "16/256");
    let (bytes, discards) = (data_bytes(&reg), data_discards(&reg));
    assert!(bytes >= 16 * BLOCK, "{bytes}");

    // Partial blocks at either end stay mapped: only block 21 goes.
    assert_eq!(discard(&*thin, 20 * BLOCK + 4096, 2 * BLOCK), Status::Ok);
    // Inside one block: nothing happens.
    assert_eq!(discard(&*thin, 23 * BLOCK + 512, 4096), Status::Ok);
    assert_eq!(read(&*thin, 21 * BLOCK, 4096), vec![0u8; 4096]);
    for b in [20, 22, 23] {
        assert!(
            read(&*thin, b * BLOCK, BLOCK as usize) == pattern(b + 100, b * BLOCK, BLOCK as usize),
            "block {b} keeps its data"
        );
    }
    assert_eq!(status(&reg, "pool")[2], "15/256");
    assert_eq!(data_discards(&reg), discards + 1, "passed down");
    assert_eq!(data_bytes(&reg), bytes - BLOCK, "the data file has a hole");

    // The origin's first 8 blocks: 4 shared with the snapshot stay for
    // it, the 4 of its own are freed and passed down.
    assert_eq!(discard(&*thin, 0, 8 * BLOCK), Status::Ok);
    for b in 0..8 {
        assert_eq!(read(&*thin, b * BLOCK, 4096), vec![0u8; 4096], "{b}");
        assert!(
            read(&*snap, b * BLOCK, BLOCK as usize) == pattern(b, b * BLOCK, BLOCK as usize),
            "the snapshot keeps block {b}"
        );
    }
    assert_eq!(status(&reg, "pool")[2], "11/256");
    assert_eq!(status(&reg, "thin"), ["384", &(24 * 128 - 1).to_string()]);
    assert_eq!(data_bytes(&reg), bytes - 5 * BLOCK);
    // The snapshot's discard frees the blocks the origin let go of.
    assert_eq!(discard(&*snap, 0, 4 * BLOCK), Status::Ok);
    assert_eq!(status(&reg, "pool")[2], "7/256");
    // A freed block is used again for a new write, which reads back.
    write(&*thin, 40 * BLOCK, &pattern(40, 0, 4096));
    flush(&*thin);
    drop((thin, snap));
    reg.remove_all();
    thin_check(&f.meta);
    let dump = thin_dump(&f.meta);
    assert!(dump.contains("dev_id=\"1\" mapped_blocks=\"4\""), "{dump}");
    assert!(dump.contains("dev_id=\"2\" mapped_blocks=\"4\""), "{dump}");

    let reg = pool(&f, 32768, "");
    reg.create("thin", "0 65536 thin pool 1").unwrap();
    reg.create("snap", "0 65536 thin pool 2").unwrap();
    let (thin, snap) = (reg.device("thin").unwrap(), reg.device("snap").unwrap());
    assert_eq!(read(&*thin, 21 * BLOCK, 4096), vec![0u8; 4096]);
    assert_eq!(read(&*thin, 40 * BLOCK, 4096), pattern(40, 0, 4096));
    assert_eq!(read(&*snap, 0, 4096), vec![0u8; 4096]);
    assert!(read(&*snap, 5 * BLOCK, 4096) == pattern(5, 5 * BLOCK, 4096));
    assert_eq!(status(&reg, "pool")[2], "8/256");
    drop((thin, snap));
    reg.remove_all();
    thin_check(&f.meta);
}

#[test]
fn no_discard_passdown_frees_blocks_but_leaves_the_data_device_alone() {
    let f = files();
    let reg = pool(&f, 32768, "1 no_discard_passdown");
    assert_eq!(status(&reg, "pool")[5], "no_discard_passdown");
    assert!(
        !reg.device("pool").unwrap().features().discard,
        "the pool device passes no discards down"
    );
    msg(&reg, "create_thin 1");
    reg.create("thin", "0 65536 thin pool 1").unwrap();
    let thin = reg.device("thin").unwrap();
    for b in 0..4 {
        write(&*thin, b * BLOCK, &pattern(b, 0, BLOCK as usize));
    }
    flush(&*thin);
    let (bytes, discards) = (data_bytes(&reg), data_discards(&reg));
    assert_eq!(discard(&*thin, 0, 4 * BLOCK), Status::Ok);
    assert_eq!(status(&reg, "pool")[2], "0/256");
    assert_eq!(status(&reg, "thin"), ["0", "-"]);
    assert_eq!(data_discards(&reg), discards, "nothing passed down");
    assert_eq!(data_bytes(&reg), bytes, "the data stays on the data device");
    drop(thin);
    reg.remove_all();
    thin_check(&f.meta);
    assert!(thin_dump(&f.meta).contains("mapped_blocks=\"0\""));
}

#[test]
fn ignore_discard_offers_no_discards_and_cannot_be_turned_off_by_a_reload() {
    let f = files();
    let reg = pool(&f, 32768, "1 ignore_discard");
    let s = status(&reg, "pool");
    assert_eq!(s[5], "ignore_discard", "{s:?}");
    msg(&reg, "create_thin 1");
    reg.create("thin", "0 65536 thin pool 1").unwrap();
    let thin = reg.device("thin").unwrap();
    assert!(!thin.features().discard);
    write(&*thin, 0, &pattern(1, 0, 4096));
    assert_ne!(discard(&*thin, 0, BLOCK), Status::Ok, "refused");
    assert_eq!(read(&*thin, 0, 4096), pattern(1, 0, 4096));
    assert_eq!(status(&reg, "pool")[2], "1/256");
    let err = reg
        .reload("pool", "0 32768 thin-pool meta data 128 0 0")
        .unwrap_err();
    assert!(
        err.report()
            .contains("Discard support cannot be disabled once enabled"),
        "{}",
        err.report()
    );
    assert!(reg.table_text("pool").unwrap().contains("1 ignore_discard"));
    drop(thin);
    reg.remove_all();
    thin_check(&f.meta);
}

#[test]
fn a_data_device_without_discards_turns_passdown_off_in_the_status() {
    let f = files();
    // The data device of pool `p2` is a thin device of a pool that
    // ignores discards, so it takes none.
    let reg = pool(&f, 32768, "1 ignore_discard");
    msg(&reg, "create_thin 1");
    reg.create("lower", "0 16384 thin pool 1").unwrap();
    let meta2 = f.meta.with_file_name("meta2");
    reg.create("meta2", &format!("0 8192 file {} create", meta2.display()))
        .unwrap();
    reg.create("p2", "0 16384 thin-pool meta2 lower 128 0")
        .unwrap();
    let s = status(&reg, "p2");
    assert_eq!(s[5], "no_discard_passdown", "{s:?}");
    assert!(
        reg.table_text("p2").unwrap().trim_end().ends_with(" 0"),
        "the table keeps what was asked for"
    );
    reg.message("p2", 0, &["create_thin", "7"]).unwrap();
    reg.create("upper", "0 16384 thin p2 7").unwrap();
    let upper = reg.device("upper").unwrap();
    assert!(upper.features().discard, "the thin device still takes them");
    write(&*upper, 0, &pattern(3, 0, BLOCK as usize));
    assert_eq!(status(&reg, "p2")[2], "1/128");
    assert_eq!(discard(&*upper, 0, BLOCK), Status::Ok);
    assert_eq!(status(&reg, "p2")[2], "0/128");
    drop(upper);
    reg.remove_all();
    thin_check(&f.meta);
    thin_check(&meta2);
}

#[test]
fn a_discard_gives_a_pool_out_of_data_space_room_again() {
    let f = files();
    let reg = small_pool(&f, 8, 8, 8192, "0");
    msg(&reg, "create_thin 1");
    reg.create("thin", "0 8192 thin pool 1").unwrap();
    let thin = reg.device("thin").unwrap();
    for b in 0..8 {
        assert_eq!(try_write(&*thin, b * BLOCK), Status::Ok);
    }
    let t = thin.clone();
    let waiter = std::thread::spawn(move || try_write(&*t, 8 * BLOCK));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while status(&reg, "pool")[4] != "out_of_data_space" {
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // check_for_data_space: the commit after the discard finds a free
    // block, the pool writes again and the queued write goes on.
    assert_eq!(discard(&*thin, 2 * BLOCK, BLOCK), Status::Ok);
    flush(&*thin);
    assert_eq!(waiter.join().unwrap(), Status::Ok);
    let s = status(&reg, "pool");
    assert_eq!((s[2].as_str(), s[4].as_str()), ("8/8", "rw"));
    drop(thin);
    reg.remove_all();
    thin_check(&f.meta);
}

#[test]
fn discards_racing_writes_never_reach_another_devices_blocks() {
    let f = files();
    let reg = pool(&f, 64 * 128, "1 skip_block_zeroing");
    msg(&reg, "create_thin 1");
    msg(&reg, "create_thin 2");
    reg.create("a", "0 65536 thin pool 1").unwrap();
    reg.create("b", "0 65536 thin pool 2").unwrap();
    let (a, b) = (reg.device("a").unwrap(), reg.device("b").unwrap());
    // `a` writes and discards the same 16 blocks over and over, so the
    // blocks it frees go to `b`'s new writes; `b` checks what it wrote.
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let a = a.clone();
            s.spawn(move || {
                for i in 0..300u64 {
                    let blk = (i * 7 + t) % 16;
                    let _ = try_write(&*a, blk * BLOCK + t * 4096);
                    if i % 3 == t {
                        assert_eq!(discard(&*a, blk * BLOCK, 2 * BLOCK), Status::Ok);
                    }
                }
            });
        }
        let b = b.clone();
        s.spawn(move || {
            for blk in 0..40u64 {
                let off = blk * BLOCK;
                write(&*b, off, &pattern(blk, off, BLOCK as usize));
                if blk % 8 == 7 {
                    flush(&*b);
                }
            }
        });
    });
    for blk in 0..40u64 {
        let off = blk * BLOCK;
        assert!(
            read(&*b, off, BLOCK as usize) == pattern(blk, off, BLOCK as usize),
            "b's block {blk} was written by someone else"
        );
    }
    flush(&*a);
    drop((a, b));
    reg.remove_all();
    thin_check(&f.meta);
}

#[test]
fn discards_in_a_tree_of_many_leaves_unmap_exactly_their_range() {
    let f = files();
    let reg = pool(&f, 4096 * 128, "1 skip_block_zeroing");
    msg(&reg, "create_thin 1");
    reg.create("thin", "0 1048576 thin pool 1").unwrap();
    let thin = reg.device("thin").unwrap();
    // Every even block of 0..4000: 2000 mappings, 8 or more leaves.
    for b in (0..4000u64).step_by(2) {
        write(&*thin, b * BLOCK, &pattern(b, 0, 4096));
    }
    let mapped = |reg: &Registry| status(reg, "thin")[0].parse::<u64>().unwrap() / 128;
    assert_eq!(mapped(&reg), 2000);
    // Odd blocks and the space past the last mapping hold nothing.
    for b in [1u64, 999, 2501, 3999] {
        assert_eq!(discard(&*thin, b * BLOCK, BLOCK), Status::Ok);
    }
    assert_eq!(discard(&*thin, 4000 * BLOCK, 4000 * BLOCK), Status::Ok);
    assert_eq!(mapped(&reg), 2000, "nothing was mapped there");
    // 1000..3000 spans many leaves (and two 1024-block discard pieces).
    assert_eq!(discard(&*thin, 1000 * BLOCK, 2000 * BLOCK), Status::Ok);
    assert_eq!(mapped(&reg), 1000);
    assert_eq!(status(&reg, "pool")[2], "1000/4096");
    for b in [998u64, 1000, 2998, 3000] {
        let want = if (1000..3000).contains(&b) {
            vec![0u8; 4096]
        } else {
            pattern(b, 0, 4096)
        };
        assert_eq!(read(&*thin, b * BLOCK, 4096), want, "block {b}");
    }
    flush(&*thin);
    drop(thin);
    reg.remove_all();
    thin_check(&f.meta);
    assert!(thin_dump(&f.meta).contains("mapped_blocks=\"1000\""));
}

/// A large thin device's mapping tree (three levels, shared with a
/// snapshot across commits) loses a long run in 1024-block pieces, as a
/// large discard is split, and many short scattered ranges, on both
/// the origin and the snapshot; another device is deleted. The
/// mappings are removed in place with the kernel's rebalancing, so
/// `thin_check` finds every node a third full, every data block's
/// count equal to the mappings that hold it, and no metadata block
/// leaked; `thin_dump` finds the mapped counts the model has.
#[test]
fn discards_in_a_large_shared_tree_leave_metadata_thin_check_accepts() {
    use blkstack_mapped::targets::thin::metadata::PoolMetadata;
    use blkstack_mapped::DevArg;
    use std::collections::BTreeMap;

    const BLOCKS: u64 = 80_000;
    let f = files();
    let reg = Registry::new();
    let dev = reg
        .create("meta", &format!("0 65536 file {} create", f.meta.display()))
        .unwrap();
    let arg = DevArg {
        name: "meta".into(),
        minor: 0,
        dev,
    };
    let mut md = PoolMetadata::open(arg, 1 << 20, 128).unwrap();
    let mut models: BTreeMap<u64, BTreeMap<u64, u64>> = BTreeMap::new();
    for (dev, n) in [(1u64, BLOCKS), (3, 5000)] {
        md.create_thin(dev).unwrap();
        let model = models.entry(dev).or_default();
        // Every block but each 61st: gaps inside the ranges discarded.
        for v in (0..n).filter(|v| v % 61 != 0) {
            let b = md.alloc_data_block().unwrap();
            md.insert_block(dev, v, b).unwrap();
            model.insert(v, b);
        }
    }
    md.commit().unwrap();
    md.create_snap(2, 1).unwrap();
    models.insert(2, models[&1].clone());
    md.commit().unwrap();
    type Models = BTreeMap<u64, BTreeMap<u64, u64>>;
    fn discard(md: &mut PoolMetadata, models: &mut Models, dev: u64, begin: u64, end: u64) {
        md.remove_range(dev, begin, end).unwrap();
        models
            .get_mut(&dev)
            .unwrap()
            .retain(|v, _| !(begin..end).contains(v));
    }
    for begin in (20_000..60_000).step_by(1024) {
        discard(&mut md, &mut models, 1, begin, (begin + 1024).min(60_000));
    }
    for i in 0..300u64 {
        let b = i * 7919 % BLOCKS;
        discard(&mut md, &mut models, 1, b, b + 1 + i % 17);
    }
    md.commit().unwrap();
    for begin in (0..BLOCKS).step_by(3000) {
        discard(&mut md, &mut models, 2, begin, begin + 500);
    }
    md.delete(3).unwrap();
    models.remove(&3);
    discard(&mut md, &mut models, 2, 70_000, BLOCKS);
    md.commit().unwrap();
    for (&dev, model) in &models {
        assert_eq!(md.mapped_blocks(dev), Some(model.len() as u64), "dev {dev}");
        for v in (0..BLOCKS).step_by(97) {
            let got = md.find_block(dev, v).unwrap().map(|l| l.data_block);
            assert_eq!(got, model.get(&v).copied(), "dev {dev} block {v}");
        }
    }
    drop(md);
    reg.remove_all();
    thin_check(&f.meta);
    let dump = thin_dump(&f.meta);
    for (dev, model) in &models {
        let want = format!("dev_id=\"{dev}\" mapped_blocks=\"{}\"", model.len());
        assert!(dump.contains(&want), "{want} in the dump");
    }
    assert!(!dump.contains("dev_id=\"3\""), "device 3 is gone");
}
