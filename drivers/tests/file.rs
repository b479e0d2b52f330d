//! The `file` leaf driver through the dm table, as a user reaches it:
//! `Registry::create("f", "0 N file PATH ...")` and synchronous bios. The
//! backing files live in a temp dir on the machine's real filesystem, so
//! these tests exercise the real kernel paths (io_uring, O_DIRECT,
//! fallocate, SEEK_DATA/SEEK_HOLE, and the IOPOLL refusal of a disk
//! without poll queues).

use blkstack_core::sync::{submit_and_wait, submit_and_wait_flags};
use blkstack_core::{AlignedBuf, BioFlags, Device, Op, Status};
use blkstack_mapped::Registry;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const MIB: u64 = 1 << 20;

/// A scratch dir under the target dir's filesystem (not tmpfs), which is
/// where O_DIRECT and IOPOLL behave as on a user's disk.
fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("blkstack-file-test")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("temp dir")
}

fn backing(dir: &Path, name: &str, len: u64) -> PathBuf {
    let p = dir.join(name);
    let f = std::fs::File::create(&p).expect("create backing file");
    f.set_len(len).expect("size backing file");
    p
}

fn pattern(seed: u64, len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::new(len);
    for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
        *x = ((i as u64).wrapping_mul(31).wrapping_add(seed * 7919) % 251) as u8;
    }
    b
}

fn sectors(bytes: u64) -> u64 {
    bytes / 512
}

/// Write patterns at several offsets and sizes, read them back through the
/// device, and check the bytes really reached the file.
fn round_trip(dev: &dyn Device, path: &Path) {
    let cases: &[(u64, usize)] = &[
        (0, 4096),
        (8192 + 512, 512),
        (64 << 10, 128 << 10),
        (MIB - 8192, 8192),
        (3 * MIB + 1536, 2560),
    ];
    for (i, &(off, len)) in cases.iter().enumerate() {
        let mut w = pattern(i as u64 + 1, len);
        assert_eq!(
            submit_and_wait(dev, Op::Write, off, len as u64, w.as_mut_slice()),
            Status::Ok,
            "write {off}+{len}"
        );
    }
    for (i, &(off, len)) in cases.iter().enumerate() {
        let want = pattern(i as u64 + 1, len);
        let mut r = AlignedBuf::new(len);
        assert_eq!(
            submit_and_wait(dev, Op::Read, off, len as u64, r.as_mut_slice()),
            Status::Ok,
            "read {off}+{len}"
        );
        assert!(
            r.as_slice() == want.as_slice(),
            "data read back at {off}+{len} differs"
        );
    }
    assert_eq!(submit_and_wait(dev, Op::Flush, 0, 0, &mut []), Status::Ok);
    let on_disk = std::fs::read(path).expect("read backing file");
    for (i, &(off, len)) in cases.iter().enumerate() {
        let want = pattern(i as u64 + 1, len);
        assert!(
            &on_disk[off as usize..off as usize + len] == want.as_slice(),
            "file content at {off}+{len} differs"
        );
    }
}

fn status(reg: &Registry, name: &str) -> String {
    reg.status_text(name).expect("status")
}

#[test]
fn buffered_round_trip() {
    let dir = scratch();
    let p = backing(dir.path(), "b.img", 4 * MIB);
    let reg = Registry::new();
    let dev = reg
        .create("f", &format!("0 {} file {}", sectors(4 * MIB), p.display()))
        .expect("create");
    round_trip(&*dev, &p);
    let st = status(&reg, "f");
    assert!(st.contains("engine=uring"), "{st}");
    assert!(st.contains("direct=0"), "{st}");
    assert!(st.contains("writes=5"), "{st}");
    assert!(st.contains("reads=5"), "{st}");
}

#[test]
fn direct_round_trip_with_aligned_and_misaligned_memory() {
    let dir = scratch();
    let p = backing(dir.path(), "d.img", 4 * MIB);
    let reg = Registry::new();
    let dev = reg
        .create(
            "fd",
            &format!("0 {} file {} direct", sectors(4 * MIB), p.display()),
        )
        .expect("create");
    round_trip(&*dev, &p);
    // Memory one byte off any alignment: must go through the bounce buffer
    // and still land correctly.
    let mut raw = vec![0u8; 8192 + 1];
    let want = pattern(99, 8192);
    raw[1..].copy_from_slice(want.as_slice());
    assert_eq!(
        submit_and_wait(&*dev, Op::Write, 2 * MIB, 8192, &mut raw[1..]),
        Status::Ok
    );
    let mut back = vec![0u8; 8192 + 1];
    assert_eq!(
        submit_and_wait(&*dev, Op::Read, 2 * MIB, 8192, &mut back[1..]),
        Status::Ok
    );
    assert!(
        &back[1..] == want.as_slice(),
        "bounced direct I/O corrupted data"
    );
    let st = status(&reg, "fd");
    assert!(st.contains("direct=1"), "{st}");
    let bounced: u64 = field(&st, "bounced");
    assert!(bounced >= 2, "misaligned memory was not bounced: {st}");
}

fn field(status: &str, key: &str) -> u64 {
    status
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in '{status}'"))
        .parse()
        .unwrap_or_else(|_| panic!("{key} is not a number in '{status}'"))
}

#[test]
fn psync_engine_round_trip() {
    let dir = scratch();
    let p = backing(dir.path(), "p.img", 4 * MIB);
    let reg = Registry::new();
    let dev = reg
        .create(
            "fp",
            &format!(
                "0 {} file {} direct engine=psync queue_depth=4",
                sectors(4 * MIB),
                p.display()
            ),
        )
        .expect("create");
    round_trip(&*dev, &p);
    let st = status(&reg, "fp");
    assert!(st.contains("engine=psync"), "{st}");
    assert_eq!(
        reg.table_text("fp").unwrap().trim_end(),
        format!(
            "0 {} file {} direct queue_depth=4 engine=psync",
            sectors(4 * MIB),
            p.display()
        )
    );
}

/// Discard punches a hole (reads zero, extents say hole); write-zeroes
/// reads zero with and without NOUNMAP; FUA and PREFLUSH writes succeed.
fn discard_and_zero_semantics(extra: &str) {
    let dir = scratch();
    let p = backing(dir.path(), "z.img", 4 * MIB);
    let reg = Registry::new();
    let dev = reg
        .create(
            "fz",
            &format!("0 {} file {} {extra}", sectors(4 * MIB), p.display()),
        )
        .expect("create");
    assert!(dev.features().knows_holes);
    // A fresh sparse file is one hole.
    let ext = dev.extents(0, 4 * MIB).expect("extents");
    assert!(
        ext.iter().all(|e| e.hole),
        "fresh sparse file should be a hole: {ext:?}"
    );

    let mut data = pattern(5, (2 * MIB) as usize);
    assert_eq!(
        submit_and_wait(&*dev, Op::Write, 0, 2 * MIB, data.as_mut_slice()),
        Status::Ok
    );
    let ext = dev.extents(0, 4 * MIB).expect("extents");
    assert!(
        ext.iter()
            .any(|e| !e.hole && e.offset == 0 && e.len >= 2 * MIB),
        "written range should be data: {ext:?}"
    );
    assert!(
        ext.iter().any(|e| e.hole && e.offset + e.len == 4 * MIB),
        "tail should stay a hole: {ext:?}"
    );

    assert_eq!(
        submit_and_wait(&*dev, Op::Discard, 256 << 10, 256 << 10, &mut []),
        Status::Ok
    );
    assert_eq!(
        submit_and_wait(&*dev, Op::WriteZeroes, MIB, 64 << 10, &mut []),
        Status::Ok
    );
    assert_eq!(
        submit_and_wait_flags(
            &*dev,
            Op::WriteZeroes,
            BioFlags::NOUNMAP,
            MIB + (128 << 10),
            64 << 10,
            &mut []
        ),
        Status::Ok
    );
    let mut back = AlignedBuf::new((2 * MIB) as usize);
    assert_eq!(
        submit_and_wait(&*dev, Op::Read, 0, 2 * MIB, back.as_mut_slice()),
        Status::Ok
    );
    let b = back.as_slice();
    let d = data.as_slice();
    let zero = |r: std::ops::Range<usize>| b[r.clone()].iter().all(|&x| x == 0);
    assert!(
        zero(256 << 10..512 << 10),
        "discarded range must read zeroes"
    );
    assert!(
        zero(1 << 20..(1 << 20) + (64 << 10)),
        "write-zeroes range must read zeroes"
    );
    assert!(
        zero((1 << 20) + (128 << 10)..(1 << 20) + (192 << 10)),
        "NOUNMAP write-zeroes range must read zeroes"
    );
    assert_eq!(
        &b[..256 << 10],
        &d[..256 << 10],
        "data before the discard changed"
    );
    assert_eq!(
        &b[512 << 10..1 << 20],
        &d[512 << 10..1 << 20],
        "data between discard and zeroes changed"
    );
    assert_eq!(
        &b[(1 << 20) + (64 << 10)..(1 << 20) + (128 << 10)],
        &d[(1 << 20) + (64 << 10)..(1 << 20) + (128 << 10)]
    );
    // The punched hole is visible to SEEK_HOLE (4 KiB-block filesystems
    // punch whole blocks, and this range is block aligned).
    let ext = dev.extents(256 << 10, 256 << 10).expect("extents");
    assert_eq!(ext.len(), 1, "{ext:?}");
    assert!(ext[0].hole, "discarded range should be a hole: {ext:?}");

    let mut w = pattern(7, 4096);
    assert_eq!(
        submit_and_wait_flags(
            &*dev,
            Op::Write,
            BioFlags::FUA,
            3 * MIB,
            4096,
            w.as_mut_slice()
        ),
        Status::Ok
    );
    assert_eq!(
        submit_and_wait_flags(
            &*dev,
            Op::Write,
            BioFlags::PREFLUSH | BioFlags::FUA,
            3 * MIB + 4096,
            4096,
            w.as_mut_slice()
        ),
        Status::Ok
    );
    let on_disk = std::fs::read(&p).unwrap();
    assert_eq!(
        &on_disk[(3 * MIB + 4096) as usize..(3 * MIB + 8192) as usize],
        w.as_slice()
    );
    let st = status(&reg, "fz");
    assert_eq!(field(&st, "discards"), 1, "{st}");
    assert_eq!(field(&st, "write_zeroes"), 2, "{st}");
    assert_eq!(field(&st, "errors"), 0, "{st}");
}

#[test]
fn discard_and_zero_uring_buffered() {
    discard_and_zero_semantics("");
}

#[test]
fn discard_and_zero_uring_direct() {
    discard_and_zero_semantics("direct");
}

#[test]
fn discard_and_zero_psync() {
    discard_and_zero_semantics("engine=psync");
}

/// Asking for polled completions gives a working device whatever the
/// kernel and disk allow: where the disk has no poll queues (a virtio
/// disk, for one) the status says it fell back and why, and every byte
/// still round-trips.
fn poll_request_works(flag: &str) {
    let dir = scratch();
    let p = backing(dir.path(), "poll.img", 4 * MIB);
    // Real data in the file, so that the construction probe reaches the
    // disk (a read of a hole never does, and is never refused).
    std::fs::write(&p, pattern(3, (4 * MIB) as usize).as_slice()).unwrap();
    let reg = Registry::new();
    let dev = reg
        .create(
            "fpoll",
            &format!("0 {} file {} direct {flag}", sectors(4 * MIB), p.display()),
        )
        .expect("a polled file device must be created even where polling is refused");
    let at_create = status(&reg, "fpoll");
    let refused_at_create = at_create.contains("fallback=");
    round_trip(&*dev, &p);
    let st = status(&reg, "fpoll");
    assert!(st.contains(&format!("requested={flag}")), "{st}");
    assert_eq!(
        refused_at_create,
        st.contains("fallback="),
        "the construction probe should find a refusal before use: {at_create} / {st}"
    );
    if st.contains("fallback=") {
        assert!(
            st.contains("mode=interrupt"),
            "fell back but still claims polling: {st}"
        );
        if st.contains("fallback=EOPNOTSUPP") {
            assert!(field(&st, "poll_refused") >= 1, "{st}");
        }
        eprintln!("polling refused here, as expected on a disk without poll queues: {st}");
    } else {
        assert!(
            field(&st, "polled") >= 5,
            "claims polling but polled nothing: {st}"
        );
    }
    assert_eq!(field(&st, "errors"), 0, "{st}");
}

#[test]
fn iopoll_falls_back_and_keeps_working() {
    poll_request_works("iopoll");
}

#[test]
fn hybrid_iopoll_falls_back_and_keeps_working() {
    poll_request_works("hybrid_iopoll");
}

/// More bios in flight than the ring has slots: the backlog must hand
/// every one a slot and lose none.
#[test]
fn more_concurrent_bios_than_queue_depth() {
    let dir = scratch();
    let p = backing(dir.path(), "qd.img", 4 * MIB);
    let reg = Registry::new();
    let dev: Arc<dyn Device> = reg
        .create(
            "fq",
            &format!(
                "0 {} file {} direct queue_depth=2",
                sectors(4 * MIB),
                p.display()
            ),
        )
        .expect("create");
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let dev = dev.clone();
            std::thread::spawn(move || {
                for i in 0..40u64 {
                    let off = (t * 40 + i) * 8192;
                    let mut w = pattern(t * 1000 + i, 8192);
                    assert_eq!(
                        submit_and_wait(&*dev, Op::Write, off, 8192, w.as_mut_slice()),
                        Status::Ok
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("writer thread");
    }
    for t in 0..8u64 {
        for i in 0..40u64 {
            let off = (t * 40 + i) * 8192;
            let mut r = AlignedBuf::new(8192);
            assert_eq!(
                submit_and_wait(&*dev, Op::Read, off, 8192, r.as_mut_slice()),
                Status::Ok
            );
            assert!(
                r.as_slice() == pattern(t * 1000 + i, 8192).as_slice(),
                "block {t}/{i} differs"
            );
        }
    }
}

#[test]
fn file_size_rules_and_bad_args() {
    let dir = scratch();
    let reg = Registry::new();
    let missing = dir.path().join("missing.img");
    let err = |table: String| {
        reg.create("bad", &table)
            .err()
            .expect("must be refused")
            .report()
    };

    let e = err(format!("0 2048 file {}", missing.display()));
    assert!(e.contains("does not exist") && e.contains("create"), "{e}");
    assert!(
        reg.get("bad").is_none() && !missing.exists(),
        "a refused table changed something"
    );

    let short = backing(dir.path(), "short.img", 512 * 1024);
    let e = err(format!("0 2048 file {}", short.display()));
    assert!(e.contains("524288 bytes") && e.contains("1048576"), "{e}");
    assert_eq!(
        std::fs::metadata(&short).unwrap().len(),
        512 * 1024,
        "a refused table must not extend the file"
    );

    assert!(err("0 2048 file".into()).contains("missing PATH"));
    assert!(err(format!("0 2048 file {} iopoll", short.display())).contains("needs 'direct'"));
    assert!(
        err(format!("0 2048 file {} queue_depth=0", short.display())).contains("queue_depth=0")
    );
    assert!(err(format!("0 2048 file {} engine=aio", short.display())).contains("engine='aio'"));
    assert!(
        err(format!("0 2048 file {} sparkle", short.display())).contains("unknown flag 'sparkle'")
    );
    assert!(err(format!("0 2048 file {}", dir.path().display())).contains("neither a regular file"));

    // `create` makes a missing file and extends a short one, sparsely.
    reg.create("c1", &format!("0 2048 file {} create", missing.display()))
        .expect("create missing");
    assert_eq!(std::fs::metadata(&missing).unwrap().len(), MIB);
    reg.create("c2", &format!("0 2048 file {} create", short.display()))
        .expect("extend short");
    assert_eq!(std::fs::metadata(&short).unwrap().len(), MIB);
    // A longer file is fine and is never shortened.
    let long = backing(dir.path(), "long.img", 2 * MIB);
    let d = reg
        .create("c3", &format!("0 2048 file {}", long.display()))
        .expect("longer file");
    assert_eq!(d.size(), MIB);
    assert_eq!(std::fs::metadata(&long).unwrap().len(), 2 * MIB);
    // Past the line's end is refused even though the file is longer.
    let mut b = AlignedBuf::new(4096);
    assert_eq!(
        submit_and_wait(&*d, Op::Read, MIB, 4096, b.as_mut_slice()),
        Status::Invalid
    );
}

/// The last reference to a device may be dropped by the thread that
/// completes its last bio (an upper layer's completion frame held it).
/// That thread must not try to join itself; the device must go away
/// cleanly and the completion must still be delivered.
#[test]
fn device_dropped_from_its_own_completion_thread() {
    use blkstack_core::{Bio, EndIo};
    use blkstack_drivers::file::FileDevice;
    use parking_lot::Mutex;
    use std::sync::mpsc;

    struct DropsDevice {
        dev: Mutex<Option<Arc<FileDevice>>>,
        done: Mutex<mpsc::Sender<Status>>,
    }
    impl EndIo for DropsDevice {
        fn end_io(&self, _bio: Bio, status: Status, _private: u64) {
            drop(self.dev.lock().take());
            let _ = self.done.lock().send(status);
        }
    }

    let dir = scratch();
    for extra in ["", "direct", "engine=psync"] {
        let p = backing(dir.path(), "drop.img", MIB);
        let args: Vec<String> = std::iter::once(p.display().to_string())
            .chain(extra.split_whitespace().map(String::from))
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let dev = Arc::new(FileDevice::from_args(MIB, &args).expect("open"));
        let (tx, rx) = mpsc::channel();
        let owner = Arc::new(DropsDevice {
            dev: Mutex::new(Some(dev.clone())),
            done: Mutex::new(tx),
        });
        let buf = AlignedBuf::new(4096);
        // SAFETY: `buf` outlives the request: we wait for its completion.
        let io = unsafe { buf.io_buf(0, 4096) };
        let bio = Bio::new(Op::Read, 0, 4096, io, owner.clone(), 0);
        let weak = Arc::downgrade(&dev);
        dev.submit(bio);
        drop(dev);
        let st = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("{extra:?}: completion never delivered"));
        assert_eq!(st, Status::Ok, "{extra:?}");
        // The device is gone once the completing thread let go of it.
        let t0 = std::time::Instant::now();
        while weak.strong_count() > 0 && t0.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(weak.strong_count(), 0, "{extra:?}: device leaked");
    }
}

/// Counts completed bios; a waiter sees them all arrive.
struct Done(parking_lot::Mutex<Vec<Status>>, parking_lot::Condvar);

impl blkstack_core::EndIo for Done {
    fn end_io(&self, bio: blkstack_core::Bio, status: Status, _private: u64) {
        drop(bio);
        self.0.lock().push(status);
        self.1.notify_all();
    }
}

/// Bios submitted under a plug ([`blkstack_core::plug`]: the ring is
/// entered once, when the plug closes) all complete once it closes, more
/// of them than the ring has slots (the rest wait in the backlog), and
/// their data is on the file.
#[test]
fn bios_submitted_under_a_plug_complete_when_it_closes() {
    let dir = scratch();
    let p = backing(dir.path(), "plug.img", MIB);
    let reg = Registry::new();
    let dev: Arc<dyn Device> = reg
        .create(
            "fp",
            &format!(
                "0 {} file {} direct queue_depth=4",
                sectors(MIB),
                p.display()
            ),
        )
        .expect("create");
    let done = Arc::new(Done(
        parking_lot::Mutex::new(Vec::new()),
        Default::default(),
    ));
    let mut bufs: Vec<AlignedBuf> = (0..16u64).map(|i| pattern(i + 50, 4096)).collect();
    {
        let _plug = blkstack_core::plug::SubmitPlug::start();
        for (i, b) in bufs.iter_mut().enumerate() {
            // SAFETY: each buffer outlives its bio: the test waits for
            // every completion before the buffers go.
            let io = unsafe { blkstack_core::IoBuf::from_slice(b.as_mut_slice()) };
            let bio =
                blkstack_core::Bio::new(Op::Write, i as u64 * 8192, 4096, io, done.clone(), 0);
            dev.submit(bio);
        }
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut got = done.0.lock();
    while got.len() < bufs.len() {
        assert!(
            !done.1.wait_until(&mut got, deadline).timed_out(),
            "only {} of {} plugged bios completed",
            got.len(),
            bufs.len()
        );
    }
    assert!(got.iter().all(|s| *s == Status::Ok), "{got:?}");
    drop(got);
    let file = std::fs::read(&p).expect("read back");
    for i in 0..16usize {
        let at = i * 8192;
        assert!(
            file[at..at + 4096] == *pattern(i as u64 + 50, 4096).as_slice(),
            "block {i} is not on the file"
        );
    }
}
