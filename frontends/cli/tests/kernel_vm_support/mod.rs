//! The kernel VM from a test: boot Debian's Linux 6.12 under qemu (TCG)
//! through `scripts/kernel-vm.sh`, with blkstack's NBD exports as virtio
//! disks, run one guest shell script and get back what it printed and its
//! exit status. The real kernel's device-mapper, NBD client and
//! filesystems are the judges of every claim that blkstack behaves like
//! Linux; this module is how a test asks them.
//!
//! A test calls [`vm_available`] first: it is false only where
//! qemu-system cannot be installed, the kernel package cannot be fetched,
//! or the guest does not boot; the test then fails under CI and prints
//! one line saying what it skipped elsewhere
//! (`blkstack_test_support::skip`). Anything else that goes wrong in the
//! guest fails the test.

#![allow(dead_code)] // each test file uses a different part of the harness

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The script that does the work; tests and people run the same one.
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/kernel-vm.sh")
}

fn artifacts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/kernel-vm")
}

/// Whether a guest can be booted here. Decided once per test binary: the
/// first caller prepares the kernel and initramfs (cached under
/// `target/kernel-vm`) and, unless an earlier boot from the same artifacts
/// succeeded, boots a guest that only answers.
pub fn vm_available() -> bool {
    static OK: OnceLock<Result<(), String>> = OnceLock::new();
    match OK.get_or_init(probe) {
        Ok(()) => true,
        Err(why) => {
            blkstack_test_support::skip(&format!("no kernel VM: {why}"));
            false
        }
    }
}

fn probe() -> Result<(), String> {
    if std::env::var_os("BLKSTACK_SKIP_KERNEL_VM").is_some() {
        return Err("BLKSTACK_SKIP_KERNEL_VM is set".into());
    }
    let have_qemu = Command::new("qemu-system-x86_64")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !have_qemu {
        return Err("qemu-system-x86_64 is not installed (make deps installs it)".into());
    }
    let prep = Command::new(script())
        .arg("prepare")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script().display()))?;
    if !prep.status.success() {
        return Err(format!(
            "kernel-vm.sh prepare failed: {}",
            String::from_utf8_lossy(&prep.stderr).trim()
        ));
    }
    let stamp = artifacts().join("boot-ok");
    let built = artifacts().join("stamp");
    let fresh = |p: &Path| p.metadata().and_then(|m| m.modified()).ok();
    if fresh(&stamp).is_some() && fresh(&stamp) >= fresh(&built) {
        return Ok(());
    }
    let r = Vm::new().timeout(120).run("echo up");
    if r.code == 0 && r.out.trim() == "up" {
        let _ = std::fs::write(&stamp, "");
        Ok(())
    } else {
        Err(format!(
            "the guest did not boot (exit {}): {}\n{}",
            r.code, r.out, r.stderr
        ))
    }
}

/// One guest boot's configuration.
#[derive(Default, Clone)]
pub struct Vm {
    args: Vec<String>,
    timeout_s: u64,
}

/// What the guest script printed (stdout and stderr together, in order)
/// and its exit status; `stderr` is the host script's own messages (the
/// console's tail when the guest failed).
pub struct VmRun {
    pub code: i32,
    pub out: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl VmRun {
    /// Panics with everything the guest and the host script said unless
    /// the guest script exited 0.
    pub fn assert_ok(&self, what: &str) -> &Self {
        assert_eq!(
            self.code, 0,
            "{what}: guest script exited {}\n--- guest output ---\n{}\n--- kernel-vm.sh ---\n{}",
            self.code, self.out, self.stderr
        );
        self
    }

    /// The lines between `BEGIN name` and `END name` markers a guest
    /// script printed around one step's output.
    pub fn section(&self, name: &str) -> Option<String> {
        let begin = format!("BEGIN {name}");
        let end = format!("END {name}");
        let mut lines = self.out.lines().skip_while(|l| *l != begin);
        lines.next()?;
        let body: Vec<&str> = lines.take_while(|l| *l != end).collect();
        Some(body.join("\n"))
    }
}

impl Vm {
    pub fn new() -> Vm {
        Vm {
            args: Vec::new(),
            timeout_s: 240,
        }
    }

    /// A virtio disk with this serial (`/dev/disk/by-serial/SERIAL` in the
    /// guest) backed by an NBD URI or an image file.
    pub fn disk(mut self, serial: &str, uri: &str) -> Vm {
        self.args.push("--disk".into());
        self.args.push(format!("{serial}={uri}"));
        self
    }

    /// A virtio disk over an image file that another disk of the same
    /// guest may also use (two paths to one LUN).
    pub fn shared_disk(mut self, serial: &str, file: &Path) -> Vm {
        self.args.push("--shared-disk".into());
        self.args.push(format!("{serial}={}", file.display()));
        self
    }

    /// A virtio disk served over vhost-user at `socket` with `queues`
    /// virtqueues (`blkstack serve --vhost-user-blk SOCKET:NAME`); the
    /// first one is the guest's /dev/vda, and qemu reconnects when the
    /// server comes back.
    pub fn vhost_user_blk(mut self, socket: &Path, queues: u16) -> Vm {
        self.args.push("--vhost-user-blk".into());
        self.args.push(format!("{}:{queues}", socket.display()));
        self
    }

    /// Guest `10.0.2.100:guest_port` reaches host `127.0.0.1:host_port`.
    pub fn forward(mut self, guest_port: u16, host_port: u16) -> Vm {
        self.args.push("--fwd".into());
        self.args.push(format!("{guest_port}={host_port}"));
        self
    }

    /// A host file copied to `guest_path` in the guest.
    pub fn file(mut self, host: &Path, guest_path: &str) -> Vm {
        self.args.push("--file".into());
        self.args.push(format!("{}:{guest_path}", host.display()));
        self
    }

    /// An executable (with its libraries) copied to the guest's `/bin`.
    pub fn bin(mut self, path: &Path) -> Vm {
        self.args.push("--bin".into());
        self.args.push(path.display().to_string());
        self
    }

    /// blkstack's own binary, as `/bin/blkstack` in the guest.
    pub fn blkstack(self) -> Vm {
        self.bin(Path::new(env!("CARGO_BIN_EXE_blkstack")))
    }

    pub fn timeout(mut self, secs: u64) -> Vm {
        self.timeout_s = secs;
        self
    }

    /// Boots the guest, runs `guest_script` under busybox sh and waits for
    /// the guest to power off (bounded by the timeout, plus a margin for
    /// the host script's own work).
    pub fn run(&self, guest_script: &str) -> VmRun {
        let dir = std::env::temp_dir().join(format!(
            "blkstack-vm-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let script_path = dir.join("guest.sh");
        std::fs::write(&script_path, guest_script).expect("write guest script");
        let t0 = Instant::now();
        let out = Command::new(script())
            .arg("run")
            .args(&self.args)
            .arg("--timeout")
            .arg(self.timeout_s.to_string())
            .arg(&script_path)
            .stdin(Stdio::null())
            .output()
            .expect("run scripts/kernel-vm.sh");
        let _ = std::fs::remove_dir_all(&dir);
        VmRun {
            code: out.status.code().unwrap_or(-1),
            out: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            elapsed: t0.elapsed(),
        }
    }
}

/// `len` bytes of the tests' xorshift pattern in `dir/pattern`, to copy
/// into a guest (`/test/pattern`) as data whose every block differs.
pub fn guest_pattern(dir: &Path, len: usize, seed: u64) -> PathBuf {
    let p = dir.join("pattern");
    blkstack_test_support::pattern_file(&p, len, seed);
    p
}

/// Guest shell function `verify_pass DEV N`: a verified random-write pass
/// over the first `$S` sectors of DEV: N writes of 1..16 4 KiB blocks from
/// /test/pattern (at least 4 MiB) at pseudo-random places, O_DIRECT, the
/// same writes applied to an image in RAM, then the whole range read back
/// (O_DIRECT) must hash the same. Needs `S` set (a multiple of 2048).
pub const GUEST_VERIFY_FN: &str = r#"
verify_pass() {
  dev=$1; n=$2
  dd if=/dev/zero of=/tmp/exp bs=1M count=$((S/2048)) 2>/dev/null
  dd if=/dev/zero of=$dev bs=1M count=$((S/2048)) oflag=direct 2>/dev/null || return 1
  x=12345; i=0
  while [ $i -lt $n ]; do
    x=$(( (x * 1103515245 + 12345) % 2147483648 ))
    blk=$(( x % (S / 8 - 16) )); cnt=$(( x / 7 % 16 + 1 )); src=$(( x / 3 % 900 ))
    dd if=/test/pattern of=$dev bs=4k skip=$src seek=$blk count=$cnt oflag=direct 2>/dev/null || return 1
    dd if=/test/pattern of=/tmp/exp bs=4k skip=$src seek=$blk count=$cnt conv=notrunc 2>/dev/null || return 1
    i=$((i+1))
  done
  a=$(dd if=$dev bs=64k iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1)
  b=$(md5sum < /tmp/exp | cut -d' ' -f1)
  [ "$a" = "$b" ] || { echo "device $a, expected $b"; return 1; }
}
"#;

/// Shell-quotes one word for a guest script.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The guest port a [`HostHooks`] listener is forwarded to.
pub const HOOK_PORT: u16 = 7000;

/// Shell function a guest script defines to call the host:
/// `hook CMD ARGS...` prints the host's one-line answer and fails unless
/// it starts with `ok`.
pub const GUEST_HOOK_FN: &str = r#"hook() {
  r=$(echo "$*" | nc -w 30 10.0.2.100 7000)
  echo "hook $*: $r"
  case $r in ok*) return 0 ;; *) return 1 ;; esac
}
"#;

/// Lets a guest script ask the host to act at a point in its run (reload a
/// table, kill a server) and wait for it: the guest sends one line over a
/// forwarded TCP port, the handler runs on the host and its answer goes
/// back. Each connection carries one command; the handler's answer should
/// start with `ok` when the action worked.
pub struct HostHooks {
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HostHooks {
    pub fn start<F>(handler: F) -> HostHooks
    where
        F: FnMut(&str) -> String + Send + 'static,
    {
        use std::io::{BufRead, BufReader, Write};
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind hook port");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let mut handler = handler;
        let thread = std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                let (mut conn, _) = match listener.accept() {
                    Ok(c) => c,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                };
                let _ = conn.set_nonblocking(false);
                let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
                let mut line = String::new();
                let Ok(reader) = conn.try_clone() else {
                    continue;
                };
                if BufReader::new(reader).read_line(&mut line).is_err() {
                    continue;
                }
                let answer = handler(line.trim());
                let _ = writeln!(conn, "{}", answer.replace('\n', " | "));
            }
        });
        HostHooks {
            port,
            stop,
            thread: Some(thread),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for HostHooks {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
