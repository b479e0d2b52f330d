//! LUKS images made by the real `cryptsetup luksFormat` (LUKS1 with
//! PBKDF2, LUKS2 with argon2id and with PBKDF2): blkstack unlocks the same
//! volume key `cryptsetup luksDump --dump-volume-key` prints, prints the
//! luksDump fields it knows as cryptsetup does, refuses a wrong
//! passphrase and corrupt headers by name, and serves the plaintext
//! through its crypt table over the image. Low KDF costs keep it fast.

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Op, Status};
use blkstack_mapped::luks::{self, LuksError};
use blkstack_mapped::Registry;
use blkstack_test_support::process::tool;
use std::path::{Path, PathBuf};
use std::process::Command;

const PASS: &[u8] = b"correct horse";

fn format(dir: &Path, name: &str, args: &[&str]) -> PathBuf {
    let img = dir.join(name);
    let key = dir.join("key");
    std::fs::write(&key, PASS).unwrap();
    std::fs::File::create(&img)
        .unwrap()
        .set_len(24 << 20)
        .unwrap();
    let out = Command::new(tool("cryptsetup"))
        .args(["luksFormat", "--batch-mode", "--key-file"])
        .arg(&key)
        .args(args)
        .arg(&img)
        .output()
        .unwrap();
    assert!(out.status.success(), "luksFormat: {out:?}");
    img
}

fn cryptsetup_dump(dir: &Path, img: &Path, volume_key: bool) -> String {
    let mut c = Command::new(tool("cryptsetup"));
    c.arg("luksDump");
    if volume_key {
        c.args(["--dump-volume-key", "--batch-mode", "--key-file"])
            .arg(dir.join("key"));
    }
    let out = c.arg(img).output().unwrap();
    assert!(out.status.success(), "luksDump: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// The volume key cryptsetup prints ("MK dump:" and continuation lines).
fn cryptsetup_key(dump: &str) -> Vec<u8> {
    let mut hex = String::new();
    let mut on = false;
    for l in dump.lines() {
        if let Some(rest) = l.strip_prefix("MK dump:") {
            on = true;
            hex.push_str(rest);
        } else if on && l.starts_with('\t') {
            hex.push_str(l);
        } else {
            on = false;
        }
    }
    let hex: String = hex.split_whitespace().collect();
    hex::decode(hex).unwrap()
}

fn words(s: &str) -> Vec<String> {
    s.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|l| !l.is_empty())
        .collect()
}

fn check_image(dir: &Path, img: &Path) {
    let u = luks::unlock(img, PASS).unwrap_or_else(|e| panic!("{}: {e}", img.display()));
    let theirs = cryptsetup_dump(dir, img, true);
    assert_eq!(
        *u.key,
        cryptsetup_key(&theirs),
        "{}: volume key",
        img.display()
    );
    // Every line blkstack's dump prints is one cryptsetup's prints.
    let theirs = words(&cryptsetup_dump(dir, img, false));
    for line in words(&luks::dump(&u.header)) {
        if line.starts_with("LUKS header information") {
            continue;
        }
        assert!(
            theirs.contains(&line),
            "{}: '{line}' not in {theirs:#?}",
            img.display()
        );
    }
    assert!(matches!(
        luks::unlock(img, b"wrong"),
        Err(LuksError::BadPassphrase)
    ));
    // The plaintext through blkstack's crypt table over the image.
    let reg = Registry::new();
    let size = std::fs::metadata(img).unwrap().len();
    reg.create("leg", &format!("0 {} file {}", size / 512, img.display()))
        .unwrap();
    let sectors = u.sectors(size);
    reg.create("v", &format!("0 {sectors} crypt {}", u.crypt_args("leg")))
        .unwrap_or_else(|e| panic!("{}", e.report()));
    let v = reg.device("v").unwrap();
    let data: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
    let mut buf = data.clone();
    assert_eq!(
        submit_and_wait(&*v, Op::Write, 1 << 20, 65536, &mut buf),
        Status::Ok
    );
    let mut back = vec![0u8; 65536];
    assert_eq!(
        submit_and_wait(&*v, Op::Read, 1 << 20, 65536, &mut back),
        Status::Ok
    );
    assert_eq!(back, data);
    reg.remove_all();
    // The same volume from a stack file line.
    let key = dir.join("key").display().to_string();
    let stack = format!("# a LUKS volume\nvol: --luks {} {key}\n", img.display());
    reg.create_stack(&stack)
        .unwrap_or_else(|e| panic!("{}", e.report()));
    let vol = reg.device("vol").unwrap();
    let mut again = vec![0u8; 65536];
    assert_eq!(
        submit_and_wait(&*vol, Op::Read, 1 << 20, 65536, &mut again),
        Status::Ok
    );
    assert_eq!(
        again, data,
        "the stack file's --luks line opens the same volume"
    );
    reg.remove_all();
    let bad = format!(
        "vol: --luks {} {}\n",
        img.display(),
        dir.join("nosuch").display()
    );
    let e = match reg.create_stack(&bad) {
        Ok(_) => panic!("a missing key file was accepted"),
        Err(e) => e.report(),
    };
    assert!(e.contains("--luks: key file"), "{e}");
}

#[test]
fn cryptsetup_images_unlock_to_the_same_key() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let l1 = format(
        d,
        "l1.img",
        &["--type", "luks1", "--pbkdf-force-iterations", "1000"],
    );
    check_image(d, &l1);
    let l2 = format(
        d,
        "l2.img",
        &[
            "--type",
            "luks2",
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "32768",
            "--pbkdf-force-iterations",
            "4",
        ],
    );
    check_image(d, &l2);
    let l2p = format(
        d,
        "l2p.img",
        &[
            "--type",
            "luks2",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--cipher",
            "aes-cbc-essiv:sha256",
            "--key-size",
            "256",
            "--sector-size",
            "512",
        ],
    );
    check_image(d, &l2p);
}

fn patched(src: &Path, dst: &Path, at: u64, bytes: &[u8]) {
    let mut img = std::fs::read(src).unwrap();
    img[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
    std::fs::write(dst, img).unwrap();
}

#[test]
fn hostile_headers_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let l1 = format(
        d,
        "l1.img",
        &["--type", "luks1", "--pbkdf-force-iterations", "1000"],
    );
    let bad = d.join("bad.img");
    let err = |p: &Path| luks::read_header(p).unwrap_err().to_string();
    // Stripes of slot 0 (offset 208 + 44) made huge.
    patched(&l1, &bad, 252, &u32::MAX.to_be_bytes());
    assert!(err(&bad).contains("AF stripes"), "{}", err(&bad));
    // Key material offset past the image.
    patched(&l1, &bad, 248, &0x00ff_ffffu32.to_be_bytes());
    assert!(err(&bad).contains("outside"), "{}", err(&bad));
    // A slot state that is neither active nor inactive.
    patched(&l1, &bad, 208, &[1, 2, 3, 4]);
    assert!(err(&bad).contains("state"), "{}", err(&bad));
    // Key size 0.
    patched(&l1, &bad, 108, &[0, 0, 0, 0]);
    assert!(err(&bad).contains("key size"), "{}", err(&bad));
    patched(&l1, &bad, 0, b"XXXX");
    assert!(matches!(luks::read_header(&bad), Err(LuksError::NotLuks)));

    let l2 = format(
        d,
        "l2.img",
        &[
            "--type",
            "luks2",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ],
    );
    // The primary JSON changed: its checksum fails and the secondary copy
    // (same contents) is used.
    patched(&l2, &bad, 4096 + 10, b"#");
    let h = luks::read_header(&bad).unwrap();
    assert_eq!(h.version, 2);
    assert!(luks::unlock(&bad, PASS).is_ok());
    // Both copies changed: refused naming the checksum.
    let mut img = std::fs::read(&bad).unwrap();
    img[16384 + 4096 + 10] = b'#';
    std::fs::write(&bad, img).unwrap();
    assert!(err(&bad).contains("checksum"), "{}", err(&bad));
}
