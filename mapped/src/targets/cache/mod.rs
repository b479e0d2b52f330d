//! `cache <metadata dev> <cache dev> <origin dev> <block size> <#features>
//! [writeback|writethrough|passthrough] [metadata2] [no_discard_passdown]
//! <policy> <#policy args> [<key> <value>]*`: a fast device caching a slow
//! one (kernel `drivers/md/dm-cache-target.c`). The table, constructor
//! errors, status and messages are the kernel's; `metadata.rs` is the
//! on-disk format (`dm-cache-metadata.c`, formats 1 and 2), `smq.rs` the
//! policies (`dm-cache-policy-smq.c`: smq, its `mq` alias and the
//! cleaner), `hits.rs` their mapping table, which read hits consult
//! without the policy lock, `io.rs` the I/O path, `migrate.rs` the
//! migrations (their copies in `copier.rs`, their commits in
//! `batcher.rs`). Judged by `cache_check`/`cache_dump` and by the
//! kernel's own dm-cache.

mod batcher;
mod cell;
mod copier;
pub mod hits;
pub mod io;
pub mod metadata;
mod migrate;
mod queue;
pub mod smq;

use crate::error::TargetError;
use crate::target::{CtrContext, DevArg, Target, TargetRef, TargetType};
use blkstack_core::{Bio, Features, SECTOR_SIZE};
use io::{Core, IoMode, Shared};
use metadata::CacheMetadata;
use parking_lot::Mutex;
use smq::Smq;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The `cache` target type.
pub const TYPE: TargetType = TargetType {
    name: "cache",
    version: [2, 3, 0],
    ctr,
};

/// `DATA_DEV_BLOCK_SIZE_MIN_SECTORS` (32 KiB).
const MIN_BLOCK: u64 = 64;
/// `DATA_DEV_BLOCK_SIZE_MAX_SECTORS` (1 GiB).
const MAX_BLOCK: u64 = 2 * 1024 * 1024;
/// `MAX_DISCARD_BLOCKS`.
const MAX_DISCARD_BLOCKS: u64 = 1 << 14;

fn invalid(s: &str) -> TargetError {
    TargetError::Invalid(s.to_string())
}

/// `struct cache_features`.
struct CacheFeatures {
    mode: IoMode,
    metadata_version: u32,
    discard_passdown: bool,
}

/// `dm_read_arg_group`: a count in `0..=max` followed by that many args.
fn arg_group<'a>(
    args: &mut &'a [&'a str],
    max: u32,
    error: &str,
) -> Result<&'a [&'a str], TargetError> {
    let n = args
        .first()
        .and_then(|s| crate::target::parse_sscanf::<u32>("count", s).ok())
        .filter(|&n| n <= max && (n as usize) < args.len())
        .ok_or_else(|| invalid(error))?;
    let group = &args[1..1 + n as usize];
    *args = &args[1 + n as usize..];
    Ok(group)
}

/// `parse_features`.
fn parse_features<'a>(args: &mut &'a [&'a str]) -> Result<CacheFeatures, TargetError> {
    let group = arg_group(args, 3, "Invalid number of cache feature arguments")?;
    let mut f = CacheFeatures {
        mode: IoMode::Writeback,
        metadata_version: 1,
        discard_passdown: true,
    };
    let mut modes = 0;
    for a in group {
        match a.to_ascii_lowercase().as_str() {
            "writeback" => (f.mode, modes) = (IoMode::Writeback, modes + 1),
            "writethrough" => (f.mode, modes) = (IoMode::Writethrough, modes + 1),
            "passthrough" => (f.mode, modes) = (IoMode::Passthrough, modes + 1),
            "metadata2" => f.metadata_version = 2,
            "no_discard_passdown" => f.discard_passdown = false,
            _ => return Err(invalid("Unrecognised cache feature requested")),
        }
    }
    if modes > 1 {
        return Err(invalid("Duplicate cache io_mode features requested"));
    }
    Ok(f)
}

fn shift<'a>(args: &mut &'a [&'a str]) -> Result<&'a str, TargetError> {
    let (first, rest) = args
        .split_first()
        .ok_or_else(|| invalid("Insufficient args"))?;
    *args = rest;
    Ok(first)
}

/// `calculate_discard_block_size`: the cache block size, doubled until
/// the origin has at most 2^14 discard blocks.
fn discard_block_sectors(block: u64, origin: u64) -> u64 {
    let mut d = block;
    while origin.div_ceil(d) > MAX_DISCARD_BLOCKS {
        d *= 2;
    }
    d
}

/// `dm_get_device`'s own error (ENOENT for no such device) is what the
/// kernel returns, under the `ti->error`.
fn ctr(ctx: &mut CtrContext<'_>, argv: &[&str]) -> Result<TargetRef, TargetError> {
    let mut args = argv;
    let md_arg = shift(&mut args)?;
    let metadata = ctx
        .get_device(md_arg, 0, 0)
        .map_err(|e| e.within("Error opening metadata device"))?;
    let cache_arg = shift(&mut args)?;
    let cache = ctx
        .get_device(cache_arg, 0, 0)
        .map_err(|e| e.within("Error opening cache device"))?;
    let cache_sectors = cache.dev.size() / SECTOR_SIZE;
    let origin_arg = shift(&mut args)?;
    let origin = ctx
        .get_device(origin_arg, 0, 0)
        .map_err(|e| e.within("Error opening origin device"))?;
    if ctx.len > origin.dev.size() / SECTOR_SIZE {
        return Err(invalid("Device size larger than cached device"));
    }
    let bs_arg = shift(&mut args)?;
    let block: u64 = bs_arg
        .parse()
        .ok()
        .filter(|&b: &u64| (MIN_BLOCK..=MAX_BLOCK).contains(&b) && b % MIN_BLOCK == 0)
        .ok_or_else(|| invalid("Invalid data block size"))?;
    if block > cache_sectors {
        return Err(invalid("Data block size is larger than the cache device"));
    }
    let features = parse_features(&mut args)?;
    let policy_name = shift(&mut args)?;
    let policy_args = arg_group(&mut args, 1024, "Invalid number of policy arguments")?;
    let ctr_args: Vec<String> = argv[3..argv.len() - args.len()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if ctx.live_target.is_some() {
        // The kernel shares the metadata object between the old and new
        // table; blkstack refuses rather than open it twice.
        return Err(invalid(
            "reloading a live cache table is not supported: remove and create it again",
        ));
    }
    let nr_cblocks = (cache_sectors / block).min(u32::MAX as u64 - 1) as u32;
    let origin_blocks = ctx.len / block;
    let mut policy = Smq::create(
        &policy_name.to_ascii_lowercase(),
        nr_cblocks,
        ctx.len,
        block,
    )
    .ok_or_else(|| invalid("Error creating cache's policy"))?;
    let mut threshold = 2048u64;
    if policy_args.len() % 2 == 1 {
        tracing::warn!(
            "Odd number of policy arguments given but they should be <key> <value> pairs."
        );
        return Err(invalid("Error setting cache policy's config values"));
    }
    for kv in policy_args.chunks(2) {
        if !set_config_value(&mut policy, &mut threshold, kv[0], kv[1]) {
            return Err(invalid("Error setting cache policy's config values"));
        }
    }
    if features.mode == IoMode::Passthrough {
        policy.allow_migrations(false);
    }
    let mut md = CacheMetadata::open(
        metadata.dev.clone(),
        block as u32,
        features.metadata_version,
    )
    .map_err(|e| {
        tracing::error!(error = %e, "cache: couldn't open metadata");
        invalid("Error creating metadata object")
    })?;
    let d_sectors = discard_block_sectors(block, ctx.len);
    let nr_dblocks = ctx.len.div_ceil(d_sectors);
    let passthrough = features.mode == IoMode::Passthrough;
    let core = preresume(
        &mut md,
        policy,
        nr_cblocks,
        d_sectors,
        nr_dblocks,
        passthrough,
    )
    .map_err(|e| {
        tracing::error!(error = %e, "cache: preresume failed");
        TargetError::Invalid(format!("Error preparing metadata: {e}"))
    })?;
    let stats = md.stats();
    let shared = Arc::new(Shared::new(
        core,
        md,
        origin.dev.clone(),
        cache.dev.clone(),
        block * SECTOR_SIZE,
        origin_blocks,
        d_sectors * SECTOR_SIZE,
        features.mode,
        features.discard_passdown,
    ));
    shared
        .migration_threshold
        .store(threshold, Ordering::Relaxed);
    let c = &shared.counters;
    c.read_hit.store(stats.read_hits, Ordering::Relaxed);
    c.read_miss.store(stats.read_misses, Ordering::Relaxed);
    c.write_hit.store(stats.write_hits, Ordering::Relaxed);
    c.write_miss.store(stats.write_misses, Ordering::Relaxed);
    let s = shared.clone();
    let worker = std::thread::Builder::new()
        .name(format!("cache-{}", ctx.device_name))
        .spawn(move || s.run())
        .map_err(|source| TargetError::Io {
            what: "could not start the cache worker",
            source,
        })?;
    Ok(Arc::new(CacheTarget {
        shared,
        metadata,
        cache,
        origin,
        ctr_args,
        features,
        block,
        suspended: AtomicBool::new(false),
        worker: Mutex::new(Some(worker)),
    }))
}

/// `set_config_value`: `migration_threshold` is the core's, the rest the
/// policy's.
fn set_config_value(policy: &mut Smq, threshold: &mut u64, key: &str, value: &str) -> bool {
    let ok = if key.eq_ignore_ascii_case("migration_threshold") {
        match value.parse() {
            Ok(v) => {
                *threshold = v;
                true
            }
            Err(_) => false,
        }
    } else {
        policy.set_config_value(key, value)
    };
    if !ok {
        tracing::warn!(key, value, "bad config value");
    }
    ok
}

/// `cache_preresume`: size the metadata to the cache device, load the
/// mappings into the policy and the discard bits.
fn preresume(
    md: &mut CacheMetadata,
    mut policy: Smq,
    nr_cblocks: u32,
    d_sectors: u64,
    nr_dblocks: u64,
    passthrough: bool,
) -> Result<Core, metadata::CacheMdError> {
    if md.cache_blocks() != nr_cblocks {
        md.resize(nr_cblocks)?;
    }
    let mappings = md.load_mappings(policy.name(), smq::VERSION[0], smq::HINT_SIZE)?;
    let (old_dbs, discards) = md.load_discards()?;
    let mut dirty = vec![false; nr_cblocks as usize];
    let mut nr_dirty = 0;
    for m in &mappings {
        if m.dirty && passthrough {
            return Err(metadata::CacheMdError::Refused(
                "cannot enter passthrough mode unless all blocks are clean".into(),
            ));
        }
        policy.load_mapping(m.oblock, m.cblock, m.dirty, m.hint);
        if m.dirty {
            dirty[m.cblock as usize] = true;
            nr_dirty += 1;
        }
    }
    let mut core = Core::new(policy, nr_cblocks, nr_dblocks);
    core.dirty = dirty;
    core.nr_dirty = nr_dirty;
    // `load_discard`: a saved discard block marks the new ones it wholly covers.
    if old_dbs > 0 {
        for (b, _) in discards.iter().enumerate().filter(|(_, &d)| d) {
            let (s, e) = (b as u64 * old_dbs, (b as u64 + 1) * old_dbs);
            for d in s.div_ceil(d_sectors)..(e / d_sectors).min(nr_dblocks) {
                core.discarded[d as usize] = true;
            }
        }
    }
    md.commit(false)?;
    Ok(core)
}

/// A constructed cache target.
pub struct CacheTarget {
    shared: Arc<Shared>,
    metadata: DevArg,
    cache: DevArg,
    origin: DevArg,
    ctr_args: Vec<String>,
    features: CacheFeatures,
    block: u64,
    suspended: AtomicBool,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl CacheTarget {
    fn emit_flags(&self) -> String {
        let f = &self.features;
        let mut v = Vec::new();
        if f.metadata_version == 2 {
            v.push("metadata2");
        }
        v.push(match f.mode {
            IoMode::Writethrough => "writethrough",
            IoMode::Passthrough => "passthrough",
            IoMode::Writeback => "writeback",
        });
        if !f.discard_passdown {
            v.push("no_discard_passdown");
        }
        format!("{} {}", v.len(), v.join(" "))
    }

    /// `process_invalidate_cblocks_message`.
    fn invalidate_cblocks(&self, ranges: &[&str]) -> Result<(), TargetError> {
        if self.features.mode != IoMode::Passthrough {
            return Err(invalid(
                "cache has to be in passthrough mode for invalidation",
            ));
        }
        let n = self.shared.core.lock().dirty.len() as u64;
        for r in ranges {
            let (b, e) = parse_cblock_range(r)?;
            if b >= n {
                return Err(TargetError::Invalid(format!(
                    "begin cblock out of range: {b} >= {n}"
                )));
            }
            if e > n {
                return Err(TargetError::Invalid(format!(
                    "end cblock out of range: {e} > {n}"
                )));
            }
            if b >= e {
                return Err(TargetError::Invalid(format!(
                    "invalid cblock range: {b} >= {e}"
                )));
            }
            for cb in b..e {
                let cb = cb as u32;
                if self.shared.core.lock().policy.invalidate(cb) {
                    self.shared
                        .md
                        .lock()
                        .remove(cb)
                        .map_err(|e| TargetError::Invalid(e.to_string()))?;
                }
            }
        }
        self.shared.commit_if_changed();
        Ok(())
    }
}

/// `parse_cblock_range`: `N` or `B-E` (end exclusive).
fn parse_cblock_range(s: &str) -> Result<(u64, u64), TargetError> {
    let bad = || TargetError::Invalid(format!("invalid cblock range '{s}'"));
    if let Some((b, e)) = s.split_once('-') {
        let b = b.parse().map_err(|_| bad())?;
        let e = e.parse().map_err(|_| bad())?;
        return Ok((b, e));
    }
    let b: u64 = s.parse().map_err(|_| bad())?;
    Ok((b, b + 1))
}

impl Target for CacheTarget {
    fn map(&self, bio: Bio) {
        self.shared.map(bio);
    }

    fn map_batch(&self, bios: &mut Vec<Bio>) {
        self.shared.map_batch(bios);
    }

    fn status(&self) -> String {
        let s = &self.shared;
        if !self.suspended.load(Ordering::SeqCst) {
            s.commit_if_changed();
        }
        let (residency, size, nr_dirty, policy, config) = {
            let core = s.core.lock();
            (
                core.policy.residency(),
                core.dirty.len(),
                core.nr_dirty,
                core.policy.name(),
                core.policy.config_values(),
            )
        };
        let (usage, needs_check) = {
            let md = s.md.lock();
            (md.usage(), md.needs_check())
        };
        let c = &s.counters;
        let ld = |a: &std::sync::atomic::AtomicU32| a.load(Ordering::Relaxed);
        format!(
            "8 {}/{} {} {residency}/{size} {} {} {} {} {} {} {nr_dirty} {} 2 migration_threshold {} {policy} {config} rw {}",
            usage.used,
            usage.total,
            self.block,
            ld(&c.read_hit),
            ld(&c.read_miss),
            ld(&c.write_hit),
            ld(&c.write_miss),
            ld(&c.demotion),
            ld(&c.promotion),
            self.emit_flags(),
            s.migration_threshold.load(Ordering::Relaxed),
            if needs_check { "needs_check" } else { "-" },
        )
    }

    fn table(&self) -> String {
        let mut t = format!("{} {} {}", self.metadata, self.cache, self.origin);
        for a in &self.ctr_args {
            t.push(' ');
            t.push_str(a);
        }
        t
    }

    /// `cache_message`: `invalidate_cblocks <range>*` or `<key> <value>`.
    fn message(&self, args: &[&str]) -> Result<String, TargetError> {
        let Some(first) = args.first() else {
            return Err(invalid("no message"));
        };
        if first.eq_ignore_ascii_case("invalidate_cblocks") {
            return self.invalidate_cblocks(&args[1..]).map(|_| String::new());
        }
        if args.len() != 2 {
            return Err(invalid("incorrect number of message arguments"));
        }
        let s = &self.shared;
        let mut threshold = s.migration_threshold.load(Ordering::Relaxed);
        let ok = set_config_value(&mut s.core.lock().policy, &mut threshold, args[0], args[1]);
        if !ok {
            return Err(TargetError::Invalid(format!(
                "bad config value for {}: {}",
                args[0], args[1]
            )));
        }
        s.migration_threshold.store(threshold, Ordering::Relaxed);
        s.wake();
        Ok(String::new())
    }

    /// `cache_postsuspend`: background work stops, then `sync_metadata`.
    fn postsuspend(&self) {
        if self.suspended.swap(true, Ordering::SeqCst) {
            return;
        }
        self.shared.pause(true);
        self.shared.sync_metadata();
    }

    fn resume(&self) {
        if self.suspended.swap(false, Ordering::SeqCst) {
            self.shared.pause(false);
        }
    }

    /// Flush and FUA pass to both devices; discards are accepted (and
    /// passed down unless `no_discard_passdown`); no write-zeroes.
    fn features(&self) -> Features {
        let o = self.origin.dev.features();
        Features {
            discard: true,
            discard_granularity: (self.block * SECTOR_SIZE) as u32,
            write_zeroes: false,
            fast_zero: false,
            read_only: o.read_only,
            knows_holes: false,
            ..o
        }
    }

    /// `dm_set_target_max_io_len(ti, sectors_per_block)`.
    fn max_io_len(&self, offset: u64) -> u64 {
        let b = self.block * SECTOR_SIZE;
        b - offset % b
    }
}

impl Drop for CacheTarget {
    /// Removal suspends first (`__dm_destroy`): the worker finishes the
    /// deferred bios and stops, then the metadata is synced clean.
    fn drop(&mut self) {
        self.shared.pause(true);
        self.shared.stop();
        if let Some(w) = self.worker.lock().take() {
            if w.thread().id() != std::thread::current().id() {
                let _ = w.join();
            }
        }
        self.shared.join_pool();
        if !self.suspended.swap(true, Ordering::SeqCst) {
            self.shared.sync_metadata();
        }
    }
}
