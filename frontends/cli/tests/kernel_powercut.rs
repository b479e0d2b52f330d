//! The `powercut` target judged by real programs in the kernel VM
//! (Debian's Linux 6.12): blkstack serves powercut devices over memory on
//! ublk inside the guest, so the guest script itself cuts the power
//! (`blkstack message NAME 0 cut drop | reorder SEED | torn SEED`) while
//! the kernel's ext4 (data=ordered) and xfs, and Debian's sqlite3, work
//! on them; then it unmounts the dead filesystem, powers on, lets the
//! kernel replay the journal, and checks what a crash must keep.
//!
//! - Files: `pcwork` (tests/data/powercut/pcwork.c) writes and fsyncs
//!   files, logging each fsynced one to the guest's tmpfs, until the cut;
//!   after it, every logged file of every round so far is intact and
//!   `e2fsck -fn` / `xfs_repair -n` are clean.
//! - The planted bug: a file replaced by rename without fsync, and a new
//!   file made so, lose their new content to a `drop` cut, while the file
//!   updated the correct way (fsync, rename, fsync of the directory)
//!   keeps it: the target finds the bug it exists to find.
//! - SQLite (WAL journal): with `synchronous=FULL` every COMMIT that
//!   returned survives every cut mode and `PRAGMA integrity_check` says
//!   ok; with `synchronous=OFF` a `drop` cut loses committed rows.
//!
//! `make test` runs one cut per mode per filesystem and per SQLite
//! setting in one guest boot; `make crashtest` runs `POWERCUT_CUTS` (20
//! by default) of each (`--ignored`).

mod kernel_vm_support;

use kernel_vm_support::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// The guest's shell functions: `files_round`, `bug_round`, `sql_round`.
const LIB: &str = include_str!("data/powercut/guest-lib.sh");

/// One guest at a time: TCG guests share the machine's CPUs.
static ONE_VM: Mutex<()> = Mutex::new(());

/// What one guest boot does.
struct Plan {
    /// Filesystems to cut, each `cuts` times per mode.
    fs: &'static [&'static str],
    cuts: usize,
    /// The planted bug, on ext4.
    bug: bool,
    /// SQLite rounds: `sql_full` per mode with synchronous=FULL,
    /// `sql_off` drop cuts with synchronous=OFF.
    sql_full: usize,
    sql_off: usize,
    /// Each step's guest time and the cache's status before each cut
    /// (`POWERCUT_TRACE` turns it on for any run).
    trace: bool,
}

/// The three cut modes for round `r`, each with its own seed so a failing
/// round can be rerun alone.
fn mode(r: usize) -> String {
    match r % 3 {
        0 => "drop".into(),
        1 => format!("reorder {}", 1000 + r),
        _ => format!("torn {}", 2000 + r),
    }
}

fn guest_script(p: &Plan) -> String {
    let mut s = String::from(LIB);
    if p.trace || std::env::var_os("POWERCUT_TRACE").is_some() {
        s.push_str("TRACE=1\n");
    }
    s.push_str(
        r#"
# ext4 and xfs on 128 MiB each (mkfs.xfs told it runs under fstests,
# which lifts its 300 MB and 64 MB-log floors).
S4=262144; SX=262144
cat > /tmp/stack.txt <<EOT
m4: 0 $S4 memory
p4: 0 $S4 powercut m4
mx: 0 $SX memory
px: 0 $SX powercut mx
EOT
start_serve /tmp/s.out --stack /tmp/stack.txt --ublk p4,px --control $C
D4=$(dev_of p4 /tmp/s.out); DX=$(dev_of px /tmp/s.out)
[ -b "$D4" ] && [ -b "$DX" ] || { cat /tmp/s.out; fail "no ublk devices"; }
q=/sys/block/${D4#/dev/}/queue
echo "CACHE $(cat $q/write_cache) fua=$(cat $q/fua)"
"#,
    );
    // SQLite runs on the ext4 of the files rounds, or on its own.
    let fs: Vec<&str> = if p.fs.is_empty() {
        vec!["ext4"]
    } else {
        p.fs.to_vec()
    };
    for fs in fs {
        let (n, d, mkfs) = match fs {
            "ext4" => ("p4", "$D4", "mkfs.ext4 -q -F"),
            _ => (
                "px",
                "$DX",
                "TEST_DIR=/tmp TEST_DEV=$DX QA_CHECK_FS=1 mkfs.xfs -q -f -K",
            ),
        };
        s.push_str(&format!("{mkfs} {d} || fail 'mkfs {fs}'\nmnt {fs} {d}\n"));
        for r in 0..p.cuts * 3 {
            s.push_str(&format!("files_round {fs} {n} {d} {} {}\n", r + 1, mode(r)));
        }
        if fs == "ext4" {
            if p.bug {
                s.push_str(&format!("bug_round {fs} {n} {d}\n"));
            }
            s.push_str(&format!("SQL_NAME={n} SQL_DEV={d}\n"));
            let mut r = 0;
            for i in 0..p.sql_full * 3 {
                r += 1;
                s.push_str(&format!("sql_round FULL {r} {}\n", mode(i)));
            }
            for _ in 0..p.sql_off {
                r += 1;
                s.push_str(&format!("sql_round OFF {r} drop\n"));
            }
        }
        s.push_str("umount /mnt || fail umount\n");
    }
    s.push_str(
        "echo \"STATUS p4 $(pc_status p4)\"\necho \"STATUS px $(pc_status px)\"\n\
         kill -TERM $spid; wait $spid\necho DONE\n",
    );
    s
}

/// pcwork built from its source with the system C compiler, once per
/// test binary; `None` (a skip, a failure under CI) without a compiler.
fn pcwork() -> Option<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = BIN.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/powercut/pcwork.c");
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/powercut");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let bin = dir.join(format!("pcwork.{}", std::process::id()));
        let out = Command::new("cc")
            .args(["-O2", "-Wall", "-o"])
            .arg(&bin)
            .arg(&src)
            .output()
            .map_err(|e| format!("no C compiler (cc: {e}); make deps installs one"))?;
        if !out.status.success() {
            return Err(format!(
                "cc could not build pcwork: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        // Renamed into place (the guest's name for it is the file's), so
        // no test run copies a half-written one.
        let named = dir.join("pcwork");
        std::fs::rename(&bin, &named).map_err(|e| format!("{}: {e}", named.display()))?;
        Ok(named)
    });
    match built {
        Ok(p) => Some(p.clone()),
        Err(why) => {
            blkstack_test_support::skip(&format!("no pcwork: {why}"));
            None
        }
    }
}

/// Debian's sqlite3, which `make deps` installs for the guest.
fn sqlite3() -> Option<PathBuf> {
    let p = Path::new("/usr/bin/sqlite3");
    if p.exists() {
        Some(p.to_path_buf())
    } else {
        blkstack_test_support::skip(
            "no /usr/bin/sqlite3 for the guest (make deps installs sqlite3)",
        );
        None
    }
}

/// Boots one guest for the plan; `None` when something outside the
/// project is missing.
fn run(p: &Plan, timeout: u64) -> Option<VmRun> {
    if !vm_available() {
        return None;
    }
    let pcwork = pcwork()?;
    let sqlite = sqlite3()?;
    let _one = ONE_VM.lock().unwrap_or_else(|e| e.into_inner());
    let r = Vm::new()
        .blkstack()
        .bin(&pcwork)
        .bin(&sqlite)
        .timeout(timeout)
        .run(&guest_script(p));
    println!("{}\n({} s)", r.out, r.elapsed.as_secs());
    r.assert_ok("powercut in the guest");
    assert!(
        r.out.contains("\nDONE"),
        "the script did not finish:\n{}",
        r.out
    );
    Some(r)
}

/// `key=value` of a result line (values end at the next space).
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let k = format!(" {key}=");
    line.find(&k)
        .map(|i| &line[i + k.len()..])
        .map(|v| v.split(' ').next().unwrap_or(""))
        .unwrap_or("")
}

fn num(line: &str, key: &str) -> u64 {
    field(line, key)
        .parse()
        .unwrap_or_else(|_| panic!("no number {key}= in {line:?}"))
}

/// Every files round of `fs`: each cut in its mode, every file fsynced
/// so far intact, fsck clean.
fn check_files(out: &str, fs: &str, cuts_per_mode: usize) {
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with(&format!("CUT fs={fs} ")))
        .collect();
    assert_eq!(lines.len(), cuts_per_mode * 3, "{fs}: rounds run:\n{out}");
    for (r, l) in lines.iter().enumerate() {
        let durable = num(l, "durable");
        // `checked N, bad N` as pcwork prints it.
        let checked: u64 = l
            .split("checked ")
            .nth(1)
            .and_then(|v| v.split(',').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no count of checked files in {l:?}"));
        assert!(
            l.contains(", bad 0"),
            "{fs}: a fsynced file was lost or changed: {l}"
        );
        assert_eq!(checked, durable, "{fs}: {l}");
        assert!(
            durable >= 4 * (r as u64 + 1),
            "{fs}: too few fsynced files: {l}"
        );
        assert_eq!(field(l, "fsck"), "clean", "{fs}: {l}");
        let want = mode(r).replace(' ', "_");
        assert_eq!(field(l, "mode"), want, "{fs}: {l}");
    }
}

/// The SQLite rounds: FULL loses no commit and stays intact; OFF loses
/// at least one commit in some cut.
fn check_sqlite(out: &str, full: usize, off: usize) {
    let mut lost_off = Vec::new();
    let mut n = (0, 0);
    for l in out.lines().filter(|l| l.starts_with("SQL ")) {
        let committed = num(l, "committed");
        assert!(committed >= 6, "too few commits before the cut: {l}");
        // A database the cut left unreadable keeps nothing.
        let present = field(l, "present").parse::<u64>().unwrap_or(0);
        assert_eq!(field(l, "fsck"), "clean", "{l}");
        if field(l, "sync") == "FULL" {
            n.0 += 1;
            assert_eq!(present, committed, "synchronous=FULL lost a commit: {l}");
            assert_eq!(field(l, "integrity"), "ok", "{l}");
        } else {
            n.1 += 1;
            lost_off.push(committed.saturating_sub(present));
        }
    }
    assert_eq!(n, (full * 3, off), "SQLite rounds run:\n{out}");
    if off > 0 {
        assert!(
            lost_off.iter().any(|&l| l > 0),
            "synchronous=OFF lost no commit in {off} drop cuts ({lost_off:?}):\n{out}"
        );
    }
}

/// The planted bug: found.
fn check_bug(out: &str) {
    let after = out
        .lines()
        .find(|l| l.starts_with("BUG after the cut:"))
        .unwrap_or_else(|| panic!("no planted-bug round:\n{out}"));
    assert!(
        out.contains("BUG before the cut: good=new bad=new new=new"),
        "the updates were not made before the cut:\n{out}"
    );
    assert!(
        after.contains(" good=new"),
        "the fsynced update was lost: {after}"
    );
    assert!(
        !after.contains(" bad=new"),
        "the unsynced replace survived a drop cut: {after}"
    );
    assert!(
        !after.contains(" new=new"),
        "the unsynced new file survived a drop cut: {after}"
    );
}

/// The kernel sees a volatile cache with FUA, so it sends the flushes the
/// filesystems' and SQLite's durability rests on.
fn check_cache(out: &str) {
    assert!(
        out.contains("CACHE write back fua=1"),
        "the kernel's view of the cache:\n{out}"
    );
}

#[test]
fn fsynced_files_and_sqlite_commits_survive_each_cut_mode() {
    let plan = Plan {
        fs: &["ext4", "xfs"],
        cuts: 1,
        bug: true,
        sql_full: 1,
        sql_off: 1,
        trace: false,
    };
    let Some(r) = run(&plan, 400) else { return };
    check_cache(&r.out);
    check_files(&r.out, "ext4", 1);
    check_files(&r.out, "xfs", 1);
    check_bug(&r.out);
    check_sqlite(&r.out, 1, 1);
}

/// `POWERCUT_CUTS` (default 20): the issue's count of cuts per mode.
fn long_count() -> usize {
    std::env::var("POWERCUT_CUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
}

/// A guest's time limit for `rounds` cuts: generous, as TCG is slow.
fn long_timeout(rounds: usize) -> u64 {
    120 + 60 * rounds as u64
}

/// `make crashtest`: ext4 cut `POWERCUT_CUTS` times per mode.
#[test]
#[ignore]
fn ext4_many_cuts() {
    let n = long_count();
    let plan = Plan {
        fs: &["ext4"],
        cuts: n,
        bug: true,
        sql_full: 0,
        sql_off: 0,
        trace: true,
    };
    let Some(r) = run(&plan, long_timeout(3 * n)) else {
        return;
    };
    check_files(&r.out, "ext4", n);
    check_bug(&r.out);
}

/// `make crashtest`: xfs cut `POWERCUT_CUTS` times per mode.
#[test]
#[ignore]
fn xfs_many_cuts() {
    let n = long_count();
    let plan = Plan {
        fs: &["xfs"],
        cuts: n,
        bug: false,
        sql_full: 0,
        sql_off: 0,
        trace: true,
    };
    let Some(r) = run(&plan, long_timeout(3 * n)) else {
        return;
    };
    check_files(&r.out, "xfs", n);
}

/// `make crashtest`: SQLite, FULL cut `POWERCUT_CUTS` times per mode and
/// OFF `POWERCUT_CUTS` times with `drop`.
#[test]
#[ignore]
fn sqlite_many_cuts() {
    let n = long_count();
    let plan = Plan {
        fs: &[],
        cuts: 0,
        bug: false,
        sql_full: n,
        sql_off: n,
        trace: true,
    };
    let Some(r) = run(&plan, long_timeout(4 * n)) else {
        return;
    };
    check_sqlite(&r.out, n, n);
}
