//! `blkstack bench --verify=crc32c` end to end over the `file` target:
//! the real binary writes and verifies a real file through io_uring,
//! buffered and with O_DIRECT (and with polling asked for, which this
//! machine's disk refuses, so the fallback is on the data path too). A
//! wrong byte in the file would fail verify and the run.

use std::path::PathBuf;
use std::process::{Command, Output};

/// A fresh directory under the target dir (a real disk, not tmpfs, so
/// O_DIRECT behaves as on a user's machine).
fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("file-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_blkstack"))
        .arg("bench")
        .args(args)
        .output()
        .expect("run blkstack")
}

fn verify_run(name: &str, flags: &str, rw: &str) {
    let dir = scratch(name);
    let img = dir.join("disk.img");
    let stack = dir.join("file.stack");
    // 64 MiB, created sparse by the target itself.
    std::fs::write(
        &stack,
        format!("file0: 0 131072 file {} {flags} create\n", img.display()),
    )
    .unwrap();
    let out = bench(&[
        "--stack",
        &stack.display().to_string(),
        "--name=v",
        "--filename=file0",
        &format!("--rw={rw}"),
        "--verify=crc32c",
        "--bs=16k",
        "--iodepth=16",
        "--size=16m",
        "--output-format=json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{name}: exit {:?}\nstdout:\n{}\nstderr:\n{stderr}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{name}: not JSON ({e}); stderr:\n{stderr}"));
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0, "{name}");
    assert_eq!(job["verify_errors"], 0, "{name}");
    assert!(
        job["verify_checked"].as_u64().unwrap_or(0) >= 1024,
        "{name}: verify checked too little: {}",
        job["verify_checked"]
    );
    assert!(
        job["write"]["io_bytes"].as_u64().unwrap_or(0) >= 16 << 20,
        "{name}"
    );
    // The data is really in the file: 16 MiB written from offset 0, so
    // the file holds non-zero bytes there.
    let data = std::fs::read(&img).unwrap();
    assert_eq!(data.len(), 64 << 20, "{name}: file size");
    assert!(
        data[..16 << 20].iter().any(|&b| b != 0),
        "{name}: file untouched"
    );
    if flags.contains("iopoll") {
        assert!(
            stderr.contains("falling back") || !stderr.contains("refused"),
            "{name}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_verify_over_buffered_file() {
    verify_run("buffered", "", "write");
}

#[test]
fn bench_verify_over_direct_file() {
    verify_run("direct", "direct", "randwrite");
}

#[test]
fn bench_verify_over_direct_file_with_polling_asked() {
    verify_run("hybrid", "direct hybrid_iopoll", "randwrite");
}

#[test]
fn bench_verify_over_psync_engine() {
    verify_run("psync", "direct engine=psync", "randwrite");
}

#[test]
fn missing_file_is_refused_clearly() {
    let dir = scratch("missing");
    let out = bench(&[
        "--concise",
        &format!("f0,,,rw,0 2048 file {}", dir.join("nope.img").display()),
        "--name=x",
        "--filename=f0",
        "--rw=read",
        "--size=1m",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("does not exist") && stderr.contains("create"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
