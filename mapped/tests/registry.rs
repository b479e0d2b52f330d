//! Registry behaviour as a dmsetup user sees it: bad tables are refused
//! with the line and the problem named and change nothing; reloads take
//! effect at resume; suspend holds I/O without failing it; devices in use
//! cannot be removed; data written through linear and striped comes back.

use blkstack_core::sync::submit_and_wait;
use blkstack_core::testing::CompletionRecorder;
use blkstack_core::{Bio, Device, IoBuf, Op, Status};
use blkstack_mapped::Registry;
use std::sync::Arc;

fn snapshot(reg: &Registry) -> Vec<(String, String, Option<String>)> {
    reg.names()
        .into_iter()
        .map(|n| {
            let t = reg.table_text(&n).unwrap();
            let i = reg.inactive_table_text(&n).unwrap();
            (n, t, i)
        })
        .collect()
}

fn base() -> Arc<Registry> {
    let reg = Registry::new();
    reg.create_stack("m0: 0 2048 memory\nm1: 0 2048 memory\nz: 0 4096 zero\n")
        .unwrap();
    reg
}

#[test]
fn malformed_tables_name_line_and_problem_and_change_nothing() {
    let reg = base();
    let before = snapshot(&reg);
    let cases: &[(&str, &[&str])] = &[
        (
            "0 100 nosuch\n",
            &["line 1", "unknown target type 'nosuch'"],
        ),
        (
            "0 100 linear m0\n",
            &["line 1", "linear", "expected 2 argument"],
        ),
        (
            "0 100 zero extra\n",
            &["line 1", "zero", "expected 0 argument"],
        ),
        (
            "0 101 striped 2 8 m0 0 m1 0\n",
            &["line 1", "not divisible by the number of stripes"],
        ),
        (
            "0 100 striped 2 8 m0 0 m1 0\n",
            &["line 1", "not divisible by chunk size"],
        ),
        (
            "0 96 striped 2 8 m0 0\n",
            &["line 1", "need 4 device arguments"],
        ),
        (
            "0 100 linear missing 0\n",
            &["line 1", "device 'missing' not found"],
        ),
        ("0 100 linear m0 2000\n", &["line 1", "too small"]),
        ("0 100 zero\n50 100 zero\n", &["line 2", "overlap"]),
        (
            "0 100 zero\n100 1o0 zero\n",
            &["line 2", "bad length '1o0'"],
        ),
        (
            "0 100 linear m0 x\n",
            &["line 1", "invalid device sector 'x'"],
        ),
        ("0 100 null irqmode=7\n", &["line 1", "irqmode"]),
        ("0 100 memory nosuchkey=1\n", &["line 1", "nosuchkey"]),
    ];
    for (table, wants) in cases {
        let e = reg
            .create("new", table)
            .err()
            .expect("create must fail")
            .report();
        for w in *wants {
            assert!(e.contains(w), "table {table:?}: error {e:?} lacks {w:?}");
        }
        assert_eq!(
            snapshot(&reg),
            before,
            "create of {table:?} changed the registry"
        );
        let e = reg.reload("z", table).unwrap_err().report();
        for w in *wants {
            assert!(e.contains(w), "reload {table:?}: error {e:?} lacks {w:?}");
        }
        assert_eq!(
            snapshot(&reg),
            before,
            "reload of {table:?} changed the registry"
        );
    }
    // A batch with one bad device creates none of them.
    let e = reg
        .create_stack("a: 0 8 zero\nb: 0 8 bogus\n")
        .unwrap_err()
        .report();
    assert!(e.contains("device b") && e.contains("line 2"), "{e}");
    assert_eq!(snapshot(&reg), before);
    assert!(reg
        .create("m0", "0 8 zero")
        .err()
        .expect("dup")
        .report()
        .contains("already exists"));
}

#[test]
fn remove_refuses_devices_in_use_and_cycles_are_refused() {
    let reg = base();
    reg.create("lin", "0 1024 linear m0 0").unwrap();
    let e = reg.remove("m0", false).unwrap_err().report();
    assert!(e.contains("busy") && e.contains("lin"), "{e}");
    assert!(
        reg.remove("m0", true).is_err(),
        "force must not leave a dangling user"
    );
    let e = reg
        .reload("m0", "0 1024 linear lin 0")
        .unwrap_err()
        .report();
    assert!(e.contains("cycle"), "{e}");
    let e = reg
        .reload("lin", "0 1024 linear lin 0")
        .unwrap_err()
        .report();
    assert!(e.contains("itself"), "{e}");
    reg.remove("lin", false).unwrap();
    reg.remove("m0", false).unwrap();
    assert!(reg.get("m0").is_none());
    // /dev/mapper/ and 253:MINOR name devices too.
    let minor = reg.info("m1").unwrap().minor;
    reg.create("a", "0 8 linear /dev/mapper/m1 0").unwrap();
    reg.create("b", &format!("0 8 linear 253:{minor} 8"))
        .unwrap();
    assert_eq!(
        reg.table_text("b").unwrap(),
        format!("0 8 linear 253:{minor} 8\n")
    );
}

fn write_pattern(dev: &dyn Device, off: u64, len: usize, seed: u8) {
    let mut buf: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    assert_eq!(
        submit_and_wait(dev, Op::Write, off, len as u64, &mut buf),
        Status::Ok
    );
}

fn read_back(dev: &dyn Device, off: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xAAu8; len];
    assert_eq!(
        submit_and_wait(dev, Op::Read, off, len as u64, &mut buf),
        Status::Ok
    );
    buf
}

#[test]
fn data_round_trips_through_linear_and_striped() {
    let reg = base();
    reg.create("lin", "0 1024 linear m0 1024").unwrap();
    reg.create("st", "0 2048 striped 2 8 m0 0 m1 0").unwrap();
    let lin = reg.device("lin").unwrap();
    let st = reg.device("st").unwrap();
    // Crosses many 4 KiB chunks, so the bio is split and fanned in.
    write_pattern(&*st, 4096 - 512, 64 * 1024, 3);
    let got = read_back(&*st, 4096 - 512, 64 * 1024);
    let want: Vec<u8> = (0..64 * 1024)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(3))
        .collect();
    assert_eq!(got, want);
    // Chunk 0 of st is m0's first 4 KiB; chunk 1 is m1's first.
    let m1 = reg.device("m1").unwrap();
    assert_eq!(read_back(&*m1, 0, 4096)[..512], want[512..1024]);
    write_pattern(&*lin, 0, 4096, 9);
    let m0 = reg.device("m0").unwrap();
    assert_eq!(read_back(&*m0, 1024 * 512, 4096), read_back(&*lin, 0, 4096));
    // Out of range and misaligned requests fail cleanly.
    let mut b = vec![0u8; 4096];
    assert_eq!(
        submit_and_wait(&*lin, Op::Read, 1024 * 512 - 512, 4096, &mut b),
        Status::Invalid
    );
    let mut b = vec![0u8; 100];
    assert_eq!(
        submit_and_wait(&*lin, Op::Read, 0, 100, &mut b),
        Status::Invalid
    );
    assert_eq!(submit_and_wait(&*st, Op::Flush, 0, 0, &mut []), Status::Ok);
    assert_eq!(
        reg.status_text("st").unwrap(),
        "0 2048 striped 2 253:0 253:1 1 AA\n"
    );
}

#[test]
fn suspend_holds_io_and_reload_takes_effect_at_resume() {
    let reg = base();
    reg.create("d", "0 1024 zero").unwrap();
    let dev = reg.device("d").unwrap();
    reg.reload("d", "0 1024 error").unwrap();
    // Staged, not live yet.
    assert_eq!(reg.table_text("d").unwrap(), "0 1024 zero\n");
    assert_eq!(
        reg.inactive_table_text("d").unwrap().as_deref(),
        Some("0 1024 error\n")
    );
    let mut b = vec![0u8; 512];
    assert_eq!(submit_and_wait(&*dev, Op::Read, 0, 512, &mut b), Status::Ok);

    reg.suspend("d").unwrap();
    assert!(reg.info("d").unwrap().suspended);
    let sink = CompletionRecorder::new();
    let mut mem = vec![0u8; 512];
    // SAFETY: `mem` outlives the request; we wait for its completion below.
    let buf = unsafe { IoBuf::from_slice(&mut mem) };
    dev.submit(Bio::new(Op::Read, 0, 512, buf, sink.clone(), 0));
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(sink.count(), 0, "I/O must be held while suspended");
    reg.resume("d").unwrap();
    // The held bio ran against the new table.
    assert_eq!(sink.statuses(), vec![Status::IoError]);
    assert_eq!(reg.table_text("d").unwrap(), "0 1024 error\n");
    assert_eq!(reg.info("d").unwrap().event_nr, 1);
    drop(mem);
}

#[test]
fn read_only_devices_refuse_writes() {
    let reg = Registry::new();
    reg.create_concise("ro,,,ro,0 64 memory").unwrap();
    let dev = reg.device("ro").unwrap();
    let mut b = vec![1u8; 512];
    assert_eq!(
        submit_and_wait(&*dev, Op::Write, 0, 512, &mut b),
        Status::Permission
    );
    assert_eq!(submit_and_wait(&*dev, Op::Read, 0, 512, &mut b), Status::Ok);
}

#[test]
fn a_stack_offers_the_widest_tag_set_below_it() {
    use blkstack_core::QueueShape;
    let reg = Registry::new();
    reg.create_stack(
        "a: 0 2048 memory submit_queues=2 hw_queue_depth=32\n\
         b: 0 2048 memory submit_queues=3 hw_queue_depth=16\n\
         s: 0 4096 striped 2 8 a 0 b 0\n\
         top: 0 4096 linear s 0\n\
         z: 0 2048 zero\n",
    )
    .unwrap();
    let shape = |n: &str| reg.get(n).unwrap().queue_shape();
    assert_eq!(
        shape("a"),
        Some(QueueShape {
            hw_queues: 2,
            depth: 32
        })
    );
    let widest = Some(QueueShape {
        hw_queues: 3,
        depth: 32,
    });
    assert_eq!(shape("s"), widest);
    // Through another mapped device, as dm's table of devices is walked.
    assert_eq!(shape("top"), widest);
    // Nothing below queues.
    assert_eq!(shape("z"), None);
}
