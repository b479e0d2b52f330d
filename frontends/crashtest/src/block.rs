//! Block workloads that record through a `log-writes` stack in this
//! process, and the checks that judge each replayed crash point:
//!
//! - `verify`, the bench's verify rule at crash points: rounds of
//!   concurrent 4 KiB writes of self-describing blocks (block number,
//!   generation, a pattern made from both), each round ended by a FLUSH;
//!   at every point, each block holds a valid stamp no older than the last
//!   write to it acknowledged before the last completed flush.
//! - `journal`, a filesystem-like journal: each transaction writes its
//!   data blocks, FLUSHes, then writes a commit record (with the data
//!   blocks' hashes) with FUA, as jbd2 and the XFS log order a commit. At
//!   every point, a transaction whose commit record is present must have
//!   all its data. Two ordering bugs can be planted, the kind crash
//!   testing exists to find. `no-flush` leaves out the flush before the
//!   commit: the FUA commit is durable (logged) at once, its data only at
//!   a later flush, so an in-order point shows it. `same-epoch` writes the
//!   commit as a plain write right after its data and flushes after both:
//!   every in-order point has both, and only a crash state that keeps the
//!   commit but not all its data (`--reorder`) shows it.
//!
//! In a torn state (`--torn`) a verify block may also be a mix, block by
//! block of the log, of its stamp before the epoch and the one the epoch
//! wrote: that is what tearing makes, and it is still no lost write.

use blkstack_core::sync::submit_and_wait_flags;
use blkstack_core::{BioFlags, DeviceRef, Op, Status};
use blkstack_mapped::{DmError, Registry};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const BLOCK: usize = 4096;
const STAMP_MAGIC: &[u8; 8] = b"BLKSTAMP";
const COMMIT_MAGIC: &[u8; 8] = b"JCOMMIT\0";

/// Names of the recording stack's devices.
pub const DATA: &str = "crash-data";
pub const LOG: &str = "crash-log";
pub const LOG_WRITES: &str = "crash-lw";

/// A `log-writes` stack over a RAM data device, its log in a file.
pub struct Recorder {
    pub reg: Arc<Registry>,
    pub log_path: PathBuf,
}

impl Recorder {
    /// `sectors` of data; the log file may grow to `log_sectors`.
    pub fn create(log_path: &Path, sectors: u64, log_sectors: u64) -> Result<Recorder, DmError> {
        let reg = Registry::new();
        reg.create(DATA, &format!("0 {sectors} memory"))?;
        reg.create(
            LOG,
            &format!("0 {log_sectors} file {} create", log_path.display()),
        )?;
        reg.create(LOG_WRITES, &format!("0 {sectors} log-writes {DATA} {LOG}"))?;
        Ok(Recorder {
            reg,
            log_path: log_path.to_path_buf(),
        })
    }

    pub fn device(&self) -> Result<DeviceRef, DmError> {
        self.reg.device(LOG_WRITES)
    }

    /// Remove the log-writes device (its log ends with the kernel's
    /// `dm-log-writes-end` mark and is complete on the file).
    pub fn finish(self) -> Result<PathBuf, DmError> {
        self.reg.remove(LOG_WRITES, true)?;
        self.reg.remove_all();
        Ok(self.log_path)
    }
}

/// The block-sized pattern of (block, generation).
pub fn stamp(block: u64, gen: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    b[..8].copy_from_slice(STAMP_MAGIC);
    b[8..16].copy_from_slice(&block.to_le_bytes());
    b[16..24].copy_from_slice(&gen.to_le_bytes());
    let mut x = block.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ gen;
    for chunk in b[24..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let w = x.to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
    b
}

/// The generation a block holds, if it is a whole valid stamp of `block`.
fn stamp_gen(block: u64, data: &[u8]) -> Option<u64> {
    if &data[..8] != STAMP_MAGIC || data[8..16] != block.to_le_bytes() {
        return None;
    }
    let gen = u64::from_le_bytes(data[16..24].try_into().ok()?);
    (stamp(block, gen) == data).then_some(gen)
}

fn io(dev: &DeviceRef, op: Op, flags: BioFlags, block: u64, buf: &mut [u8]) -> Status {
    let len = if op.has_data() { buf.len() as u64 } else { 0 };
    submit_and_wait_flags(&**dev, op, flags, block * BLOCK as u64, len, buf)
}

fn must(st: Status, what: &str) -> anyhow::Result<()> {
    if st.is_ok() {
        Ok(())
    } else {
        anyhow::bail!("{what}: {st:?}")
    }
}

/// Write `(block, data)` pairs concurrently, as a queue would have them
/// in flight together, so they complete (and enter the log) in any order.
fn write_all(dev: &DeviceRef, writes: &[(u64, Vec<u8>)]) -> anyhow::Result<()> {
    std::thread::scope(|s| {
        let hs: Vec<_> = writes
            .iter()
            .map(|(b, d)| {
                s.spawn(move || {
                    let mut d = d.clone();
                    io(dev, Op::Write, BioFlags::NONE, *b, &mut d)
                })
            })
            .collect();
        for h in hs {
            let st = h.join().unwrap_or(Status::IoError);
            must(st, "a workload write")?;
        }
        Ok(())
    })
}

fn flush(dev: &DeviceRef) -> anyhow::Result<()> {
    must(io(dev, Op::Flush, BioFlags::NONE, 0, &mut []), "a flush")
}

/// A small xorshift for block choices (no dependency for a test pattern).
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// The verify workload's expectations: after flush k (from 1), the
/// generation each block must have at least.
pub struct VerifyModel {
    pub blocks: u64,
    after_flush: Vec<Vec<u64>>,
}

/// `rounds` rounds of `per_round` concurrent writes over `blocks` blocks,
/// a FLUSH after each.
pub fn run_verify(
    dev: &DeviceRef,
    blocks: u64,
    rounds: u64,
    per_round: u64,
) -> anyhow::Result<VerifyModel> {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut acked = vec![0u64; blocks as usize];
    let mut after_flush = Vec::new();
    let mut gen = 0;
    for _ in 0..rounds {
        let mut writes: Vec<(u64, Vec<u8>)> = Vec::new();
        while (writes.len() as u64) < per_round.min(blocks) {
            let b = rng.below(blocks);
            if writes.iter().all(|w| w.0 != b) {
                gen += 1;
                writes.push((b, stamp(b, gen)));
            }
        }
        write_all(dev, &writes)?;
        for (b, d) in &writes {
            acked[*b as usize] = u64::from_le_bytes(d[16..24].try_into()?);
        }
        flush(dev)?;
        after_flush.push(acked.clone());
    }
    Ok(VerifyModel {
        blocks,
        after_flush,
    })
}

impl VerifyModel {
    /// Check the device at a point after `flushes` completed flushes.
    pub fn check(&self, dev: &DeviceRef, flushes: u64) -> (bool, String) {
        self.check_state(dev, flushes, false)
    }

    /// The check of a point, or of a crash state of the epoch after it;
    /// `torn`: a block may be a sector-wise mix of its stamp at the point
    /// and the one the epoch wrote.
    pub fn check_state(&self, dev: &DeviceRef, flushes: u64, torn: bool) -> (bool, String) {
        let zero = vec![0u64; self.blocks as usize];
        let want = match flushes {
            0 => &zero,
            k => match self.after_flush.get(k as usize - 1) {
                Some(w) => w,
                None => {
                    return (
                        false,
                        format!("the log has {k} flushes, the workload made fewer"),
                    )
                }
            },
        };
        let mut bad = Vec::new();
        let mut buf = vec![0u8; BLOCK];
        for b in 0..self.blocks {
            if !io(dev, Op::Read, BioFlags::NONE, b, &mut buf).is_ok() {
                bad.push(format!("block {b}: read failed"));
                continue;
            }
            let need = want[b as usize];
            let got = stamp_gen(b, &buf);
            let ok = match got {
                Some(g) => g >= need,
                None => need == 0 && buf.iter().all(|&x| x == 0),
            } || (torn && self.is_torn(b, need, flushes, &buf));
            if !ok {
                bad.push(format!(
                    "block {b}: holds {}, a write of generation {need} was acknowledged before the flush",
                    got.map_or("no valid stamp".to_string(), |g| format!("generation {g}"))
                ));
            }
        }
        summarize(
            bad,
            format!(
                "{} blocks as acknowledged before flush {flushes}",
                self.blocks
            ),
        )
    }
}

impl VerifyModel {
    /// Is `data` a sector-wise mix of block `b`'s stamp of generation
    /// `old` (zeroes for 0) and the one the epoch after flush `flushes`
    /// wrote? (Each round writes a block at most once.)
    fn is_torn(&self, b: u64, old: u64, flushes: u64, data: &[u8]) -> bool {
        let Some(new) = self
            .after_flush
            .get(flushes as usize)
            .map(|w| w[b as usize])
            .filter(|&g| g != old)
        else {
            return false;
        };
        let before = if old == 0 {
            vec![0u8; BLOCK]
        } else {
            stamp(b, old)
        };
        let after = stamp(b, new);
        data.chunks(512)
            .zip(before.chunks(512).zip(after.chunks(512)))
            .all(|(d, (x, y))| d == x || d == y)
    }
}

fn summarize(bad: Vec<String>, good: String) -> (bool, String) {
    if bad.is_empty() {
        return (true, good);
    }
    let n = bad.len();
    let mut s: Vec<String> = bad.into_iter().take(8).collect();
    if n > 8 {
        s.push(format!("... and {} more", n - 8));
    }
    (false, s.join("\n"))
}

/// An ordering bug to plant in the journal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Bug {
    /// The FUA commit record without the flush before it.
    NoFlush,
    /// A plain commit write in its data's flush epoch, one flush after.
    SameEpoch,
}

impl Bug {
    pub fn name(self) -> &'static str {
        match self {
            Bug::NoFlush => "no-flush",
            Bug::SameEpoch => "same-epoch",
        }
    }
}

/// The journal's geometry: `txns` commit blocks, then each transaction's
/// `per_txn` data blocks.
#[derive(Clone, Copy, Debug)]
pub struct Journal {
    pub txns: u64,
    pub per_txn: u64,
}

/// FNV-1a, for the commit record's data hashes.
fn hash(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

impl Journal {
    /// Blocks the journal spans.
    pub fn blocks(&self) -> u64 {
        self.txns * (1 + self.per_txn)
    }

    fn data_block(&self, t: u64, i: u64) -> u64 {
        self.txns + t * self.per_txn + i
    }

    /// Run every transaction, with the planted bug if any. A last FLUSH
    /// makes the tail durable either way.
    pub fn run(&self, dev: &DeviceRef, plant: Option<Bug>) -> anyhow::Result<()> {
        for t in 0..self.txns {
            let writes: Vec<(u64, Vec<u8>)> = (0..self.per_txn)
                .map(|i| {
                    let b = self.data_block(t, i);
                    (b, stamp(b, t + 1))
                })
                .collect();
            write_all(dev, &writes)?;
            if plant.is_none() {
                flush(dev)?;
            }
            let mut rec = vec![0u8; BLOCK];
            rec[..8].copy_from_slice(COMMIT_MAGIC);
            rec[8..16].copy_from_slice(&t.to_le_bytes());
            rec[16..24].copy_from_slice(&self.per_txn.to_le_bytes());
            for (i, (b, d)) in writes.iter().enumerate() {
                let at = 24 + i * 16;
                rec[at..at + 8].copy_from_slice(&b.to_le_bytes());
                rec[at + 8..at + 16].copy_from_slice(&hash(d).to_le_bytes());
            }
            let how = match plant {
                Some(Bug::SameEpoch) => BioFlags::NONE,
                _ => BioFlags::FUA,
            };
            must(io(dev, Op::Write, how, t, &mut rec), "a commit write")?;
            if plant == Some(Bug::SameEpoch) {
                flush(dev)?;
            }
        }
        flush(dev)
    }

    /// Every transaction whose commit record is on the device has all its
    /// data there.
    pub fn check(&self, dev: &DeviceRef) -> (bool, String) {
        let mut bad = Vec::new();
        let mut committed = 0;
        let mut rec = vec![0u8; BLOCK];
        let mut buf = vec![0u8; BLOCK];
        for t in 0..self.txns {
            if !io(dev, Op::Read, BioFlags::NONE, t, &mut rec).is_ok() {
                bad.push(format!("commit block {t}: read failed"));
                continue;
            }
            if &rec[..8] != COMMIT_MAGIC || rec[8..16] != t.to_le_bytes() {
                continue;
            }
            committed += 1;
            let n = u64::from_le_bytes(rec[16..24].try_into().unwrap_or_default());
            for i in 0..n.min(((BLOCK - 24) / 16) as u64) as usize {
                let at = 24 + i * 16;
                let b = u64::from_le_bytes(rec[at..at + 8].try_into().unwrap_or_default());
                let h = u64::from_le_bytes(rec[at + 8..at + 16].try_into().unwrap_or_default());
                let ok = io(dev, Op::Read, BioFlags::NONE, b, &mut buf).is_ok() && hash(&buf) == h;
                if !ok {
                    bad.push(format!(
                        "transaction {t} is committed but its data block {b} is not there \
                         (the commit record reached the disk before its data)"
                    ));
                }
            }
        }
        summarize(
            bad,
            format!("{committed} committed transactions, all with their data"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_fails_when_an_acknowledged_write_is_missing() {
        let reg = Registry::new();
        reg.create("d", "0 2048 memory").unwrap();
        let dev = reg.device("d").unwrap();
        let m = run_verify(&dev, 64, 10, 8).unwrap();
        let (ok, out) = m.check(&dev, 10);
        assert!(ok, "{out}");
        // Older expectations hold too: blocks only move forward.
        assert!(m.check(&dev, 3).0);
        let victim = (0..64).find(|&b| m.after_flush[9][b as usize] > 0).unwrap();
        let mut z = vec![0u8; BLOCK];
        assert!(io(&dev, Op::Write, BioFlags::NONE, victim, &mut z).is_ok());
        let (ok, out) = m.check(&dev, 10);
        assert!(!ok);
        assert!(
            out.contains(&format!("block {victim}: holds no valid stamp")),
            "{out}"
        );
        assert!(!m.check(&dev, 11).0, "a flush the workload never made");
    }

    #[test]
    fn journal_check_fails_on_a_commit_without_its_data() {
        let reg = Registry::new();
        reg.create("d", "0 2048 memory").unwrap();
        let dev = reg.device("d").unwrap();
        let j = Journal {
            txns: 4,
            per_txn: 4,
        };
        j.run(&dev, None).unwrap();
        assert!(j.check(&dev).0);
        let mut z = vec![0u8; BLOCK];
        assert!(io(&dev, Op::Write, BioFlags::NONE, j.data_block(2, 1), &mut z).is_ok());
        let (ok, out) = j.check(&dev);
        assert!(!ok && out.contains("transaction 2 is committed"), "{out}");
    }
}
