//! RAM-held data across reload and remove: a reload that keeps a `memory`
//! line at the same start and length keeps its data (dm keeps the
//! underlying device across a table swap); one that would drop it, and a
//! remove of a device holding it, are refused unless forced, naming the
//! device, the line and the bytes, and change nothing.

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Device, Op, Status};
use blkstack_mapped::{DmError, Registry};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

fn write(dev: &dyn Device, off: u64, data: &[u8]) -> Status {
    let mut buf = data.to_vec();
    submit_and_wait(dev, Op::Write, off, buf.len() as u64, &mut buf)
}

fn read(dev: &dyn Device, off: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xAAu8; len];
    assert_eq!(
        submit_and_wait(dev, Op::Read, off, len as u64, &mut buf),
        Status::Ok
    );
    buf
}

fn allocated(reg: &Registry, name: &str) -> u64 {
    let status = reg.status_text(name).unwrap();
    status
        .split_whitespace()
        .find_map(|w| w.strip_prefix("allocated_bytes="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no allocated_bytes in {status}"))
}

#[test]
fn reloading_the_same_memory_table_keeps_the_data() {
    let reg = Registry::new();
    reg.create("mm", "0 8192 memory").unwrap();
    let dev = reg.device("mm").unwrap();
    let data = pattern(8192, 1);
    assert_eq!(write(&*dev, 4096, &data), Status::Ok);
    reg.reload("mm", "0 8192 memory").unwrap();
    reg.resume("mm").unwrap();
    assert_eq!(reg.info("mm").unwrap().event_nr, 1, "the table was swapped");
    assert_eq!(read(&*dev, 4096, 8192), data);
    assert_eq!(allocated(&reg, "mm"), 8192);
    // Options may change; the pages stay, and writes between reload and
    // resume land in the same store.
    reg.reload("mm", "0 8192 memory bs=4096 max_alloc=1M")
        .unwrap();
    let more = pattern(4096, 2);
    assert_eq!(write(&*dev, 0, &more), Status::Ok);
    reg.resume("mm").unwrap();
    assert_eq!(
        reg.table_text("mm").unwrap(),
        "0 8192 memory bs=4096 max_alloc=1048576\n"
    );
    assert_eq!(read(&*dev, 0, 4096), more);
    assert_eq!(read(&*dev, 4096, 8192), data);
    // A second memory line appended keeps the first line's data.
    reg.reload("mm", "0 8192 memory\n8192 8192 memory").unwrap();
    reg.resume("mm").unwrap();
    assert_eq!(read(&*dev, 4096, 8192), data);
    assert_eq!(dev.size(), 16384 * 512);
}

#[test]
fn a_reload_that_drops_ram_data_is_refused_unless_forced() {
    let reg = Registry::new();
    reg.create("mm", "0 8192 memory").unwrap();
    let dev = reg.device("mm").unwrap();
    let data = pattern(4096, 3);
    assert_eq!(write(&*dev, 0, &data), Status::Ok);
    for table in [
        "0 16384 memory",
        "0 8192 zero",
        "0 4096 memory\n4096 4096 memory",
    ] {
        let e = reg.reload("mm", table).unwrap_err();
        assert!(matches!(e, DmError::WouldLoseData { .. }), "{table}: {e:?}");
        let msg = e.report();
        assert!(
            msg.contains("device mm: reload")
                && msg.contains("'0 8192 memory' holds 4096 bytes")
                && msg.contains("--force"),
            "{msg}"
        );
        // Nothing changed: the old table is live, no table staged.
        assert_eq!(reg.table_text("mm").unwrap(), "0 8192 memory\n");
        assert_eq!(reg.inactive_table_text("mm").unwrap(), None);
        assert_eq!(read(&*dev, 0, 4096), data);
    }
    // Forced: staged, and the data goes when it becomes live.
    reg.reload_forced("mm", "0 16384 memory", true).unwrap();
    assert_eq!(read(&*dev, 0, 4096), data, "still live until resume");
    reg.resume("mm").unwrap();
    assert_eq!(read(&*dev, 0, 4096), vec![0u8; 4096]);
    assert_eq!(allocated(&reg, "mm"), 0);
    // Nothing in RAM: a reload that drops the (empty) store is fine.
    reg.reload("mm", "0 8192 zero").unwrap();
}

#[test]
fn data_written_between_reload_and_resume_is_not_dropped_silently() {
    let reg = Registry::new();
    reg.create("mm", "0 8192 memory").unwrap();
    let dev = reg.device("mm").unwrap();
    // Nothing held yet, so the reload is accepted...
    reg.reload("mm", "0 8192 zero").unwrap();
    let data = pattern(4096, 5);
    assert_eq!(write(&*dev, 0, &data), Status::Ok);
    // ...but by resume the live table holds data the staged one drops.
    let msg = reg.resume("mm").unwrap_err().report();
    assert!(
        msg.contains("device mm: resume would discard data held in RAM")
            && msg.contains("'0 8192 memory' holds 4096 bytes")
            && msg.contains("reload with --force"),
        "{msg}"
    );
    assert_eq!(reg.table_text("mm").unwrap(), "0 8192 memory\n");
    assert_eq!(reg.info("mm").unwrap().event_nr, 0);
    assert!(!reg.info("mm").unwrap().suspended);
    assert_eq!(read(&*dev, 0, 4096), data);
    // A forced reload lets the swap happen.
    reg.reload_forced("mm", "0 8192 zero", true).unwrap();
    reg.resume("mm").unwrap();
    assert_eq!(reg.table_text("mm").unwrap(), "0 8192 zero\n");
}

#[test]
fn removing_a_device_holding_ram_data_needs_force() {
    let reg = Registry::new();
    reg.create_stack("mm: 0 2048 memory\nmm: 2048 2048 zero\ne: 0 2048 memory\n")
        .unwrap();
    let dev = reg.device("mm").unwrap();
    assert_eq!(write(&*dev, 512, &pattern(512, 4)), Status::Ok);
    let e = reg.remove("mm", false).unwrap_err();
    let msg = e.report();
    assert!(
        msg.contains("device mm: remove")
            && msg.contains("'0 2048 memory' holds 4096 bytes")
            && !msg.contains("zero"),
        "{msg}"
    );
    assert!(reg.get("mm").is_some());
    assert_eq!(read(&*dev, 512, 512), pattern(512, 4));
    // A memory device never written holds nothing to lose.
    reg.remove("e", false).unwrap();
    reg.remove("mm", true).unwrap();
    assert!(reg.get("mm").is_none());
}
