//! fio's own example job files run unmodified through `blkstack bench`:
//! the block-device subset of fio's `examples/` (test data, with fio's
//! licence beside them), each against a stack of sparse memory devices
//! named after the files' `filename`s, for a fifth of a second per job
//! (enough to show each job starts, runs and reports). docs/FIO.md
//! says which run and which are refused (naming the option); this test
//! checks every row of that table against what the binary does, and that
//! at least 90 % run.

use blkstack_test_support::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_blkstack");

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `(file, None)` for "runs", `(file, Some(option))` for "refused".
fn doc_table() -> Vec<(String, Option<String>)> {
    let doc = std::fs::read_to_string(root().join("docs/FIO.md")).expect("docs/FIO.md");
    doc.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| {
            let (file, rest) = l.split_once("` | ")?;
            if !file.ends_with(".fio") {
                return None;
            }
            let refused = rest
                .strip_prefix("refused: `")
                .map(|r| r.split('`').next().unwrap_or("").to_string());
            Some((file.to_string(), refused))
        })
        .collect()
}

/// The devices a job file names: `/dev/NAME` and plain names become
/// devices; an absolute path elsewhere is retargeted with `--filename`.
fn devices_of(text: &str) -> (Vec<String>, bool) {
    let mut names = vec!["dev0".to_string()];
    let mut retarget = false;
    for line in text.lines() {
        let l = line.trim();
        let Some(v) = l.strip_prefix("filename=") else {
            continue;
        };
        let v = v.split([' ', '\t', ';', '#']).next().unwrap_or("");
        match v.strip_prefix("/dev/") {
            Some(n) => names.push(n.to_string()),
            None if v.starts_with('/') => retarget = true,
            None => names.push(v.to_string()),
        }
    }
    names.sort();
    names.dedup();
    (names, retarget)
}

#[test]
fn fio_example_job_files_run_or_are_refused_as_documented() {
    let data = root().join("frontends/bench/tests/data/fio-examples");
    assert!(
        data.join("COPYING").is_file(),
        "fio's licence beside its files"
    );
    let table = doc_table();
    let on_disk = std::fs::read_dir(&data)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "fio")
        })
        .count();
    assert_eq!(table.len(), on_disk, "docs/FIO.md lists every example file");
    let mut ran = 0;
    let mut wrong = Vec::new();
    for (file, refused) in &table {
        let path = data.join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let (names, retarget) = devices_of(&text);
        let dir = Scratch::new("fioex");
        // 8 TiB sparse: room for cross-stripe-verify's 30 x 124 GiB.
        let stack: String = names
            .iter()
            .map(|n| format!("{n}: 0 17179869184 memory\n"))
            .collect();
        std::fs::write(dir.path("s.stack"), stack).unwrap();
        let mut cmd = Command::new(BIN);
        cmd.current_dir(&dir.0)
            .env("FIO_BS", "4k")
            .env("uri", "nbd://localhost")
            .args([
                "bench",
                "--stack",
                "s.stack",
                "--eta=never",
                "--output=out.txt",
            ])
            .arg(&path);
        if file == "surface-scan.fio" {
            // Its read phase verifies what the write phase wrote: both
            // cover 4 MiB instead of a time slice of a whole device.
            cmd.arg("--size=4m");
        } else {
            cmd.args([
                "--runtime=200ms",
                "--time_based",
                "--startdelay=0",
                "--ramp_time=0",
            ]);
        }
        if retarget {
            cmd.arg("--filename=dev0");
        }
        let out = run(&mut cmd, Duration::from_secs(120));
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        match refused {
            None if out.status.success() => ran += 1,
            None => wrong.push(format!("{file}: should run, failed: {err}")),
            Some(opt) => {
                if out.status.success() || !err.contains(&format!("option '{opt}'")) {
                    wrong.push(format!("{file}: should be refused naming '{opt}': {err}"));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(
        ran * 10 >= table.len() * 9,
        "{ran} of {} example files run, fewer than 90 %",
        table.len()
    );
}
