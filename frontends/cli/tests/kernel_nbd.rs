//! The kernel's own NBD client against `blkstack serve`: in the kernel VM
//! (Debian's Linux 6.12 and its nbd-client), `/dev/nbd0` is attached over
//! TCP through qemu's forwarding with four connections (`-C 4`, as
//! multi-conn allows), `/dev/nbd1` with TLS (nbd-client's own GnuTLS
//! proxy, verifying our certificate against the CA); an ext4 filesystem
//! lives on each through a workload, a remount and `e2fsck -fn`. Then the
//! server goes away under a writer, once by `remove -f` of the export and
//! once by `kill -9` of the whole server: the guest's kernel must turn
//! that into I/O errors for the writer, and nothing in the guest may hang.

mod tls_support;

mod kernel_vm_support;

use blkstack_test_support::*;
use kernel_vm_support::*;
use std::sync::Arc;

const SECTORS: u64 = 1 << 19;
const NBD_PORT: u16 = 10809;

/// The guest's side: two filesystems over the kernel NBD client, then
/// the two ways of losing the server.
const GUEST: &str = r#"
fail() { echo "FAIL: $*"; exit 1; }
fs_check() {
  dev=$1
  mkfs.ext4 -q -F $dev || fail "mkfs on $dev"
  mount -t ext4 $dev /mnt || fail "mount $dev"
  i=0; while [ $i -lt 100 ]; do echo "file $i" > /mnt/f$i || fail "create on $dev"; i=$((i+1)); done
  dd if=/test/pattern of=/mnt/big bs=64k 2>/dev/null && sync /mnt/big || fail "write on $dev"
  i=0; while [ $i -lt 100 ]; do mv /mnt/f$i /mnt/g$i || fail "rename on $dev"; i=$((i+2)); done
  umount /mnt && mount -t ext4 $dev /mnt || fail "remount $dev"
  cmp /test/pattern /mnt/big || fail "data on $dev after a remount"
  [ "$(ls /mnt | wc -l)" -eq 102 ] || fail "entries on $dev: $(ls /mnt | wc -l)"
  umount /mnt || fail "umount $dev"
  e2fsck -fn $dev > /tmp/fsck.out 2>&1 || { cat /tmp/fsck.out; fail "e2fsck on $dev"; }
  echo "PASS ext4 on $dev"
}
# A writer that fsyncs file after file until it gets an error; the
# server is then taken away and the writer must stop with one.
lose_server() {
  dev=$1 how=$2
  mount -t ext4 $dev /mnt || fail "mount $dev again"
  ( i=0; while dd if=/test/pattern of=/mnt/w$i bs=64k count=16 conv=fsync 2>/tmp/w.err; do i=$((i+1)); done
    echo "writer on $dev stopped after $i files: $(cat /tmp/w.err)" ) > /tmp/w.log &
  w=$!
  sleep 2
  hook $how || fail "hook $how"
  t=0; while kill -0 $w 2>/dev/null && [ $t -lt 60 ]; do sleep 1; t=$((t+1)); done
  kill -0 $w 2>/dev/null && fail "the writer on $dev still runs 60 s after $how"
  cat /tmp/w.log
  grep -q "Input/output error" /tmp/w.log || fail "the writer on $dev did not see EIO after $how"
  timeout 60 umount /mnt; echo "umount after $how: $?"
  timeout 60 nbd-client -d $dev >/dev/null 2>&1; echo "nbd-client -d after $how: $?"
  echo "PASS $how"
}
modprobe nbd nbds_max=4 || fail "modprobe nbd"
# -t: the kernel's per-request timeout. Without one the kernel waits for
# ever on a request sent before it noticed the connection die (through
# nbd-client's TLS proxy it may not notice at all), and umount hangs.
nbd-client 10.0.2.100 10809 /dev/nbd0 -N plain -C 4 -b 4096 -t 10 2>&1 || fail "nbd-client -C 4"
fs_check /dev/nbd0
nbd-client 10.0.2.100 10809 /dev/nbd1 -N tls -b 4096 -t 10 -x -A /test/ca-cert.pem -H localhost 2>&1 || fail "nbd-client with TLS"
fs_check /dev/nbd1
lose_server /dev/nbd0 remove_f
lose_server /dev/nbd1 kill_server
dmesg | grep -E "nbd[01]|block nbd" | sort -u | tail -n 6
echo DONE
"#;

#[test]
fn kernel_nbd_client_lives_on_blkstack_and_survives_losing_it() {
    if !vm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("scratch");
    tls_support::certificates(scratch.path());
    let certs = scratch.path().display().to_string();
    let concise = format!("plain,,,rw,0 {SECTORS} memory;tls,,,rw,0 {SECTORS} memory");
    let srv = Arc::new(
        Serve::options()
            .args(&["--concise", &concise, "--export", "plain,tls"])
            .args(&[
                "--listen",
                "nbd://127.0.0.1:0",
                "--tls",
                "on",
                "--tls-certificates",
                &certs,
            ])
            .start(),
    );
    let port = srv.tcp_port();
    let hook_srv = srv.clone();
    let hooks = HostHooks::start(move |cmd| match cmd {
        "remove_f" => {
            let o = hook_srv.run("remove", &["-f", "plain"]);
            if o.status.success() {
                "ok".into()
            } else {
                format!("remove -f failed: {}", o.stderr)
            }
        }
        "kill_server" => {
            let st = std::process::Command::new("kill")
                .args(["-9", &hook_srv.pid().to_string()])
                .status();
            match st {
                Ok(s) if s.success() => "ok".into(),
                other => format!("kill failed: {other:?}"),
            }
        }
        other => format!("unknown hook {other}"),
    });
    let pattern = scratch.path().join("pattern");
    blkstack_test_support::pattern_file_with_holes(&pattern, 4 << 20, 7);
    let run = Vm::new()
        .file(&pattern, "/test/pattern")
        .file(&scratch.path().join("ca-cert.pem"), "/test/ca-cert.pem")
        .forward(NBD_PORT, port)
        .forward(HOOK_PORT, hooks.port())
        .timeout(300)
        .run(&format!("{GUEST_HOOK_FN}{GUEST}"));
    println!("{}", run.out);
    run.assert_ok("the kernel NBD client on blkstack serve");
    // nbd-client negotiates once per connection: four for nbd0, one for
    // the TLS nbd1.
    let negotiations = run.out.matches("Negotiation:").count();
    assert_eq!(negotiations, 5, "connections negotiated:\n{}", run.out);
    for step in [
        "PASS ext4 on /dev/nbd0",
        "PASS ext4 on /dev/nbd1",
        "PASS remove_f",
        "PASS kill_server",
        "DONE",
    ] {
        assert!(run.out.contains(step), "missing {step}:\n{}", run.out);
    }
}
