//! The verity target over memory devices holding a tree built by
//! [`super::format`]: reads pass, a flipped byte in the data or in the
//! tree fails the read with EIO and turns `status` to `C`, and the
//! options and refusals behave as dm-verity-target.c's.

use super::format::{self, hex, BlockIo, Params};
use super::tree::HashAlg;
use crate::Registry;
use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Op, Status};
use std::io;
use std::sync::Arc;

/// A registry device as a [`BlockIo`].
struct DevIo<'a>(&'a Registry, &'a str);
impl BlockIo for DevIo<'_> {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let d = self.0.device(self.1).map_err(io::Error::other)?;
        match submit_and_wait(&*d, Op::Read, off, buf.len() as u64, buf) {
            Status::Ok => Ok(()),
            st => Err(io::Error::from_raw_os_error(st.errno())),
        }
    }
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        let d = self.0.device(self.1).map_err(io::Error::other)?;
        let mut b = buf.to_vec();
        match submit_and_wait(&*d, Op::Write, off, b.len() as u64, &mut b) {
            Status::Ok => Ok(()),
            st => Err(io::Error::from_raw_os_error(st.errno())),
        }
    }
}

fn read(reg: &Registry, dev: &str, off: u64, len: usize) -> (Status, Vec<u8>) {
    let d = reg.device(dev).unwrap();
    let mut b = vec![0u8; len];
    let st = submit_and_wait(&*d, Op::Read, off, len as u64, &mut b);
    (st, b)
}

fn flip(reg: &Registry, dev: &str, off: u64) {
    let io = DevIo(reg, dev);
    let mut b = [0u8; 512];
    let at = off / 512 * 512;
    io.read_at(&mut b, at).unwrap();
    b[(off - at) as usize] ^= 0x40;
    io.write_at(&b, at).unwrap();
}

const BLOCKS: u64 = 256;
const SALT: [u8; 4] = [0, 0x11, 0x22, 0x33];

/// Data `d` (1 MiB of pattern, block 7 zeroes), hash `h` with a tree and
/// a superblock; returns the table line's arguments after `verity`.
fn setup() -> (Arc<Registry>, Vec<u8>, String) {
    let reg = Registry::new();
    reg.create("d", "0 2048 memory").unwrap();
    reg.create("h", "0 64 memory").unwrap();
    let mut data: Vec<u8> = (0..BLOCKS * 4096).map(|i| (i * 13 % 253) as u8).collect();
    data[7 * 4096..8 * 4096].fill(0);
    DevIo(&reg, "d").write_at(&data, 0).unwrap();
    let p = Params {
        version: 1,
        alg: HashAlg::Sha256,
        data_block_size: 4096,
        hash_block_size: 4096,
        data_blocks: BLOCKS,
        hash_offset: 0,
        salt: SALT.to_vec(),
        uuid: Some([1; 16]),
    };
    let root = format::format(&p, &DevIo(&reg, "d"), &DevIo(&reg, "h")).unwrap();
    let args = format!(
        "1 d h 4096 4096 {BLOCKS} 1 sha256 {} {}",
        hex(&root),
        hex(&SALT)
    );
    (reg, data, args)
}

fn create(reg: &Registry, args: &str) {
    let _ = reg.remove("v", false);
    reg.create("v", &format!("0 2048 verity {args}")).unwrap();
}

#[test]
fn reads_pass_and_a_flipped_data_or_hash_byte_fails_with_eio() {
    let (reg, data, args) = setup();
    create(&reg, &args);
    let (st, got) = read(&reg, "v", 0, data.len());
    assert_eq!(st, Status::Ok);
    assert!(got == data, "the verified read differs from the data");
    assert_eq!(reg.status_text("v").unwrap(), "0 2048 verity V\n");
    let dm = reg.info("d").unwrap().minor;
    let hm = reg.info("h").unwrap().minor;
    assert_eq!(
        reg.table_text("v").unwrap(),
        format!(
            "0 2048 verity {}\n",
            args.replacen("d h", &format!("253:{dm} 253:{hm}"), 1)
        )
    );
    // A byte of data block 5.
    flip(&reg, "d", 5 * 4096 + 100);
    assert_eq!(read(&reg, "v", 5 * 4096, 4096).0, Status::IoError);
    assert_eq!(read(&reg, "v", 4 * 4096, 8192).0, Status::IoError);
    assert_eq!(read(&reg, "v", 6 * 4096, 4096).0, Status::Ok);
    assert_eq!(reg.status_text("v").unwrap(), "0 2048 verity C\n");
    flip(&reg, "d", 5 * 4096 + 100);
    // A byte of the level-0 block of data blocks 128..256 (hash block
    // 3), seen by a fresh target (the old one cached it verified).
    flip(&reg, "h", 3 * 4096 + 5);
    create(&reg, &args);
    assert_eq!(read(&reg, "v", 0, 4096).0, Status::Ok);
    assert_eq!(read(&reg, "v", 200 * 4096, 4096).0, Status::IoError);
    assert_eq!(reg.status_text("v").unwrap(), "0 2048 verity C\n");
    // Writes never reach the data device.
    let d = reg.device("v").unwrap();
    let mut b = vec![0u8; 4096];
    assert_eq!(
        submit_and_wait(&*d, Op::Write, 0, 4096, &mut b),
        Status::Permission
    );
    // Misaligned reads fail as `verity_map`'s "unaligned io".
    assert_eq!(read(&reg, "v", 512, 4096).0, Status::IoError);
}

#[test]
fn options_change_what_a_corrupt_block_does() {
    let (reg, data, args) = setup();
    flip(&reg, "d", 9 * 4096);
    create(&reg, &format!("{args} 1 ignore_corruption"));
    let (st, got) = read(&reg, "v", 9 * 4096, 4096);
    assert_eq!(st, Status::Ok);
    assert_eq!(got[1..], data[9 * 4096 + 1..10 * 4096]);
    assert_eq!(reg.status_text("v").unwrap(), "0 2048 verity C\n");
    flip(&reg, "d", 9 * 4096);

    // check_at_most_once: a block verified once is not hashed again.
    create(&reg, &format!("{args} 1 check_at_most_once"));
    assert_eq!(read(&reg, "v", 0, 64 * 4096).0, Status::Ok);
    flip(&reg, "d", 3 * 4096);
    assert_eq!(read(&reg, "v", 3 * 4096, 4096).0, Status::Ok);
    assert_eq!(read(&reg, "v", 70 * 4096, 4096).0, Status::Ok);
    flip(&reg, "d", 70 * 4096);
    assert_eq!(read(&reg, "v", 71 * 4096, 4096).0, Status::Ok);
    flip(&reg, "d", 3 * 4096);

    // ignore_zero_blocks: block 7 has the zero block's digest, so it
    // reads as zeroes whatever the data device holds.
    flip(&reg, "d", 7 * 4096 + 1);
    create(
        &reg,
        &format!("{args} 2 IGNORE_ZERO_BLOCKS try_verify_in_tasklet"),
    );
    let (st, got) = read(&reg, "v", 7 * 4096, 4096);
    assert_eq!((st, got.iter().all(|&b| b == 0)), (Status::Ok, true));
    assert!(reg
        .table_text("v")
        .unwrap()
        .ends_with(" 2 ignore_zero_blocks try_verify_in_tasklet\n"));

    // restart_on_corruption: where the kernel restarts, the target stops.
    create(
        &reg,
        &format!("{args} 2 restart_on_corruption panic_on_error"),
    );
    assert_eq!(read(&reg, "v", 0, 4096).0, Status::Ok);
    assert_eq!(read(&reg, "v", 7 * 4096, 4096).0, Status::IoError);
    assert_eq!(read(&reg, "v", 0, 4096).0, Status::IoError);
    assert!(reg
        .table_text("v")
        .unwrap()
        .ends_with(" 2 restart_on_corruption panic_on_error\n"));
}

#[test]
fn bad_tables_are_refused_with_the_kernels_words() {
    let (reg, _, args) = setup();
    let w: Vec<&str> = args.split(' ').collect();
    let with = |i: usize, v: &str| {
        let mut w = w.clone();
        w[i] = v;
        w.join(" ")
    };
    let cases = [
        ("1 d h 4096", "Not enough arguments".to_string()),
        (&*with(0, "2"), "Invalid version".into()),
        (&*with(1, "nope"), "Data device lookup failed".into()),
        (&*with(2, "nope"), "Hash device lookup failed".into()),
        (&*with(3, "8192"), "Invalid data device block size".into()),
        (&*with(3, "1000"), "Invalid data device block size".into()),
        (&*with(4, "256"), "Invalid hash device block size".into()),
        (&*with(5, "x"), "Invalid data blocks".into()),
        (&*with(5, "255"), "Data device is too small".into()),
        (&*with(6, "-1"), "Invalid hash start".into()),
        (&*with(7, "md5"), "Cannot initialize hash function".into()),
        (&*with(8, "abcd"), "Invalid root digest".into()),
        (&*with(9, "abc"), "Invalid salt".into()),
        (&*with(6, "60"), "Hash device is too small".into()),
        (
            &format!("{args} 2 x"),
            "Invalid number of feature args".into(),
        ),
        (
            &format!("{args} 1 bogus"),
            "Unrecognized verity feature request".into(),
        ),
        (
            &format!("{args} 2 ignore_corruption panic_on_corruption"),
            "Conflicting error handling parameters".into(),
        ),
        (
            &format!("{args} 2 use_fec_from_device h"),
            "forward error correction".into(),
        ),
        (
            &format!("{args} 2 root_hash_sig_key_desc k"),
            "keyring".into(),
        ),
    ];
    for (a, want) in cases {
        let e = reg
            .create("bad", &format!("0 2048 verity {a}"))
            .map(|_| ())
            .unwrap_err()
            .report();
        assert!(e.contains(&want), "table '{a}': {e}");
        assert!(reg.device("bad").is_err(), "'{a}' left a device");
    }
}

#[test]
fn a_leg_error_fails_the_read_and_restart_on_error_stops_the_target() {
    let (reg, _, args) = setup();
    // Data block 5 of the data device fails reads (dust, enabled).
    reg.create("dd", "0 2048 dust d 0 4096").unwrap();
    reg.message("dd", 0, &["addbadblock", "5"]).unwrap();
    reg.message("dd", 0, &["enable"]).unwrap();
    let args = args.replacen("1 d h", "1 dd h", 1);
    create(&reg, &args);
    assert_eq!(read(&reg, "v", 5 * 4096, 4096).0, Status::IoError);
    assert_eq!(read(&reg, "v", 6 * 4096, 4096).0, Status::Ok);
    // An I/O error is not corruption.
    assert_eq!(reg.status_text("v").unwrap(), "0 2048 verity V\n");
    create(&reg, &format!("{args} 1 restart_on_error"));
    assert_eq!(read(&reg, "v", 6 * 4096, 4096).0, Status::Ok);
    assert_eq!(read(&reg, "v", 5 * 4096, 4096).0, Status::IoError);
    assert_eq!(read(&reg, "v", 6 * 4096, 4096).0, Status::IoError);
    assert_eq!(reg.status_text("v").unwrap(), "0 2048 verity V\n");
}

#[test]
fn concurrent_readers_all_get_verified_data() {
    let (reg, data, args) = setup();
    create(&reg, &args);
    let data = Arc::new(data);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (reg, data) = (&reg, data.clone());
            s.spawn(move || {
                let mut x = t + 1;
                for _ in 0..200 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let b = (x >> 33) % (BLOCKS - 4);
                    let n = 1 + (x >> 20) % 4;
                    let at = (b * 4096) as usize;
                    let (st, got) = read(reg, "v", b * 4096, (n * 4096) as usize);
                    assert_eq!(st, Status::Ok, "block {b}+{n}");
                    assert!(got == data[at..at + got.len()], "block {b}+{n} differs");
                }
            });
        }
    });
    assert_eq!(reg.status_text("v").unwrap(), "0 2048 verity V\n");
}

/// A data block size different from the hash block size (both ways, as
/// veritysetup's `--data-block-size`/`--hash-block-size` allow): every
/// read verifies, a flipped data byte fails exactly the reads of its
/// data block, a flipped digest fails the data blocks it covers.
#[test]
fn data_and_hash_block_sizes_may_differ() {
    for (dbs, hbs) in [(512u64, 4096u64), (4096, 1024), (1024, 512)] {
        let reg = Registry::new();
        reg.create("d", "0 2048 memory").unwrap();
        reg.create("h", "0 256 memory").unwrap();
        let data: Vec<u8> = (0..1u64 << 20).map(|i| (i * 7 % 251) as u8).collect();
        DevIo(&reg, "d").write_at(&data, 0).unwrap();
        let blocks = (1 << 20) / dbs;
        let p = Params {
            version: 1,
            alg: HashAlg::Sha256,
            data_block_size: dbs as u32,
            hash_block_size: hbs as u32,
            data_blocks: blocks,
            hash_offset: 0,
            salt: SALT.to_vec(),
            uuid: Some([1; 16]),
        };
        let root = format::format(&p, &DevIo(&reg, "d"), &DevIo(&reg, "h")).unwrap();
        let args = format!(
            "1 d h {dbs} {hbs} {blocks} {} sha256 {} {}",
            p.hash_start(),
            hex(&root),
            hex(&SALT)
        );
        create(&reg, &args);
        let what = format!("data block {dbs}, hash block {hbs}");
        let (st, got) = read(&reg, "v", 0, data.len());
        assert_eq!(st, Status::Ok, "{what}");
        assert!(got == data, "{what}: the verified read differs");
        let b = blocks / 3;
        flip(&reg, "d", b * dbs + dbs / 2);
        create(&reg, &args);
        let io = dbs.max(4096);
        let around = b * dbs / io * io;
        assert_eq!(
            read(&reg, "v", around, io as usize).0,
            Status::IoError,
            "{what}"
        );
        let next = (b + 1) * dbs;
        let later = next.div_ceil(io) * io;
        assert_eq!(read(&reg, "v", later, io as usize).0, Status::Ok, "{what}");
        assert_eq!(reg.status_text("v").unwrap(), "0 2048 verity C\n", "{what}");
        flip(&reg, "d", b * dbs + dbs / 2);
        // A byte of data block 0's digest.
        let (block, at) = p.geometry().unwrap().hash_at_level(0, 0);
        flip(&reg, "h", block * hbs + at as u64 + 3);
        create(&reg, &args);
        assert_eq!(
            read(&reg, "v", 0, dbs as usize).0,
            Status::IoError,
            "{what}"
        );
        assert_eq!(reg.status_text("v").unwrap(), "0 2048 verity C\n", "{what}");
    }
}
