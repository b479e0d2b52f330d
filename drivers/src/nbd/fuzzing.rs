//! Fuzzing entry point (cargo-fuzz's `nbd_replies` target, and the stable
//! test that replays its corpus): the `nbd` leaf's reply reader fed a
//! server's whole transmission-phase byte stream.
//!
//! The leaf's peer is a remote server it cannot trust, as the kernel's
//! nbd client cannot (`recv_work` checks every cookie, length and
//! offset before touching a request's pages). Here a scripted server on a
//! socketpair accepts a fixed set of requests (reads, one split across
//! two parts, a write, a flush), then sends the fuzzer's bytes as its
//! replies and hangs up. Whatever the bytes, each request must end
//! exactly once, in bounded time, with the connection's dead timeout at
//! 0 so that a dead connection fails what it holds at once.

use super::connection::Geometry;
use super::handshake::{Connected, ExportInfo};
use super::options::NbdOptions;
use super::proto::*;
use super::wire::{self, Socket};
use super::NbdDevice;
use blkstack_core::{Bio, Device, EndIo, IoBuf, Op, Status};
use parking_lot::{Condvar, Mutex};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Size of the fuzzed export.
pub const EXPORT_BYTES: u64 = 1 << 20;
/// Largest request part the scripted server advertises: a 128 KiB read
/// is sent as two parts.
pub const MAX_PART: u32 = 64 * 1024;
/// The requests submitted before the fuzzer's replies arrive, in order:
/// (op, offset, length). With `queue_depth=4` they hold tags 0..=3, in
/// an order that rotates with the tag allocator's random first hint, so
/// a corpus names their cookies (`cookie(0, part, tag)`) though not
/// always the same request's.
pub const REQUESTS: [(Op, u64, u64); 4] = [
    (Op::Read, 0, 4096),
    (Op::Read, 65536, 128 * 1024),
    (Op::Write, 8192, 4096),
    (Op::Flush, 0, 0),
];
/// Longest any request may take to end once the server hung up.
const END_BOUND: Duration = Duration::from_secs(20);

/// Records each request's end; panics on a second one.
#[derive(Default)]
struct Ends {
    got: Mutex<Vec<Option<Status>>>,
    cv: Condvar,
}

impl EndIo for Ends {
    fn end_io(&self, _bio: Bio, status: Status, private: u64) {
        let mut g = self.got.lock();
        let slot = &mut g[private as usize];
        assert!(slot.is_none(), "request {private} ended twice");
        *slot = Some(status);
        self.cv.notify_all();
    }
}

/// A device over one end of a socketpair, as if negotiated with a
/// server that offers structured replies when `structured`.
fn device(sock: UnixStream, structured: bool) -> NbdDevice {
    let info = ExportInfo {
        size: EXPORT_BYTES,
        tflags: TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_SEND_WRITE_ZEROES,
        min_block: 512,
        preferred_block: 4096,
        max_block: MAX_PART,
        structured,
        allocation_context: structured.then_some(1),
    };
    let (sender, receiver) = wire::split(Socket::Unix(sock), None).expect("split a socketpair");
    // Reconnects go nowhere (no such socket) and fail at once.
    let opts = NbdOptions::parse(&[
        "nbd+unix:///e?socket=/nonexistent/blkstack-fuzz.sock",
        "dead_timeout_ms=0",
        "reconnect_delay_ms=1",
        "timeout_ms=5000",
        "queue_depth=4",
    ])
    .expect("fuzz options");
    let geo = Geometry {
        info,
        max_part: MAX_PART as u64,
    };
    let link = Connected {
        sender,
        receiver,
        info,
    };
    NbdDevice::start(opts, None, EXPORT_BYTES, 512, geo, vec![link], false)
        .expect("start the fuzzed device")
}

/// Feed `input` as the server's replies; the first byte's low bit picks
/// structured replies. Panics if a request ends twice or never ends (or
/// the reader panics on a bad reply). Returns each request's status.
pub fn replies(input: &[u8]) -> Vec<Status> {
    let structured = input.first().is_some_and(|b| b & 1 == 1);
    let body = input.get(1..).unwrap_or(&[]);
    let (client, mut server) = UnixStream::pair().expect("socketpair");
    let dev = device(client, structured);
    let ends = Arc::new(Ends::default());
    *ends.got.lock() = vec![None; REQUESTS.len()];
    let mut bufs: Vec<Vec<u8>> = REQUESTS
        .iter()
        .map(|&(_, _, len)| vec![0xa5u8; len as usize])
        .collect();
    for (i, (&(op, offset, len), buf)) in REQUESTS.iter().zip(bufs.iter_mut()).enumerate() {
        let io = if len > 0 {
            // SAFETY: every buffer outlives the wait for its request below
            // (or the process, when a request never ends: then we panic
            // while still holding them).
            unsafe { IoBuf::from_slice(buf) }
        } else {
            IoBuf::empty()
        };
        dev.submit(Bio::new(op, offset, len, io, ends.clone(), i as u64));
    }
    // The requests are on the wire; drain them (a blocked client would
    // otherwise never read) while the replies go the other way.
    let mut rd = server.try_clone().expect("clone");
    let drain = std::thread::spawn(move || {
        let mut sink = [0u8; 16 * 1024];
        while matches!(rd.read(&mut sink), Ok(n) if n > 0) {}
    });
    let _ = server.write_all(body);
    let _ = server.shutdown(std::net::Shutdown::Write);
    let deadline = Instant::now() + END_BOUND;
    let mut got = ends.got.lock();
    while got.iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "requests never ended: {:?}", *got);
        ends.cv.wait_for(&mut got, left);
    }
    let statuses: Vec<Status> = got.iter().map(|s| s.unwrap_or(Status::IoError)).collect();
    drop(got);
    drop(dev);
    drop(server);
    let _ = drain.join();
    statuses
}
