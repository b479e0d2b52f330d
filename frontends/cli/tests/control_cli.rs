//! The dmsetup-style verbs against the real `blkstack serve`: dmsetup's
//! output text, kernel semantics of reload/resume and remove, runtime
//! export/unexport seen by a real NBD client, and refusals that are
//! clear and change nothing.

use blkstack_nbd::client::RawClient;
use blkstack_test_support::*;
use std::os::unix::net::UnixStream;
use std::time::Duration;

const STACK: &str = "mem,,,rw,0 2048 memory;d0,,,rw,0 2048 linear mem 0";

fn nbd_client(srv: &Serve) -> RawClient<UnixStream> {
    let s = UnixStream::connect(&srv.nbd_socket).expect("connect nbd");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    RawClient::new(s)
}

#[test]
fn verbs_print_dmsetup_text() {
    let srv = Serve::start(STACK, "d0");
    assert_eq!(srv.ok("ls", &[]), "d0\t(253:1)\nmem\t(253:0)\n");
    assert_eq!(
        srv.ok("create", &["top", "--table", "0 2048 linear d0 0"]),
        ""
    );
    assert_eq!(
        srv.ok("ls", &["--tree"]),
        "top (253:2)\n └─d0 (253:1)\n    └─mem (253:0)\n"
    );
    assert_eq!(srv.ok("deps", &["top"]), "1 dependencies\t: (253, 1)\n");
    assert_eq!(
        srv.ok("deps", &[]),
        "d0: 1 dependencies\t: (253, 0)\nmem: 0 dependencies\t:\ntop: 1 dependencies\t: (253, 1)\n"
    );
    // The exported device is open once.
    assert_eq!(
        srv.ok("info", &["d0"]),
        "Name:              d0\n\
         State:             ACTIVE\n\
         Read Ahead:        256\n\
         Tables present:    LIVE\n\
         Open count:        1\n\
         Event number:      0\n\
         Major, minor:      253, 1\n\
         Number of targets: 1\n\n"
    );
    assert_eq!(
        srv.ok("table", &[]),
        "d0: 0 2048 linear 253:0 0\nmem: 0 2048 memory\ntop: 0 2048 linear 253:1 0\n"
    );
    assert_eq!(srv.ok("table", &["d0"]), "0 2048 linear 253:0 0\n");
    assert_eq!(
        srv.ok("table", &["d0", "top"]),
        "d0: 0 2048 linear 253:0 0\ntop: 0 2048 linear 253:1 0\n"
    );
    assert!(srv.ok("status", &["mem"]).starts_with("0 2048 memory"));
    assert!(srv.ok("status", &[]).contains("top: 0 2048 linear"));

    // A table file, standard input, a concise batch, a uuid and read-only.
    let file = srv.dir.join("t.table");
    std::fs::write(&file, "0 1024 zero\n1024 1024 linear mem 0\n").unwrap();
    srv.ok("create", &["f", file.to_str().unwrap()]);
    let o = srv.run_stdin("create", &["s", "-u", "UUID-s", "-r"], Some("0 16 zero\n"));
    assert!(o.status.success(), "{}", o.stderr);
    srv.ok(
        "create",
        &["--concise", "a,,,rw,0 8 zero;b,,,rw,0 8 linear a 0"],
    );
    let info = srv.ok("info", &["s", "f"]);
    assert!(
        info.contains("Name:              s\nState:             ACTIVE (READ-ONLY)\n"),
        "{info}"
    );
    assert!(
        info.contains("Number of targets: 1\nUUID: UUID-s\n\nName:              f\n"),
        "{info}"
    );
    assert!(info.contains("Number of targets: 2\n\n"), "{info}");
    assert_eq!(
        srv.ok("table", &["f"]),
        "0 1024 zero\n1024 1024 linear 253:0 0\n"
    );
    let tree = srv.ok("ls", &["--tree"]);
    assert!(tree.contains("b (253:"), "{tree}");
    assert!(tree.contains(" └─a (253:"), "{tree}");

    // Messages reach the target (delay's run-time `set`).
    srv.ok("create", &["dl", "--table", "0 2048 delay mem 0 5"]);
    assert_eq!(srv.ok("table", &["dl"]), "0 2048 delay 253:0 0 5\n");
    srv.ok("message", &["dl", "0", "set", "all", "1"]);
    assert_eq!(srv.ok("table", &["dl"]), "0 2048 delay 253:0 0 1\n");

    // Removing users first frees what they used; an empty registry says so.
    for n in ["dl", "top", "f", "s", "b", "a"] {
        srv.ok("remove", &[n]);
    }
    srv.ok("remove", &["-f", "d0"]);
    srv.ok("remove", &["mem"]);
    assert_eq!(srv.ok("ls", &[]), "No devices found\n");
    assert_eq!(srv.ok("info", &[]), "No devices found\n");
}

/// `message` takes `--control` anywhere, as every other verb does: a
/// user's first thin pool is made with it last. A word that starts with
/// `--` is a message word only after `--`.
#[test]
fn message_takes_its_options_anywhere() {
    let srv = Serve::start(STACK, "d0");
    srv.ok("create", &["dl", "--table", "0 2048 delay mem 0 5"]);
    let ctl = srv.control.to_str().unwrap();
    let run = |args: &[&str]| {
        run_bounded(
            std::process::Command::new(blkstack_bin()).args(args),
            None,
            Duration::from_secs(30),
            &format!("blkstack {args:?}"),
        )
    };
    let o = run(&["message", "dl", "0", "set", "all", "2", "--control", ctl]);
    assert!(o.status.success(), "{}{}", o.stdout, o.stderr);
    assert_eq!(srv.ok("table", &["dl"]), "0 2048 delay 253:0 0 2\n");
    let o = run(&["message", "dl", "0", "set", "--control", ctl, "all", "3"]);
    assert!(o.status.success(), "{}{}", o.stdout, o.stderr);
    assert_eq!(srv.ok("table", &["dl"]), "0 2048 delay 253:0 0 3\n");
    // After `--` everything is a message word, sent as it is: the target
    // refuses it by name, and the table is unchanged.
    let o = run(&[
        "message",
        "--control",
        ctl,
        "dl",
        "0",
        "--",
        "--control",
        "x",
        "y",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}{}", o.stdout, o.stderr);
    assert!(
        o.stderr.contains("message ioctl on dl failed"),
        "{}",
        o.stderr
    );
    assert!(o.stderr.contains("--control"), "{}", o.stderr);
    assert_eq!(srv.ok("table", &["dl"]), "0 2048 delay 253:0 0 3\n");
}

#[test]
fn reload_is_staged_until_resume() {
    let srv = Serve::start(STACK, "d0");
    let mut c = nbd_client(&srv);
    c.start().unwrap();
    assert_eq!(c.go("d0").unwrap().0, 2048 * 512);

    srv.ok("reload", &["d0", "--table", "0 1024 zero"]);
    let info = srv.ok("info", &["d0"]);
    assert!(
        info.contains("Tables present:    LIVE & INACTIVE\n"),
        "{info}"
    );
    assert_eq!(srv.ok("table", &["d0"]), "0 2048 linear 253:0 0\n");
    assert_eq!(srv.ok("table", &["--inactive", "d0"]), "0 1024 zero\n");

    srv.ok("suspend", &["d0"]);
    assert!(srv
        .ok("info", &["d0"])
        .contains("State:             SUSPENDED\n"));
    srv.ok("resume", &["d0"]);
    let info = srv.ok("info", &["d0"]);
    assert!(info.contains("State:             ACTIVE\n"), "{info}");
    assert!(info.contains("Tables present:    LIVE\n"), "{info}");
    assert!(info.contains("Event number:      1\n"), "{info}");
    assert_eq!(srv.ok("table", &["d0"]), "0 1024 zero\n");
    // mem is no longer used by d0's live table.
    assert_eq!(srv.ok("ls", &["--tree"]), "d0 (253:1)\nmem (253:0)\n");

    // clear drops a staged table.
    srv.ok("load", &["d0", "--table", "0 8 error"]);
    srv.ok("clear", &["d0"]);
    assert_eq!(srv.ok("table", &["--inactive", "d0"]), "");
    assert!(srv
        .ok("info", &["d0"])
        .contains("Tables present:    LIVE\n"));
}

#[test]
fn export_and_unexport_at_run_time() {
    let srv = Serve::start(STACK, "d0");
    let out = srv.ok("export", &["mem", "--readonly"]);
    assert_eq!(
        out,
        format!("exported mem (read-only) at {}\n", srv.uri("mem"))
    );
    let mut c = nbd_client(&srv);
    c.start().unwrap();
    let (size, flags) = c.go("mem").expect("new export is served");
    assert_eq!(size, 2048 * 512);
    assert_ne!(flags & blkstack_nbd::proto::TFLAG_READ_ONLY, 0);

    // Exported devices are open: remove refuses them without -f.
    let e = srv.fails("remove", &["mem"]);
    assert!(e.contains("Device or resource busy"), "{e}");
    let e = srv.fails("export", &["mem"]);
    assert!(e.contains("already exported"), "{e}");

    // A connected client keeps unexport from happening, unless forced.
    let e = srv.fails("unexport", &["mem"]);
    assert!(e.contains("1 client(s) connected"), "{e}");
    srv.ok("unexport", &["-f", "mem"]);
    drop(c);
    let mut fresh = nbd_client(&srv);
    fresh.start().unwrap();
    assert!(
        fresh.go("mem").is_err(),
        "an unexported device is not offered"
    );

    let e = srv.fails("unexport", &["mem"]);
    assert!(e.contains("not exported"), "{e}");
    assert!(srv.ok("info", &["mem"]).contains("Open count:        0\n"));

    // remove -f withdraws the export of d0 and removes it.
    srv.ok("remove", &["-f", "d0"]);
    let mut fresh = nbd_client(&srv);
    fresh.start().unwrap();
    assert!(fresh.go("d0").is_err());
    assert_eq!(srv.ok("ls", &[]), "mem\t(253:0)\n");
}

#[test]
fn forced_unexport_disconnects_the_client() {
    let srv = Serve::start(STACK, "d0");
    let s = UnixStream::connect(&srv.nbd_socket).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut probe = s.try_clone().unwrap();
    let mut c = RawClient::new(s);
    c.start().unwrap();
    c.go("d0").unwrap();
    srv.ok("unexport", &["--force", "d0"]);
    // The server stops reading and closes once nothing is in flight: the
    // client reads end-of-stream rather than hanging.
    let mut b = [0u8; 16];
    let n = std::io::Read::read(&mut probe, &mut b).expect("read after unexport");
    assert_eq!(n, 0, "expected the server to hang up");
    assert!(srv.ok("info", &["d0"]).contains("Open count:        0\n"));
}

#[test]
fn errors_are_clear_and_change_nothing() {
    let srv = Serve::start(STACK, "d0");
    srv.ok("create", &["top", "--table", "0 2048 linear d0 0"]);
    srv.ok("reload", &["top", "--table", "0 2048 zero"]);
    let before = srv.snapshot();

    let cases: &[(&str, &[&str], &str)] = &[
        ("info", &["nosuch"], "device-mapper: info ioctl on nosuch failed: No such device or address"),
        ("table", &["nosuch"], "No such device or address"),
        ("status", &["d0", "nosuch"], "device nosuch not found"),
        ("suspend", &["nosuch"], "device-mapper: suspend ioctl on nosuch failed"),
        ("resume", &["nosuch"], "No such device or address"),
        ("remove", &["mem"], "device-mapper: remove ioctl on mem failed: Device or resource busy: device mem is busy: used by d0"),
        ("remove", &["d0"], "used by top"),
        ("remove", &["-f", "d0"], "used by top"),
        ("create", &["d0", "--table", "0 8 zero"], "device-mapper: create ioctl on d0 failed: Device or resource busy"),
        ("create", &["bad name", "--table", "0 8 zero"], "Invalid argument"),
        ("create", &["n", "--table", "0 8 frob"], "line 1: unknown target type 'frob'"),
        ("create", &["n", "--table", "0 8 zero\n16 8 zero"], "line 2"),
        ("create", &["n", "--table", "0 8 linear nosuch 0"], "failed: No such file or directory"),
        ("create", &["--concise", "n1,,,rw,0 8 zero;n2,,,rw,0 8 bogus"], "unknown target type 'bogus'"),
        ("reload", &["d0", "--table", "0 2048 linear d0 0"], "cannot use itself"),
        ("reload", &["mem", "--table", "0 2048 linear top 0"], "cycle"),
        ("reload", &["mem", "--table", "0 1024 memory"], "shrinking"),
        ("reload", &["d0", "--table", ""], "empty table"),
        ("reload", &["nosuch", "--table", "0 8 zero"], "No such device or address"),
        ("message", &["d0", "0", "hello"], "device-mapper: message ioctl on d0 failed: Invalid argument"),
        ("message", &["d0", "99999", "hello"], "beyond the end"),
        ("deps", &["nosuch"], "device-mapper: deps ioctl on nosuch failed"),
        ("export", &["nosuch"], "No such device or address"),
        ("export", &["d0"], "already exported"),
        ("unexport", &["mem"], "mem is not exported"),
    ];
    for (verb, args, want) in cases {
        let e = srv.fails(verb, args);
        assert!(
            e.contains(want),
            "blkstack {verb} {args:?}: expected {want:?} in {e:?}"
        );
        assert!(e.starts_with("blkstack: error: "), "{e}");
        assert_eq!(e.lines().count(), 1, "one line: {e:?}");
    }
    assert_eq!(srv.snapshot(), before, "a refused change changed something");

    // Usage errors: clap's message, exit 2.
    let o = srv.run("frobnicate", &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr.contains("unrecognized subcommand 'frobnicate'"),
        "{}",
        o.stderr
    );
    let o = srv.run("message", &["d0", "notasector", "x"]);
    assert_eq!(o.status.code(), Some(2));
    let o = srv.run("create", &[]);
    assert_eq!(o.status.code(), Some(2));

    // No server at the given socket.
    let o = run_bounded(
        std::process::Command::new(blkstack_bin()).args([
            "ls",
            "--control",
            "/nonexistent/control.sock",
        ]),
        None,
        VERB_DEADLINE,
        "ls without server",
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        o.stderr.contains("is `blkstack serve` running?"),
        "{}",
        o.stderr
    );
    assert_eq!(srv.snapshot(), before);
}

#[test]
fn control_socket_is_private() {
    use std::os::unix::fs::PermissionsExt;
    let srv = Serve::start(STACK, "d0");
    let mode = std::fs::metadata(&srv.control)
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
}

#[test]
fn default_socket_is_under_xdg_runtime_dir() {
    use std::os::unix::fs::PermissionsExt;
    let srv = Serve::options()
        .args(&["--concise", STACK, "--export", "d0"])
        .control(Control::Default)
        .start();
    let dir = srv.dir.join("blkstack");
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&srv.control), 0o600);
    // A verb without --control finds it through the same variable.
    let o = run_bounded(
        std::process::Command::new(blkstack_bin())
            .arg("ls")
            .env("XDG_RUNTIME_DIR", &srv.dir),
        None,
        VERB_DEADLINE,
        "ls on the default socket",
    );
    assert!(o.status.success(), "{}", o.stderr);
    assert_eq!(o.stdout, "d0\t(253:1)\nmem\t(253:0)\n");
}
