//! log-writes as xfstests uses it: every change reaches the log in the
//! order it became durable (a write with the first flush issued after it
//! completed, a FUA write at once), with its data, flags and marks, in
//! dm-log-writes' on-disk format; status, table and message are the
//! kernel's.

use blkstack_core::sync::{submit_and_wait, submit_and_wait_flags};
use blkstack_core::{BioFlags, Device, Op, Status};
use blkstack_mapped::targets::log_writes::format::{
    LogEntry, LogSuper, LOG_DISCARD_FLAG, LOG_FLUSH_FLAG, LOG_FUA_FLAG, LOG_MARK_FLAG,
};
use blkstack_mapped::Registry;
use std::sync::Arc;

fn setup() -> Arc<Registry> {
    let reg = Registry::new();
    reg.create("data", "0 8192 memory").unwrap();
    reg.create("log", "0 8192 memory").unwrap();
    reg.create("lw", "0 8192 log-writes data log").unwrap();
    reg
}

fn write(dev: &dyn Device, flags: BioFlags, off: u64, byte: u8) -> Status {
    let mut b = vec![byte; 4096];
    submit_and_wait_flags(dev, Op::Write, flags, off, 4096, &mut b)
}

/// The log as (entry, inline text, data) in order, read from its device.
fn read_log(reg: &Registry) -> (LogSuper, Vec<(LogEntry, String, Vec<u8>)>) {
    let log = reg.device("log").unwrap();
    let mut all = vec![0u8; 8192 * 512];
    let len = all.len() as u64;
    assert_eq!(
        submit_and_wait(&*log, Op::Read, 0, len, &mut all),
        Status::Ok
    );
    let sup = LogSuper::decode(&all[..512]).unwrap();
    let bs = sup.sectorsize as usize;
    let mut at = bs;
    let mut out = Vec::new();
    for _ in 0..sup.nr_entries {
        let e = LogEntry::decode(&all[at..at + bs]).unwrap();
        let text = &all[at + 32..at + 32 + e.data_len as usize];
        at += bs;
        let mut data = Vec::new();
        if e.flags & (LOG_DISCARD_FLAG | LOG_MARK_FLAG) == 0 {
            let n = e.nr_sectors as usize * bs;
            data = all[at..at + n].to_vec();
            at += n;
        }
        out.push((e, String::from_utf8_lossy(text).into_owned(), data));
    }
    (sup, out)
}

#[test]
fn writes_enter_the_log_when_they_become_durable() {
    let reg = setup();
    let lw = reg.device("lw").unwrap();
    assert_eq!(write(&*lw, BioFlags::NONE, 0, 0xa1), Status::Ok);
    assert_eq!(write(&*lw, BioFlags::FUA, 8192, 0xb2), Status::Ok);
    // Nothing but the FUA write is durable yet: one entry logged.
    let wait_status = |want: &str| {
        for _ in 0..500 {
            if reg.status_text("lw").unwrap().starts_with(want) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!(
            "status never became {want}: {}",
            reg.status_text("lw").unwrap()
        );
    };
    wait_status("0 8192 log-writes 1 ");
    assert_eq!(submit_and_wait(&*lw, Op::Flush, 0, 0, &mut []), Status::Ok);
    reg.message("lw", 0, &["mark", "one"]).unwrap();
    assert_eq!(
        submit_and_wait(&*lw, Op::Discard, 4096 * 4, 8192, &mut []),
        Status::Ok
    );
    // The discard is unflushed: the end logs it before the closing mark.
    wait_status("0 8192 log-writes 4 ");
    assert_eq!(
        reg.table_text("lw").unwrap(),
        "0 8192 log-writes 253:0 253:1\n"
    );
    // Removing the device ends the target (kernel `log_writes_dtr`):
    // the unflushed discard, then the closing mark, reach the log.
    drop(lw);
    reg.remove("lw", false).unwrap();

    let (sup, entries) = read_log(&reg);
    assert_eq!(sup.sectorsize, 512);
    let got: Vec<(u64, u64, u64, &str)> = entries
        .iter()
        .map(|(e, t, _)| (e.sector, e.nr_sectors, e.flags, t.as_str()))
        .collect();
    assert_eq!(
        got,
        vec![
            (16, 8, LOG_FUA_FLAG, ""),
            (0, 8, 0, ""),
            (0, 0, LOG_FLUSH_FLAG, ""),
            (0, 0, LOG_MARK_FLAG, "one"),
            (32, 16, LOG_DISCARD_FLAG, ""),
            (0, 0, LOG_MARK_FLAG, "dm-log-writes-end"),
        ]
    );
    assert_eq!(entries[0].2, vec![0xb2; 4096]);
    assert_eq!(entries[1].2, vec![0xa1; 4096]);
}

#[test]
fn bad_tables_and_messages_are_refused() {
    let reg = setup();
    for bad in [
        "0 8192 log-writes data",
        "0 8192 log-writes nosuch log",
        "0 8192 log-writes data nosuch",
        "0 16384 log-writes data log",
    ] {
        assert!(reg.create("x", bad).is_err(), "{bad} was accepted");
    }
    assert!(reg.message("lw", 0, &["mark"]).is_err());
    assert!(reg.message("lw", 0, &["mark", "a", "b"]).is_err());
    assert!(reg.message("lw", 0, &["bookmark", "a"]).is_err());
    assert!(reg.message("lw", 0, &["MARK", "a"]).is_ok());
}

#[test]
fn a_full_log_turns_logging_off_and_io_goes_on() {
    let reg = Registry::new();
    reg.create("data", "0 8192 memory").unwrap();
    reg.create("log", "0 64 memory").unwrap();
    reg.create("lw", "0 8192 log-writes data log").unwrap();
    let lw = reg.device("lw").unwrap();
    for i in 0..8 {
        assert_eq!(write(&*lw, BioFlags::FUA, i * 4096, 1), Status::Ok);
    }
    for _ in 0..500 {
        if reg
            .status_text("lw")
            .unwrap()
            .ends_with("logging_disabled\n")
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let st = reg.status_text("lw").unwrap();
    assert!(st.ends_with(" logging_disabled\n"), "{st}");
    // Six entries of 9 sectors fit below sector 64 after the super.
    assert!(st.starts_with("0 8192 log-writes 6 "), "{st}");
    assert_eq!(write(&*lw, BioFlags::NONE, 0, 2), Status::Ok);
}
