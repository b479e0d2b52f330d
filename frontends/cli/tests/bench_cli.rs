//! `blkstack bench` end to end: the real binary over the examples/ stack
//! and job files. Verify is clean on good stacks (striped and linear over
//! memory) and fails the run, with a non-zero exit, on a dm-flakey stack
//! that corrupts or drops writes; bad job files are refused naming the
//! line and key.

use std::path::PathBuf;
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn example(name: &str) -> String {
    root().join("examples").join(name).display().to_string()
}

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_blkstack"))
        .arg("bench")
        .args(args)
        .output()
        .expect("run blkstack")
}

fn json_of(out: &Output) -> serde_json::Value {
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}):\n{text}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn randrw_verify_on(stack: &str, device: &str) {
    let stack = example(stack);
    let filename = format!("--filename={device}");
    let out = bench(&[
        "--stack",
        &stack,
        "--name=x",
        &filename,
        "--rw=randrw",
        "--verify=crc32c",
        "--bs=4k",
        "--iodepth=16",
        "--runtime=1s",
        "--time_based",
        "--output-format=json",
    ]);
    assert!(
        out.status.success(),
        "{device}: exit {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json_of(&out);
    let job = &v["jobs"][0];
    assert_eq!(job["verify_errors"], 0, "{device}");
    assert!(job["verify_checked"].as_u64().unwrap() > 0, "{device}");
    assert!(job["read"]["iops"].as_f64().unwrap() > 0.0, "{device}");
    assert!(job["write"]["iops"].as_f64().unwrap() > 0.0, "{device}");
    assert!(job["read"]["clat_ns"]["percentile"]["99.000000"].is_u64());
    assert_eq!(job["error"], 0);
}

#[test]
fn randrw_verify_on_striped_memory_is_clean() {
    randrw_verify_on("striped-memory.stack", "striped0");
}

#[test]
fn randrw_verify_on_linear_memory_is_clean() {
    randrw_verify_on("linear-memory.stack", "/dev/mapper/linear0");
}

#[test]
fn example_job_files_run() {
    let out = bench(&[
        "--stack",
        &example("striped-memory.stack"),
        &example("randrw-verify.fio"),
        "--eta=never",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "randrw-verify: (g=0): rw=randrw",
        "randrw-verify: (groupid=0, jobs=1): err= 0",
        "  read: IOPS=",
        "  write: IOPS=",
        "clat percentiles",
        "  verify       : checked=",
        ", errors=0",
        "Run status group 0 (all jobs):",
    ] {
        assert!(text.contains(needle), "missing {needle:?}:\n{text}");
    }

    let out = bench(&[
        "--stack",
        &example("linear-memory.stack"),
        &example("seq-write-verify.fio"),
        "--output-format=json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json_of(&out);
    let jobs = v["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 2);
    assert_eq!(jobs[0]["write"]["io_bytes"], 16 << 20);
    assert_eq!(jobs[0]["verify_checked"], 256);
    assert_eq!(jobs[0]["verify_errors"], 0);
    assert_eq!(jobs[1]["groupid"], 1);
    assert_eq!(jobs[1]["read"]["io_bytes"], 16 << 20);
}

#[test]
fn corrupting_and_dropping_devices_fail_the_run() {
    for (what, table) in [
        (
            "corrupt",
            "0 16384 flakey mem0 0 0 1 5 corrupt_bio_byte 100 w 0 0",
        ),
        ("drop", "0 16384 flakey mem0 0 0 1 1 drop_writes"),
    ] {
        let concise = format!("mem0,,,rw,0 16384 memory;bad0,,,rw,{table}");
        let out = bench(&[
            "--concise",
            &concise,
            "--name=v",
            "--filename=bad0",
            "--rw=randrw",
            "--verify=crc32c",
            "--iodepth=8",
            "--size=4m",
            "--output-format=json",
        ]);
        assert!(
            !out.status.success(),
            "{what}: a bad device must fail the run"
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("verify error"), "{what}: {stderr}");
        assert!(
            stderr.contains("verify: "),
            "{what}: failures are described: {stderr}"
        );
        let v = json_of(&out);
        assert!(
            v["jobs"][0]["verify_errors"].as_u64().unwrap() > 0,
            "{what}"
        );
        assert_eq!(v["jobs"][0]["error"], libc_eilseq());
    }
}

fn libc_eilseq() -> i64 {
    84
}

#[test]
fn bad_input_is_refused() {
    let dir = std::env::temp_dir().join(format!("blkstack-bench-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let job = dir.join("bad.fio");
    std::fs::write(&job, "[a]\nrw=randread\niodepth=many\n").unwrap();
    let out = bench(&["--stack", &example("null.stack"), job.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.fio") && stderr.contains("line 3") && stderr.contains("iodepth"),
        "{stderr}"
    );

    let out = bench(&[
        "--stack",
        &example("null.stack"),
        "--name=a",
        "--rw=sideways",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--rw"));

    let out = bench(&[
        "--stack",
        &example("null.stack"),
        "--name=a",
        "--filename=nosuch",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nosuch"));

    let out = bench(&["--name=a"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--stack"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn wait_modes_from_the_command_line() {
    for wait in ["interrupt", "poll", "hybrid"] {
        let w = format!("--wait={wait}");
        let out = bench(&[
            "--stack",
            &example("striped-memory.stack"),
            "--name=w",
            "--rw=randread",
            "--iodepth=4",
            "--size=4m",
            &w,
            "--output-format=json",
        ]);
        assert!(
            out.status.success(),
            "{wait}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v = json_of(&out);
        assert_eq!(v["jobs"][0]["wait"], wait);
        assert_eq!(v["jobs"][0]["read"]["total_ios"], 1024);
    }
}

#[test]
fn ctrl_c_stops_the_jobs_and_still_reports() {
    let child = Command::new(env!("CARGO_BIN_EXE_blkstack"))
        .args([
            "bench",
            "--stack",
            &example("striped-memory.stack"),
            "--name=long",
            "--rw=randread",
            "--runtime=60s",
            "--time_based",
            "--output-format=json",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start blkstack");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(kill.success());
    let out = child.wait_with_output().expect("wait for blkstack");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json_of(&out);
    let runtime = v["jobs"][0]["read"]["runtime"].as_u64().unwrap();
    assert!(runtime < 30_000, "stopped early, ran {runtime} ms");
    assert!(v["jobs"][0]["read"]["total_ios"].as_u64().unwrap() > 0);
}

/// fio's `filename=/dev/NAME` names the stack's device NAME; engine tuning
/// is accepted and named in the header line; `hipri` is polled
/// completion; a misspelt option is an error naming it.
#[test]
fn dev_names_engine_options_and_misspellings() {
    let out = bench(&[
        "--concise",
        "m0,,,rw,0 65536 memory;m1,,,rw,0 65536 memory",
        "--eta=never",
        "--name=x",
        "--filename=/dev/m0",
        "--rw=randwrite",
        "--ioengine=io_uring",
        "--sqthread_poll",
        "--fixedbufs",
        "--hipri",
        "--number_ios=100",
        "--output-format=normal,json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let header = text.lines().next().unwrap_or("");
    assert!(
        header.contains("ioengine=blkstack(io_uring)")
            && header.contains("not applicable: sqthread_poll fixedbufs")
            && header.contains("wait=poll"),
        "{header}"
    );
    let json = &text[text.find("{\n").expect("json after the normal report")..];
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(v["jobs"][0]["device"], "m0");
    assert_eq!(v["jobs"][0]["write"]["total_ios"], 100, "number_ios=100");
    let bad = bench(&[
        "--concise",
        "m0,,,rw,0 2048 memory",
        "--name=x",
        "--bsize=4k",
    ]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("--bsize: unknown option"), "{err}");
}

/// `--status-interval` prints fio-shaped progress blocks while jobs run.
#[test]
fn status_interval_reports_while_running() {
    let out = bench(&[
        "--concise",
        "m0,,,rw,0 65536 memory",
        "--eta=never",
        "--name=s",
        "--rw=randread",
        "--runtime=1",
        "--time_based",
        "--status-interval=250ms",
        "--output-format=json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let blocks = text.matches("s: (groupid=0, jobs=1): err= 0").count();
    assert!(
        (2..=5).contains(&blocks),
        "{blocks} status blocks in a second:\n{text}"
    );
    assert!(text.contains("  read: IOPS="));
}
