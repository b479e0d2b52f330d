//! Child processes a test starts (tools, verbs, servers), each bounded in
//! time: a hang fails the test with what hung instead of blocking the
//! run, and nothing is left behind.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// What a bounded run printed, as text.
pub struct Out {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Wait for `child` at most `limit`; `None` (and the child killed) past it.
pub fn try_wait_bounded(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Wait for `child` at most `limit`; kill it and panic naming `what`
/// past that.
pub fn wait_bounded(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    try_wait_bounded(child, limit)
        .unwrap_or_else(|| panic!("{what} did not finish within {limit:?}"))
}

/// Run `cmd` with `stdin` fed, bounded by `limit`; its output as text.
pub fn run_bounded(cmd: &mut Command, stdin: Option<&str>, limit: Duration, what: &str) -> Out {
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    if let Some(text) = stdin {
        let mut i = child.stdin.take().expect("stdin");
        i.write_all(text.as_bytes()).expect("write stdin");
    }
    // Drain the pipes on threads so a chatty child cannot block on them.
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            r.read_to_string(&mut s).ok();
            s
        })
    };
    let to = drain(Box::new(child.stdout.take().expect("stdout")));
    let te = drain(Box::new(child.stderr.take().expect("stderr")));
    let status = wait_bounded(&mut child, limit, what);
    Out {
        status,
        stdout: to.join().expect("stdout thread"),
        stderr: te.join().expect("stderr thread"),
    }
}

/// Run a client command with a time limit; panics if it does not finish.
/// Its output goes through files, so a child that leaves a grandchild
/// holding the pipes open cannot hang the test.
pub fn run(cmd: &mut Command, limit: Duration) -> Output {
    let dir = crate::Scratch::new("out");
    let (o, e) = (dir.path("o"), dir.path("e"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&o).expect("stdout file"))
        .stderr(std::fs::File::create(&e).expect("stderr file"))
        .spawn()
        .unwrap_or_else(|err| panic!("cannot start {cmd:?}: {err}"));
    let status = wait_bounded(&mut child, limit, &format!("{cmd:?}"));
    Output {
        status,
        stdout: std::fs::read(&o).unwrap_or_default(),
        stderr: std::fs::read(&e).unwrap_or_default(),
    }
}

/// As [`run`], and the command must succeed: panics with its output if not.
pub fn run_ok(cmd: &mut Command, limit: Duration) -> Output {
    let out = run(cmd, limit);
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The Debian package a tool comes in, for the message when it is missing.
fn package_of(name: &str) -> &str {
    match name {
        "nbdinfo" | "nbdcopy" | "nbdsh" => "libnbd-bin",
        "qemu-img" | "qemu-io" | "qemu-nbd" | "qemu-storage-daemon" => "qemu-utils",
        "thin_check" | "thin_dump" | "thin_restore" | "cache_check" | "era_check" | "era_dump"
        | "era_invalidate" => "thin-provisioning-tools",
        "mkfs.ext4" | "e2fsck" => "e2fsprogs",
        "mkfs.xfs" | "xfs_repair" => "xfsprogs",
        "ip" => "iproute2",
        "veritysetup" | "cryptsetup" => "cryptsetup-bin",
        _ => name,
    }
}

/// The path of a tool the test runs: on `PATH`, or in the sbin folders a
/// non-root `PATH` may lack. Missing, the test fails naming the package
/// (`make deps` installs them all): a test that cannot run its tool
/// proves nothing, so it never passes quietly.
pub fn tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} is not installed: this test needs it (`make deps`, or apt-get install {})",
                package_of(name)
            )
        })
}

/// `thin_check` on a metadata file or device: panics with its output if
/// it finds anything wrong.
pub fn thin_check(meta: &std::path::Path) {
    let out = Command::new(tool("thin_check"))
        .arg(meta)
        .output()
        .expect("run thin_check");
    assert!(
        out.status.success(),
        "thin_check {} failed:\n{}{}",
        meta.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `thin_dump` of a metadata file: its XML.
pub fn thin_dump(meta: &std::path::Path) -> String {
    let out = Command::new(tool("thin_dump"))
        .arg(meta)
        .output()
        .expect("run thin_dump");
    assert!(
        out.status.success(),
        "thin_dump {} failed: {}",
        meta.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A KiB field of process `pid`'s /proc status (`VmRSS`, `VmSize`...).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    st.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// Resident memory of process `pid`, in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS")
}
