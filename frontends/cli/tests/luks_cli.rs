//! `blkstack luks` against a running server, on an image the real
//! `cryptsetup luksFormat` made: `open` with the passphrase on standard
//! input creates the crypt device over a file leaf with the volume key
//! cryptsetup dumps; a wrong passphrase creates nothing and says why;
//! `dump` prints luksDump's text for the header fields.

use blkstack_test_support::process::tool;
use blkstack_test_support::*;
use std::process::Command;

#[test]
fn luks_open_table_and_dump_on_a_running_server() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = d.join("v.img");
    std::fs::write(d.join("key"), b"open sesame").unwrap();
    std::fs::File::create(&img)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let out = Command::new(tool("cryptsetup"))
        .args([
            "luksFormat",
            "--batch-mode",
            "--type",
            "luks1",
            "--pbkdf-force-iterations",
            "1000",
        ])
        .arg("--key-file")
        .arg(d.join("key"))
        .arg(&img)
        .output()
        .unwrap();
    assert!(out.status.success(), "luksFormat: {out:?}");
    let dump = Command::new(tool("cryptsetup"))
        .args([
            "luksDump",
            "--dump-volume-key",
            "--batch-mode",
            "--key-file",
        ])
        .arg(d.join("key"))
        .arg(&img)
        .output()
        .unwrap();
    let dump = String::from_utf8(dump.stdout).unwrap();
    let mk: String = dump
        .split("MK dump:")
        .nth(1)
        .expect("MK dump")
        .lines()
        .take(4)
        .flat_map(|l| l.split_whitespace())
        .collect();
    assert_eq!(mk.len(), 128, "{dump}");

    let srv = Serve::start("z,,,rw,0 8 zero", "z");
    let imgs = img.display().to_string();
    let bad = srv.run_stdin("luks", &["open", &imgs, "v"], Some("wrong\n"));
    assert!(!bad.status.success());
    assert!(
        bad.stderr.contains("no key available with this passphrase"),
        "{}",
        bad.stderr
    );
    assert!(
        !srv.ok("ls", &[]).contains("v_raw"),
        "a failed open left a device"
    );

    let ok = srv.run_stdin("luks", &["open", &imgs, "v"], Some("open sesame\n"));
    assert!(ok.status.success(), "{}", ok.stderr);
    let table = srv.ok("table", &["v"]);
    assert!(
        table.contains(&format!("crypt aes-xts-plain64 {mk} 0 ")),
        "{table} (want key {mk})"
    );
    assert!(srv.ok("ls", &[]).contains("v_raw"));

    let dump = Command::new(blkstack_bin())
        .args(["luks", "dump"])
        .arg(&img)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&dump.stdout);
    assert!(
        dump.status.success() && text.contains("Version:       \t1"),
        "{text}"
    );
    assert!(
        text.contains("Key Slot 0: ENABLED") && text.contains("AF stripes:            \t4000"),
        "{text}"
    );
}
