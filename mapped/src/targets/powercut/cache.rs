//! The volatile write cache of `powercut`: the newest data of every
//! sector written since it was last written down, as a disk's DRAM cache
//! holds it. No kernel source to follow (dm has no such target); the
//! model is the ATA/NVMe volatile write cache the block layer's
//! `REQ_PREFLUSH`/`REQ_FUA` exist for (Documentation/block/writeback_cache_control.rst).
//!
//! The cache is a map from start sector to a [`Piece`]: a run of sectors
//! of one acknowledged [`Write`]. Pieces never overlap: a new write
//! punches the sectors it covers out of older pieces (splitting them,
//! without copying their data, which the pieces share through the
//! `Arc<Write>`), so only the last write of a sector can survive a cut,
//! as a real cache holds only that. A piece being written down keeps its
//! place (and stays readable) until the write completes, so a read never
//! falls through to stale data on the device; the batch that wrote it
//! then removes exactly its pieces ([`Cache::finish`]).
//!
//! Accounting: `bytes` counts cached data sectors (what a cut can lose),
//! `mem` the buffers still referenced by a piece (what `max_dirty`
//! bounds: a partly overwritten write keeps its whole buffer). Freed
//! buffers of the common sizes go to a bounded [`BufPool`] for the next
//! writes.

use blkstack_core::SECTOR_SHIFT;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// What one write carries.
pub(super) enum Payload {
    /// A write's data, copied from the submitter's buffer.
    Data(Box<[u8]>),
    /// Write-zeroes: reads as zeroes, goes down as a write-zeroes
    /// (`NOUNMAP` kept).
    Zeroes { nounmap: bool },
    /// A discard: reads as zeroes while cached, goes down as a discard.
    Discard,
}

/// One acknowledged write, shared by the pieces that are left of it.
pub(super) struct Write {
    /// Arrival order: the oldest writes are forced down first.
    pub seq: u64,
    /// First sector of the write as submitted.
    pub start: u64,
    /// Its length in sectors as submitted.
    pub len: u64,
    pub payload: Payload,
    /// Pieces of the cache that refer to it (changed under the cache's
    /// lock only; atomic because the `Write` is shared with writebacks).
    pieces: AtomicU32,
    /// Where its buffer goes when the last reference drops.
    pool: Arc<BufPool>,
}

impl Drop for Write {
    fn drop(&mut self) {
        if let Payload::Data(d) = std::mem::replace(&mut self.payload, Payload::Discard) {
            self.pool.give(d);
        }
    }
}

/// Buffer sizes kept for reuse: powers of two from 4 KiB to 128 KiB.
const POOL_SHIFTS: std::ops::RangeInclusive<u32> = 12..=17;

/// Data buffers of freed writes, kept for the next writes of the same
/// size: every cached write is a copy, and handing freed copies back to
/// the allocator only for it to fault fresh pages in for the next batch
/// costs more than the copy. Bounded in bytes.
pub(super) struct BufPool {
    classes: Mutex<[Vec<Box<[u8]>>; 6]>,
    /// Bytes it may keep.
    cap: u64,
    held: AtomicU64,
}

impl BufPool {
    /// A pool keeping at most `cap` bytes.
    pub fn new(cap: u64) -> Arc<BufPool> {
        Arc::new(BufPool {
            classes: Mutex::new(Default::default()),
            cap,
            held: AtomicU64::new(0),
        })
    }

    fn class(len: usize) -> Option<usize> {
        let shift = len.trailing_zeros();
        (len.is_power_of_two() && POOL_SHIFTS.contains(&shift))
            .then(|| (shift - POOL_SHIFTS.start()) as usize)
    }

    /// A copy of `data`, in a kept buffer when one of its size is there.
    pub fn copy(&self, data: &[u8]) -> Box<[u8]> {
        if let Some(c) = Self::class(data.len()) {
            let kept = self.classes.lock()[c].pop();
            if let Some(mut b) = kept {
                self.held.fetch_sub(b.len() as u64, Ordering::Relaxed);
                b.copy_from_slice(data);
                return b;
            }
        }
        data.into()
    }

    fn give(&self, b: Box<[u8]>) {
        let len = b.len() as u64;
        let Some(c) = Self::class(b.len()) else {
            return;
        };
        if self.held.load(Ordering::Relaxed) + len > self.cap {
            return;
        }
        self.held.fetch_add(len, Ordering::Relaxed);
        self.classes.lock()[c].push(b);
    }
}

impl Write {
    /// The data of `sector..sector+len` of this write (`None` for zeroes
    /// and discards).
    pub fn data(&self, sector: u64, len: u64) -> Option<&[u8]> {
        match &self.payload {
            Payload::Data(d) => {
                let off = ((sector - self.start) << SECTOR_SHIFT) as usize;
                Some(&d[off..off + (len << SECTOR_SHIFT) as usize])
            }
            _ => None,
        }
    }

    fn buffer_len(&self) -> u64 {
        match &self.payload {
            Payload::Data(d) => d.len() as u64,
            _ => 0,
        }
    }

    fn is_data(&self) -> bool {
        matches!(self.payload, Payload::Data(_))
    }
}

/// A run of sectors of the cache, all from one write.
#[derive(Clone)]
pub(super) struct Piece {
    /// Length in sectors.
    pub len: u64,
    pub write: Arc<Write>,
    /// Part of the batch being written down now.
    pub writing: bool,
}

/// A run of one write's sectors handed to the device: a piece taken for
/// a batch or chosen to survive a cut.
#[derive(Clone)]
pub(super) struct Extent {
    /// First sector.
    pub start: u64,
    /// Length in sectors.
    pub len: u64,
    pub write: Arc<Write>,
    /// Goes down with FUA (a FUA write's sectors, when the device has FUA).
    pub fua: bool,
}

/// How much of a range the cache holds.
pub(super) enum Coverage {
    None,
    Full,
    Partial,
}

/// The cache itself; the caller holds it under its state lock.
pub(super) struct Cache {
    map: BTreeMap<u64, Piece>,
    pool: Arc<BufPool>,
    next_seq: u64,
    /// Data bytes of the pieces (what a cut can lose).
    pub bytes: u64,
    /// Bytes of the write buffers some piece still refers to.
    pub mem: u64,
    /// Writes some piece still refers to.
    pub writes: u64,
}

impl Default for Cache {
    /// A cache whose freed buffers go back to the allocator.
    fn default() -> Cache {
        Cache::new(BufPool::new(0))
    }
}

impl Cache {
    /// An empty cache whose freed buffers go to `pool`.
    pub fn new(pool: Arc<BufPool>) -> Cache {
        Cache {
            map: BTreeMap::new(),
            pool,
            next_seq: 0,
            bytes: 0,
            mem: 0,
            writes: 0,
        }
    }

    /// Pieces in the cache.
    pub fn pieces(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether a write of `bytes` may enter now without going past
    /// `max_dirty` bytes or `max_pieces` pieces (it may split one piece
    /// in two). A write larger than the whole cache enters an empty one.
    pub fn fits(&self, bytes: u64, max_dirty: u64, max_pieces: usize) -> bool {
        self.map.is_empty() || (self.mem + bytes <= max_dirty && self.map.len() + 2 <= max_pieces)
    }

    /// Cache a write of `len` sectors at `start`, replacing what older
    /// writes left of those sectors.
    pub fn insert(&mut self, start: u64, len: u64, payload: Payload) -> Arc<Write> {
        self.next_seq += 1;
        let write = Arc::new(Write {
            seq: self.next_seq,
            start,
            len,
            payload,
            pieces: AtomicU32::new(0),
            pool: self.pool.clone(),
        });
        self.punch(start, start + len);
        self.attach(
            start,
            Piece {
                len,
                write: write.clone(),
                writing: false,
            },
        );
        write
    }

    fn attach(&mut self, start: u64, piece: Piece) {
        if piece.write.pieces.fetch_add(1, Ordering::Relaxed) == 0 {
            self.writes += 1;
            self.mem += piece.write.buffer_len();
        }
        if piece.write.is_data() {
            self.bytes += piece.len << SECTOR_SHIFT;
        }
        self.map.insert(start, piece);
    }

    fn detach(&mut self, start: u64) -> Option<Piece> {
        let piece = self.map.remove(&start)?;
        if piece.write.is_data() {
            self.bytes -= piece.len << SECTOR_SHIFT;
        }
        if piece.write.pieces.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.writes -= 1;
            self.mem -= piece.write.buffer_len();
        }
        Some(piece)
    }

    /// Remove `start..end` from every piece (a newer write covers it);
    /// the parts outside stay, sharing their write's buffer.
    fn punch(&mut self, start: u64, end: u64) {
        // A piece starting before `start` may reach into the range.
        if let Some((&s, p)) = self.map.range(..start).next_back() {
            if s + p.len > start {
                let p = self.detach(s).expect("piece just found");
                let pend = s + p.len;
                self.attach(
                    s,
                    Piece {
                        len: start - s,
                        ..p.clone()
                    },
                );
                if pend > end {
                    self.attach(
                        end,
                        Piece {
                            len: pend - end,
                            ..p
                        },
                    );
                }
            }
        }
        while let Some((&s, _)) = self.map.range(start..end).next() {
            let p = self.detach(s).expect("piece just found");
            let pend = s + p.len;
            if pend > end {
                self.attach(
                    end,
                    Piece {
                        len: pend - end,
                        ..p
                    },
                );
            }
        }
    }

    /// The pieces overlapping `start..end`, clipped to it, in order.
    fn overlapping(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, u64, &Piece)> {
        let before = self
            .map
            .range(..start)
            .next_back()
            .filter(|(&s, p)| s + p.len > start);
        before
            .into_iter()
            .chain(self.map.range(start..end))
            .map(move |(&s, p)| {
                let lo = s.max(start);
                let hi = (s + p.len).min(end);
                (lo, hi - lo, p)
            })
    }

    /// How much of `start..end` the cache holds.
    pub fn coverage(&self, start: u64, end: u64) -> Coverage {
        let covered: u64 = self.overlapping(start, end).map(|(_, len, _)| len).sum();
        match covered {
            0 => Coverage::None,
            c if c == end - start => Coverage::Full,
            _ => Coverage::Partial,
        }
    }

    /// Copy what the cache holds of `start..` into `out` (a read's
    /// buffer for sectors `start..start + out.len()/512`).
    pub fn read_into(&self, start: u64, out: &mut [u8]) {
        let end = start + (out.len() as u64 >> SECTOR_SHIFT);
        for (s, len, p) in self.overlapping(start, end) {
            copy_piece(&p.write, s, len, start, out);
        }
    }

    /// The pieces overlapping `start..end`, clipped, for a read that
    /// lays them over what the device returns.
    pub fn snapshot(&self, start: u64, end: u64) -> Vec<(u64, u64, Arc<Write>)> {
        self.overlapping(start, end)
            .map(|(s, len, p)| (s, len, p.write.clone()))
            .collect()
    }

    /// Mark every piece not being written as part of a new batch; its
    /// extents go to `out`, in sector order.
    pub fn take_all(&mut self, out: &mut Vec<Extent>) {
        for (&s, p) in self.map.iter_mut().filter(|(_, p)| !p.writing) {
            p.writing = true;
            out.push(extent(s, p));
        }
    }

    /// [`Cache::take_all`] for the pieces overlapping `start..end` (a FUA
    /// write's sectors: its own pieces, or newer writes that replaced
    /// them, which must be as durable now), whole.
    pub fn take_range(&mut self, start: u64, end: u64, fua: bool, out: &mut Vec<Extent>) {
        let first = self
            .map
            .range(..start)
            .next_back()
            .filter(|(&s, p)| s + p.len > start)
            .map_or(start, |(&s, _)| s);
        for (&s, p) in self.map.range_mut(first..end).filter(|(_, p)| !p.writing) {
            p.writing = true;
            out.push(Extent {
                fua,
                ..extent(s, p)
            });
        }
    }

    /// Take the oldest pieces not being written until they hold at least
    /// `bytes` bytes and `pieces` pieces (a full cache forcing writes
    /// down, oldest first).
    pub fn take_oldest(&mut self, bytes: u64, pieces: usize, out: &mut Vec<Extent>) -> usize {
        let mut order: Vec<(u64, u64)> = self
            .map
            .iter()
            .filter(|(_, p)| !p.writing)
            .map(|(&s, p)| (p.write.seq, s))
            .collect();
        order.sort_unstable();
        let (mut got_bytes, mut got) = (0, 0);
        for (_, s) in order {
            if got_bytes >= bytes && got >= pieces {
                break;
            }
            let p = self.map.get_mut(&s).expect("piece just listed");
            p.writing = true;
            if p.write.is_data() {
                got_bytes += p.len << SECTOR_SHIFT;
            }
            got += 1;
            out.push(extent(s, p));
        }
        got
    }

    /// A batch ended: remove what it wrote (`ok`), or give it back to the
    /// cache to be written again (it failed). Pieces a newer write split
    /// keep their write and their `writing` mark; pieces of newer writes
    /// in the same sectors are not touched.
    pub fn finish(&mut self, batch: &[Extent], ok: bool) {
        let mut done = Vec::new();
        for e in batch {
            for (&s, p) in self.map.range_mut(e.start..e.start + e.len) {
                if p.writing && Arc::ptr_eq(&p.write, &e.write) {
                    if ok {
                        done.push(s);
                    } else {
                        p.writing = false;
                    }
                }
            }
            for s in done.drain(..) {
                self.detach(s);
            }
        }
    }

    /// Empty the cache (a power cut): every piece, in sector order.
    pub fn drain(&mut self) -> Vec<Extent> {
        let out = std::mem::take(&mut self.map)
            .into_iter()
            .map(|(s, p)| extent(s, &p))
            .collect();
        self.bytes = 0;
        self.mem = 0;
        self.writes = 0;
        out
    }
}

fn extent(start: u64, p: &Piece) -> Extent {
    Extent {
        start,
        len: p.len,
        write: p.write.clone(),
        fua: false,
    }
}

/// Copy `sector..sector+len` of `write` into `out`, a buffer that starts
/// at sector `base`.
pub(super) fn copy_piece(write: &Write, sector: u64, len: u64, base: u64, out: &mut [u8]) {
    let off = ((sector - base) << SECTOR_SHIFT) as usize;
    let dst = &mut out[off..off + (len << SECTOR_SHIFT) as usize];
    match write.data(sector, len) {
        Some(src) => dst.copy_from_slice(src),
        None => dst.fill(0),
    }
}

/// The writes a list of extents belongs to, in the order each first
/// appears (for a cut, which decides per write).
pub(super) fn group_by_write(extents: Vec<Extent>) -> Vec<Vec<Extent>> {
    let mut index: HashMap<u64, usize> = HashMap::new();
    let mut groups: Vec<Vec<Extent>> = Vec::new();
    for e in extents {
        match index.entry(e.write.seq) {
            std::collections::hash_map::Entry::Occupied(o) => groups[*o.get()].push(e),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(groups.len());
                groups.push(vec![e]);
            }
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(byte: u8, sectors: u64) -> Payload {
        Payload::Data(vec![byte; (sectors << SECTOR_SHIFT) as usize].into())
    }

    fn read(c: &Cache, start: u64, sectors: u64) -> Vec<u8> {
        let mut out = vec![0xEEu8; (sectors << SECTOR_SHIFT) as usize];
        c.read_into(start, &mut out);
        out
    }

    #[test]
    fn overwrites_replace_and_split_without_losing_the_rest() {
        let mut c = Cache::default();
        c.insert(0, 8, data(1, 8));
        c.insert(2, 2, data(2, 2));
        assert_eq!(c.pieces(), 3, "head, new write, tail");
        assert_eq!(c.writes, 2);
        assert_eq!(c.bytes, 8 * 512);
        assert_eq!(c.mem, 10 * 512, "the split write keeps its whole buffer");
        let r = read(&c, 0, 8);
        assert!(r[..1024].iter().all(|&b| b == 1));
        assert!(r[1024..2048].iter().all(|&b| b == 2));
        assert!(r[2048..].iter().all(|&b| b == 1));
        c.insert(0, 8, data(3, 8));
        assert_eq!((c.pieces(), c.writes, c.mem), (1, 1, 8 * 512));
        assert!(read(&c, 0, 8).iter().all(|&b| b == 3));
    }

    #[test]
    fn coverage_and_zero_pieces() {
        let mut c = Cache::default();
        c.insert(4, 4, Payload::Zeroes { nounmap: false });
        assert!(matches!(c.coverage(0, 4), Coverage::None));
        assert!(matches!(c.coverage(4, 8), Coverage::Full));
        assert!(matches!(c.coverage(2, 6), Coverage::Partial));
        assert_eq!(c.bytes, 0, "zeroes hold no data");
        assert!(read(&c, 4, 4).iter().all(|&b| b == 0));
    }

    #[test]
    fn finish_removes_only_what_the_batch_wrote() {
        let mut c = Cache::default();
        c.insert(0, 8, data(1, 8));
        let mut batch = Vec::new();
        c.take_all(&mut batch);
        assert_eq!(batch.len(), 1);
        // A newer write lands in the middle while the batch is in flight.
        c.insert(2, 2, data(2, 2));
        c.finish(&batch, true);
        assert_eq!(c.pieces(), 1, "only the newer write is left");
        assert_eq!(c.writes, 1);
        assert!(read(&c, 2, 2).iter().all(|&b| b == 2));
        let mut again = Vec::new();
        c.take_all(&mut again);
        c.finish(&again, false);
        assert_eq!(c.pieces(), 1, "a failed batch gives its pieces back");
        let mut third = Vec::new();
        c.take_all(&mut third);
        assert_eq!(third.len(), 1, "... to be written again");
    }

    #[test]
    fn take_oldest_goes_by_age_not_by_sector() {
        let mut c = Cache::default();
        c.insert(100, 1, data(1, 1));
        c.insert(0, 1, data(2, 1));
        c.insert(50, 1, data(3, 1));
        let mut out = Vec::new();
        c.take_oldest(1024, 0, &mut out);
        let starts: Vec<u64> = out.iter().map(|e| e.start).collect();
        assert_eq!(starts, vec![100, 0]);
    }

    #[test]
    fn freed_buffers_are_reused_within_the_pool_bound() {
        let pool = BufPool::new(8192);
        let mut c = Cache::new(pool.clone());
        c.insert(0, 8, Payload::Data(pool.copy(&[1; 4096])));
        c.insert(0, 8, Payload::Data(pool.copy(&[2; 4096])));
        assert_eq!(
            pool.held.load(Ordering::Relaxed),
            4096,
            "the replaced write's buffer"
        );
        let b = pool.copy(&[3; 4096]);
        assert_eq!(pool.held.load(Ordering::Relaxed), 0);
        assert!(b.iter().all(|&x| x == 3));
        for _ in 0..4 {
            pool.give(vec![0; 4096].into());
        }
        assert_eq!(pool.held.load(Ordering::Relaxed), 8192, "bounded");
        pool.give(vec![0; 1000].into());
        assert_eq!(
            pool.held.load(Ordering::Relaxed),
            8192,
            "only the size classes"
        );
    }

    #[test]
    fn fits_bounds_bytes_and_pieces_but_takes_a_big_write_when_empty() {
        let mut c = Cache::default();
        assert!(c.fits(1 << 30, 4096, 8), "an empty cache takes anything");
        c.insert(0, 8, data(1, 8));
        assert!(!c.fits(512, 4096, 8));
        assert!(c.fits(512, 8192, 8));
        assert!(!c.fits(512, 8192, 2));
    }
}
