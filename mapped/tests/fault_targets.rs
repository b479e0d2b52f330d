//! flakey and dust as a tester uses them: the failure each one promises
//! happens, and only then; their table/status/message text is dm's.

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Device, Op, Status};
use blkstack_mapped::Registry;
use std::sync::Arc;

fn setup() -> Arc<Registry> {
    let reg = Registry::new();
    reg.create("m", "0 4096 memory").unwrap();
    reg
}

fn write(dev: &dyn Device, off: u64, byte: u8) -> Status {
    let mut b = vec![byte; 4096];
    submit_and_wait(dev, Op::Write, off, 4096, &mut b)
}

fn read(dev: &dyn Device, off: u64) -> (Status, Vec<u8>) {
    let mut b = vec![0u8; 4096];
    let s = submit_and_wait(dev, Op::Read, off, 4096, &mut b);
    (s, b)
}

#[test]
fn flakey_up_passes_down_fails_everything_by_default() {
    let reg = setup();
    reg.create("up", "0 4096 flakey m 0 1 0").unwrap();
    reg.create("down", "0 4096 flakey m 0 0 1").unwrap();
    let up = reg.device("up").unwrap();
    let down = reg.device("down").unwrap();
    assert_eq!(write(&*up, 0, 7), Status::Ok);
    assert_eq!(read(&*up, 0), (Status::Ok, vec![7; 4096]));
    assert_eq!(write(&*down, 0, 8), Status::IoError);
    assert_eq!(read(&*down, 0).0, Status::IoError);
    assert_eq!(
        reg.table_text("down").unwrap(),
        "0 4096 flakey 253:0 0 0 1 2 error_reads error_writes\n",
        "kernel 6.12 sets and prints both error bits when no feature is given"
    );
}

#[test]
fn flakey_features_drop_error_and_corrupt() {
    let reg = setup();
    let m = reg.device("m").unwrap();
    reg.create("drop", "0 4096 flakey m 0 0 1 1 drop_writes")
        .unwrap();
    reg.create("err", "0 4096 flakey m 0 0 1 1 error_writes")
        .unwrap();
    reg.create("cor", "0 4096 flakey m 0 0 1 5 corrupt_bio_byte 10 r 255 0")
        .unwrap();
    assert_eq!(write(&*m, 0, 1), Status::Ok);
    let drop = reg.device("drop").unwrap();
    assert_eq!(
        write(&*drop, 0, 2),
        Status::Ok,
        "dropped writes report success"
    );
    assert_eq!(read(&*m, 0).1, vec![1; 4096], "... but change nothing");
    assert_eq!(
        read(&*drop, 0),
        (Status::Ok, vec![1; 4096]),
        "reads pass while dropping writes"
    );
    let err = reg.device("err").unwrap();
    assert_eq!(write(&*err, 0, 3), Status::IoError);
    assert_eq!(read(&*err, 0).0, Status::Ok);
    let cor = reg.device("cor").unwrap();
    let (s, data) = read(&*cor, 0);
    assert_eq!(s, Status::Ok);
    assert_eq!(data[9], 255);
    assert_eq!(data[8], 1);
    assert_eq!(
        read(&*m, 0).1[9],
        1,
        "read corruption must not reach the medium"
    );
    assert_eq!(
        reg.table_text("cor").unwrap(),
        "0 4096 flakey 253:0 0 0 1 5 corrupt_bio_byte 10 r 255 0\n"
    );
    assert_eq!(
        reg.table_text("drop").unwrap(),
        "0 4096 flakey 253:0 0 0 1 1 drop_writes\n"
    );
}

#[test]
fn flakey_argument_errors() {
    let reg = setup();
    for (t, want) in [
        ("0 8 flakey m 0 1", "invalid argument count"),
        ("0 8 flakey m 0 0 0", "interval is zero"),
        ("0 8 flakey m 0 1 1 2 drop_writes error_writes", "conflicts"),
        (
            "0 8 flakey m 0 1 1 1 bogus",
            "Unrecognised flakey feature requested: 'bogus'",
        ),
        ("0 8 flakey m 0 1 1 5 corrupt_bio_byte 1 x 0 0", "direction"),
        (
            "0 8 flakey m 0 1 1 6 drop_writes corrupt_bio_byte 1 w 0 0",
            "incompatible",
        ),
        ("0 8 flakey m 0 1 1 3 drop_writes", "3 declared, 1 given"),
        ("0 8 flakey m 0 4294967295 1", "interval overflow"),
        ("0 8 flakey m +0 1 1", "device sector"),
        ("0 8 flakey m 0 +1 1", "up interval"),
        ("0 8 flakey m 0 1 1 12", "Invalid number of feature args"),
        (
            "0 8 flakey m 0 1 1 2 corrupt_bio_byte 1 r 0 0",
            "Insufficient feature arguments",
        ),
        (
            "0 8 flakey m 0 1 1 1 random_read_corrupt",
            "requires a parameter",
        ),
        (
            "0 8 flakey m 0 1 1 5 corrupt_bio_byte 0 r 0 0",
            "corrupt bio byte",
        ),
        ("0 8 flakey m 0 1 1 5 corrupt_bio_byte 1 r 256 0", "0-255"),
    ] {
        let e = reg.create("f", t).err().expect(t).report();
        assert!(e.contains(want) && e.contains("line 1"), "{t}: {e}");
    }
    // What dm-flakey 6.12 accepts: words after the counted features are
    // ignored, and random_write_corrupt may stand beside drop_writes.
    for (t, table) in [
        (
            "0 8 flakey m 0 1 1 1 error_reads ignored words",
            "0 8 flakey 253:0 0 1 1 1 error_reads\n",
        ),
        (
            "0 8 flakey m 0 1 1 3 drop_writes random_write_corrupt 9",
            "0 8 flakey 253:0 0 1 1 3 drop_writes random_write_corrupt 9\n",
        ),
        (
            "0 8 flakey m 0 1 1 0",
            "0 8 flakey 253:0 0 1 1 2 error_reads error_writes\n",
        ),
    ] {
        reg.create("ok", t)
            .unwrap_or_else(|e| panic!("{t}: {}", e.report()));
        assert_eq!(reg.table_text("ok").unwrap(), table, "{t}");
        reg.remove("ok", false).unwrap();
    }
}

#[test]
fn flakey_error_reads_fails_reads_only_while_down() {
    let reg = setup();
    let m = reg.device("m").unwrap();
    assert_eq!(write(&*m, 0, 1), Status::Ok);
    reg.create("er", "0 4096 flakey m 0 0 1 1 error_reads")
        .unwrap();
    reg.create("erup", "0 4096 flakey m 0 1 0 1 error_reads")
        .unwrap();
    reg.create("erdrop", "0 4096 flakey m 0 0 1 2 error_reads drop_writes")
        .unwrap();
    let er = reg.device("er").unwrap();
    assert_eq!(read(&*er, 0).0, Status::IoError);
    // Writes are not touched by error_reads alone.
    assert_eq!(write(&*er, 0, 2), Status::Ok);
    assert_eq!(read(&*m, 0).1, vec![2; 4096]);
    let up = reg.device("erup").unwrap();
    assert_eq!(read(&*up, 0), (Status::Ok, vec![2; 4096]));
    let erdrop = reg.device("erdrop").unwrap();
    assert_eq!(read(&*erdrop, 0).0, Status::IoError);
    assert_eq!(write(&*erdrop, 0, 3), Status::Ok);
    assert_eq!(read(&*m, 0).1, vec![2; 4096], "the write was dropped");
    assert_eq!(
        reg.table_text("erdrop").unwrap(),
        "0 4096 flakey 253:0 0 0 1 2 error_reads drop_writes\n"
    );
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(0x9E37_79B9).wrapping_add(seed * 7) >> 3) as u8)
        .collect()
}

/// Bytes that differ between `a` and `b`.
fn diff(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count()
}

const BIOS: usize = 2000;

/// `hits` out of [`BIOS`] corrupted bios match probability `p` (of 1e9):
/// the random value equals the old byte 1 time in 256, and the bound is
/// over 5 standard deviations, so a correct rate never fails it.
fn assert_rate(hits: usize, p: f64) {
    let p = p * 255.0 / 256.0;
    let want = BIOS as f64 * p;
    let sd = (BIOS as f64 * p * (1.0 - p)).sqrt();
    assert!(
        (hits as f64 - want).abs() <= 5.0 * sd + 1.0,
        "{hits} of {BIOS} corrupted, expected about {want:.0}"
    );
}

#[test]
fn flakey_random_read_corrupt_matches_its_probability() {
    let reg = setup();
    let m = reg.device("m").unwrap();
    let data = pattern(4096, 1);
    let mut w = data.clone();
    assert_eq!(submit_and_wait(&*m, Op::Write, 0, 4096, &mut w), Status::Ok);
    // 25%: probabilities are out of 1000000000, as dm-flakey's.
    reg.create(
        "rr",
        "0 4096 flakey m 0 0 1 2 random_read_corrupt 250000000",
    )
    .unwrap();
    let rr = reg.device("rr").unwrap();
    let mut hits = 0;
    for _ in 0..BIOS {
        let (s, got) = read(&*rr, 0);
        assert_eq!(s, Status::Ok);
        let d = diff(&got, &data);
        assert!(d <= 1, "one byte at most is corrupted, {d} were");
        hits += d;
    }
    assert_rate(hits, 0.25);
    assert_eq!(
        read(&*m, 0).1,
        data,
        "read corruption never reaches the medium"
    );
    // Writes pass untouched (random_read_corrupt alone sets no error bit).
    assert_eq!(write(&*rr, 4096, 9), Status::Ok);
    assert_eq!(read(&*m, 4096).1, vec![9; 4096]);
    // Probability 1000000000 corrupts every read.
    reg.create(
        "all",
        "0 4096 flakey m 0 0 1 2 random_read_corrupt 1000000000",
    )
    .unwrap();
    let all = reg.device("all").unwrap();
    let hits: usize = (0..BIOS).map(|_| diff(&read(&*all, 0).1, &data)).sum();
    assert_rate(hits, 1.0);
}

#[test]
fn flakey_random_write_corrupt_matches_its_probability() {
    let reg = setup();
    let m = reg.device("m").unwrap();
    reg.create(
        "rw",
        "0 4096 flakey m 0 0 1 2 random_write_corrupt 500000000",
    )
    .unwrap();
    let rw = reg.device("rw").unwrap();
    let mut hits = 0;
    for i in 0..BIOS as u64 {
        let data = pattern(4096, i);
        let mut w = data.clone();
        assert_eq!(
            submit_and_wait(&*rw, Op::Write, 0, 4096, &mut w),
            Status::Ok
        );
        assert_eq!(w, data, "the submitter's buffer keeps what it wrote");
        let d = diff(&read(&*m, 0).1, &data);
        assert!(d <= 1, "one byte at most is corrupted, {d} were");
        hits += d;
    }
    assert_rate(hits, 0.5);
    // Reads pass untouched.
    let stored = read(&*m, 0).1;
    assert_eq!(read(&*rw, 0), (Status::Ok, stored));
    // A fixed write corruption reaches the medium, not the caller's buffer.
    reg.create("fw", "0 4096 flakey m 0 0 1 5 corrupt_bio_byte 3 w 200 0")
        .unwrap();
    let fw = reg.device("fw").unwrap();
    let mut w = vec![7u8; 4096];
    assert_eq!(
        submit_and_wait(&*fw, Op::Write, 8192, 4096, &mut w),
        Status::Ok
    );
    assert_eq!(w, vec![7u8; 4096]);
    let got = read(&*m, 8192).1;
    assert_eq!((got[1], got[2], got[3]), (7, 200, 7));
}

#[test]
fn flakey_new_features_round_trip_and_refuse_bad_arguments() {
    let reg = setup();
    let t = "0 4096 flakey m 0 0 1 10 error_reads corrupt_bio_byte 10 r 255 0 random_read_corrupt 5 random_write_corrupt 7";
    reg.create("f", t).unwrap();
    let want = "0 4096 flakey 253:0 0 0 1 10 error_reads corrupt_bio_byte 10 r 255 0 random_read_corrupt 5 random_write_corrupt 7\n";
    assert_eq!(reg.table_text("f").unwrap(), want);
    reg.create("g", want.trim_end()).unwrap();
    assert_eq!(reg.table_text("g").unwrap(), want);
    assert_eq!(reg.status_text("f").unwrap(), "0 4096 flakey \n");
    for (t, want) in [
        ("0 8 flakey m 0 1 1 1 random_read_corrupt", "requires a parameter"),
        (
            "0 8 flakey m 0 1 1 2 random_write_corrupt 1000000001",
            "Invalid random corrupt argument: 1000000001",
        ),
        ("0 8 flakey m 0 1 1 2 random_read_corrupt x", "random corrupt argument"),
        (
            "0 8 flakey m 0 1 1 6 error_writes corrupt_bio_byte 1 w 0 0",
            "error_writes is incompatible with corrupt_bio_byte",
        ),
        ("0 8 flakey m 0 1 1 2 error_reads error_reads", "error_reads duplicated"),
        (
            "0 8 flakey m 0 1 1 12 error_reads drop_writes corrupt_bio_byte 1 r 0 0 random_read_corrupt 1 random_write_corrupt 1 x",
            "Invalid number of feature args",
        ),
    ] {
        let e = reg.create("bad", t).err().expect(t).report();
        assert!(e.contains(want) && e.contains("line 1"), "{t}: {e}");
    }
}

#[test]
fn dust_fails_reads_of_bad_blocks_once_enabled() {
    let reg = setup();
    reg.create("d", "0 4096 dust m 0 4096").unwrap();
    let d = reg.device("d").unwrap();
    assert_eq!(write(&*d, 4096, 5), Status::Ok);
    assert_eq!(reg.message("d", 0, &["addbadblock", "1"]).unwrap(), "");
    assert_eq!(
        read(&*d, 4096).0,
        Status::Ok,
        "bypass until enabled, as dm-dust"
    );
    reg.message("d", 0, &["enable"]).unwrap();
    assert_eq!(
        reg.status_text("d").unwrap(),
        "0 4096 dust 253:0 fail_read_on_bad_block verbose\n"
    );
    assert_eq!(read(&*d, 4096).0, Status::IoError);
    assert_eq!(read(&*d, 0).0, Status::Ok);
    assert_eq!(
        reg.message("d", 0, &["queryblock", "1"]).unwrap(),
        "dust_query_block: block 1 found in badblocklist"
    );
    assert_eq!(
        reg.message("d", 0, &["countbadblocks"]).unwrap(),
        "countbadblocks: 1 badblock(s) found"
    );
    // A write to a bad block remaps it: reads work again.
    assert_eq!(write(&*d, 4096, 6), Status::Ok);
    assert_eq!(read(&*d, 4096), (Status::Ok, vec![6; 4096]));
    // Write-fail count: the first N writes fail.
    reg.message("d", 0, &["addbadblock", "2", "2"]).unwrap();
    assert_eq!(write(&*d, 8192, 1), Status::IoError);
    assert_eq!(write(&*d, 8192, 1), Status::IoError);
    assert_eq!(write(&*d, 8192, 1), Status::Ok);
    // A bio over several blocks is split per block: only the bad one fails.
    reg.message("d", 0, &["addbadblock", "5"]).unwrap();
    let mut b = vec![0u8; 4 * 4096];
    assert_eq!(
        submit_and_wait(&*d, Op::Read, 3 * 4096, 4 * 4096, &mut b),
        Status::IoError
    );
    assert_eq!(reg.message("d", 0, &["listbadblocks"]).unwrap(), "5\n");
    assert!(reg
        .message("d", 0, &["addbadblock", "5"])
        .unwrap_err()
        .report()
        .contains("already"));
    assert!(reg
        .message("d", 0, &["addbadblock", "99999"])
        .unwrap_err()
        .report()
        .contains("out of range"));
    assert!(reg
        .message("d", 0, &["frobnicate"])
        .unwrap_err()
        .report()
        .contains("unrecognized"));
    assert_eq!(
        reg.message("d", 0, &["clearbadblocks"]).unwrap(),
        "dust_clear_badblocks: badblocks cleared"
    );
    assert_eq!(reg.table_text("d").unwrap(), "0 4096 dust 253:0 0 4096\n");
    for (t, want) in [
        ("0 8 dust m 0 1000", "power of 2"),
        ("0 8 dust m 0 256", "at least 512"),
        ("0 8 dust m 0", "expected 3"),
    ] {
        let e = reg.create("x", t).err().expect(t).report();
        assert!(e.contains(want), "{t}: {e}");
    }
}
