//! fio's own tools read `blkstack bench`'s output unchanged: the json+
//! latency bins through `fio_jsonplus_clat2csv --validate`, the bw/iops/lat
//! log files through `fio2gnuplot`, and the log lines have the shape of
//! the ones fio itself writes for the same options.

use blkstack_test_support::*;
use std::process::Command;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_blkstack");
const T: Duration = Duration::from_secs(120);

/// `(time, value, ddir)` of each line; every line has `fields` fields.
fn log_lines(path: &std::path::Path, fields: usize) -> Vec<(u64, u64, u64)> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(|l| {
            let f: Vec<u64> = l.split(", ").map(|x| x.trim().parse().unwrap()).collect();
            assert_eq!(f.len(), fields, "{}: '{l}'", path.display());
            (f[0], f[1], f[2])
        })
        .collect()
}

#[test]
fn json_plus_and_logs_are_read_by_fios_tools() {
    let dir = Scratch::new("fiotools");
    let out = run_ok(
        Command::new(BIN).current_dir(&dir.0).args([
            "bench",
            "--concise",
            "m0,,,rw,0 262144 memory",
            "--eta=never",
            "--name=t",
            "--rw=randrw",
            "--runtime=1",
            "--time_based",
            "--output-format=json+",
            "--output=out.json",
            "--write_bw_log=t",
            "--write_iops_log=t",
            "--write_lat_log=t",
            "--log_avg_msec=100",
        ]),
        T,
    );
    assert!(out.status.success());
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path("out.json")).unwrap()).unwrap();
    for ddir in ["read", "write"] {
        let d = &json["jobs"][0][ddir];
        let bins: u64 = d["clat_ns"]["bins"]
            .as_object()
            .expect("json+ bins")
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum();
        assert_eq!(
            bins,
            d["total_ios"].as_u64().unwrap(),
            "{ddir} bins hold every I/O"
        );
    }
    run_ok(
        Command::new(tool("fio_jsonplus_clat2csv"))
            .current_dir(&dir.0)
            .args(["out.json", "clat"]),
        T,
    );
    let v = run_ok(
        Command::new(tool("fio_jsonplus_clat2csv"))
            .current_dir(&dir.0)
            .args(["--validate", "out.json", "clat"]),
        T,
    );
    assert!(String::from_utf8_lossy(&v.stdout).contains("validated"));

    // Averaged logs: a line per direction per 100 ms window, 5 fields. As
    // in fio, samples are taken from the I/O loop, so a stall of the job
    // (a loaded machine) merges windows: ask for several windows of both
    // directions, not for all ten.
    let bw = log_lines(&dir.path("t_bw.1.log"), 5);
    for ddir in [0, 1] {
        let n = bw.iter().filter(|&&(_, _, d)| d == ddir).count();
        assert!(n >= 3, "{n} bw samples of direction {ddir} in a 1 s run");
    }
    assert!(bw.iter().all(|&(t, v, d)| t % 100 == 0 && v > 0 && d <= 1));
    assert!(bw.windows(2).all(|w| w[0].0 <= w[1].0), "time goes forward");
    log_lines(&dir.path("t_iops.1.log"), 5);
    log_lines(&dir.path("t_lat.1.log"), 5);
    let g = run_ok(
        Command::new(tool("fio2gnuplot"))
            .current_dir(&dir.0)
            .args(["-p", "t_bw*.log"]),
        T,
    );
    assert!(String::from_utf8_lossy(&g.stdout).contains("t_bw.1.log"));
    let global = std::fs::read_to_string(dir.path("t_bw.global")).expect("fio2gnuplot's summary");
    let count: usize = global
        .lines()
        .find_map(|l| l.strip_prefix("values_count="))
        .expect("values_count")
        .parse()
        .unwrap();
    assert_eq!(count, bw.len(), "fio2gnuplot read every sample");

    // fio itself, same log options: the same line shape.
    run_ok(
        Command::new(tool("fio")).current_dir(&dir.0).args([
            "--name=f",
            "--ioengine=null",
            "--size=64m",
            "--rw=randrw",
            "--runtime=1",
            "--time_based",
            "--write_bw_log=f",
            "--write_lat_log=f",
            "--log_avg_msec=100",
            "--log_offset=1",
        ]),
        T,
    );
    log_lines(&dir.path("f_bw.1.log"), 6);
    let run2 = run_ok(
        Command::new(BIN).current_dir(&dir.0).args([
            "bench",
            "--concise",
            "m1,,,rw,0 262144 memory",
            "--eta=never",
            "--name=u",
            "--rw=randrw",
            "--runtime=1",
            "--time_based",
            "--output=/dev/null",
            "--write_bw_log=u",
            "--log_avg_msec=100",
            "--log_offset=1",
        ]),
        T,
    );
    assert!(run2.status.success());
    log_lines(&dir.path("u_bw.1.log"), 6);
}

/// `--output-format=terse` lines have fio's fields for each terse version
/// (counted against fio's own line for the same job), and `--minimal` is
/// terse as in fio.
#[test]
fn terse_lines_have_fios_fields() {
    for ver in ["3", "4", "5"] {
        let v = format!("--terse-version={ver}");
        let fio = run_ok(
            Command::new(tool("fio")).args([
                "--name=f",
                "--ioengine=null",
                "--size=64m",
                "--rw=randrw",
                "--runtime=200ms",
                "--time_based",
                "--output-format=terse",
                &v,
            ]),
            T,
        );
        let fio_line = String::from_utf8_lossy(&fio.stdout)
            .lines()
            .last()
            .unwrap_or("")
            .to_string();
        let ours = run_ok(
            Command::new(BIN).args([
                "bench",
                "--concise",
                "m0,,,rw,0 131072 memory",
                "--eta=never",
                "--name=t",
                "--rw=randrw",
                "--runtime=200ms",
                "--time_based",
                "--output-format=terse",
                &v,
            ]),
            T,
        );
        let line = String::from_utf8_lossy(&ours.stdout).trim_end().to_string();
        let fields: Vec<&str> = line.split(';').collect();
        assert_eq!(
            fields.len(),
            fio_line.split(';').count(),
            "v{ver}:\nours {line}\nfio  {fio_line}"
        );
        assert_eq!(
            (fields[0], fields[2], fields[3], fields[4]),
            (ver, "t", "0", "0")
        );
        let read_kib: u64 = fields[5].parse().unwrap();
        assert!(read_kib > 0, "read KiB field: {line}");
    }
    let m = run_ok(
        Command::new(BIN).args([
            "bench",
            "--concise",
            "m0,,,rw,0 131072 memory",
            "--eta=never",
            "--minimal",
            "--name=t",
            "--rw=read",
            "--runtime=100ms",
            "--time_based",
        ]),
        T,
    );
    assert!(String::from_utf8_lossy(&m.stdout).starts_with("3;"));
}
