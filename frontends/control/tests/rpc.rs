//! The control socket as a script sees it: raw JSON-RPC lines over the
//! unix socket of an in-process `ControlServer` driving a real registry.
//! Checks the protocol (ids, errors, notifications), the socket's mode
//! and takeover rules, and that refused changes leave the state as it was.

use blkstack_control::{Control, ControlServer};
use blkstack_core::sync::submit_and_wait;
use blkstack_core::Op;
use blkstack_mapped::Registry;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

struct Fixture {
    // Declared first so it stops before the directory goes.
    server: Option<ControlServer>,
    path: PathBuf,
    reg: Arc<Registry>,
    _dir: tempfile::TempDir,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("control.sock");
    let reg = Registry::new();
    reg.create_concise("mem,,,rw,0 2048 memory;d0,,,rw,0 2048 linear mem 0")
        .expect("stack");
    let control = Arc::new(Control::new(reg.clone(), None));
    let server = ControlServer::start(&path, control, false).expect("start");
    Fixture {
        _dir: dir,
        path,
        reg,
        server: Some(server),
    }
}

struct Conn {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Conn {
    fn new(f: &Fixture) -> Conn {
        let s = UnixStream::connect(&f.path).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Conn {
            r: BufReader::new(s.try_clone().unwrap()),
            w: s,
        }
    }

    fn send_line(&mut self, line: &str) {
        self.w.write_all(line.as_bytes()).unwrap();
        self.w.write_all(b"\n").unwrap();
    }

    fn recv(&mut self) -> Value {
        let mut l = String::new();
        self.r.read_line(&mut l).expect("answer");
        serde_json::from_str(&l).unwrap_or_else(|e| panic!("bad answer {l:?}: {e}"))
    }

    fn call(&mut self, id: u64, method: &str, params: Value) -> Value {
        self.send_line(
            &json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string(),
        );
        let v = self.recv();
        assert_eq!(v["id"], json!(id), "{v}");
        assert_eq!(v["jsonrpc"], "2.0");
        v
    }
}

#[test]
fn socket_is_private_and_removed_on_stop() {
    let mut f = fixture();
    let mode = std::fs::metadata(&f.path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    f.server.take().unwrap().stop();
    assert!(!f.path.exists());
}

#[test]
fn live_socket_is_refused_and_stale_one_replaced() {
    let f = fixture();
    let c2 = Arc::new(Control::new(f.reg.clone(), None));
    let e = ControlServer::start(&f.path, c2.clone(), false)
        .err()
        .expect("second server on a live socket must fail");
    assert!(e.to_string().contains("another server"), "{e}");
    // A socket file nobody listens on (a crashed server) is taken over.
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let s = ControlServer::start(&stale, c2, false).expect("replace stale socket");
    let mut c = UnixStream::connect(s.path()).unwrap();
    c.write_all(b"{\"id\":1,\"method\":\"version\"}\n").unwrap();
    let mut l = String::new();
    BufReader::new(c).read_line(&mut l).unwrap();
    assert!(l.contains("\"server\":\"blkstack\""), "{l}");
}

#[test]
fn protocol_errors_name_what_is_wrong() {
    let f = fixture();
    let mut c = Conn::new(&f);
    c.send_line("this is not json");
    let v = c.recv();
    assert_eq!(v["error"]["code"], -32700);
    assert_eq!(v["id"], Value::Null);

    c.send_line(r#"{"id": 5, "params": {}}"#);
    let v = c.recv();
    assert_eq!(
        (v["id"].clone(), v["error"]["code"].clone()),
        (json!(5), json!(-32600))
    );

    c.send_line(r#"{"jsonrpc": "1.0", "id": 6, "method": "ls"}"#);
    assert_eq!(c.recv()["error"]["code"], -32600);

    let v = c.call(7, "frobnicate", json!({}));
    assert_eq!(v["error"]["code"], -32601);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("frobnicate"));

    let v = c.call(8, "suspend", json!({"nmae": "d0"}));
    assert_eq!(v["error"]["code"], -32602);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("nmae"),
        "{v}"
    );

    // A notification runs but gets no answer; blank lines are ignored:
    // the next answer is the next request's.
    c.send_line(r#"{"jsonrpc": "2.0", "method": "suspend", "params": {"name": "d0"}}"#);
    c.send_line("");
    let v = c.call(9, "info", json!({"names": ["d0"]}));
    assert_eq!(v["result"]["devices"][0]["suspended"], true);
    c.call(10, "resume", json!({"name": "d0"}));

    // Export needs an NBD frontend, which this server has not.
    let v = c.call(11, "export", json!({"name": "d0"}));
    assert_eq!(v["error"]["data"]["errno"], "EOPNOTSUPP", "{v}");
}

#[test]
fn device_errors_carry_dm_errnos_and_change_nothing() {
    let f = fixture();
    let mut c = Conn::new(&f);
    let before = c.call(1, "table", json!({}))["result"].clone();

    let v = c.call(2, "info", json!({"names": ["nope"]}));
    assert_eq!(v["error"]["code"], libc::ENXIO);
    assert_eq!(v["error"]["data"]["errno"], "ENXIO");

    let v = c.call(
        3,
        "reload",
        json!({"name": "d0", "table": "0 2048 linear mem 0\n2048 8 bogus"}),
    );
    assert_eq!(v["error"]["code"], libc::EINVAL);
    assert_eq!(v["error"]["data"]["kind"], "table");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("line 2"),
        "{v}"
    );

    let v = c.call(4, "create", json!({"name": "mem", "table": "0 8 zero"}));
    assert_eq!(v["error"]["code"], libc::EBUSY);

    // A batch whose second device is bad creates neither.
    let v = c.call(
        5,
        "create",
        json!({"concise": "n1,,,rw,0 8 zero;n2,,,rw,0 8 linear nosuch 0"}),
    );
    // A missing device: ENOENT, as the kernel's table load says.
    assert_eq!(v["error"]["code"], libc::ENOENT, "{v}");
    assert!(f.reg.get("n1").is_none());

    let v = c.call(6, "remove", json!({"name": "mem"}));
    assert_eq!(v["error"]["code"], libc::EBUSY);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("used by d0"));

    let v = c.call(
        7,
        "message",
        json!({"name": "d0", "sector": 0, "message": ["hello"]}),
    );
    assert_eq!(v["error"]["code"], libc::EINVAL);

    let v = c.call(
        8,
        "create",
        json!({"name": "x", "concise": "a,,,rw,0 8 zero"}),
    );
    assert_eq!(v["error"]["code"], -32602);

    assert_eq!(c.call(9, "table", json!({}))["result"], before);
    let info = c.call(10, "info", json!({"names": ["d0"]}))["result"]["devices"][0].clone();
    assert_eq!(info["inactive_table"], false);
    assert_eq!(info["suspended"], false);
}

#[test]
fn reload_stages_until_resume_and_suspend_holds_io() {
    let f = fixture();
    let mut c = Conn::new(&f);
    let v = c.call(1, "reload", json!({"name": "d0", "table": "0 1024 zero"}));
    assert!(v["error"].is_null(), "{v}");
    // Staged, not live.
    let t = c.call(2, "table", json!({"names": ["d0"]}));
    assert_eq!(
        t["result"]["devices"][0]["table"],
        "0 2048 linear 253:0 0\n"
    );
    let t = c.call(3, "table", json!({"names": ["d0"], "inactive": true}));
    assert_eq!(t["result"]["devices"][0]["table"], "0 1024 zero\n");

    c.call(4, "suspend", json!({"name": "d0"}));
    // I/O to a suspended device is held, not failed.
    let dev = f.reg.device("d0").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let d2 = dev.clone();
    let t = std::thread::spawn(move || {
        let mut buf = vec![0u8; 512];
        let st = submit_and_wait(&*d2, Op::Read, 0, 512, &mut buf);
        tx.send(st).unwrap();
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "a read completed while the device was suspended"
    );
    let v = c.call(5, "resume", json!({"name": "d0"}));
    assert_eq!(v["result"]["table_swapped"], true);
    let st = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("held read completes on resume");
    assert!(st.is_ok(), "{st:?}");
    t.join().unwrap();
    assert_eq!(dev.size(), 1024 * 512);
    let t = c.call(6, "ls", json!({}));
    let d0 = t["result"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "d0")
        .cloned()
        .unwrap();
    assert_eq!(d0["deps"], json!([]), "the zero table uses no device");
    // Now mem is unused and can go.
    assert!(c.call(7, "remove", json!({"name": "mem"}))["error"].is_null());
    assert_eq!(f.reg.names(), vec!["d0".to_string()]);
}

#[test]
fn clients_are_served_concurrently() {
    let f = fixture();
    let mut a = Conn::new(&f);
    let mut b = Conn::new(&f);
    // a leaves its connection open without sending; b is still answered.
    a.send_line(r#"{"id": 1, "method": "version"}"#);
    assert!(b.call(2, "ls", json!({}))["result"]["devices"].is_array());
    assert_eq!(a.recv()["id"], 1);
}

#[test]
fn reload_and_remove_take_force_for_ram_held_data() {
    let f = fixture();
    let mut c = Conn::new(&f);
    c.call(1, "create", json!({"name": "mm", "table": "0 64 memory"}));
    let dev = f.reg.device("mm").unwrap();
    let mut w = vec![0x42u8; 4096];
    assert!(submit_and_wait(&*dev, Op::Write, 0, 4096, &mut w).is_ok());

    let v = c.call(2, "reload", json!({"name": "mm", "table": "0 64 zero"}));
    assert_eq!(v["error"]["data"]["kind"], "would_lose_data", "{v}");
    assert_eq!(v["error"]["data"]["errno"], "EBUSY", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("'0 64 memory' holds 4096 bytes"), "{msg}");
    assert_eq!(f.reg.inactive_table_text("mm").unwrap(), None);
    let v = c.call(
        3,
        "reload",
        json!({"name": "mm", "table": "0 64 memory", "force": false}),
    );
    assert!(v["error"].is_null(), "{v}");
    let v = c.call(4, "resume", json!({"name": "mm"}));
    assert_eq!(v["result"]["table_swapped"], true, "{v}");
    let v = c.call(5, "remove", json!({"name": "mm"}));
    assert_eq!(v["error"]["data"]["kind"], "would_lose_data", "{v}");
    assert!(f.reg.get("mm").is_some());
    let v = c.call(
        6,
        "reload",
        json!({"name": "mm", "table": "0 64 zero", "force": true}),
    );
    assert!(v["error"].is_null(), "{v}");
    let v = c.call(7, "remove", json!({"name": "mm", "force": true}));
    assert!(v["error"].is_null(), "{v}");
    assert!(f.reg.get("mm").is_none());
}

fn limited(lim: blkstack_control::ServerLimits) -> (ControlServer, PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("control.sock");
    let control = Arc::new(Control::new(Registry::new(), None));
    let server = ControlServer::start_with_limits(&path, control, false, lim).expect("start");
    (server, path, dir)
}

fn closing_error(s: UnixStream) -> Value {
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).expect("error line");
    let v: Value = serde_json::from_str(&line).expect("json");
    line.clear();
    // Closed: EOF, or ECONNRESET when the client was still sending (a
    // Unix socket closed with unread input resets its peer; the error
    // line queued before it is still read first, as above).
    match r.read_line(&mut line) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("not closed: {other:?} {line:?}"),
    }
    v
}

#[test]
fn idle_and_trickling_clients_are_closed_at_the_request_deadline() {
    let lim = blkstack_control::ServerLimits {
        request_deadline: Duration::from_millis(500),
        ..Default::default()
    };
    let (_server, path, _dir) = limited(lim);
    let idle = UnixStream::connect(&path).expect("connect");
    let mut trickle = UnixStream::connect(&path).expect("connect");
    let t0 = std::time::Instant::now();
    let writer = {
        let mut w = trickle.try_clone().expect("clone");
        std::thread::spawn(move || {
            for _ in 0..40 {
                if w.write_all(b" ").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    for s in [idle, trickle.try_clone().expect("clone")] {
        let v = closing_error(s);
        assert_eq!(v["error"]["code"], -32600, "{v}");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("no complete request"));
    }
    assert!(t0.elapsed() < Duration::from_secs(3));
    let _ = writer.join();
    // A prompt client is served as before, request after request.
    let _ = trickle.flush();
    let mut ok = UnixStream::connect(&path).expect("connect");
    for id in 0..3 {
        writeln!(ok, r#"{{"id":{id},"method":"version"}}"#).expect("send");
        let mut r = BufReader::new(ok.try_clone().expect("clone"));
        let mut line = String::new();
        r.read_line(&mut line).expect("answer");
        assert!(line.contains("\"result\""), "{line}");
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn a_line_of_exactly_the_limit_is_read_and_one_byte_more_is_refused() {
    let lim = blkstack_control::ServerLimits {
        max_line: 4096,
        ..Default::default()
    };
    let (_server, path, _dir) = limited(lim);
    let req = r#"{"id":1,"method":"version"}"#;
    let pad = " ".repeat(4096 - req.len());
    let mut s = UnixStream::connect(&path).expect("connect");
    writeln!(s, "{pad}{req}").expect("send");
    let mut r = BufReader::new(s.try_clone().expect("clone"));
    let mut line = String::new();
    r.read_line(&mut line).expect("answer");
    assert!(line.contains("\"result\""), "{line}");
    // One write: `writeln!` on a bare socket writes each piece apart, and
    // the server, which refuses as soon as it holds more than the limit,
    // may close before the last piece (the newline), failing that write
    // with EPIPE. A whole line in one call lands before the server reads.
    s.write_all(format!(" {pad}{req}\n").as_bytes())
        .expect("send");
    let v = closing_error(s);
    assert_eq!(v["error"]["code"], -32600, "{v}");
}
