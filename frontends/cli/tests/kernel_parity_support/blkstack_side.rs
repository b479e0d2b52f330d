//! The blkstack half of the kernel parity suite: every corpus case run
//! through blkstack's own device registry (the code behind `blkstack
//! serve`'s control socket), over `file` legs that start with the same
//! contents as the kernel VM's virtio disks, written down in the same
//! transcript form as the kernel's (see `kernel_side`), following
//! dmsetup's create / table / status / message as dm-ioctl.c answers them.

use super::{
    make_images, md5_hex, normalise, pattern_skip, subst, BadCase, GoodCase, Step, Transcript,
    HELD_SNAP_SECS, LEGS,
};
use blkstack_core::sync::{submit_and_wait, Completion};
use blkstack_core::{Bio, IoBuf, Op, Status};
use blkstack_mapped::Registry;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

struct Side {
    reg: Arc<Registry>,
    dir: PathBuf,
    pattern: Vec<u8>,
    /// Write steps so far, across the corpus (picks the pattern slice).
    writes: u64,
}

/// What blkstack calls a placeholder's device.
fn dev_name(p: &str) -> String {
    match p.strip_prefix("d:") {
        Some(aux) => format!("a_{aux}"),
        None => p.to_string(),
    }
}

impl Side {
    fn devnums(&self) -> BTreeMap<String, String> {
        self.reg
            .names()
            .into_iter()
            .filter_map(|n| {
                let minor = self.reg.info(&n).ok()?.minor;
                Some((format!("253:{minor}"), n))
            })
            .collect()
    }

    fn text(&self, t: &[String]) -> String {
        t.iter()
            .map(|l| subst(l, &dev_name))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// `table:` and/or `status:` lines of device `name`, as the guest's
    /// `snap` (both) and `stat` (status only) print them.
    fn show(&self, out: &mut Vec<String>, name: &str, table: bool) {
        let nums = self.devnums();
        let mut texts = Vec::new();
        if table {
            texts.push(("table", self.reg.table_text(name)));
        }
        texts.push(("status", self.reg.status_text(name)));
        for (what, text) in texts {
            for l in text.unwrap_or_default().lines() {
                out.push(format!("{what}: {}", normalise(l, &nums)));
            }
        }
    }

    fn bad(&self, c: &BadCase) -> Vec<String> {
        let mut out = Vec::new();
        match self.reg.create("b", &self.text(&c.lines)) {
            Ok(_) => {
                out.push("result: accepted".to_string());
                let nums = self.devnums();
                for l in self.reg.table_text("b").unwrap_or_default().lines() {
                    out.push(format!("table: {}", normalise(l, &nums)));
                }
                self.reg.remove("b", true).expect("remove b");
            }
            Err(e) => {
                // What dmsetup prints after "failed: ": the errno text of
                // the control socket's answer.
                let rpc = blkstack_control::proto::RpcError::from(e);
                let text = rpc.strerror().unwrap_or("(no errno)");
                out.push(format!("result: refused: {text}"));
            }
        }
        out
    }

    /// `legs:` and the md5 of each named leg's whole contents.
    fn legs(&self, names: &[&str]) -> String {
        let mut s = String::from("legs:");
        for name in names {
            let data = std::fs::read(self.dir.join(format!("{name}.img"))).expect("leg");
            s.push_str(&format!(" {name}={}", md5_hex(&data)));
        }
        s
    }

    /// The buffer of an I/O: the next pattern slice for a write.
    fn buf_for(&mut self, op: Op, count: u64) -> Vec<u8> {
        let len = (count * 512) as usize;
        if op != Op::Write {
            return vec![0u8; len];
        }
        let skip = pattern_skip(self.writes, count) as usize * 512;
        self.writes += 1;
        self.pattern[skip..skip + len].to_vec()
    }

    fn io(&mut self, op: Op, sector: u64, count: u64) -> (Status, Vec<u8>) {
        let dev = self.reg.device("t").expect("device t");
        let mut buf = self.buf_for(op, count);
        let st = submit_and_wait(&*dev, op, sector * 512, count * 512, &mut buf);
        (st, buf)
    }

    /// An I/O left in flight while `table` and `status` are taken.
    fn held(
        &mut self,
        op: Op,
        sector: u64,
        count: u64,
        out: &mut Vec<String>,
    ) -> (Status, Vec<u8>) {
        let dev = self.reg.device("t").expect("device t");
        let mut buf = self.buf_for(op, count);
        let done = Completion::new();
        // SAFETY: `buf` is neither touched nor dropped before the bio has
        // completed: `done.wait()` below comes first.
        let io = unsafe { IoBuf::from_slice(&mut buf) };
        dev.submit(Bio::new(op, sector * 512, count * 512, io, done.clone(), 0));
        std::thread::sleep(Duration::from_secs(HELD_SNAP_SECS));
        self.show(out, "t", false);
        let st = done.wait();
        (st, buf)
    }

    fn step(&mut self, s: &Step, legs: &[&str], out: &mut Vec<String>) {
        let label = s.label();
        match s {
            Step::Msg { sector, words } => {
                let words: Vec<String> = words.iter().map(|w| subst(w, &dev_name)).collect();
                let words: Vec<&str> = words.iter().map(String::as_str).collect();
                let ok = self.reg.message("t", *sector, &words).is_ok();
                out.push(format!("step {label}: {}", if ok { "ok" } else { "error" }));
            }
            Step::Write { sector, count } => {
                let (st, _) = self.io(Op::Write, *sector, *count);
                let r = if st == Status::Ok { "ok" } else { "error" };
                out.push(format!("step {label}: {r}"));
                out.push(self.legs(legs));
            }
            Step::Held {
                write,
                sector,
                count,
            } => {
                let op = if *write { Op::Write } else { Op::Read };
                let (st, data) = self.held(op, *sector, *count, out);
                out.push(match (st, write) {
                    (Status::Ok, true) => format!("step {label}: ok"),
                    (Status::Ok, false) => format!("step {label}: ok {}", md5_hex(&data)),
                    _ => format!("step {label}: error"),
                });
                if *write {
                    out.push(self.legs(legs));
                }
            }
            Step::Reload { lines } => {
                let text = self.text(lines);
                let ok = self.reg.reload("t", &text).is_ok() && self.reg.resume("t").is_ok();
                out.push(format!("step {label}: {}", if ok { "ok" } else { "error" }));
            }
            Step::Read { sector, count } => {
                let (st, data) = self.io(Op::Read, *sector, *count);
                out.push(match st {
                    Status::Ok => format!("step {label}: ok {}", md5_hex(&data)),
                    _ => format!("step {label}: error"),
                });
            }
        }
        self.show(out, "t", s.changes_table());
    }

    fn good(&mut self, c: &GoodCase) -> Vec<String> {
        let mut out = Vec::new();
        for (name, table) in &c.devs {
            self.reg
                .create(&format!("a_{name}"), &subst(table, &dev_name))
                .unwrap_or_else(|e| panic!("{}: helper {name}: {}", c.id, e.report()));
        }
        match self.reg.create("t", &self.text(&c.lines)) {
            Ok(_) => {
                out.push("create: ok".to_string());
                self.show(&mut out, "t", true);
                let legs = c.legs_used();
                for s in &c.steps {
                    self.step(s, &legs, &mut out);
                }
                self.reg.remove("t", true).expect("remove t");
            }
            Err(_) => out.push("create: refused".to_string()),
        }
        for (name, _) in c.devs.iter().rev() {
            self.reg
                .remove(&format!("a_{name}"), true)
                .expect("remove helper");
        }
        out
    }
}

/// Runs the whole corpus through blkstack over fresh legs in `dir`, which
/// start as the kernel's do: with the cross cases' first halves written.
pub fn run(
    dir: &Path,
    bad: &[BadCase],
    good: &[GoodCase],
    cross_cases: &[super::CrossCase],
) -> Transcript {
    make_images(dir);
    cross(dir, cross_cases, 0);
    let reg = legs_over(dir);
    let pattern = std::fs::read(dir.join("pattern")).expect("pattern");
    let mut side = Side {
        reg,
        dir: dir.to_path_buf(),
        pattern,
        writes: 0,
    };
    let mut t = Transcript::new();
    for c in bad {
        t.insert(c.id.clone(), side.bad(c));
    }
    for c in good {
        let lines = side.good(c);
        t.insert(c.id.clone(), lines);
    }
    t
}

/// A registry with the legs over the images in `dir`, as they are.
fn legs_over(dir: &Path) -> Arc<Registry> {
    let reg = Registry::new();
    for (name, sectors) in LEGS {
        let path = dir.join(format!("{name}.img"));
        reg.create(name, &format!("0 {sectors} file {}", path.display()))
            .unwrap_or_else(|e| panic!("leg {name}: {}", e.report()));
    }
    reg
}

/// Half `h` of every cross case through blkstack over the legs in `dir`:
/// written from the pattern (`h` = 0), or read, giving each read's md5.
pub fn cross(dir: &Path, cases: &[super::CrossCase], h: u64) -> Vec<String> {
    let reg = legs_over(dir);
    let pattern = std::fs::read(dir.join("pattern")).expect("pattern");
    let mut out = Vec::new();
    for (k, c) in cases.iter().enumerate() {
        reg.create("x", &subst(&c.line, &dev_name))
            .unwrap_or_else(|e| panic!("{}: {}", c.id, e.report()));
        let dev = reg.device("x").expect("x");
        let (sector, count) = c.half(h);
        let mut buf = vec![0u8; (count * 512) as usize];
        let op = if h == 0 {
            let skip = c.pattern_skip(k as u64, h) as usize * 512;
            let len = buf.len();
            buf.copy_from_slice(&pattern[skip..skip + len]);
            Op::Write
        } else {
            Op::Read
        };
        let st = submit_and_wait(&*dev, op, sector * 512, count * 512, &mut buf);
        out.push(match st {
            Status::Ok => format!("blkstack-read: ok {}", md5_hex(&buf)),
            _ => "blkstack-read: error".to_string(),
        });
        reg.remove("x", true).expect("remove x");
    }
    reg.remove_all();
    out
}
