//! Walking a log's crash points through a copy-on-write overlay: the
//! replay origin (a RAM device) moves forward from point to point, never
//! rewound, and a `snapshot` target over it (transient store, RAM COW
//! device) takes whatever the check writes (a journal replay at mount);
//! reloading the overlay's table drops those writes before the origin
//! moves on. This is xfstests' generic/482 method with dm-snapshot in
//! place of its dm-thin snapshots, and no copy of the device per point.

use crate::walk::{Plan, Point, Replayer, WalkError};
use blkstack_core::DeviceRef;
use blkstack_mapped::{DmError, Registry};
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
}

impl Overlay {
    /// Devices of `sectors` each (the COW device as large as the origin,
    /// so no check can overflow it) in `reg`.
    pub fn create(reg: Arc<Registry>, sectors: u64) -> Result<Overlay, DmError> {
        reg.create(ORIGIN, &format!("0 {sectors} memory"))?;
        reg.create(COW, &format!("0 {sectors} memory"))?;
        let table = format!("0 {sectors} snapshot {ORIGIN} {COW} N {CHUNK_SECTORS}");
        reg.create(OVERLAY, &table)?;
        Ok(Overlay { reg, table })
    }

    /// The overlay `create` made earlier in `reg`.
    pub fn existing(reg: Arc<Registry>, sectors: u64) -> Overlay {
        let table = format!("0 {sectors} snapshot {ORIGIN} {COW} N {CHUNK_SECTORS}");
        Overlay { reg, table }
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

/// What the check said at one point.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Outcome {
    pub point: Point,
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

/// Moves the origin from point to point, resetting the overlay first.
pub struct Walker {
    pub overlay: Overlay,
    replayer: Replayer,
    pub plan: Plan,
    next: usize,
    pub costs: Costs,
    started: Instant,
    pub outcomes: Vec<Outcome>,
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
        })
    }

    /// Reset the overlay and replay the origin to the next point.
    pub fn advance(&mut self) -> Result<Option<Point>, WalkError> {
        let Some(p) = self.plan.points.get(self.next).cloned() else {
            return Ok(None);
        };
        self.next += 1;
        self.costs.cow_sectors += self.overlay.cow_sectors();
        let t0 = Instant::now();
        self.overlay.reset().map_err(dm)?;
        let t1 = Instant::now();
        self.replayer.advance_to(p.entry)?;
        self.costs.reset_s += (t1 - t0).as_secs_f64();
        self.costs.replay_s += t1.elapsed().as_secs_f64();
        self.costs.replayed_bytes = self.replayer.bytes;
        Ok(Some(p))
    }

    pub fn record(&mut self, o: Outcome, took: Duration) {
        self.costs.check_s += took.as_secs_f64();
        self.outcomes.push(o);
    }

    /// Every point in turn through `check`, stopping at the first failure
    /// when `stop_at_failure`.
    pub fn run(
        &mut self,
        stop_at_failure: bool,
        check: &mut dyn FnMut(&Point, &DeviceRef) -> (bool, String),
    ) -> Result<(), WalkError> {
        let dev = self.overlay.overlay().map_err(dm)?;
        while let Some(p) = self.advance()? {
            let t = Instant::now();
            let (ok, output) = check(&p, &dev);
            self.record(
                Outcome {
                    point: p,
                    ok,
                    output,
                },
                t.elapsed(),
            );
            if !ok && stop_at_failure {
                break;
            }
        }
        self.costs.cow_sectors += self.overlay.cow_sectors();
        Ok(())
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

fn dm(e: DmError) -> WalkError {
    WalkError::Replay(crate::replay::ReplayError::Device(e.to_string()))
}
