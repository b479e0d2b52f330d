//! blkstack as the misbehaving SAN under the real Linux multipath: in the
//! kernel VM, the guest's dm-multipath (round-robin, queue_if_no_path)
//! runs over two virtio disks, each an export of its own `blkstack serve`
//! process, both over one shared backing file (one LUN, two paths). An
//! ext4 filesystem on the multipath device takes fsynced writes while the
//! host breaks one path after another: server A killed with `kill -9` and
//! restarted, A's `flakey` reloaded to fail every I/O, B's `delay` made
//! slow, and both paths down at once (I/O must queue, not fail, until B
//! comes back). The guest's `dmsetup status` must show the path failed
//! and, after `reinstate_path`, active again; no write acknowledged to the
//! guest may be lost (every file compared, e2fsck clean).

mod control_support;
mod kernel_vm_support;

use control_support::Serve;
use kernel_vm_support::*;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

const SECTORS: u64 = 1 << 19;

const GUEST: &str = r#"
fail() { echo "FAIL: $*"; dmsetup status mp; exit 1; }
A=$(cat /sys/block/$(basename $(readlink /dev/disk/by-serial/pathA))/dev)
B=$(cat /sys/block/$(basename $(readlink /dev/disk/by-serial/pathB))/dev)
N=$(blockdev --getsz /dev/disk/by-serial/pathA)
dmsetup create mp --table "0 $N multipath 1 queue_if_no_path 0 1 1 round-robin 0 2 1 $A 1000 $B 1000" || fail "create"
mkfs.ext4 -q -F /dev/mapper/mp && mount -t ext4 /dev/mapper/mp /mnt || fail "mkfs and mount"
written=0
writer() {
  i=0; while [ $i -lt $2 ]; do
    dd if=/test/pattern of=/mnt/$1.$i bs=64k conv=fsync 2>/tmp/err.$1 || { echo "WRITE ERROR $1.$i: $(cat /tmp/err.$1)"; return 1; }
    i=$((i+1))
  done
}
# state DEV A|F: the path's state in `dmsetup status` must become that.
# A path fails only when I/O reaches it, and round-robin sends 1000 I/Os
# down one path before the next: while waiting for F, read the device
# (direct, 256 x 4 KiB a second) so a failing path meets I/O soon even
# when the writer has finished.
state() {
  t=0; while [ $t -lt 60 ]; do
    dmsetup status mp | grep -q " $1 $2 " && { echo "path $1 $2: $(dmsetup status mp)"; return 0; }
    [ "$2" = F ] && dd if=/dev/mapper/mp of=/dev/null bs=4k count=256 skip=$((t * 256)) iflag=direct 2>/dev/null
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
# break: run a writer in the background, break things on the host, wait.
break_under_writer() {
  tag=$1; shift
  writer $tag 12 & w=$!
  sleep 1
  for h in "$@"; do hook $h || fail "hook $h"; done
  wait $w || fail "writes failed across $tag"
}
writer base 4 || fail "writes with both paths up"
break_under_writer kill kill_a
state $A F
hook restart_a || fail "restart"
path_up pathA
dmsetup message mp 0 reinstate_path $A || fail "reinstate after restart"
state $A A
break_under_writer flakey flakey_a
state $A F
hook heal_a && dmsetup message mp 0 reinstate_path $A || fail "heal A"
state $A A
break_under_writer slow slow_b fast_b
# Both paths down: queue_if_no_path holds the writes until B is back.
writer queued 40 & w=$!
sleep 1
hook flakey_a && hook kill_b || fail "both paths down"
sleep 3
kill -0 $w 2>/dev/null || fail "the writer ended with no path up: its I/O was not queued"
state $B F
hook restart_b || fail "restart B"
path_up pathB
dmsetup message mp 0 reinstate_path $B || fail "reinstate B"
wait $w || fail "queued writes failed"
state $B A
hook heal_a && dmsetup message mp 0 reinstate_path $A || fail "heal A again"
state $A A
for f in /mnt/*.*; do cmp /test/pattern $f || fail "$f differs"; done
echo "files intact: $(ls /mnt | grep -c '\.')"
umount /mnt || fail umount
e2fsck -fn /dev/mapper/mp > /tmp/fsck.out 2>&1 || { cat /tmp/fsck.out; fail "e2fsck"; }
dmsetup table mp
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
        self.serve = Some(Serve::start_args(
            &self.stack,
            self.name,
            false,
            &["--listen", &listen],
        ));
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
}
