//! dm-cache metadata both ways, judged by the kernel in one VM boot: the
//! guest's dm-cache activates caches blkstack wrote (formats 1 and 2,
//! dirty blocks included, after a clean shutdown), shows the status
//! blkstack shows for the same metadata and reads the data blkstack
//! wrote; the kernel's cleaner policy then writes blkstack's dirty blocks
//! back to the origin. The reverse: the guest formats a cache of its own
//! and leaves dirty blocks, which `cache_check` passes and blkstack
//! opens with the kernel's status, reads and cleans. And what `kill -9`
//! left: before the boot `blkstack serve` runs a cache (formats 1 and
//! 2, writeback, smq) under writes, reads and flushes, and is killed
//! inside a metadata commit (cache_crash_support: a metadata write, or
//! flush, held); `cache_check` passes and blkstack reads every flushed
//! write from a copy. In the guest the kernel's dm-cache activates that
//! metadata, cache and origin (dm-linear slices of one disk) with every
//! cached block dirty, blkstack's status, reads the written quarter of
//! the origin byte for byte as blkstack does, and its cleaner writes it
//! all back to the origin.

mod cache_crash_support;
mod kernel_vm_support;

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Op, Status};
use blkstack_mapped::Registry;
use blkstack_test_support::pdata_tool_ok;
use cache_crash_support::{
    cache_check, Crash, KillAt, BLOCK, CACHE_SECTORS, HOT_BLOCKS, META_SECTORS, ORIGIN_SECTORS,
};
use kernel_vm_support::*;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Blocks blkstack caches; the first four are written again (dirty).
const HOT: [u64; 6] = [3, 9, 40, 41, 100, 200];

fn cache_reg(dir: &Path, set: &str, features: &str, policy: &str) -> Arc<Registry> {
    let reg = Registry::new();
    for (dev, sectors) in [
        ("meta", META_SECTORS),
        ("cache", CACHE_SECTORS),
        ("orig", ORIGIN_SECTORS),
    ] {
        let path = dir.join(format!("{set}{dev}"));
        reg.create(dev, &format!("0 {sectors} file {}", path.display()))
            .unwrap();
    }
    reg.create(
        "c",
        &format!("0 {ORIGIN_SECTORS} cache meta cache orig 128 {features} {policy}"),
    )
    .unwrap();
    reg
}

fn status_args(reg: &Registry) -> Vec<String> {
    let s = reg.status_text("c").unwrap();
    s.split_whitespace().skip(3).map(String::from).collect()
}

fn fill(b: u64, tag: u8) -> u8 {
    (b as u8).wrapping_mul(7).wrapping_add(tag)
}

fn write_block(reg: &Registry, b: u64, byte: u8) {
    let dev = reg.device("c").unwrap();
    let mut buf = vec![byte; BLOCK as usize];
    let st = submit_and_wait(&*dev, Op::Write, b * BLOCK, BLOCK, &mut buf);
    assert_eq!(st, Status::Ok);
}

fn read_4k(reg: &Registry, b: u64) -> Vec<u8> {
    let dev = reg.device("c").unwrap();
    let mut buf = vec![0u8; 4096];
    let st = submit_and_wait(&*dev, Op::Read, b * BLOCK, 4096, &mut buf);
    assert_eq!(st, Status::Ok);
    buf
}

fn md5(byte: u8) -> String {
    let mut c = Command::new("md5sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("md5sum");
    use std::io::Write;
    c.stdin.take().unwrap().write_all(&[byte; 4096]).unwrap();
    let out = c.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The first 4 KiB of origin block `b` in the origin file.
fn origin_byte(dir: &Path, set: &str, b: u64) -> Vec<u8> {
    let raw = std::fs::read(dir.join(format!("{set}orig"))).unwrap();
    raw[(b * BLOCK) as usize..(b * BLOCK + 4096) as usize].to_vec()
}

/// blkstack's cache on set `set`: the hot blocks promoted, four of them
/// written again (dirty), removed cleanly; returns what blkstack's status
/// shows opening (a copy of) that metadata.
fn blkstack_writes(dir: &Path, set: &str, features: &str) -> Vec<String> {
    let reg = cache_reg(dir, set, features, "smq 0");
    for b in HOT {
        write_block(&reg, b, fill(b, 1));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    // Promotions done (residency counts the ones still queued).
    while status_args(&reg)[9] != HOT.len().to_string() {
        assert!(Instant::now() < deadline, "{:?}", status_args(&reg));
        std::thread::sleep(Duration::from_millis(5));
    }
    for b in &HOT[..4] {
        write_block(&reg, *b, fill(*b, 2));
    }
    assert_eq!(status_args(&reg)[10], "4");
    reg.remove_all();
    pdata_tool_ok("cache_check", &[], &dir.join(format!("{set}meta")));
    for dev in ["meta", "cache", "orig"] {
        let (from, to) = (format!("{set}{dev}"), format!("copy{dev}"));
        std::fs::copy(dir.join(from), dir.join(to)).unwrap();
    }
    let reg = cache_reg(dir, "copy", features, HELD);
    let s = status_args(&reg);
    reg.remove_all();
    s
}

/// The policy with migrations held off: an idle cache writes dirty
/// blocks back at once, so the first status must come before any.
const HELD: &str = "smq 2 migration_threshold 0";

const GUEST: &str = r#"
fail() { echo "FAIL: $*"; exit 1; }
dev() {
  if [ -e /dev/mapper/$1 ]; then echo /dev/mapper/$1; return; fi
  cat /sys/block/$(basename $(readlink /dev/disk/by-serial/$1))/dev
}
st() { dmsetup status $1 | sed 's/ *$//' | cut -d' ' -f4-; }
r() { dd if=/dev/mapper/$1 bs=4096 count=1 skip=$(($2 * 16)) iflag=direct 2>/dev/null | md5sum; }
w() { dd if=/test/fill-$3 of=/dev/mapper/$1 bs=65536 count=1 seek=$2 oflag=direct conv=notrunc 2>/dev/null || fail "write $*"; }
tbl() { echo "0 ORIG cache $(dev ${1}meta) $(dev ${1}cache) $(dev ${1}orig) 128 $2 $3"; }
clean() {
  dmsetup create $1 --table "$(tbl $1 "$2" "cleaner 0")" || fail "cleaner on $1"
  i=0
  while [ "$(st $1 | cut -d' ' -f11)" != 0 ]; do
    i=$((i + 1)); [ $i -gt 200 ] && fail "cleaner left $1 dirty: $(st $1)"; sleep 0.05
  done
  dmsetup remove $1 || fail "remove cleaned $1"
}
modprobe dm-cache || fail "modprobe dm-cache"
modprobe dm-cache-smq || fail "modprobe dm-cache-smq"
for s in b c; do
  f="1 metadata2"; [ $s = c ] && f="1 writeback"
  dmsetup create $s --table "$(tbl $s "$f" "HELD")" || fail "activate blkstack's cache $s"
  echo "BEGIN ${s}status"; st $s; echo "END ${s}status"
  echo "BEGIN ${s}read"; for b in HOT; do r $s $b; done; echo "END ${s}read"
  dmsetup remove $s || fail "remove $s"
  clean $s "$f"
done
dmsetup create k --table "$(tbl k 0 "HELD")" || fail "format kmeta"
for b in 2 11 50; do w k $b p; done
for b in 2 11; do w k $b q; done
echo "BEGIN kstatus"; st k; echo "END kstatus"
dmsetup remove k || fail "remove k"
killed() {
  s=$1; d=$(dev ${s}img); at=0
  for p in "meta META" "cache CSEC" "orig ORIG"; do
    set -- $p
    dmsetup create $s$1 --table "0 $2 linear $d $at" || fail "slice $s$1"
    at=$((at + $2))
  done
  dmsetup create $s --table "$(tbl $s "$f" "HELD")" || fail "activate what kill -9 left in $s"
  echo "BEGIN ${s}status"; st $s; echo "END ${s}status"
  dd if=/dev/mapper/$s of=/dev/disk/by-serial/${s}img bs=65536 count=HOTN seek=$((at / 128)) \
    iflag=direct oflag=direct conv=notrunc 2>/dev/null || fail "read $s"
  dmsetup remove $s || fail "remove $s"
  clean $s "$f"
  dmsetup remove ${s}meta ${s}cache ${s}orig || fail "remove the slices of $s"
}
f="1 writeback"; killed x
f="2 metadata2 writeback"; killed y
echo DONE
"#;

/// A cache `blkstack serve` was killed in, as handed to the guest.
struct Killed {
    crash: Crash,
    /// blkstack's status opening a copy of what the kill left.
    ours: Vec<String>,
    /// The hot quarter of the cache device as blkstack reads it there.
    seen: Vec<u8>,
    /// Written blocks whose origin copy is not what reads back: they
    /// must be dirty in the cache.
    min_dirty: usize,
}

/// The guest's disk `{name}img`: metadata, cache, origin, then room for
/// the hot quarter as the guest's dm-cache reads it.
const SLICES: [(&str, u64); 4] = [
    ("meta", META_SECTORS),
    ("cdev", CACHE_SECTORS),
    ("origin", ORIGIN_SECTORS),
    ("out", HOT_BLOCKS * BLOCK / 512),
];

/// `blkstack serve` over a cache in `dir/name`, killed at `at`; what
/// blkstack reads from a copy, judged against the flushed writes; the
/// guest's disk image made of it.
fn killed_in_serve(dir: &Path, name: &str, features: &str, at: KillAt, early: bool) -> Killed {
    let (set, copy) = (dir.join(name), dir.join(format!("{name}copy")));
    std::fs::create_dir_all(&set).unwrap();
    std::fs::create_dir_all(&copy).unwrap();
    let mut crash = Crash::new(&set, features, 0x5eed_0001 + early as u64);
    // Armed early, the cache still fills and the commit held is a
    // migration's; armed later it is full, nothing migrates and it is
    // mostly a suspend's (cache_crash_support), whose format 2 dirty
    // bitset is rewritten.
    let k = crash.round_after(at, if early { 2 } else { 16 });
    println!(
        "{name}: killed at {:?} (suspend asked for: {}) after {} flushes ({})",
        k.at, k.by_suspend, k.flushes, k.status
    );
    for f in ["meta", "cdev", "origin"] {
        std::fs::copy(set.join(f), copy.join(f)).unwrap();
    }
    let reg = crash.open_in(&copy, HELD);
    let ours = status_args(&reg);
    let dev = reg.device("c").unwrap();
    let mut seen = vec![0u8; (HOT_BLOCKS * BLOCK) as usize];
    for (b, chunk) in seen.chunks_mut(BLOCK as usize).enumerate() {
        let st = submit_and_wait(&*dev, Op::Read, b as u64 * BLOCK, BLOCK, chunk);
        assert_eq!(st, Status::Ok);
    }
    drop(dev);
    reg.remove_all();
    let at4k = |v: &[u8], b: u64| v[(b * BLOCK) as usize..(b * BLOCK + 4096) as usize].to_vec();
    crash.settle(&format!("{name}: blkstack on what kill -9 left"), |b| {
        at4k(&seen, b)
    });
    let origin = std::fs::read(set.join("origin")).unwrap();
    let min_dirty = crash
        .blocks()
        .iter()
        .filter(|&&b| at4k(&origin, b) != at4k(&seen, b))
        .count();
    let mut image = Vec::new();
    for (f, sectors) in SLICES {
        let mut v = std::fs::read(set.join(f)).unwrap_or_default();
        v.resize((sectors * 512) as usize, 0);
        image.extend(v);
    }
    std::fs::write(dir.join(format!("{name}img")), image).unwrap();
    Killed {
        crash,
        ours,
        seen,
        min_dirty,
    }
}

/// The guest's image split back into the cache's files; the guest's
/// read of the hot quarter.
fn unpack(dir: &Path, name: &str, set: &Path) -> Vec<u8> {
    let image = std::fs::read(dir.join(format!("{name}img"))).unwrap();
    let mut at = 0;
    let mut out = Vec::new();
    for (f, sectors) in SLICES {
        let part = &image[at..at + (sectors * 512) as usize];
        at += part.len();
        if f == "out" {
            out = part.to_vec();
        } else {
            std::fs::write(set.join(f), part).unwrap();
        }
    }
    out
}

/// What the kernel made of a cache `kill -9` left.
fn judge_killed(run: &VmRun, dir: &Path, name: &str, k: &Killed) {
    let kernel = run.section(&format!("{name}status")).unwrap_or_default();
    let ks: Vec<&str> = kernel.split_whitespace().collect();
    let o: Vec<&str> = k.ours.iter().map(String::as_str).collect();
    assert!(ks.len() > 10, "{name}: {kernel}");
    println!(
        "{name}: kernel status {kernel}; blkstack's {}; at least {} dirty",
        o.join(" "),
        k.min_dirty
    );
    let resident = ks[3].split('/').next().unwrap_or("");
    assert_eq!(
        ks[10], resident,
        "{name}: after a crash the kernel loads every cached block dirty"
    );
    let dirty: usize = ks[10].parse().unwrap_or(0);
    assert!(
        dirty > 0 && dirty >= k.min_dirty,
        "{name}: {dirty} dirty, but {} written blocks read back what the origin does not hold",
        k.min_dirty
    );
    assert_eq!(
        (&ks[..1], &ks[2..]),
        (&o[..1], &o[2..]),
        "{name}: the kernel's status on what kill -9 left is blkstack's"
    );
    assert_eq!(ks[1], o[1], "{name}: metadata blocks used/in all");
    let set = dir.join(name);
    let out = unpack(dir, name, &set);
    assert!(
        out == k.seen,
        "{name}: the kernel reads the cache kill -9 left as blkstack does"
    );
    cache_check(&k.crash.meta());
    let origin = std::fs::read(set.join("origin")).unwrap();
    assert!(
        origin[..out.len()] == out[..],
        "{name}: the kernel's cleaner wrote every block back to the origin"
    );
    let reg = k.crash.open_here(HELD);
    assert_eq!(status_args(&reg)[10], "0", "{name}: cleaned by the kernel");
    reg.remove_all();
}

#[test]
fn the_kernel_reads_blkstacks_cache_metadata_and_blkstack_reads_the_kernels() {
    if !vm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("scratch");
    let dir = scratch.path();
    for set in ["b", "c", "k"] {
        for (dev, sectors) in [
            ("meta", META_SECTORS),
            ("cache", CACHE_SECTORS),
            ("orig", ORIGIN_SECTORS),
        ] {
            let f = std::fs::File::create(dir.join(format!("{set}{dev}"))).unwrap();
            f.set_len(sectors * 512).unwrap();
        }
    }
    let ours_b = blkstack_writes(dir, "b", "1 metadata2");
    let ours_c = blkstack_writes(dir, "c", "1 writeback");
    let killed_x = killed_in_serve(dir, "x", "1 writeback", KillAt::HeldWrite, true);
    let killed_y = killed_in_serve(dir, "y", "2 metadata2 writeback", KillAt::HeldFlush, false);
    // Dirty blocks are in the cache only.
    assert_eq!(origin_byte(dir, "b", 3), vec![fill(3, 1); 4096]);
    for (name, byte) in [("p", b'p'), ("q", b'q')] {
        std::fs::write(dir.join(format!("fill-{name}")), vec![byte; BLOCK as usize]).unwrap();
    }
    let hot: Vec<String> = HOT.iter().map(|b| b.to_string()).collect();
    let script = GUEST
        .replace("ORIG", &ORIGIN_SECTORS.to_string())
        .replace("META", &META_SECTORS.to_string())
        .replace("CSEC", &CACHE_SECTORS.to_string())
        .replace("HOTN", &HOT_BLOCKS.to_string())
        .replace("HOT", &hot.join(" "))
        .replace("HELD", HELD);
    let mut vm = Vm::new()
        .file(&dir.join("fill-p"), "/test/fill-p")
        .file(&dir.join("fill-q"), "/test/fill-q");
    for set in ["b", "c", "k"] {
        for dev in ["meta", "cache", "orig"] {
            let name = format!("{set}{dev}");
            vm = vm.disk(&name, &dir.join(&name).display().to_string());
        }
    }
    for set in ["x", "y"] {
        let name = format!("{set}img");
        vm = vm.disk(&name, &dir.join(&name).display().to_string());
    }
    let run = vm.timeout(300).run(&script);
    println!("{}", run.out);
    run.assert_ok("the kernel's dm-cache over blkstack's caches, then its own");
    assert!(run.out.contains("DONE"), "{}", run.out);

    for (set, ours) in [("b", &ours_b), ("c", &ours_c)] {
        let kernel = run.section(&format!("{set}status")).unwrap_or_default();
        let k: Vec<&str> = kernel.split_whitespace().collect();
        let o: Vec<&str> = ours.iter().map(String::as_str).collect();
        println!(
            "used metadata blocks ({set}): kernel {} blkstack {}",
            k[1], o[1]
        );
        // Both sides allocate metadata blocks in the kernel's order, so
        // the used count matches too, not only the total.
        assert_eq!(k[1], o[1], "metadata blocks used/in all ({set})");
        assert_eq!(
            k[10], "4",
            "the kernel loads blkstack's dirty blocks: {kernel}"
        );
        assert_eq!(
            (&k[..1], &k[2..]),
            (&o[..1], &o[2..]),
            "the kernel's status on blkstack's metadata ({set}) is blkstack's"
        );
        let want: Vec<String> = HOT
            .iter()
            .enumerate()
            .map(|(i, &b)| md5(fill(b, if i < 4 { 2 } else { 1 })))
            .collect();
        assert_eq!(
            run.section(&format!("{set}read"))
                .unwrap_or_default()
                .trim(),
            want.join("\n"),
            "the kernel reads the cache ({set}) as blkstack wrote it"
        );
        // The kernel's cleaner wrote blkstack's dirty blocks back.
        for (i, &b) in HOT.iter().enumerate() {
            let tag = if i < 4 { 2 } else { 1 };
            assert_eq!(
                origin_byte(dir, set, b),
                vec![fill(b, tag); 4096],
                "{set} {b}"
            );
        }
        pdata_tool_ok("cache_check", &[], &dir.join(format!("{set}meta")));
        let reg = cache_reg(dir, set, "0", HELD);
        assert_eq!(status_args(&reg)[10], "0", "cleaned by the kernel");
        reg.remove_all();
    }

    judge_killed(&run, dir, "x", &killed_x);
    judge_killed(&run, dir, "y", &killed_y);

    // The kernel's own cache, left with dirty blocks.
    let kernel = run.section("kstatus").unwrap_or_default();
    let k: Vec<&str> = kernel.split_whitespace().collect();
    pdata_tool_ok("cache_check", &[], &dir.join("kmeta"));
    let reg = cache_reg(dir, "k", "0", HELD);
    let o = status_args(&reg);
    assert_eq!(
        (o[3].as_str(), o[10].as_str()),
        (k[3], k[10]),
        "{kernel} / {o:?}"
    );
    assert_ne!(k[10], "0", "the kernel left dirty blocks: {kernel}");
    assert_eq!(read_4k(&reg, 2), vec![b'q'; 4096]);
    assert_eq!(read_4k(&reg, 11), vec![b'q'; 4096]);
    assert_eq!(read_4k(&reg, 50), vec![b'p'; 4096]);
    reg.remove_all();
    let reg = cache_reg(dir, "k", "0", "cleaner 0");
    let deadline = Instant::now() + Duration::from_secs(30);
    while status_args(&reg)[10] != "0" {
        assert!(Instant::now() < deadline, "{:?}", status_args(&reg));
        std::thread::sleep(Duration::from_millis(10));
    }
    reg.remove_all();
    pdata_tool_ok("cache_check", &[], &dir.join("kmeta"));
    assert_eq!(origin_byte(dir, "k", 2), vec![b'q'; 4096]);
    assert_eq!(origin_byte(dir, "k", 50), vec![b'p'; 4096]);
}
