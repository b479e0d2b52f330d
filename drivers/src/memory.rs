//! `memory`: a sparse RAM disk that really stores data (Linux `brd`).
//!
//! Storage is 4 KiB pages allocated on first write, held in page maps split
//! into shards by page number, each behind its own reader/writer lock, so
//! many submitters on different pages never meet on one lock and the map
//! holds no global lock. Never-written ranges read as zeroes and cost no
//! memory; Discard and WriteZeroes free the pages they cover (WriteZeroes
//! with NOUNMAP keeps them allocated and zeroes them instead, as the flag
//! asks), so the data/hole map that [`Device::extents`] reports is exact at
//! page granularity. Optional table args: `bs=` (512..=4096, power of two)
//! and the engine args of [`crate::engine_args`]: requests go through the
//! blk-mq engine like `null`'s, so the same completion modes and tag
//! options apply (the copy itself is done in `queue_rq`).

use crate::args::{check_block_size, check_size, KvArgs};
use crate::engine_args::EngineArgs;
use crate::error::MemoryError;
use blkstack_core::device::{check_bio, Extent};
use blkstack_core::{Bio, BioFlags, Device, Features, Op, Status};
use blkstack_mq::queue::{Driver, EngineOptions, Queue, QueueRq, QueueStats, Rq};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::fmt::Write;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

pub const PAGE_SIZE: u64 = 4096;
const PAGE_SHIFT: u32 = 12;
/// Enough shards that 2..64 submitter threads rarely share one.
const SHARDS: usize = 64;

type Page = Box<[u8; PAGE_SIZE as usize]>;

/// Page numbers are already well spread integers; SipHash would cost more
/// than the copy of a small block. A multiplicative mix is enough.
#[derive(Default)]
struct PageHasher(u64);

impl Hasher for PageHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type PageMap = HashMap<u64, Page, BuildHasherDefault<PageHasher>>;

/// Page storage with per-shard locks; shared by the inline device and the
/// engine-driven one.
pub struct PageStore {
    shards: Box<[crossbeam_utils::CachePadded<RwLock<PageMap>>]>,
    allocated: AtomicU64,
}

fn zero_page() -> Page {
    Box::new([0u8; PAGE_SIZE as usize])
}

impl Default for PageStore {
    fn default() -> Self {
        Self::new()
    }
}

impl PageStore {
    pub fn new() -> PageStore {
        PageStore {
            shards: (0..SHARDS)
                .map(|_| crossbeam_utils::CachePadded::new(RwLock::new(PageMap::default())))
                .collect(),
            allocated: AtomicU64::new(0),
        }
    }

    #[inline]
    fn shard(&self, page: u64) -> &RwLock<PageMap> {
        &self.shards[(page as usize) % SHARDS]
    }

    /// Pages currently holding data.
    pub fn allocated_pages(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }

    /// Split `offset..offset+len` into per-page pieces: (page, offset in
    /// page, length, offset in the caller's buffer).
    fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize, usize, usize)> {
        let end = offset + len;
        let mut pos = offset;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let page = pos >> PAGE_SHIFT;
            let in_page = (pos & (PAGE_SIZE - 1)) as usize;
            let n = ((PAGE_SIZE as usize) - in_page).min((end - pos) as usize);
            let item = (page, in_page, n, (pos - offset) as usize);
            pos += n as u64;
            Some(item)
        })
    }

    pub fn read(&self, offset: u64, out: &mut [u8]) {
        for (page, in_page, n, at) in Self::pieces(offset, out.len() as u64) {
            let map = self.shard(page).read();
            match map.get(&page) {
                Some(p) => out[at..at + n].copy_from_slice(&p[in_page..in_page + n]),
                None => out[at..at + n].fill(0),
            }
        }
    }

    pub fn write(&self, offset: u64, data: &[u8]) {
        for (page, in_page, n, at) in Self::pieces(offset, data.len() as u64) {
            let mut map = self.shard(page).write();
            let p = map.entry(page).or_insert_with(|| {
                self.allocated.fetch_add(1, Ordering::Relaxed);
                zero_page()
            });
            p[in_page..in_page + n].copy_from_slice(&data[at..at + n]);
        }
    }

    /// Make `offset..offset+len` read as zeroes. With `keep_allocated`
    /// (NOUNMAP) every page stays or becomes allocated and is zeroed;
    /// otherwise whole pages are freed and only partial edges are zeroed.
    pub fn zero_range(&self, offset: u64, len: u64, keep_allocated: bool) {
        if len == 0 {
            return;
        }
        let end = offset + len;
        let first_full = offset.div_ceil(PAGE_SIZE);
        let end_full = end >> PAGE_SHIFT; // exclusive
                                          // Partial edge pages (at most the first and the last): zero the
                                          // covered part.
        let first_page = offset >> PAGE_SHIFT;
        let last_page = (end - 1) >> PAGE_SHIFT;
        let mut edges = [None, None];
        if !(first_full..end_full).contains(&first_page) {
            edges[0] = Some(first_page);
        }
        if last_page != first_page && !(first_full..end_full).contains(&last_page) {
            edges[1] = Some(last_page);
        }
        for page in edges.into_iter().flatten() {
            let start = (page << PAGE_SHIFT).max(offset);
            let stop = ((page + 1) << PAGE_SHIFT).min(end);
            let in_page = (start & (PAGE_SIZE - 1)) as usize;
            let n = (stop - start) as usize;
            let mut map = self.shard(page).write();
            if keep_allocated {
                let p = map.entry(page).or_insert_with(|| {
                    self.allocated.fetch_add(1, Ordering::Relaxed);
                    zero_page()
                });
                p[in_page..in_page + n].fill(0);
            } else if let Some(p) = map.get_mut(&page) {
                p[in_page..in_page + n].fill(0);
            }
        }
        if first_full >= end_full {
            return;
        }
        if keep_allocated {
            for page in first_full..end_full {
                let mut map = self.shard(page).write();
                match map.get_mut(&page) {
                    Some(p) => p.fill(0),
                    None => {
                        map.insert(page, zero_page());
                        self.allocated.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            return;
        }
        let span = end_full - first_full;
        if span <= self.allocated_pages() {
            for page in first_full..end_full {
                if self.shard(page).write().remove(&page).is_some() {
                    self.allocated.fetch_sub(1, Ordering::Relaxed);
                }
            }
        } else {
            // A huge range over a small map: visit what exists instead.
            for shard in self.shards.iter() {
                let mut map = shard.write();
                let before = map.len();
                map.retain(|&p, _| !(first_full..end_full).contains(&p));
                let freed = (before - map.len()) as u64;
                self.allocated.fetch_sub(freed, Ordering::Relaxed);
            }
        }
    }

    /// Allocated page numbers in `first..end`, sorted.
    fn pages_in(&self, first: u64, end: u64) -> Vec<u64> {
        let span = end.saturating_sub(first);
        let mut pages = Vec::new();
        if span <= self.allocated_pages().saturating_mul(2) {
            for page in first..end {
                if self.shard(page).read().contains_key(&page) {
                    pages.push(page);
                }
            }
        } else {
            for shard in self.shards.iter() {
                pages.extend(
                    shard
                        .read()
                        .keys()
                        .copied()
                        .filter(|p| (first..end).contains(p)),
                );
            }
            pages.sort_unstable();
        }
        pages
    }

    /// Data/hole runs of `offset..end`, at page granularity, clipped to the
    /// asked range.
    pub fn extents(&self, offset: u64, end: u64) -> Vec<Extent> {
        let mut out: Vec<Extent> = Vec::new();
        if offset >= end {
            return out;
        }
        let mut push = |start: u64, stop: u64, hole: bool| {
            let (s, e) = (start.max(offset), stop.min(end));
            if s >= e {
                return;
            }
            match out.last_mut() {
                Some(last) if last.hole == hole && last.offset + last.len == s => last.len += e - s,
                _ => out.push(Extent {
                    offset: s,
                    len: e - s,
                    hole,
                }),
            }
        };
        let first = offset >> PAGE_SHIFT;
        let last = end.div_ceil(PAGE_SIZE);
        let mut pos = first << PAGE_SHIFT;
        for page in self.pages_in(first, last) {
            let start = page << PAGE_SHIFT;
            push(pos, start, true);
            push(start, start + PAGE_SIZE, false);
            pos = start + PAGE_SIZE;
        }
        push(pos, last << PAGE_SHIFT, true);
        out
    }
}

/// Carry out one (already validated) bio against a page store.
fn memory_execute(store: &PageStore, bio: &Bio) -> Status {
    match bio.op {
        Op::Read => store.read(bio.offset, bio.data_mut()),
        Op::Write => store.write(bio.offset, bio.data()),
        Op::Flush => {}
        Op::Discard => store.zero_range(bio.offset, bio.len, false),
        Op::WriteZeroes => {
            store.zero_range(bio.offset, bio.len, bio.flags.contains(BioFlags::NOUNMAP))
        }
    }
    Status::Ok
}

/// The memory driver under the engine: the copy happens in `queue_rq`,
/// the completion goes wherever the engine's `irqmode` says.
pub struct MemoryDriver {
    store: PageStore,
}

impl Driver for MemoryDriver {
    #[inline]
    fn queue_rq(&self, rq: Rq<'_>) -> QueueRq {
        QueueRq::Done(memory_execute(&self.store, rq.bio))
    }
}

pub struct MemoryDevice {
    size: u64,
    block_size: u32,
    engine: EngineArgs,
    queue: Queue<MemoryDriver>,
}

impl MemoryDevice {
    /// Build from a table line's length (in bytes) and its optional
    /// `key=value` args: `bs=` and the engine args.
    pub fn from_args(size_bytes: u64, args: &[&str]) -> Result<Self, MemoryError> {
        let mut kv = KvArgs::parse("memory", args)?;
        let block_size = kv.take_block_size("bs")?;
        let engine = EngineArgs::parse(&mut kv)?;
        kv.finish()?;
        Self::build(size_bytes, block_size, engine)
    }

    /// Build with engine options set from Rust (experiments, benches).
    pub fn with_options(
        size_bytes: u64,
        block_size: u32,
        opts: EngineOptions,
    ) -> Result<Self, MemoryError> {
        let block_size = check_block_size("memory", "bs", block_size.into())?;
        Self::build(size_bytes, block_size, EngineArgs::from_options(opts))
    }

    fn build(size_bytes: u64, block_size: u32, engine: EngineArgs) -> Result<Self, MemoryError> {
        check_size("memory", size_bytes, block_size)?;
        let driver = MemoryDriver {
            store: PageStore::new(),
        };
        let queue = Queue::new(driver, engine.opts.clone())
            .map_err(|reason| MemoryError::Queue { reason })?;
        Ok(MemoryDevice {
            size: size_bytes,
            block_size,
            engine,
            queue,
        })
    }

    pub fn table_args(&self) -> String {
        let mut s = String::new();
        if self.block_size != 512 {
            let _ = write!(s, " bs={}", self.block_size);
        }
        self.engine.write_table_args(&mut s);
        s.trim_start().to_string()
    }

    pub fn status(&self) -> String {
        format!(
            "bs={} allocated_bytes={} {} {}",
            self.block_size,
            self.store().allocated_pages() * PAGE_SIZE,
            self.engine.describe(),
            self.queue.status()
        )
    }

    pub fn store(&self) -> &PageStore {
        &self.queue.driver().store
    }

    pub fn engine_stats(&self) -> QueueStats {
        self.queue.stats()
    }

    pub fn queue(&self) -> &Queue<MemoryDriver> {
        &self.queue
    }
}

impl Device for MemoryDevice {
    #[inline]
    fn submit(&self, bio: Bio) {
        if let Err(st) = check_bio(self, &bio) {
            bio.complete(st);
            return;
        }
        self.queue.submit(bio);
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn logical_block_size(&self) -> u32 {
        self.block_size
    }

    fn features(&self) -> Features {
        Features {
            discard: true,
            write_zeroes: true,
            fast_zero: true,
            knows_holes: true,
            ..Features::default()
        }
    }

    fn extents(&self, offset: u64, len: u64) -> Option<Vec<Extent>> {
        let end = offset.saturating_add(len).min(self.size);
        Some(self.store().extents(offset, end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkstack_core::submit_and_wait;
    use blkstack_core::sync::submit_and_wait_flags;
    use std::sync::Arc;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn stores_and_reads_back_across_pages() {
        for irq in ["irqmode=0", "irqmode=1"] {
            stores_and_reads_back(MemoryDevice::from_args(1 << 20, &[irq]).unwrap());
        }
    }

    fn stores_and_reads_back(d: MemoryDevice) {
        let mut w = pattern(8192 + 1024, 7);
        assert_eq!(
            submit_and_wait(&d, Op::Write, 3584, w.len() as u64, &mut w),
            Status::Ok
        );
        let mut r = vec![0xffu8; w.len()];
        assert_eq!(
            submit_and_wait(&d, Op::Read, 3584, r.len() as u64, &mut r),
            Status::Ok
        );
        assert_eq!(r, w);
        // Never written: zeroes.
        let mut r = vec![0xffu8; 4096];
        assert_eq!(
            submit_and_wait(&d, Op::Read, 65536, 4096, &mut r),
            Status::Ok
        );
        assert!(r.iter().all(|&b| b == 0));
    }

    #[test]
    fn discard_frees_and_nounmap_zeroes() {
        let d = MemoryDevice::from_args(1 << 20, &[]).unwrap();
        let mut w = pattern(16384, 1);
        submit_and_wait(&d, Op::Write, 0, 16384, &mut w);
        assert_eq!(d.store().allocated_pages(), 4);
        // Discard 512..12800: page 0 and 3 partly zeroed, pages 1-2 freed.
        assert_eq!(
            submit_and_wait(&d, Op::Discard, 512, 12288, &mut []),
            Status::Ok
        );
        assert_eq!(d.store().allocated_pages(), 2);
        let mut r = vec![0u8; 16384];
        submit_and_wait(&d, Op::Read, 0, 16384, &mut r);
        assert_eq!(&r[..512], &w[..512]);
        assert!(r[512..12800].iter().all(|&b| b == 0));
        assert_eq!(&r[12800..], &w[12800..]);
        let ext = d.extents(0, 16384).unwrap();
        assert_eq!(
            ext,
            vec![
                Extent {
                    offset: 0,
                    len: 4096,
                    hole: false
                },
                Extent {
                    offset: 4096,
                    len: 8192,
                    hole: true
                },
                Extent {
                    offset: 12288,
                    len: 4096,
                    hole: false
                },
            ]
        );
        // NOUNMAP write-zeroes keeps (allocates) the pages.
        let st = submit_and_wait_flags(&d, Op::WriteZeroes, BioFlags::NOUNMAP, 0, 16384, &mut []);
        assert_eq!(st, Status::Ok);
        assert_eq!(d.store().allocated_pages(), 4);
        submit_and_wait(&d, Op::Read, 0, 16384, &mut r);
        assert!(r.iter().all(|&b| b == 0));
        // A range inside one page zeroes just that part.
        let mut w = pattern(4096, 9);
        submit_and_wait(&d, Op::Write, 0, 4096, &mut w);
        assert_eq!(
            submit_and_wait(&d, Op::Discard, 1024, 1024, &mut []),
            Status::Ok
        );
        let mut r = vec![0u8; 4096];
        submit_and_wait(&d, Op::Read, 0, 4096, &mut r);
        assert_eq!(&r[..1024], &w[..1024]);
        assert!(r[1024..2048].iter().all(|&b| b == 0));
        assert_eq!(&r[2048..], &w[2048..]);
        // Plain write-zeroes frees them.
        assert_eq!(
            submit_and_wait(&d, Op::WriteZeroes, 0, 16384, &mut []),
            Status::Ok
        );
        assert_eq!(d.store().allocated_pages(), 0);
        assert_eq!(
            d.extents(0, 1 << 20).unwrap(),
            vec![Extent {
                offset: 0,
                len: 1 << 20,
                hole: true
            }]
        );
    }

    #[test]
    fn huge_sparse_device_extents_and_discard() {
        let size = 1u64 << 40;
        let d = MemoryDevice::from_args(size, &["bs=4096"]).unwrap();
        let mut w = pattern(4096, 3);
        submit_and_wait(&d, Op::Write, size / 2, 4096, &mut w);
        let ext = d.extents(0, size).unwrap();
        assert_eq!(ext.len(), 3);
        assert_eq!(
            ext[1],
            Extent {
                offset: size / 2,
                len: 4096,
                hole: false
            }
        );
        assert_eq!(
            submit_and_wait(&d, Op::Discard, 0, size, &mut []),
            Status::Ok
        );
        assert_eq!(d.store().allocated_pages(), 0);
    }

    #[test]
    fn bad_bios_and_args() {
        let d = MemoryDevice::from_args(1 << 20, &["bs=4096"]).unwrap();
        let mut b = vec![0u8; 512];
        assert_eq!(
            submit_and_wait(&d, Op::Write, 0, 512, &mut b),
            Status::Invalid
        );
        let mut b = vec![0u8; 4096];
        assert_eq!(
            submit_and_wait(&d, Op::Write, 1 << 20, 4096, &mut b),
            Status::Invalid
        );
        assert_eq!(d.store().allocated_pages(), 0);
        assert_eq!(d.table_args(), "bs=4096");
        let d =
            MemoryDevice::from_args(1 << 20, &["bs=4096", "irqmode=1", "submit_queues=2"]).unwrap();
        assert_eq!(d.table_args(), "bs=4096 irqmode=1 submit_queues=2");
        assert!(d.status().contains("tags=0/128"), "{}", d.status());
        assert!(MemoryDevice::from_args(1 << 20, &["bs=8192"])
            .err()
            .unwrap()
            .to_string()
            .contains("bs"));
        assert!(MemoryDevice::from_args(1 << 20, &["foo=1"])
            .err()
            .unwrap()
            .to_string()
            .contains("foo"));
    }

    #[test]
    fn concurrent_writers_distinct_blocks() {
        let d = Arc::new(MemoryDevice::from_args(8 << 20, &[]).unwrap());
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let d = d.clone();
                std::thread::spawn(move || {
                    for i in 0..256u64 {
                        let off = (i * 4 + t as u64) * 2048;
                        let mut w = pattern(2048, t.wrapping_add(i as u8));
                        assert_eq!(
                            submit_and_wait(&*d, Op::Write, off, 2048, &mut w),
                            Status::Ok
                        );
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        for t in 0..4u8 {
            for i in 0..256u64 {
                let off = (i * 4 + t as u64) * 2048;
                let mut r = vec![0u8; 2048];
                submit_and_wait(&*d, Op::Read, off, 2048, &mut r);
                assert_eq!(r, pattern(2048, t.wrapping_add(i as u8)));
            }
        }
    }
}
