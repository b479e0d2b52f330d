//! blkstack's `verity` beside the kernel's dm-verity (Linux 6.12) in the
//! kernel VM, over one tree `blkstack verity format` built: the guest's
//! dm-verity, with the table blkstack uses, reads the data back exactly
//! and prints the same table; a flipped data byte and a flipped digest
//! each fail the same reads with EIO and turn `status` to `C` on both
//! stacks; with `ignore_corruption` both return the data and say `C`.
//! One boot, a few reads.

mod kernel_vm_support;

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Op, Status};
use blkstack_mapped::Registry;
use blkstack_test_support::pattern_file;
use kernel_vm_support::*;
use std::path::Path;
use std::process::Command;

const SALT: &str = "5eed0038";
/// 4 MiB: 1024 data blocks, two tree levels.
const DATA_LEN: u64 = 4 << 20;
const SECTORS: u64 = DATA_LEN / 512;
/// Where each case flips a byte: data block 300, and data block 1's
/// digest in the first level-0 hash block (hash block 2).
const DATA_FLIP: u64 = 300 * 4096 + 17;
const HASH_FLIP: u64 = 2 * 4096 + 40;
/// Data blocks each case reads, one at a time.
const READS: [u64; 4] = [0, 1, 200, 300];

/// The guest: `dmsetup create -r` with the table (`$D`/`$H` the disks),
/// the table text, each read's outcome, the status.
const GUEST: &str = r#"
modprobe dm-verity || { echo "FAIL: modprobe dm-verity"; exit 1; }
num() { cat /sys/block/$(basename $(readlink /dev/disk/by-serial/$1))/dev; }
case_run() { # NAME DATA-DISK HASH-DISK OPTS...
  name=$1; D=$(num $2); H=$(num $3); shift 3
  echo "0 SECTORS verity 1 $D $H 4096 4096 BLOCKS 1 sha256 ROOT SALT $*" | dmsetup create -r kv || { echo "$name create: refused"; return; }
  t=$(dmsetup table kv); t=${t/ $D / DATA }; echo "$name table: ${t/ $H / HASH }"
  for b in READS; do
    if dd if=/dev/mapper/kv of=/tmp/r bs=4096 count=1 skip=$b iflag=direct 2>/dev/null; then
      set -- $(md5sum /tmp/r); echo "$name read $b: ok $1"
    else echo "$name read $b: error"; fi
  done
  echo "$name status: $(dmsetup status kv)"
  [ "$name" = clean ] && { set -- $(dd if=/dev/mapper/kv bs=64k iflag=direct 2>/dev/null | md5sum); echo "whole: $1"; }
  dmsetup remove kv
}
case_run clean vdata vhash
case_run data bdata vhash
case_run data-ignore bdata vhash 1 ignore_corruption
case_run hash vdata bhash
"#;

fn md5(b: &[u8]) -> String {
    let d = <md5::Md5 as md5::Digest>::digest(b);
    d.iter().map(|x| format!("{x:02x}")).collect()
}

fn flip(path: &Path, off: u64) {
    let mut b = std::fs::read(path).unwrap();
    b[off as usize] ^= 1;
    std::fs::write(path, b).unwrap();
}

/// blkstack's side of one case, in the guest's words.
fn ours(name: &str, data: &Path, hash: &Path, root: &str, opts: &str) -> Vec<String> {
    let reg = Registry::new();
    let hs = std::fs::metadata(hash).unwrap().len() / 512;
    reg.create("vdata", &format!("0 {SECTORS} file {}", data.display()))
        .unwrap();
    reg.create("vhash", &format!("0 {hs} file {}", hash.display()))
        .unwrap();
    let table = format!(
        "0 {SECTORS} verity 1 vdata vhash 4096 4096 {} 1 sha256 {root} {SALT}{opts}",
        DATA_LEN / 4096
    );
    reg.create("kv", &table).unwrap();
    let (dm, hm) = (
        reg.info("vdata").unwrap().minor,
        reg.info("vhash").unwrap().minor,
    );
    let table = reg.table_text("kv").unwrap();
    let table = table
        .trim_end()
        .replacen(&format!(" 253:{dm} 253:{hm} "), " DATA HASH ", 1);
    let mut out = vec![format!("{name} table: {table}")];
    let v = reg.device("kv").unwrap();
    for b in READS {
        let mut buf = vec![0u8; 4096];
        out.push(
            match submit_and_wait(&*v, Op::Read, b * 4096, 4096, &mut buf) {
                Status::Ok => format!("{name} read {b}: ok {}", md5(&buf)),
                _ => format!("{name} read {b}: error"),
            },
        );
    }
    out.push(format!(
        "{name} status: {}",
        reg.status_text("kv").unwrap().trim_end()
    ));
    reg.remove_all();
    out
}

/// The guest's lines of the cases.
fn kernel_lines(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| {
            ["clean ", "data ", "data-ignore ", "hash "]
                .iter()
                .any(|p| l.starts_with(p))
        })
        .map(str::to_string)
        .collect()
}

#[test]
fn kernel_dm_verity_reads_and_refuses_what_blkstack_does() {
    if !vm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (data, hash) = (dir.path().join("data.img"), dir.path().join("hash.img"));
    pattern_file(&data, DATA_LEN as usize, 3801);
    let fmt = Command::new(env!("CARGO_BIN_EXE_blkstack"))
        .args(["verity", "format", "--salt", SALT])
        .arg(&data)
        .arg(&hash)
        .output()
        .unwrap();
    assert!(fmt.status.success(), "{fmt:?}");
    let report = String::from_utf8_lossy(&fmt.stdout);
    let root = report
        .lines()
        .find_map(|l| l.strip_prefix("Root hash:"))
        .unwrap()
        .trim()
        .to_string();
    // The corrupt copies: a data byte, a digest.
    let (bdata, bhash) = (dir.path().join("bdata.img"), dir.path().join("bhash.img"));
    std::fs::copy(&data, &bdata).unwrap();
    std::fs::copy(&hash, &bhash).unwrap();
    flip(&bdata, DATA_FLIP);
    flip(&bhash, HASH_FLIP);
    let mut want = ours("clean", &data, &hash, &root, "");
    want.extend(ours("data", &bdata, &hash, &root, ""));
    want.extend(ours(
        "data-ignore",
        &bdata,
        &hash,
        &root,
        " 1 ignore_corruption",
    ));
    want.extend(ours("hash", &data, &bhash, &root, ""));

    let script = GUEST
        .replace("SECTORS", &SECTORS.to_string())
        .replace("BLOCKS", &(DATA_LEN / 4096).to_string())
        .replace("ROOT", &root)
        .replace("SALT", SALT)
        .replace("READS", &READS.map(|b| b.to_string()).join(" "));
    let run = Vm::new()
        .disk("vdata", &data.display().to_string())
        .disk("vhash", &hash.display().to_string())
        .disk("bdata", &bdata.display().to_string())
        .disk("bhash", &bhash.display().to_string())
        .timeout(180)
        .run(&script);
    run.assert_ok("kernel dm-verity");
    let got = kernel_lines(&run.out);
    assert_eq!(
        got, want,
        "kernel (left) and blkstack (right) differ:\n{}",
        run.out
    );
    // The checks are not vacuous: the corrupt cases failed reads and
    // said C, the clean one read everything and said V.
    assert!(want.iter().any(|l| l == "data read 300: error"));
    assert!(want.iter().any(|l| l == "hash read 1: error"));
    assert!(want
        .iter()
        .any(|l| l.starts_with("data-ignore read 300: ok")));
    assert!(want.iter().any(|l| l.ends_with("verity C")));
    assert!(want
        .iter()
        .any(|l| l == &format!("clean status: 0 {SECTORS} verity V")));
    let whole = run
        .out
        .lines()
        .find_map(|l| l.strip_prefix("whole: "))
        .expect("the guest read the whole device");
    assert_eq!(whole, md5(&std::fs::read(&data).unwrap()));
}
