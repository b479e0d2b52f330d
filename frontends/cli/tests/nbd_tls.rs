//! TLS (NBD_OPT_STARTTLS) with real clients: nbdinfo and nbdcopy over
//! `nbds://` and `nbds+unix://` (libnbd's `tls-certificates=DIR`), and
//! qemu-io with a `tls-creds-x509` object. Certificates are made by
//! openssl in the test: a CA, a server certificate for localhost and
//! 127.0.0.1, and a client certificate for `--tls-verify-peer`.

mod tls_support;

use blkstack_nbd::client::RawClient;
use blkstack_nbd::proto::*;
use blkstack_test_support::*;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use tls_support::{certificates, tls_serve};

const STACK: &str = "mem,,,rw,0 8192 memory";
const LIMIT: Duration = Duration::from_secs(60);

fn tls_server(certs: &Path, extra: &[&str]) -> Serve {
    tls_serve(certs, STACK, "mem", extra)
}

fn nbdinfo(uri: &str) -> std::process::Output {
    run(Command::new(tool("nbdinfo")).arg(uri), LIMIT)
}

#[test]
fn require_serves_tls_clients_and_refuses_plain_ones() {
    let scratch = Scratch::new("tls");
    certificates(&scratch.0);
    let srv = tls_server(&scratch.0, &[]);
    let q = format!("tls-certificates={}", scratch.0.display());
    let unix = format!("nbds+unix:///mem?socket={}&{q}", srv.nbd_socket.display());
    let out = nbdinfo(&unix);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("with TLS"), "{text}");
    assert!(text.contains("export-size: 4194304"), "{text}");
    // Without TLS: refused.
    let plain = nbdinfo(&srv.uri("mem"));
    assert!(!plain.status.success(), "a plain client must be refused");

    // Data round trip over TCP with nbdcopy.
    let (src, back) = (scratch.path("src"), scratch.path("back"));
    pattern_file_with_holes(&src, 4 << 20, 7);
    let tcp = format!("nbds://{}/mem?{q}", srv.tcp_addr());
    run_ok(Command::new(tool("nbdcopy")).arg(&src).arg(&tcp), LIMIT);
    run_ok(Command::new(tool("nbdcopy")).arg(&tcp).arg(&back), LIMIT);
    assert!(
        std::fs::read(&src).expect("src") == std::fs::read(&back).expect("back"),
        "data read back over TLS differs"
    );

    // qemu-io with x509 credentials, over the Unix socket.
    let out = run_ok(
        Command::new(tool("qemu-io"))
            .arg("--object")
            .arg(format!(
                "tls-creds-x509,id=tls0,endpoint=client,dir={}",
                scratch.0.display()
            ))
            .arg("--image-opts")
            .arg(format!(
                "driver=nbd,path={},export=mem,tls-creds=tls0,tls-hostname=localhost",
                srv.nbd_socket.display()
            ))
            .args(["-c", "write -P 0x5a 1M 256k", "-c", "read -P 0x5a 1M 256k"]),
        LIMIT,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("read 262144/262144"), "{text}");
    assert!(!text.contains("Pattern verification failed"), "{text}");
}

#[test]
fn require_refuses_every_option_but_starttls_and_abort_before_tls() {
    let scratch = Scratch::new("tls-raw");
    certificates(&scratch.0);
    let srv = tls_server(&scratch.0, &[]);
    let connect = || {
        let s = UnixStream::connect(&srv.nbd_socket).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut c = RawClient::new(s);
        c.start().expect("greeting");
        c
    };
    let mut c = connect();
    for (opt, data) in [
        (OPT_LIST, &b""[..]),
        (OPT_STRUCTURED_REPLY, b""),
        (OPT_GO, &[0, 0, 0, 3, b'm', b'e', b'm', 0, 0]),
    ] {
        c.option(opt, data).expect("option");
        assert_eq!(
            c.option_reply().expect("reply").0.rep,
            REP_ERR_TLS_REQD,
            "option {opt}"
        );
    }
    c.option(OPT_ABORT, b"").expect("abort");
    assert_eq!(c.option_reply().expect("reply").0.rep, REP_ACK);
    // EXPORT_NAME cannot carry an error: the connection is dropped.
    let mut c = connect();
    c.option(OPT_EXPORT_NAME, b"mem").expect("export name");
    let mut b = [0u8; 1];
    assert!(matches!(std::io::Read::read(&mut c.s, &mut b), Ok(0)));
    // STARTTLS is acknowledged (the TLS handshake would follow).
    let mut c = connect();
    c.option(OPT_STARTTLS, b"").expect("starttls");
    assert_eq!(c.option_reply().expect("reply").0.rep, REP_ACK);
}

#[test]
fn verify_peer_needs_a_client_certificate_from_the_ca() {
    let scratch = Scratch::new("tls-peer");
    certificates(&scratch.0);
    let srv = tls_server(&scratch.0, &["--tls-verify-peer"]);
    // With the client certificate in the directory: served.
    let uri = |dir: &Path| {
        format!(
            "nbds+unix:///mem?socket={}&tls-certificates={}",
            srv.nbd_socket.display(),
            dir.display()
        )
    };
    let out = nbdinfo(&uri(&scratch.0));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Only the CA: no client certificate, refused.
    let bare = Scratch::new("tls-bare");
    std::fs::copy(scratch.path("ca-cert.pem"), bare.path("ca-cert.pem")).expect("copy ca");
    let out = nbdinfo(&uri(&bare.0));
    assert!(
        !out.status.success(),
        "a client without a certificate must be refused"
    );
}

/// fio's nbd engine cannot pass `tls-certificates=` (libnbd refuses a URI's
/// local file access unless the program allows it, and fio does not), so
/// it finds the certificates where libnbd looks by default,
/// `$HOME/.pki/libnbd`: a verified write workload over `nbds+unix://`.
#[test]
fn fio_nbd_engine_verifies_writes_over_tls() {
    let home = Scratch::new("tls-home");
    let certs = home.path(".pki/libnbd");
    std::fs::create_dir_all(&certs).expect("certificates dir");
    certificates(&certs);
    let srv = tls_server(&certs, &[]);
    let uri = format!("nbds+unix:///mem?socket={}", srv.nbd_socket.display());
    let out = run(
        Command::new(tool("fio"))
            .env("HOME", &home.0)
            // Small blocks (copied into the reply) and large ones (sent
            // from their slots, encrypted by rustls from the slot).
            .args(["--name=tls", "--ioengine=nbd", "--rw=randwrite"])
            .args([
                "--bssplit=4k/50:256k/50",
                "--size=4m",
                "--iodepth=8",
                "--verify=crc32c",
                "--verify_state_save=0",
                "--output-format=json",
            ])
            .current_dir(&home.0)
            .arg(format!("--uri={uri}")),
        LIMIT,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = &text[text.find('{').expect("fio JSON")..];
    let job = &serde_json::from_str::<serde_json::Value>(json).expect("fio JSON")["jobs"][0];
    assert_eq!(job["error"], 0, "{json}");
    assert_eq!(job["write"]["io_bytes"], 4 << 20, "{json}");
    // Verification read everything back.
    assert_eq!(job["read"]["io_bytes"], 4 << 20, "{json}");
    // The same fio without TLS is refused by `--tls=require`.
    let plain = run(
        Command::new(tool("fio"))
            .env("HOME", &home.0)
            .args(["--name=plain", "--ioengine=nbd", "--rw=read", "--size=64k"])
            .current_dir(&home.0)
            .arg(format!("--uri={}", srv.uri("mem"))),
        LIMIT,
    );
    assert!(!plain.status.success(), "plain fio must be refused");
}
