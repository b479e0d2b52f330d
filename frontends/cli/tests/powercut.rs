//! `powercut` under the real `blkstack serve`, seen by a real NBD client
//! (blkstack's own `nbd` client leaf, in this process): a cut while a
//! flush is in flight (its writeback held below by a suspended device)
//! ends that flush with EIO at once (never a hang), every later request
//! fails until `power_on`, the server stays up, and what reads back
//! afterwards is every flushed write and only written data.
//! The same over a powercut whose device is itself a remote `nbd` leg.

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Device, Op, Status};
use blkstack_mapped::Registry;
use blkstack_test_support::*;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

const SECTORS: u64 = 32768;

/// The longest any step may take.
const LIMIT: Duration = Duration::from_secs(60);

/// An NBD client of `uri` as a device of a private registry.
fn client(uri: &str) -> (Arc<Registry>, Arc<dyn Device>) {
    let reg = Registry::new();
    reg.create("c", &format!("0 {SECTORS} nbd {uri}"))
        .unwrap_or_else(|e| panic!("connect {uri}: {e:#}"));
    let dev = reg.device("c").unwrap();
    (reg, dev)
}

fn write(dev: &dyn Device, block: u64, byte: u8) -> Status {
    let mut b = vec![byte; 4096];
    submit_and_wait(dev, Op::Write, block * 4096, 4096, &mut b)
}

fn read(dev: &dyn Device, block: u64) -> (Status, Vec<u8>) {
    let mut b = vec![0xEE; 4096];
    let s = submit_and_wait(dev, Op::Read, block * 4096, 4096, &mut b);
    (s, b)
}

fn flush(dev: &dyn Device) -> Status {
    submit_and_wait(dev, Op::Flush, 0, 0, &mut [])
}

fn is(byte: u8) -> Vec<u8> {
    vec![byte; 4096]
}

#[test]
fn a_cut_under_serve_fails_io_in_flight_and_keeps_flushed_data() {
    let stack = format!("m,,,rw,0 {SECTORS} memory;p,,,rw,0 {SECTORS} powercut m");
    let srv = Serve::start(&stack, "p");
    let (_reg, c) = client(&srv.uri("p"));
    assert_eq!(write(&*c, 0, 0xa1), Status::Ok);
    assert_eq!(flush(&*c), Status::Ok);
    assert_eq!(write(&*c, 0, 0xa2), Status::Ok);
    assert_eq!(write(&*c, 1, 0xb1), Status::Ok);
    // With the device below suspended, the next flush's writeback stays
    // on its way down for as long as the test needs.
    srv.ok("suspend", &["m"]);
    let (tx, rx) = mpsc::channel();
    let c2 = c.clone();
    std::thread::spawn(move || tx.send(flush(&*c2)));
    let t0 = Instant::now();
    while !srv.ok("status", &["p"]).contains(" writeback=2 ") {
        assert!(t0.elapsed() < LIMIT, "{}", srv.ok("status", &["p"]));
        std::thread::sleep(Duration::from_millis(10));
    }
    // Cached while the flush's batch is on its way down: the cut decides.
    assert_eq!(write(&*c, 2, 0xc1), Status::Ok);
    std::thread::scope(|s| {
        let cut = s.spawn(|| srv.run("message", &["p", "0", "cut", "reorder", "7"]));
        assert_eq!(
            rx.recv_timeout(LIMIT),
            Ok(Status::IoError),
            "the flush in flight ends with EIO at the cut, before the device answers"
        );
        assert_eq!(write(&*c, 3, 0xd1), Status::IoError);
        assert_eq!(read(&*c, 0).0, Status::IoError);
        assert_eq!(flush(&*c), Status::IoError);
        // The cut waits for the batch already on its way down.
        srv.ok("resume", &["m"]);
        let out = cut.join().unwrap();
        assert!(out.status.success(), "{}{}", out.stdout, out.stderr);
        assert!(
            out.stdout.contains("cut reorder 7: kept "),
            "{}",
            out.stdout
        );
    });
    let st = srv.ok("status", &["p"]);
    assert!(
        st.contains(" powercut off ") && st.contains(" cuts=1 "),
        "{st}"
    );
    srv.ok("message", &["p", "0", "power_on"]);
    assert_eq!(read(&*c, 0), (Status::Ok, is(0xa2)), "the batch landed");
    assert_eq!(read(&*c, 1).1, is(0xb1));
    let b2 = read(&*c, 2).1;
    assert!(b2 == is(0xc1) || b2 == is(0), "block 2: written data only");
    assert_eq!(
        read(&*c, 3).1,
        is(0),
        "a write refused while off never lands"
    );
    assert_eq!(write(&*c, 3, 0xd2), Status::Ok, "powered on again");
    assert_eq!(read(&*c, 3).1, is(0xd2));
}

#[test]
fn a_powercut_over_a_remote_nbd_leg() {
    let remote = Serve::start(&format!("m,,,rw,0 {SECTORS} memory"), "m");
    let stack = format!(
        "n,,,rw,0 {SECTORS} nbd {};p,,,rw,0 {SECTORS} powercut n",
        remote.uri("m")
    );
    let srv = Serve::start(&stack, "p");
    let (_reg, c) = client(&srv.uri("p"));
    assert_eq!(write(&*c, 0, 0x11), Status::Ok);
    assert_eq!(flush(&*c), Status::Ok);
    assert_eq!(write(&*c, 0, 0x12), Status::Ok);
    assert_eq!(write(&*c, 1, 0x21), Status::Ok);
    assert_eq!(read(&*c, 1).1, is(0x21), "read-your-writes over the leg");
    let said = srv.ok("message", &["p", "0", "cut", "drop"]);
    assert_eq!(said.trim(), "cut drop: kept 0 of 2 cached writes (0 torn)");
    assert_eq!(read(&*c, 0).0, Status::IoError);
    srv.ok("message", &["p", "0", "power_on"]);
    assert_eq!(read(&*c, 0).1, is(0x11), "flushed: kept");
    assert_eq!(read(&*c, 1).1, is(0), "unflushed: lost");
    // The remote export itself holds exactly that.
    let (_r, direct) = client(&remote.uri("m"));
    assert_eq!(read(&*direct, 0).1, is(0x11));
    assert_eq!(read(&*direct, 1).1, is(0));
}
