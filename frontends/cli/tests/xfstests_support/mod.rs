//! xfstests' own `replay-log`, built from its sources (copied in
//! tests/data/xfstests-log-writes, see the README there) with the system C
//! compiler, as the judge of our dm-log-writes logs and of `blkstack
//! replay-log`. Built once per target directory; a test calls
//! [`xfstests_replay_log`] and skips (fails under CI), saying why, when
//! there is no C compiler or it cannot build the tool.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn sources() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/xfstests-log-writes")
}

fn build() -> Result<PathBuf, String> {
    let out_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/xfstests-replay-log");
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    // One file per test binary and process, renamed into place, so
    // parallel test binaries never run a half-written tool.
    let bin = out_dir.join("replay-log");
    let tmp = out_dir.join(format!("replay-log.{}", std::process::id()));
    let src = sources();
    let out = Command::new("cc")
        .arg("-O2")
        .arg("-o")
        .arg(&tmp)
        .arg(src.join("replay-log.c"))
        .arg(src.join("log-writes.c"))
        .output()
        .map_err(|e| format!("no C compiler (cc: {e}); make deps installs one"))?;
    if !out.status.success() {
        return Err(format!(
            "cc could not build xfstests' replay-log: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    std::fs::rename(&tmp, &bin).map_err(|e| format!("{}: {e}", bin.display()))?;
    Ok(bin)
}

/// The path of xfstests' replay-log, or `None` where it cannot be built
/// (a failure under CI, a `SKIP` line elsewhere).
pub fn xfstests_replay_log() -> Option<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match BIN.get_or_init(build) {
        Ok(p) => Some(p.clone()),
        Err(why) => {
            blkstack_test_support::skip(&format!("no xfstests replay-log: {why}"));
            None
        }
    }
}
