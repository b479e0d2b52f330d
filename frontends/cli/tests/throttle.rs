//! The `throttle` target judged by the real fio (its nbd engine, libnbd)
//! against `blkstack serve`: an IOPS cap, a bandwidth cap charged by
//! bytes (a 1 MiB write under 4 MiB/s every quarter second), a burst at
//! its burst rate and then the base rate, and a `blkstack message ... set`
//! taking effect at once in the middle of a run.
//!
//! Rates come from fio's per-I/O completion log (`log_avg_msec=0`,
//! Unix-epoch milliseconds): the median, over consecutive windows of a
//! fixed number of completions, of completions per second. A stall of
//! fio or of the host lengthens one window and shortens the next (the
//! buckets keep the tokens of a stall for a tenth of a second), so the
//! median stays at the cap; a host too slow to reach the cap can only
//! bring it below, which is what the lower bound would show. The caps
//! are a few hundred to a thousand IOPS, far below what fio reaches here
//! unthrottled.

use blkstack_test_support::*;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const T: Duration = Duration::from_secs(120);
/// 1 GiB.
const LEN: u64 = 2_097_152;

/// One completion: Unix time in ms, and its bytes.
#[derive(Clone, Copy, Debug)]
struct Done {
    at_ms: u64,
    bytes: u64,
}

fn serve(limits: &str) -> Serve {
    let n = limits.split_whitespace().count();
    Serve::start(
        &format!("n,,,rw,0 {LEN} null;t,,,rw,0 {LEN} throttle n {n} {limits}"),
        "t",
    )
}

/// fio's nbd engine on export `t`, `secs` long, logging every completion
/// to `DIR/c_clat.1.log`.
fn fio(srv: &Serve, rw: &str, bs: &str, qd: u32, secs: f64) -> Child {
    let log = srv.dir.join("c");
    Command::new(tool("fio"))
        .args([
            "--name=t",
            "--ioengine=nbd",
            &format!("--uri={}", srv.uri("t")),
            &format!("--rw={rw}"),
            &format!("--bs={bs}"),
            &format!("--iodepth={qd}"),
            &format!("--runtime={}ms", (secs * 1000.0) as u64),
            "--time_based",
            "--size=256m",
            "--log_avg_msec=0",
            "--log_unix_epoch=1",
            &format!("--write_lat_log={}", log.display()),
            &format!("--output={}", srv.dir.join("fio.out").display()),
        ])
        .spawn()
        .expect("start fio")
}

fn finish(srv: &Serve, mut child: Child) -> Vec<Done> {
    let st = wait_bounded(&mut child, T, "fio");
    let out = std::fs::read_to_string(srv.dir.join("fio.out")).unwrap_or_default();
    assert!(st.success(), "fio failed: {out}");
    completions(&srv.dir.join("c_clat.1.log"))
}

fn completions(path: &Path) -> Vec<Done> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut v: Vec<Done> = text
        .lines()
        .map(|l| {
            let f: Vec<u64> = l.split(',').map(|x| x.trim().parse().unwrap()).collect();
            Done {
                at_ms: f[0],
                bytes: f[3],
            }
        })
        .collect();
    v.sort_by_key(|d| d.at_ms);
    assert!(
        v.len() > 10,
        "{} completions in {}",
        v.len(),
        path.display()
    );
    v
}

/// The median, over consecutive windows of `k` completions inside
/// `[from_ms, to_ms)`, of (completions or bytes) per second.
fn median_rate(done: &[Done], from_ms: u64, to_ms: u64, k: usize, bytes: bool) -> f64 {
    let w: Vec<&Done> = done
        .iter()
        .filter(|d| d.at_ms >= from_ms && d.at_ms < to_ms)
        .collect();
    let mut rates: Vec<f64> = w
        .chunks_exact(k + 1)
        .map(|c| {
            let units: u64 = if bytes {
                c[1..].iter().map(|d| d.bytes).sum()
            } else {
                k as u64
            };
            let span = (c[k].at_ms - c[0].at_ms).max(1);
            units as f64 * 1000.0 / span as f64
        })
        .collect();
    assert!(
        rates.len() >= 5,
        "{} windows of {k} in the range",
        rates.len()
    );
    rates.sort_by(|a, b| a.total_cmp(b));
    rates[rates.len() / 2]
}

fn assert_within_5pct(what: &str, got: f64, cap: f64) {
    println!("{what}: {got:.1}/s, cap {cap}, ratio {:.4}", got / cap);
    assert!(
        got >= cap * 0.95,
        "{what}: {got:.1}/s is below 95 % of the cap {cap}"
    );
    assert!(
        got <= cap * 1.05,
        "{what}: {got:.1}/s is above the cap {cap} by more than 5 %"
    );
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as u64
}

#[test]
fn an_iops_cap_holds_within_5_percent() {
    let srv = serve("riops 400");
    let done = finish(&srv, fio(&srv, "randread", "4k", 16, 3.5));
    let t0 = done[0].at_ms;
    // After the first tenth of a second's slack: windows of 40 (100 ms).
    let rate = median_rate(&done, t0 + 500, u64::MAX, 40, false);
    assert_within_5pct("riops 400", rate, 400.0);
    let st = srv.ok("status", &["t"]);
    assert!(st.contains("throttle 2 riops 400 "), "{st}");
}

#[test]
fn a_bandwidth_cap_charges_large_writes_by_their_bytes() {
    let srv = serve("wbps 4M");
    let done = finish(&srv, fio(&srv, "write", "1m", 1, 3.6));
    let t0 = done[0].at_ms;
    // One 1 MiB write every quarter second: windows of one interval.
    let rate = median_rate(&done, t0 + 300, u64::MAX, 1, true);
    assert_within_5pct("wbps 4M at 1 MiB", rate, 4.0 * 1048576.0);
}

#[test]
fn a_burst_runs_at_its_rate_then_the_base_rate() {
    // A bucket of 1000 × 2 filling at 1000 - 200 a second: the burst
    // lasts two and a half seconds at 1000 IOPS, then 200 IOPS.
    let srv = serve("riops 200 riops_burst 1000 2");
    let done = finish(&srv, fio(&srv, "randread", "4k", 16, 4.5));
    let t0 = done[0].at_ms;
    let first_second = done.iter().filter(|d| d.at_ms < t0 + 1000).count();
    assert!(
        first_second >= 950,
        "{first_second} I/Os in the first second of a 1000 IOPS burst"
    );
    let burst = median_rate(&done, t0 + 300, t0 + 2000, 50, false);
    assert_within_5pct("the burst", burst, 1000.0);
    let base = median_rate(&done, t0 + 3000, u64::MAX, 20, false);
    assert_within_5pct("after the burst", base, 200.0);
}

#[test]
fn a_set_message_takes_effect_at_once_mid_run() {
    let srv = serve("riops 100");
    let child = fio(&srv, "randread", "4k", 16, 4.0);
    // fio takes a while to start: wait until the throttle holds its
    // I/O, then give the old rate a second and a half.
    let started = std::time::Instant::now();
    while held_ios(&srv.ok("status", &["t"])) == 0 {
        assert!(started.elapsed() < T, "fio never reached the throttle");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(1500));
    let before = now_ms();
    srv.ok("message", &["t", "0", "set", "riops", "1000"]);
    let after = now_ms();
    let done = finish(&srv, child);
    let t0 = done[0].at_ms;
    let slow = median_rate(&done, t0 + 300, before, 10, false);
    assert_within_5pct("before the set", slow, 100.0);
    // Within 100 ms of the message returning, the new rate runs: at the
    // old one at most 11 I/Os could complete in that time.
    let early = done
        .iter()
        .filter(|d| d.at_ms >= after && d.at_ms < after + 100)
        .count();
    assert!(
        early >= 50,
        "{early} I/Os in the 100 ms after `set riops 1000`"
    );
    let fast = median_rate(&done, after, after + 1000, 50, false);
    assert_within_5pct("after the set", fast, 1000.0);
    let table = srv.ok("table", &["t"]);
    assert!(table.contains("throttle 253:0 2 riops 1000"), "{table}");
}

/// `<held_ios>` of a throttle's status line (`start len throttle
/// <#args> <args>... <held_ios> <held_bytes> ...`).
fn held_ios(status: &str) -> u64 {
    let w: Vec<&str> = status.split_whitespace().collect();
    let n: usize = w[3].parse().expect("#args");
    w[4 + n].parse().expect("held_ios")
}

#[test]
fn bad_sets_are_refused_and_change_nothing() {
    let srv = serve("riops 100");
    let before = srv.ok("table", &["t"]);
    let e = srv.fails("message", &["t", "0", "set", "iops", "5"]);
    assert!(e.contains("iops cannot be given with riops"), "{e}");
    let e = srv.fails("message", &["t", "0", "set", "wbps", "4Q"]);
    assert!(e.contains("invalid size '4Q' for wbps"), "{e}");
    assert_eq!(srv.ok("table", &["t"]), before);
}
