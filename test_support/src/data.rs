//! Test data and scratch space: deterministic patterns (so a failure
//! reproduces) and a directory removed when the test ends.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// A scratch directory under the temporary directory, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "blkstack-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create scratch dir");
        Scratch(p)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `len` bytes of xorshift64 from `seed`: every 8 bytes differ, so data
/// that lands in the wrong place is seen.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// [`pattern`] in a file.
pub fn pattern_file(path: &Path, len: usize, seed: u64) {
    std::fs::write(path, pattern(len, seed)).expect("write pattern file");
}

/// [`pattern`] with every third 256 KiB stretch (from the second) zeroed,
/// in a file: sparse paths (holes, zero detection) get exercised.
pub fn pattern_file_with_holes(path: &Path, len: usize, seed: u64) {
    let mut v = pattern(len, seed);
    for chunk in v.chunks_mut(256 << 10).skip(1).step_by(3) {
        chunk.fill(0);
    }
    std::fs::write(path, v).expect("write pattern file");
}
