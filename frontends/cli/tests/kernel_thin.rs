//! dm-thin metadata both ways, judged by the kernel: in the kernel VM,
//! the guest's dm-thin-pool activates a pool blkstack wrote (its metadata
//! and data files as virtio disks) and reads every block of a thin device
//! and of its snapshot as blkstack wrote them (md5 of the whole devices,
//! whose mapping trees have internal nodes), and prints the same status
//! blkstack printed; then the guest's kernel makes a pool of its own
//! (thin device, snapshot, overwrites, a deleted thin) that blkstack
//! opens afterwards and reads back as the guest wrote it. Each side
//! discards part of its thin device after the snapshot (blkstack with a
//! DISCARD bio, the guest with `blkdiscard`): the other reads zeroes in
//! the whole blocks discarded, the snapshot's shared blocks unchanged,
//! and both print the same pool status (the freed block no longer
//! counted). Messages both refuse give the same errno text (EEXIST,
//! ENODATA, EBUSY, EINVAL). `thin_check` passes on both pools.
//!
//! Hostile metadata (issue 35): both refuse a second pool over metadata
//! in use with EBUSY and the same `ti->error`, keep a pool whose
//! superblock says `needs_check` read-only with the same status, and log
//! a reference count that would go below zero; blkstack then fails the
//! `delete` where the kernel lets it succeed (a deliberate difference).
//! A block mapped past the data device fails its read and its write with
//! EIO on both, the pool staying read-write, and both log "attempt to
//! access beyond end of device".

mod kernel_thin_order;
mod kernel_vm_support;

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Device, Op, Status};
use blkstack_mapped::Registry;
use blkstack_test_support::thin_check;
use kernel_vm_support::*;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

const DATA_SECTORS: u64 = 131072;
const META_SECTORS: u64 = 8192;
const THIN_SECTORS: u64 = 81920;
const THIN_BYTES: usize = THIN_SECTORS as usize * 512;

/// Writes as `dd bs=BS count=N seek=S` of the pattern file's start.
type Write = (usize, usize, usize);

const BLKSTACK_ORIGIN: &[Write] = &[(65536, 1, 0), (4096, 3, 40), (512, 5, 2001), (65536, 4, 60)];
const BLKSTACK_AFTER_SNAP: &[Write] = &[(4096, 1, 0), (8192, 2, 200)];
const KERNEL_ORIGIN: &[Write] = &[(65536, 2, 1), (4096, 5, 7), (512, 9, 3333), (65536, 1, 100)];
const KERNEL_AFTER_SNAP: &[Write] = &[(4096, 2, 16), (65536, 1, 101)];
/// blkstack's discard of thin 1 after the snapshot: blocks 1..33 whole
/// (25 is thin 1's own since the snapshot, so it is freed), and half of
/// block 0, which stays.
const BLKSTACK_DISCARD: (usize, usize) = (32768, 65536 * 33 - 32768);
/// Pool messages refused (thin 1 open, no thin 8 or 9), each with the
/// errno dmsetup prints after `failed: `.
const REFUSED: &[&str] = &[
    "create_thin 1",
    "create_snap 1 1",
    "create_snap 9 8",
    "delete 8",
    "delete 1",
    "reserve_metadata_snap",
    "release_metadata_snap",
];

/// The refused messages that follow the same message succeeding once
/// (a second metadata snapshot, a second release).
fn done_once_first(m: &str) -> bool {
    m.ends_with("_metadata_snap")
}

/// The guest's `blkdiscard` of its thin 1: blocks 1..17 (1 is its own).
const KERNEL_DISCARD: (usize, usize) = (65536, 65536 * 16);

/// 600 more blocks, one 4 KiB write each, so the mapping trees have
/// internal nodes (a leaf holds 252 mappings) on both sides.
fn spread(first: &[Write], offset: usize) -> Vec<Write> {
    let mut w = first.to_vec();
    w.extend((0..600).map(|k| (4096, 1, 16 * k + offset)));
    w
}

fn pattern() -> Vec<u8> {
    (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

fn apply(img: &mut [u8], pat: &[u8], writes: &[Write]) {
    for &(bs, n, seek) in writes {
        img[bs * seek..bs * (seek + n)].copy_from_slice(&pat[..bs * n]);
    }
}

fn dev_write(dev: &dyn Device, pat: &[u8], writes: &[Write]) {
    for &(bs, n, seek) in writes {
        let mut b = pat[..bs * n].to_vec();
        let st = submit_and_wait(dev, Op::Write, (bs * seek) as u64, b.len() as u64, &mut b);
        assert_eq!(st, Status::Ok);
    }
}

fn read_all(dev: &dyn Device) -> Vec<u8> {
    let mut b = vec![0u8; THIN_BYTES];
    let st = submit_and_wait(dev, Op::Read, 0, THIN_BYTES as u64, &mut b);
    assert_eq!(st, Status::Ok);
    b
}

fn pool_reg(meta: &Path, data: &Path) -> Arc<Registry> {
    pool_reg_sized(meta, data, DATA_SECTORS)
}

/// [`pool_reg`] over a data device of `data_sectors`.
fn pool_reg_sized(meta: &Path, data: &Path, data_sectors: u64) -> Arc<Registry> {
    let reg = Registry::new();
    reg.create("meta", &format!("0 {META_SECTORS} file {}", meta.display()))
        .unwrap();
    reg.create("data", &format!("0 {data_sectors} file {}", data.display()))
        .unwrap();
    reg.create(
        "pool",
        &format!("0 {data_sectors} thin-pool meta data 128 0"),
    )
    .unwrap();
    reg
}

fn status_args(reg: &Registry, name: &str) -> String {
    let s = reg.status_text(name).unwrap();
    s.split_whitespace().skip(3).collect::<Vec<_>>().join(" ")
}

/// The guest lines sending [`REFUSED`].
fn refused_lines() -> String {
    REFUSED
        .iter()
        .map(|m| {
            let first = if done_once_first(m) {
                format!("dmsetup message kpool 0 {m} || fail '{m}'\n")
            } else {
                String::new()
            };
            format!("{first}dmsetup message kpool 0 {m} 2>&1 | sed -n 's/.*failed: //p'\n")
        })
        .collect()
}

/// blkstack's errno text for each of [`REFUSED`], sent as the guest
/// does (through the control socket's errno mapping).
fn refused_here(reg: &Registry) -> String {
    let mut out = Vec::new();
    for m in REFUSED {
        let args: Vec<&str> = m.split_whitespace().collect();
        if done_once_first(m) {
            reg.message("pool", 0, &args).unwrap();
        }
        let e = reg.message("pool", 0, &args).expect_err(m);
        let e = blkstack_control::proto::RpcError::from(e);
        out.push(e.strerror().unwrap_or("?").to_string());
    }
    out.join("\n")
}

fn dd_lines(dev: &str, writes: &[Write]) -> String {
    writes
        .iter()
        .map(|(bs, n, seek)| format!("w {dev} {bs} {n} {seek}\n"))
        .collect()
}

const GUEST: &str = r#"
fail() { echo "FAIL: $*"; exit 1; }
dev() { cat /sys/block/$(basename $(readlink /dev/disk/by-serial/$1))/dev; }
w() { dd if=/test/pattern of=/dev/mapper/$1 bs=$2 count=$3 seek=$4 oflag=direct conv=notrunc 2>/dev/null || fail "write $*"; }
st() { dmsetup status $1 | sed 's/ *$//' | cut -d' ' -f4-; }
modprobe dm-thin-pool || fail "modprobe dm-thin-pool"
dmsetup create bpool --table "0 DATA thin-pool $(dev bmeta) $(dev bdata) 128 0" || fail "activate blkstack's pool"
dmsetup create bt1 --table "0 THIN thin /dev/mapper/bpool 1" || fail "thin 1"
dmsetup create bt2 --table "0 THIN thin /dev/mapper/bpool 2" || fail "thin 2"
echo "BEGIN bstatus"; st bpool; st bt1; st bt2; echo "END bstatus"
echo "BEGIN bmd5"; md5sum < /dev/mapper/bt1; md5sum < /dev/mapper/bt2; echo "END bmd5"
dmsetup remove bt1; dmsetup remove bt2; dmsetup remove bpool || fail "remove bpool"
dmsetup create kpool --table "0 DATA thin-pool $(dev kmeta) $(dev kdata) 128 0" || fail "kernel pool"
dmsetup message kpool 0 create_thin 1 || fail create_thin
dmsetup create kt1 --table "0 THIN thin /dev/mapper/kpool 1" || fail "kt1"
KORIGIN
dmsetup suspend kt1 && dmsetup message kpool 0 create_snap 2 1 && dmsetup resume kt1 || fail create_snap
KAFTER
blkdiscard -o KDOFF -l KDLEN /dev/mapper/kt1 || fail "blkdiscard kt1"
echo "BEGIN kerrno"
KREFUSED
echo "END kerrno"
dmsetup message kpool 0 create_thin 3 && dmsetup message kpool 0 delete 3 || fail "create and delete 3"
dmsetup message kpool 0 set_transaction_id 0 5 || fail set_transaction_id
echo "BEGIN kstatus"; st kpool; st kt1; echo "END kstatus"
dmsetup remove kt1; dmsetup remove kpool || fail "remove kpool"
echo DONE
"#;

/// A scratch folder holding the guest's `pattern` file and a sparse file
/// of each (name, sectors) given: the disks a test hands the guest.
fn scratch_with_disks(disks: &[(&str, u64)]) -> tempfile::TempDir {
    let scratch = tempfile::tempdir().expect("scratch");
    std::fs::write(scratch.path().join("pattern"), pattern()).unwrap();
    for (name, sectors) in disks {
        let f = std::fs::File::create(scratch.path().join(name)).unwrap();
        f.set_len(sectors * 512).unwrap();
    }
    scratch
}

#[test]
fn the_kernel_reads_blkstacks_pools_and_blkstack_reads_the_kernels() {
    if !vm_available() {
        return;
    }
    let scratch = scratch_with_disks(&[
        ("bmeta", META_SECTORS),
        ("bdata", DATA_SECTORS),
        ("kmeta", META_SECTORS),
        ("kdata", DATA_SECTORS),
    ]);
    let p = |n: &str| scratch.path().join(n);
    let pat = pattern();

    // blkstack writes a pool: thin 1, its snapshot 2, overwrites of 1.
    let reg = pool_reg(&p("bmeta"), &p("bdata"));
    let msg = |reg: &Registry, m: &str| {
        let args: Vec<&str> = m.split_whitespace().collect();
        reg.message("pool", 0, &args).unwrap();
    };
    msg(&reg, "create_thin 1");
    reg.create("t1", &format!("0 {THIN_SECTORS} thin pool 1"))
        .unwrap();
    let t1 = reg.device("t1").unwrap();
    let b_origin = spread(BLKSTACK_ORIGIN, 3);
    dev_write(&*t1, &pat, &b_origin);
    msg(&reg, "create_snap 2 1");
    dev_write(&*t1, &pat, BLKSTACK_AFTER_SNAP);
    let (off, len) = BLKSTACK_DISCARD;
    let st = submit_and_wait(&*t1, Op::Discard, off as u64, len as u64, &mut []);
    assert_eq!(st, Status::Ok, "blkstack's discard");
    let our_errnos = refused_here(&reg);
    msg(&reg, "create_thin 3");
    msg(&reg, "delete 3");
    reg.create("t2", &format!("0 {THIN_SECTORS} thin pool 2"))
        .unwrap();
    let mut expect1 = vec![0u8; THIN_BYTES];
    apply(&mut expect1, &pat, &b_origin);
    let expect2 = expect1.clone();
    apply(&mut expect1, &pat, BLKSTACK_AFTER_SNAP);
    expect1[65536..off + len].fill(0);
    assert!(read_all(&*t1) == expect1, "blkstack reads back thin 1");
    assert!(
        read_all(&*reg.device("t2").unwrap()) == expect2,
        "blkstack reads back thin 2"
    );
    let ours = [
        status_args(&reg, "pool"),
        status_args(&reg, "t1"),
        status_args(&reg, "t2"),
    ]
    .join("\n");
    drop(t1);
    reg.remove_all();
    thin_check(&p("bmeta"));
    std::fs::write(p("expect1"), &expect1).unwrap();
    std::fs::write(p("expect2"), &expect2).unwrap();

    let k_origin = spread(KERNEL_ORIGIN, 5);
    let script = GUEST
        .replace("DATA", &DATA_SECTORS.to_string())
        .replace("THIN", &THIN_SECTORS.to_string())
        .replace("KORIGIN\n", &dd_lines("kt1", &k_origin))
        .replace("KAFTER\n", &dd_lines("kt1", KERNEL_AFTER_SNAP))
        .replace("KDOFF", &KERNEL_DISCARD.0.to_string())
        .replace("KDLEN", &KERNEL_DISCARD.1.to_string())
        .replace("KREFUSED\n", &refused_lines());
    let run = Vm::new()
        .disk("bmeta", &p("bmeta").display().to_string())
        .disk("bdata", &p("bdata").display().to_string())
        .disk("kmeta", &p("kmeta").display().to_string())
        .disk("kdata", &p("kdata").display().to_string())
        .file(&p("pattern"), "/test/pattern")
        .timeout(300)
        .run(&script);
    println!("{}", run.out);
    run.assert_ok("the kernel's dm-thin-pool over blkstack's pool, then its own");
    assert!(run.out.contains("DONE"), "{}", run.out);
    let md5 = |f: &Path| {
        let out = Command::new("md5sum").arg(f).output().expect("md5sum");
        String::from_utf8_lossy(&out.stdout)
            .split(' ')
            .next()
            .unwrap_or("")
            .to_string()
    };
    let want = format!("{}  -\n{}  -", md5(&p("expect1")), md5(&p("expect2")));
    assert_eq!(
        run.section("bmd5").unwrap_or_default().trim(),
        want,
        "the kernel reads thin 1 and 2 (first, second line) as blkstack wrote them"
    );
    assert_eq!(
        run.section("bstatus").unwrap_or_default().trim(),
        ours,
        "the kernel's status of blkstack's pool (right) and blkstack's (left)"
    );

    assert_eq!(
        run.section("kerrno").unwrap_or_default().trim(),
        our_errnos,
        "refused messages: the kernel's errno (right) and blkstack's (left)"
    );

    // blkstack opens the kernel's pool and reads what the guest wrote.
    thin_check(&p("kmeta"));
    let reg = pool_reg(&p("kmeta"), &p("kdata"));
    reg.create("t1", &format!("0 {THIN_SECTORS} thin pool 1"))
        .unwrap();
    reg.create("t2", &format!("0 {THIN_SECTORS} thin pool 2"))
        .unwrap();
    let mut k1 = vec![0u8; THIN_BYTES];
    apply(&mut k1, &pat, &k_origin);
    let k2 = k1.clone();
    apply(&mut k1, &pat, KERNEL_AFTER_SNAP);
    let (koff, klen) = KERNEL_DISCARD;
    k1[koff..koff + klen].fill(0);
    assert!(
        read_all(&*reg.device("t1").unwrap()) == k1,
        "the kernel's thin 1"
    );
    assert!(
        read_all(&*reg.device("t2").unwrap()) == k2,
        "the kernel's snapshot 2"
    );
    assert!(
        reg.message("pool", 0, &["create_thin", "3"]).is_ok(),
        "thin 3 was deleted by the kernel"
    );
    let kstatus = run.section("kstatus").unwrap_or_default();
    let kpool = kstatus.lines().next().unwrap_or_default();
    let ours = status_args(&reg, "pool");
    assert_eq!(
        ours.split(' ').next(),
        kpool.split(' ').next(),
        "transaction id set by the kernel"
    );
    assert_eq!(
        ours.split(' ').nth(2),
        kpool.split(' ').nth(2),
        "used data blocks after the guest's discard: blkstack's (left), the kernel's"
    );
    assert_eq!(
        status_args(&reg, "t1"),
        kstatus.lines().nth(1).unwrap_or_default().trim(),
        "thin 1's status here and in the kernel"
    );
    // And blkstack's further changes to the kernel's pool still check.
    dev_write(&*reg.device("t2").unwrap(), &pat, KERNEL_AFTER_SNAP);
    reg.remove_all();
    thin_check(&p("kmeta"));
}

/// Issue 35, judged by the kernel: a second pool over metadata a pool
/// runs on (`__pool_find`: EBUSY, "metadata device already in use by a
/// pool"), a pool whose superblock says `needs_check` (`set_pool_mode`:
/// read-only, the same status, writes refused), and a `delete` over a
/// data block counted once but mapped twice (dm-space-map-common.c:
/// "unable to decrement block"), where blkstack is deliberately stricter
/// than the kernel.
const HOSTILE_GUEST: &str = r#"
fail() { echo "FAIL: $*"; exit 1; }
dev() { cat /sys/block/$(basename $(readlink /dev/disk/by-serial/$1))/dev; }
st() { dmsetup status $1 | sed 's/ *$//' | cut -d' ' -f4-; }
modprobe dm-thin-pool || fail "modprobe dm-thin-pool"
dmesg -c >/dev/null
T="0 DATA thin-pool $(dev xmeta) $(dev xdata) 128 0"
dmsetup create xpool --table "$T" || fail "activate the cross-linked pool"
echo "BEGIN busy"
dmsetup create xpool2 --table "$T" 2>&1 | sed -n 's/.*failed: //p'
dmesg | grep -o 'metadata device already in use by a pool' | head -n 1
echo "END busy"
echo "BEGIN delete"
dmsetup message xpool 0 delete 0 2>/tmp/e && echo ok || sed -n 's/.*failed: //p' /tmp/e
st xpool
echo "END delete"
echo "BEGIN dlog"; dmesg | grep -i 'thin\|space map\|btree'; echo "END dlog"
dmsetup remove xpool || fail "remove xpool"
dmsetup create npool --table "0 DATA thin-pool $(dev nmeta) $(dev ndata) 128 0" || fail "needs_check pool"
echo "BEGIN nstatus"; st npool; echo "END nstatus"
dmsetup create nt --table "0 THIN thin /dev/mapper/npool 1" || fail "thin over the needs_check pool"
echo "BEGIN nwrite"
dd if=/test/pattern of=/dev/mapper/nt bs=4096 count=1 oflag=direct conv=notrunc 2>/dev/null && echo written || echo refused
echo "END nwrite"
dmsetup remove nt; dmsetup remove npool || fail "remove npool"
dmesg -c >/dev/null
dmsetup create ppool --table "0 DATA thin-pool $(dev pmeta) $(dev pdata) 128 0" || fail "pool mapping past its data"
dmsetup create pt --table "0 THIN thin /dev/mapper/ppool 2" || fail "thin over the pool mapping past its data"
errno() { grep -o 'Input/output error\|Invalid argument\|No space left on device' /tmp/e | head -n 1; }
echo "BEGIN past"
dd if=/dev/mapper/pt of=/dev/null bs=4096 count=1 iflag=direct 2>/tmp/e && echo read || errno
st ppool
dd if=/test/pattern of=/dev/mapper/pt bs=4096 count=1 oflag=direct conv=notrunc 2>/tmp/e && echo written || errno
st ppool
echo "END past"
echo "BEGIN plog"; dmesg | grep -i 'beyond end\|thin'; echo "END plog"
dmsetup remove pt; dmsetup remove ppool || fail "remove ppool"
echo DONE
"#;

/// What is wrong with the metadata [`hostile_metadata`] writes.
#[derive(Clone, Copy, PartialEq)]
enum Hostile {
    /// Thin 0 maps virtual blocks 0 and 1 to one data block counted once.
    Cross,
    /// Thin 1, and the superblock says `needs_check`.
    NeedsCheck,
    /// Thin 2 maps virtual block 0 to a data block past the data device.
    PastData,
}

fn hostile_metadata(meta: &Path, data: &Path, how: Hostile) {
    use blkstack_mapped::targets::thin::metadata::PoolMetadata;
    let reg = Registry::new();
    reg.create("meta", &format!("0 {META_SECTORS} file {}", meta.display()))
        .unwrap();
    reg.create("data", &format!("0 {DATA_SECTORS} file {}", data.display()))
        .unwrap();
    let arg = blkstack_mapped::DevArg {
        name: "meta".into(),
        minor: 0,
        dev: reg.get("meta").unwrap(),
    };
    let mut md = PoolMetadata::open(arg, DATA_SECTORS / 128, 128).unwrap();
    match how {
        Hostile::Cross => {
            md.create_thin(0).unwrap();
            let b = md.alloc_data_block().unwrap();
            md.insert_block(0, 0, b).unwrap();
            md.insert_block(0, 1, b).unwrap();
            md.commit().unwrap();
        }
        Hostile::NeedsCheck => {
            md.create_thin(1).unwrap();
            md.commit().unwrap();
            md.set_needs_check().unwrap();
        }
        Hostile::PastData => {
            md.create_thin(2).unwrap();
            md.insert_block(2, 0, DATA_SECTORS / 128 + 100).unwrap();
            md.commit().unwrap();
        }
    }
}

/// What blkstack answers to the guest's steps, section by section.
fn hostile_here(p: &dyn Fn(&str) -> std::path::PathBuf) -> [String; 5] {
    let errno = |e: blkstack_mapped::DmError| {
        let e = blkstack_control::proto::RpcError::from(e);
        e.strerror().unwrap_or("?").to_string()
    };
    let reg = pool_reg(&p("xmeta-b"), &p("xdata-b"));
    let table = format!("0 {DATA_SECTORS} thin-pool meta data 128 0");
    let busy = match reg.create("pool2", &table) {
        Ok(_) => "accepted".to_string(),
        Err(e) => {
            let report = e.report();
            let text = ["metadata device already in use by a pool"]
                .into_iter()
                .filter(|t| report.contains(t));
            std::iter::once(errno(e))
                .chain(text.map(String::from))
                .collect::<Vec<_>>()
                .join("\n")
        }
    };
    let delete = match reg.message("pool", 0, &["delete", "0"]) {
        Ok(_) => "ok".to_string(),
        Err(e) => errno(e),
    };
    let delete = format!("{delete}\n{}", status_args(&reg, "pool"));
    reg.remove_all();
    let reg = pool_reg(&p("nmeta-b"), &p("ndata-b"));
    let nstatus = status_args(&reg, "pool");
    reg.create("nt", &format!("0 {THIN_SECTORS} thin pool 1"))
        .unwrap();
    let mut b = pattern()[..4096].to_vec();
    let nt = reg.device("nt").unwrap();
    let nwrite = match submit_and_wait(&*nt, Op::Write, 0, 4096, &mut b) {
        Status::Ok => "written",
        _ => "refused",
    };
    drop(nt);
    reg.remove_all();
    [busy, delete, nstatus, nwrite.to_string(), past_here(p)]
}

/// The guest's `past` section, here: read and write the block mapped past
/// the data device, the pool's status after each.
fn past_here(p: &dyn Fn(&str) -> std::path::PathBuf) -> String {
    let reg = pool_reg(&p("pmeta-b"), &p("pdata-b"));
    reg.create("pt", &format!("0 {THIN_SECTORS} thin pool 2"))
        .unwrap();
    let pt = reg.device("pt").unwrap();
    let mut out = Vec::new();
    for (op, done) in [(Op::Read, "read"), (Op::Write, "written")] {
        let mut b = pattern()[..4096].to_vec();
        out.push(match submit_and_wait(&*pt, op, 0, 4096, &mut b) {
            Status::Ok => done.to_string(),
            st => {
                let e = std::io::Error::from_raw_os_error(st.errno()).to_string();
                e.split(" (os error").next().unwrap_or_default().to_string()
            }
        });
        out.push(status_args(&reg, "pool"));
    }
    drop(pt);
    reg.remove_all();
    out.join("\n")
}

#[test]
fn the_kernel_and_blkstack_refuse_hostile_pools_alike() {
    if !vm_available() {
        return;
    }
    let scratch = scratch_with_disks(&[
        ("xmeta", META_SECTORS),
        ("xdata", DATA_SECTORS),
        ("nmeta", META_SECTORS),
        ("ndata", DATA_SECTORS),
        ("pmeta", META_SECTORS),
        ("pdata", DATA_SECTORS),
    ]);
    let p = |n: &str| scratch.path().join(n);
    hostile_metadata(&p("xmeta"), &p("xdata"), Hostile::Cross);
    hostile_metadata(&p("nmeta"), &p("ndata"), Hostile::NeedsCheck);
    hostile_metadata(&p("pmeta"), &p("pdata"), Hostile::PastData);
    let disks = ["xmeta", "xdata", "nmeta", "ndata", "pmeta", "pdata"];
    for n in disks {
        std::fs::copy(p(n), p(&format!("{n}-b"))).unwrap();
    }
    let ours = hostile_here(&p);
    let script = HOSTILE_GUEST
        .replace("DATA", &DATA_SECTORS.to_string())
        .replace("THIN", &THIN_SECTORS.to_string());
    let mut vm = Vm::new();
    for n in disks {
        vm = vm.disk(n, &p(n).display().to_string());
    }
    let run = vm
        .file(&p("pattern"), "/test/pattern")
        .timeout(300)
        .run(&script);
    println!("{}", run.out);
    run.assert_ok("the kernel's dm-thin-pool over hostile metadata");
    assert!(run.out.contains("DONE"), "{}", run.out);
    let section = |s: &str| run.section(s).unwrap_or_default().trim().to_string();
    assert_eq!(
        section("busy"),
        ours[0],
        "a second pool over metadata in use: the kernel's errno and ti->error (right), blkstack's (left)"
    );
    // A deliberate difference: the kernel logs the refused decrement
    // but its `delete` succeeds (`with_runs` and `subtree_dec` drop the
    // error) and the pool stays rw; blkstack fails the message (EINVAL),
    // aborts the transaction and flags the metadata.
    let kdelete = section("delete");
    assert!(
        section("dlog").contains("space map common: unable to decrement block"),
        "{}",
        section("dlog")
    );
    assert_eq!(kdelete.lines().next(), Some("ok"), "{kdelete}");
    assert!(
        kdelete.contains(" rw ") && kdelete.ends_with(" - 256"),
        "{kdelete}"
    );
    assert_eq!(
        ours[1].lines().next(),
        Some("Invalid argument"),
        "{}",
        ours[1]
    );
    assert!(
        ours[1].contains(" ro ") && ours[1].contains(" needs_check "),
        "{}",
        ours[1]
    );
    assert_eq!(
        section("nstatus"),
        ours[2],
        "a pool whose metadata needs_check: the kernel's status (right), blkstack's (left)"
    );
    assert_eq!(section("nwrite"), ours[3], "a write to its thin device");
    assert_eq!(
        section("past"),
        ours[4],
        "a block mapped past the data device read, then written: errno and pool status after each, the kernel's (right), blkstack's (left)"
    );
    assert!(
        section("plog").contains("beyond end of device"),
        "{}",
        section("plog")
    );
}
