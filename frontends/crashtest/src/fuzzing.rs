//! Fuzzing entry point (cargo-fuzz's `replay_log` target, and the stable
//! test that replays its corpus): a dm-log-writes log from bytes, read
//! and replayed as `blkstack replay-log` and `crashtest` do. The log is
//! the one input of theirs a stranger may have written, so every way of
//! walking it must end in a named error or a replay that stays inside
//! the target device: never a panic, a hang, a write past the device's
//! end or work out of proportion to the log's size.
//!
//! The log lives in a memfd (no file is made on disk) and the replay
//! target is a 1 MiB `memory` device, whose size no entry may change.

use crate::replay::{self, ReplayDev, ReplayOptions};
use crate::sink::Sink;
use crate::walk::{self, PlanOptions, PointRule, Replayer};
use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Op, Status};
use blkstack_mapped::Registry;
use std::fs::File;
use std::io::Write;
use std::os::fd::FromRawFd;
use std::path::PathBuf;

/// The replay target: 1 MiB.
const TARGET_SECTORS: u64 = 2048;

/// Crash points a fuzzed log may ask the walk to replay to.
const MAX_POINTS: usize = 16;

/// One log: print it as replay-log without `--replay` does, replay it
/// whole onto the target, then plan its crash points and replay to each.
/// What the whole replay left on the target's first 64 KiB, or its error.
pub fn log(input: &[u8]) -> Result<Vec<u8>, String> {
    let (_file, path) = memfd_with(input).ok_or("no memfd")?;
    let reg = Registry::new();
    let dev = reg
        .create("target", &format!("0 {TARGET_SECTORS} memory"))
        .map_err(|e| e.to_string())?;
    let mut sink = std::io::sink();
    let info = ReplayOptions {
        log: path.clone(),
        num_entries: true,
        ..Default::default()
    };
    let _ = replay::run(&info, &mut sink);
    let whole = ReplayOptions {
        log: path.clone(),
        replay: Some(ReplayDev::Device {
            name: "target".into(),
            dev: dev.clone(),
        }),
        verbose: 2,
        ..Default::default()
    };
    let replayed = replay::run(&whole, &mut sink).map_err(|e| e.to_string());
    let mut head = vec![0u8; 64 << 10];
    let read = submit_and_wait(&*dev, Op::Read, 0, head.len() as u64, &mut head);
    // A crash state of the first epoch, torn: a log's lies must end in
    // an error there too, never in a panic or a huge allocation.
    let state = ReplayOptions {
        log: path.clone(),
        replay: whole.replay.clone(),
        limit: 1,
        reorder_seed: Some(input.len() as u64),
        torn: true,
        ..Default::default()
    };
    let _ = replay::run(&state, &mut sink);
    let plan_options = PlanOptions {
        rule: PointRule::Durable,
        start_mark: None,
        every_nth: 1,
        max_points: Some(MAX_POINTS),
    };
    if let Ok(plan) = walk::plan(&path, &plan_options) {
        if let Ok(mut r) = Replayer::new(&path, Sink::device(dev.clone())) {
            for p in &plan.points {
                if r.advance_to(p.entry).is_err() {
                    break;
                }
            }
        }
    }
    use blkstack_core::Device;
    assert_eq!(
        dev.size(),
        TARGET_SECTORS * 512,
        "the replay changed the target's size"
    );
    reg.remove_all();
    assert_eq!(read, Status::Ok, "reading the replay target back");
    replayed.map(|()| head)
}

/// A memfd holding `data`, and a path that opens it.
fn memfd_with(data: &[u8]) -> Option<(File, PathBuf)> {
    // SAFETY: the name is a NUL-terminated literal; the call only
    // creates a new file descriptor.
    let fd = unsafe { libc::memfd_create(c"replay-log-fuzz".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just created and nothing else owns it.
    let mut f = unsafe { File::from_raw_fd(fd) };
    f.write_all(data).ok()?;
    let path = PathBuf::from(format!("/proc/self/fd/{fd}"));
    Some((f, path))
}
