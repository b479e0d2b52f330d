//! The vhost-user-blk frontend judged by the real kernel: the kernel VM
//! (Linux 6.12 under qemu) boots with blkstack's vhost-user-blk disk as
//! /dev/vda (blkstack serve on the host, the guest's RAM a shared memfd),
//! and its virtio_blk driver uses it: the config it read (serial, two
//! queues, size, block size, write cache, discard), the event index
//! (VIRTIO_RING_F_EVENT_IDX) negotiated, so every request below runs with
//! its notification suppression and with the queues' adaptive polling on
//! (`--vhost-poll-us`), ext4 with e2fsck -fn
//! clean, a verified random-write pass, and blkstack killed with SIGKILL
//! and restarted in the middle of an fsyncing writer: qemu reconnects
//! (`reconnect-ms`), the guest's I/O goes on, every file is intact.

mod kernel_vm_support;

use blkstack_test_support::*;
use kernel_vm_support::*;
use std::sync::{Arc, Mutex};

/// 32 MiB in sectors.
const SECTORS: u64 = 65536;

const GUEST: &str = r#"
fail() { echo "FAIL: $*"; exit 1; }
modprobe ext4
S=65536
[ -b /dev/vda ] || fail "no /dev/vda"
echo "BEGIN config"
cat /sys/block/vda/serial; echo
cat /sys/block/vda/size /sys/block/vda/queue/logical_block_size /sys/block/vda/queue/write_cache
ls /sys/block/vda/mq | wc -l
echo "END config"
echo "FEATURES $(cat /sys/block/vda/device/features)"
verify_pass /dev/vda 24 || fail "verify pass"
echo "PASS verify"
mkfs.ext4 -q -F /dev/vda && mount -t ext4 /dev/vda /mnt || fail "mkfs/mount"
(
  i=0
  while [ $i -lt 30 ]; do
    dd if=/test/pattern of=/mnt/f$i bs=64k count=2 skip=$i conv=fsync 2>/dev/null || { echo "writer: f$i failed"; exit 1; }
    echo "f$i at $(cut -d' ' -f1 /proc/uptime)"
    usleep 300000
    i=$((i+1))
  done
  echo writer-done
) > /tmp/w.out 2>&1 &
w=$!
while [ ! -e /mnt/f4 ]; do usleep 100000; done
hook restart || fail "hook restart"
wait $w; cat /tmp/w.out
grep -q writer-done /tmp/w.out || fail "the writer did not finish across the restart"
i=0; while [ $i -lt 30 ]; do
  dd if=/test/pattern bs=64k count=2 skip=$i 2>/dev/null | cmp - /mnt/f$i || fail "f$i differs"
  i=$((i+1))
done
umount /mnt || fail umount
e2fsck -fn /dev/vda > /tmp/fsck.out 2>&1 || { cat /tmp/fsck.out; fail "e2fsck after the restart"; }
echo PASS restart
"#;

fn kill9(pid: u32) {
    let st = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(st.success(), "kill -9 {pid}");
}

#[test]
fn vhost_user_blk_disk_survives_a_backend_restart() {
    if !vm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("scratch");
    let img = scratch.path().join("vd.img");
    let sock = scratch.path().join("vhost.sock");
    let stack = format!("vd,,,rw,0 {SECTORS} file {} create", img.display());
    let vhost = format!("{}:vd", sock.display());
    let extra = [
        "--vhost-user-blk",
        vhost.as_str(),
        "--vhost-queues",
        "2",
        "--vhost-poll-us",
        "50",
    ];
    let srv = Arc::new(Mutex::new(
        Serve::options()
            .args(&["--concise", &stack, "--export", "vd"])
            .args(&extra)
            .start(),
    ));
    let (hook_srv, hook_stack, hook_extra) = (srv.clone(), stack.clone(), extra.map(String::from));
    let restarts = Arc::new(Mutex::new(0));
    let hook_restarts = restarts.clone();
    // The restart runs beside the guest (a hook answers at once: busybox
    // nc does not wait long for an answer), under the guest's writer.
    let restarter: Arc<Mutex<Option<std::thread::JoinHandle<()>>>> = Arc::default();
    let hook_restarter = restarter.clone();
    let hooks = HostHooks::start(move |cmd| {
        if cmd != "restart" {
            return format!("unknown hook {cmd}");
        }
        let (srv, stack, extra, n) = (
            hook_srv.clone(),
            hook_stack.clone(),
            hook_extra.clone(),
            hook_restarts.clone(),
        );
        *hook_restarter.lock().expect("restarter") = Some(std::thread::spawn(move || {
            let mut s = srv.lock().expect("serve");
            kill9(s.pid());
            std::thread::sleep(std::time::Duration::from_millis(500));
            let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
            *s = Serve::options()
                .args(&["--concise", &stack, "--export", "vd"])
                .args(&extra)
                .start();
            *n.lock().expect("count") += 1;
        }));
        "ok".into()
    });
    let run = Vm::new()
        .vhost_user_blk(&sock, 2)
        .file(
            &guest_pattern(scratch.path(), 4 << 20, 0x51_7CC1_B727_220A),
            "/test/pattern",
        )
        .forward(HOOK_PORT, hooks.port())
        .timeout(300)
        .run(&format!("{GUEST_HOOK_FN}{GUEST_VERIFY_FN}{GUEST}"));
    println!("{}", run.out);
    if let Some(t) = restarter.lock().expect("restarter").take() {
        t.join().expect("the restart");
    }
    run.assert_ok("blkstack's vhost-user-blk disk in the guest");
    let config: Vec<String> = run
        .section("config")
        .expect("config section")
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(
        config,
        ["blkstack-vd", "65536", "512", "write back", "2"],
        "{}",
        run.out
    );
    // The negotiated features, bit 0 first: 29 is VIRTIO_RING_F_EVENT_IDX.
    let features = run
        .out
        .lines()
        .find_map(|l| l.strip_prefix("FEATURES "))
        .expect("the guest's negotiated features");
    assert_eq!(
        features.as_bytes().get(29),
        Some(&b'1'),
        "event index not negotiated: {features}"
    );
    assert!(run.out.contains("PASS verify"), "{}", run.out);
    assert!(run.out.contains("PASS restart"), "{}", run.out);
    assert_eq!(*restarts.lock().expect("count"), 1);
    // What the guest wrote is in the file on the host: ext4's magic.
    let head = std::fs::read(&img).expect("image");
    assert_eq!(
        &head[1024 + 56..1024 + 58],
        &[0x53, 0xEF],
        "ext4 superblock magic"
    );
}
