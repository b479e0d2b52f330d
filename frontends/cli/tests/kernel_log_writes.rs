//! blkstack's `log-writes` beside the kernel's dm-log-writes: in the
//! kernel VM, one workload (direct writes of several sizes, flushes, a
//! discard, marks) runs over the kernel's target (over two virtio disks,
//! blkstack exports) and over ours (through the kernel's nbd client, which
//! passes flushes and FUA as they are). Both logs land in files on the
//! host, and must hold the same entries: sectors, lengths, flags, mark
//! texts and data, in the same order, ending with the mark both targets
//! write when they are removed. A direct O_SYNC write (xfs_io -d -s)
//! makes a FUA entry on both. Then the replay tools: `blkstack
//! replay-log` replaying the kernel's log rebuilds the kernel's data
//! device byte for byte, and xfstests' own replay-log (built with cc)
//! replays both logs to the same images as ours.

mod kernel_vm_support;
mod xfstests_support;

use blkstack_mapped::targets::log_writes::format::{LogEntry, LogSuper, LOG_MARK_FLAG};
use blkstack_test_support::*;
use kernel_vm_support::*;
use std::path::Path;
use std::sync::Arc;

const SECTORS: u64 = 65536;
const NBD_PORT: u16 = 10809;

/// The workload, run once with the kernel's target ($1 = kernel) and once
/// with ours ($1 = blkstack); `mark` says where each side's marks go.
const GUEST: &str = r#"
fail() { echo "FAIL: $*"; exit 1; }
flush() { dd if=/dev/zero of=$D count=0 conv=fsync,notrunc 2>/dev/null || fail "flush on $D"; }
w() { dd if=/test/pattern of=$D bs=$1 count=$2 seek=$3 oflag=direct conv=notrunc 2>/dev/null || fail "write on $D"; }
workload() {
  w 4096 4 0
  w 65536 1 4
  flush
  mark m1
  w 4096 2 100
  blkdiscard -o 1048576 -l 65536 $D || fail "discard on $D"
  flush
  w 8192 1 7
  xfs_io -d -s -c "pwrite -q -S 0x5a 409600 4096" $D || fail "FUA write on $D"
  mark m2
  flush
}
modprobe dm-log-writes || fail "modprobe dm-log-writes"
K=$(cat /sys/block/$(basename $(readlink /dev/disk/by-serial/kdata))/dev)
L=$(cat /sys/block/$(basename $(readlink /dev/disk/by-serial/klog))/dev)
dmsetup create klw --table "0 SECTORS log-writes $K $L" || fail "create the kernel's log-writes"
dmsetup table klw
D=/dev/mapper/klw
mark() { dmsetup message klw 0 mark $1 || fail "kernel mark $1"; }
workload
dmsetup status klw
dmsetup remove klw || fail "remove klw"
modprobe nbd
nbd-client 10.0.2.100 10809 /dev/nbd0 -N lw -b 512 >/dev/null 2>&1 || fail "nbd-client"
D=/dev/nbd0
mark() { hook mark $1 || fail "blkstack mark $1"; }
workload
nbd-client -d /dev/nbd0 >/dev/null 2>&1
hook remove || fail "remove lw"
echo DONE
"#;

/// (sector, nr_sectors, flags, mark text, data) of each entry of a log
/// file, in order.
type Entry = (u64, u64, u64, String, Vec<u8>);

fn read_log(path: &Path) -> (LogSuper, Vec<Entry>) {
    let all = std::fs::read(path).expect("read a log file");
    let sup = LogSuper::decode(&all[..512]).expect("a log's super block");
    let bs = sup.sectorsize as usize;
    let mut at = bs;
    let mut out = Vec::new();
    for i in 0..sup.nr_entries {
        let e =
            LogEntry::decode(&all[at..at + bs]).unwrap_or_else(|err| panic!("entry {i}: {err}"));
        let mark = e.flags & LOG_MARK_FLAG != 0;
        let text =
            String::from_utf8_lossy(&all[at + 32..at + 32 + e.data_len as usize]).into_owned();
        at += bs;
        let mut data = Vec::new();
        if !mark && e.flags & 4 == 0 {
            let n = e.nr_sectors as usize * bs;
            data = all[at..at + n].to_vec();
            at += n;
        }
        out.push((e.sector, e.nr_sectors, e.flags, text, data));
    }
    (sup, out)
}

/// One line per entry, the data as its crc32c.
fn show_entries(v: &[Entry]) -> String {
    v.iter()
        .map(|(s, n, f, t, d)| format!("{s}+{n} flags={f:#x} {t} data={:08x}", crc32c::crc32c(d)))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn our_log_writes_logs_what_the_kernels_logs() {
    if !vm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("scratch");
    let (klog, blog) = (
        scratch.path().join("klog.img"),
        scratch.path().join("blog.img"),
    );
    let concise = [
        format!("kdata,,,rw,0 {SECTORS} memory"),
        format!("klog,,,rw,0 {SECTORS} file {} create", klog.display()),
        format!("bdata,,,rw,0 {SECTORS} memory"),
        format!("blog,,,rw,0 {SECTORS} file {} create", blog.display()),
        format!("lw,,,rw,0 {SECTORS} log-writes bdata blog"),
    ]
    .join(";");
    let srv = Arc::new(
        Serve::options()
            .args(&["--concise", &concise, "--export", "kdata,klog,lw"])
            .args(&["--listen", "nbd://127.0.0.1:0"])
            .start(),
    );
    let port = srv.tcp_port();
    let hs = srv.clone();
    let hooks = HostHooks::start(move |cmd| {
        let words: Vec<&str> = cmd.split_whitespace().collect();
        let out = match words.as_slice() {
            ["mark", text] => hs.run("message", &["lw", "0", "mark", text]),
            ["remove"] => {
                let u = hs.run("unexport", &["lw"]);
                if !u.status.success() {
                    return format!("unexport failed: {}", u.stderr);
                }
                hs.run("remove", &["lw"])
            }
            _ => return format!("unknown hook {cmd}"),
        };
        if out.status.success() {
            "ok".into()
        } else {
            format!("failed: {}", out.stderr)
        }
    });
    let pattern = scratch.path().join("pattern");
    let bytes: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    std::fs::write(&pattern, &bytes).expect("pattern");
    let run = Vm::new()
        .disk("kdata", &srv.uri("kdata"))
        .disk("klog", &srv.uri("klog"))
        .file(&pattern, "/test/pattern")
        .bin(Path::new("/usr/sbin/xfs_io"))
        .forward(NBD_PORT, port)
        .forward(HOOK_PORT, hooks.port())
        .timeout(200)
        .run(&format!(
            "{GUEST_HOOK_FN}{}",
            GUEST.replace("SECTORS", &SECTORS.to_string())
        ));
    println!("{}", run.out);
    run.assert_ok("the same workload over both log-writes targets");
    assert!(run.out.contains("DONE"), "{}", run.out);

    let (ks, kernel) = read_log(&klog);
    let (bs, ours) = read_log(&blog);
    assert_eq!(ks.sectorsize, bs.sectorsize, "log block sizes");
    println!("kernel log:\n{}", show_entries(&kernel));
    assert_eq!(
        show_entries(&ours),
        show_entries(&kernel),
        "blkstack's log (left) differs from the kernel's (right)"
    );
    assert!(
        kernel.len() >= 12,
        "too few entries to mean much:\n{}",
        show_entries(&kernel)
    );
    assert_eq!(
        kernel.last().map(|e| e.3.as_str()),
        Some("dm-log-writes-end")
    );
    assert!(
        kernel.iter().any(|e| e.2 & 2 != 0),
        "no FUA entry in the kernel's log"
    );
    replay_both_logs(&srv, scratch.path(), &klog, &blog);
}

/// Our replay-log on the kernel's log rebuilds the kernel's data device;
/// xfstests' replay-log, where it builds, replays both logs as ours does.
fn replay_both_logs(srv: &Serve, dir: &Path, klog: &Path, blog: &Path) {
    use std::process::Command;
    let size = (SECTORS * 512) as usize;
    let kdata = dir.join("kdata.img");
    let o = Command::new("nbdcopy")
        .arg(srv.uri("kdata"))
        .arg(&kdata)
        .output()
        .expect("run nbdcopy");
    assert!(o.status.success(), "nbdcopy kdata: {o:?}");
    let replay = |tool: &Path, log: &Path, name: &str| -> Vec<u8> {
        let img = dir.join(name);
        std::fs::write(&img, vec![0u8; size]).expect("image");
        let o = Command::new(tool)
            .arg("--log")
            .arg(log)
            .arg("--replay")
            .arg(&img)
            .args(["--end-mark", "dm-log-writes-end"])
            .output()
            .expect("run a replay-log");
        assert!(
            o.status.success(),
            "{} on {}: {o:?}",
            tool.display(),
            log.display()
        );
        std::fs::read(&img).expect("read the image")
    };
    let ours = Path::new(env!("CARGO_BIN_EXE_blkstack"));
    let args_tool = std::env::temp_dir().join(format!("blkstack-rl-{}", std::process::id()));
    // `blkstack replay-log`, as one executable a test can call like the C one.
    std::fs::write(
        &args_tool,
        format!("#!/bin/sh\nexec {} replay-log \"$@\"\n", ours.display()),
    )
    .expect("wrapper");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&args_tool, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let from_kernel_log = replay(&args_tool, klog, "k-ours.img");
    assert!(
        from_kernel_log == std::fs::read(&kdata).expect("kdata"),
        "replaying the kernel's log does not give the kernel's data device"
    );
    if let Some(tool) = xfstests_support::xfstests_replay_log() {
        assert!(replay(&tool, klog, "k-theirs.img") == from_kernel_log);
        assert!(replay(&tool, blog, "b-theirs.img") == replay(&args_tool, blog, "b-ours.img"));
    }
    let _ = std::fs::remove_file(&args_tool);
}
