//! Harness of the multi-host tests: NBD servers in network namespaces
//! (the lab's `netns` testbed: a bridge in a switch namespace, a client
//! namespace, one namespace per host), the real peers as servers
//! (blkstack serve with a delay target over a file target, qemu-nbd,
//! nbdkit's delay filter), faults a SAN sees (a server killed with
//! SIGKILL and restarted, a link cut at the switch and restored), and a
//! watcher that records each multipath path's state (`A`/`F` in dm-mpath's
//! status) over a run, so a test can assert "failed, then active again".
//!
//! Everything is a guard: servers, namespaces, veths and scratch files go
//! on drop, also when a test panics. The tests skip, saying why (and
//! fail under CI), only when namespaces cannot be made (not root, no
//! iproute2, `ip netns add` refused); a missing qemu-nbd or nbdkit fails
//! them (`make deps`).

#![allow(dead_code)] // each test file uses a different part of the harness

use blkstack_lab::netns::{self, delay_over_file, Daemon, Testbed, EXPORT, NBD_PORT};
pub use blkstack_test_support::tool;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Whether namespaces can be made; if not, the test skips (fails under CI).
pub fn namespaces_or_skip(test: &str) -> bool {
    match netns::probe() {
        Ok(()) => true,
        Err(why) => {
            blkstack_test_support::skip(&format!(
                "{test}: network namespaces cannot be created here: {why:#}"
            ));
            false
        }
    }
}

/// What a host runs.
#[derive(Clone, Copy, Debug)]
pub enum Server {
    /// `blkstack serve` exporting a delay target over a file target.
    Blkstack { delay_ms: f64 },
    /// `qemu-nbd -f raw --shared=8 -t`.
    QemuNbd,
    /// `nbdkit --filter=delay file` (whole milliseconds).
    Nbdkit { delay_ms: u32 },
}

/// Hosts in namespaces, each serving export `lun` on port 10809.
pub struct Hosts {
    // Dropped first: the servers, then the namespaces, then the files.
    servers: Vec<Option<Daemon>>,
    pub bed: Testbed,
    kinds: Vec<Server>,
    files: Vec<PathBuf>,
    pub sectors: u64,
    pub dir: tempfile::TempDir,
}

impl Hosts {
    /// Start one host per entry of `kinds`; with `shared` every host
    /// serves the same backing file (one LUN, several paths), else each
    /// its own.
    pub fn start(kinds: &[Server], sectors: u64, shared: bool) -> Hosts {
        let dir = tempfile::tempdir().expect("scratch dir");
        let files: Vec<PathBuf> = (0..kinds.len())
            .map(|i| {
                let f = dir.path().join(if shared {
                    "lun.img".into()
                } else {
                    format!("h{i}.img")
                });
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&f)
                    .expect("backing file");
                file.set_len(sectors * 512).expect("size backing file");
                f
            })
            .collect();
        let bed = Testbed::new(kinds.len()).expect("testbed");
        let mut hosts = Hosts {
            servers: Vec::new(),
            bed,
            kinds: kinds.to_vec(),
            files,
            sectors,
            dir,
        };
        for i in 0..kinds.len() {
            let d = hosts.spawn(i);
            hosts.servers.push(Some(d));
        }
        hosts
    }

    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    pub fn file(&self, i: usize) -> &Path {
        &self.files[i]
    }

    fn spawn(&self, i: usize) -> Daemon {
        let addr = self.bed.host_addr(i);
        let file = self.files[i].display().to_string();
        let log = self.dir.path().join(format!("h{i}.log"));
        let (what, program, args): (&str, PathBuf, Vec<String>) = match self.kinds[i] {
            Server::Blkstack { delay_ms } => {
                return self
                    .bed
                    .start_blkstack(
                        i,
                        Path::new(env!("CARGO_BIN_EXE_blkstack")),
                        self.dir.path(),
                        &delay_over_file(&self.files[i], self.sectors, delay_ms, false),
                    )
                    .unwrap_or_else(|e| panic!("host h{i}: {e:#}"))
            }
            Server::QemuNbd => (
                "qemu-nbd",
                tool("qemu-nbd"),
                [
                    "-f",
                    "raw",
                    "--shared=8",
                    "-t",
                    "-b",
                    &addr,
                    "-p",
                    "10809",
                    "-x",
                    EXPORT,
                    &file,
                ]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            ),
            Server::Nbdkit { delay_ms } => (
                "nbdkit",
                tool("nbdkit"),
                vec![
                    "-f".into(),
                    "-i".into(),
                    addr.clone(),
                    "-p".into(),
                    NBD_PORT.to_string(),
                    "-e".into(),
                    EXPORT.into(),
                    "--filter=delay".into(),
                    "file".into(),
                    file,
                    format!("rdelay={delay_ms}ms"),
                    format!("wdelay={delay_ms}ms"),
                ],
            ),
        };
        self.bed
            .start_server(i, what, program.as_os_str(), &args, &log)
            .unwrap_or_else(|e| panic!("host h{i}: {e:#}"))
    }

    /// `kill -9` host `i`'s server.
    pub fn kill9(&mut self, i: usize) {
        if let Some(mut d) = self.servers[i].take() {
            d.kill();
        }
    }

    /// Start host `i`'s server again (after [`Hosts::kill9`]).
    pub fn restart(&mut self, i: usize) {
        self.kill9(i);
        let d = self.spawn(i);
        self.servers[i] = Some(d);
    }

    /// Cut (`false`) or restore (`true`) host `i`'s link at the switch.
    pub fn link(&self, i: usize, up: bool) {
        self.bed.set_link(i, up).expect("ip link set");
    }

    /// A stack-file line `NAME: 0 SECTORS nbd URI OPTS` for host `i`.
    pub fn nbd_line(&self, name: &str, i: usize, opts: &str) -> String {
        format!(
            "{name}: 0 {} nbd {} {opts}\n",
            self.sectors,
            self.bed.host_uri(i)
        )
    }
}

/// Each path's state (`'A'` or `'F'`) in a dm-mpath status line: the
/// word after the path's device in the per-path triples.
pub fn path_states(status: &str, devs: &[String]) -> Vec<Option<char>> {
    let words: Vec<&str> = status.split_whitespace().collect();
    devs.iter()
        .map(|d| {
            words.windows(2).find_map(|w| {
                (w[0] == d && (w[1] == "A" || w[1] == "F")).then(|| w[1].chars().next())?
            })
        })
        .collect()
}

/// How many times the path checker reinstated `dev`, from the
/// multipath's `checker` message answer (`DEV STATE probes N ok N fail N
/// reinstated N failed N` per path).
pub fn checker_reinstated(answer: &str, dev: &str) -> Option<u64> {
    answer.lines().find_map(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        if w.first() != Some(&dev) {
            return None;
        }
        let at = w.iter().position(|x| *x == "reinstated")?;
        w.get(at + 1)?.parse().ok()
    })
}

/// The path devices, in order, from a `path_stats` answer.
pub fn path_devs(path_stats: &str) -> Vec<String> {
    path_stats
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

/// Samples a multipath's status on a thread and keeps, per path, the
/// sequence of states it went through (`"AFA"`: failed, then active).
pub struct PathWatch {
    stop: Arc<AtomicBool>,
    history: Arc<Mutex<Vec<String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PathWatch {
    pub fn start(
        devs: Vec<String>,
        status: impl Fn() -> Option<String> + Send + 'static,
    ) -> PathWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let history = Arc::new(Mutex::new(vec![String::new(); devs.len()]));
        let (s, h) = (stop.clone(), history.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Acquire) {
                if let Some(text) = status() {
                    let states = path_states(&text, &devs);
                    let mut h = h.lock().unwrap();
                    for (hist, st) in h.iter_mut().zip(states) {
                        if let Some(c) = st {
                            if !hist.ends_with(c) {
                                hist.push(c);
                            }
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(40));
            }
        });
        PathWatch {
            stop,
            history,
            thread: Some(thread),
        }
    }

    /// Each path's state sequence so far.
    pub fn history(&self) -> Vec<String> {
        self.history.lock().unwrap().clone()
    }

    /// Wait (up to `limit`) until path `i`'s history contains `pattern`
    /// as a subsequence of its states, e.g. "FA".
    pub fn wait_for(&self, i: usize, pattern: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if is_subsequence(pattern, &self.history()[i]) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for PathWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Is `needle` a subsequence of `hay` (in order, not necessarily adjacent)?
pub fn is_subsequence(needle: &str, hay: &str) -> bool {
    let mut it = hay.chars();
    needle.chars().all(|c| it.any(|h| h == c))
}
