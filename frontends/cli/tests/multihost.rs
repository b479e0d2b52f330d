//! Multipath and striping over NBD exports on other hosts: hosts are
//! network namespaces on one bridge (see `netns_support`), every path a
//! real TCP connection of the `nbd` leaf to a real server (blkstack
//! serve, qemu-nbd, nbdkit). What dm-multipath with multipathd's checker
//! promises a SAN user is checked end to end: a write+verify load at
//! QD32 loses nothing and sees no error while one host's server is
//! killed with SIGKILL and restarted and another host's link is cut and
//! restored, and each path goes failed, then active again, without a
//! message (the checker reinstates it). Once through the bench runner in
//! process, once through `blkstack serve` re-exporting the multipath to
//! fio's own nbd engine. Striping over three hosts' exports passes a
//! verify run too.
//!
//! Skips (saying why) only where network namespaces cannot be made.

mod netns_support;

use blkstack_bench::{parse_command_line, run_jobs, JobSpec, RunOptions};
use blkstack_mapped::Registry;
use netns_support::{
    checker_reinstated, namespaces_or_skip, path_devs, tool, Hosts, PathWatch, Server,
};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// 64 MiB per export.
const SECTORS: u64 = 64 * 2048;
/// The nbd leaves' options: a dead connection is noticed within a second
/// (a cut link leaves no socket error behind, only silence), and requests
/// wait half a second for a reconnect before failing over to another
/// path.
const NBD_OPTS: &str = "timeout_ms=1000 reconnect_delay_ms=50 dead_timeout_ms=500";
/// Multipath features: queue rather than fail when no path is left, and
/// the path checker probing every 250 ms.
const MPATH_FEATURES: &str = "3 queue_if_no_path checker_interval 250";
/// How long the in-process load runs; the faults happen in its first
/// half or so.
const RUNTIME_S: u64 = 12;

/// `blkstack bench`'s options turned into one job.
fn job(args: &[&str]) -> JobSpec {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let mut cl = parse_command_line(&args).expect("bench options");
    cl.named_jobs.remove(0)
}

/// The client's stack: one nbd leaf per host, a multipath over them.
fn multipath_stack(hosts: &Hosts) -> String {
    let mut s = String::new();
    for i in 0..hosts.len() {
        s.push_str(&hosts.nbd_line(&format!("p{i}"), i, NBD_OPTS));
    }
    let paths: Vec<String> = (0..hosts.len()).map(|i| format!("p{i}")).collect();
    s.push_str(&format!(
        "mp: 0 {SECTORS} multipath {MPATH_FEATURES} 0 1 1 service-time 0 {} 0 {}\n",
        hosts.len(),
        paths.join(" ")
    ));
    s
}

/// The faults, in order, while the load runs: host `kill` is killed and
/// restarted once its path has failed, host `cut` loses its link until
/// its path has failed. Each path must come back (checker) in time.
fn inject_faults(hosts: &mut Hosts, watch: &PathWatch, kill: usize, cut: usize) {
    let limit = Duration::from_secs(8);
    std::thread::sleep(Duration::from_secs(1));
    hosts.kill9(kill);
    assert!(
        watch.wait_for(kill, "AF", limit),
        "path p{kill} not failed after its server was killed: {:?}",
        watch.history()
    );
    std::thread::sleep(Duration::from_millis(500));
    hosts.restart(kill);
    hosts.link(cut, false);
    assert!(
        watch.wait_for(cut, "AF", limit),
        "path p{cut} not failed after its link was cut: {:?}",
        watch.history()
    );
    hosts.link(cut, true);
    for p in [kill, cut] {
        assert!(
            watch.wait_for(p, "AFA", limit),
            "path p{p} not reinstated by the checker: {:?}",
            watch.history()
        );
    }
}

/// The checker, not a message, brought the faulted paths back: its
/// `checker` answer counts a reinstatement for each.
fn assert_checker_reinstated(answer: &str, devs: &[String], faulted: &[usize]) {
    for &p in faulted {
        let n = checker_reinstated(answer, &devs[p]);
        assert!(
            n.is_some_and(|n| n >= 1),
            "checker did not reinstate {}: {answer}",
            devs[p]
        );
    }
}

#[test]
fn failover_in_process_bench_verifies_through_kill_and_link_cut() {
    if !namespaces_or_skip("failover_in_process") {
        return;
    }
    let mut hosts = Hosts::start(
        &[
            Server::Blkstack { delay_ms: 0.1 },
            Server::QemuNbd,
            Server::Nbdkit { delay_ms: 1 },
        ],
        SECTORS,
        true,
    );
    let reg: Arc<Registry> = Registry::new();
    let stack = multipath_stack(&hosts);
    let r = reg.clone();
    hosts
        .bed
        .client
        .run(move || Ok(r.create_stack(&stack)?))
        .expect("multipath over nbd leaves");
    let devs = path_devs(&reg.message("mp", 0, &["path_stats"]).unwrap());
    assert_eq!(devs.len(), 3, "{devs:?}");
    let r = reg.clone();
    let watch = PathWatch::start(devs.clone(), move || r.status_text("mp").ok());
    // blkstack bench reads back every write of a time-based run, its last
    // backlog included (fio leaves that one unchecked).
    let runtime = format!("--runtime={RUNTIME_S}");
    let spec = job(&[
        "--name=failover",
        "--filename=mp",
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=32",
        "--time_based",
        &runtime,
        "--verify=crc32c",
        "--verify_backlog=256",
        "--do_verify=1",
    ]);
    let r = reg.clone();
    let bench = hosts
        .bed
        .client
        .spawn(move || run_jobs(&r, &[spec], &RunOptions::default()))
        .unwrap();
    inject_faults(&mut hosts, &watch, 0, 1);
    assert_checker_reinstated(&reg.message("mp", 0, &["checker"]).unwrap(), &devs, &[0, 1]);
    let report = bench.join().expect("bench thread").expect("bench run");
    let j = &report.jobs[0];
    assert_eq!(j.error, 0, "job error");
    assert_eq!(j.write.errors, 0, "write errors");
    assert_eq!(j.read.errors, 0, "read errors");
    assert_eq!(j.verify_errors, 0, "{:?}", j.verify_failures);
    assert!(j.write.total_ios > 0, "nothing written");
    assert!(
        j.verify_checked >= j.write.total_ios,
        "{} writes, {} verified",
        j.write.total_ios,
        j.verify_checked
    );
    eprintln!(
        "bench: {} writes, {} verified; paths {:?}",
        j.write.total_ios,
        j.verify_checked,
        watch.history()
    );
    drop(watch);
    reg.remove_all();
}

/// `blkstack VERB --control SOCKET ARGS` (status, message) against the
/// client's control socket; `None` if it fails.
fn control(socket: &std::path::Path, verb: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_blkstack"))
        .arg(verb)
        .arg("--control")
        .arg(socket)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn failover_fio_nbd_engine_through_serve_verifies() {
    if !namespaces_or_skip("failover_fio") {
        return;
    }
    let fio = tool("fio");
    let mut hosts = Hosts::start(
        &[
            Server::QemuNbd,
            Server::Blkstack { delay_ms: 0.2 },
            Server::Nbdkit { delay_ms: 1 },
        ],
        SECTORS,
        true,
    );
    let dir = hosts.dir.path().to_path_buf();
    let stack = dir.join("client.stack");
    std::fs::write(&stack, multipath_stack(&hosts)).unwrap();
    let (sock, ctl) = (dir.join("mp.sock"), dir.join("client.control"));
    let mut cmd = hosts.bed.client.command(env!("CARGO_BIN_EXE_blkstack"));
    cmd.arg("serve")
        .arg("--stack")
        .arg(&stack)
        .args(["--export", "mp", "--listen"])
        .arg(format!("nbd+unix:///?socket={}", sock.display()))
        .arg("--control")
        .arg(&ctl)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("client.log")).unwrap());
    let mut serve = blkstack_lab::netns::Daemon::spawn("client serve", cmd).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(
            serve.exited().is_none() && Instant::now() < deadline,
            "client serve did not start: {}",
            std::fs::read_to_string(dir.join("client.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let stats = control(&ctl, "message", &["mp", "0", "path_stats"]).expect("path_stats");
    let devs = path_devs(&stats);
    assert_eq!(devs.len(), 3, "{stats}");
    let c = ctl.clone();
    let watch = PathWatch::start(devs.clone(), move || control(&c, "status", &["mp"]));
    // Size-based, so that fio's verify phase reads back every block
    // written (a time-based run leaves its last backlog unverified); the
    // writes are paced so that the faults fall inside the write phase.
    let fio_run = std::thread::spawn({
        let args = [
            "--name=failover".to_string(),
            "--ioengine=nbd".to_string(),
            format!("--uri=nbd+unix:///mp?socket={}", sock.display()),
            "--rw=randwrite".into(),
            "--bs=4k".into(),
            "--iodepth=32".into(),
            "--size=40m".into(),
            "--rate_iops=0,1200".into(),
            "--verify=crc32c".into(),
            "--verify_backlog=256".into(),
            "--do_verify=1".into(),
            // No verify state file left in the working directory.
            "--verify_state_save=0".into(),
            "--output-format=json".into(),
        ];
        move || Command::new(fio).args(args).output()
    });
    inject_faults(&mut hosts, &watch, 0, 1);
    let answer = control(&ctl, "message", &["mp", "0", "checker"]).expect("checker message");
    assert_checker_reinstated(&answer, &devs, &[0, 1]);
    let out = fio_run.join().unwrap().expect("run fio");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "fio failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        text
    );
    let start = text.find('{').expect("fio JSON");
    let v: serde_json::Value = serde_json::from_str(&text[start..]).expect("fio JSON");
    let j = &v["jobs"][0];
    assert_eq!(j["error"], 0, "{j}");
    let (writes, reads) = (
        j["write"]["total_ios"].as_u64().unwrap_or(0),
        j["read"]["total_ios"].as_u64().unwrap_or(0),
    );
    eprintln!(
        "fio: {writes} writes, {reads} verify reads; paths {:?}",
        watch.history()
    );
    assert_eq!(writes, 40 << 8, "every block written once: {j}");
    assert!(reads >= writes, "not every write verified: {j}");
    drop(watch);
    drop(serve);
}

#[test]
fn striped_over_three_hosts_verifies_and_spreads() {
    if !namespaces_or_skip("striped_over_hosts") {
        return;
    }
    let hosts = Hosts::start(
        &[
            Server::Blkstack { delay_ms: 0.1 },
            Server::QemuNbd,
            Server::Nbdkit { delay_ms: 1 },
        ],
        SECTORS,
        false,
    );
    let mut stack = String::new();
    for i in 0..3 {
        stack.push_str(&hosts.nbd_line(&format!("s{i}"), i, "timeout_ms=5000"));
    }
    stack.push_str(&format!(
        "st: 0 {} striped 3 128 s0 0 s1 0 s2 0\n",
        3 * SECTORS
    ));
    let reg: Arc<Registry> = Registry::new();
    let spec = job(&[
        "--name=striped",
        "--filename=st",
        "--rw=randrw",
        "--bssplit=4k/60:64k/40",
        "--iodepth=16",
        "--size=24m",
        "--verify=crc32c",
        "--do_verify=1",
    ]);
    let r = reg.clone();
    let report = hosts
        .bed
        .client
        .run(move || {
            r.create_stack(&stack)?;
            run_jobs(&r, &[spec], &RunOptions::default())
        })
        .expect("striped verify run");
    let j = &report.jobs[0];
    assert_eq!(j.error, 0);
    assert_eq!(j.read.errors + j.write.errors, 0);
    assert_eq!(j.verify_errors, 0, "{:?}", j.verify_failures);
    assert!(
        j.write.total_ios > 0 && j.verify_checked > 0,
        "nothing verified"
    );
    reg.remove_all();
    // Every host got its stripes: each export's file holds written data.
    for i in 0..3 {
        let data = std::fs::read(hosts.file(i)).unwrap();
        assert!(
            data.iter().any(|&b| b != 0),
            "host h{i}'s export received no writes"
        );
    }
}

/// The harness's readers of dm-mpath's status and the checker's answer,
/// on text in the shapes the target prints (runs without namespaces).
#[test]
fn status_and_checker_readers() {
    use netns_support::{is_subsequence, path_states};
    let devs: Vec<String> = ["p0", "p1", "p2"].iter().map(|s| s.to_string()).collect();
    let status = "0 131072 multipath 2 0 0 0 1 1 A 0 3 2 p0 A 0 0 1 p1 F 3 0 1 p2 A 1 0 1";
    assert_eq!(
        path_states(status, &devs),
        vec![Some('A'), Some('F'), Some('A')]
    );
    assert_eq!(path_states("", &devs), vec![None, None, None]);
    let answer = "interval_ms 250 timeout_ms 250 no_path_retry none running 1\n\
                  p0 active probes 40 ok 38 fail 2 reinstated 1 failed 1\n\
                  p1 active probes 40 ok 40 fail 0 reinstated 0 failed 0\n";
    assert_eq!(checker_reinstated(answer, "p0"), Some(1));
    assert_eq!(checker_reinstated(answer, "p1"), Some(0));
    assert_eq!(checker_reinstated(answer, "p9"), None);
    assert!(is_subsequence("AFA", "AFFA") && is_subsequence("AFA", "AFA"));
    assert!(!is_subsequence("AFA", "AF") && !is_subsequence("AFA", "FA"));
}

/// A cut link must end the nbd leaf's requests with an error within
/// `timeout_ms + dead_timeout_ms` and a bound, never hang: writes fill
/// the socket's send buffer while nothing is acknowledged, and a sender
/// blocked there must not keep the connection from being declared dead.
/// (A sender blocked there once held the connection's transmit lock that
/// the reader needed to declare the connection dead: the bench hung.)
#[test]
fn nbd_leaf_link_cut_ends_requests_instead_of_hanging() {
    if !namespaces_or_skip("nbd_leaf_link_cut") {
        return;
    }
    let hosts = Hosts::start(&[Server::QemuNbd], SECTORS, true);
    let reg: Arc<Registry> = Registry::new();
    let stack = hosts.nbd_line("p0", 0, "timeout_ms=1000 dead_timeout_ms=500");
    let r = reg.clone();
    hosts
        .bed
        .client
        .run(move || Ok(r.create_stack(&stack)?))
        .expect("nbd leaf");
    hosts.link(0, false);
    let spec = job(&[
        "--name=cut",
        "--filename=p0",
        "--rw=randwrite",
        "--bs=64k",
        "--iodepth=32",
        "--runtime=3",
        "--time_based",
    ]);
    let (tx, rx) = std::sync::mpsc::channel();
    let r = reg.clone();
    hosts
        .bed
        .client
        .spawn(move || {
            let _ = tx.send(run_jobs(&r, &[spec], &RunOptions::default()));
            Ok(())
        })
        .unwrap();
    let report = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("requests hang on a cut link: the bench did not end within 20 s of a 3 s run")
        .expect("bench run");
    let j = &report.jobs[0];
    assert!(j.write.errors > 0 || j.error != 0, "no error on a cut link");
}

/// `scripts/multihost.sh` as a user runs it: `up` builds hosts whose
/// exports the client namespace reaches and prints the client's stack,
/// `down` leaves nothing behind, and succeeds again when nothing is up.
#[test]
fn multihost_script_up_and_down() {
    if !namespaces_or_skip("multihost_script") {
        return;
    }
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/multihost.sh");
    let name = format!("bkmh{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let run = |args: &[&str]| {
        Command::new("bash")
            .arg(&script)
            .args(args)
            .env("MULTIHOST_NAME", &name)
            .env("MULTIHOST_DIR", &state)
            .env("BLKSTACK", env!("CARGO_BIN_EXE_blkstack"))
            .env("SIZE_MB", "16")
            .output()
            .unwrap()
    };
    let namespaces = || blkstack_lab::netns::ip(&["netns", "list"]).unwrap();
    let up = run(&["up", "4"]);
    let text = String::from_utf8_lossy(&up.stdout).into_owned();
    // Every host's export, as the client sees it (h2 is qemu-nbd, h3 nbdkit).
    let sizes: Vec<String> = (0..4)
        .map(|i| {
            let out = Command::new("ip")
                .args(["netns", "exec", &format!("{name}-client")])
                .arg(tool("nbdinfo"))
                .args(["--size", &format!("nbd://10.77.0.{}:10809/lun", 11 + i)])
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        })
        .collect();
    let cleanup = run(&["down"]);
    assert!(
        up.status.success(),
        "up failed: {}\n{text}",
        String::from_utf8_lossy(&up.stderr)
    );
    assert!(cleanup.status.success(), "down failed");
    assert_eq!(sizes, vec![(16u64 << 20).to_string(); 4], "{text}");
    assert!(
        text.lines().any(|l| l
            .starts_with("mp: 0 32768 multipath 3 queue_if_no_path checker_interval")
            && l.ends_with(" p0 p1 p2 p3")),
        "{text}"
    );
    assert!(
        text.contains("p1: 0 32768 nbd nbd://10.77.0.12:10809/lun"),
        "{text}"
    );
    assert!(
        !namespaces().contains(&format!("{name}-")),
        "{}",
        namespaces()
    );
    assert!(!state.exists(), "state directory left behind");
    assert!(
        run(&["down"]).status.success(),
        "a second down must succeed"
    );
}
