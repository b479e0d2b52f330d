//! A pool's metadata space and its no-space policy as dm-thin has them:
//! a pool whose metadata reaches the reserve turns read-only, and a
//! metadata device reloaded larger grows the metadata space map and lets
//! it write again (`maybe_resize_metadata_dev`), the metadata low water
//! raises an event
//! (`metadata_low_callback`), the no-space timeout (the kernel's
//! `no_space_timeout` module parameter) stops a pool out of data space
//! from queueing, and refused messages carry the kernel's errno.
//!
//! Its own test binary: the no-space timeout is one setting for the
//! whole process, as the module parameter is for the whole kernel.

mod thin_support;

use blkstack_core::Status;
use blkstack_mapped::error::{Refusal, TargetError};
use blkstack_mapped::{DmError, Registry};
use std::time::{Duration, Instant};
use thin_support::*;

fn used_total(s: &str) -> (u64, u64) {
    let (u, t) = s.split_once('/').unwrap();
    (u.parse().unwrap(), t.parse().unwrap())
}

fn events(reg: &Registry) -> u64 {
    reg.info("pool").unwrap().event_nr
}

#[test]
fn the_metadata_low_water_event_fires_and_a_larger_metadata_device_grows_the_pool() {
    let f = files();
    // 256 metadata blocks: the low water threshold is a quarter, 64 free
    // blocks, which the status's used count (its reserve of 25 blocks
    // included) reaches at 217.
    let reg = small_pool(&f, 4096, 4096, 2048, "0 1 skip_block_zeroing");
    assert_eq!(status(&reg, "pool")[8], "64");
    msg(&reg, "create_thin 1");
    reg.create("thin", "0 1048576 thin pool 1").unwrap();
    let thin = reg.device("thin").unwrap();
    for b in 0..300 {
        assert_eq!(try_write(&*thin, b * BLOCK), Status::Ok);
    }
    let mut low_seen = false;
    let mut id = 2;
    while !low_seen {
        assert!(id < 1000, "the low water never came");
        let before = events(&reg);
        // The status commits, which checks the threshold.
        let s = status(&reg, "pool");
        let (used, total) = used_total(&s[1]);
        assert_eq!((total, s[4].as_str()), (256, "rw"), "{s:?}");
        let now = events(&reg);
        if used >= 217 {
            assert_eq!(now, before + 1, "the low water event: {s:?}");
            low_seen = true;
        } else {
            assert_eq!(now, before, "no event at {used} used: {s:?}");
        }
        msg(&reg, &format!("create_snap {id} 1"));
        assert_eq!(try_write(&*thin, (id % 300) * BLOCK), Status::Ok);
        id += 1;
    }
    let before = events(&reg);
    status(&reg, "pool");
    assert_eq!(events(&reg), before, "once, until it rises above again");
    // On into the reserve: the commit that reaches it turns the pool
    // read-only (check_for_metadata_space), with no damage to repair.
    loop {
        assert!(id < 1000, "the metadata never ran out");
        let s = status(&reg, "pool");
        if s[4] == "ro" {
            assert_eq!(s[7], "-", "out of metadata space, not failed: {s:?}");
            break;
        }
        if reg
            .message("pool", 0, &["create_snap", &id.to_string(), "1"])
            .is_ok()
        {
            let _ = try_write(&*thin, (id % 300) * BLOCK);
        }
        id += 1;
    }
    assert!(reg.message("pool", 0, &["create_thin", "5000"]).is_err());

    // The metadata device cannot shrink under the pool (the kernel's
    // resume would fail: "metadata device too small").
    let small = format!("0 1024 file {}", f.meta.display());
    let e = reg.reload("meta", &small).unwrap_err();
    assert!(e.report().contains("shrinking"), "{}", e.report());
    // Reload the metadata device 4 times larger, then the pool.
    reg.reload("meta", &format!("0 8192 file {} create", f.meta.display()))
        .unwrap();
    reg.resume("meta").unwrap();
    reg.reload(
        "pool",
        "0 524288 thin-pool meta data 128 0 1 skip_block_zeroing",
    )
    .unwrap();
    reg.resume("pool").unwrap();
    let s = status(&reg, "pool");
    let (used, total) = used_total(&s[1]);
    assert_eq!((total, s[4].as_str()), (1024, "rw"), "{s:?}");
    assert_eq!(s[8], "256", "the threshold follows the device");
    // New snapshots and writes use blocks past the old 256.
    let first = id;
    for _ in 0..80 {
        msg(&reg, &format!("create_snap {id} 1"));
        assert_eq!(try_write(&*thin, (id % 300) * BLOCK), Status::Ok);
        id += 1;
    }
    let (used2, _) = used_total(&status(&reg, "pool")[1]);
    // The reserve grew from 25 to 102 blocks: take it out of both.
    assert!(
        used2 - 102 > 256 && used2 > used,
        "{used} then {used2} of 1024 used after snapshots {first}..{id}"
    );
    drop(thin);
    reg.remove_all();
    thin_check(&f.meta);
    let dump = thin_dump(&f.meta);
    assert!(dump.contains(&format!("dev_id=\"{}\"", id - 1)), "{dump}");
}

#[test]
fn the_no_space_timeout_fails_queued_io_and_the_pool_errors_after() {
    blkstack_mapped::targets::thin::set_no_space_timeout_secs(1);
    let f = files();
    let reg = small_pool(&f, 4, 8, 8192, "0");
    msg(&reg, "create_thin 1");
    reg.create("thin", "0 8192 thin pool 1").unwrap();
    let thin = reg.device("thin").unwrap();
    for b in 0..4 {
        assert_eq!(try_write(&*thin, b * BLOCK), Status::Ok);
    }
    let start = Instant::now();
    assert_eq!(
        try_write(&*thin, 4 * BLOCK),
        Status::NoSpace,
        "queued, then failed by the timeout"
    );
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
    let s = status(&reg, "pool");
    assert_eq!(
        (s[4].as_str(), s[6].as_str()),
        ("out_of_data_space", "error_if_no_space"),
        "do_no_space_timeout sets error_if_no_space: {s:?}"
    );
    let start = Instant::now();
    assert_eq!(try_write(&*thin, 5 * BLOCK), Status::NoSpace);
    assert!(
        start.elapsed() < Duration::from_millis(900),
        "fails at once now"
    );
    // A larger pool writes again, with the table's policy back.
    reg.reload("pool", "0 1024 thin-pool meta data 128 0")
        .unwrap();
    reg.resume("pool").unwrap();
    let s = status(&reg, "pool");
    assert_eq!((s[4].as_str(), s[6].as_str()), ("rw", "queue_if_no_space"));
    assert_eq!(try_write(&*thin, 5 * BLOCK), Status::Ok);
    drop(thin);
    reg.remove_all();
    thin_check(&f.meta);
}

/// The errno a refused pool message carries (EINVAL when it has none).
fn errno_of(e: &DmError) -> Option<Refusal> {
    let DmError::Message { source, .. } = e else {
        panic!("not a message error: {e:?}");
    };
    match &**source {
        TargetError::Refused { errno, .. } => Some(*errno),
        _ => None,
    }
}

#[test]
fn refused_messages_carry_the_kernels_errno() {
    let f = files();
    let reg = pool(&f, 32768, "");
    msg(&reg, "create_thin 1");
    reg.create("thin", "0 8192 thin pool 1").unwrap();
    msg(&reg, "reserve_metadata_snap");
    for (m, want) in [
        ("create_thin 1", Some(Refusal::Exists)),
        ("create_snap 1 1", Some(Refusal::Exists)),
        ("create_snap 2 9", Some(Refusal::NoData)),
        ("delete 9", Some(Refusal::NoData)),
        ("delete 1", Some(Refusal::Busy)),
        ("reserve_metadata_snap", Some(Refusal::Busy)),
        ("set_transaction_id 5 6", None),
        ("create_thin x", None),
    ] {
        let args: Vec<&str> = m.split_whitespace().collect();
        let e = reg.message("pool", 0, &args).unwrap_err();
        assert_eq!(errno_of(&e), want, "{m}: {}", e.report());
    }
    msg(&reg, "release_metadata_snap");
    let e = reg
        .message("pool", 0, &["release_metadata_snap"])
        .unwrap_err();
    assert_eq!(errno_of(&e), None, "EINVAL: {}", e.report());
    reg.remove_all();
    thin_check(&f.meta);
}
