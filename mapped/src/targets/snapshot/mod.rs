//! `snapshot <origin> <COW device> N|P|PO <chunksize>`: a copy-on-write
//! overlay over an origin (kernel `drivers/md/dm-snap.c`), with the
//! transient exception store of `dm-snap-transient.c` ([`transient`]:
//! crash replay mounts, replays and fscks an image without changing it,
//! and a reload starts the next replay point from a fresh overlay) or the
//! persistent one of `dm-snap-persistent.c` ([`persistent`]: the on-disk
//! format LVM's classic snapshots use, which the kernel loads too).
//!
//! Writes to a chunk the overlay does not hold yet first copy the origin's
//! chunk to a free chunk of the COW device (for the transient store
//! skipped when the write covers the whole chunk, as the kernel's
//! `start_full_bio`; the persistent store copies anyway, so that the
//! exception it commits before the write goes out never names a chunk
//! holding neither the old data nor the new), then go to the COW device;
//! reads of such chunks come from there, the rest from the origin. Bios
//! are split at chunk boundaries (the kernel's `max_io_len` of one
//! chunk). A flush goes to the COW device (the origin is not written
//! through a snapshot). When the COW device is full the snapshot becomes
//! invalid and every later I/O fails (`Invalid`; a persistent store marks
//! its header invalid, so a reload stays invalid), or with `PO` only
//! writes fail (`Overflow`), as the kernel's `snapshot_map`.
//!
//! `status` is the kernel's `<allocated sectors>/<COW sectors> <metadata
//! sectors>`; `table` is `<origin> <cow> N|P|PO <chunk>`. A reload of a
//! persistent snapshot onto the same COW device takes the live one's
//! exceptions over (the kernel's `__handover_exceptions`), a reload of a
//! transient one starts empty (what crashtest wants; a listed difference).
//! Feature arguments (`discard_zeroes_cow`, `discard_passdown_origin`)
//! are checked as the kernel checks them, then refused (not built).
//! `snapshot-merge` ([`merge`]) shares this constructor and store.
//! Writes to the origin are tracked when they go through
//! `snapshot-origin` ([`origin`]), which finds the snapshots of its
//! device in `LIVE`; a snapshot's reads in flight to the origin finish
//! before an origin write that made an exception goes on (the kernel's
//! tracked chunks).

pub(crate) mod merge;
pub(crate) mod origin;
mod persistent;
mod transient;

use crate::error::TargetError;
use crate::target::{CtrContext, DevArg, Events, Target, TargetRef, TargetType};
use blkstack_core::sync::submit_and_wait;
use blkstack_core::{AlignedBuf, Bio, BioFlags, DeviceRef, Features, Op, Status, SECTOR_SIZE};
use parking_lot::Mutex;
use persistent::Persistent;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use transient::Transient;

pub const TYPE: TargetType = TargetType {
    name: "snapshot",
    version: [1, 16, 0],
    ctr,
};

pub struct SnapshotTarget {
    origin: DevArg,
    cow: DevArg,
    snap: Arc<Snap>,
}

/// One snapshot's exceptions and store, which a reload onto the same
/// persistent COW device hands over to the new table (kernel `struct
/// dm_snapshot`'s `complete` table and `store`).
struct Snap {
    origin: DeviceRef,
    cow: DeviceRef,
    events: Events,
    /// Chunk size in sectors (a power of two).
    chunk_sectors: u64,
    state: Mutex<State>,
    /// A `snapshot-merge` target runs it: origin writes skip it.
    merging: AtomicBool,
    /// Writes to COW chunks in flight through a merging target.
    inflight: AtomicU64,
    /// Snapshot reads in flight to the origin.
    origin_reads: AtomicU64,
}

/// The `EndIo` word of a snapshot read sent to the origin (a merge
/// target's COW write is 0).
const ORIGIN_READ: u64 = 1;

struct State {
    /// Origin chunk -> COW chunk (the kernel's `complete` table).
    map: HashMap<u64, u64>,
    store: Store,
    valid: bool,
    /// `snapshot_overflowed`: a `PO` store ran out of room.
    overflowed: bool,
    /// The run of origin chunks being merged (first, count).
    merging: Option<(u64, u64)>,
    /// `merge_failed`.
    merge_failed: bool,
}

/// Why a merge stopped (the kernel's DMERR text).
struct NoMerge(&'static str);

/// Why no exception was made.
enum NoException {
    /// The COW device has no room for another.
    Full,
    /// Copying or committing failed: the snapshot is invalid now.
    Failed,
}

enum Store {
    Transient(Transient),
    Persistent(Persistent),
}

impl Store {
    fn prepare(&mut self, cow_bytes: u64) -> Option<u64> {
        match self {
            Store::Transient(t) => t.prepare(cow_bytes),
            Store::Persistent(p) => p.prepare(),
        }
    }

    fn commit(&mut self, old: u64, new: u64) -> bool {
        match self {
            Store::Transient(_) => true,
            Store::Persistent(p) => p.commit(old, new),
        }
    }

    fn usage(&self, cow_bytes: u64) -> (u64, u64, u64) {
        match self {
            Store::Transient(t) => t.usage(cow_bytes),
            Store::Persistent(p) => p.usage(),
        }
    }

    fn persistent(&self) -> bool {
        matches!(self, Store::Persistent(_))
    }

    fn overflow(&self) -> bool {
        matches!(self, Store::Persistent(p) if p.overflow)
    }
}

/// Live snapshots: by COW device for a reload's handover of a persistent
/// store (`__find_snapshots_sharing_cow`), by origin device for
/// `snapshot-origin` writes (the kernel's `_origins` hash).
static LIVE: Mutex<Vec<Weak<Snap>>> = Mutex::new(Vec::new());

/// Add `snap` to [`LIVE`], dropping the entries of snapshots gone (so
/// that crash replay's thousands of reloads do not grow the list).
fn register(snap: &Arc<Snap>) {
    let mut live = LIVE.lock();
    live.retain(|w| w.strong_count() > 0);
    live.push(Arc::downgrade(snap));
}

/// The live snapshots of origin device `origin`.
fn snapshots_of(origin: &DeviceRef) -> Vec<Arc<Snap>> {
    let mut live = LIVE.lock();
    live.retain(|w| w.strong_count() > 0);
    live.iter()
        .filter_map(Weak::upgrade)
        .filter(|s| same_dev(&s.origin, origin))
        .collect()
}

fn same_dev(a: &DeviceRef, b: &DeviceRef) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// Which store a table's third word names (`dm_exception_store_create`:
/// the first letter; for `P` a second letter `O` is overflow, any other
/// is refused by `persistent_ctr`; `N` ignores what follows).
fn store_kind(word: &str) -> Result<Option<bool>, TargetError> {
    let store =
        |why: String| TargetError::invalid(format!("Couldn't create exception store: {why}"));
    let mut chars = word.chars().map(|c| c.to_ascii_uppercase());
    match chars.next() {
        Some('N') => Ok(None),
        Some('P') => match chars.next() {
            None => Ok(Some(false)),
            Some('O') => Ok(Some(true)),
            Some(_) => Err(store(format!(
                "Unsupported persistent store option: {}",
                &word[1..]
            ))),
        },
        _ => Err(store(format!(
            "Exception store type is not P or N: '{word}'"
        ))),
    }
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    let (origin, cow, snap) = build(ctx, args)?;
    Ok(Arc::new(SnapshotTarget { origin, cow, snap }))
}

/// `parse_snapshot_features`: the kernel's checks of the optional group;
/// the features themselves are not built and are refused.
fn parse_features(args: &[&str]) -> Result<(), TargetError> {
    let Some(count) = args.first() else {
        return Ok(());
    };
    let n: usize = count
        .parse()
        .ok()
        .filter(|n| *n <= 2)
        .ok_or_else(|| TargetError::invalid("Invalid number of feature arguments"))?;
    if n > args.len() - 1 {
        // dm_read_arg_group gives the group's own error for this too.
        return Err(TargetError::invalid("Invalid number of feature arguments"));
    }
    let (mut zeroes, mut passdown) = (false, false);
    for w in &args[1..=n] {
        match w.to_ascii_lowercase().as_str() {
            "discard_zeroes_cow" => zeroes = true,
            "discard_passdown_origin" => passdown = true,
            _ => return Err(TargetError::invalid("Unrecognised feature requested")),
        }
    }
    if passdown && !zeroes {
        return Err(TargetError::invalid(
            "discard_passdown_origin feature depends on discard_zeroes_cow",
        ));
    }
    if zeroes || args.len() > n + 1 {
        return Err(TargetError::invalid(format!(
            "snapshot feature arguments are not supported: '{}'",
            args.join(" ")
        )));
    }
    Ok(())
}

/// `snapshot_ctr`, shared by `snapshot` and `snapshot-merge`.
fn build(
    ctx: &mut CtrContext<'_>,
    args: &[&str],
) -> Result<(DevArg, DevArg, Arc<Snap>), TargetError> {
    if args.len() < 4 {
        return Err(TargetError::invalid("requires 4 or more arguments"));
    }
    parse_features(&args[4..])?;
    let origin = ctx
        .get_device(args[0], 0, ctx.len)
        .map_err(|e| in_context("Cannot get origin device", e))?;
    let cow = ctx
        .get_device(args[1], 0, 0)
        .map_err(|e| in_context("Cannot get COW device", e))?;
    if origin.name == cow.name {
        return Err(TargetError::invalid(
            "COW device cannot be the same as origin device",
        ));
    }
    let persistent = store_kind(args[2])?;
    let table_chunk = chunk_size(args[3], &origin, &cow)?;
    let snap = match persistent {
        None if table_chunk == 0 => return Err(TargetError::invalid("Chunk size not set")),
        None => {
            let store = Store::Transient(Transient::new(table_chunk));
            let snap = Arc::new(Snap::new(
                &origin,
                &cow,
                &ctx.events,
                table_chunk,
                store,
                Vec::new(),
                true,
            ));
            register(&snap);
            snap
        }
        Some(overflow) => persistent_snap(&origin, &cow, &ctx.events, table_chunk, overflow)?,
    };
    Ok((origin, cow, snap))
}

/// A persistent snapshot: the live one on this COW device if there is
/// one (handover), else the store read from the COW device.
fn persistent_snap(
    origin: &DevArg,
    cow: &DevArg,
    events: &Events,
    table_chunk: u64,
    overflow: bool,
) -> Result<Arc<Snap>, TargetError> {
    let mut live = LIVE.lock();
    live.retain(|w| w.strong_count() > 0);
    if let Some(s) = live
        .iter()
        .filter_map(Weak::upgrade)
        .find(|s| same_dev(&s.cow, &cow.dev) && s.state.lock().store.persistent())
    {
        if let Store::Persistent(p) = &mut s.state.lock().store {
            // The new table's `PO` or `P` wins, as __handover_exceptions
            // keeps the destination's userspace_supports_overflow.
            p.overflow = overflow;
        }
        return Ok(s);
    }
    let check = |c: u64| check_chunk(c, origin, cow);
    let opened = Persistent::open(cow.dev.clone(), table_chunk, overflow, &check)?;
    let chunk = opened.store.chunk_sectors();
    let snap = Arc::new(Snap::new(
        origin,
        cow,
        events,
        chunk,
        Store::Persistent(opened.store),
        opened.exceptions,
        opened.valid,
    ));
    live.push(Arc::downgrade(&snap));
    Ok(snap)
}

impl Snap {
    fn new(
        origin: &DevArg,
        cow: &DevArg,
        events: &Events,
        chunk_sectors: u64,
        store: Store,
        ex: Vec<(u64, u64)>,
        valid: bool,
    ) -> Snap {
        Snap {
            origin: origin.dev.clone(),
            cow: cow.dev.clone(),
            events: events.clone(),
            chunk_sectors,
            state: Mutex::new(State {
                map: ex.into_iter().collect(),
                store,
                valid,
                overflowed: false,
                merging: None,
                merge_failed: false,
            }),
            merging: AtomicBool::new(false),
            inflight: AtomicU64::new(0),
            origin_reads: AtomicU64::new(0),
        }
    }
}

/// Kernel `set_chunk_size` / `dm_exception_store_set_chunk_size`; 0 is
/// "not set" (a persistent store then reads it from its header or takes
/// the default, a transient one is refused by the caller).
fn chunk_size(arg: &str, origin: &DevArg, cow: &DevArg) -> Result<u64, TargetError> {
    let store = |why: &str| TargetError::invalid(format!("Couldn't create exception store: {why}"));
    // kstrtouint: decimal digits (an optional leading '+'), fitting u32.
    let digits = arg.strip_prefix('+').unwrap_or(arg);
    let c: u32 = Some(digits)
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|d| d.parse().ok())
        .ok_or_else(|| store("Invalid chunk size"))?;
    if c == 0 {
        return Ok(0);
    }
    check_chunk(c as u64, origin, cow).map_err(|why| store(&why.to_string()))?;
    Ok(c as u64)
}

/// Why `dm_exception_store_set_chunk_size` refuses a chunk size, in its
/// words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(super) enum ChunkSizeError {
    #[error("Chunk size is not a power of 2")]
    NotPowerOfTwo,
    #[error("Chunk size is not a multiple of device blocksize")]
    NotBlockMultiple,
    #[error("Chunk size is too high")]
    TooHigh,
}

/// `dm_exception_store_set_chunk_size`'s checks of a chunk size.
fn check_chunk(c: u64, origin: &DevArg, cow: &DevArg) -> Result<(), ChunkSizeError> {
    if !c.is_power_of_two() {
        return Err(ChunkSizeError::NotPowerOfTwo);
    }
    for d in [cow, origin] {
        let lbs = (d.dev.logical_block_size() as u64 / SECTOR_SIZE).max(1);
        if !c.is_multiple_of(lbs) {
            return Err(ChunkSizeError::NotBlockMultiple);
        }
    }
    if c > (i32::MAX as u64) >> 9 {
        return Err(ChunkSizeError::TooHigh);
    }
    Ok(())
}

fn in_context(context: &str, source: TargetError) -> TargetError {
    TargetError::In {
        context: context.to_string(),
        source: Box::new(source),
    }
}

impl SnapshotTarget {
    fn chunk_bytes(&self) -> u64 {
        self.snap.chunk_bytes()
    }
}

impl Snap {
    fn chunk_bytes(&self) -> u64 {
        self.chunk_sectors * SECTOR_SIZE
    }

    /// `__invalidate_snapshot`: no more I/O, and a persistent store marks
    /// its header invalid.
    fn invalidate(&self, st: &mut State, why: &str) {
        if !st.valid {
            return;
        }
        tracing::error!("snapshot: Invalidating snapshot: {why}");
        if let Store::Persistent(p) = &mut st.store {
            p.drop_snapshot();
        }
        st.valid = false;
        self.events.raise();
    }

    /// The COW chunk that holds origin chunk `chunk` for a write, copying
    /// the origin's data there first unless the write covers it all (and
    /// the store is transient). `None` when the write must fail.
    fn chunk_for_write(&self, chunk: u64, whole: bool) -> Option<u64> {
        let mut st = self.state.lock();
        if !st.valid || st.overflowed {
            return None;
        }
        if let Some(&c) = st.map.get(&chunk) {
            return Some(c);
        }
        let copy = !whole || st.store.persistent();
        match self.new_exception(&mut st, chunk, copy) {
            Ok(c) => Some(c),
            Err(NoException::Failed) => None,
            Err(NoException::Full) if st.store.overflow() => {
                tracing::error!("snapshot: Snapshot overflowed: Unable to allocate exception.");
                st.overflowed = true;
                self.events.raise();
                None
            }
            Err(NoException::Full) => {
                self.invalidate(&mut st, "Unable to allocate exception.");
                None
            }
        }
    }

    /// Before a write through `snapshot-origin` to origin chunk `chunk`:
    /// keep the chunk's data in this snapshot if it lacks it (the
    /// kernel's `__origin_write`, which invalidates a full snapshot even
    /// with `PO`, and goes on with the origin write either way).
    fn keep_for_origin(&self, chunk: u64) {
        if self.merging.load(Ordering::Acquire) {
            return;
        }
        let mut st = self.state.lock();
        if !st.valid || st.map.contains_key(&chunk) {
            return;
        }
        if self.new_exception(&mut st, chunk, true).is_err() {
            self.invalidate(&mut st, "Unable to allocate exception.");
            return;
        }
        drop(st);
        // Reads of the origin this snapshot sent before the exception
        // existed finish before the origin changes (the kernel's
        // __check_for_conflicting_io over its tracked chunks); later
        // reads of the chunk go to the COW device.
        while self.origin_reads.load(Ordering::Acquire) > 0 {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// A new exception for origin chunk `chunk` (prepare, copy the chunk
    /// out if `copy`, commit), under the state lock so that a second
    /// write to the same chunk waits for it instead of racing it (the
    /// kernel's pending exception). An I/O error invalidates the
    /// snapshot; a full COW device is left to the caller.
    fn new_exception(&self, st: &mut State, chunk: u64, copy: bool) -> Result<u64, NoException> {
        let Some(new) = st.store.prepare(self.cow.size()) else {
            return Err(NoException::Full);
        };
        if (copy && !self.copy_out(chunk, new)) || !st.store.commit(chunk, new) {
            self.invalidate(st, "Error reading/writing.");
            return Err(NoException::Failed);
        }
        st.map.insert(chunk, new);
        Ok(new)
    }

    /// Copy origin chunk `old` to COW chunk `new` (kernel `start_copy`:
    /// the last chunk may be short of the origin's end).
    fn copy_out(&self, old: u64, new: u64) -> bool {
        let cb = self.chunk_bytes();
        let len = cb.min(self.origin.size().saturating_sub(old * cb));
        if len == 0 {
            return true;
        }
        // Aligned: a file leaf below may do direct I/O.
        let mut buf = AlignedBuf::new(len as usize);
        let b = buf.as_mut_slice();
        let r = submit_and_wait(&*self.origin, Op::Read, old * cb, len, b);
        let w = if r.is_ok() {
            submit_and_wait(&*self.cow, Op::Write, new * cb, len, b)
        } else {
            r
        };
        if !w.is_ok() {
            tracing::error!(?w, "snapshot: copying a chunk out failed");
        }
        w.is_ok()
    }
}

impl Target for SnapshotTarget {
    fn map(&self, mut bio: Bio) {
        if bio.op == Op::Flush || (bio.len == 0 && bio.flags.contains(BioFlags::PREFLUSH)) {
            self.cow.dev.submit(bio);
            return;
        }
        let cb = self.chunk_bytes();
        let chunk = bio.offset / cb;
        let within = bio.offset % cb;
        match bio.op {
            Op::Read => {
                let st = self.snap.state.lock();
                if !st.valid {
                    drop(st);
                    bio.complete(Status::IoError);
                    return;
                }
                match st.map.get(&chunk) {
                    Some(&c) => {
                        drop(st);
                        bio.offset = c * cb + within;
                        self.cow.dev.submit(bio);
                    }
                    None => {
                        // Counted until done, so that an origin write
                        // making an exception waits for it (only while
                        // there is a snapshot-origin to write: crash
                        // replay's overlays read without the frame).
                        if origin::any_live() {
                            self.snap.origin_reads.fetch_add(1, Ordering::AcqRel);
                            bio.push_end(self.snap.clone(), ORIGIN_READ);
                        }
                        drop(st);
                        self.origin.dev.submit(bio);
                    }
                }
            }
            Op::Write | Op::WriteZeroes => {
                let whole = within == 0 && bio.len == cb;
                match self.snap.chunk_for_write(chunk, whole) {
                    Some(c) => {
                        bio.offset = c * cb + within;
                        self.cow.dev.submit(bio);
                    }
                    None => bio.complete(Status::IoError),
                }
            }
            _ => bio.complete(Status::NotSupported),
        }
    }

    fn status(&self) -> String {
        status_of(&self.snap, &self.cow)
    }

    fn table(&self) -> String {
        table_of(&self.snap, &self.origin, &self.cow)
    }

    fn max_io_len(&self, offset: u64) -> u64 {
        let cb = self.chunk_bytes();
        cb - offset % cb
    }

    fn features(&self) -> Features {
        let cow = self.cow.dev.features();
        Features {
            discard: false,
            write_zeroes: false,
            fast_zero: false,
            knows_holes: false,
            read_only: false,
            ..cow
        }
    }
}

/// `snapshot_status` STATUSTYPE_INFO.
fn status_of(snap: &Snap, cow: &DevArg) -> String {
    let st = snap.state.lock();
    if !st.valid {
        return "Invalid".into();
    }
    if st.merge_failed {
        return "Merge failed".into();
    }
    if st.overflowed {
        return "Overflow".into();
    }
    let (alloc, total, meta) = st.store.usage(cow.dev.size());
    format!("{alloc}/{total} {meta}")
}

/// `snapshot_status` STATUSTYPE_TABLE.
fn table_of(snap: &Snap, origin: &DevArg, cow: &DevArg) -> String {
    let st = snap.state.lock();
    let kind = match &st.store {
        Store::Transient(_) => "N",
        Store::Persistent(p) if p.overflow => "PO",
        Store::Persistent(_) => "P",
    };
    format!("{origin} {cow} {kind} {}", snap.chunk_sectors)
}

#[cfg(test)]
mod tests;
