//! The one harness every integration test starts `blkstack serve` with:
//! the real binary, in a private directory, on a unix NBD socket, with
//! its own control socket (so parallel tests never meet on the default
//! one), optionally a kernel-chosen TCP port; it returns once serve says
//! `ready`, runs `blkstack` verbs against it with a deadline, and always
//! stops it (SIGTERM, then SIGKILL) so no test leaves a process behind.
//! serve's stderr goes to a file: tests read it, and a failing test
//! prints it.

use crate::process::{run_bounded, try_wait_bounded, wait_bounded, Out};
use crate::Scratch;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Longest any single verb may take.
pub const VERB_DEADLINE: Duration = Duration::from_secs(60);

/// Longest serve may take to say `ready`.
const READY_DEADLINE: Duration = Duration::from_secs(60);

/// The `blkstack` binary cargo built beside the running test (the test
/// is `target/PROFILE/deps/NAME-HASH`, the binary `target/PROFILE/
/// blkstack`); `BLKSTACK_BIN` overrides.
pub fn blkstack_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("BLKSTACK_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().expect("the test's own path");
    let dir = exe.parent().and_then(Path::parent).expect("target/PROFILE");
    let bin = dir.join("blkstack");
    assert!(bin.is_file(), "{} is not built", bin.display());
    bin
}

/// Where serve's control socket is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// `--control DIR/control.sock`.
    Own,
    /// No `--control`, `XDG_RUNTIME_DIR=DIR`: the default socket,
    /// `DIR/blkstack/control.sock`.
    Default,
    /// The test passes `--control` itself.
    Given,
}

/// How to start serve.
pub struct ServeOptions {
    args: Vec<String>,
    tcp: bool,
    control: Control,
}

impl ServeOptions {
    /// More `serve` arguments.
    pub fn args(mut self, args: &[&str]) -> ServeOptions {
        self.args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// Also listen on `nbd://127.0.0.1:0`.
    pub fn tcp(mut self) -> ServeOptions {
        self.tcp = true;
        self
    }

    pub fn control(mut self, c: Control) -> ServeOptions {
        self.control = c;
        self
    }

    pub fn start(self) -> Serve {
        Serve::spawn(self)
    }
}

pub struct Serve {
    child: Option<Child>,
    scratch: Scratch,
    /// The private directory (files a test makes here go with it).
    pub dir: PathBuf,
    pub control: PathBuf,
    pub nbd_socket: PathBuf,
    /// `HOST:PORT` of the first TCP listener serve printed, if any.
    pub tcp: Option<String>,
    /// What serve printed on stdout before `ready`.
    pub stdout_lines: Vec<String>,
    stderr: PathBuf,
}

impl Serve {
    /// Nothing but the unix socket and control socket yet: add arguments.
    pub fn options() -> ServeOptions {
        ServeOptions {
            args: Vec::new(),
            tcp: false,
            control: Control::Own,
        }
    }

    /// `blkstack serve --concise STACK --export EXPORTS`.
    pub fn start(stack: &str, exports: &str) -> Serve {
        Serve::options()
            .args(&["--concise", stack, "--export", exports])
            .start()
    }

    /// As [`Serve::start`], also on a TCP port.
    pub fn start_tcp(stack: &str, exports: &str) -> Serve {
        Serve::options()
            .args(&["--concise", stack, "--export", exports])
            .tcp()
            .start()
    }

    fn spawn(o: ServeOptions) -> Serve {
        let scratch = Scratch::new("serve");
        let dir = scratch.0.clone();
        let nbd_socket = dir.join("nbd.sock");
        let stderr = dir.join("serve.stderr");
        let mut cmd = Command::new(blkstack_bin());
        cmd.arg("serve").args(&o.args).arg("--listen");
        cmd.arg(format!("nbd+unix:///?socket={}", nbd_socket.display()));
        if o.tcp {
            cmd.args(["--listen", "nbd://127.0.0.1:0"]);
        }
        let control = match o.control {
            Control::Own => {
                let c = dir.join("control.sock");
                cmd.arg("--control").arg(&c);
                c
            }
            Control::Default => {
                cmd.env("XDG_RUNTIME_DIR", &dir);
                dir.join("blkstack").join("control.sock")
            }
            Control::Given => PathBuf::new(),
        };
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("serve's stderr file"))
            .spawn()
            .expect("spawn blkstack serve");
        let mut srv = Serve {
            child: Some(child),
            scratch,
            dir,
            control,
            nbd_socket,
            tcp: None,
            stdout_lines: Vec::new(),
            stderr,
        };
        srv.wait_ready(o.tcp);
        srv
    }

    fn wait_ready(&mut self, tcp: bool) {
        let out = self.child_mut().stdout.take().expect("stdout pipe");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let deadline = Instant::now() + READY_DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) if l == "ready" => break,
                Ok(l) => {
                    if let (None, Some(i)) = (&self.tcp, l.find("nbd://")) {
                        let hp = l[i + 6..].split('/').next().unwrap_or("");
                        self.tcp = Some(hp.to_string());
                    }
                    self.stdout_lines.push(l);
                }
                Err(e) => {
                    let st = self.child_mut().try_wait();
                    panic!(
                        "blkstack serve never said ready ({e}; status {st:?}); stderr:\n{}",
                        self.stderr_text()
                    );
                }
            }
        }
        assert!(
            !tcp || self.tcp.is_some(),
            "no TCP address printed: {:?}",
            self.stdout_lines
        );
    }

    fn child_mut(&mut self) -> &mut Child {
        self.child.as_mut().expect("serve is running")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("serve is running").id()
    }

    /// `nbd+unix:///EXPORT?socket=...`
    pub fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.nbd_socket.display())
    }

    /// `HOST:PORT` of the TCP listener.
    pub fn tcp_addr(&self) -> &str {
        self.tcp.as_deref().expect("serve was started with .tcp()")
    }

    /// `nbd://HOST:PORT/EXPORT`
    pub fn tcp_uri(&self, export: &str) -> String {
        format!("nbd://{}/{export}", self.tcp_addr())
    }

    pub fn tcp_port(&self) -> u16 {
        let hp = self.tcp_addr();
        hp.rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in {hp}"))
    }

    /// What serve wrote on stderr so far.
    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// `blkstack VERB --control SOCK ARGS...`
    pub fn run(&self, verb: &str, args: &[&str]) -> Out {
        self.run_stdin(verb, args, None)
    }

    pub fn run_stdin(&self, verb: &str, args: &[&str], stdin: Option<&str>) -> Out {
        let mut cmd = Command::new(blkstack_bin());
        cmd.arg(verb).arg("--control").arg(&self.control).args(args);
        let what = format!("blkstack {verb} {args:?}");
        run_bounded(&mut cmd, stdin, VERB_DEADLINE, &what)
    }

    /// Run a verb that must succeed; its stdout.
    pub fn ok(&self, verb: &str, args: &[&str]) -> String {
        let o = self.run(verb, args);
        assert!(
            o.status.success(),
            "blkstack {verb} {args:?} failed: {}{}",
            o.stdout,
            o.stderr
        );
        o.stdout
    }

    /// Run a verb that must fail (exit 1); its stderr.
    pub fn fails(&self, verb: &str, args: &[&str]) -> String {
        let o = self.run(verb, args);
        assert_eq!(
            o.status.code(),
            Some(1),
            "blkstack {verb} {args:?} should fail with 1: {}{}",
            o.stdout,
            o.stderr
        );
        o.stderr
    }

    /// Everything a verb can observe, to show a refused change changed nothing.
    pub fn snapshot(&self) -> String {
        let mut s = self.ok("table", &[]);
        s += &self.ok("table", &["--inactive"]);
        s += &self.ok("info", &[]);
        s += &self.ok("ls", &["--tree"]);
        s
    }

    /// How serve ended, if it has (a crash shows here as a signal).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child_mut().try_wait().expect("try_wait")
    }

    /// SIGTERM, then serve must exit within `limit` (killed and a panic
    /// past that): a stop that never hangs.
    pub fn terminate_within(&mut self, limit: Duration) -> ExitStatus {
        let pid = self.pid();
        sigterm(pid);
        wait_bounded(self.child_mut(), limit, "blkstack serve after SIGTERM")
    }

    /// SIGTERM, the graceful exit (within 20 s), and what serve said on
    /// stderr.
    pub fn terminate(mut self) -> (ExitStatus, String) {
        let st = self.terminate_within(Duration::from_secs(20));
        (st, self.stderr_text())
    }
}

fn sigterm(pid: u32) {
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            sigterm(child.id());
            if try_wait_bounded(&mut child, Duration::from_secs(10)).is_none() {
                eprintln!("blkstack serve ignored SIGTERM for 10 s; killed");
            }
        }
        if std::thread::panicking() {
            eprintln!(
                "blkstack serve's stderr ({}):\n{}",
                self.scratch.0.display(),
                self.stderr_text()
            );
        }
    }
}
