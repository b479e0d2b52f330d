//! `crypt <cipher> <key> <iv_offset> <dev> <offset> [#opts opt...]`:
//! transparent encryption of every sector (kernel drivers/md/dm-crypt.c,
//! 6.12). The table is the kernel's, so a table cryptsetup would load
//! (`cryptsetup open --test-passphrase` prints none, but `dmsetup table
//! --showkeys` of an open LUKS volume does) works unchanged, and the
//! ciphertext on the device is the kernel's, byte for byte.
//!
//! Where the cipher runs: on the thread that submits a write (before it
//! goes down) and on the thread that completes a read (as dm-crypt does
//! with `no_read_workqueue`/`no_write_workqueue`). dm-crypt's default
//! hops to kcryptd workqueues because a bio may be submitted from a
//! context that must not run long; in blkstack every submitter is a
//! queue's own thread (an NBD connection, a bench job, a ublk queue), so
//! those threads already spread the work over the CPUs and a pool would
//! add a hand-off per I/O and nothing else. The workqueue options are
//! (and `high_priority`) therefore accepted and printed back, and change
//! nothing. What makes one thread enough is how the cipher is fed: whole
//! sectors through `aes`'s batched block calls (cipher.rs, xts.rs), so
//! AES-NI keeps several blocks in flight instead of one. Splitting one
//! large request's decryption over a pool (kcryptd's other reason) is
//! not built: it buys a second CPU only where one is idle (an NBD
//! client's own thread usually holds it), and costs a cross-CPU wake-up
//! per request, which on a virtual machine is not small; the crypt rows
//! of docs/BENCHMARKS.md (scripts/bench-crypt.sh) show whether one
//! thread per queue keeps up.
//!
//! A write is never encrypted in the caller's buffer (the page cache of a
//! kernel caller must not see ciphertext, and an NBD client's buffer may
//! be resent): it is encrypted into a bounce buffer, which replaces the
//! bio's buffer on the way down and is given back on completion. Bounce
//! buffers are bounded: a write is at most [`MAX_IO`] (the kernel splits
//! writes at `BIO_MAX_VECS` pages, the same size), and at most
//! [`POOL_KEEP`] idle buffers, [`POOL_BYTES`] in all, are kept for reuse.
//!
//! `key wipe` and `key set` need the device suspended, and a device whose
//! key was wiped cannot be resumed until a key is set again (the kernel's
//! `crypt_message` and `crypt_preresume`), so no I/O ever meets a wiped
//! key: it stays held by the suspended device.

pub mod cipher;
pub mod iv;
pub mod xts;

use crate::error::TargetError;
use crate::target::{parse_sscanf, CtrContext, DevArg, Target, TargetRef, TargetType};
use arc_swap::ArcSwapOption;
use blkstack_core::{AlignedBuf, Bio, EndIo, Features, IoBuf, Op, Status, SECTOR_SIZE};
use cipher::{CipherSpec, Keyed};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use zeroize::Zeroizing;

/// The `crypt` target type.
pub const TYPE: TargetType = TargetType {
    name: "crypt",
    version: [1, 28, 0],
    ctr,
};

/// The largest bio mapped at once (kernel: `BIO_MAX_VECS << PAGE_SHIFT`).
pub const MAX_IO: u64 = 256 * 4096;

/// Idle bounce buffers kept for reuse, and the bytes they may hold.
const POOL_KEEP: usize = 64;
const POOL_BYTES: usize = 8 << 20;

/// The feature words (kernel `crypt_ctr_optional`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// `allow_discards`: discards pass down (they reveal which sectors
    /// are free, hence opt-in).
    pub allow_discards: bool,
    /// `same_cpu_crypt`.
    pub same_cpu_crypt: bool,
    /// `submit_from_crypt_cpus`.
    pub submit_from_crypt_cpus: bool,
    /// `no_read_workqueue`.
    pub no_read_workqueue: bool,
    /// `no_write_workqueue`.
    pub no_write_workqueue: bool,
    /// `high_priority` (6.10's kcryptd at high priority).
    pub high_priority: bool,
    /// `sector_size:N`: the encryption unit, 512..=4096, a power of two.
    pub sector_size: u32,
    /// `iv_large_sectors`: IVs count `sector_size` units, not 512 bytes.
    pub iv_large_sectors: bool,
}

impl Options {
    fn words(&self) -> Vec<String> {
        let mut w = Vec::new();
        for (on, name) in [
            (self.allow_discards, "allow_discards"),
            (self.same_cpu_crypt, "same_cpu_crypt"),
            (self.high_priority, "high_priority"),
            (self.submit_from_crypt_cpus, "submit_from_crypt_cpus"),
            (self.no_read_workqueue, "no_read_workqueue"),
            (self.no_write_workqueue, "no_write_workqueue"),
        ] {
            if on {
                w.push(name.to_string());
            }
        }
        if self.sector_size != 512 {
            w.push(format!("sector_size:{}", self.sector_size));
        }
        if self.iv_large_sectors {
            w.push("iv_large_sectors".to_string());
        }
        w
    }
}

fn invalid(why: impl Into<String>) -> TargetError {
    TargetError::Invalid(why.into())
}

/// The feature group (kernel `crypt_ctr_optional` with
/// `dm_read_arg_group`): a count 0..=9 no larger than the words after it,
/// then that many words; words after the counted ones are ignored, as the
/// kernel ignores them.
fn parse_options(args: &[&str], len_sectors: u64) -> Result<Options, TargetError> {
    let mut o = Options {
        sector_size: 512,
        ..Options::default()
    };
    let Some((count, rest)) = args.split_first() else {
        return Ok(o);
    };
    let n: usize = parse_sscanf::<u32>("feature count", count)
        .ok()
        .filter(|&n| n <= 9 && n as usize <= rest.len())
        .ok_or_else(|| invalid(format!("Invalid number of feature args: '{count}'")))?
        as usize;
    for word in &rest[..n] {
        let lower = word.to_ascii_lowercase();
        match lower.as_str() {
            "allow_discards" => o.allow_discards = true,
            "same_cpu_crypt" => o.same_cpu_crypt = true,
            "submit_from_crypt_cpus" => o.submit_from_crypt_cpus = true,
            "no_read_workqueue" => o.no_read_workqueue = true,
            "no_write_workqueue" => o.no_write_workqueue = true,
            "high_priority" => o.high_priority = true,
            "iv_large_sectors" => o.iv_large_sectors = true,
            _ => {
                if let Some(v) = word.strip_prefix("integrity:") {
                    return Err(integrity(v));
                }
                let Some(v) = word.strip_prefix("sector_size:") else {
                    return Err(invalid(format!("Invalid feature arguments: '{word}'")));
                };
                if !v.bytes().all(|b| b.is_ascii_digit()) || v.is_empty() {
                    return Err(invalid(format!("Invalid feature arguments: '{word}'")));
                }
                let size: u32 = v.parse().unwrap_or(0);
                if !(512..=4096).contains(&size) || !size.is_power_of_two() {
                    return Err(invalid(format!(
                        "Invalid feature value for sector_size: {v} (512..4096, a power of two)"
                    )));
                }
                if !len_sectors.is_multiple_of(size as u64 / SECTOR_SIZE) {
                    return Err(invalid(format!(
                        "Device size is not multiple of sector_size feature: {len_sectors} \
                         sectors, sector_size {size}"
                    )));
                }
                o.sector_size = size;
            }
        }
    }
    Ok(o)
}

/// `integrity:TAG:PROFILE`: the kernel's own checks, then a refusal: the
/// tags live in a dm-integrity device below, which blkstack has not got.
fn integrity(v: &str) -> TargetError {
    let (tag, profile) = v.split_once(':').unwrap_or((v, ""));
    match tag.parse::<u32>() {
        Ok(t) if (1..=480).contains(&t) => {}
        _ => return invalid(format!("Invalid integrity arguments: 'integrity:{v}'")),
    }
    if !profile.eq_ignore_ascii_case("aead") && !profile.eq_ignore_ascii_case("none") {
        return invalid(format!("Unknown integrity profile: '{profile}'"));
    }
    invalid(format!(
        "integrity:{v}: authenticated encryption is not supported: it needs dm-integrity \
         below, which blkstack has not got"
    ))
}

/// The key argument: hex (its length halved, an odd last digit ignored,
/// as the kernel's `hex2bin`), `-` for none; the keyring forms refused.
fn parse_key(arg: &str) -> Result<Zeroizing<Vec<u8>>, TargetError> {
    if let Some(rest) = arg.strip_prefix(':') {
        let size_ok = rest
            .split_once(':')
            .is_some_and(|(n, _)| parse_sscanf::<u32>("key size", n).is_ok());
        if !size_ok {
            return Err(invalid("Cannot parse key size"));
        }
        // ENOKEY, as the kernel's lookup of a key it does not hold.
        return Err(TargetError::Refused {
            errno: crate::error::Refusal::NoKey,
            why: "Error decoding and setting key: kernel keyring keys (':SIZE:logon:DESC', \
                  ':SIZE:user:DESC') are not supported: blkstack has no kernel keyring; give \
                  the key in hex"
                .to_string(),
        });
    }
    let size = arg.len() / 2;
    if size == 0 {
        if arg == "-" {
            return Ok(Zeroizing::new(Vec::new()));
        }
        return Err(invalid(format!(
            "Error decoding and setting key: '{arg}' is neither hex nor '-'"
        )));
    }
    let mut key = Zeroizing::new(vec![0u8; size]);
    hex::decode_to_slice(&arg.as_bytes()[..size * 2], &mut key)
        .map_err(|_| invalid("Error decoding and setting key: the key is not hex"))?;
    Ok(key)
}

/// A crypt target (kernel `struct crypt_config`).
pub struct Crypt {
    spec: CipherSpec,
    dev: DevArg,
    /// Start on `dev`, in sectors.
    start: u64,
    /// Added to the target-relative sector to make the IV sector.
    iv_offset: u64,
    opts: Options,
    /// The key as `table` prints it: zeroes after `key wipe`, as the
    /// kernel's `crypt_wipe_key` leaves `cc->key`.
    key: Mutex<Zeroizing<Vec<u8>>>,
    /// The cipher while the key is valid (`DM_CRYPT_KEY_VALID`).
    keyed: ArcSwapOption<Keyed>,
    /// Set between postsuspend and resume (`DM_CRYPT_SUSPENDED`).
    suspended: AtomicBool,
    pool: Mutex<Vec<AlignedBuf>>,
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    if args.len() < 5 {
        return Err(invalid(format!(
            "Not enough arguments: '<cipher> <key> <iv_offset> <dev> <offset> \
             [#opts opt...]' takes at least 5, got {}",
            args.len()
        )));
    }
    let key = parse_key(args[1])?;
    let opts = parse_options(&args[5..], ctx.len)?;
    let spec = cipher::parse(args[0])?;
    let keyed = Keyed::new(&spec, &key)?;
    let unit = opts.sector_size as u64 / SECTOR_SIZE;
    let iv_offset: u64 = parse_sscanf("iv_offset sector", args[2])
        .ok()
        .filter(|v: &u64| v.is_multiple_of(unit))
        .ok_or_else(|| invalid(format!("Invalid iv_offset sector: '{}'", args[2])))?;
    // The kernel looks the device up before it reads the offset, so a
    // missing device is named first; the range check needs the offset.
    let start: u64 = match parse_sscanf("device sector", args[4]) {
        Ok(s) => s,
        Err(_) => {
            ctx.get_device(args[3], 0, 0)?;
            return Err(invalid(format!("Invalid device sector: '{}'", args[4])));
        }
    };
    let dev = ctx.get_device(args[3], start, ctx.len)?;
    // dm-table.c's device_area_is_invalid, with the limits crypt's
    // io_hints raised: the start must be a whole logical block.
    if !start.is_multiple_of(unit) {
        return Err(invalid(format!(
            "start={start} not aligned to h/w logical block size {} of {}",
            opts.sector_size, args[3]
        )));
    }
    Ok(Arc::new(CryptTarget(Arc::new(Crypt {
        spec,
        dev,
        start,
        iv_offset,
        opts,
        key: Mutex::new(key),
        keyed: ArcSwapOption::from_pointee(keyed),
        suspended: AtomicBool::new(false),
        pool: Mutex::new(Vec::new()),
    }))))
}

/// The table-facing half; the shared half sees completions.
pub struct CryptTarget(Arc<Crypt>);

/// What a write's completion gives back: the caller's buffer and the
/// bounce buffer, boxed into the frame's private word.
struct WriteFrame {
    orig: IoBuf,
    bounce: AlignedBuf,
}

impl Crypt {
    /// The IV sector of target-relative byte `offset` and the IV step per
    /// crypto sector (kernel `crypt_convert`: `cc_sector` counts 512-byte
    /// sectors from `iv_offset`, shifted down with `iv_large_sectors`).
    fn iv_sector(&self, offset: u64) -> (u64, u64) {
        let s = (offset / SECTOR_SIZE).wrapping_add(self.iv_offset);
        let unit = self.opts.sector_size as u64 / SECTOR_SIZE;
        if self.opts.iv_large_sectors {
            (s / unit, 1)
        } else {
            (s, unit)
        }
    }

    /// The bio is whole crypto sectors at a crypto sector boundary
    /// (kernel `crypt_map` kills it otherwise).
    fn aligned(&self, bio: &Bio) -> bool {
        let ss = self.opts.sector_size as u64;
        bio.offset.is_multiple_of(ss) && bio.len.is_multiple_of(ss)
    }

    fn bounce(&self, len: usize) -> AlignedBuf {
        let mut pool = self.pool.lock();
        match pool.iter().rposition(|b| b.len() >= len) {
            Some(i) => pool.swap_remove(i),
            None => {
                drop(pool);
                AlignedBuf::new(len.next_power_of_two().max(4096))
            }
        }
    }

    fn give_back(&self, buf: AlignedBuf) {
        let mut pool = self.pool.lock();
        let held: usize = pool.iter().map(AlignedBuf::len).sum();
        if pool.len() < POOL_KEEP && held + buf.len() <= POOL_BYTES {
            pool.push(buf);
        }
    }

    fn remap(&self, mut bio: Bio) {
        bio.offset += self.start * SECTOR_SIZE;
        self.dev.dev.submit(bio);
    }

    fn map_write(self: &Arc<Self>, mut bio: Bio, keyed: &Keyed) {
        let len = bio.len as usize;
        let mut bounce = self.bounce(len);
        bounce.as_mut_slice()[..len].copy_from_slice(bio.data());
        let (iv, step) = self.iv_sector(bio.offset);
        keyed.encrypt(
            &mut bounce.as_mut_slice()[..len],
            self.opts.sector_size as usize,
            iv,
            step,
        );
        // SAFETY: the bounce buffer's heap memory moves into the frame
        // below, which lives until this bio's completion pops it; nothing
        // else touches it meanwhile.
        let buf = unsafe { bounce.io_buf(0, len) };
        let orig = std::mem::replace(&mut bio.buf, buf);
        let frame = Box::new(WriteFrame { orig, bounce });
        bio.push_end(self.clone(), Box::into_raw(frame) as u64 | 1);
        self.remap(bio);
    }
}

impl EndIo for Crypt {
    fn end_io(&self, mut bio: Bio, status: Status, private: u64) {
        if private & 1 == 1 {
            // SAFETY: an odd private word is the `WriteFrame` `map_write`
            // boxed (a Box's address is even); the bio contract pops each
            // frame exactly once, so it is reclaimed exactly once.
            let frame = unsafe { Box::from_raw((private & !1) as *mut WriteFrame) };
            bio.buf = frame.orig;
            self.give_back(frame.bounce);
            bio.complete(status);
            return;
        }
        if status.is_ok() {
            match self.keyed.load_full() {
                Some(k) => {
                    let (iv, step) = self.iv_sector(bio.offset);
                    k.decrypt(bio.data_mut(), self.opts.sector_size as usize, iv, step);
                }
                None => {
                    bio.complete(Status::IoError);
                    return;
                }
            }
        }
        bio.complete(status);
    }
}

impl Target for CryptTarget {
    fn map(&self, mut bio: Bio) {
        let c = &self.0;
        match bio.op {
            Op::Flush => return c.remap(bio),
            Op::Discard if c.opts.allow_discards => return c.remap(bio),
            Op::Discard | Op::WriteZeroes => return bio.complete(Status::NotSupported),
            Op::Read | Op::Write => {}
        }
        if !c.aligned(&bio) {
            return bio.complete(Status::IoError);
        }
        let Some(keyed) = c.keyed.load_full() else {
            // Unreachable through the registry (a wiped key keeps the
            // device suspended); fail rather than pass plaintext.
            return bio.complete(Status::IoError);
        };
        if bio.op == Op::Write {
            c.map_write(bio, &keyed);
        } else {
            bio.push_end(c.clone(), 0);
            c.remap(bio);
        }
    }

    fn table(&self) -> String {
        let c = &self.0;
        let key = c.key.lock();
        let key = if key.is_empty() {
            "-".to_string()
        } else {
            hex::encode(&**key)
        };
        let mut s = format!(
            "{} {key} {} {} {}",
            c.spec.text, c.iv_offset, c.dev, c.start
        );
        let words = c.opts.words();
        if !words.is_empty() {
            s.push_str(&format!(" {} {}", words.len(), words.join(" ")));
        }
        s
    }

    fn message(&self, args: &[&str]) -> Result<String, TargetError> {
        let c = &self.0;
        let verb = args.first().map(|a| a.to_ascii_lowercase());
        if args.len() < 2 || verb.as_deref() != Some("key") {
            return Err(TargetError::UnsupportedMessage(args.join(" ")));
        }
        if !c.suspended.load(Ordering::SeqCst) {
            return Err(invalid(
                "not suspended during key manipulation: suspend the device first",
            ));
        }
        match (args.len(), args[1].to_ascii_lowercase().as_str()) {
            (3, "set") => {
                let key = parse_key(args[2])?;
                if key.len() != c.key.lock().len() {
                    return Err(invalid(format!(
                        "key set: the key size may not change ({} bytes, the table's is {})",
                        key.len(),
                        c.key.lock().len()
                    )));
                }
                let keyed = Keyed::new(&c.spec, &key)?;
                *c.key.lock() = key;
                c.keyed.store(Some(Arc::new(keyed)));
                Ok(String::new())
            }
            (2, "wipe") => {
                c.keyed.store(None);
                c.key.lock().iter_mut().for_each(|b| *b = 0);
                Ok(String::new())
            }
            _ => Err(TargetError::UnsupportedMessage(args.join(" "))),
        }
    }

    fn postsuspend(&self) {
        self.0.suspended.store(true, Ordering::SeqCst);
    }

    fn preresume(&self) -> Result<(), TargetError> {
        if self.0.keyed.load().is_none() {
            return Err(TargetError::Refused {
                errno: crate::error::Refusal::Again,
                why: "aborting resume - crypt key is not set: send 'key set HEX' first".to_string(),
            });
        }
        Ok(())
    }

    fn resume(&self) {
        self.0.suspended.store(false, Ordering::SeqCst);
    }

    fn features(&self) -> Features {
        let mut f = self.0.dev.dev.features();
        f.discard &= self.0.opts.allow_discards;
        f.write_zeroes = false;
        f.fast_zero = false;
        f.knows_holes = false;
        f
    }

    fn max_io_len(&self, _offset: u64) -> u64 {
        MAX_IO
    }

    fn max_discard_len(&self, _offset: u64) -> u64 {
        u64::MAX
    }

    /// `sector_size`, as `crypt_io_hints` raises the logical block size.
    fn logical_block_size(&self) -> u32 {
        self.0.opts.sector_size
    }
}
