//! Our dm-log-writes logs and `blkstack replay-log` judged by xfstests'
//! own `replay-log` (built from its sources with cc): one log from our
//! `log-writes` target holding writes of several sizes, FUA writes,
//! flushes, a discard and marks is counted, searched and replayed by
//! both tools with the same options; they must print the same and leave
//! byte-identical images. And `replay-log --replay NAME` reaches a device
//! of a stack file and of a running serve.

mod xfstests_support;

use blkstack_core::sync::{submit_and_wait, submit_and_wait_flags};
use blkstack_core::{BioFlags, Op, Status};
use blkstack_mapped::Registry;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use xfstests_support::xfstests_replay_log;

const BIN: &str = env!("CARGO_BIN_EXE_blkstack");
const SECTORS: u64 = 8192;

fn make_log(dir: &Path) -> PathBuf {
    let log = dir.join("log.img");
    let reg = Registry::new();
    reg.create("data", &format!("0 {SECTORS} memory")).unwrap();
    reg.create("log", &format!("0 {SECTORS} file {} create", log.display()))
        .unwrap();
    reg.create("lw", &format!("0 {SECTORS} log-writes data log"))
        .unwrap();
    let lw = reg.device("lw").unwrap();
    let put = |off: u64, len: usize, byte: u8, flags: BioFlags| {
        let mut b: Vec<u8> = (0..len).map(|i| byte ^ (i % 251) as u8).collect();
        let st = submit_and_wait_flags(&*lw, Op::Write, flags, off, len as u64, &mut b);
        assert_eq!(st, Status::Ok);
    };
    let flush = || assert_eq!(submit_and_wait(&*lw, Op::Flush, 0, 0, &mut []), Status::Ok);
    put(0, 4096, 1, BioFlags::NONE);
    put(65536, 65536, 2, BioFlags::NONE);
    flush();
    reg.message("lw", 0, &["mark", "m1"]).unwrap();
    put(8192, 512, 3, BioFlags::FUA);
    put(4096, 8192, 4, BioFlags::NONE);
    assert_eq!(
        submit_and_wait(&*lw, Op::Discard, 65536, 16384, &mut []),
        Status::Ok
    );
    flush();
    put(1 << 20, 4096, 5, BioFlags::FUA);
    reg.message("lw", 0, &["mark", "m2"]).unwrap();
    put(0, 4096, 6, BioFlags::NONE);
    flush();
    drop(lw);
    reg.remove("lw", false).unwrap();
    reg.remove_all();
    log
}

fn ours(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("replay-log")
        .args(args)
        .output()
        .expect("run blkstack replay-log")
}

fn theirs(tool: &Path, args: &[&str]) -> Output {
    Command::new(tool)
        .args(args)
        .output()
        .expect("run xfstests' replay-log")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn xfstests_replay_log_reads_our_logs_as_we_do() {
    let Some(tool) = xfstests_replay_log() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let log = make_log(dir.path());
    let l = log.to_str().unwrap();
    let o = theirs(&tool, &["--log", l, "--num-entries"]);
    assert!(o.status.success(), "{o:?}");
    // 2 writes, flush, m1, FUA, write, discard, flush, FUA, m2, write,
    // flush, and the end mark.
    assert_eq!(stdout(&o).trim(), "13");
    for opts in [
        vec!["--num-entries"],
        vec!["--find", "--end-mark", "m2"],
        vec!["--find", "--next-fua"],
        vec!["--find", "--next-flush", "--start-entry", "3"],
        vec!["--find", "--limit", "5"],
        vec!["--find", "--next-fua", "--start-mark", "m1"],
    ] {
        let mut args = vec!["--log", l];
        args.extend(&opts);
        let (a, b) = (theirs(&tool, &args), ours(&args));
        assert_eq!(a.status.success(), b.status.success(), "{opts:?}");
        assert_eq!(stdout(&b), stdout(&a), "{opts:?}: ours (left), xfstests'");
    }
    // Replays to marks, counts, FUA entries: the same bytes on both.
    for opts in [
        vec!["--end-mark", "m1"],
        vec!["--end-mark", "m2"],
        vec!["--limit", "7"],
        vec!["--next-fua", "--start-mark", "m1"],
        vec!["--end-mark", "dm-log-writes-end"],
        vec!["--end-mark", "m2", "--no-discard"],
        // A mark the log does not hold: xfstests' replay-log replays the
        // whole log and exits 0 (its loop ends at the log's end, which is
        // no error); so does ours.
        vec!["--end-mark", "nosuch"],
    ] {
        let (ia, ib) = (dir.path().join("a.img"), dir.path().join("b.img"));
        for i in [&ia, &ib] {
            std::fs::write(i, vec![0xeeu8; SECTORS as usize * 512]).unwrap();
        }
        let mut args = vec!["--log", l, "--replay", ia.to_str().unwrap()];
        args.extend(&opts);
        let a = theirs(&tool, &args);
        assert!(a.status.success(), "{opts:?}: {a:?}");
        args[3] = ib.to_str().unwrap();
        let b = ours(&args);
        assert!(b.status.success(), "{opts:?}: {b:?}");
        assert!(
            std::fs::read(&ia).unwrap() == std::fs::read(&ib).unwrap(),
            "{opts:?}: the images differ"
        );
    }
    // Verbose replay prints the same entries (ours prints replay-log's
    // lines on stdout; its -v is the global one).
    let img = dir.path().join("v.img");
    std::fs::write(&img, vec![0u8; SECTORS as usize * 512]).unwrap();
    let i = img.to_str().unwrap();
    let a = theirs(
        &tool,
        &["-v", "--log", l, "--replay", i, "--end-mark", "m2"],
    );
    let b = Command::new(BIN)
        .args([
            "-v",
            "replay-log",
            "--log",
            l,
            "--replay",
            i,
            "--end-mark",
            "m2",
        ])
        .output()
        .unwrap();
    let lines = |s: String| -> Vec<String> {
        s.lines()
            .filter(|x| x.starts_with("replaying"))
            .map(str::to_string)
            .collect()
    };
    let theirs_v = lines(format!(
        "{}{}",
        stdout(&a),
        String::from_utf8_lossy(&a.stderr)
    ));
    assert!(theirs_v.len() >= 8, "{a:?}");
    assert_eq!(lines(stdout(&b)), theirs_v);
}

#[test]
fn replay_reaches_devices_of_a_stack_file_and_of_a_running_serve() {
    let dir = tempfile::tempdir().unwrap();
    let log = make_log(dir.path());
    let l = log.to_str().unwrap();
    let want = dir.path().join("want.img");
    std::fs::write(&want, vec![0u8; SECTORS as usize * 512]).unwrap();
    let o = ours(&[
        "--log",
        l,
        "--replay",
        want.to_str().unwrap(),
        "--end-mark",
        "m2",
    ]);
    assert!(o.status.success(), "{o:?}");
    let want = std::fs::read(&want).unwrap();

    // A stack file whose device is a file leaf: replay lands in its file.
    let img = dir.path().join("stack.img");
    let stack = dir.path().join("s.stack");
    std::fs::write(
        &stack,
        format!("target: 0 {SECTORS} file {} create\n", img.display()),
    )
    .unwrap();
    let s = stack.to_str().unwrap();
    let o = ours(&[
        "--log",
        l,
        "--replay",
        "target",
        "--stack",
        s,
        "--end-mark",
        "m2",
    ]);
    assert!(o.status.success(), "{o:?}");
    assert!(std::fs::read(&img).unwrap() == want, "stack file replay");
    let o = ours(&["--log", l, "--replay", "nosuch", "--stack", s]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("nosuch"),
        "{o:?}"
    );

    // A device of a running serve, written through its export.
    let srv = blkstack_test_support::Serve::start(&format!("m,,,rw,0 {SECTORS} memory"), "m");
    let ctl = srv.control.to_str().unwrap().to_string();
    let o = ours(&[
        "--log",
        l,
        "--replay",
        "m",
        "--control",
        &ctl,
        "--end-mark",
        "m2",
    ]);
    assert!(o.status.success(), "{o:?}");
    // nbdcopy (make deps installs it) reads the export back.
    let got = Command::new("nbdcopy")
        .arg(srv.uri("m"))
        .arg(dir.path().join("got.img"))
        .output()
        .expect("run nbdcopy");
    assert!(got.status.success(), "{got:?}");
    assert!(std::fs::read(dir.path().join("got.img")).unwrap() == want);
    let o = ours(&["--log", l, "--replay", "absent", "--control", &ctl]);
    assert!(!o.status.success());
    let o = ours(&["--log", l, "--replay", "/no/such/path"]);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--stack FILE or --control SOCK"),
        "{o:?}"
    );
}
