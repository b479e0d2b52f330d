//! Filesystem workloads in the kernel VM (`scripts/kernel-vm.sh`, Debian's
//! Linux 6.12 under qemu TCG, no root): one boot does it all. The guest
//! makes an ext4 or xfs on a blkstack `log-writes` device it reaches with
//! the kernel's nbd client (which passes FLUSH and FUA as they are), marks
//! the end of mkfs, runs a file workload with a `sync` per step, and
//! unmounts. Then, for each crash point, it asks the host (a one-line TCP
//! hook) to move the replay origin to the next point and drop the
//! overlay; it mounts the overlay (the kernel replays the journal), unmounts
//! it and runs `e2fsck -fn` / `xfs_repair -n`, as xfstests' generic/455
//! does after each replay. With `--reorder`, the host hands out the
//! crash states of each FLUSH point's epoch the same way: `next` answers
//! with a label (`3.r1`, `3.t2`) in place of the point's number, and the
//! host has written the state into the emptied overlay before it answers,
//! so the guest's loop is the same for both. The guest prints each
//! state's exit status and, for a failure, the checker's output; the host
//! reads them when the guest powers off.

use crate::block::{Recorder, LOG_WRITES};
use crate::runner::{Outcome, Overlay, ReorderOptions, State, Walker, OVERLAY};
use crate::walk::{plan, PlanOptions};
use anyhow::{bail, Context};
use blkstack_mapped::Registry;
use blkstack_nbd::{Export, ListenUri, Server};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Fs {
    Ext4,
    Xfs,
}

impl Fs {
    fn name(self) -> &'static str {
        match self {
            Fs::Ext4 => "ext4",
            Fs::Xfs => "xfs",
        }
    }
    /// mkfs.xfs refuses a filesystem under 300 MB and a log under 64 MB
    /// unless it runs under fstests (all three of its variables set), as
    /// xfstests' crash tests do: a small device and log keep every
    /// replayed point cheap, and the kernel mounts them.
    fn mkfs(self) -> &'static str {
        match self {
            Fs::Ext4 => "mkfs.ext4 -q -F",
            Fs::Xfs => "TEST_DIR=/tmp TEST_DEV=/dev/nbd0 QA_CHECK_FS=1 mkfs.xfs -q -f",
        }
    }
    fn fsck(self) -> &'static str {
        match self {
            Fs::Ext4 => "e2fsck -fn",
            Fs::Xfs => "xfs_repair -n",
        }
    }
    /// The smallest device its mkfs takes, with room to work.
    pub fn min_mib(self) -> u64 {
        match self {
            Fs::Ext4 | Fs::Xfs => 64,
        }
    }
}

/// The mark the guest sets after mkfs; points start after it.
pub const MKFS_MARK: &str = "crashtest-mkfs";
const END_MARK: &str = "crashtest-end";
const NBD_GUEST_PORT: u16 = 10809;
const HOOK_GUEST_PORT: u16 = 7000;

const GUEST: &str = r#"
fail() { echo "FAIL: $*"; exit 1; }
ask() { echo "$*" | nc -w 60 10.0.2.100 7000; }
hook() { r=$(ask "$@"); [ -n "$r" ] || r=$(ask "$@"); case $r in ok*) return 0 ;; *) echo "hook $*: $r"; return 1 ;; esac; }
modprobe nbd || fail "modprobe nbd"
if [ WORKLOAD = 1 ]; then
  nbd-client 10.0.2.100 10809 /dev/nbd0 -N LOGWRITES -b 512 >/dev/null 2>&1 || fail "nbd-client LOGWRITES"
  MKFS /dev/nbd0 || fail "MKFS"
  hook mark MKFSMARK || fail "mark"
  mkdir -p /mnt
  mount -t FS /dev/nbd0 /mnt || fail "mount the new FS"
  i=1
  while [ $i -le STEPS ]; do
    d=/mnt/d$((i % 5)); mkdir -p $d
    dd if=/dev/urandom of=$d/f$i bs=4096 count=$((i % 7 + 1)) 2>/dev/null || fail "write f$i"
    [ $((i % 3)) = 0 ] && rm -f /mnt/d$(((i + 3) % 5))/f$((i - 2))
    [ $((i % 4)) = 0 ] && mv $d/f$i /mnt/d$(((i + 1) % 5))/g$i 2>/dev/null
    [ $((i % 6)) = 0 ] && echo "step $i" >> /mnt/appended
    sync
    i=$((i + 1))
  done
  umount /mnt || fail "umount"
  nbd-client -d /dev/nbd0 >/dev/null 2>&1
  hook endlog || fail "end the log"
fi
hook plan || fail "plan the crash points"
nbd-client 10.0.2.100 10809 /dev/nbd1 -N OVERLAY -b 512 >/dev/null 2>&1 || fail "nbd-client OVERLAY"
mkdir -p /mnt
k=1; prc=-
while :; do
  # "next K RC": the point wanted and the last one's result; asking again
  # for the same K gets the same answer, so a lost answer is retried.
  r=$(ask next $k $prc); [ -n "$r" ] || r=$(ask next $k $prc)
  case $r in ok*) ;; done*) break ;; *) fail "next point: $r" ;; esac
  set -- $r
  n=$2; e=$3
  blockdev --flushbufs /dev/nbd1
  if mount -t FS /dev/nbd1 /mnt >/tmp/out 2>&1; then
    umount /mnt >>/tmp/out 2>&1
    FSCK /dev/nbd1 >/tmp/out 2>&1; rc=$?
  else
    rc=mount; dmesg | tail -n 5 >>/tmp/out
  fi
  echo "POINT $n $e $rc"
  if [ "$rc" != 0 ]; then echo "BEGIN point-$n"; cat /tmp/out; echo "END point-$n"; fi
  prc=$rc; k=$((k + 1))
done
nbd-client -d /dev/nbd1 >/dev/null 2>&1
echo CRASHTEST-DONE
"#;

pub struct FsOptions {
    pub fs: Fs,
    pub sectors: u64,
    /// Workload steps (each ends with a sync).
    pub steps: u64,
    /// An existing log to check instead of running the workload.
    pub existing_log: Option<PathBuf>,
    pub log_path: PathBuf,
    pub plan: PlanOptions,
    pub vm_script: PathBuf,
    pub vm_timeout_s: u64,
    pub stop_at_failure: bool,
    pub reorder: Option<ReorderOptions>,
}

/// What the hooks share with the run.
struct HookState {
    reg: Arc<Registry>,
    log: PathBuf,
    plan: PlanOptions,
    sectors: u64,
    walker: Option<Walker>,
    /// When each point or state was handed to the guest.
    handed: Vec<(State, Instant)>,
    error: Option<String>,
    stop_at_failure: bool,
    reorder: Option<ReorderOptions>,
}

impl HookState {
    fn answer(&mut self, cmd: &str) -> String {
        let words: Vec<&str> = cmd.split_whitespace().collect();
        let r = match words.as_slice() {
            ["mark", text] => self
                .reg
                .message(LOG_WRITES, 0, &["mark", text])
                .map(|_| "ok".to_string())
                .map_err(anyhow::Error::from),
            ["endlog"] => self.end_log().map(|_| "ok".to_string()),
            ["plan"] => self.make_plan(),
            ["next", k, last_rc] => match k.parse::<usize>() {
                Ok(k) => self.next(k, last_rc),
                Err(_) => Err(anyhow::anyhow!("next: '{k}' is not a point number")),
            },
            _ => Err(anyhow::anyhow!("unknown hook '{cmd}'")),
        };
        r.unwrap_or_else(|e| {
            let s = format!("{e:#}");
            self.error.get_or_insert(s.clone());
            format!("error: {s}")
        })
    }

    /// Mark the log's end and wait until the super block counts the mark
    /// (the logger writes it after every mark), so the log file is whole.
    fn end_log(&mut self) -> anyhow::Result<()> {
        self.reg.message(LOG_WRITES, 0, &["mark", END_MARK])?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let o = PlanOptions {
                rule: crate::walk::PointRule::Marks,
                start_mark: Some(MKFS_MARK.into()),
                every_nth: 1,
                max_points: None,
            };
            if let Ok(p) = plan(&self.log, &o) {
                if p.points.iter().any(|x| x.mark == END_MARK) {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!("the log never showed its end mark");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn make_plan(&mut self) -> anyhow::Result<String> {
        if let Some(w) = &self.walker {
            // A retry of a lost answer.
            return Ok(format!("ok {}", w.plan.points.len()));
        }
        let p = plan(&self.log, &self.plan)?;
        let n = p.points.len();
        // Created before the boot, as it is exported.
        let overlay = Overlay::existing(self.reg.clone(), self.sectors);
        let mut w = Walker::new(&self.log, p, overlay)?;
        if let Some(r) = self.reorder {
            w = w.with_reorder(&self.log, r)?;
        }
        self.walker = Some(w);
        Ok(format!("ok {n}"))
    }

    /// The `k`th (from 1) point or state for the guest; `last_rc` is the
    /// previous one's result (`-` for none). Asking for the one already
    /// handed answers the same again, so the guest may retry a lost answer.
    fn next(&mut self, k: usize, last_rc: &str) -> anyhow::Result<String> {
        if let Some((s, _)) = self.handed.get(k.wrapping_sub(1)) {
            return Ok(format!("ok {} {}", s.label(), s.point.entry));
        }
        if k != self.handed.len() + 1 {
            bail!("next {k}: {} points handed so far", self.handed.len());
        }
        if last_rc != "0" && last_rc != "-" && self.stop_at_failure {
            tracing::info!(point = k - 1, "crashtest: a point failed: stopping");
            return Ok("done".into());
        }
        let w = self.walker.as_mut().context("next before plan")?;
        match w.advance()? {
            Some(s) => {
                let label = s.label();
                tracing::info!(state = %label, entry = s.point.entry, "crashtest: guest checks");
                let answer = format!("ok {label} {}", s.point.entry);
                self.handed.push((s, Instant::now()));
                Ok(answer)
            }
            None => Ok("done".into()),
        }
    }
}

/// Serve one-line hook requests on a loopback port until stopped.
fn start_hooks(
    state: Arc<Mutex<HookState>>,
) -> anyhow::Result<(u16, Arc<AtomicBool>, std::thread::JoinHandle<()>)> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let port = listener.local_addr()?.port();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let t = std::thread::spawn(move || {
        while !stop2.load(Ordering::Relaxed) {
            let Ok((mut conn, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            };
            let _ = conn.set_nonblocking(false);
            let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
            let Ok(reader) = conn.try_clone() else {
                continue;
            };
            let mut line = String::new();
            // A request is one short line: bound what a peer can send.
            if BufReader::new(std::io::Read::take(reader, 4096))
                .read_line(&mut line)
                .is_err()
            {
                continue;
            }
            let answer = state.lock().answer(line.trim());
            let _ = writeln!(conn, "{}", answer.replace('\n', " | "));
        }
    });
    Ok((port, stop, t))
}

/// The kernel VM's artifacts (cached after the first time).
fn prepare(vm_script: &Path) -> anyhow::Result<()> {
    if !vm_script.exists() {
        bail!(
            "the kernel VM script {} is not there (run from the repository, or give --vm-script)",
            vm_script.display()
        );
    }
    let prep = std::process::Command::new(vm_script)
        .arg("prepare")
        .stdin(std::process::Stdio::null())
        .output()
        .with_context(|| format!("running {} prepare", vm_script.display()))?;
    if !prep.status.success() {
        bail!(
            "kernel-vm.sh prepare failed: {}",
            String::from_utf8_lossy(&prep.stderr).trim()
        );
    }
    Ok(())
}

/// The guest script for this filesystem (with the workload, or only the
/// checks of an existing log).
fn guest_script(o: &FsOptions, workload: bool) -> String {
    // The placeholders holding `FS` are set aside first, so that `FS`
    // (the type) is replaced alone and not inside what they expand to.
    GUEST
        .replace("WORKLOAD", if workload { "1" } else { "0" })
        .replace("LOGWRITES", LOG_WRITES)
        .replace("OVERLAY", OVERLAY)
        .replace("STEPS", &o.steps.to_string())
        .replace("MKFSMARK", "\u{1}")
        .replace("MKFS", "\u{2}")
        .replace("FSCK", "\u{3}")
        .replace("FS", o.fs.name())
        .replace('\u{1}', MKFS_MARK)
        .replace('\u{2}', o.fs.mkfs())
        .replace('\u{3}', o.fs.fsck())
}

/// Run the filesystem crash test; returns the walker with every outcome.
pub fn run(o: &FsOptions) -> anyhow::Result<Walker> {
    prepare(&o.vm_script)?;
    let (reg, recorder) = match &o.existing_log {
        Some(_) => (Registry::new(), None),
        None => {
            let r = Recorder::create(&o.log_path, o.sectors, o.sectors * 4)?;
            (r.reg.clone(), Some(r))
        }
    };
    let log = o.existing_log.clone().unwrap_or(o.log_path.clone());
    if o.existing_log.is_some() {
        // Refuse a bad log before the boot.
        plan(&log, &o.plan)?;
    }
    Overlay::create(reg.clone(), o.sectors)?;
    let mut exports = vec![Export::new(OVERLAY, reg.device(OVERLAY)?, false)];
    if recorder.is_some() {
        exports.push(Export::new(LOG_WRITES, reg.device(LOG_WRITES)?, false));
    }
    let server = Server::bind(exports, &[ListenUri::Tcp(([127, 0, 0, 1], 0).into())])?;
    let nbd_port = match server.addresses().first() {
        Some(ListenUri::Tcp(a)) => a.port(),
        _ => bail!("the NBD server has no TCP address"),
    };
    let stopper = server.stopper();
    let server_thread = std::thread::spawn(move || server.run());
    let state = Arc::new(Mutex::new(HookState {
        reg: reg.clone(),
        log: log.clone(),
        plan: o.plan.clone(),
        sectors: o.sectors,
        walker: None,
        handed: Vec::new(),
        error: None,
        stop_at_failure: o.stop_at_failure,
        reorder: o.reorder,
    }));
    let (hook_port, hook_stop, hook_thread) = start_hooks(state.clone())?;
    let script = guest_script(o, recorder.is_some());
    let dir = tempfile::tempdir()?;
    let script_path = dir.path().join("guest.sh");
    std::fs::write(&script_path, script)?;
    let out = std::process::Command::new(&o.vm_script)
        .arg("run")
        .args(["--fwd", &format!("{NBD_GUEST_PORT}={nbd_port}")])
        .args(["--fwd", &format!("{HOOK_GUEST_PORT}={hook_port}")])
        .args(["--timeout", &o.vm_timeout_s.to_string()])
        .arg(&script_path)
        .stdin(std::process::Stdio::null())
        .output()
        .context("running the kernel VM")?;
    let ended = Instant::now();
    hook_stop.store(true, Ordering::Relaxed);
    let _ = hook_thread.join();
    stopper.stop();
    let _ = server_thread.join();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut st = state.lock();
    if let Some(e) = st.error.take() {
        bail!("crashtest: {e}\n--- guest ---\n{text}");
    }
    let handed = std::mem::take(&mut st.handed);
    let Some(mut walker) = st.walker.take() else {
        bail!(
            "the guest never reached the checks (exit {:?}):\n{text}\n{}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    drop(st);
    collect(&mut walker, &handed, &text, ended)?;
    walker.take_cow();
    if !text.contains("CRASHTEST-DONE") {
        bail!(
            "the guest stopped after {} of {} points (exit {:?}):\n{text}\n{}",
            walker.outcomes.len(),
            walker.plan.points.len(),
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    drop(recorder);
    Ok(walker)
}

/// The guest's `POINT label entry rc` lines (and failures' output) as
/// outcomes.
fn collect(
    w: &mut Walker,
    handed: &[(State, Instant)],
    text: &str,
    ended: Instant,
) -> anyhow::Result<()> {
    for (o, took) in outcomes(handed, text, ended) {
        w.record(o, took);
    }
    Ok(())
}

/// Each handed point or state the guest reported, with its result and
/// how long it took (until the guest asked for the next one, or for the
/// last, until it powered off).
fn outcomes(handed: &[(State, Instant)], text: &str, ended: Instant) -> Vec<(Outcome, Duration)> {
    let mut out = Vec::new();
    let mut rc: HashMap<&str, &str> = HashMap::new();
    for l in text.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if let ["POINT", n, _entry, code] = f.as_slice() {
            rc.insert(n, code);
        }
    }
    for (i, (s, at)) in handed.iter().enumerate() {
        let label = s.label();
        let Some(code) = rc.get(label.as_str()) else {
            continue;
        };
        let took = handed
            .get(i + 1)
            .map_or(ended, |(_, next)| *next)
            .duration_since(*at);
        let ok = *code == "0";
        let output = if ok {
            String::new()
        } else {
            let body = section(text, &format!("point-{label}"));
            format!("exit {code}\n{body}")
        };
        out.push((
            Outcome {
                point: s.point.clone(),
                variant: s.variant.clone(),
                ok,
                output,
            },
            took,
        ));
    }
    out
}

fn section(text: &str, name: &str) -> String {
    let begin = format!("BEGIN {name}");
    let end = format!("END {name}");
    text.lines()
        .skip_while(|l| *l != begin)
        .skip(1)
        .take_while(|l| *l != end)
        .collect::<Vec<_>>()
        .join("\n")
}

/// Where the repository's VM script is when run from its top directory.
pub fn default_vm_script() -> PathBuf {
    Path::new("scripts/kernel-vm.sh").to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::Variant;
    use crate::walk::Point;

    #[test]
    fn reorder_states_come_back_by_their_labels() {
        let point = Point {
            n: 3,
            entry: 40,
            flags: blkstack_mapped::targets::log_writes::format::LOG_FLUSH_FLAG,
            flushes: 2,
            mark: String::new(),
        };
        let state = |j, torn| State {
            point: point.clone(),
            variant: Some(Variant {
                j,
                seed: 99 + j,
                torn,
                kept: 1,
                epoch_entries: 4,
                torn_entry: None,
            }),
        };
        let t0 = Instant::now();
        let handed = vec![
            (
                State {
                    point: point.clone(),
                    variant: None,
                },
                t0,
            ),
            (state(1, false), t0),
            (state(1, true), t0),
        ];
        assert_eq!(handed[1].0.label(), "3.r1");
        assert_eq!(handed[2].0.label(), "3.t1");
        let text = "POINT 3 40 0\nPOINT 3.r1 40 0\nPOINT 3.t1 40 4\n\
                    BEGIN point-3.t1\nbad inode\nEND point-3.t1\n";
        let got = outcomes(&handed, text, Instant::now());
        assert_eq!(got.len(), 3);
        assert!(got[0].0.ok && got[0].0.variant.is_none());
        assert!(got[1].0.ok && got[1].0.variant.as_ref().is_some_and(|v| !v.torn));
        let (bad, _) = &got[2];
        assert!(!bad.ok);
        assert_eq!(bad.variant.as_ref().map(|v| v.seed), Some(100));
        assert_eq!(bad.output, "exit 4\nbad inode");
    }

    #[test]
    fn each_filesystem_gets_its_own_commands() {
        let opts = |fs| FsOptions {
            fs,
            sectors: fs.min_mib() << 11,
            steps: 1,
            existing_log: None,
            log_path: PathBuf::from("log"),
            plan: PlanOptions {
                rule: crate::walk::PointRule::Durable,
                start_mark: Some(MKFS_MARK.into()),
                every_nth: 1,
                max_points: None,
            },
            vm_script: PathBuf::from("vm.sh"),
            vm_timeout_s: 1,
            stop_at_failure: false,
            reorder: None,
        };
        let xfs = guest_script(&opts(Fs::Xfs), true);
        assert!(xfs.contains(
            "TEST_DIR=/tmp TEST_DEV=/dev/nbd0 QA_CHECK_FS=1 mkfs.xfs -q -f /dev/nbd0 || fail"
        ));
        assert!(xfs.contains("hook mark crashtest-mkfs"));
        assert!(xfs.contains("mount -t xfs /dev/nbd1 /mnt"));
        assert!(xfs.contains("xfs_repair -n /dev/nbd1"));
        let ext4 = guest_script(&opts(Fs::Ext4), false);
        assert!(ext4.contains("mkfs.ext4 -q -F /dev/nbd0"));
        assert!(ext4.contains("e2fsck -fn /dev/nbd1"));
        assert!(ext4.contains("if [ 0 = 1 ]"));
        assert!(!ext4.contains('\u{1}') && !ext4.contains("FS"));
    }
}
