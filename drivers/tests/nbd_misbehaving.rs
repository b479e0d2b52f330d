//! The `nbd` leaf against servers that accept every connection and
//! handshake correctly, then misbehave in transmission: replies with
//! cookies it never sent, data outside the request, a reply that stops
//! halfway, no reply at all. Each reconnect succeeds, so only the
//! failure model bounds the request: a protocol violation kills the
//! connection, a reconnect is no progress, the dead timeout runs from the
//! first failure and a request is resent a bounded number of times; then
//! it fails with EIO, which multipath takes as a path error (kernel nbd:
//! `nbd_handle_reply` errors, `nbd_xmit_timeout`, `dead_conn_timeout`).
//! The servers are `blkstack_drivers::nbd::scripted`.

use blkstack_core::{Bio, Device, EndIo, IoBuf, Op, Status};
use blkstack_drivers::nbd::scripted::{self, Misbehaviour};
use blkstack_drivers::NbdDevice;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

const SIZE: u64 = 1 << 20;

/// A server misbehaving `how` on every connection; counts connections.
fn start(how: Misbehaviour) -> (tempfile::TempDir, String, Arc<AtomicU32>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.sock");
    let conns = scripted::spawn(&path, SIZE, how).expect("scripted server");
    let uri = format!("nbd+unix:///e?socket={}", path.display());
    (dir, uri, conns)
}

struct Sent(mpsc::Sender<Status>);

impl EndIo for Sent {
    fn end_io(&self, _bio: Bio, status: Status, _private: u64) {
        let _ = self.0.send(status);
    }
}

/// Read 4 KiB; its status and how long it took (None: not within `limit`).
fn read_within(dev: &NbdDevice, limit: Duration) -> (Option<Status>, Duration) {
    // Leaked: a request that never ends may still write into it later.
    let buf: &'static mut [u8] = Box::leak(vec![0u8; 4096].into_boxed_slice());
    let (tx, rx) = mpsc::channel();
    // SAFETY: the buffer lives for the rest of the process.
    let io = unsafe { IoBuf::from_slice(buf) };
    let t0 = Instant::now();
    dev.submit(Bio::new(Op::Read, 0, 4096, io, Arc::new(Sent(tx)), 0));
    let st = rx.recv_timeout(limit).ok();
    (st, t0.elapsed())
}

fn fails_with_eio_in_bounded_time(how: Misbehaviour) {
    let (_dir, uri, conns) = start(how);
    let dev = NbdDevice::from_args(
        SIZE,
        &[
            &uri,
            "timeout_ms=300",
            "dead_timeout_ms=3000",
            "reconnect_delay_ms=10",
        ],
    )
    .expect("handshake succeeds");
    let (st, took) = read_within(&dev, Duration::from_secs(15));
    let status = dev.status();
    drop(dev);
    assert_eq!(st, Some(Status::IoError), "{how:?}: {status}");
    assert!(took < Duration::from_secs(10), "{how:?}: took {took:?}");
    // Resent a bounded number of times, not reconnecting in a loop.
    let n = conns.load(Ordering::SeqCst);
    assert!((2..=8).contains(&n), "{how:?}: {n} connections: {status}");
}

#[test]
fn replies_with_unknown_cookies_end_in_eio() {
    fails_with_eio_in_bounded_time(Misbehaviour::UnknownCookie);
}

#[test]
fn replies_outside_the_request_end_in_eio() {
    fails_with_eio_in_bounded_time(Misbehaviour::OutsideRequest);
}

#[test]
fn a_reply_that_hangs_halfway_ends_in_eio() {
    fails_with_eio_in_bounded_time(Misbehaviour::HangMidReply);
}

#[test]
fn a_server_that_never_replies_ends_in_eio() {
    fails_with_eio_in_bounded_time(Misbehaviour::NeverReply);
}

#[test]
fn without_a_request_timeout_a_violating_server_still_ends_in_eio() {
    // No timeout_ms: the bound is the resend limit alone.
    let (_dir, uri, _conns) = start(Misbehaviour::UnknownCookie);
    let dev = NbdDevice::from_args(SIZE, &[&uri, "reconnect_delay_ms=10"]).expect("handshake");
    let (st, took) = read_within(&dev, Duration::from_secs(15));
    drop(dev);
    assert_eq!(st, Some(Status::IoError));
    assert!(took < Duration::from_secs(10), "took {took:?}");
}
