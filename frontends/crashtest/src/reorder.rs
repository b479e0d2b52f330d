//! Crash states beyond replay in order, as CrashMonkey (Mohan et al., OSDI
//! 2018) makes them: a drive's volatile cache may persist any subset of
//! the writes it acknowledged since the last completed FLUSH, in any
//! order, and a power cut may tear a multi-sector write. A state is
//! (flush point `k`, seed, mode): the device as replay in order leaves it
//! at FLUSH entry `k`, plus a seeded subset of the epoch after it (the
//! entries after `k` up to, not including, the next FLUSH entry or the
//! log's end), applied in log order.
//!
//! - Plain writes and discards of the epoch are the subset's members, each
//!   kept with probability 1/2 (a discard a drive had not acted on is as
//!   lost as a write).
//! - FUA writes are always kept: log-writes logs a FUA write when it
//!   completes, and a completed FUA write is durable, so a crash after the
//!   epoch's last acknowledgement (the moment these states stand for)
//!   finds it on the medium. Earlier crash moments are the in-order FUA
//!   points' business. The next FLUSH entry (with a PREFLUSH write's data)
//!   is never part of the epoch: it is the next in-order point.
//! - `torn`: one multi-block data write (never FUA) is kept as a prefix of
//!   its blocks, at the log's block size (the device's logical block,
//!   the unit a drive writes atomically): the last multi-block write the
//!   subset kept, or, if it kept none, one the generator picks among the
//!   epoch's. An epoch without a multi-block plain write has nothing to
//!   tear; its torn states equal its plain ones.
//!
//! Determinism: the state depends only on the log, `k`, the seed and the
//! mode. The generator is ChaCha8 (`rand_chacha`, whose output for a key
//! is fixed by the algorithm, not by a crate version) keyed with the seed
//! as 8 little-endian bytes followed by 24 zero bytes, stream 0; only
//! `next_u64` is used, never `rand`'s distributions (which may change
//! between versions): one draw per plain entry in log order (kept when the
//! top bit is 1), then for `torn`, if the subset kept no multi-block
//! write, one draw to pick one (`draw % count`), then one for the prefix
//! (`1 + draw % (blocks - 1)` blocks).
//!
//! `crashtest` derives the seeds of a point's states from `--seed`, the
//! point's entry and the state's number with SplitMix64 (`state_seed`);
//! the derivation only picks seeds, the printed seed alone rebuilds the
//! state (`replay-log --limit K+1 --reorder-seed S [--torn]`).

use crate::log::{Entry, LogError, LogReader};
use crate::replay::{copy_data_len, ReplayError};
use crate::sink::Sink;
use blkstack_mapped::targets::log_writes::format::{
    LOG_DISCARD_FLAG, LOG_FLUSH_FLAG, LOG_FUA_FLAG, LOG_MARK_FLAG,
};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// At most this many entries in one epoch: a bound on what a log that
/// never flushes can make this hold in memory.
pub const MAX_EPOCH: usize = 1 << 20;

/// The entries a crash inside one flush epoch chooses from.
#[derive(Clone, Debug, Default)]
pub struct Epoch {
    /// Writes and discards (marks and empty entries left out), in log order.
    pub entries: Vec<Entry>,
    /// The FLUSH entry that ends it (`None`: the log ended first).
    pub ends_at: Option<u64>,
    /// The log's block size.
    pub block: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum EpochError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("the flush epoch after entry {after} has more than {MAX_EPOCH} entries: too many to reorder")]
    TooLarge { after: u64 },
}

/// Read the epoch that starts where `r` is (the entry after a flush
/// point): entries up to the next FLUSH entry, which is read and dropped.
pub fn read_epoch(r: &mut LogReader) -> Result<Epoch, EpochError> {
    let after = r.position().saturating_sub(1);
    let mut ep = Epoch {
        block: r.sup.sectorsize as u64,
        ..Epoch::default()
    };
    while let Some(e) = r.next_entry()? {
        if e.is(LOG_FLUSH_FLAG) {
            ep.ends_at = Some(e.index);
            break;
        }
        if e.dev_len == 0 || e.is(LOG_MARK_FLAG) {
            continue;
        }
        if ep.entries.len() == MAX_EPOCH {
            return Err(EpochError::TooLarge { after });
        }
        ep.entries.push(e);
    }
    Ok(ep)
}

/// Which of an epoch's entries a state keeps, and the torn one.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Selection {
    /// One per epoch entry.
    pub keep: Vec<bool>,
    /// (position in the epoch, blocks kept of the write's blocks).
    pub torn: Option<(usize, u64, u64)>,
}

impl Selection {
    pub fn kept(&self) -> usize {
        self.keep.iter().filter(|k| **k).count()
    }
}

fn multi_block(e: &Entry, block: u64) -> bool {
    !e.is(LOG_FUA_FLAG) && !e.is(LOG_DISCARD_FLAG) && e.dev_len > block
}

/// The state `seed` (and `torn`) makes of `ep`; see the module doc for
/// the exact draws.
pub fn choose(ep: &Epoch, seed: u64, torn: bool) -> Selection {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    let mut rng = ChaCha8Rng::from_seed(key);
    let keep: Vec<bool> = ep
        .entries
        .iter()
        .map(|e| e.is(LOG_FUA_FLAG) || rng.next_u64() >> 63 == 1)
        .collect();
    let mut sel = Selection { keep, torn: None };
    if !torn {
        return sel;
    }
    let bs = ep.block.max(1);
    let last_kept = (0..ep.entries.len())
        .rev()
        .find(|&i| sel.keep[i] && multi_block(&ep.entries[i], bs));
    let victim = last_kept.or_else(|| {
        let multi: Vec<usize> = (0..ep.entries.len())
            .filter(|&i| multi_block(&ep.entries[i], bs))
            .collect();
        (!multi.is_empty()).then(|| multi[(rng.next_u64() % multi.len() as u64) as usize])
    });
    if let Some(i) = victim {
        let blocks = ep.entries[i].dev_len / bs;
        let prefix = 1 + rng.next_u64() % (blocks - 1);
        sel.keep[i] = true;
        sel.torn = Some((i, prefix, blocks));
    }
    sel
}

/// Apply a state's entries to `sink` in log order (a torn write as its
/// prefix), then sync. `no_discard` skips discards, as replay-log's
/// option. Returns the bytes written.
pub fn apply(
    log: &LogReader,
    ep: &Epoch,
    sel: &Selection,
    sink: &mut Sink,
    no_discard: bool,
) -> Result<u64, ReplayError> {
    let mut bytes = 0;
    for (i, e) in ep.entries.iter().enumerate() {
        if !sel.keep.get(i).copied().unwrap_or(false) {
            continue;
        }
        if e.is(LOG_DISCARD_FLAG) {
            if !no_discard {
                sink.discard(e.dev_at, e.dev_len)?;
            }
            continue;
        }
        let len = match sel.torn {
            Some((t, prefix, _)) if t == i => prefix * ep.block,
            _ => e.data_len,
        };
        copy_data_len(log, e, sink, e.dev_at, len)?;
        bytes += len;
    }
    sink.sync();
    Ok(bytes)
}

/// What happens to each epoch entry in a state, as `replay-log -v` prints.
pub fn describe(ep: &Epoch, sel: &Selection, e_at: usize) -> String {
    let e = &ep.entries[e_at];
    match sel.torn {
        Some((t, prefix, blocks)) if t == e_at => format!("torn: {prefix} of {blocks} blocks"),
        _ if e.is(LOG_FUA_FLAG) => "kept (FUA)".into(),
        _ if sel.keep[e_at] => "kept".into(),
        _ => "dropped".into(),
    }
}

/// SplitMix64's output function (Steele, Lea, Flood 2014).
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of state `j` at the point at log entry `entry`, from `base`
/// (`crashtest --seed`).
pub fn state_seed(base: u64, entry: u64, j: u64) -> u64 {
    splitmix64(base ^ splitmix64(entry ^ splitmix64(j)))
}

#[cfg(test)]
#[path = "reorder_tests.rs"]
mod tests;
