//! `thin-pool <metadata dev> <data dev> <block size> <low water mark>
//! [<#features> <feature>...]`: the pool of data blocks that thin devices
//! share (kernel `dm-thin.c` `pool_target`), with its messages
//! (`create_thin`, `create_snap`, `delete`, `set_transaction_id`,
//! `reserve_metadata_snap`, `release_metadata_snap`) and status.
//!
//! A reload of the pool device keeps the running pool (`__pool_find`):
//! the new table's features and low water mark, and a larger data size,
//! take effect on resume, which also releases bios that waited for space.

use super::metadata::{metadata_blocks_of, read_dev_id, MetadataError, PoolMetadata};
use super::pool::{Mode, Pool, PoolFeatures, PoolShared, PoolState};
use super::pool_table;
use crate::error::{Refusal, TargetError};
use crate::target::{CtrContext, DevArg, Target, TargetRef, TargetType};
use blkstack_core::{Bio, Features};
use std::sync::Arc;

pub const TYPE: TargetType = TargetType {
    name: "thin-pool",
    version: [1, 23, 0],
    ctr,
};

/// `DATA_DEV_BLOCK_SIZE_MIN_SECTORS` (64 KiB) and `_MAX_` (1 GiB).
const MIN_BLOCK_SECTORS: u64 = 128;
const MAX_BLOCK_SECTORS: u64 = 2 * 1024 * 1024;

pub struct PoolTarget {
    pub pool: Arc<Pool>,
    metadata: DevArg,
    data: DevArg,
    block_sectors: u64,
    low_water_blocks: u64,
    requested: PoolFeatures,
    data_blocks: u64,
}

fn invalid(s: impl Into<String>) -> TargetError {
    TargetError::Invalid(s.into())
}

/// `parse_pool_features`.
fn parse_features(args: &[&str]) -> Result<PoolFeatures, TargetError> {
    let mut pf = PoolFeatures::default();
    let Some(count) = args.first() else {
        return Ok(pf);
    };
    let n: usize = count
        .parse()
        .ok()
        .filter(|&n| n <= 4 && n < args.len())
        .ok_or_else(|| invalid("Invalid number of pool feature arguments"))?;
    if args.len() != n + 1 {
        return Err(invalid("Invalid number of pool feature arguments"));
    }
    for a in &args[1..=n] {
        match a.to_ascii_lowercase().as_str() {
            "skip_block_zeroing" => pf.zero_new_blocks = false,
            "ignore_discard" => pf.discard_enabled = false,
            "no_discard_passdown" => pf.discard_passdown = false,
            "read_only" => pf.read_only = true,
            "error_if_no_space" => pf.error_if_no_space = true,
            _ => return Err(invalid("Unrecognised pool feature requested")),
        }
    }
    Ok(pf)
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    if args.len() < 4 {
        return Err(invalid("Invalid argument count"));
    }
    if args[0] == args[1] {
        return Err(invalid("Error setting metadata or data device"));
    }
    let requested = parse_features(&args[4..])?;
    let metadata = ctx
        .get_device(args[0], 0, 0)
        .map_err(|_| invalid("Error opening metadata block device"))?;
    let data = ctx
        .get_device(args[1], 0, ctx.len)
        .map_err(|e| TargetError::In {
            context: "Error getting data device".into(),
            source: Box::new(e),
        })?;
    let block_sectors: u64 = args[2]
        .parse()
        .ok()
        .filter(|&b| {
            (MIN_BLOCK_SECTORS..=MAX_BLOCK_SECTORS).contains(&b) && b % MIN_BLOCK_SECTORS == 0
        })
        .ok_or_else(|| invalid("Invalid block size"))?;
    let low_water_blocks: u64 = args[3]
        .parse()
        .map_err(|_| invalid("Invalid low water mark"))?;
    let data_blocks = ctx.len / block_sectors;
    // `__pool_find`: a pool over this metadata device that another
    // mapped device holds is refused with EBUSY, before anything else.
    let mut table = pool_table::lock();
    let live = ctx.live_target.as_ref().and_then(|t| table.by_target(t));
    let found = table
        .find(&metadata.dev, &data.dev, ctx.device_name)
        .map_err(|e| TargetError::Refused {
            errno: Refusal::Busy,
            why: e.to_string(),
        })?;
    let pool = match live.or(found) {
        Some(pool) => reuse_pool(
            &pool,
            &metadata,
            &data,
            block_sectors,
            data_blocks,
            requested,
        )?,
        None => {
            let pool = start_pool(
                ctx,
                metadata.clone(),
                data.clone(),
                block_sectors,
                data_blocks,
                requested,
                low_water_blocks,
            )?;
            table.insert(&pool, ctx.device_name);
            pool
        }
    };
    let target: TargetRef = Arc::new(PoolTarget {
        pool: pool.clone(),
        metadata,
        data,
        block_sectors,
        low_water_blocks,
        requested,
        data_blocks,
    });
    table.add_target(&pool, &target);
    Ok(target)
}

/// `__pool_find` for a table reload of the device that runs `pool`:
/// the same devices and block size keep it; the data device may grow.
fn reuse_pool(
    pool: &Arc<Pool>,
    metadata: &DevArg,
    data: &DevArg,
    block_sectors: u64,
    data_blocks: u64,
    requested: PoolFeatures,
) -> Result<Arc<Pool>, TargetError> {
    let shared = &pool.shared;
    if shared.metadata_dev.name != metadata.name || shared.data_dev.name != data.name {
        return Err(invalid("different pool cannot replace a pool"));
    }
    if shared.block_sectors != block_sectors {
        return Err(invalid("Pool's data block size cannot be changed"));
    }
    let (discard, have, meta_have) = {
        let st = shared.state.lock();
        (
            st.requested_pf.discard_enabled,
            st.md.data_blocks().1,
            st.md.metadata_blocks().1,
        )
    };
    if discard != requested.discard_enabled {
        return Err(invalid("Discard support cannot be disabled once enabled"));
    }
    if data_blocks < have {
        return Err(invalid(format!(
            "pool target ({data_blocks} blocks) too small: expected {have}"
        )));
    }
    // `maybe_resize_metadata_dev` fails the kernel's resume; here the
    // reload is refused and the old table stays (the registry already
    // refuses to shrink a device a pool uses).
    let meta_now = metadata_blocks_of(metadata.dev.size());
    if meta_now < meta_have {
        return Err(invalid(format!(
            "metadata device ({meta_now} blocks) too small: expected {meta_have}"
        )));
    }
    Ok(pool.clone())
}

fn start_pool(
    ctx: &CtrContext<'_>,
    metadata: DevArg,
    data: DevArg,
    block_sectors: u64,
    data_blocks: u64,
    pf: PoolFeatures,
    low_water: u64,
) -> Result<Arc<Pool>, TargetError> {
    let md = PoolMetadata::open(metadata.clone(), data_blocks, block_sectors as u32)
        .map_err(|e| invalid(format!("Error creating metadata object: {e}")))?;
    let have = md.data_blocks().1;
    if data_blocks < have {
        return Err(invalid(format!(
            "pool target ({data_blocks} blocks) too small: expected {have}"
        )));
    }
    let mut adjusted = pf;
    adjust_passdown(&mut adjusted, &data);
    let shared = PoolShared::new(metadata, data, block_sectors, md, adjusted, low_water);
    {
        let mut st = shared.state.lock();
        st.requested_pf = pf;
        st.events = ctx.events.clone();
    }
    Pool::start(shared, ctx.device_name).map_err(|source| TargetError::Io {
        what: "Couldn't start the pool's worker thread",
        source,
    })
}

/// `maybe_resize_metadata_dev`: a metadata device reloaded larger grows
/// the metadata space map (and lets a pool out of metadata space write
/// again). A smaller one is refused before it gets here (the registry
/// does not shrink a device in use, a pool reload checks too); should
/// one be seen, it is left alone with an error logged, where the
/// kernel's resume fails.
fn grow_metadata(shared: &PoolShared, st: &mut PoolState) {
    if st.md.needs_check() {
        tracing::error!(pool = %shared.data_dev.name, "thin-pool: unable to grow the metadata device until repaired.");
        return;
    }
    let before = st.md.metadata_blocks().1;
    match st.md.resize_metadata() {
        Ok(false) => {}
        Ok(true) => {
            tracing::info!(pool = %shared.data_dev.name, "thin-pool: growing the metadata device from {before} to {} blocks", st.md.metadata_blocks().1);
            if st.mode == Mode::OutOfMetadataSpace {
                st.mode = Mode::Write;
                st.events.raise();
            }
            let _ = shared.commit(st);
        }
        Err(e) => tracing::error!(pool = %shared.data_dev.name, "thin-pool: {e}"),
    }
}

/// `disable_discard_passdown_if_not_supported`: discards go down to a
/// data device only if it takes them (the status then says
/// `no_discard_passdown`; the table keeps what was asked for).
fn adjust_passdown(pf: &mut PoolFeatures, data: &DevArg) {
    if pf.discard_enabled && pf.discard_passdown && !data.dev.features().discard {
        tracing::warn!(
            "thin-pool: Data device ({}) discard unsupported: Disabling discard passdown.",
            data.name
        );
        pf.discard_passdown = false;
    }
}

/// Errors of metadata messages that only refuse (the kernel's -EEXIST,
/// -ENODATA, -EBUSY, -EINVAL) leave the pool as it is; any other aborts
/// the transaction.
fn refusal_only(e: &MetadataError) -> bool {
    matches!(
        e,
        MetadataError::Exists(_)
            | MetadataError::NoSuchDevice(_)
            | MetadataError::Busy(_)
            | MetadataError::Refused(_)
    )
}

/// A refused metadata message, with the errno dm-thin-metadata.c gives
/// it: -EEXIST for an id in use (`__create_thin`, `__create_snap`),
/// -ENODATA for an id that is not (`__open_device`, the origin's
/// `dm_btree_lookup`), -EBUSY for a second metadata snapshot, -EINVAL
/// for the rest.
fn refused(verb: &str, e: &MetadataError) -> TargetError {
    let why = format!("{verb} failed: {e}");
    let errno = match e {
        MetadataError::Exists(_) => Refusal::Exists,
        MetadataError::NoSuchDevice(_) => Refusal::NoData,
        MetadataError::Busy(_) => Refusal::Busy,
        _ => return invalid(why),
    };
    TargetError::Refused { errno, why }
}

impl PoolTarget {
    fn dev_id(arg: &str) -> Result<u64, TargetError> {
        read_dev_id(arg)
            .ok_or_else(|| invalid(format!("Message received with invalid device id: {arg}")))
    }

    fn check_count(args: &[&str], n: usize) -> Result<(), TargetError> {
        if args.len() != n {
            return Err(invalid(format!(
                "Message received with {} arguments instead of {n}.",
                args.len()
            )));
        }
        Ok(())
    }

    fn run_message(
        &self,
        md: &mut PoolMetadata,
        open: bool,
        args: &[&str],
    ) -> Result<Result<(), MetadataError>, TargetError> {
        let verb = args[0].to_ascii_lowercase();
        Ok(match verb.as_str() {
            "create_thin" => {
                Self::check_count(args, 2)?;
                md.create_thin(Self::dev_id(args[1])?)
            }
            "create_snap" => {
                Self::check_count(args, 3)?;
                let dev = Self::dev_id(args[1])?;
                md.create_snap(dev, Self::dev_id(args[2])?)
            }
            "delete" => {
                Self::check_count(args, 2)?;
                let dev = Self::dev_id(args[1])?;
                if open {
                    // `__delete_device`: -EBUSY while a target has it open.
                    return Err(TargetError::Refused {
                        errno: Refusal::Busy,
                        why: format!("Deletion of thin device {dev} failed: it is open"),
                    });
                }
                md.delete(dev)
            }
            "set_transaction_id" => {
                Self::check_count(args, 3)?;
                let old: u64 = args[1].parse().map_err(|_| {
                    invalid(format!(
                        "set_transaction_id message: Unrecognised id {}.",
                        args[1]
                    ))
                })?;
                let new: u64 = args[2].parse().map_err(|_| {
                    invalid(format!(
                        "set_transaction_id message: Unrecognised new id {}.",
                        args[2]
                    ))
                })?;
                md.set_transaction_id(old, new)
            }
            "reserve_metadata_snap" => {
                Self::check_count(args, 1)?;
                md.reserve_metadata_snap()
            }
            "release_metadata_snap" => {
                Self::check_count(args, 1)?;
                md.release_metadata_snap()
            }
            _ => {
                return Err(invalid(format!(
                    "Unrecognised thin pool target message received: {}",
                    args[0]
                )))
            }
        })
    }
}

impl Target for PoolTarget {
    /// `pool_map`: I/O to the pool device goes to the data device.
    fn map(&self, bio: Bio) {
        self.pool.shared.data_dev.dev.submit(bio);
    }

    fn status(&self) -> String {
        let shared = &self.pool.shared;
        let mut st = shared.state.lock();
        if st.mode == Mode::Fail {
            return "Fail".into();
        }
        let _ = shared.commit(&mut st);
        let (mu, mt) = st.md.metadata_blocks();
        let (du, dt) = st.md.data_blocks();
        let held = match st.md.held_root() {
            0 => "-".to_string(),
            h => h.to_string(),
        };
        let mode = match st.mode {
            Mode::OutOfDataSpace => "out_of_data_space",
            Mode::OutOfMetadataSpace | Mode::ReadOnly | Mode::Fail => "ro",
            Mode::Write => "rw",
        };
        let discard = if !st.pf.discard_enabled {
            "ignore_discard"
        } else if st.pf.discard_passdown {
            "discard_passdown"
        } else {
            "no_discard_passdown"
        };
        let space = if st.pf.error_if_no_space {
            "error_if_no_space"
        } else {
            "queue_if_no_space"
        };
        let check = if st.md.needs_check() {
            "needs_check"
        } else {
            "-"
        };
        let threshold = (mt / 4).min(1024);
        format!(
            "{} {mu}/{mt} {du}/{dt} {held} {mode} {discard} {space} {check} {threshold}",
            st.md.transaction_id()
        )
    }

    /// `emit_flags` after the devices, block size and low water mark.
    fn table(&self) -> String {
        let pf = &self.requested;
        let mut flags = Vec::new();
        if !pf.zero_new_blocks {
            flags.push("skip_block_zeroing");
        }
        if !pf.discard_enabled {
            flags.push("ignore_discard");
        }
        if !pf.discard_passdown {
            flags.push("no_discard_passdown");
        }
        if pf.read_only {
            flags.push("read_only");
        }
        if pf.error_if_no_space {
            flags.push("error_if_no_space");
        }
        let mut s = format!(
            "{} {} {} {} {}",
            self.metadata,
            self.data,
            self.block_sectors,
            self.low_water_blocks,
            flags.len()
        );
        for f in flags {
            s.push(' ');
            s.push_str(f);
        }
        s
    }

    fn message(&self, args: &[&str]) -> Result<String, TargetError> {
        if args.is_empty() {
            return Err(TargetError::EmptyMessage);
        }
        let shared = &self.pool.shared;
        let id = args.get(1).and_then(|a| read_dev_id(a));
        if args[0].eq_ignore_ascii_case("delete") {
            if let Some(id) = id {
                shared.wait_closed(id);
            }
        }
        let mut st = shared.state.lock();
        if st.mode.is_read_only() {
            return Err(invalid(
                "unable to service pool target messages in READ_ONLY or FAIL mode",
            ));
        }
        let open = id.is_some_and(|id| st.open_thins.contains_key(&id));
        let r = self.run_message(&mut st.md, open, args)?;
        match r {
            Ok(()) => {
                let c = shared.commit(&mut st);
                if !c.is_ok() {
                    return Err(invalid(format!("{}: commit failed: {c:?}", args[0])));
                }
                Ok(String::new())
            }
            Err(e) if refusal_only(&e) => Err(refused(args[0], &e)),
            Err(e) => {
                shared.metadata_failed(&mut st, args[0], &e);
                Err(refused(args[0], &e))
            }
        }
    }

    /// `pool_postsuspend`: commit, so a suspended (or removed) pool has
    /// everything on disk.
    fn postsuspend(&self) {
        let shared = &self.pool.shared;
        let mut st = shared.state.lock();
        if st.md.is_dirty() {
            let _ = shared.commit(&mut st);
        }
    }

    /// `pool_preresume`: bind the new table's settings, grow the data
    /// space map to the table's length.
    fn resume(&self) {
        let shared = &self.pool.shared;
        {
            let mut st = shared.state.lock();
            let mut pf = self.requested;
            adjust_passdown(&mut pf, &self.data);
            st.pf = pf;
            st.requested_pf = self.requested;
            grow_metadata(shared, &mut st);
            st.low_water_blocks = self.low_water_blocks;
            if self.requested.read_only && st.mode == Mode::Write {
                st.mode = Mode::ReadOnly;
            }
        }
        shared.resize(self.data_blocks);
    }

    /// The data device's, but discards only when the pool passes them
    /// down (`pool_ctr` sets `num_discard_bios` only then).
    fn features(&self) -> Features {
        let mut f = self.pool.shared.data_dev.dev.features();
        f.discard &= self.requested.discard_enabled && self.requested.discard_passdown;
        f
    }
}
