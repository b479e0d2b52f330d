//! A thin pool meeting metadata it must not trust (issue 35), checked
//! against dm-thin.c and dm-space-map-common.c of Linux 6.12:
//! a second pool over metadata a pool already runs on is refused with
//! EBUSY (`__pool_find`); a reference count that would go below zero
//! fails the message with EINVAL, aborts the transaction and flags the
//! metadata (`sm_ll_dec_bitmap`, `metadata_operation_failed`); and a
//! pool whose superblock says `needs_check` stays read-only
//! (`set_pool_mode`).

mod thin_support;

use blkstack_core::{Op, Status};
use blkstack_mapped::error::{Refusal, TargetError};
use blkstack_mapped::targets::thin::metadata::PoolMetadata;
use blkstack_mapped::{DevArg, DmError, Registry};
use std::sync::Arc;
use thin_support::*;

/// The errno of the first [`TargetError::Refused`] in `e`'s chain.
fn refusal(e: &DmError) -> Option<Refusal> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(TargetError::Refused { errno, .. }) = err.downcast_ref::<TargetError>() {
            return Some(*errno);
        }
        cur = err.source();
    }
    None
}

fn meta_arg(reg: &Registry) -> DevArg {
    DevArg {
        name: "meta".into(),
        minor: 0,
        dev: reg.get("meta").unwrap(),
    }
}

#[test]
fn a_second_pool_over_metadata_in_use_is_refused_with_ebusy() {
    let f = files();
    let reg = pool(&f, 32768, "");
    msg(&reg, "create_thin 1");
    reg.create("thinA", "0 8192 thin pool 1").unwrap();
    let table = "0 32768 thin-pool meta data 128 0";
    let Err(e) = reg.create("poolB", table) else {
        panic!("a second pool over metadata in use was accepted");
    };
    assert_eq!(refusal(&e), Some(Refusal::Busy), "{}", e.report());
    assert!(
        e.report()
            .contains("metadata device already in use by a pool"),
        "{}",
        e.report()
    );
    assert!(
        reg.get("poolB").is_none(),
        "a refused create leaves no device"
    );
    // A reload of the pool's own device keeps its pool.
    reg.reload("pool", table).unwrap();
    reg.resume("pool").unwrap();
    let thin = reg.get("thinA").unwrap();
    write(&*thin, 0, &pattern(1, 0, 4096));
    assert_eq!(read(&*thin, 0, 4096), pattern(1, 0, 4096));
    drop(thin);
    // Once the pool is gone, the metadata device may carry another.
    reg.remove("thinA", false).unwrap();
    reg.remove("pool", false).unwrap();
    reg.create("poolB", table).unwrap();
    reg.remove_all();
    thin_check(&f.meta);
}

/// Metadata with thin device 0 mapping virtual blocks 0 and 1 to one
/// data block counted once: deleting it drops that count below zero.
fn cross_linked(f: &Files) -> u64 {
    let reg = files_registry(f, 32768);
    let mut md = PoolMetadata::open(meta_arg(&reg), 256, 128).unwrap();
    md.create_thin(0).unwrap();
    let b = md.alloc_data_block().unwrap();
    md.insert_block(0, 0, b).unwrap();
    md.insert_block(0, 1, b).unwrap();
    md.commit().unwrap();
    b
}

#[test]
fn a_reference_count_below_zero_fails_the_message_and_flags_the_metadata() {
    let f = files();
    cross_linked(&f);
    let reg = files_registry(&f, 32768);
    reg.create("pool", "0 32768 thin-pool meta data 128 0")
        .unwrap();
    let before = status(&reg, "pool");
    assert_eq!(before[4], "rw", "{before:?}");
    let e = reg.message("pool", 0, &["delete", "0"]).unwrap_err();
    assert_eq!(refusal(&e), None, "EINVAL: {}", e.report());
    assert!(
        e.report().contains("unable to decrement block"),
        "{}",
        e.report()
    );
    let s = status(&reg, "pool");
    assert_eq!(
        (s[4].as_str(), s[7].as_str()),
        ("ro", "needs_check"),
        "{s:?}"
    );
    // Nothing of the aborted transaction is on disk: device 0 is there.
    reg.remove_all();
    drop(reg);
    let reg = files_registry(&f, 32768);
    let md = PoolMetadata::open(meta_arg(&reg), 256, 128).unwrap();
    assert!(md.needs_check());
    assert!(md.exists(0), "the delete was not committed");
}

#[test]
fn a_pool_whose_metadata_needs_check_stays_read_only() {
    let f = files();
    {
        let reg = files_registry(&f, 32768);
        let mut md = PoolMetadata::open(meta_arg(&reg), 256, 128).unwrap();
        md.create_thin(1).unwrap();
        md.commit().unwrap();
        md.set_needs_check().unwrap();
    }
    let reg = files_registry(&f, 32768);
    reg.create("pool", "0 32768 thin-pool meta data 128 0")
        .unwrap();
    let s = status(&reg, "pool");
    // The kernel's `pool_status` for such a pool: `ro` and `needs_check`.
    let fields = [&s[3], &s[4], &s[6], &s[7]].map(String::as_str);
    assert_eq!(
        fields,
        ["-", "ro", "queue_if_no_space", "needs_check"],
        "{s:?}"
    );
    reg.create("thin", "0 8192 thin pool 1").unwrap();
    let thin = reg.get("thin").unwrap();
    assert_eq!(try_write(&*thin, 0), Status::IoError);
    let e = reg.message("pool", 0, &["create_thin", "2"]).unwrap_err();
    assert!(e.report().contains("READ_ONLY"), "{}", e.report());
    drop(thin);
    reg.remove_all();
}

#[test]
fn of_two_pools_created_at_once_over_one_metadata_device_one_runs() {
    for round in 0..8 {
        let f = files();
        let reg = files_registry(&f, 32768);
        let table = "0 32768 thin-pool meta data 128 0";
        let made: Vec<bool> = std::thread::scope(|s| {
            let a = s.spawn(|| reg.create("poolA", table).is_ok());
            let b = s.spawn(|| reg.create("poolB", table).is_ok());
            [a, b].map(|h| h.join().unwrap()).to_vec()
        });
        assert_eq!(
            made.iter().filter(|m| **m).count(),
            1,
            "round {round}: {made:?}"
        );
        reg.remove_all();
        thin_check(&f.meta);
    }
}

/// Log lines, captured for one test.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A mapping that points past the data device (issue 35, item 9): its
/// reads and writes fail with EIO and say why in the log, as the
/// kernel's remapped bio does ("attempt to access beyond end of
/// device"); the pool stays read-write, as the 6.12 kernel's does
/// (kernel_thin checks both against the guest), and other blocks work.
#[test]
fn a_mapping_past_the_data_device_fails_its_io_with_eio_and_logs_it() {
    let f = files();
    {
        let reg = files_registry(&f, 32768);
        let mut md = PoolMetadata::open(meta_arg(&reg), 256, 128).unwrap();
        md.create_thin(2).unwrap();
        md.insert_block(2, 0, 256 + 100).unwrap();
        md.commit().unwrap();
    }
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let reg = files_registry(&f, 32768);
    reg.create("pool", "0 32768 thin-pool meta data 128 0")
        .unwrap();
    reg.create("t", "0 16384 thin pool 2").unwrap();
    let t = reg.get("t").unwrap();
    for op in [Op::Read, Op::Write] {
        let mut b = vec![0u8; 4096];
        let st = blkstack_core::sync::submit_and_wait(&*t, op, 0, 4096, &mut b);
        assert_eq!(
            st,
            Status::IoError,
            "{op:?} of the block mapped past the end"
        );
    }
    assert_eq!(status(&reg, "pool")[4], "rw");
    write(&*t, 65536, &pattern(2, 65536, 4096));
    assert_eq!(read(&*t, 65536, 4096), pattern(2, 65536, 4096));
    drop(t);
    reg.remove_all();
    let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    assert!(
        text.contains("attempt to access beyond end of device") && text.contains("data_block=356"),
        "{text}"
    );
}
