//! Protocol tests of the server against a small in-test device, driven by
//! the raw client: handshake options, every command, every refusal, replies
//! out of order, misbehaving clients next to well-behaved ones, and the
//! graceful stop. The real clients (fio, qemu, libnbd) are exercised by the
//! interop tests in frontends/cli/tests/.

use crate::client::{RawClient, Reply};
use crate::proto::*;
use crate::server::{ServeSummary, Server, Stopper};
use crate::{Export, ListenUri};
use blkstack_core::device::{check_bio, Extent};
use blkstack_core::timing::spin::PollSetting;
use blkstack_core::{Bio, Device, Features, Op, Status};
use parking_lot::Mutex;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

mod comp_batch;
mod concurrent_flush;

const BLOCK: u64 = 4096;

/// A RAM device: all-zero 4 KiB blocks are reported as holes; bios whose
/// offset is `slow_offset` complete 300 ms later on another thread.
struct VecDev {
    data: Mutex<Vec<u8>>,
    feats: Features,
    slow_offset: Option<u64>,
    /// Every bio completes 2 s late on another thread.
    slow_all: bool,
    /// Bios submitted and not yet completed, and the most ever seen.
    outstanding: Arc<AtomicU64>,
    max_outstanding: Arc<AtomicU64>,
    flushes: AtomicU64,
    max_io: u64,
    ops: Mutex<Vec<(Op, u64, u64)>>,
}

impl VecDev {
    fn new(size: usize) -> Arc<VecDev> {
        Arc::new(VecDev {
            data: Mutex::new(vec![0u8; size]),
            feats: Features {
                discard: true,
                write_zeroes: true,
                fast_zero: false,
                knows_holes: true,
                ..Features::default()
            },
            slow_offset: None,
            slow_all: false,
            outstanding: Arc::default(),
            max_outstanding: Arc::default(),
            flushes: AtomicU64::new(0),
            max_io: 32 << 20,
            ops: Mutex::new(Vec::new()),
        })
    }

    fn with(size: usize, f: impl FnOnce(&mut VecDev)) -> Arc<VecDev> {
        let mut d = Arc::into_inner(VecDev::new(size)).expect("fresh Arc");
        f(&mut d);
        Arc::new(d)
    }
}

impl Device for VecDev {
    fn submit(&self, bio: Bio) {
        if let Err(s) = check_bio(self, &bio) {
            bio.complete(s);
            return;
        }
        self.ops.lock().push((bio.op, bio.offset, bio.len));
        if self.slow_all {
            let now = self.outstanding.fetch_add(1, Ordering::SeqCst) + 1;
            self.max_outstanding.fetch_max(now, Ordering::SeqCst);
        }
        {
            let mut d = self.data.lock();
            let r = bio.offset as usize..(bio.offset + bio.len) as usize;
            match bio.op {
                Op::Read => bio.data_mut().copy_from_slice(&d[r]),
                Op::Write => d[r].copy_from_slice(bio.data()),
                Op::Discard | Op::WriteZeroes => d[r].fill(0),
                Op::Flush => {
                    self.flushes.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if self.slow_all {
            let outstanding = self.outstanding.clone();
            std::thread::spawn(move || {
                // Long enough for the server to submit everything it may.
                std::thread::sleep(Duration::from_millis(2000));
                outstanding.fetch_sub(1, Ordering::SeqCst);
                bio.complete(Status::Ok);
            });
        } else if self.slow_offset == Some(bio.offset) && bio.op != Op::Flush {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                bio.complete(Status::Ok);
            });
        } else {
            bio.complete(Status::Ok);
        }
    }
    fn size(&self) -> u64 {
        self.data.lock().len() as u64
    }
    fn max_io_bytes(&self) -> u64 {
        self.max_io
    }
    fn features(&self) -> Features {
        self.feats
    }
    fn extents(&self, offset: u64, len: u64) -> Option<Vec<Extent>> {
        let d = self.data.lock();
        let mut v: Vec<Extent> = Vec::new();
        let mut off = offset - offset % BLOCK;
        while off < offset + len {
            let end = (off + BLOCK).min(d.len() as u64);
            let hole = d[off as usize..end as usize].iter().all(|&b| b == 0);
            match v.last_mut() {
                Some(l) if l.hole == hole => l.len += end - off,
                _ => v.push(Extent {
                    offset: off,
                    len: end - off,
                    hole,
                }),
            }
            off = end;
        }
        Some(v)
    }
}

struct Running {
    _dir: tempfile::TempDir,
    path: PathBuf,
    stopper: Stopper,
    thread: Option<JoinHandle<std::io::Result<ServeSummary>>>,
}

impl Running {
    fn connect(&self) -> RawClient<UnixStream> {
        let s = UnixStream::connect(&self.path).expect("connect to test server");
        // Every wait in these tests is bounded.
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        RawClient::new(s)
    }

    fn client(&self, export: &str, structured: bool) -> (RawClient<UnixStream>, u64, u16) {
        let mut c = self.connect();
        c.start().expect("greeting");
        if structured {
            c.structured().expect("structured replies");
        }
        let (size, flags) = c.go(export).expect("NBD_OPT_GO");
        (c, size, flags)
    }

    fn stop(mut self) -> ServeSummary {
        self.stopper.stop();
        self.thread
            .take()
            .expect("running")
            .join()
            .expect("server thread")
            .expect("server run")
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stopper.stop();
            let _ = t.join();
        }
    }
}

fn serve(exports: Vec<Export>) -> Running {
    serve_with_poll(exports, crate::server::DEFAULT_POLL)
}

/// [`serve`] with the readers polling as `poll` says.
fn serve_with_poll(exports: Vec<Export>, poll: PollSetting) -> Running {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("nbd.sock");
    let mut server = Server::bind(exports, &[ListenUri::Unix(path.clone())]).expect("bind");
    server.set_poll(poll);
    let stopper = server.stopper();
    let thread = Some(std::thread::spawn(move || server.run()));
    Running {
        _dir: dir,
        path,
        stopper,
        thread,
    }
}

fn req(cmd: u16, flags: u16, handle: u64, offset: u64, len: u32) -> Request {
    Request {
        flags,
        cmd,
        handle,
        offset,
        len,
    }
}

fn read_simple(c: &mut RawClient<UnixStream>, handle: u64, off: u64, len: usize) -> Vec<u8> {
    c.request(&req(CMD_READ, 0, handle, off, len as u32), &[])
        .expect("send read");
    let r = c.simple_reply().expect("read reply");
    assert_eq!((r.handle, r.error), (handle, 0));
    let mut b = vec![0u8; len];
    std::io::Read::read_exact(&mut c.s, &mut b).expect("read data");
    b
}

#[test]
fn handshake_infos_list_and_unknown_options() {
    let dev = VecDev::new(1 << 20);
    let run = serve(vec![
        Export::new("a", dev.clone(), false),
        Export::new("b", dev.clone(), true),
    ]);
    let mut c = run.connect();
    let hs = c.greeting().unwrap();
    assert_eq!(hs, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    c.client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
        .unwrap();

    // Unknown option: ERR_UNSUP, and the session goes on.
    c.option(200, b"whatever").unwrap();
    let (r, _) = c.option_reply().unwrap();
    assert_eq!((r.option, r.rep), (200, REP_ERR_UNSUP));

    // LIST names every export.
    c.option(OPT_LIST, &[]).unwrap();
    let names: Vec<String> = c
        .option_replies()
        .unwrap()
        .into_iter()
        .filter(|(r, _)| r.rep == REP_SERVER)
        .map(|(_, p)| {
            let n = u32::from_be_bytes(p[..4].try_into().unwrap()) as usize;
            String::from_utf8(p[4..4 + n].to_vec()).unwrap()
        })
        .collect();
    assert_eq!(names, ["a", "b"]);
    // LIST with data is invalid.
    c.option(OPT_LIST, b"x").unwrap();
    assert_eq!(c.option_reply().unwrap().0.rep, REP_ERR_INVALID);

    // INFO on b: export, name, description, block size.
    let mut d = Vec::new();
    GoRequest {
        name: "b".into(),
        infos: vec![INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE],
    }
    .encode(&mut d);
    c.option(OPT_INFO, &d).unwrap();
    let replies = c.option_replies().unwrap();
    let infos: Vec<u16> = replies
        .iter()
        .filter(|(r, _)| r.rep == REP_INFO)
        .map(|(_, p)| u16::from_be_bytes([p[0], p[1]]))
        .collect();
    assert_eq!(
        infos,
        [INFO_EXPORT, INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]
    );
    let exp = &replies[0].1;
    assert_eq!(u64::from_be_bytes(exp[2..10].try_into().unwrap()), 1 << 20);
    let tflags = u16::from_be_bytes([exp[10], exp[11]]);
    assert_ne!(tflags & TFLAG_READ_ONLY, 0);
    let bs = &replies[3].1;
    let min = u32::from_be_bytes(bs[2..6].try_into().unwrap());
    let pref = u32::from_be_bytes(bs[6..10].try_into().unwrap());
    let max = u32::from_be_bytes(bs[10..14].try_into().unwrap());
    assert_eq!((min, pref, max), (512, 4096, 32 << 20));
    assert_eq!(replies.last().unwrap().0.rep, REP_ACK);

    // Unknown export: ERR_UNKNOWN, not a disconnect.
    let mut d = Vec::new();
    GoRequest {
        name: "nope".into(),
        infos: vec![],
    }
    .encode(&mut d);
    c.option(OPT_GO, &d).unwrap();
    assert_eq!(c.option_reply().unwrap().0.rep, REP_ERR_UNKNOWN);
    // Malformed GO data: ERR_INVALID.
    c.option(OPT_GO, &[0, 0, 0, 9, b'a']).unwrap();
    assert_eq!(c.option_reply().unwrap().0.rep, REP_ERR_INVALID);
    // Meta contexts before structured replies: invalid.
    let mut d = Vec::new();
    MetaRequest {
        export: "a".into(),
        queries: vec![],
    }
    .encode(&mut d);
    c.option(OPT_LIST_META_CONTEXT, &d).unwrap();
    assert_eq!(c.option_reply().unwrap().0.rep, REP_ERR_INVALID);

    // ABORT is acknowledged.
    c.option(OPT_ABORT, &[]).unwrap();
    assert_eq!(c.option_reply().unwrap().0.rep, REP_ACK);
    run.stop();
}

#[test]
fn export_name_with_and_without_zeroes() {
    let dev = VecDev::new(1 << 20);
    let run = serve(vec![Export::new("a", dev, false)]);
    for no_zeroes in [true, false] {
        let mut c = run.connect();
        c.greeting().unwrap();
        let f = FLAG_C_FIXED_NEWSTYLE | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 };
        c.client_flags(f).unwrap();
        // The empty name is the default (first) export.
        c.option(OPT_EXPORT_NAME, b"").unwrap();
        let mut b = vec![0u8; if no_zeroes { 10 } else { 134 }];
        std::io::Read::read_exact(&mut c.s, &mut b).unwrap();
        assert_eq!(u64::from_be_bytes(b[..8].try_into().unwrap()), 1 << 20);
        // Straight into transmission: a read works.
        assert_eq!(read_simple(&mut c, 1, 0, 512), vec![0u8; 512]);
    }
    run.stop();
}

#[test]
fn write_read_flush_trim_zero_round_trip() {
    let dev = VecDev::new(1 << 20);
    let run = serve(vec![Export::new("a", dev.clone(), false)]);
    let (mut c, size, flags) = run.client("a", false);
    assert_eq!(size, 1 << 20);
    for f in [
        TFLAG_HAS_FLAGS,
        TFLAG_SEND_FLUSH,
        TFLAG_SEND_FUA,
        TFLAG_SEND_TRIM,
        TFLAG_SEND_WRITE_ZEROES,
        TFLAG_SEND_FAST_ZERO,
        TFLAG_CAN_MULTI_CONN,
        TFLAG_SEND_CACHE,
    ] {
        assert_ne!(flags & f, 0, "flag {f:#x} missing from {flags:#x}");
    }
    assert_eq!(flags & (TFLAG_READ_ONLY | TFLAG_SEND_DF), 0);

    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();
    c.request(&req(CMD_WRITE, CMD_FLAG_FUA, 10, 4096, 8192), &data)
        .unwrap();
    assert_eq!(c.status_reply().unwrap(), (10, 0));
    assert_eq!(read_simple(&mut c, 11, 4096, 8192), data);
    c.request(&req(CMD_FLUSH, 0, 12, 0, 0), &[]).unwrap();
    assert_eq!(c.status_reply().unwrap(), (12, 0));
    assert_eq!(dev.flushes.load(Ordering::Relaxed), 1);
    c.request(&req(CMD_TRIM, 0, 13, 4096, 4096), &[]).unwrap();
    assert_eq!(c.status_reply().unwrap(), (13, 0));
    c.request(
        &req(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 14, 8192, 4096),
        &[],
    )
    .unwrap();
    assert_eq!(c.status_reply().unwrap(), (14, 0));
    assert_eq!(read_simple(&mut c, 15, 4096, 8192), vec![0u8; 8192]);
    // This device's zeroing is not fast: FAST_ZERO is refused at once.
    c.request(&req(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 16, 0, 4096), &[])
        .unwrap();
    assert_eq!(c.status_reply().unwrap(), (16, ENOTSUP));
    c.request(&req(CMD_CACHE, 0, 17, 0, 4096), &[]).unwrap();
    assert_eq!(c.status_reply().unwrap(), (17, 0));
    c.request(&req(CMD_DISC, 0, 18, 0, 0), &[]).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(
        std::io::Read::read(&mut c.s, &mut b).unwrap(),
        0,
        "closed after DISC"
    );
    run.stop();
}

#[test]
fn large_write_zeroes_is_split_at_the_device_limit() {
    let dev = VecDev::with(1 << 20, |d| d.max_io = 64 << 10);
    dev.data.lock().fill(0xee);
    let run = serve(vec![Export::new("a", dev.clone(), false)]);
    let (mut c, _, _) = run.client("a", false);
    c.request(&req(CMD_WRITE_ZEROES, 0, 1, 0, 1 << 20), &[])
        .unwrap();
    assert_eq!(c.status_reply().unwrap(), (1, 0));
    assert!(dev.data.lock().iter().all(|&b| b == 0));
    let pieces = dev
        .ops
        .lock()
        .iter()
        .filter(|(op, _, _)| *op == Op::WriteZeroes)
        .count();
    assert_eq!(pieces, 16);
    // And a READ above the limit is refused with EINVAL (the protocol
    // keeps EOVERFLOW for DF reads that would need fragmenting).
    c.request(&req(CMD_READ, 0, 2, 0, 128 << 10), &[]).unwrap();
    assert_eq!(c.status_reply().unwrap(), (2, EINVAL));
    run.stop();
}

#[test]
fn bad_requests_get_errors_and_the_stream_stays_in_sync() {
    let dev = VecDev::new(1 << 20);
    let run = serve(vec![
        Export::new("rw", dev.clone(), false),
        Export::new("ro", dev.clone(), true),
    ]);
    let (mut c, _, _) = run.client("rw", false);
    let cases = [
        (req(CMD_READ, 0, 1, 1 << 20, 512), EINVAL), // past the end
        (req(CMD_READ, 0, 2, u64::MAX - 100, 512), EINVAL), // offset overflow
        (req(CMD_READ, 0, 3, 100, 512), EINVAL),     // misaligned offset
        (req(CMD_READ, 0, 4, 0, 100), EINVAL),       // misaligned length
        (req(CMD_READ, 0, 5, 0, 0), EINVAL),         // empty
        (req(CMD_READ, 0, 6, 0, 64 << 20), EINVAL),  // too big
        (req(99, 0, 7, 0, 512), EINVAL),             // unknown command
        (req(CMD_READ, 1 << 9, 8, 0, 512), EINVAL),  // unknown flag
        (req(CMD_READ, CMD_FLAG_DF, 9, 0, 512), EINVAL), // DF without structured
        (req(CMD_BLOCK_STATUS, 0, 10, 0, 512), EINVAL), // no meta context
        (req(CMD_TRIM, 0, 11, 1 << 20, 512), ENOSPC), // trim past the end
    ];
    for (r, err) in cases {
        c.request(&r, &[]).unwrap();
        assert_eq!(c.status_reply().unwrap(), (r.handle, err), "{r:?}");
    }
    // A WRITE that is refused still has its payload consumed.
    c.request(&req(CMD_WRITE, 0, 20, 1 << 20, 4096), &[7u8; 4096])
        .unwrap();
    assert_eq!(c.status_reply().unwrap(), (20, ENOSPC));
    assert_eq!(read_simple(&mut c, 21, 0, 512), vec![0u8; 512]);

    let (mut r, _, flags) = run.client("ro", false);
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    r.request(&req(CMD_WRITE, 0, 30, 0, 4096), &[7u8; 4096])
        .unwrap();
    assert_eq!(r.status_reply().unwrap(), (30, EPERM));
    r.request(&req(CMD_WRITE_ZEROES, 0, 31, 0, 4096), &[])
        .unwrap();
    assert_eq!(r.status_reply().unwrap(), (31, EPERM));
    r.request(&req(CMD_TRIM, 0, 32, 0, 4096), &[]).unwrap();
    assert_eq!(r.status_reply().unwrap(), (32, EPERM));
    assert_eq!(read_simple(&mut r, 33, 0, 512), vec![0u8; 512]);
    assert!(dev.data.lock().iter().all(|&b| b == 0), "nothing written");

    // A garbage request header hangs up this client only.
    assert_eq!(read_simple(&mut c, 40, 0, 512), vec![0u8; 512]);
    std::io::Write::write_all(&mut c.s, &[0xffu8; 28]).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(std::io::Read::read(&mut c.s, &mut b).unwrap_or(0), 0);
    assert_eq!(read_simple(&mut r, 41, 0, 512), vec![0u8; 512]);
    run.stop();
}

#[test]
fn structured_reads_use_holes_and_errors_chunks() {
    let dev = VecDev::new(1 << 20);
    dev.data.lock()[8192..12288].fill(0x5a);
    let run = serve(vec![Export::new("a", dev.clone(), false)]);
    let (mut c, _, flags) = run.client("a", true);
    assert_ne!(flags & TFLAG_SEND_DF, 0);
    c.request(&req(CMD_READ, 0, 1, 0, 16384), &[]).unwrap();
    let mut chunks = Vec::new();
    loop {
        match c.any_reply().unwrap() {
            Reply::Chunk(h, p) => {
                let done = h.flags & REPLY_FLAG_DONE != 0;
                chunks.push((h.typ, p));
                if done {
                    break;
                }
            }
            Reply::Simple(_) => panic!("simple reply to a structured READ"),
        }
    }
    let kinds: Vec<u16> = chunks.iter().map(|c| c.0).collect();
    assert_eq!(
        kinds,
        [
            REPLY_TYPE_OFFSET_HOLE,
            REPLY_TYPE_OFFSET_DATA,
            REPLY_TYPE_OFFSET_HOLE
        ]
    );
    let hole0 = &chunks[0].1;
    assert_eq!(u64::from_be_bytes(hole0[..8].try_into().unwrap()), 0);
    assert_eq!(u32::from_be_bytes(hole0[8..12].try_into().unwrap()), 8192);
    let data = &chunks[1].1;
    assert_eq!(u64::from_be_bytes(data[..8].try_into().unwrap()), 8192);
    assert!(data[8..].iter().all(|&b| b == 0x5a) && data.len() == 8 + 4096);

    // DF: one data chunk with the zeroes spelled out.
    c.request(&req(CMD_READ, CMD_FLAG_DF, 2, 0, 16384), &[])
        .unwrap();
    match c.any_reply().unwrap() {
        Reply::Chunk(h, p) => {
            assert_eq!(h.typ, REPLY_TYPE_OFFSET_DATA);
            assert_ne!(h.flags & REPLY_FLAG_DONE, 0);
            assert_eq!(p.len(), 8 + 16384);
        }
        r => panic!("unexpected {r:?}"),
    }
    // Errors come as ERROR chunks with a message.
    c.request(&req(CMD_READ, 0, 3, 1 << 20, 512), &[]).unwrap();
    match c.any_reply().unwrap() {
        Reply::Chunk(h, p) => {
            assert_eq!((h.typ, h.handle), (REPLY_TYPE_ERROR, 3));
            assert_eq!(u32::from_be_bytes(p[..4].try_into().unwrap()), EINVAL);
            let n = u16::from_be_bytes([p[4], p[5]]) as usize;
            assert!(n > 0 && p.len() == 6 + n);
        }
        r => panic!("unexpected {r:?}"),
    }
    run.stop();
}

#[test]
fn base_allocation_block_status() {
    let dev = VecDev::new(1 << 20);
    dev.data.lock()[4096..8192].fill(1);
    let run = serve(vec![Export::new("a", dev.clone(), false)]);
    let mut c = run.connect();
    c.start().unwrap();
    c.structured().unwrap();
    let mut d = Vec::new();
    MetaRequest {
        export: "a".into(),
        queries: vec![],
    }
    .encode(&mut d);
    c.option(OPT_LIST_META_CONTEXT, &d).unwrap();
    let l = c.option_replies().unwrap();
    assert_eq!(l.len(), 2);
    assert_eq!(&l[0].1[4..], BASE_ALLOCATION.as_bytes());
    let mut d = Vec::new();
    MetaRequest {
        export: "a".into(),
        queries: vec![BASE_ALLOCATION.into(), "x-other:thing".into()],
    }
    .encode(&mut d);
    c.option(OPT_SET_META_CONTEXT, &d).unwrap();
    let s = c.option_replies().unwrap();
    assert_eq!(s.len(), 2);
    assert_eq!(s[0].0.rep, REP_META_CONTEXT);
    let id = u32::from_be_bytes(s[0].1[..4].try_into().unwrap());
    c.go("a").unwrap();
    c.request(&req(CMD_BLOCK_STATUS, 0, 5, 0, 16384), &[])
        .unwrap();
    let Reply::Chunk(h, p) = c.any_reply().unwrap() else {
        panic!("block status needs a structured reply")
    };
    assert_eq!(
        (h.typ, h.flags & REPLY_FLAG_DONE),
        (REPLY_TYPE_BLOCK_STATUS, REPLY_FLAG_DONE)
    );
    assert_eq!(u32::from_be_bytes(p[..4].try_into().unwrap()), id);
    let desc: Vec<(u32, u32)> = p[4..]
        .chunks(8)
        .map(|d| {
            (
                u32::from_be_bytes(d[..4].try_into().unwrap()),
                u32::from_be_bytes(d[4..].try_into().unwrap()),
            )
        })
        .collect();
    assert_eq!(
        desc,
        [
            (4096, STATE_HOLE | STATE_ZERO),
            (4096, 0),
            (8192, STATE_HOLE | STATE_ZERO)
        ]
    );
    c.request(&req(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 6, 0, 16384), &[])
        .unwrap();
    let Reply::Chunk(_, p) = c.any_reply().unwrap() else {
        panic!("block status needs a structured reply")
    };
    assert_eq!(p.len(), 4 + 8);
    run.stop();
}

#[test]
fn replies_come_back_out_of_order() {
    let dev = VecDev::with(1 << 20, |d| d.slow_offset = Some(0));
    let run = serve(vec![Export::new("a", dev, false)]);
    let (mut c, _, _) = run.client("a", false);
    c.request(&req(CMD_READ, 0, 1, 0, 512), &[]).unwrap();
    c.request(&req(CMD_READ, 0, 2, 4096, 512), &[]).unwrap();
    let first = c.simple_reply().unwrap();
    assert_eq!(first.handle, 2, "the fast request is answered first");
    let mut b = [0u8; 512];
    std::io::Read::read_exact(&mut c.s, &mut b).unwrap();
    assert_eq!(c.simple_reply().unwrap().handle, 1);
    run.stop();
}

#[test]
fn malformed_handshakes_do_not_disturb_other_clients() {
    let dev = VecDev::new(1 << 20);
    let run = serve(vec![Export::new("a", dev, false)]);
    let (mut good, _, _) = run.client("a", false);

    // Unknown client flags: dropped.
    let mut c = run.connect();
    c.greeting().unwrap();
    c.client_flags(0x80).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(std::io::Read::read(&mut c.s, &mut b).unwrap_or(0), 0);
    // Bad option magic: dropped.
    let mut c = run.connect();
    c.start().unwrap();
    std::io::Write::write_all(&mut c.s, &[0x55u8; 16]).unwrap();
    assert_eq!(std::io::Read::read(&mut c.s, &mut b).unwrap_or(0), 0);
    // Absurd option length: dropped without reading gigabytes.
    let mut c = run.connect();
    c.start().unwrap();
    let mut v = Vec::new();
    OptionHeader {
        option: OPT_GO,
        len: u32::MAX,
    }
    .encode(&mut v);
    std::io::Write::write_all(&mut c.s, &v).unwrap();
    assert_eq!(std::io::Read::read(&mut c.s, &mut b).unwrap_or(0), 0);
    // Unknown export via EXPORT_NAME: dropped.
    let mut c = run.connect();
    c.start().unwrap();
    c.option(OPT_EXPORT_NAME, b"missing").unwrap();
    assert_eq!(std::io::Read::read(&mut c.s, &mut b).unwrap_or(0), 0);
    // Half a greeting, then gone.
    drop(run.connect());

    assert_eq!(read_simple(&mut good, 1, 0, 512), vec![0u8; 512]);
    let (mut again, _, _) = run.client("a", false);
    assert_eq!(read_simple(&mut again, 2, 0, 512), vec![0u8; 512]);
    run.stop();
}

#[test]
fn graceful_stop_answers_in_flight_requests_then_flushes() {
    let dev = VecDev::with(1 << 20, |d| d.slow_offset = Some(0));
    let run = serve(vec![Export::new("a", dev.clone(), false)]);
    let (mut c, _, _) = run.client("a", false);
    c.request(&req(CMD_WRITE, 0, 1, 0, 4096), &[9u8; 4096])
        .unwrap();
    // Stop only once the request has reached the device (bounded wait).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while dev.ops.lock().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "write never reached the device"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let path = run.path.clone();
    let summary = run.stop();
    assert_eq!(summary.connections, 1);
    assert_eq!(
        c.status_reply().unwrap(),
        (1, 0),
        "in-flight write answered"
    );
    assert!(
        dev.flushes.load(Ordering::Relaxed) >= 1,
        "device flushed on stop"
    );
    assert!(!path.exists(), "socket file removed");
    assert!(dev.data.lock()[..4096].iter().all(|&b| b == 9));
}

#[test]
fn data_in_flight_per_connection_is_bounded() {
    const BIG: u32 = 32 << 20;
    let dev = VecDev::with(6 * BIG as usize, |d| d.slow_all = true);
    let run = serve(vec![Export::new("a", dev.clone(), false)]);
    let (mut c, _, _) = run.client("a", false);
    for i in 0..6u64 {
        c.request(&req(CMD_READ, 0, i, i * BIG as u64, BIG), &[])
            .unwrap();
    }
    let mut buf = vec![0u8; BIG as usize];
    for _ in 0..6 {
        let r = c.simple_reply().unwrap();
        assert_eq!(r.error, 0);
        std::io::Read::read_exact(&mut c.s, &mut buf).unwrap();
    }
    // The connection's budget (64 MiB of data in flight plus unsent
    // replies) at most: two 32 MiB reads, not six.
    assert_eq!(
        dev.max_outstanding.load(Ordering::SeqCst) as usize,
        crate::conn::BUDGET / BIG as usize
    );
    run.stop();
}

/// A client that chose its export with NBD_OPT_EXPORT_NAME (so it never
/// learnt the block sizes) on the default export.
fn export_name_client(run: &Running) -> RawClient<UnixStream> {
    let mut c = run.connect();
    c.start().unwrap();
    c.option(OPT_EXPORT_NAME, b"").unwrap();
    let mut b = [0u8; 10];
    std::io::Read::read_exact(&mut c.s, &mut b).unwrap();
    c
}

#[test]
fn an_export_name_client_may_read_and_write_at_any_alignment() {
    let dev = VecDev::new(1 << 20);
    let run = serve(vec![Export::new("a", dev.clone(), false)]);
    let mut c = export_name_client(&run);
    let pattern: Vec<u8> = (0..2048u32).map(|i| (i * 7 + 3) as u8).collect();
    c.request(&req(CMD_WRITE, 0, 1, 0, 2048), &pattern).unwrap();
    assert_eq!(c.simple_reply().unwrap().error, 0);
    // A 1-byte read, and reads straddling block boundaries.
    assert_eq!(read_simple(&mut c, 2, 5, 1), vec![pattern[5]]);
    assert_eq!(read_simple(&mut c, 3, 500, 30), pattern[500..530].to_vec());
    // An unaligned write changes exactly its bytes (read-modify-write).
    c.request(&req(CMD_WRITE, 0, 4, 510, 4), b"WXYZ").unwrap();
    assert_eq!(c.simple_reply().unwrap().error, 0);
    let mut want = pattern.clone();
    want[510..514].copy_from_slice(b"WXYZ");
    assert_eq!(read_simple(&mut c, 5, 0, 2048), want);
    assert_eq!(dev.data.lock()[..2048], want[..]);
    // Unaligned zeroing likewise; an unaligned trim reports success and
    // leaves the partial blocks' data alone.
    c.request(&req(CMD_WRITE_ZEROES, 0, 6, 1000, 100), &[])
        .unwrap();
    assert_eq!(c.simple_reply().unwrap().error, 0);
    want[1000..1100].fill(0);
    c.request(&req(CMD_TRIM, 0, 7, 1, 100), &[]).unwrap();
    assert_eq!(c.simple_reply().unwrap().error, 0);
    assert_eq!(read_simple(&mut c, 8, 0, 2048), want);
    // Past the end is still refused.
    c.request(&req(CMD_READ, 0, 9, (1 << 20) - 1, 2), &[])
        .unwrap();
    assert_eq!(c.status_reply().unwrap(), (9, EINVAL));
    run.stop();
}
