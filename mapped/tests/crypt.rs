//! The crypt target as a user drives it: what goes down is ciphertext
//! the caller's buffer never sees, it reads back as written, the table,
//! status and key messages are dm-crypt's, and bad tables are refused
//! naming the kernel's reason. The kernel's dm-crypt judges the
//! ciphertext itself (frontends/cli/tests/data/kernel-parity/cross.txt).

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Device, Op, Status};
use blkstack_mapped::Registry;
use std::sync::Arc;

const KEY64: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\
                     202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f";

fn setup() -> Arc<Registry> {
    let reg = Registry::new();
    reg.create("m", "0 8192 memory").unwrap();
    reg
}

fn rw(dev: &dyn Device, op: Op, off: u64, buf: &mut [u8]) -> Status {
    let len = buf.len() as u64;
    submit_and_wait(dev, op, off, len, buf)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn every_cipher_round_trips_and_hides_the_data() {
    let reg = setup();
    let m = reg.device("m").unwrap();
    for (i, (cipher, key)) in [
        ("aes-xts-plain64", KEY64),
        ("aes-xts-plain64", &KEY64[..64]),
        ("capi:xts(aes)-plain64", KEY64),
        ("aes-xts-plain", KEY64),
        ("aes-cbc-essiv:sha256", &KEY64[..64]),
        ("capi:cbc(aes)-essiv:sha256", &KEY64[..32]),
        ("aes-cbc-plain64", &KEY64[..48]),
        ("aes-cbc-plain64be", &KEY64[..32]),
        ("aes-cbc-null", &KEY64[..32]),
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("c{i}");
        reg.create(&name, &format!("0 4096 crypt {cipher} {key} 7 m 8"))
            .unwrap_or_else(|e| panic!("{cipher}: {}", e.report()));
        let c = reg.device(&name).unwrap();
        let plain = pattern(8192, i as u8);
        let mut buf = plain.clone();
        assert_eq!(rw(&*c, Op::Write, 4096, &mut buf), Status::Ok);
        assert_eq!(buf, plain, "{cipher}: the caller's buffer was changed");
        let mut under = vec![0u8; 8192];
        assert_eq!(rw(&*m, Op::Read, 4096 + 8 * 512, &mut under), Status::Ok);
        assert_ne!(under, plain, "{cipher}: plaintext reached the device");
        let mut back = vec![0u8; 8192];
        assert_eq!(rw(&*c, Op::Read, 4096, &mut back), Status::Ok);
        assert_eq!(back, plain, "{cipher}: read back");
        // A sector read alone decrypts with its own IV.
        let mut one = vec![0u8; 512];
        assert_eq!(rw(&*c, Op::Read, 4096 + 3 * 512, &mut one), Status::Ok);
        assert_eq!(one, plain[3 * 512..4 * 512], "{cipher}: one sector");
        reg.remove(&name, false).unwrap();
    }
}

#[test]
fn null_cipher_passes_data_unchanged() {
    let reg = setup();
    reg.create("n", "0 4096 crypt cipher_null-ecb - 0 m 0")
        .unwrap();
    let (n, m) = (reg.device("n").unwrap(), reg.device("m").unwrap());
    let mut buf = pattern(4096, 9);
    assert_eq!(rw(&*n, Op::Write, 0, &mut buf), Status::Ok);
    let mut under = vec![0u8; 4096];
    assert_eq!(rw(&*m, Op::Read, 0, &mut under), Status::Ok);
    assert_eq!(under, buf);
    assert_eq!(
        reg.table_text("n").unwrap(),
        "0 4096 crypt cipher_null-ecb - 0 253:0 0\n"
    );
}

#[test]
fn large_sectors_and_iv_large_sectors_change_the_ciphertext_layout() {
    let reg = setup();
    let m = reg.device("m").unwrap();
    let plain = pattern(8192, 3);
    let mut seen = Vec::new();
    for (i, opts) in [
        "",
        " 1 sector_size:4096",
        " 2 sector_size:4096 iv_large_sectors",
    ]
    .iter()
    .enumerate()
    {
        let name = format!("s{i}");
        reg.create(
            &name,
            &format!("0 4096 crypt aes-xts-plain64 {KEY64} 0 m 0{opts}"),
        )
        .unwrap();
        let c = reg.device(&name).unwrap();
        let mut buf = plain.clone();
        assert_eq!(rw(&*c, Op::Write, 0, &mut buf), Status::Ok);
        let mut under = vec![0u8; 8192];
        assert_eq!(rw(&*m, Op::Read, 0, &mut under), Status::Ok);
        let mut back = vec![0u8; 8192];
        assert_eq!(rw(&*c, Op::Read, 0, &mut back), Status::Ok);
        assert_eq!(back, plain, "{opts}");
        seen.push(under);
        if !opts.is_empty() {
            // The device's logical block size is the crypto sector (the
            // kernel's crypt_io_hints), so a smaller I/O is refused.
            assert_eq!(c.logical_block_size(), 4096, "{opts}");
            let mut small = vec![0u8; 512];
            assert_eq!(
                rw(&*c, Op::Read, 0, &mut small),
                Status::Invalid,
                "{opts}: an I/O smaller than the crypto sector is refused"
            );
        }
        reg.remove(&name, false).unwrap();
    }
    assert_ne!(seen[0], seen[1]);
    assert_ne!(seen[1], seen[2]);
}

#[test]
fn table_prints_key_and_options_as_the_kernel() {
    let reg = setup();
    let line = format!(
        "0 4096 crypt aes-xts-plain64 {KEY64} 16 m 8 3 ALLOW_DISCARDS same_cpu_crypt sector_size:1024"
    );
    reg.create("t", &line).unwrap();
    assert_eq!(
        reg.table_text("t").unwrap(),
        format!(
            "0 4096 crypt aes-xts-plain64 {KEY64} 16 253:0 8 3 allow_discards same_cpu_crypt sector_size:1024\n"
        )
    );
    assert_eq!(reg.status_text("t").unwrap(), "0 4096 crypt \n");
    let m = reg.device("t").unwrap();
    assert!(m.features().discard);
    assert!(!m.features().write_zeroes);
}

#[test]
fn key_messages_need_suspend_and_a_wiped_key_blocks_resume() {
    let reg = setup();
    reg.create("k", &format!("0 4096 crypt aes-xts-plain64 {KEY64} 0 m 0"))
        .unwrap();
    let c = reg.device("k").unwrap();
    let plain = pattern(4096, 5);
    let mut buf = plain.clone();
    assert_eq!(rw(&*c, Op::Write, 0, &mut buf), Status::Ok);
    let e = reg.message("k", 0, &["key", "wipe"]).unwrap_err();
    assert!(e.report().contains("not suspended"), "{}", e.report());
    reg.suspend("k").unwrap();
    reg.message("k", 0, &["key", "wipe"]).unwrap();
    assert!(reg.table_text("k").unwrap().contains(&"0".repeat(128)));
    let e = reg.resume("k").unwrap_err();
    assert!(
        e.report().contains("crypt key is not set"),
        "{}",
        e.report()
    );
    let e = reg
        .message("k", 0, &["key", "set", &KEY64[..64]])
        .unwrap_err();
    assert!(
        e.report().contains("key size may not change"),
        "{}",
        e.report()
    );
    let other = KEY64.replace('0', "f");
    reg.message("k", 0, &["key", "set", &other]).unwrap();
    reg.resume("k").unwrap();
    let mut back = vec![0u8; 4096];
    assert_eq!(rw(&*c, Op::Read, 0, &mut back), Status::Ok);
    assert_ne!(back, plain, "another key reads other plaintext");
    reg.suspend("k").unwrap();
    reg.message("k", 0, &["key", "set", KEY64]).unwrap();
    reg.resume("k").unwrap();
    assert_eq!(rw(&*c, Op::Read, 0, &mut back), Status::Ok);
    assert_eq!(back, plain, "the first key again");
}

#[test]
fn bad_tables_name_the_reason() {
    let reg = setup();
    let k = KEY64;
    for (args, want) in [
        (format!("aes-xts-plain64 {k} 0 m"), "Not enough arguments"),
        (
            format!("aes-xts-plain64 {k} 0 m 0 1 nosuch"),
            "Invalid feature arguments",
        ),
        (
            format!("aes-xts-plain64 {k} 0 m 0 10 a b c d e f g h i j"),
            "Invalid number of feature args",
        ),
        (
            format!("aes-xts-plain64 {k} 0 m 0 2 allow_discards"),
            "Invalid number of feature args",
        ),
        (
            format!("aes-xts-plain64 {k} 0 m 0 1 sector_size:1000"),
            "Invalid feature value for sector_size",
        ),
        (
            format!("aes-xts-plain64 {k} 0 m 0 1 sector_size:8192"),
            "Invalid feature value for sector_size",
        ),
        (
            format!("aes-xts-plain64 {k} 0 m 0 1 integrity:28:aead"),
            "dm-integrity",
        ),
        (
            format!("aes-xts-plain64 {k} 0 m 0 1 integrity:0:aead"),
            "Invalid integrity arguments",
        ),
        (
            format!("aes-xts-plain64 {k} 0 m 0 1 integrity:28:x"),
            "Unknown integrity profile",
        ),
        (
            "aes-xts-plain64 :64:logon:cryptsetup:x 0 m 0".to_string(),
            "keyring",
        ),
        (
            "aes-xts-plain64 :x:logon:y 0 m 0".to_string(),
            "Cannot parse key size",
        ),
        (
            "aes-xts-plain64 - 0 m 0".to_string(),
            "Error decoding and setting key",
        ),
        (
            "aes-xts-plain64 zz11 0 m 0".to_string(),
            "Error decoding and setting key",
        ),
        (
            format!("aes-xts-plain64 {} 0 m 0", &k[..40]),
            "Error decoding and setting key",
        ),
        (format!("aes-cbc {k} 0 m 0"), "IV mechanism required"),
        (
            format!("aes-cbc-essiv {k} 0 m 0"),
            "Digest algorithm missing for ESSIV mode",
        ),
        (format!("aes-xts-nosuch {k} 0 m 0"), "Invalid IV mode"),
        (
            format!("serpent-xts-plain64 {k} 0 m 0"),
            "Error allocating crypto tfm",
        ),
        (
            format!("aes-xts-plain64 {k} x m 0"),
            "Invalid iv_offset sector",
        ),
        (
            format!("aes-xts-plain64 {k} 1 m 0 1 sector_size:4096"),
            "Invalid iv_offset sector",
        ),
        (format!("aes-xts-plain64 {k} 0 nosuch 0"), "not found"),
        (
            format!("aes-xts-plain64 {k} 0 m x"),
            "Invalid device sector",
        ),
        (format!("aes-xts-plain64 {k} 0 m 8000"), "too small"),
    ] {
        let e = match reg.create("bad", &format!("0 4096 crypt {args}")) {
            Ok(_) => panic!("{args}: accepted"),
            Err(e) => e.report(),
        };
        assert!(e.contains(want), "{args}: want '{want}', got '{e}'");
    }
    let line = format!("0 4095 crypt aes-xts-plain64 {k} 0 m 0 1 sector_size:4096");
    let e = match reg.create("bad", &line) {
        Ok(_) => panic!("{line}: accepted"),
        Err(e) => e.report(),
    };
    assert!(e.contains("not multiple of sector_size"), "{e}");
    let line = format!("0 64 crypt aes-xts-plain64 {k} 0 m 1700 1 sector_size:4096");
    let e = match reg.create("bad", &line) {
        Ok(_) => panic!("{line}: accepted"),
        Err(e) => e.report(),
    };
    assert!(
        e.contains("start=1700 not aligned to h/w logical block size 4096"),
        "{e}"
    );
}
