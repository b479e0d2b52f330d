//! TLS test certificates made with openssl, in the layout qemu, nbdkit
//! and libnbd share (`tls-certificates=DIR`): a CA (`ca-cert.pem`), a
//! server certificate for localhost and 127.0.0.1 (`server-*.pem`) and a
//! client certificate (`client-*.pem`). Used by the server's TLS tests
//! and by the nbd client leaf's.

#![allow(dead_code)] // each test file uses a different part

use blkstack_test_support::{run_ok, tool, Serve};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

fn openssl(dir: &Path, args: &[&str]) {
    run_ok(
        Command::new(tool("openssl")).current_dir(dir).args(args),
        LIMIT,
    );
}

/// A certificate `name`-cert.pem / `name`-key.pem signed by the CA.
fn signed(dir: &Path, name: &str, cn: &str, ext: &str) {
    let (key, csr, cert) = (
        format!("{name}-key.pem"),
        format!("{name}.csr"),
        format!("{name}-cert.pem"),
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={cn}"),
        ],
    );
    let extfile = format!("{name}.ext");
    std::fs::write(dir.join(&extfile), ext).expect("ext file");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca-cert.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            &cert,
            "-days",
            "2",
            "-extfile",
            &extfile,
        ],
    );
}

/// The qemu/libnbd layout: ca-cert.pem, server-*.pem, client-*.pem.
pub fn certificates(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca-key.pem",
            "-out",
            "ca-cert.pem",
            "-days",
            "2",
            "-subj",
            "/CN=blkstack test CA",
        ],
    );
    signed(dir, "server", "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n");
    signed(
        dir,
        "client",
        "client",
        "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n",
    );
}

/// `blkstack serve --concise STACK --export EXPORT --tls require
/// --tls-certificates CERTS EXTRA...`, the server side of every TLS test.
pub fn tls_serve(certs: &Path, stack: &str, export: &str, extra: &[&str]) -> Serve {
    let dir = certs.to_str().expect("utf-8 path");
    let mut args = vec![
        "--concise",
        stack,
        "--export",
        export,
        "--tls",
        "require",
        "--tls-certificates",
        dir,
    ];
    args.extend_from_slice(extra);
    Serve::options().args(&args).tcp().start()
}
