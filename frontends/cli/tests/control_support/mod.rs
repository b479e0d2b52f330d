//! Shared by the control_* tests: run the real `blkstack serve` with a
//! control socket in a private directory, and run `blkstack` verbs
//! against it, every process bounded in time and killed if the test ends
//! early.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_blkstack");

/// Longest any single verb may take; a hang fails the test instead of
/// blocking it forever.
pub const VERB_DEADLINE: Duration = Duration::from_secs(60);

pub struct Serve {
    child: Child,
    pub dir: PathBuf,
    pub control: PathBuf,
    pub nbd_socket: PathBuf,
    /// `HOST:PORT` of the first TCP listener serve printed, if any was
    /// asked for with `--listen nbd://...` in the extra arguments.
    pub tcp: Option<String>,
}

pub struct Out {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// Wait for `child` at most `limit`; kill it and panic past that.
pub fn wait_bounded(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            return st;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Run a command with `stdin` fed, bounded by `limit`.
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
    let mut so = child.stdout.take().expect("stdout");
    let mut se = child.stderr.take().expect("stderr");
    let to = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut so, &mut s).ok();
        s
    });
    let te = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut se, &mut s).ok();
        s
    });
    let status = wait_bounded(&mut child, limit, what);
    Out {
        status,
        stdout: to.join().expect("stdout thread"),
        stderr: te.join().expect("stderr thread"),
    }
}

impl Serve {
    /// `blkstack serve --concise STACK --export EXPORTS` on a unix NBD
    /// socket and a control socket, both in a fresh directory.
    pub fn start(stack: &str, exports: &str) -> Serve {
        Serve::start_with(stack, exports, false)
    }

    /// With `default_control`, serve gets no `--control` and
    /// `XDG_RUNTIME_DIR` is the test directory, so the socket is the
    /// default one, `DIR/blkstack/control.sock`.
    pub fn start_with(stack: &str, exports: &str, default_control: bool) -> Serve {
        Serve::start_args(stack, exports, default_control, &[])
    }

    /// As [`Serve::start_with`], with more `serve` arguments.
    pub fn start_args(stack: &str, exports: &str, default_control: bool, extra: &[&str]) -> Serve {
        let dir = std::env::temp_dir().join(format!(
            "blkstack-ctl-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("test dir");
        let nbd_socket = dir.join("nbd.sock");
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "--concise", stack, "--export", exports, "--listen"])
            .arg(format!("nbd+unix:///?socket={}", nbd_socket.display()))
            .args(extra);
        let control = if default_control {
            cmd.env("XDG_RUNTIME_DIR", &dir);
            dir.join("blkstack").join("control.sock")
        } else {
            let c = dir.join("control.sock");
            cmd.arg("--control").arg(&c);
            c
        };
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn blkstack serve");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut srv = Serve {
            child,
            dir,
            control,
            nbd_socket,
            tcp: None,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) if l == "ready" => break,
                Ok(l) => {
                    if let (None, Some(i)) = (&srv.tcp, l.find("nbd://")) {
                        let hp = l[i + 6..].split('/').next().unwrap_or("");
                        srv.tcp = Some(hp.to_string());
                    }
                }
                Err(e) => {
                    let st = srv.child.try_wait();
                    panic!("blkstack serve never said ready ({e}; status {st:?})");
                }
            }
        }
        srv
    }

    /// The port of the TCP listener asked for with `--listen nbd://...`.
    pub fn tcp_port(&self) -> u16 {
        self.tcp
            .as_deref()
            .and_then(|hp| hp.rsplit(':').next())
            .and_then(|p| p.parse().ok())
            .expect("serve's TCP port")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.nbd_socket.display())
    }

    /// `blkstack VERB --control SOCK ARGS...`
    pub fn run(&self, verb: &str, args: &[&str]) -> Out {
        self.run_stdin(verb, args, None)
    }

    pub fn run_stdin(&self, verb: &str, args: &[&str], stdin: Option<&str>) -> Out {
        let mut cmd = Command::new(BIN);
        cmd.arg(verb).arg("--control").arg(&self.control).args(args);
        run_bounded(
            &mut cmd,
            stdin,
            VERB_DEADLINE,
            &format!("blkstack {verb} {args:?}"),
        )
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
}

impl Serve {
    /// How serve ended, if it has (a crash shows here as a signal).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }

    /// SIGTERM, then the server must exit within `limit` (killed and a
    /// panic past that): a stop that never hangs.
    pub fn terminate_within(&mut self, limit: Duration) -> ExitStatus {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc_kill(self.child.id() as i32, 15) };
        wait_bounded(&mut self.child, limit, "blkstack serve after SIGTERM")
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        // SIGTERM for a graceful stop, then make sure it is gone.
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc_kill(self.child.id() as i32, 15) };
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                let _ = std::fs::remove_dir_all(&self.dir);
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}
