//! Filesystems on blkstack devices, judged by the real kernel: in the
//! kernel VM (Debian's Linux 6.12), ext4 and xfs are made on blkstack
//! exports of five kinds (memory, file, striped over two memory legs,
//! delay, multipath over two paths), mounted, put through a
//! metadata-heavy workload (creates, renames, unlinks, hard and symbolic
//! links, fsyncs, a sparse write and an 8 MiB patterned file), remounted
//! and verified, and checked with `e2fsck -fn` / `xfs_repair -n`, which
//! must find nothing. Over `flakey` with `error_writes` the filesystem must
//! see the errors: EIO to the writer and ext4 turning read-only
//! (errors=remount-ro: EROFS to every later change), then, with the
//! device healed, what was synced before the errors intact and e2fsck
//! clean after it replays the journal.

mod kernel_vm_support;

use blkstack_test_support::*;
use kernel_vm_support::*;
use std::path::Path;

/// 128 MiB in sectors. mkfs.xfs's floors (300 MB, a 64 MB log) are
/// lifted as for fstests, whose variables it runs with: a smaller log
/// to zero keeps each mkfs over the guest's NBD disks short.
const SECTORS: u64 = 1 << 18;

/// The guest-side workload and checks, shared by both tests.
const GUEST_LIB: &str = r#"
fail() { echo "FAIL: $*"; exit 1; }
workload() {
  d=$1
  mkdir -p $d/a $d/b $d/deep/x/y/z || return 1
  i=0; while [ $i -lt 200 ]; do echo "small file $i" > $d/a/f$i || return 1; i=$((i+1)); done
  sync -f $d/a/f0 || return 1
  dd if=/test/pattern of=$d/big bs=64k 2>/dev/null || return 1
  sync $d/big || return 1
  i=0; while [ $i -lt 200 ]; do mv $d/a/f$i $d/b/g$i || return 1; i=$((i+4)); done
  i=1; while [ $i -lt 200 ]; do rm $d/a/f$i || return 1; i=$((i+4)); done
  ln -s big $d/link && ln $d/big $d/hard || return 1
  dd if=/test/pattern of=$d/sparse bs=4k count=3 seek=1000 2>/dev/null || return 1
  echo tail >> $d/b/g0 && sync $d/b/g0 || return 1
  sync
}
verify() {
  d=$1
  cmp /test/pattern $d/big || return 1
  cmp $d/big $d/hard || return 1
  [ "$(readlink $d/link)" = big ] || return 1
  [ "$(ls $d/b | wc -l)" -eq 50 ] || { echo "b holds $(ls $d/b | wc -l)"; return 1; }
  [ "$(ls $d/a | wc -l)" -eq 100 ] || { echo "a holds $(ls $d/a | wc -l)"; return 1; }
  [ "$(stat -c %s $d/sparse)" -eq $((1003 * 4096)) ] || return 1
  [ "$(tail -n 1 $d/b/g0)" = tail ] || return 1
}
fs_cycle() {
  fs=$1; serial=$2; dev=/dev/disk/by-serial/$serial
  case $fs in
    ext4) mkfs.ext4 -q -F $dev ;;
    xfs) TEST_DIR=/tmp TEST_DEV=$dev QA_CHECK_FS=1 mkfs.xfs -q -f $dev ;;
  esac || fail "mkfs.$fs on $serial"
  mount -t $fs $dev /mnt || fail "mount $fs on $serial"
  workload /mnt || fail "workload on $fs on $serial"
  umount /mnt || fail "umount $fs on $serial"
  mount -t $fs $dev /mnt || fail "remount $fs on $serial"
  verify /mnt || fail "verify $fs on $serial after a remount"
  umount /mnt || fail "umount $fs on $serial"
  case $fs in
    ext4) e2fsck -fn $dev ;;
    xfs) xfs_repair -n $dev ;;
  esac > /tmp/fsck.out 2>&1 || { cat /tmp/fsck.out; fail "fsck of $fs on $serial"; }
  echo "PASS $fs $serial at $(cut -d" " -f1 /proc/uptime)"
}
"#;

fn pattern(dir: &Path) -> std::path::PathBuf {
    guest_pattern(dir, 8 << 20, 0x9E37_79B9_7F4A_7C15)
}

/// The first four bytes of an export, read back through blkstack on the
/// host with qemu-io.
fn head_of(srv: &Serve, export: &str) -> String {
    let out = std::process::Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -v 0 4"])
        .arg(srv.uri(export))
        .output()
        .expect("run qemu-io (qemu-utils)");
    assert!(out.status.success(), "qemu-io read of {export} failed");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().next().unwrap_or_default();
    line.split_whitespace()
        .skip(1)
        .take(4)
        .filter_map(|h| u8::from_str_radix(h, 16).ok())
        .map(char::from)
        .collect()
}

#[test]
fn ext4_and_xfs_live_on_five_kinds_of_blkstack_device() {
    if !vm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("scratch");
    let img = scratch.path().join("file0.img");
    let concise = [
        format!("mem,,,rw,0 {SECTORS} memory"),
        format!("file,,,rw,0 {SECTORS} file {} create", img.display()),
        format!("la,,,rw,0 {} memory", SECTORS / 2),
        format!("lb,,,rw,0 {} memory", SECTORS / 2),
        format!("striped,,,rw,0 {SECTORS} striped 2 128 la 0 lb 0"),
        format!("dmem,,,rw,0 {SECTORS} memory"),
        format!("delay,,,rw,0 {SECTORS} delay dmem 0 1"),
        format!("pmem,,,rw,0 {SECTORS} memory"),
        format!("p0,,,rw,0 {SECTORS} linear pmem 0"),
        format!("p1,,,rw,0 {SECTORS} linear pmem 0"),
        format!(
            "mpath,,,rw,0 {SECTORS} multipath 1 queue_if_no_path 0 1 1 round-robin 0 2 1 p0 1 p1 1"
        ),
    ]
    .join(";");
    let kinds = ["mem", "file", "striped", "delay", "mpath"];
    let srv = Serve::start(&concise, &kinds.join(","));
    let mut vm = Vm::new().file(&pattern(scratch.path()), "/test/pattern");
    for k in kinds {
        vm = vm.disk(k, &srv.uri(k));
    }
    let mut script = String::from(GUEST_LIB);
    for k in kinds {
        script.push_str(&format!("fs_cycle ext4 {k}\n"));
    }
    for k in kinds {
        script.push_str(&format!("fs_cycle xfs {k}\n"));
    }
    let run = vm.timeout(400).run(&script);
    println!("{}", run.out);
    run.assert_ok("ext4 and xfs on blkstack devices");
    for fs in ["ext4", "xfs"] {
        for k in kinds {
            assert!(
                run.out.contains(&format!("PASS {fs} {k} at ")),
                "{fs} on {k} did not pass:\n{}",
                run.out
            );
        }
    }
    // What the guest's xfs wrote is where blkstack keeps it: the
    // superblock magic at byte 0 of every device (for `file`, of the file).
    for k in kinds {
        assert_eq!(head_of(&srv, k), "XFSB", "xfs superblock on {k}");
    }
    let file_head = std::fs::read(&img).expect("read the file leaf's image");
    assert_eq!(
        &file_head[..4],
        b"XFSB",
        "the file leaf's image holds the xfs"
    );
    eprintln!("five kinds x two filesystems: {:?}", run.elapsed);
}

#[test]
fn write_errors_from_flakey_reach_ext4_and_its_writer() {
    if !vm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("scratch");
    let up = format!("0 {SECTORS} flakey fmem 0 3600 0");
    let down = format!("0 {SECTORS} flakey fmem 0 0 3600 1 error_writes");
    let concise = format!("fmem,,,rw,0 {SECTORS} memory;flakey,,,rw,{up}");
    let srv = std::sync::Arc::new(Serve::start(&concise, "flakey"));
    let hook_srv = srv.clone();
    let hooks = HostHooks::start(move |cmd| {
        let table = match cmd {
            "fail_writes" => &down,
            "heal" => &up,
            other => return format!("unknown hook {other}"),
        };
        let r = hook_srv.run("reload", &["flakey", "--table", table]);
        let s = hook_srv.run("resume", &["flakey"]);
        if r.status.success() && s.status.success() {
            "ok".into()
        } else {
            format!("failed: {}{}", r.stderr, s.stderr)
        }
    });
    let script = format!(
        "{GUEST_LIB}{GUEST_HOOK_FN}{}",
        r#"
dev=/dev/disk/by-serial/flakey
mkfs.ext4 -q -F $dev || fail mkfs
mount -t ext4 -o errors=remount-ro $dev /mnt || fail mount
workload /mnt || fail workload
hook fail_writes || fail "hook fail_writes"
if dd if=/test/pattern of=/mnt/after bs=64k count=16 conv=fsync 2>/tmp/dd.err; then
  fail "a write and fsync succeeded over error_writes"
fi
echo "writer saw: $(cat /tmp/dd.err)"
grep -q "Input/output error" /tmp/dd.err || fail "the writer's error was not EIO"
# ext4 (since 6.6) no longer flips SB_RDONLY on errors: with
# errors=remount-ro it refuses every further change with EROFS instead.
i=0; while [ $i -lt 30 ]; do
  touch /mnt/new$i 2>/tmp/touch.err
  grep -q "Read-only file system" /tmp/touch.err && break
  sleep 1; sync; i=$((i+1))
done
echo "after the errors: $(cat /tmp/touch.err)"
grep -q "Read-only file system" /tmp/touch.err || fail "ext4 did not turn read-only"
dmesg | grep -E "EXT4-fs|JBD2" | tail -n 8
hook heal || fail "hook heal"
umount /mnt || fail "umount after the errors"
mount -t ext4 $dev /mnt || fail "mount after healing"
verify /mnt || fail "what was synced before the errors is not intact"
umount /mnt
e2fsck -fn $dev > /tmp/fsck.out 2>&1 || { cat /tmp/fsck.out; fail "e2fsck -fn after the errors"; }
echo PASS flakey
"#
    );
    let run = Vm::new()
        .file(&pattern(scratch.path()), "/test/pattern")
        .disk("flakey", &srv.uri("flakey"))
        .forward(HOOK_PORT, hooks.port())
        .timeout(200)
        .run(&script);
    println!("{}", run.out);
    run.assert_ok("ext4 over flakey error_writes");
    assert!(run.out.contains("PASS flakey"), "{}", run.out);
}
