//! Fuzzing entry point (cargo-fuzz's `nbd_server` target, and the stable
//! regression test that replays its corpus): one client byte stream
//! through the real handshake and transmission state machine, in process,
//! over a socketpair, against a small RAM device.
//!
//! It follows how nbd-server and nbdkit are fuzzed upstream (nbdkit's
//! `fuzzing/` drives the server with a raw byte stream on a socket): the
//! bytes are the whole client side, so option haggling, request headers,
//! write payloads and disconnects are all in the fuzzer's hands. No TLS:
//! the rustls handshake is fuzzed by rustls itself.

use crate::client::RawClient;
use crate::conn;
use crate::export::Export;
use crate::limits::Limits;
use crate::proto::*;
use crate::sock::Sock;
use crate::tls::TlsPolicy;
use blkstack_core::timing::spin::PollSetting;
use blkstack_core::DeviceRef;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

/// Size of the fuzzed device: 4 MiB, as in the recorded sessions.
pub const DEVICE_BYTES: u64 = 4 << 20;
/// The server's replies kept for the caller; the rest is read and dropped.
const KEEP_OUTPUT: usize = 1 << 20;

/// Feed `input` to a fresh server connection as the client's whole byte
/// stream, then close the client's write side and read every reply until
/// the server hangs up. Panics if the server panics, never ends, or
/// leaves the device in a state a well-behaved client cannot use (its
/// size changed, or a write then read of the same block disagrees).
/// Returns the first MiB the server sent.
pub fn handshake_and_transmission(input: &[u8]) -> Vec<u8> {
    let reg = blkstack_mapped::Registry::new();
    let dev = fuzz_device(&reg);
    let exports = vec![
        Export::new("d0", dev.clone(), false),
        Export::new("ro", dev.clone(), true),
    ];
    let out = session(&exports, |mut client| {
        let feed = input.to_vec();
        let mut writer = client.try_clone().expect("socketpair dup");
        let w = std::thread::spawn(move || {
            // The server may hang up early: the rest is simply not sent.
            let _ = writer.write_all(&feed);
            let _ = writer.shutdown(std::net::Shutdown::Write);
        });
        let mut kept = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match client.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let room = KEEP_OUTPUT.saturating_sub(kept.len());
                    kept.extend_from_slice(&buf[..n.min(room)]);
                }
            }
        }
        w.join().expect("fuzz client writer");
        kept
    });
    assert_eq!(
        dev.size(),
        DEVICE_BYTES,
        "the session changed the device size"
    );
    check_device_usable(&exports);
    reg.remove_all();
    out
}

/// The device the fuzzed session talks to: a sparse RAM device created
/// through the table language, as `blkstack serve` creates its devices.
fn fuzz_device(reg: &blkstack_mapped::Registry) -> DeviceRef {
    let table = format!("0 {} memory", DEVICE_BYTES / 512);
    reg.create("d0", &table).expect("fuzz device table");
    reg.device("d0").expect("fuzz device")
}

/// Run `conn::serve` on one end of a socketpair and `client` on the
/// other; panics (re-raising the server's panic) if the server fails.
fn session<T>(exports: &[Export], client: impl FnOnce(UnixStream) -> T) -> T {
    let (server_end, client_end) = UnixStream::pair().expect("socketpair");
    client_end
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("client read timeout");
    let sock = Arc::new(Sock::new(OwnedFd::from(server_end)));
    let limits = Limits {
        handshake_deadline: Duration::from_secs(10),
        ..Limits::default()
    };
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            // An I/O error here is the client's doing (it hung up).
            let _ = conn::serve(
                sock,
                exports,
                PollSetting::Off,
                &limits,
                &TlsPolicy::default(),
                None,
            );
        });
        let r = client(client_end);
        server.join().expect("nbd server thread panicked");
        r
    })
}

/// A well-behaved client, after the fuzzed one: NBD_OPT_GO, a write and a
/// read of the same block, disconnect. Both must succeed and agree.
fn check_device_usable(exports: &[Export]) {
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    let offset = DEVICE_BYTES - 4096;
    session(exports, |s| {
        let mut c = RawClient::new(s);
        c.start().expect("greeting");
        let (size, _) = c.go("d0").expect("NBD_OPT_GO after a fuzzed session");
        assert_eq!(size, DEVICE_BYTES, "export size after a fuzzed session");
        let w = Request {
            flags: 0,
            cmd: CMD_WRITE,
            handle: 1,
            offset,
            len: 4096,
        };
        c.request(&w, &pattern).expect("send WRITE");
        let r = c.simple_reply().expect("WRITE reply");
        assert_eq!((r.handle, r.error), (1, 0), "WRITE after a fuzzed session");
        let rd = Request {
            cmd: CMD_READ,
            handle: 2,
            ..w
        };
        c.request(&rd, &[]).expect("send READ");
        let r = c.simple_reply().expect("READ reply");
        assert_eq!((r.handle, r.error), (2, 0), "READ after a fuzzed session");
        let mut back = vec![0u8; 4096];
        c.s.read_exact(&mut back).expect("READ data");
        assert!(back == pattern, "READ returned other data than written");
        let d = Request {
            cmd: CMD_DISC,
            handle: 3,
            len: 0,
            ..w
        };
        c.request(&d, &[]).expect("send DISC");
    });
}
