//! dm-era metadata both ways, judged by the kernel in one VM boot: the
//! guest's dm-era activates metadata blkstack wrote (eras, a
//! checkpoint, an archived writeset), shows the era and metadata size
//! blkstack shows for the same metadata, and once the digest of the
//! archived writesets is done and committed the same status, used
//! metadata blocks included (both allocate in the kernel's order), reads the origin as blkstack
//! wrote it, writes more, checkpoints and takes a metadata snapshot;
//! `era_check` passes on what the kernel left, `era_invalidate` lists
//! blkstack's and the guest's writes by era, and blkstack opens it,
//! shows the era the kernel would, and drops the kernel's snapshot. The
//! guest also formats metadata of its own, which blkstack and
//! `era_check` open afterwards, and activates metadata a `kill -9` of
//! `blkstack serve` left mid-era, finding every completed write marked.

mod kernel_vm_support;

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Op, Status};
use blkstack_mapped::Registry;
use blkstack_test_support::{era_written_since, pdata_tool_ok, Serve};
use kernel_vm_support::*;
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

const META_SECTORS: u64 = 8192;
const DATA_SECTORS: u64 = 32768;
const BLOCK: u64 = 65536;

fn era_reg(meta: &Path, data: &Path) -> Arc<Registry> {
    let reg = Registry::new();
    reg.create("meta", &format!("0 {META_SECTORS} file {}", meta.display()))
        .unwrap();
    reg.create("data", &format!("0 {DATA_SECTORS} file {}", data.display()))
        .unwrap();
    reg.create("era", &format!("0 {DATA_SECTORS} era meta data 128"))
        .unwrap();
    reg
}

fn status_args(reg: &Registry) -> Vec<String> {
    let s = reg.status_text("era").unwrap();
    s.split_whitespace().skip(3).map(String::from).collect()
}

fn write_block(reg: &Registry, b: u64, fill: u8) {
    let dev = reg.device("era").unwrap();
    let mut buf = vec![fill; 4096];
    let st = submit_and_wait(&*dev, Op::Write, b * BLOCK, 4096, &mut buf);
    assert_eq!(st, Status::Ok);
}

fn read_block(reg: &Registry, b: u64) -> Vec<u8> {
    let dev = reg.device("era").unwrap();
    let mut buf = vec![0u8; 4096];
    let st = submit_and_wait(&*dev, Op::Read, b * BLOCK, 4096, &mut buf);
    assert_eq!(st, Status::Ok);
    buf
}

const GUEST: &str = r#"
fail() { echo "FAIL: $*"; exit 1; }
dev() { cat /sys/block/$(basename $(readlink /dev/disk/by-serial/$1))/dev; }
st() { dmsetup status $1 | sed 's/ *$//' | cut -d' ' -f4-; }
w() { dd if=/test/fill-$3 of=/dev/mapper/$1 bs=4096 count=1 seek=$(($2 * 16)) oflag=direct conv=notrunc 2>/dev/null || fail "write $*"; }
r() { dd if=/dev/mapper/$1 bs=4096 count=1 skip=$(($2 * 16)) iflag=direct 2>/dev/null | md5sum; }
modprobe dm-era || fail "modprobe dm-era"
dmsetup create bera --table "0 DATA era $(dev bmeta) $(dev bdata) 128" || fail "activate blkstack's era"
echo "BEGIN bstatus"; st bera; echo "END bstatus"
echo "BEGIN settled"; sleep 2; st bera; sleep 1; st bera; echo "END settled"
echo "BEGIN bread"; r bera 1; r bera 7; echo "END bread"
w bera 20 k
dmsetup message bera 0 checkpoint || fail checkpoint
w bera 30 k
dmsetup message bera 0 take_metadata_snap || fail take_metadata_snap
echo "BEGIN bstatus2"; st bera; echo "END bstatus2"
dmsetup remove bera || fail "remove bera"
dmsetup create kera --table "0 DATA era $(dev kmeta) $(dev kdata) 128" || fail "format kmeta"
w kera 3 q
dmsetup message kera 0 checkpoint || fail "kera checkpoint"
echo "BEGIN kstatus"; st kera; echo "END kstatus"
dmsetup remove kera || fail "remove kera"
dmsetup create cera --table "0 DATA era $(dev cmeta) $(dev cdata) 128" || fail "activate what kill -9 left"
echo "BEGIN cstatus"; st cera; echo "END cstatus"
dmsetup message cera 0 take_metadata_snap || fail "cera take_metadata_snap"
dmsetup remove cera || fail "remove cera"
echo DONE
"#;

#[test]
fn the_kernel_reads_blkstacks_era_metadata_and_blkstack_reads_the_kernels() {
    if !vm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("scratch");
    let p = |n: &str| scratch.path().join(n);
    for (name, sectors) in [
        ("bmeta", META_SECTORS),
        ("bdata", DATA_SECTORS),
        ("kmeta", META_SECTORS),
        ("kdata", DATA_SECTORS),
        ("cmeta", META_SECTORS),
        ("cdata", DATA_SECTORS),
    ] {
        let f = std::fs::File::create(p(name)).unwrap();
        f.set_len(sectors * 512).unwrap();
    }

    // blkstack: era 1 writes blocks 1 and 5, era 2 block 7; removal
    // archives era 2.
    let reg = era_reg(&p("bmeta"), &p("bdata"));
    write_block(&reg, 1, b'a');
    write_block(&reg, 5, b'a');
    reg.message("era", 0, &["checkpoint"]).unwrap();
    write_block(&reg, 7, b'b');
    assert_eq!(status_args(&reg)[2], "2");
    reg.remove_all();
    pdata_tool_ok("era_check", &[], &p("bmeta"));
    // What blkstack shows opening this metadata (a copy, left as it is).
    std::fs::copy(p("bmeta"), p("bmeta-copy")).unwrap();
    std::fs::copy(p("bdata"), p("bdata-copy")).unwrap();
    let reg = era_reg(&p("bmeta-copy"), &p("bdata-copy"));
    let ours_on_open = status_args(&reg).join(" ");
    let mut ours_settled = ours_on_open.clone();
    for _ in 0..50 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let now = status_args(&reg).join(" ");
        if now == ours_settled {
            break;
        }
        ours_settled = now;
    }
    reg.remove_all();

    killed_mid_era(&p("cmeta"), &p("cdata"));
    for fill in ["k", "q"] {
        std::fs::write(p(&format!("fill-{fill}")), fill.repeat(4096)).unwrap();
    }
    let script = GUEST.replace("DATA", &DATA_SECTORS.to_string());
    let run = Vm::new()
        .file(&p("fill-k"), "/test/fill-k")
        .file(&p("fill-q"), "/test/fill-q")
        .disk("bmeta", &p("bmeta").display().to_string())
        .disk("bdata", &p("bdata").display().to_string())
        .disk("kmeta", &p("kmeta").display().to_string())
        .disk("kdata", &p("kdata").display().to_string())
        .disk("cmeta", &p("cmeta").display().to_string())
        .disk("cdata", &p("cdata").display().to_string())
        .timeout(300)
        .run(&script);
    println!("{}", run.out);
    run.assert_ok("the kernel's dm-era over blkstack's metadata, then its own");
    assert!(run.out.contains("DONE"), "{}", run.out);

    let kernel_on_open = run.section("bstatus").unwrap_or_default();
    let (k, o): (Vec<&str>, Vec<&str>) = (
        kernel_on_open.split_whitespace().collect(),
        ours_on_open.split_whitespace().collect(),
    );
    assert_eq!(k.len(), 4, "{kernel_on_open}");
    assert_eq!(
        (k[0], k[2], k[3]),
        ("8", "3", "-"),
        "the kernel opens blkstack's era 2 archived and starts era 3"
    );
    assert_eq!(
        (o[0], o[2], o[3]),
        (k[0], k[2], k[3]),
        "blkstack's status on the same metadata"
    );
    let total = |s: &str| s.split('/').nth(1).unwrap_or("").to_string();
    assert_eq!(total(k[1]), total(o[1]), "metadata blocks in all");
    // The first status counts the blocks the worker's digest took since
    // the last commit, as far as it got (timing); once the digest is done
    // and a status has committed, the count is settled on both sides.
    println!(
        "used metadata blocks at open: kernel {} blkstack {}",
        k[1], o[1]
    );
    let ksettled = run.section("settled").unwrap_or_default();
    let ksettled = ksettled
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_string();
    assert_eq!(
        ours_settled, ksettled,
        "era status once the digest is done and committed (used metadata blocks included): blkstack's (left), the kernel's (right)"
    );
    let md5 = |fill: u8| {
        let mut c = Command::new("md5sum")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("md5sum");
        use std::io::Write;
        c.stdin.take().unwrap().write_all(&[fill; 4096]).unwrap();
        let out = c.wait_with_output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(
        run.section("bread").unwrap_or_default().trim(),
        format!("{}\n{}", md5(b'a'), md5(b'b')),
        "the kernel reads the origin as blkstack wrote it"
    );
    let s2: Vec<String> = run
        .section("bstatus2")
        .unwrap_or_default()
        .split_whitespace()
        .map(String::from)
        .collect();
    assert_eq!(s2.get(2).map(String::as_str), Some("5"), "{s2:?}");
    assert_ne!(s2.get(3).map(String::as_str), Some("-"), "{s2:?}");

    // What the kernel left: era_check, eras by block, and blkstack on it.
    pdata_tool_ok("era_check", &[], &p("bmeta"));
    assert_eq!(
        era_written_since(&p("bmeta"), 1),
        BTreeSet::from([1, 5, 7, 20, 30])
    );
    assert_eq!(
        era_written_since(&p("bmeta"), 2),
        BTreeSet::from([7, 20, 30])
    );
    assert_eq!(era_written_since(&p("bmeta"), 4), BTreeSet::from([30]));
    let reg = era_reg(&p("bmeta"), &p("bdata"));
    let s = status_args(&reg);
    assert_eq!(
        s[2], "6",
        "removal archived era 5, blkstack starts 6: {s:?}"
    );
    assert_eq!(s[3], s2[3], "the kernel's held snapshot: {s:?}");
    assert_eq!(read_block(&reg, 20), vec![b'k'; 4096]);
    reg.message("era", 0, &["drop_metadata_snap"])
        .expect("blkstack drops the kernel's snapshot");
    reg.remove_all();
    pdata_tool_ok("era_check", &[], &p("bmeta"));

    // Metadata the kernel formatted.
    let ks = run.section("kstatus").unwrap_or_default();
    assert_eq!(ks.split_whitespace().nth(2), Some("2"), "{ks}");
    pdata_tool_ok("era_check", &[], &p("kmeta"));
    let reg = era_reg(&p("kmeta"), &p("kdata"));
    assert_eq!(status_args(&reg)[2], "3");
    assert_eq!(read_block(&reg, 3), vec![b'q'; 4096]);
    reg.message("era", 0, &["take_metadata_snap"]).unwrap();
    reg.remove_all();
    assert_eq!(era_written_since(&p("kmeta"), 1), BTreeSet::from([3]));
    pdata_tool_ok("era_check", &[], &p("kmeta"));

    // What kill -9 left: the kernel archived the crashed era 1.
    let cs = run.section("cstatus").unwrap_or_default();
    assert_eq!(cs.split_whitespace().nth(2), Some("2"), "{cs}");
    pdata_tool_ok("era_check", &[], &p("cmeta"));
    assert_eq!(
        era_written_since(&p("cmeta"), 1),
        BTreeSet::from(KILLED_WRITES),
        "every write completed before the kill is marked"
    );
}

/// Blocks written through NBD before `kill -9` of the server.
const KILLED_WRITES: [u64; 3] = [2, 9, 77];

/// `blkstack serve` with an era device over `meta` and `data`, written
/// through its NBD export, then killed with SIGKILL (no suspend, no
/// archive: the current era's writeset is left as committed).
fn killed_mid_era(meta: &Path, data: &Path) {
    let stack = format!(
        "meta,,,rw,0 {META_SECTORS} file {};data,,,rw,0 {DATA_SECTORS} file {};\
         era,,,rw,0 {DATA_SECTORS} era meta data 128",
        meta.display(),
        data.display()
    );
    let srv = Serve::start(&stack, "era");
    let reg = Registry::new();
    reg.create(
        "remote",
        &format!(
            "0 {DATA_SECTORS} nbd {} dead_timeout_ms=500",
            srv.uri("era")
        ),
    )
    .expect("connect to the era export");
    let dev = reg.device("remote").unwrap();
    for b in KILLED_WRITES {
        let mut buf = vec![b as u8; 4096];
        let st = submit_and_wait(&*dev, Op::Write, b * BLOCK, 4096, &mut buf);
        assert_eq!(st, Status::Ok);
    }
    let killed = Command::new("kill")
        .args(["-9", &srv.pid().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success(), "kill -9");
    drop(dev);
    reg.remove_all();
    drop(srv);
    pdata_tool_ok("era_check", &[], meta);
}
