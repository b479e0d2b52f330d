//! Walking a log's crash points through a copy-on-write overlay: the
//! replay origin (a RAM device) moves forward from point to point, never
//! rewound, and a `snapshot` target over it (transient store, RAM COW
//! device) takes whatever the check writes (a journal replay at mount);
//! reloading the overlay's table drops those writes before the origin
//! moves on. This is xfstests' generic/482 method with dm-snapshot in
//! place of its dm-thin snapshots, and no copy of the device per point.

use crate::log::LogReader;
use crate::reorder::{apply, choose, read_epoch, state_seed, Epoch, Selection};
use crate::sink::Sink;
use crate::walk::{Plan, Point, Replayer, WalkError};
use blkstack_core::DeviceRef;
use blkstack_mapped::targets::log_writes::format::{LOG_FLUSH_FLAG, LOG_FUA_FLAG};
use blkstack_mapped::{DmError, Registry};
use std::collections::{HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Names of the overlay's devices in its registry.
pub const ORIGIN: &str = "crash-origin";
pub const COW: &str = "crash-cow";
pub const OVERLAY: &str = "crash-overlay";

/// The overlay's chunk, in sectors: a 4 KiB filesystem block.
const CHUNK_SECTORS: u64 = 8;

/// The replay origin and the overlay over it.
pub struct Overlay {
    pub reg: Arc<Registry>,
    table: String,
    sectors: u64,
}

impl Overlay {
    /// Devices of `sectors` each (the COW device as large as the origin,
    /// so no check can overflow it) in `reg`.
    pub fn create(reg: Arc<Registry>, sectors: u64) -> Result<Overlay, DmError> {
        reg.create(ORIGIN, &format!("0 {sectors} memory"))?;
        reg.create(COW, &format!("0 {sectors} memory"))?;
        let table = format!("0 {sectors} snapshot {ORIGIN} {COW} N {CHUNK_SECTORS}");
        reg.create(OVERLAY, &table)?;
        Ok(Overlay {
            reg,
            table,
            sectors,
        })
    }

    /// The overlay `create` made earlier in `reg`.
    pub fn existing(reg: Arc<Registry>, sectors: u64) -> Overlay {
        let table = format!("0 {sectors} snapshot {ORIGIN} {COW} N {CHUNK_SECTORS}");
        Overlay {
            reg,
            table,
            sectors,
        }
    }

    /// The replayed device's size in sectors.
    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    pub fn origin(&self) -> Result<DeviceRef, DmError> {
        self.reg.device(ORIGIN)
    }

    pub fn overlay(&self) -> Result<DeviceRef, DmError> {
        self.reg.device(OVERLAY)
    }

    /// Drop everything written to the overlay: a reload of the same table
    /// (a new, empty transient store) and a resume.
    pub fn reset(&self) -> Result<(), DmError> {
        self.reg.reload(OVERLAY, &self.table)?;
        self.reg.resume(OVERLAY)?;
        Ok(())
    }

    /// Sectors the overlay holds now (the first number of its status).
    pub fn cow_sectors(&self) -> u64 {
        self.reg
            .status_text(OVERLAY)
            .ok()
            .and_then(|s| {
                s.split_whitespace()
                    .nth(3)
                    .and_then(|u| u.split('/').next())
                    .and_then(|n| n.parse().ok())
            })
            .unwrap_or(0)
    }
}

/// `--reorder N [--torn]`: the states checked after each FLUSH point.
#[derive(Clone, Copy, Debug)]
pub struct ReorderOptions {
    /// States per point (and as many torn ones with `torn`).
    pub states: u64,
    pub torn: bool,
    /// `--seed`: where the states' seeds are derived from.
    pub base_seed: u64,
}

/// One crash state beyond a point's in-order one (see `reorder.rs`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Variant {
    /// Its number among the point's states, from 1.
    pub j: u64,
    pub seed: u64,
    pub torn: bool,
    /// Entries of the epoch the state keeps, of all of them.
    pub kept: usize,
    pub epoch_entries: usize,
    /// The torn write: its entry, the blocks kept, its blocks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub torn_entry: Option<[u64; 3]>,
}

/// What a check is handed: a point as replay in order leaves it, or one
/// of the crash states of the epoch after it.
#[derive(Clone, Debug)]
pub struct State {
    pub point: Point,
    pub variant: Option<Variant>,
}

impl State {
    /// `N` for point N in order, `N.rJ` / `N.tJ` for its state J (torn).
    pub fn label(&self) -> String {
        match &self.variant {
            None => self.point.n.to_string(),
            Some(v) => format!("{}.{}{}", self.point.n, if v.torn { 't' } else { 'r' }, v.j),
        }
    }
}

/// What the check said at one point or state.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Outcome {
    pub point: Point,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub variant: Option<Variant>,
    pub ok: bool,
    /// The checker's output (fsck's, or what the block check found).
    pub output: String,
}

/// Time spent per phase over all points.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Costs {
    pub replay_s: f64,
    /// Overlay resets (reloads), the overlay's fixed cost per point.
    pub reset_s: f64,
    pub check_s: f64,
    /// Bytes of entry data replayed onto the origin.
    pub replayed_bytes: u64,
    /// Overlay sectors the checks wrote (copied-out chunks), summed.
    pub cow_sectors: u64,
}

/// Moves the origin from point to point, resetting the overlay first;
/// after a FLUSH point, with `reorder`, it hands out the epoch's states
/// one by one, each written into the emptied overlay.
pub struct Walker {
    pub overlay: Overlay,
    replayer: Replayer,
    pub plan: Plan,
    next: usize,
    pub costs: Costs,
    started: Instant,
    pub outcomes: Vec<Outcome>,
    reorder: Option<Reordering>,
    /// Overlay sectors a reorder state wrote before its check (not the
    /// check's).
    cow_base: u64,
}

/// The reorder states' own log reader (it runs ahead of the replayer by
/// one epoch) and the states still to hand out for the current point.
struct Reordering {
    opts: ReorderOptions,
    log: LogReader,
    epoch: Epoch,
    /// A state's selection is made again when it is applied (`choose` is
    /// cheap), so the queue holds no per-entry data.
    pending: VecDeque<(Point, Variant)>,
    sink: Sink,
}

impl Walker {
    pub fn new(log: &Path, plan: Plan, overlay: Overlay) -> Result<Walker, WalkError> {
        let sink = crate::sink::Sink::device(overlay.origin().map_err(dm)?);
        Ok(Walker {
            replayer: Replayer::new(log, sink)?,
            overlay,
            plan,
            next: 0,
            costs: Costs::default(),
            started: Instant::now(),
            outcomes: Vec::new(),
            reorder: None,
            cow_base: 0,
        })
    }

    /// Check `opts.states` (and as many torn) states after each FLUSH point.
    pub fn with_reorder(mut self, log: &Path, opts: ReorderOptions) -> Result<Walker, WalkError> {
        self.reorder = Some(Reordering {
            opts,
            log: LogReader::open(log)?,
            epoch: Epoch::default(),
            pending: VecDeque::new(),
            sink: Sink::device(self.overlay.overlay().map_err(dm)?),
        });
        Ok(self)
    }

    /// Reset the overlay and replay the origin to the next point, or
    /// write the next crash state of the current point's epoch into it.
    pub fn advance(&mut self) -> Result<Option<State>, WalkError> {
        self.take_cow();
        if let Some(r) = self.reorder.as_mut() {
            if let Some((point, v)) = r.pending.pop_front() {
                let sel = choose(&r.epoch, v.seed, v.torn);
                let t0 = Instant::now();
                self.overlay.reset().map_err(dm)?;
                let t1 = Instant::now();
                apply(&r.log, &r.epoch, &sel, &mut r.sink, false)?;
                self.cow_base = self.overlay.cow_sectors();
                self.costs.reset_s += (t1 - t0).as_secs_f64();
                self.costs.replay_s += t1.elapsed().as_secs_f64();
                return Ok(Some(State {
                    point,
                    variant: Some(v),
                }));
            }
        }
        let Some(p) = self.plan.points.get(self.next).cloned() else {
            return Ok(None);
        };
        self.next += 1;
        let t0 = Instant::now();
        self.overlay.reset().map_err(dm)?;
        let t1 = Instant::now();
        self.replayer.advance_to(p.entry)?;
        self.costs.reset_s += (t1 - t0).as_secs_f64();
        self.costs.replay_s += t1.elapsed().as_secs_f64();
        self.costs.replayed_bytes = self.replayer.bytes;
        if let Some(r) = self.reorder.as_mut() {
            if p.flags & LOG_FLUSH_FLAG != 0 {
                r.queue(&p)?;
            }
        }
        Ok(Some(State {
            point: p,
            variant: None,
        }))
    }

    /// Count the overlay sectors the last check wrote.
    pub fn take_cow(&mut self) {
        self.costs.cow_sectors += self.overlay.cow_sectors().saturating_sub(self.cow_base);
        self.cow_base = 0;
    }

    pub fn record(&mut self, o: Outcome, took: Duration) {
        self.costs.check_s += took.as_secs_f64();
        self.outcomes.push(o);
    }

    /// Every point (and state) in turn through `check`, stopping at the
    /// first failure when `stop_at_failure`.
    pub fn run(
        &mut self,
        stop_at_failure: bool,
        check: &mut dyn FnMut(&State, &DeviceRef) -> (bool, String),
    ) -> Result<(), WalkError> {
        let dev = self.overlay.overlay().map_err(dm)?;
        while let Some(s) = self.advance()? {
            let t = Instant::now();
            let (ok, output) = check(&s, &dev);
            self.record(
                Outcome {
                    point: s.point,
                    variant: s.variant,
                    ok,
                    output,
                },
                t.elapsed(),
            );
            if !ok && stop_at_failure {
                break;
            }
        }
        self.take_cow();
        Ok(())
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

impl Reordering {
    /// Read the epoch after FLUSH point `p` and queue its distinct states
    /// (a state equal to an earlier one, or to the in-order state, is
    /// checked once).
    fn queue(&mut self, p: &Point) -> Result<(), WalkError> {
        while self.log.position() <= p.entry {
            if self.log.next_entry()?.is_none() {
                break;
            }
        }
        self.epoch = read_epoch(&mut self.log)?;
        self.pending.clear();
        let n = self.epoch.entries.len();
        if n == 0 {
            return Ok(());
        }
        // Selections are remembered by a hash, so memory stays one word
        // per state whatever the epoch's size. The state keeping only the
        // FUA writes is the in-order state when there are none.
        let mut seen: HashSet<u64> = HashSet::new();
        if !self.epoch.entries.iter().any(|e| e.is(LOG_FUA_FLAG)) {
            seen.insert(digest(&Selection {
                keep: vec![false; n],
                torn: None,
            }));
        }
        for torn in [false, true] {
            if torn && !self.opts.torn {
                break;
            }
            for j in 1..=self.opts.states {
                let seed = state_seed(self.opts.base_seed, p.entry, j);
                let sel = choose(&self.epoch, seed, torn);
                if torn && sel.torn.is_none() {
                    continue;
                }
                let v = Variant {
                    j,
                    seed,
                    torn,
                    kept: sel.kept(),
                    epoch_entries: n,
                    torn_entry: sel
                        .torn
                        .map(|(i, k, of)| [self.epoch.entries[i].index, k, of]),
                };
                if seen.insert(digest(&sel)) {
                    self.pending.push_back((p.clone(), v));
                }
            }
        }
        Ok(())
    }
}

fn digest(sel: &Selection) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    sel.hash(&mut h);
    h.finish()
}

fn dm(e: DmError) -> WalkError {
    WalkError::Replay(crate::replay::ReplayError::Device(e.to_string()))
}
