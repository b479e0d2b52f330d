//! blkstack as the misbehaving SAN under the real Linux multipath: in the
//! kernel VM, the guest's dm-multipath (round-robin, queue_if_no_path)
//! runs over two virtio disks, each an export of its own `blkstack serve`
//! process, both over one shared backing file (one LUN, two paths). An
//! ext4 filesystem on the multipath device takes fsynced writes while the
//! host breaks one path after another: server A killed with `kill -9` and
//! restarted, A's `flakey` reloaded to fail every I/O, B's `delay` made
//! slow, and both paths down at once (I/O must queue, not fail, until B
//! comes back). Each break happens under a writer that runs until the
//! guest has seen what it waits for, never for a fixed count that a fast
//! guest finishes before the host acts. The guest's `dmsetup status` must
//! show the path failed and, after `reinstate_path`, active again; with no
//! path up the writer must wait, not fail, and no file begun then may be
//! fsynced; every request error the guest logs must be a path error
//! (BLK_STS_IOERR) and none may reach ext4; no write acknowledged to the
//! guest may be lost (every file compared, e2fsck clean).

mod kernel_vm_support;

use blkstack_test_support::*;
use kernel_vm_support::*;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

const SECTORS: u64 = 1 << 19;

const GUEST: &str = r#"
fail() { echo "FAIL: $*"; dmsetup status mp; echo "--- dmesg"; dmesg | tail -n 40; exit 1; }
A=$(cat /sys/block/$(basename $(readlink /dev/disk/by-serial/pathA))/dev)
B=$(cat /sys/block/$(basename $(readlink /dev/disk/by-serial/pathB))/dev)
N=$(blockdev --getsz /dev/disk/by-serial/pathA)
# repeat_count 1: 6.12's round-robin takes any larger one as 1 (rr_add_path
# in dm-round-robin.c: "repeat_count > 1 is deprecated"), so requests
# alternate between the paths and a broken one meets I/O at once.
dmsetup create mp --table "0 $N multipath 1 queue_if_no_path 0 1 1 round-robin 0 2 1 $A 1 $B 1" || fail "create"
mkfs.ext4 -q -F /dev/mapper/mp && mount -t ext4 /dev/mapper/mp /mnt || fail "mkfs and mount"
# writer TAG: fsynced 512 KiB files TAG.1, TAG.2, ... until /tmp/stop.TAG
# appears. It runs until told to stop, not for a fixed count, so it is
# still writing when the host breaks a path however fast the guest is (a
# fixed count of files was often done before the host had acted).
# /tmp/started.TAG and /tmp/done.TAG hold the number of the file begun
# and of the last one fsynced; /tmp/failed.TAG appears on an error.
# The numbers are renamed into place, so a reader never sees a half-written
# one.
put() { echo $2 > $1.new && mv $1.new $1; }
writer() {
  i=0
  while [ ! -e /tmp/stop.$1 ]; do
    i=$((i+1)); put /tmp/started.$1 $i
    dd if=/test/pattern of=/mnt/$1.$i bs=64k conv=fsync 2>/tmp/err.$1 || {
      echo "WRITE ERROR $1.$i: $(cat /tmp/err.$1)"; touch /tmp/failed.$1; return 1; }
    put /tmp/done.$1 $i
  done
}
start_writer() { rm -f /tmp/stop.$1 /tmp/failed.$1; put /tmp/done.$1 0; writer $1 & w=$!; progress $1 1; }
stop_writer() {
  touch /tmp/stop.$1; wait $w || fail "writes failed across $1"
  echo "writer $1: $(cat /tmp/done.$1) files"
}
writer_ok() {
  for f in /tmp/failed.*; do [ -e $f ] && fail "writer ${f#/tmp/failed.} got an error"; done
  return 0
}
# progress TAG N: the writer fsyncs N more files (within 60 s).
progress() {
  want=$(( $(cat /tmp/done.$1) + $2 )); t=0
  while [ $(cat /tmp/done.$1) -lt $want ]; do
    writer_ok
    [ $t -lt 600 ] || fail "writer $1 made no progress in 60 s"
    usleep 100000; t=$((t+1))
  done
}
# state DEV A|F: the path's state in `dmsetup status` must become that.
# Waiting for F needs no I/O of its own: a writer is running, and its next
# request fails the broken path (a read here would even hang with no path
# left, queued as queue_if_no_path says).
state() {
  t=0; while [ $t -lt 60 ]; do
    dmsetup status mp | grep -q " $1 $2 " && { echo "path $1 $2: $(dmsetup status mp)"; return 0; }
    writer_ok
    sleep 1; t=$((t+1))
  done
  fail "path $1 never became $2"
}
# path_up SERIAL: what multipathd's directio checker does before a
# reinstate: read the path itself until qemu's NBD client is back on the
# restarted server (it reconnects in the background, with backoff).
path_up() {
  t=0; while [ $t -lt 60 ]; do
    echo 3 > /proc/sys/vm/drop_caches
    dd if=/dev/disk/by-serial/$1 of=/dev/null bs=4k count=1 2>/dev/null && return 0
    sleep 1; t=$((t+1))
  done
  fail "path $1 never answered after its server's restart"
}
start_writer base; progress base 3; stop_writer base
# One path killed: its I/O fails, the writes go on through B.
start_writer kill
hook kill_a || fail "hook kill_a"
state $A F
progress kill 2; stop_writer kill
hook restart_a || fail "restart"
path_up pathA
dmsetup message mp 0 reinstate_path $A || fail "reinstate after restart"
state $A A
# A's flakey fails every I/O: the same.
start_writer flakey
hook flakey_a || fail "hook flakey_a"
state $A F
progress flakey 2; stop_writer flakey
hook heal_a && dmsetup message mp 0 reinstate_path $A || fail "heal A"
state $A A
# B made slow: slow is not failed (dm-mpath has no timeout of its own and
# virtio-blk none that fails a request).
start_writer slow
hook slow_b || fail "hook slow_b"
progress slow 3
hook fast_b || fail "hook fast_b"
progress slow 1; stop_writer slow
dmsetup status mp | grep -q " F " && fail "a slow path was failed"
# Both paths down: with queue_if_no_path, dm-mpath requeues a request whose
# path failed when no path is left (multipath_end_io, must_push_back_rq)
# and holds new ones (multipath_clone_and_map), so the writer blocks and
# gets no error until B is back. Its next request fails both paths, which
# the status shows; a file begun after that cannot be fsynced, so at most
# the file begun then (finished before the break, or held) may be done.
start_writer queued
hook flakey_a && hook kill_b || fail "both paths down"
state $A F
state $B F
begun=$(cat /tmp/started.queued)
sleep 3
writer_ok
done=$(cat /tmp/done.queued)
[ $done -le $begun ] || fail "file $done was fsynced with no path up (file $begun was begun when both had failed)"
echo "no path up: the writer waits at file $begun, $done fsynced"
hook restart_b || fail "restart B"
path_up pathB
dmsetup message mp 0 reinstate_path $B || fail "reinstate B"
progress queued 2; stop_writer queued
state $B A
hook heal_a && dmsetup message mp 0 reinstate_path $A || fail "heal A again"
state $A A
for f in /mnt/*.*; do cmp /test/pattern $f || fail "$f differs"; done
echo "files intact: $(ls /mnt | grep -c '\.')"
umount /mnt || fail umount
e2fsck -fn /dev/mapper/mp > /tmp/fsck.out 2>&1 || { cat /tmp/fsck.out; fail "e2fsck"; }
dmsetup table mp
# What the kernel logged of the paths' errors (blk_print_req_error names
# the status: "I/O error" is BLK_STS_IOERR) and of any error that came
# through the multipath device (dm-0) to ext4.
echo BEGIN errors
dmesg | grep -E "error, dev |I/O error on dev |EXT4-fs (error|warning)|Failing path"
echo END errors
echo PASS multipath
"#;

/// One path's server: the shared LUN file under `flakey` (A) or `delay`
/// (B), exported on a fixed socket so a restart is the same path.
struct Path {
    socket: PathBuf,
    stack: String,
    name: &'static str,
    serve: Option<Serve>,
}

impl Path {
    fn new(dir: &std::path::Path, lun: &std::path::Path, name: &'static str, top: &str) -> Path {
        let stack = format!(
            "leg,,,rw,0 {SECTORS} file {};{name},,,rw,0 {SECTORS} {top}",
            lun.display()
        );
        let mut p = Path {
            socket: dir.join(format!("{name}.sock")),
            stack,
            name,
            serve: None,
        };
        p.start();
        p
    }

    fn start(&mut self) {
        let listen = format!("nbd+unix:///?socket={}", self.socket.display());
        self.serve = Some(
            Serve::options()
                .args(&["--concise", &self.stack, "--export", self.name])
                .args(&["--listen", &listen])
                .start(),
        );
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///{}?socket={}", self.name, self.socket.display())
    }

    fn kill(&mut self) -> String {
        let Some(s) = self.serve.take() else {
            return "not running".into();
        };
        let st = std::process::Command::new("kill")
            .args(["-9", &s.pid().to_string()])
            .status();
        drop(s);
        match st {
            Ok(s) if s.success() => "ok".into(),
            other => format!("kill failed: {other:?}"),
        }
    }

    fn reload(&self, table: &str) -> String {
        let Some(s) = &self.serve else {
            return "not running".into();
        };
        let r = s.run("reload", &[self.name, "--table", table]);
        let q = s.run("resume", &[self.name]);
        if r.status.success() && q.status.success() {
            "ok".into()
        } else {
            format!("reload failed: {}{}", r.stderr, q.stderr)
        }
    }
}

#[test]
fn guest_multipath_fails_over_between_two_blkstack_servers() {
    if !vm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("scratch");
    let lun = scratch.path().join("lun.img");
    std::fs::File::create(&lun)
        .and_then(|f| f.set_len(SECTORS * 512))
        .expect("LUN file");
    let up = format!("0 {SECTORS} flakey leg 0 3600 0");
    let down = format!("0 {SECTORS} flakey leg 0 0 3600");
    let fast = format!("0 {SECTORS} delay leg 0 0");
    let slow = format!("0 {SECTORS} delay leg 0 50");
    // The target and its arguments: a table line without START LENGTH.
    let target = |t: &str| t.splitn(3, ' ').nth(2).unwrap_or_default().to_string();
    let a = Arc::new(Mutex::new(Path::new(
        scratch.path(),
        &lun,
        "pathA",
        &target(&up),
    )));
    let b = Arc::new(Mutex::new(Path::new(
        scratch.path(),
        &lun,
        "pathB",
        &target(&fast),
    )));
    let (ua, ub) = (a.lock().expect("A").uri(), b.lock().expect("B").uri());
    let (ha, hb) = (a.clone(), b.clone());
    let hooks = HostHooks::start(move |cmd| {
        let (mut a, mut b) = (ha.lock().expect("A"), hb.lock().expect("B"));
        match cmd {
            "kill_a" => a.kill(),
            "kill_b" => b.kill(),
            "restart_a" => {
                a.start();
                "ok".into()
            }
            "restart_b" => {
                b.start();
                "ok".into()
            }
            "flakey_a" => a.reload(&down),
            "heal_a" => a.reload(&up),
            "slow_b" => b.reload(&slow),
            "fast_b" => b.reload(&fast),
            other => format!("unknown hook {other}"),
        }
    });
    let pattern = scratch.path().join("pattern");
    let bytes: Vec<u8> = (0..512u32 << 10)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&pattern, bytes).expect("pattern");
    let run = Vm::new()
        .disk("pathA", &ua)
        .disk("pathB", &ub)
        .file(&pattern, "/test/pattern")
        .forward(HOOK_PORT, hooks.port())
        .timeout(300)
        .run(&format!("{GUEST_HOOK_FN}{GUEST}"));
    println!("{}", run.out);
    run.assert_ok("the guest's multipath over two blkstack servers");
    assert!(run.out.contains("PASS multipath"), "{}", run.out);
    assert!(!run.out.contains("WRITE ERROR"), "{}", run.out);
    let errors = run.section("errors").expect("the guest's error log");
    assert_path_errors_only(&errors);
}

/// Every failure blkstack's servers caused must reach dm-multipath as a
/// path error, and none may pass through it: dm-mpath fails a path and
/// retries the request elsewhere (or queues it) only when
/// `blk_path_error()` holds (include/linux/blk_types.h, 6.12); a status
/// such as BLK_STS_NOTSUPP, TARGET, NOSPC or MEDIUM goes straight back to
/// ext4 with the path left active. The kernel names the status in each
/// request error it logs (`blk_print_req_error`, block/blk-core.c's
/// `blk_errors` table): qemu's virtio-blk, with werror/rerror=report,
/// answers every failed NBD request (any errno) VIRTIO_BLK_S_IOERR, which
/// the guest's virtio_blk takes as BLK_STS_IOERR, "I/O error".
fn assert_path_errors_only(log: &str) {
    let mut failed_paths = 0;
    for line in log.lines() {
        let text = line.split_once("] ").map_or(line, |(_, t)| t);
        if text.contains("Failing path") {
            failed_paths += 1;
        } else if let Some((status, rest)) = text.split_once(" error, dev ") {
            assert!(
                status == "I/O" && rest.starts_with("vd"),
                "a request failed with other than a path's BLK_STS_IOERR: {line}\n{log}"
            );
        }
        assert!(
            !text.contains("dev dm-") && !text.starts_with("EXT4-fs"),
            "an error came through the multipath device: {line}\n{log}"
        );
    }
    // kill_a, flakey_a, then both paths at once.
    assert!(
        failed_paths >= 4,
        "{failed_paths} path failures logged:\n{log}"
    );
}
