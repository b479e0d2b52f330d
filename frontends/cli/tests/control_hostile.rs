//! Hostile clients of the control socket (issue 35, item 8 and 9)
//! against the real `blkstack serve`: many connections held open, lines
//! far longer than any request, and parameters the methods do not take.
//! Whatever they do, the server's threads and memory stay bounded, each
//! gets the error docs/CONTROL.md names, and other clients are served.

use blkstack_test_support::*;
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

const STACK: &str = "mem,,,rw,0 2048 memory";

fn status_field(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

fn connect(srv: &Serve) -> UnixStream {
    let s = UnixStream::connect(&srv.control).expect("connect control");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    s
}

/// Read one answer line; `None` when the server closed first.
fn answer(s: &UnixStream) -> Option<Value> {
    let mut line = String::new();
    let n = BufReader::new(s).read_line(&mut line).expect("read answer");
    (n > 0).then(|| serde_json::from_str(&line).expect("answer is JSON"))
}

fn error_code(v: &Value) -> i64 {
    v["error"]["code"]
        .as_i64()
        .unwrap_or_else(|| panic!("no error in {v}"))
}

/// The server still answers a verb on a fresh connection.
fn still_serves(srv: &Serve) {
    let out = srv.run("ls", &[]);
    assert!(out.status.success(), "ls failed: {}", out.stderr);
    assert!(out.stdout.contains("mem"), "ls: {}", out.stdout);
}

#[test]
fn lines_longer_than_the_limit_are_refused_and_cost_bounded_memory() {
    let srv = Serve::start(STACK, "mem");
    let pid = srv.pid();
    let base = status_field(pid, "VmRSS");
    // 24 clients each send 3 MiB without a newline: over the 1 MiB limit,
    // under the old 16 MiB one (where each was buffered whole).
    let chunk = vec![b'x'; 64 << 10];
    let mut conns = Vec::new();
    for _ in 0..24 {
        let mut s = connect(&srv);
        for _ in 0..48 {
            if s.write_all(&chunk).is_err() {
                break; // the server closed on us: what we want
            }
        }
        conns.push(s);
    }
    let grown = status_field(pid, "VmRSS").saturating_sub(base);
    for s in &conns {
        let v = answer(s).expect("an error line before the close");
        assert_eq!(error_code(&v), -32600, "{v}");
        let msg = v["error"]["message"].as_str().unwrap_or("");
        assert!(msg.contains("longer than 1048576 bytes"), "{msg}");
    }
    // 24 x 3 MiB would be 72 MiB held; the limit holds at most 1 MiB each.
    assert!(grown < 40 << 10, "RSS grew by {grown} KiB");
    still_serves(&srv);
}

#[test]
fn connections_beyond_the_cap_are_refused_and_threads_stay_bounded() {
    let srv = Serve::start(STACK, "mem");
    let pid = srv.pid();
    let base = status_field(pid, "Threads");
    let mut idle = Vec::new();
    for _ in 0..200 {
        idle.push(connect(&srv));
    }
    std::thread::sleep(Duration::from_millis(500));
    let threads = status_field(pid, "Threads");
    assert!(
        threads <= base + 40,
        "{threads} threads with 200 idle clients (from {base})"
    );
    // The ones past the cap were told why and closed.
    let mut busy = 0;
    for s in &idle[40..] {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let v = answer(s).expect("a refusal line");
        assert_eq!(error_code(&v), -32000, "{v}");
        busy += 1;
    }
    assert_eq!(busy, 160);
    drop(idle);
    std::thread::sleep(Duration::from_millis(300));
    still_serves(&srv);
}

#[test]
fn methods_without_params_refuse_unknown_ones() {
    let srv = Serve::start(STACK, "mem");
    for method in ["ls", "version", "exports"] {
        let mut s = connect(&srv);
        writeln!(
            s,
            r#"{{"jsonrpc":"2.0","id":7,"method":"{method}","params":{{"bogus":1}}}}"#
        )
        .expect("send");
        let v = answer(&s).expect("answer");
        assert_eq!(error_code(&v), -32602, "{method}: {v}");
        assert_eq!(v["id"], 7);
        // And without params, or with `{}`, it still works.
        writeln!(
            s,
            r#"{{"jsonrpc":"2.0","id":8,"method":"{method}","params":{{}}}}"#
        )
        .expect("send");
        let v = answer(&s).expect("answer");
        assert!(v.get("result").is_some(), "{method}: {v}");
    }
}
