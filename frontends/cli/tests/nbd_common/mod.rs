//! Shared harness of the NBD interop tests: start the real `blkstack serve`
//! binary on a fresh Unix socket and a kernel-chosen TCP port, wait until
//! it says it is ready, run client tools with a time limit, and always
//! kill the server (Drop) so no test leaves a process behind.
//!
//! A missing client tool fails the test with the package to install: CI
//! installs them, and a silently skipped interop test proves nothing.

#![allow(dead_code)] // each test file uses a different part of the harness

pub mod certs;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A scratch directory removed on drop (std only: no extra dev-dependency).
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "blkstack-nbd-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create scratch dir");
        Scratch(p)
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub struct ServerProc {
    child: Option<Child>,
    pub socket: PathBuf,
    pub tcp: String,
    pub stdout_lines: Vec<String>,
    stderr: PathBuf,
    _dir: Scratch,
}

impl ServerProc {
    /// `blkstack serve --concise CONCISE --export EXPORTS` on a Unix socket
    /// and on 127.0.0.1:0; returns once the server printed "ready".
    pub fn start(concise: &str, exports: &str) -> ServerProc {
        Self::start_args(&["--concise", concise, "--export", exports])
    }

    pub fn start_args(args: &[&str]) -> ServerProc {
        let dir = Scratch::new("srv");
        let socket = dir.path("nbd.sock");
        let stderr = dir.path("stderr.txt");
        let mut child = Command::new(env!("CARGO_BIN_EXE_blkstack"))
            .arg("serve")
            .args(args)
            .arg("--listen")
            .arg(format!("nbd+unix:///?socket={}", socket.display()))
            .arg("--listen")
            .arg("nbd://127.0.0.1:0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            .spawn()
            .expect("start blkstack serve");
        let out = child.stdout.take().expect("stdout pipe");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut proc = ServerProc {
            child: Some(child),
            socket,
            tcp: String::new(),
            stdout_lines: Vec::new(),
            stderr,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line == "ready" => break,
                Ok(line) => {
                    if let Some(i) = line.find("nbd://") {
                        let rest = &line[i + 6..];
                        let hp = rest.split('/').next().unwrap_or("");
                        proc.tcp = hp.to_string();
                    }
                    proc.stdout_lines.push(line);
                }
                Err(_) => panic!(
                    "blkstack serve did not become ready within 20 s; stderr:\n{}",
                    proc.stderr_text()
                ),
            }
        }
        assert!(
            !proc.tcp.is_empty(),
            "no TCP address printed: {:?}",
            proc.stdout_lines
        );
        proc
    }

    pub fn unix_uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }

    pub fn tcp_uri(&self, export: &str) -> String {
        format!("nbd://{}/{export}", self.tcp)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// SIGTERM, then wait (bounded) for the graceful exit.
    pub fn terminate(mut self) -> (ExitStatus, String) {
        let mut child = self.child.take().expect("running");
        let sent = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .expect("run kill(1)");
        assert!(sent.success(), "kill -TERM failed");
        let status = wait_bounded(&mut child, Duration::from_secs(20))
            .unwrap_or_else(|| panic!("server ignored SIGTERM for 20 s"));
        (status, self.stderr_text())
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn wait_bounded(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
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

/// The path of a client tool, or a failure naming the package to install.
pub fn tool(name: &str) -> PathBuf {
    let pkg = match name {
        "fio" => "fio",
        "nbdinfo" | "nbdcopy" | "nbdsh" => "libnbd-bin",
        "qemu-img" | "qemu-io" | "qemu-nbd" => "qemu-utils",
        "nbdkit" => "nbdkit",
        _ => name,
    };
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let p = dir.join(name);
        if p.is_file() {
            return p;
        }
    }
    panic!("{name} is not installed: this interop test needs it (apt-get install {pkg})");
}

/// Run a client command with a time limit; panics with its output if it
/// times out or fails.
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

pub fn run(cmd: &mut Command, limit: Duration) -> Output {
    let dir = Scratch::new("out");
    let (o, e) = (dir.path("o"), dir.path("e"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&o).expect("stdout file"))
        .stderr(std::fs::File::create(&e).expect("stderr file"))
        .spawn()
        .unwrap_or_else(|err| panic!("cannot start {cmd:?}: {err}"));
    let status = wait_bounded(&mut child, limit)
        .unwrap_or_else(|| panic!("{cmd:?} did not finish within {limit:?}"));
    Output {
        status,
        stdout: std::fs::read(&o).unwrap_or_default(),
        stderr: std::fs::read(&e).unwrap_or_default(),
    }
}

/// Deterministic pseudo-random bytes (xorshift), so failures reproduce.
pub fn pattern_file(path: &Path, len: usize, seed: u64) {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    // Leave some all-zero stretches so sparse paths (holes) are exercised.
    for chunk in v.chunks_mut(256 << 10).skip(1).step_by(3) {
        chunk.fill(0);
    }
    std::fs::write(path, v).expect("write pattern file");
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
