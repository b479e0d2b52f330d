//! blkstack's dm-verity trees beside cryptsetup's `veritysetup` on the
//! host: a tree `veritysetup format` built is accepted by `blkstack
//! verity verify` and read through blkstack's `verity` target; `blkstack
//! verity format` builds the same hash device byte for byte (same salt
//! and UUID) and the same root, which `veritysetup verify` accepts; a
//! flipped byte in the data and one in the hash device are caught by
//! both tools and by the target (EIO, status `C`).

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Op, Status};
use blkstack_mapped::Registry;
use blkstack_test_support::{pattern_file, tool};
use std::path::Path;
use std::process::{Command, Output};

const UUID: &str = "6bde2796-cc72-4b48-85fa-d3d6e4842be2";
const SALT: &str = "00112233445566778899";
/// 4 MiB of data: 1024 blocks, two levels of sha256 in 4 KiB blocks.
const DATA_LEN: usize = 4 << 20;

fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("start the command")
}

fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn veritysetup(args: &[&str]) -> Output {
    run(Command::new(tool("veritysetup")).args(args))
}

fn blkstack(args: &[&str]) -> Output {
    run(Command::new(env!("CARGO_BIN_EXE_blkstack")).args(args))
}

fn root_of(report: &str) -> String {
    report
        .lines()
        .find_map(|l| l.strip_prefix("Root hash:"))
        .map(|r| r.trim().to_string())
        .unwrap_or_else(|| panic!("no root hash in:\n{report}"))
}

fn p(dir: &Path, name: &str) -> String {
    dir.join(name).display().to_string()
}

fn flip(path: &str, off: u64) {
    let mut b = std::fs::read(path).unwrap();
    b[off as usize] ^= 0x01;
    std::fs::write(path, b).unwrap();
}

/// blkstack's `verity` target over the two files, in this process:
/// the status after reading `blocks` (data block numbers), and each
/// read's status.
fn target_reads(data: &str, hash: &str, root: &str, blocks: &[u64]) -> (Vec<Status>, String) {
    let reg = Registry::new();
    let hash_sectors = std::fs::metadata(hash).unwrap().len() / 512;
    reg.create("d", &format!("0 {} file {data}", DATA_LEN / 512))
        .unwrap();
    reg.create("h", &format!("0 {hash_sectors} file {hash}"))
        .unwrap();
    reg.create(
        "v",
        &format!(
            "0 {} verity 1 d h 4096 4096 {} 1 sha256 {root} {SALT}",
            DATA_LEN / 512,
            DATA_LEN / 4096
        ),
    )
    .unwrap();
    let v = reg.device("v").unwrap();
    let want = std::fs::read(data).unwrap();
    let mut got = Vec::new();
    for &b in blocks {
        let mut buf = vec![0u8; 4096];
        let st = submit_and_wait(&*v, Op::Read, b * 4096, 4096, &mut buf);
        if st == Status::Ok {
            let at = b as usize * 4096;
            assert!(buf == want[at..at + 4096], "block {b} read wrong data");
        }
        got.push(st);
    }
    let status = reg.status_text("v").unwrap();
    reg.remove_all();
    (got, status)
}

#[test]
fn trees_match_veritysetups_and_corruption_is_caught_by_both() {
    let dir = tempfile::tempdir().unwrap();
    let data = p(dir.path(), "data.img");
    pattern_file(Path::new(&data), DATA_LEN, 38);
    let (theirs, ours) = (p(dir.path(), "theirs.hash"), p(dir.path(), "ours.hash"));
    let common = ["--salt", SALT, "--uuid", UUID];

    // Theirs, read by us.
    let report = ok(
        &veritysetup(&[&["format", &data, &theirs][..], &common].concat()),
        "veritysetup format",
    );
    let root = root_of(&report);
    ok(
        &blkstack(&["verity", "verify", &data, &theirs, &root]),
        "blkstack verity verify (veritysetup's tree)",
    );
    let all: Vec<u64> = (0..1024).step_by(37).chain([1023]).collect();
    let (st, status) = target_reads(&data, &theirs, &root, &all);
    assert!(st.iter().all(|s| *s == Status::Ok), "{st:?}");
    assert_eq!(status, format!("0 {} verity V\n", DATA_LEN / 512));

    // Ours, the same bytes, and read by them.
    let mine = ok(
        &blkstack(&[&["verity", "format", &data, &ours][..], &common].concat()),
        "blkstack verity format",
    );
    assert_eq!(mine.replace(&ours, &theirs), report);
    assert!(
        std::fs::read(&ours).unwrap() == std::fs::read(&theirs).unwrap(),
        "blkstack's hash device differs from veritysetup's"
    );
    ok(
        &veritysetup(&["verify", &data, &ours, &root]),
        "veritysetup verify (blkstack's tree)",
    );
    ok(
        &blkstack(&["verity", "dump", &ours]),
        "blkstack verity dump",
    );

    // Bad input is refused by name, and a wrong root is not taken.
    let wrong = format!("{}0", &root[..63]);
    for (args, want) in [
        (
            vec!["verify", &data, &ours, &wrong],
            "Verification of root hash failed",
        ),
        (
            vec!["verify", &data, &ours, "xyz"],
            "invalid root hash 'xyz'",
        ),
        (vec!["dump", &data], "no verity superblock"),
        (
            vec!["format", &data, &ours, "--hash", "md5"],
            "hash algorithm 'md5' not supported",
        ),
        (
            vec!["format", &data, &ours, "--salt", "0g"],
            "invalid salt '0g'",
        ),
        (
            vec!["format", &data, &ours, "--hash-block-size", "1000"],
            "Invalid block size",
        ),
    ] {
        let out = blkstack(&[&["verity"][..], &args].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{args:?}: {err}"
        );
    }
    assert!(
        std::fs::read(&ours).unwrap() == std::fs::read(&theirs).unwrap(),
        "a refused format changed the hash device"
    );
    let never = p(dir.path(), "never.hash");
    assert!(
        !blkstack(&["verity", "format", &data, &never, "--format", "2"])
            .status
            .success()
    );
    assert!(
        !Path::new(&never).exists(),
        "a refused format made its hash file"
    );

    // A flipped data byte (block 300), then a flipped digest (block 1's,
    // in the first level-0 hash block: hash block 2).
    let bad = p(dir.path(), "bad.img");
    std::fs::copy(&data, &bad).unwrap();
    flip(&bad, 300 * 4096 + 17);
    assert!(!veritysetup(&["verify", &bad, &ours, &root])
        .status
        .success());
    assert!(!blkstack(&["verity", "verify", &bad, &ours, &root])
        .status
        .success());
    let (st, status) = target_reads(&bad, &ours, &root, &[299, 300, 301]);
    assert_eq!(st, [Status::Ok, Status::IoError, Status::Ok]);
    assert!(status.ends_with(" verity C\n"), "{status}");

    flip(&ours, 2 * 4096 + 40);
    assert!(!veritysetup(&["verify", &data, &ours, &root])
        .status
        .success());
    let e = blkstack(&["verity", "verify", &data, &ours, &root]);
    assert!(!e.status.success());
    assert!(
        String::from_utf8_lossy(&e.stderr).contains("Verification failed at position 8224"),
        "{}",
        String::from_utf8_lossy(&e.stderr)
    );
    // The whole hash block fails its digest: every data block under it
    // fails (blocks 0..128), the rest read.
    let (st, status) = target_reads(&data, &ours, &root, &[200, 0, 1]);
    assert_eq!(st, [Status::Ok, Status::IoError, Status::IoError]);
    assert!(status.ends_with(" verity C\n"), "{status}");
}

/// The other layouts veritysetup makes: format 0 with sha1 and no
/// superblock, small blocks at a hash offset, sha512 over one block.
#[test]
fn other_layouts_are_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let data = p(dir.path(), "data.img");
    pattern_file(Path::new(&data), 1 << 20, 7);
    let layouts: [&[&str]; 4] = [
        &[
            "--no-superblock",
            "--format",
            "0",
            "--hash",
            "sha1",
            "--salt",
            "-",
            "--data-blocks",
            "100",
        ],
        &[
            "--hash-offset",
            "8192",
            "--salt",
            "01",
            "--hash-block-size",
            "1024",
            "--data-block-size",
            "512",
        ],
        &["--hash", "sha512", "--salt", "aa", "--data-blocks", "1"],
        &["--hash-block-size", "512", "--salt", "-"],
    ];
    for (i, args) in layouts.iter().enumerate() {
        let (theirs, ours) = (
            p(dir.path(), &format!("t{i}")),
            p(dir.path(), &format!("o{i}")),
        );
        fn with<'a>(data: &'a str, hash: &'a str, args: &[&'a str]) -> Vec<&'a str> {
            [&["format", data, hash][..], args, &["--uuid", UUID]].concat()
        }
        let report = ok(
            &veritysetup(&with(&data, &theirs, args)),
            "veritysetup format",
        );
        let mut mine_args = vec!["verity"];
        mine_args.extend(with(&data, &ours, args));
        let mine = ok(&blkstack(&mine_args), "blkstack verity format");
        assert_eq!(mine.replace(&ours, &theirs), report, "{args:?}");
        assert!(
            std::fs::read(&ours).unwrap() == std::fs::read(&theirs).unwrap(),
            "{args:?}: hash devices differ"
        );
    }
}
