//! The `nbd` leaf against a scripted NBD server, for what the real peers
//! (tested in frontends/cli/tests/nbd_leaf.rs) cannot be made to do on
//! cue: an old server without OPT_GO or structured replies, a small
//! maximum block size (bios split into parts), a read-only export, a
//! request the server never answers (the request timeout reconnects and
//! resends it), and removal while the server does not answer (no hang, the
//! waiting request ends with EIO).

use blkstack_core::sync::{submit_and_wait_flags, Completion};
use blkstack_core::{submit_and_wait, Bio, BioFlags, Device, IoBuf, Op, Status};
use blkstack_drivers::nbd::proto::*;
use blkstack_drivers::NbdDevice;
use parking_lot::Mutex;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SIZE: u64 = 1 << 20;

/// How the scripted server behaves.
struct Script {
    structured: bool,
    go: bool,
    tflags: u16,
    block: Option<(u32, u32, u32)>,
    /// Leave the first request of the first connection unanswered.
    stall_first: AtomicBool,
    /// Close the first connection at its first request, then accept
    /// later ones without ever greeting them.
    hang_up_then_mute: bool,
    /// Hang up (unanswered) at every Nth request of a connection.
    hang_up_every: u32,
    /// Answer a structured READ with data for its first half only, DONE.
    short_reads: bool,
    data: Mutex<Vec<u8>>,
    connections: AtomicU32,
    /// Largest request seen.
    max_len: AtomicU32,
    flushes: AtomicU32,
}

impl Script {
    fn new(structured: bool, go: bool, tflags: u16) -> Script {
        Script {
            structured,
            go,
            tflags: TFLAG_HAS_FLAGS | tflags,
            block: None,
            stall_first: AtomicBool::new(false),
            hang_up_then_mute: false,
            hang_up_every: 0,
            short_reads: false,
            data: Mutex::new(vec![0u8; SIZE as usize]),
            connections: AtomicU32::new(0),
            max_len: AtomicU32::new(0),
            flushes: AtomicU32::new(0),
        }
    }
}

struct FakeServer {
    path: PathBuf,
    _dir: tempfile::TempDir,
    script: Arc<Script>,
}

impl FakeServer {
    fn start(script: Script) -> FakeServer {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fake.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let script = Arc::new(script);
        let s = script.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { break };
                let s = s.clone();
                std::thread::spawn(move || {
                    let _ = serve(conn, &s);
                });
            }
        });
        FakeServer {
            path,
            _dir: dir,
            script,
        }
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///e?socket={}", self.path.display())
    }
}

fn reply_option(s: &mut UnixStream, option: u32, rep: u32, payload: &[u8]) -> std::io::Result<()> {
    let mut v = Vec::new();
    encode_option_reply(&mut v, option, rep, payload);
    s.write_all(&v)
}

/// Negotiate; true when structured replies are on.
fn handshake(s: &mut UnixStream, sc: &Script) -> std::io::Result<bool> {
    let mut v = Vec::new();
    encode_greeting(&mut v, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    s.write_all(&v)?;
    let mut f = [0u8; 4];
    s.read_exact(&mut f)?;
    let mut structured = false;
    loop {
        let mut h = [0u8; OptionHeader::SIZE];
        s.read_exact(&mut h)?;
        let h = OptionHeader::parse(&h).map_err(std::io::Error::other)?;
        let mut data = vec![0u8; h.len as usize];
        s.read_exact(&mut data)?;
        match h.option {
            OPT_STRUCTURED_REPLY if sc.structured => {
                structured = true;
                reply_option(s, h.option, REP_ACK, &[])?;
            }
            OPT_GO if sc.go => {
                let mut p = Vec::new();
                encode_info_export(&mut p, SIZE, sc.tflags);
                reply_option(s, h.option, REP_INFO, &p)?;
                if let Some((min, pref, max)) = sc.block {
                    let mut p = Vec::new();
                    encode_info_block_size(&mut p, min, pref, max);
                    reply_option(s, h.option, REP_INFO, &p)?;
                }
                reply_option(s, h.option, REP_ACK, &[])?;
                return Ok(structured);
            }
            OPT_EXPORT_NAME => {
                let mut p = Vec::new();
                encode_export_name_reply(&mut p, SIZE, sc.tflags, true);
                s.write_all(&p)?;
                return Ok(false);
            }
            o => reply_option(s, o, REP_ERR_UNSUP, &[])?,
        }
    }
}

fn serve(mut s: UnixStream, sc: &Script) -> std::io::Result<()> {
    if sc.hang_up_then_mute && sc.connections.load(Ordering::SeqCst) > 0 {
        // Accepted, never greeted: the client's attempt times out.
        std::thread::sleep(Duration::from_secs(30));
        return Ok(());
    }
    let structured = handshake(&mut s, sc)?;
    let first = sc.connections.fetch_add(1, Ordering::SeqCst) == 0;
    let mut stall = first && sc.stall_first.load(Ordering::SeqCst);
    let mut served = 0u32;
    loop {
        let mut h = [0u8; Request::SIZE];
        s.read_exact(&mut h)?;
        let r = Request::parse(&h).map_err(std::io::Error::other)?;
        served += 1;
        if sc.hang_up_then_mute || served == sc.hang_up_every {
            return Ok(());
        }
        sc.max_len.fetch_max(r.len, Ordering::SeqCst);
        let range = r.offset as usize..(r.offset + r.len as u64) as usize;
        let mut out = Vec::new();
        match r.cmd {
            CMD_WRITE => {
                let mut d = vec![0u8; r.len as usize];
                s.read_exact(&mut d)?;
                sc.data.lock()[range.clone()].copy_from_slice(&d);
            }
            CMD_FLUSH => {
                sc.flushes.fetch_add(1, Ordering::SeqCst);
            }
            CMD_DISC => return Ok(()),
            _ => {}
        }
        if std::mem::take(&mut stall) {
            continue; // never answered: the client must time out
        }
        match (r.cmd, structured) {
            (CMD_READ, true) => {
                let n = if sc.short_reads { r.len / 2 } else { r.len };
                encode_data_chunk_header(&mut out, REPLY_FLAG_DONE, r.handle, r.offset, n);
                out.extend_from_slice(&sc.data.lock()[range.start..range.start + n as usize]);
            }
            (CMD_READ, false) => {
                encode_simple_reply(&mut out, 0, r.handle);
                out.extend_from_slice(&sc.data.lock()[range.clone()]);
            }
            (_, true) => encode_none_chunk(&mut out, r.handle),
            (_, false) => encode_simple_reply(&mut out, 0, r.handle),
        }
        s.write_all(&out)?;
    }
}

/// Submit a read of `buf.len()` bytes at 0 without waiting for it.
fn submit_read(dev: &NbdDevice, buf: &mut [u8]) -> Arc<Completion> {
    let done = Completion::new();
    // SAFETY: every caller waits for the completion while `buf` lives.
    let io = unsafe { IoBuf::from_slice(buf) };
    dev.submit(Bio::new(Op::Read, 0, buf.len() as u64, io, done.clone(), 0));
    done
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

fn write_read_back(dev: &NbdDevice, offset: u64, len: usize, seed: u8) {
    let mut w = pattern(len, seed);
    assert_eq!(
        submit_and_wait(&**dev, Op::Write, offset, len as u64, &mut w),
        Status::Ok
    );
    let mut r = vec![0u8; len];
    assert_eq!(
        submit_and_wait(&**dev, Op::Read, offset, len as u64, &mut r),
        Status::Ok
    );
    assert_eq!(r, w);
}

#[test]
fn old_server_simple_replies_and_export_name() {
    let srv = FakeServer::start(Script::new(false, false, TFLAG_SEND_FLUSH));
    let dev = NbdDevice::from_args(SIZE, &[&srv.uri()]).unwrap();
    assert!(!dev.export_info().structured);
    assert!(dev.status().contains("structured=no"), "{}", dev.status());
    write_read_back(&dev, 4096, 8192, 1);
    assert_eq!(
        &srv.script.data.lock()[4096..4096 + 8192],
        &pattern(8192, 1)[..]
    );
    assert_eq!(submit_and_wait(&*dev, Op::Flush, 0, 0, &mut []), Status::Ok);
    assert_eq!(srv.script.flushes.load(Ordering::SeqCst), 1);
    // PREFLUSH adds a FLUSH part to the write.
    let mut w = pattern(4096, 9);
    let st = submit_and_wait_flags(&*dev, Op::Write, BioFlags::PREFLUSH, 0, 4096, &mut w);
    assert_eq!(st, Status::Ok);
    assert_eq!(srv.script.flushes.load(Ordering::SeqCst), 2);
    assert_eq!(&srv.script.data.lock()[..4096], &w[..]);
}

#[test]
fn a_read_reply_that_leaves_bytes_uncovered_is_an_error() {
    let mut script = Script::new(true, true, 0);
    script.short_reads = true;
    let srv = FakeServer::start(script);
    let dev = NbdDevice::from_args(SIZE, &[&srv.uri()]).unwrap();
    let mut r = vec![0xa5u8; 8192];
    assert_eq!(
        submit_and_wait(&*dev, Op::Read, 0, 8192, &mut r),
        Status::IoError,
        "half a reply must not read as success"
    );
}

#[test]
fn large_bios_are_split_at_the_maximum_block_size() {
    let mut sc = Script::new(true, true, 0);
    sc.block = Some((4096, 4096, 65536));
    let srv = FakeServer::start(sc);
    let dev = NbdDevice::from_args(SIZE, &[&srv.uri()]).unwrap();
    assert_eq!(dev.logical_block_size(), 4096);
    write_read_back(&dev, 65536, 256 * 1024 + 4096, 7);
    assert_eq!(srv.script.max_len.load(Ordering::SeqCst), 65536);
    // Unaligned to the export's minimum block size: refused before sending.
    let mut b = vec![0u8; 512];
    assert_eq!(
        submit_and_wait(&*dev, Op::Read, 512, 512, &mut b),
        Status::Invalid
    );
    // No SEND_FLUSH: nothing to flush, as the kernel's nbd client; no
    // WRITE_ZEROES: written as zeroes; no TRIM: not supported.
    assert_eq!(submit_and_wait(&*dev, Op::Flush, 0, 0, &mut []), Status::Ok);
    assert_eq!(srv.script.flushes.load(Ordering::SeqCst), 0);
    assert_eq!(
        submit_and_wait(&*dev, Op::WriteZeroes, 65536, 8192, &mut []),
        Status::Ok
    );
    assert!(srv.script.data.lock()[65536..65536 + 8192]
        .iter()
        .all(|&b| b == 0));
    assert_eq!(
        submit_and_wait(&*dev, Op::Discard, 0, 4096, &mut []),
        Status::NotSupported
    );
}

#[test]
fn read_only_export_refuses_writes_with_permission() {
    let srv = FakeServer::start(Script::new(true, true, TFLAG_READ_ONLY));
    let dev = NbdDevice::from_args(SIZE, &[&srv.uri()]).unwrap();
    assert!(dev.features().read_only);
    let mut w = vec![1u8; 4096];
    assert_eq!(
        submit_and_wait(&*dev, Op::Write, 0, 4096, &mut w),
        Status::Permission
    );
    assert!(srv.script.data.lock().iter().all(|&b| b == 0));
    let mut r = vec![1u8; 4096];
    assert_eq!(
        submit_and_wait(&*dev, Op::Read, 0, 4096, &mut r),
        Status::Ok
    );
}

#[test]
fn unanswered_request_times_out_reconnects_and_is_resent() {
    let sc = Script::new(true, true, TFLAG_SEND_FLUSH | TFLAG_SEND_FUA);
    sc.stall_first.store(true, Ordering::SeqCst);
    let srv = FakeServer::start(sc);
    let args = [
        srv.uri(),
        "timeout_ms=200".into(),
        "reconnect_delay_ms=10".into(),
    ];
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let dev = NbdDevice::from_args(SIZE, &args).unwrap();
    let mut w = pattern(4096, 3);
    let st = submit_and_wait_flags(&*dev, Op::Write, BioFlags::FUA, 8192, 4096, &mut w);
    assert_eq!(st, Status::Ok);
    assert_eq!(&srv.script.data.lock()[8192..8192 + 4096], &w[..]);
    assert_eq!(srv.script.connections.load(Ordering::SeqCst), 2);
    let status = dev.status();
    assert!(status.contains("timeouts=1"), "{status}");
    assert!(status.contains("reconnects=1"), "{status}");
    assert!(status.contains("connections=1/1"), "{status}");
    assert!(
        status.contains("last_error=\"request timed out\""),
        "{status}"
    );
}

#[test]
fn removal_with_an_unresponsive_server_ends_waiting_requests_at_once() {
    let sc = Script::new(true, true, 0);
    sc.stall_first.store(true, Ordering::SeqCst);
    let srv = FakeServer::start(sc);
    let dev = NbdDevice::from_args(SIZE, &[&srv.uri(), "dead_timeout_ms=600000"]).unwrap();
    let mut buf = vec![0u8; 4096];
    let done = submit_read(&dev, &mut buf);
    std::thread::sleep(Duration::from_millis(50));
    let t = Instant::now();
    drop(dev);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "drop took {:?}",
        t.elapsed()
    );
    assert_eq!(done.wait(), Status::IoError);
}

#[test]
fn a_server_that_never_answers_fails_the_load_within_its_bound() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mute.sock");
    let listener = UnixListener::bind(&path).unwrap();
    // Accepts (the kernel does, from the backlog) but never greets.
    let uri = format!("nbd+unix:///e?socket={}", path.display());
    let t = Instant::now();
    let e = NbdDevice::from_args(SIZE, &[&uri, "timeout_ms=300"])
        .err()
        .map(|e| error_text(&e))
        .unwrap_or_default();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    assert!(e.contains("cannot reach"), "{e}");
    assert!(e.contains("did not answer in time"), "{e}");
    drop(listener);
}

/// The error and its sources, as a user is shown them.
fn error_text(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

#[test]
fn removal_during_a_reconnect_attempt_does_not_wait_for_it() {
    let mut sc = Script::new(true, true, 0);
    sc.hang_up_then_mute = true;
    let srv = FakeServer::start(sc);
    // A long dead timeout: only removal can end the request.
    let dev = NbdDevice::from_args(SIZE, &[&srv.uri(), "dead_timeout_ms=600000"]).unwrap();
    let mut buf = vec![0u8; 4096];
    let done = submit_read(&dev, &mut buf);
    // The server hangs up; the reconnect attempt now waits for a
    // greeting that never comes (its bound is the 10 s default).
    let t = Instant::now();
    while !dev.status().contains("connections=0/1") {
        assert!(t.elapsed() < Duration::from_secs(5), "{}", dev.status());
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    drop(dev);
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "drop took {:?}",
        t.elapsed()
    );
    assert_eq!(done.wait(), Status::IoError);
}

#[test]
fn repeated_hang_ups_lose_no_write_and_end_each_request_once() {
    let mut sc = Script::new(true, true, TFLAG_SEND_FLUSH);
    sc.hang_up_every = 7;
    let srv = FakeServer::start(sc);
    let dev = NbdDevice::from_args(
        SIZE,
        &[&srv.uri(), "reconnect_delay_ms=1", "queue_depth=16"],
    )
    .unwrap();
    const N: usize = 24;
    let mut failed = 0;
    for round in 0..6u8 {
        // N writes in flight at once (more than the tags: some wait).
        let mut bufs: Vec<Vec<u8>> = (0..N).map(|i| pattern(4096, round ^ i as u8)).collect();
        let dones: Vec<_> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| {
                let done = Completion::new();
                // SAFETY: each buffer lives until its completion is waited for.
                let io = unsafe { IoBuf::from_slice(b) };
                dev.submit(Bio::new(
                    Op::Write,
                    i as u64 * 8192,
                    4096,
                    io,
                    done.clone(),
                    0,
                ));
                done
            })
            .collect();
        // A request whose connection dies MAX_FAILED_SENDS times before
        // answering anything after it was sent ends with EIO (the bounded
        // resends of the leaf's failure model); at the back of 16 in
        // flight at a server that hangs up at every 7th request, one can.
        // What must hold: each ends once, and every write acknowledged is
        // stored.
        let statuses: Vec<Status> = dones.iter().map(|d| d.wait()).collect();
        let data = srv.script.data.lock();
        for (i, (b, st)) in bufs.iter().zip(&statuses).enumerate() {
            match st {
                Status::Ok => assert_eq!(
                    &data[i * 8192..i * 8192 + 4096],
                    &b[..],
                    "round {round} block {i}"
                ),
                other => {
                    assert_eq!(*other, Status::IoError, "round {round} block {i}");
                    failed += 1;
                }
            }
        }
    }
    assert!(
        failed <= N * 6 / 4,
        "{failed} of {} writes failed: hang-ups every 7th request should let most through",
        N * 6
    );
    // The device's own count of failed requests is the one seen here.
    let status = dev.status();
    assert!(status.contains("in_flight=0 "), "{status}");
    assert!(status.contains(&format!("failed={failed} ")), "{status}");
    assert!(!status.contains("reconnects=0 "), "{status}");
}

/// The device reconnected at least `min` times, and nothing is in flight
/// or failed.
fn assert_reconnected_losing_nothing(dev: &NbdDevice, min: u64) {
    let status = dev.status();
    let reconnects: u64 = status
        .split("reconnects=")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    assert!(reconnects >= min, "{status}");
    assert!(status.contains("in_flight=0 "), "{status}");
    assert!(status.contains("failed=0 "), "{status}");
}

/// Where and how a polled bio ended.
#[derive(Default)]
struct Reaped {
    end: Mutex<Option<(Status, String)>>,
}

impl blkstack_core::EndIo for Reaped {
    fn end_io(&self, _bio: Bio, status: Status, _private: u64) {
        let thread = std::thread::current().name().unwrap_or("").to_string();
        *self.end.lock() = Some((status, thread));
    }
}

/// Submit one `POLLED` bio and wait for it as a polling submitter does
/// (`Device::poll_wait`; with nothing to read, a short sleep). Returns its
/// status and the name of the thread that ended it.
fn polled_io(dev: &NbdDevice, op: Op, offset: u64, buf: &mut [u8]) -> (Status, String) {
    let r = Arc::new(Reaped::default());
    // SAFETY: we wait below until the bio has ended.
    let io = unsafe { IoBuf::from_slice(buf) };
    let bio = Bio::new(op, offset, buf.len() as u64, io, r.clone(), 0).with_flags(BioFlags::POLLED);
    dev.submit(bio);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(end) = r.end.lock().take() {
            return end;
        }
        assert!(Instant::now() < deadline, "polled bio never ended");
        if dev.poll_wait(&|| r.end.lock().is_some()) == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// `threads` submitters, each writing then reading back its own blocks
/// with polled bios; returns how many of the bios ended on a thread other
/// than a submitter (a connection's reader).
fn polled_writers(dev: &NbdDevice, threads: usize, rounds: usize) -> usize {
    std::thread::scope(|s| {
        let runs: Vec<_> = (0..threads)
            .map(|t| {
                std::thread::Builder::new()
                    .name(format!("submitter{t}"))
                    .spawn_scoped(s, move || {
                        let mut elsewhere = 0;
                        for round in 0..rounds {
                            // 16 blocks of its own per submitter.
                            let offset = (t * 16 + round % 16) as u64 * 8192;
                            let mut w = pattern(4096, (t * 31 + round) as u8);
                            let (st, by) = polled_io(dev, Op::Write, offset, &mut w);
                            assert_eq!(st, Status::Ok, "write {t}/{round}");
                            elsewhere += !by.starts_with("submitter") as usize;
                            let mut r = vec![0u8; 4096];
                            let (st, by) = polled_io(dev, Op::Read, offset, &mut r);
                            assert_eq!(st, Status::Ok, "read {t}/{round}");
                            assert!(r == w, "submitter {t} round {round}: data differs");
                            elsewhere += !by.starts_with("submitter") as usize;
                        }
                        elsewhere
                    })
                    .expect("spawn")
            })
            .collect();
        runs.into_iter().map(|h| h.join().expect("submitter")).sum()
    })
}

#[test]
fn poll_queue_replies_are_read_by_the_submitters() {
    let srv = FakeServer::start(Script::new(true, true, TFLAG_CAN_MULTI_CONN));
    let dev = NbdDevice::from_args(SIZE, &[&srv.uri(), "poll_queues=1"]).unwrap();
    assert!(dev.polls() && dev.poll_sleeps());
    assert!(dev.status().contains("connections=2/2 poll_queues=1 "));
    // One submitter: every reply is read on its own thread.
    assert_eq!(polled_writers(&dev, 1, 100), 0);
    // Several share the poll queue: whoever holds it reads for all, but
    // never the connection's thread (a poll queue has no reader).
    assert_eq!(polled_writers(&dev, 4, 100), 0);
    // Unpolled bios still take the ordinary queue and its reader.
    write_read_back(&dev, 65536, 8192, 9);
    assert!(dev.status().contains("in_flight=0 "), "{}", dev.status());
}

#[test]
fn poll_queue_reconnects_when_a_poller_finds_it_dead() {
    let mut sc = Script::new(true, true, TFLAG_CAN_MULTI_CONN);
    sc.hang_up_every = 7;
    let srv = FakeServer::start(sc);
    let dev =
        NbdDevice::from_args(SIZE, &[&srv.uri(), "poll_queues=2", "reconnect_delay_ms=1"]).unwrap();
    assert_eq!(polled_writers(&dev, 3, 40), 0);
    // 240 bios over connections hung up at every 7th request.
    assert_reconnected_losing_nothing(&dev, 20);
}

#[test]
fn no_poll_queues_without_multi_conn() {
    let srv = FakeServer::start(Script::new(true, true, 0));
    let dev = NbdDevice::from_args(SIZE, &[&srv.uri(), "poll_queues=1"]).unwrap();
    assert!(!dev.polls() && !dev.poll_sleeps());
    let status = dev.status();
    assert!(
        status.contains("connections=1/1 poll_queues=0 "),
        "{status}"
    );
    assert!(status.contains("multi_conn=no(asked_"), "{status}");
    // A polled bio on a device that does not poll ends as any other.
    let mut w = pattern(4096, 3);
    let c = submit_and_wait_flags(&*dev, Op::Write, BioFlags::POLLED, 0, 4096, &mut w);
    assert_eq!(c, Status::Ok);
}
