//! LUKS volumes made by the real `cryptsetup luksFormat` (LUKS1 with
//! PBKDF2, LUKS2 with argon2id), opened by blkstack, judged by the
//! kernel's dm-crypt (Linux 6.12 in the kernel VM), in one boot:
//! - `blkstack luks table` gives the stack a server exports (the crypt
//!   device over a file leaf on the image); `blkstack luks open` on the
//!   running server gives the same device for the second image;
//! - in the guest, ext4 is made and filled through blkstack's exports,
//!   then the image itself (a second disk over the same file) is opened
//!   with the kernel's dm-crypt and the table blkstack printed, and
//!   e2fsck finds it clean and the files intact;
//! - the kernel writes a file through its dm-crypt, and blkstack's export
//!   reads it back, e2fsck clean again.
//!
//! The ciphers themselves, one by one, are judged in the parity suite
//! (frontends/cli/tests/data/kernel-parity/cross.txt).

mod kernel_vm_support;

use blkstack_test_support::process::tool;
use blkstack_test_support::*;
use kernel_vm_support::*;
use std::path::Path;
use std::process::Command;

fn format(dir: &Path, name: &str, mib: u64, args: &[&str]) -> std::path::PathBuf {
    let img = dir.join(name);
    std::fs::File::create(&img)
        .unwrap()
        .set_len(mib << 20)
        .unwrap();
    let out = Command::new(tool("cryptsetup"))
        .args(["luksFormat", "--batch-mode", "--key-file"])
        .arg(dir.join("key"))
        .args(args)
        .arg(&img)
        .output()
        .expect("run cryptsetup");
    assert!(out.status.success(), "luksFormat {name}: {out:?}");
    img
}

const GUEST: &str = r#"
fail() { echo "FAIL: $*"; exit 1; }
fill() {
  d=$1
  mkdir -p $d/a $d/deep/x || return 1
  i=0; while [ $i -lt 50 ]; do echo "file $i" > $d/a/f$i || return 1; i=$((i+1)); done
  dd if=/test/pattern of=$d/big bs=64k 2>/dev/null || return 1
  ln $d/big $d/deep/x/hard && sync
}
check() {
  d=$1
  cmp /test/pattern $d/big && cmp $d/big $d/deep/x/hard || return 1
  [ "$(cat $d/a/f49)" = "file 49" ]
}
for v in 1 2; do
  dev=/dev/disk/by-serial/v$v
  # 4 KiB blocks: LUKS2 encrypts 4 KiB sectors, under which the kernel
  # cannot mount an ext4 of smaller blocks.
  mkfs.ext4 -q -F -b 4096 $dev || fail "mkfs on blkstack's v$v"
  mount -t ext4 $dev /mnt || fail "mount v$v"
  fill /mnt || fail "fill v$v"
  umount /mnt || fail "umount v$v"
  # The image, opened by the kernel's dm-crypt with blkstack's table.
  read t < /test/table$v
  printf '%s\n' "$t" | dmsetup create k$v || fail "dmsetup create k$v"
  e2fsck -fn /dev/mapper/k$v > /tmp/fsck 2>&1 || { cat /tmp/fsck; fail "e2fsck k$v"; }
  mount -t ext4 /dev/mapper/k$v /mnt || fail "mount k$v"
  check /mnt || fail "files through the kernel's dm-crypt on image $v"
  echo "written by the kernel $v" > /mnt/kernel && sync || fail "kernel write $v"
  umount /mnt && dmsetup remove k$v || fail "close k$v"
  echo 3 > /proc/sys/vm/drop_caches
  e2fsck -fn $dev > /tmp/fsck 2>&1 || { cat /tmp/fsck; fail "e2fsck v$v after the kernel wrote"; }
  mount -t ext4 -o ro $dev /mnt || fail "remount v$v"
  [ "$(cat /mnt/kernel)" = "written by the kernel $v" ] || fail "blkstack reads the kernel's file on v$v"
  check /mnt || fail "files on v$v"
  umount /mnt
  echo "PASS luks$v"
done
"#;

#[test]
fn luks_volumes_opened_by_blkstack_are_the_kernels() {
    if !vm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("scratch");
    let d = scratch.path();
    std::fs::write(d.join("key"), b"kernel judge").unwrap();
    let l1 = format(
        d,
        "l1.img",
        24,
        &["--type", "luks1", "--pbkdf-force-iterations", "1000"],
    );
    let l2 = format(
        d,
        "l2.img",
        40,
        &[
            "--type",
            "luks2",
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "32768",
            "--pbkdf-force-iterations",
            "4",
        ],
    );
    let key = d.join("key").display().to_string();
    // LUKS1 through `luks table` into the server's stack file.
    let out = Command::new(blkstack_bin())
        .args(["luks", "table"])
        .arg(&l1)
        .args(["v1", "--key-file", &key])
        .output()
        .expect("blkstack luks table");
    assert!(out.status.success(), "luks table: {out:?}");
    let stack_text = String::from_utf8(out.stdout).unwrap();
    let stack = d.join("stack.txt");
    std::fs::write(&stack, &stack_text).unwrap();
    let srv = Serve::options()
        .args(&["--stack", &stack.display().to_string(), "--export", "v1"])
        .start();
    // LUKS2 through `luks open` on the running server, then exported.
    let l2s = l2.display().to_string();
    srv.ok("luks", &["open", &l2s, "v2", "--key-file", &key]);
    srv.ok("export", &["v2"]);
    // The kernel's tables: blkstack's, with the image disk for NAME_raw.
    let t1 = stack_text
        .lines()
        .find_map(|l| l.strip_prefix("v1: "))
        .expect("v1 line")
        .replace("v1_raw", "/dev/disk/by-serial/r1");
    let t2 = srv.ok("table", &["v2"]).trim().to_string();
    assert!(
        t2.contains("crypt aes-xts-plain64") && t2.contains("sector_size:4096"),
        "{t2}"
    );
    // `table` names the leg 253:MINOR; the guest's is the image disk.
    let leg = t2
        .split_whitespace()
        .nth(6)
        .expect("the crypt leg")
        .to_string();
    let t2 = t2.replace(&format!(" {leg} "), " /dev/disk/by-serial/r2 ");
    std::fs::write(d.join("table1"), format!("{t1}\n")).unwrap();
    std::fs::write(d.join("table2"), format!("{t2}\n")).unwrap();
    let run = Vm::new()
        .file(&guest_pattern(d, 4 << 20, 0x5EED_C0DE), "/test/pattern")
        .file(&d.join("table1"), "/test/table1")
        .file(&d.join("table2"), "/test/table2")
        .disk("v1", &srv.uri("v1"))
        .disk("v2", &srv.uri("v2"))
        .shared_disk("r1", &l1)
        .shared_disk("r2", &l2)
        .timeout(240)
        .run(GUEST);
    println!("{}", run.out);
    run.assert_ok("LUKS volumes through blkstack and the kernel's dm-crypt");
    for v in ["luks1", "luks2"] {
        assert!(run.out.contains(&format!("PASS {v}")), "{v}:\n{}", run.out);
    }
    eprintln!("LUKS1 + LUKS2, ext4 both ways: {:?}", run.elapsed);
}
