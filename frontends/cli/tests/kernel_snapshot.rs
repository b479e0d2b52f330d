//! dm-snapshot's persistent store both ways, judged by the kernel (issue
//! 39): blkstack writes through a `snapshot ... P 8` over `file` origin
//! and COW images (partial chunks, whole chunks, more exceptions than one
//! metadata area holds), then the guest's dm-snapshot loads that COW over
//! the same origin and reads every byte of the snapshot as blkstack wrote
//! it, with the same status; the guest then writes through a snapshot of
//! its own over a zeroed COW, and blkstack loads that COW and reads back
//! what the guest wrote, again with the same status. The origin image is
//! unchanged by both.
//!
//! Merges cross over too: blkstack starts a `snapshot-merge` of a COW it
//! wrote into a copy of the origin and stops it (the device removed right
//! away), and the guest's `snapshot-merge` over the same images finishes
//! it; the guest starts and stops one of its own, and blkstack finishes
//! it. Each origin copy ends up holding exactly the snapshot's data, and
//! each status counts down to the header and one area. One guest boot, a
//! few seconds of guest work.

mod kernel_vm_support;

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Device, Op, Status};
use blkstack_mapped::Registry;
use kernel_vm_support::*;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

const ORIGIN_SECTORS: u64 = 8192;
const COW_SECTORS: u64 = 4096;
const ORIGIN_BYTES: usize = ORIGIN_SECTORS as usize * 512;
const PAT_LEN: usize = 1 << 20;

/// A write as `dd bs=BS count=N seek=S` of the pattern from byte `skip`.
#[derive(Clone, Copy)]
struct Write {
    bs: usize,
    n: usize,
    seek: usize,
    skip: usize,
}

fn w(bs: usize, n: usize, seek: usize) -> Write {
    // A different stretch of the pattern for each write, so that a chunk
    // read from the wrong place shows.
    let skip = (seek * bs * 7 + n * 4096) % (PAT_LEN - bs * n) / 512 * 512;
    Write { bs, n, seek, skip }
}

/// blkstack's writes: a partial chunk, 300 whole 4 KiB chunks (more than
/// the 256 exceptions of one area at chunk size 8), and a run of chunks.
fn blkstack_writes() -> Vec<Write> {
    let mut v = vec![w(512, 3, 5)];
    v.extend((0..300).map(|k| w(4096, 1, 3 * k + 1)));
    v.push(w(65536, 2, 10));
    v
}

fn kernel_writes() -> Vec<Write> {
    let mut v = vec![w(512, 5, 4001)];
    v.extend((0..280).map(|k| w(4096, 1, 3 * k + 2)));
    v.push(w(65536, 1, 20));
    v
}

/// Writes of the COW blkstack merges: single chunks and a 16-chunk run.
fn blkstack_merge_writes() -> Vec<Write> {
    let mut v: Vec<Write> = (0..60).map(|k| w(4096, 1, 5 * k + 2)).collect();
    v.push(w(65536, 1, 30));
    v
}

/// Writes of the COW the guest merges.
fn kernel_merge_writes() -> Vec<Write> {
    let mut v: Vec<Write> = (0..50).map(|k| w(4096, 1, 4 * k + 3)).collect();
    v.push(w(512, 7, 7001));
    v
}

fn apply(img: &mut [u8], pat: &[u8], writes: &[Write]) {
    for x in writes {
        let len = x.bs * x.n;
        img[x.bs * x.seek..x.bs * x.seek + len].copy_from_slice(&pat[x.skip..x.skip + len]);
    }
}

fn dev_write(dev: &dyn Device, pat: &[u8], writes: &[Write]) {
    for x in writes {
        let len = x.bs * x.n;
        let mut b = pat[x.skip..x.skip + len].to_vec();
        let st = submit_and_wait(dev, Op::Write, (x.bs * x.seek) as u64, len as u64, &mut b);
        assert_eq!(st, Status::Ok);
    }
}

fn dd_lines(dev: &str, writes: &[Write]) -> String {
    writes
        .iter()
        .map(|x| format!("w {dev} {} {} {} {}\n", x.bs, x.n, x.seek, x.skip))
        .collect()
}

fn snap_reg(origin: &Path, cow: &Path) -> Arc<Registry> {
    snap_reg_as(origin, cow, "snapshot")
}

/// Origin and COW files, and device `s` of `target` over them.
fn snap_reg_as(origin: &Path, cow: &Path, target: &str) -> Arc<Registry> {
    let reg = Registry::new();
    let o = format!("0 {ORIGIN_SECTORS} file {}", origin.display());
    reg.create("o", &o).unwrap();
    reg.create("c", &format!("0 {COW_SECTORS} file {}", cow.display()))
        .unwrap();
    reg.create("s", &format!("0 {ORIGIN_SECTORS} {target} o c P 8"))
        .unwrap();
    reg
}

/// Poll `s`'s status until the merge is done (allocated = metadata),
/// bounded so that a merge that never ends fails the test.
fn merged_status(reg: &Registry) -> String {
    for _ in 0..3000 {
        let s = status_args(reg);
        let alloc = s.split('/').next().unwrap_or_default();
        if s.rsplit(' ').next() == Some(alloc) {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("the merge never finished: {}", status_args(reg));
}

fn status_args(reg: &Registry) -> String {
    let s = reg.status_text("s").unwrap();
    s.split_whitespace().skip(3).collect::<Vec<_>>().join(" ")
}

fn read_all(dev: &dyn Device) -> Vec<u8> {
    let mut b = vec![0u8; ORIGIN_BYTES];
    let st = submit_and_wait(dev, Op::Read, 0, ORIGIN_BYTES as u64, &mut b);
    assert_eq!(st, Status::Ok);
    b
}

fn md5(f: &Path) -> String {
    let out = Command::new("md5sum").arg(f).output().expect("md5sum");
    String::from_utf8_lossy(&out.stdout)
        .split(' ')
        .next()
        .unwrap_or("")
        .to_string()
}

const GUEST: &str = r#"
fail() { echo "FAIL: $*"; exit 1; }
dev() { cat /sys/block/$(basename $(readlink /dev/disk/by-serial/$1))/dev; }
w() { dd if=/test/pattern of=/dev/mapper/$1 bs=$2 count=$3 seek=$4 skip=$5 iflag=skip_bytes oflag=direct conv=notrunc 2>/dev/null || fail "write $*"; }
st() { dmsetup status $1 | sed 's/ *$//' | cut -d' ' -f4-; }
modprobe dm-snapshot || fail "modprobe dm-snapshot"
dmsetup create bs --table "0 ORIGIN snapshot $(dev orig) $(dev bcow) P 8" || fail "load blkstack's COW"
echo "BEGIN bstatus"; st bs; echo "END bstatus"
echo "BEGIN bmd5"; md5sum < /dev/mapper/bs; echo "END bmd5"
dmsetup remove bs || fail "remove bs"
dmsetup create ks --table "0 ORIGIN snapshot $(dev orig) $(dev kcow) P 8" || fail "a snapshot of the guest's own"
KWRITES
echo "BEGIN kstatus"; st ks; echo "END kstatus"
dmsetup remove ks || fail "remove ks"
echo "BEGIN omd5"; md5sum < /dev/disk/by-serial/orig; echo "END omd5"
dmsetup create bm --table "0 ORIGIN snapshot-merge $(dev morig) $(dev mcow) P 8" || fail "merge blkstack's COW"
for i in $(seq 600); do s=$(st bm); [ "${s%%/*}" = "${s##* }" ] && break; sleep 0.1; done
echo "BEGIN bmerged"; st bm; echo "END bmerged"
dmsetup remove bm || fail "remove bm"
echo "BEGIN bmmd5"; md5sum < /dev/disk/by-serial/morig; echo "END bmmd5"
dmsetup create ks2 --table "0 ORIGIN snapshot $(dev korig) $(dev kmcow) P 8" || fail "a snapshot to merge"
KMWRITES
dmsetup remove ks2 || fail "remove ks2"
dmsetup create km --table "0 ORIGIN snapshot-merge $(dev korig) $(dev kmcow) P 8" || fail "the guest's merge"
echo "BEGIN kmstop"; st km; echo "END kmstop"
dmsetup remove km || fail "remove km"
echo DONE
"#;

#[test]
fn the_kernel_loads_blkstacks_cow_and_blkstack_loads_the_kernels() {
    if !vm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("scratch");
    let p = |n: &str| scratch.path().join(n);
    let pat = blkstack_test_support::pattern(PAT_LEN, 39);
    std::fs::write(p("pattern"), &pat).unwrap();
    let origin = blkstack_test_support::pattern(ORIGIN_BYTES, 3);
    std::fs::write(p("orig"), &origin).unwrap();
    std::fs::write(p("morig"), &origin).unwrap();
    std::fs::write(p("korig"), &origin).unwrap();
    for name in ["bcow", "kcow", "mcow", "kmcow"] {
        let f = std::fs::File::create(p(name)).unwrap();
        f.set_len(COW_SECTORS * 512).unwrap();
    }

    // blkstack writes through its snapshot, and reads it back.
    let reg = snap_reg(&p("orig"), &p("bcow"));
    let bw = blkstack_writes();
    dev_write(&*reg.device("s").unwrap(), &pat, &bw);
    let mut expect = origin.clone();
    apply(&mut expect, &pat, &bw);
    assert!(
        read_all(&*reg.device("s").unwrap()) == expect,
        "blkstack reads its snapshot"
    );
    let ours = status_args(&reg);
    reg.remove_all();
    std::fs::write(p("expect"), &expect).unwrap();

    // blkstack writes a COW to merge, starts the merge and stops it.
    let reg = snap_reg(&p("morig"), &p("mcow"));
    let bmw = blkstack_merge_writes();
    dev_write(&*reg.device("s").unwrap(), &pat, &bmw);
    reg.remove_all();
    let reg = snap_reg_as(&p("morig"), &p("mcow"), "snapshot-merge");
    println!(
        "blkstack's merge running at {} when removed",
        status_args(&reg)
    );
    reg.remove_all();
    let mut bmerged = origin.clone();
    apply(&mut bmerged, &pat, &bmw);
    std::fs::write(p("bmerged"), &bmerged).unwrap();

    let kw = kernel_writes();
    let script = GUEST
        .replace("ORIGIN", &ORIGIN_SECTORS.to_string())
        .replace("KWRITES\n", &dd_lines("ks", &kw))
        .replace("KMWRITES\n", &dd_lines("ks2", &kernel_merge_writes()));
    let run = Vm::new()
        .disk("orig", &p("orig").display().to_string())
        .disk("bcow", &p("bcow").display().to_string())
        .disk("kcow", &p("kcow").display().to_string())
        .disk("morig", &p("morig").display().to_string())
        .disk("mcow", &p("mcow").display().to_string())
        .disk("korig", &p("korig").display().to_string())
        .disk("kmcow", &p("kmcow").display().to_string())
        .file(&p("pattern"), "/test/pattern")
        .timeout(240)
        .run(&script);
    println!("{}", run.out);
    run.assert_ok("the kernel's dm-snapshot over blkstack's COW, then its own");
    assert!(run.out.contains("DONE"), "{}", run.out);
    assert_eq!(
        run.section("bmd5").unwrap_or_default().trim(),
        format!("{}  -", md5(&p("expect"))),
        "the kernel reads blkstack's snapshot as blkstack wrote it"
    );
    assert_eq!(
        run.section("bstatus").unwrap_or_default().trim(),
        ours,
        "the kernel's status of blkstack's COW (right) and blkstack's (left)"
    );
    assert_eq!(
        run.section("omd5").unwrap_or_default().trim(),
        format!("{}  -", md5(&p("orig"))),
        "the guest sees the origin image as it is"
    );
    assert!(
        std::fs::read(p("orig")).unwrap() == origin,
        "neither side wrote to the origin"
    );
    assert_eq!(
        run.section("bmmd5").unwrap_or_default().trim(),
        format!("{}  -", md5(&p("bmerged"))),
        "the kernel finished blkstack's merge: the origin holds the snapshot"
    );
    assert_eq!(
        run.section("bmerged").unwrap_or_default().trim(),
        "16/4096 16",
        "the kernel's status after the merge"
    );

    // blkstack loads the kernel's COW and reads what the guest wrote.
    let reg = snap_reg(&p("orig"), &p("kcow"));
    let mut kexpect = origin.clone();
    apply(&mut kexpect, &pat, &kw);
    assert!(
        read_all(&*reg.device("s").unwrap()) == kexpect,
        "blkstack reads the kernel's snapshot as the guest wrote it"
    );
    assert_eq!(
        status_args(&reg),
        run.section("kstatus").unwrap_or_default().trim(),
        "blkstack's status of the kernel's COW (left) and the kernel's (right)"
    );
    reg.remove_all();

    // blkstack finishes the merge the guest started and stopped.
    println!(
        "the kernel's merge stopped at {}",
        run.section("kmstop").unwrap_or_default().trim()
    );
    let reg = snap_reg_as(&p("korig"), &p("kmcow"), "snapshot-merge");
    assert_eq!(
        merged_status(&reg),
        "16/4096 16",
        "blkstack's status after the merge"
    );
    reg.remove_all();
    let mut kmerged = origin.clone();
    apply(&mut kmerged, &pat, &kernel_merge_writes());
    assert!(
        std::fs::read(p("korig")).unwrap() == kmerged,
        "blkstack finished the kernel's merge: the origin holds the snapshot"
    );
}
