//! The `verity` table line: parsing it in the order and with the
//! `ti->error` words of Linux 6.12's `verity_ctr` and
//! `verity_parse_opt_args` (drivers/md/dm-verity-target.c), and printing
//! it back as `verity_status` does for STATUSTYPE_TABLE.
//!
//! One check of the kernel's is not made: "Device must be readonly" (a
//! table not loaded with `dmsetup create -r`): blkstack's constructors
//! do not see the table's mode, so the target makes its device
//! read-only itself ([`super::VerityTarget`]'s features, and writes fail
//! with EPERM as on the kernel's read-only disk).

use super::format::{hex, unhex};
use super::tree::{BlockCache, Geometry, GeometryError, HashAlg, Hasher};
use super::verify::WorkQueue;
use super::{start, Mode, Verity, CACHE_BLOCKS};
use crate::error::{Refusal, TargetError};
use crate::target::{CtrContext, TargetRef};
use blkstack_core::SECTOR_SIZE;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::Weak;

/// Feature words a table may have (kernel `DM_VERITY_OPTS_MAX`: five
/// modes and flags, eight FEC words, two for the signature key).
const OPTS_MAX: u32 = 5 + 8 + 2;
/// The largest data block (the kernel's `PAGE_SIZE` on x86-64).
const PAGE_SIZE: u32 = 4096;
/// FEC words, each taking a value (dm-verity-fec.c).
const FEC_OPTS: [&str; 4] = [
    "use_fec_from_device",
    "fec_roots",
    "fec_blocks",
    "fec_start",
];

fn inval(msg: &str) -> TargetError {
    TargetError::invalid(msg)
}

/// A refusal the kernel returns with E2BIG.
fn too_big(msg: &str) -> TargetError {
    TargetError::Refused {
        errno: Refusal::TooBig,
        why: msg.to_string(),
    }
}

/// The kernel's `sscanf(s, "%u%c")`/`"%llu%c"`: digits only.
fn num<T: std::str::FromStr>(s: &str) -> Option<T> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// The feature count `dm_read_arg_group` reads, checked against what
/// follows it.
fn opt_count(opts: &[&str]) -> Result<usize, TargetError> {
    let Some((first, rest)) = opts.split_first() else {
        return Ok(0);
    };
    match num::<u32>(first) {
        Some(n) if n <= OPTS_MAX && n as usize <= rest.len() => Ok(n as usize),
        _ => Err(inval("Invalid number of feature args")),
    }
}

/// The table's optional words, parsed (the second pass of
/// `verity_parse_opt_args`).
struct Opts {
    mode: Mode,
    error_mode: Mode,
    zeroes: bool,
    at_most_once: bool,
    tasklet: bool,
}

fn parse_opts(opts: &[&str]) -> Result<Opts, TargetError> {
    let n = opt_count(opts)?;
    let mut o = Opts {
        mode: Mode::Eio,
        error_mode: Mode::Eio,
        zeroes: false,
        at_most_once: false,
        tasklet: false,
    };
    let set = |cur: &mut Mode, m: Mode| {
        if *cur != Mode::Eio && *cur != m {
            return Err(inval("Conflicting error handling parameters"));
        }
        *cur = m;
        Ok(())
    };
    for w in opts.iter().skip(1).take(n) {
        let is = |name: &str| w.eq_ignore_ascii_case(name);
        if is("ignore_corruption") {
            set(&mut o.mode, Mode::Logging)?;
        } else if is("restart_on_corruption") {
            set(&mut o.mode, Mode::Restart)?;
        } else if is("panic_on_corruption") {
            set(&mut o.mode, Mode::Panic)?;
        } else if is("restart_on_error") {
            set(&mut o.error_mode, Mode::Restart)?;
        } else if is("panic_on_error") {
            set(&mut o.error_mode, Mode::Panic)?;
        } else if is("ignore_zero_blocks") {
            o.zeroes = true;
        } else if is("check_at_most_once") {
            o.at_most_once = true;
        } else if is("try_verify_in_tasklet") {
            o.tasklet = true;
        } else if FEC_OPTS.iter().any(|f| is(f)) {
            return Err(TargetError::invalid(format!(
                "forward error correction is not built in blkstack: '{w}' refused \
                 (build the table without the FEC options)"
            )));
        } else if is("root_hash_sig_key_desc") {
            return Err(TargetError::invalid(
                "root_hash_sig_key_desc: root hash signatures are looked up in the \
                 kernel keyring, which blkstack has no equivalent of",
            ));
        } else {
            return Err(inval("Unrecognized verity feature request"));
        }
    }
    Ok(o)
}

/// Kernel `verity_ctr`.
pub(super) fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    if args.len() < 10 {
        return Err(inval("Not enough arguments"));
    }
    // The first pass over the options (those that change how the hash is
    // set up) can only fail on their count.
    opt_count(&args[10..])?;
    let version = match num::<u32>(args[0]) {
        Some(v) if v <= 1 => v,
        _ => return Err(inval("Invalid version")),
    };
    let data = ctx
        .get_device(args[1], 0, ctx.len)
        .map_err(|e| e.within("Data device lookup failed"))?;
    let hash = ctx
        .get_device(args[2], 0, 0)
        .map_err(|e| e.within("Hash device lookup failed"))?;
    let block_ok = |s: &str, lbs: u32, max: u32| {
        num::<u32>(s).filter(|&n| n.is_power_of_two() && n >= lbs && n <= max)
    };
    let dbs = block_ok(args[3], data.dev.logical_block_size(), PAGE_SIZE)
        .ok_or_else(|| inval("Invalid data device block size"))?;
    let hbs = block_ok(args[4], hash.dev.logical_block_size(), i32::MAX as u32)
        .ok_or_else(|| inval("Invalid hash device block size"))?;
    let dshift = dbs.trailing_zeros() - 9;
    let hshift = hbs.trailing_zeros() - 9;
    let data_blocks = num::<u64>(args[5])
        .filter(|&n| (n << dshift) >> dshift == n)
        .ok_or_else(|| inval("Invalid data blocks"))?;
    if ctx.len > data_blocks << dshift {
        return Err(inval("Data device is too small"));
    }
    let hash_start = num::<u64>(args[6])
        .filter(|&n| (n << hshift) >> hshift == n)
        .ok_or_else(|| inval("Invalid hash start"))?;
    let alg = HashAlg::parse(args[7]).ok_or_else(|| TargetError::Refused {
        errno: Refusal::NotFound,
        why: format!(
            "Cannot initialize hash function '{}' (built: sha1, sha224, sha256, sha384, sha512)",
            args[7]
        ),
    })?;
    let ds = alg.digest_size();
    if (hbs as usize) < ds * 2 {
        return Err(inval("Digest size too big"));
    }
    let root = unhex(args[8])
        .filter(|r| r.len() == ds)
        .ok_or_else(|| inval("Invalid root digest"))?;
    let salt = if args[9] == "-" {
        Vec::new()
    } else {
        unhex(args[9]).ok_or_else(|| inval("Invalid salt"))?
    };
    let opts = parse_opts(&args[10..])?;
    let geo =
        Geometry::new(version, dbs, hbs, data_blocks, hash_start, ds).map_err(|e| match e {
            GeometryError::DigestTooBig => inval("Digest size too big"),
            e => too_big(&e.to_string()),
        })?;
    if hash.dev.size() / u64::from(hbs) < geo.hash_end {
        return Err(too_big("Hash device is too small"));
    }
    let hasher = Hasher::new(alg, version, &salt);
    let zero_digest = opts.zeroes.then(|| {
        let mut d = vec![0u8; ds];
        hasher.hash(&vec![0u8; dbs as usize], &mut d);
        d
    });
    let validated = if opts.at_most_once {
        if data_blocks > i32::MAX as u64 {
            return Err(too_big("device too large to use check_at_most_once"));
        }
        Some(
            (0..data_blocks.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
        )
    } else {
        None
    };
    let queue = WorkQueue::new();
    let v = Verity {
        me: Weak::new(),
        data,
        hash,
        geo,
        hasher,
        root,
        mode: opts.mode,
        error_mode: opts.error_mode,
        zero_digest,
        validated,
        tasklet: opts.tasklet,
        hash_failed: AtomicBool::new(false),
        corrupted_errs: AtomicU32::new(0),
        halted: AtomicBool::new(false),
        cache: BlockCache::new(CACHE_BLOCKS),
        queue: queue.clone(),
    };
    debug_assert_eq!(SECTOR_SIZE, 512);
    start(v, queue, ctx.device_name)
}

/// `verity_status` for STATUSTYPE_TABLE.
pub(super) fn table(v: &Verity) -> String {
    let g = &v.geo;
    let salt = if v.hasher.salt().is_empty() {
        "-".to_string()
    } else {
        hex(v.hasher.salt())
    };
    let mut s = format!(
        "{} {} {} {} {} {} {} {} {} {salt}",
        g.version,
        v.data,
        v.hash,
        g.data_block_size,
        g.hash_block_size,
        g.data_blocks,
        g.hash_start,
        v.hasher.alg().name(),
        hex(&v.root)
    );
    let mut opts: Vec<&str> = Vec::new();
    match v.mode {
        Mode::Eio => {}
        Mode::Logging => opts.push("ignore_corruption"),
        Mode::Restart => opts.push("restart_on_corruption"),
        Mode::Panic => opts.push("panic_on_corruption"),
    }
    match v.error_mode {
        Mode::Restart => opts.push("restart_on_error"),
        Mode::Panic => opts.push("panic_on_error"),
        _ => {}
    }
    if v.zero_digest.is_some() {
        opts.push("ignore_zero_blocks");
    }
    if v.validated.is_some() {
        opts.push("check_at_most_once");
    }
    if v.tasklet {
        opts.push("try_verify_in_tasklet");
    }
    if !opts.is_empty() {
        s += &format!(" {} {}", opts.len(), opts.join(" "));
    }
    s
}
