//! What the thin-pool tests share: the pool over files, I/O helpers,
//! and Debian's `thin_check`/`thin_dump` (thin-provisioning-tools) that
//! judge every pool the tests make.
#![allow(dead_code)]

use blkstack_core::clock::now_ns;
use blkstack_core::sync::{submit_and_wait, submit_and_wait_flags};
use blkstack_core::{Bio, BioFlags, Device, EndIo, IoBuf, Op, Status};
use blkstack_mapped::Registry;
#[allow(unused_imports)] // each test file uses a different part
pub use blkstack_test_support::{thin_check, thin_dump, tool};
use parking_lot::Mutex;
use std::path::PathBuf;
use std::sync::Arc;

pub const BLOCK: u64 = 64 * 1024;

pub struct Files {
    pub _dir: tempfile::TempDir,
    pub meta: PathBuf,
    pub data: PathBuf,
}

pub fn files() -> Files {
    let dir = tempfile::tempdir().unwrap();
    Files {
        meta: dir.path().join("meta"),
        data: dir.path().join("data"),
        _dir: dir,
    }
}

/// The files as devices `meta` (4 MiB) and `data` (`data_sectors`), with
/// no pool over them yet.
pub fn files_registry(f: &Files, data_sectors: u64) -> Arc<Registry> {
    let reg = Registry::new();
    reg.create("meta", &format!("0 8192 file {} create", f.meta.display()))
        .unwrap();
    reg.create(
        "data",
        &format!("0 {data_sectors} file {} create", f.data.display()),
    )
    .unwrap();
    reg
}

/// A pool over the files: `data_sectors` of data, 4 MiB of metadata.
pub fn pool(f: &Files, data_sectors: u64, features: &str) -> Arc<Registry> {
    let reg = files_registry(f, data_sectors);
    reg.create(
        "pool",
        &format!("0 {data_sectors} thin-pool meta data 128 0 {features}"),
    )
    .unwrap();
    reg
}

pub fn msg(reg: &Registry, text: &str) {
    let args: Vec<&str> = text.split_whitespace().collect();
    reg.message("pool", 0, &args)
        .unwrap_or_else(|e| panic!("message {text}: {e}: {:?}", std::error::Error::source(&e)));
}

pub fn pattern(tag: u64, off: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((tag * 131 + (off + i) / 512 * 7 + off + i) % 251) as u8)
        .collect()
}

pub fn write(dev: &dyn Device, off: u64, data: &[u8]) {
    let mut b = data.to_vec();
    assert_eq!(
        submit_and_wait(dev, Op::Write, off, b.len() as u64, &mut b),
        Status::Ok,
        "write at {off}"
    );
}

pub fn read(dev: &dyn Device, off: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    assert_eq!(
        submit_and_wait(dev, Op::Read, off, len as u64, &mut b),
        Status::Ok,
        "read at {off}"
    );
    b
}

pub fn flush(dev: &dyn Device) {
    assert_eq!(
        submit_and_wait_flags(dev, Op::Flush, BioFlags::NONE, 0, 0, &mut []),
        Status::Ok
    );
}

pub fn status(reg: &Registry, name: &str) -> Vec<String> {
    let s = reg.status_text(name).unwrap();
    s.split_whitespace().skip(3).map(String::from).collect()
}

/// A pool of `blocks` data blocks over a data file of `file_blocks`.
pub fn small_pool(
    f: &Files,
    blocks: u64,
    file_blocks: u64,
    meta_sectors: u64,
    args: &str,
) -> Arc<Registry> {
    let reg = Registry::new();
    reg.create(
        "meta",
        &format!("0 {meta_sectors} file {} create", f.meta.display()),
    )
    .unwrap();
    reg.create(
        "data",
        &format!("0 {} file {} create", file_blocks * 128, f.data.display()),
    )
    .unwrap();
    reg.create(
        "pool",
        &format!("0 {} thin-pool meta data 128 {args}", blocks * 128),
    )
    .unwrap();
    reg
}

/// Why creating a device failed (it must fail).
pub fn refused(reg: &Registry, name: &str, table: &str) -> String {
    match reg.create(name, table) {
        Ok(_) => panic!("{table}: accepted"),
        Err(e) => format!("{e:?}"),
    }
}

pub fn try_write(dev: &dyn Device, off: u64) -> Status {
    let mut b = pattern(7, off, 4096);
    submit_and_wait(dev, Op::Write, off, 4096, &mut b)
}

/// Records each bio's status by its cookie.
pub struct Done {
    status: Mutex<Vec<Option<Status>>>,
}

impl EndIo for Done {
    fn end_io(&self, bio: Bio, status: Status, _private: u64) {
        let mut s = self.status.lock();
        assert!(s[bio.cookie as usize].is_none(), "bio {} twice", bio.cookie);
        s[bio.cookie as usize] = Some(status);
    }
}

/// One request of a batch, with the buffer it lends (a discard lends
/// none and covers one pool block).
pub struct Req {
    pub op: Op,
    pub flags: BioFlags,
    pub off: u64,
    pub buf: Vec<u8>,
}

/// Submit `reqs` as one batch (`submit_batch`) and wait for every bio to
/// succeed; reads land in their `buf`.
pub fn batch(dev: &dyn Device, reqs: &mut [Req]) {
    let done = Arc::new(Done {
        status: Mutex::new(vec![None; reqs.len()]),
    });
    let mut bios: Vec<Bio> = reqs
        .iter_mut()
        .enumerate()
        .map(|(i, r)| {
            let len = if r.op == Op::Discard {
                BLOCK
            } else {
                r.buf.len() as u64
            };
            // SAFETY: each buffer outlives its bio: this function waits
            // below for every bio to complete before `reqs` can be touched.
            let buf = unsafe { IoBuf::from_slice(&mut r.buf) };
            Bio::new(r.op, r.off, len, buf, done.clone(), i as u64).with_flags(r.flags)
        })
        .collect();
    dev.submit_batch(&mut bios);
    assert!(bios.is_empty(), "submit_batch left bios behind");
    let deadline = now_ns() + 30_000_000_000;
    loop {
        let s = done.status.lock().clone();
        if s.iter().all(Option::is_some) {
            for (i, st) in s.iter().enumerate() {
                assert_eq!(*st, Some(Status::Ok), "bio {i} ({:?})", reqs[i].op);
            }
            return;
        }
        assert!(now_ns() < deadline, "batch not done: {s:?}");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
