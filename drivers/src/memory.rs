//! `memory`: a sparse RAM disk that really stores data (Linux `brd`).
//!
//! Storage is 4 KiB pages allocated on first write, held in sharded maps
//! of 64 KiB chunks (`store.rs`: [`PageStore`]). Never-written ranges read as zeroes and cost no
//! memory; Discard and WriteZeroes free the pages they cover (WriteZeroes
//! with NOUNMAP keeps them allocated and zeroes them instead, as the flag
//! asks), so the data/hole map that [`Device::extents`] reports is exact at
//! page granularity. Optional table args: `bs=` (512..=4096, power of two)
//! and the engine args of [`crate::engine_args`]: requests go through the
//! blk-mq engine on the same emulated disk as `null`'s
//! ([`crate::emulation`]), so the same completion modes (`iopoll=1`
//! included) and tag options apply (the copy itself is done in
//! `queue_rq`).
//!
//! Allocation is bounded, as a thin pool's data device is: `max_alloc=SIZE`
//! bounds one device, and a process-wide budget (by default three quarters
//! of the machine's MemAvailable when the first memory device is built)
//! bounds all of them together. A write that needs a page past either bound
//! fails with [`Status::NoSpace`] (ENOSPC, as dm-thin's out-of-data-space
//! error mode answers) instead of growing until the OOM killer wakes.
//! The page store is shared through an `Arc` so a table reload can carry it
//! to the new table, as dm keeps the underlying device across a reload.

use crate::args::{check_block_size, check_size, KvArgs};
use crate::emulation::{Emulated, EmulatedDisk};
use crate::engine_args::EngineArgs;
use crate::error::{ArgError, MemoryError};
use blkstack_core::device::Extent;
use blkstack_core::{Bio, BioFlags, Features, Op, Status};
use blkstack_mq::{Disk, DiskLimits, Driver, EngineOptions, QueueRq, Rq};
use std::fmt::Write;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

mod slab;
mod store;

pub use store::PageStore;

pub const PAGE_SIZE: u64 = 4096;
const PAGE_SHIFT: u32 = 12;
/// Pages every memory device of the process may hold together.
pub struct AllocBudget {
    used_pages: AtomicU64,
    limit_pages: AtomicU64,
}

impl AllocBudget {
    pub const fn new(limit_bytes: u64) -> AllocBudget {
        AllocBudget {
            used_pages: AtomicU64::new(0),
            limit_pages: AtomicU64::new(limit_bytes / PAGE_SIZE),
        }
    }

    pub fn limit_bytes(&self) -> u64 {
        self.limit_pages
            .load(Ordering::Relaxed)
            .saturating_mul(PAGE_SIZE)
    }

    /// Change the bound; pages already held stay (later allocations fail
    /// until enough are freed).
    pub fn set_limit_bytes(&self, bytes: u64) {
        self.limit_pages.store(bytes / PAGE_SIZE, Ordering::Relaxed);
    }

    pub fn used_bytes(&self) -> u64 {
        self.used_pages.load(Ordering::Relaxed) * PAGE_SIZE
    }

    fn try_take(&self) -> bool {
        let prev = self.used_pages.fetch_add(1, Ordering::Relaxed);
        if prev >= self.limit_pages.load(Ordering::Relaxed) {
            self.used_pages.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    fn give_back(&self, pages: u64) {
        self.used_pages.fetch_sub(pages, Ordering::Relaxed);
    }
}

/// MemAvailable from `/proc/meminfo`, in bytes.
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The budget all memory devices of this process share: three quarters of
/// MemAvailable when first asked for (unbounded when /proc/meminfo cannot
/// be read), so a RAM disk fills with ENOSPC before the OOM killer runs.
pub fn process_budget() -> &'static AllocBudget {
    static BUDGET: OnceLock<AllocBudget> = OnceLock::new();
    BUDGET.get_or_init(|| {
        let limit = mem_available().map_or(u64::MAX, |b| b / 4 * 3);
        AllocBudget::new(limit)
    })
}

/// Carry out one (already validated) bio against a page store holding at
/// most `max_pages`.
fn memory_execute(store: &PageStore, max_pages: u64, bio: &Bio) -> Status {
    match bio.op {
        Op::Read => {
            store.read(bio.offset, bio.data_mut());
            Status::Ok
        }
        Op::Write => store.write(bio.offset, bio.data(), max_pages),
        Op::Flush => Status::Ok,
        Op::Discard => store.zero_range(bio.offset, bio.len, false, max_pages),
        Op::WriteZeroes => store.zero_range(
            bio.offset,
            bio.len,
            bio.flags.contains(BioFlags::NOUNMAP),
            max_pages,
        ),
    }
}

/// The memory driver under the engine: the copy happens in `queue_rq`,
/// the completion goes wherever the engine's `irqmode` says.
pub struct MemoryDriver {
    store: Arc<PageStore>,
    max_pages: u64,
    /// Pages the device spans.
    pages: u64,
}

impl Driver for MemoryDriver {
    #[inline]
    fn queue_rq(&self, rq: Rq<'_>) -> QueueRq {
        QueueRq::Done(memory_execute(&self.store, self.max_pages, rq.bio))
    }

    fn extents(&self, offset: u64, end: u64) -> Option<Vec<Extent>> {
        // Every page of the device allocated: no holes anywhere, known
        // without a lookup per page (an NBD server asks before every
        // structured READ, and those lookups are cache misses).
        if self.store.allocated_pages() >= self.pages {
            return None;
        }
        Some(self.store.extents(offset, end))
    }
}

/// A memory device: its table options and its disk.
pub struct MemoryDevice {
    block_size: u32,
    /// `max_alloc=` as given (bytes), if given.
    max_alloc: Option<u64>,
    engine: EngineArgs,
    disk: EmulatedDisk<MemoryDriver>,
}

/// A RAM size as `max_alloc=` and `serve --memory-limit` take it: bytes
/// or a binary suffix (K, M, G, T); `None` when malformed or overflowing.
pub fn parse_alloc_size(v: &str) -> Option<u64> {
    let (digits, shift) = match v.as_bytes().last()? {
        b'k' | b'K' => (&v[..v.len() - 1], 10),
        b'm' | b'M' => (&v[..v.len() - 1], 20),
        b'g' | b'G' => (&v[..v.len() - 1], 30),
        b't' | b'T' => (&v[..v.len() - 1], 40),
        _ => (v, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1u64 << shift)
}

fn take_max_alloc(kv: &mut KvArgs<'_>) -> Result<Option<u64>, MemoryError> {
    let Some(v) = kv.take_str("max_alloc") else {
        return Ok(None);
    };
    match parse_alloc_size(v) {
        Some(n) if n >= PAGE_SIZE => Ok(Some(n)),
        _ => Err(ArgError::BadValue {
            driver: "memory",
            key: "max_alloc".into(),
            value: v.to_string(),
            expected: format!("a size of at least {PAGE_SIZE} bytes (suffix K, M, G or T)"),
        }
        .into()),
    }
}

impl MemoryDevice {
    /// Build from a table line's length (in bytes) and its optional
    /// `key=value` args: `bs=` and the engine args.
    pub fn from_args(size_bytes: u64, args: &[&str]) -> Result<Self, MemoryError> {
        Self::from_args_with_store(size_bytes, args, None)
    }

    /// As [`MemoryDevice::from_args`], keeping the pages of `store` (a
    /// reloaded table's memory target of the same size and place) instead
    /// of starting empty.
    pub fn from_args_with_store(
        size_bytes: u64,
        args: &[&str],
        store: Option<Arc<PageStore>>,
    ) -> Result<Self, MemoryError> {
        let mut kv = KvArgs::parse("memory", args)?;
        let block_size = kv.take_block_size("bs")?;
        let max_alloc = take_max_alloc(&mut kv)?;
        let engine = EngineArgs::parse(&mut kv)?;
        kv.finish()?;
        let store = store.unwrap_or_else(|| Arc::new(PageStore::new()));
        Self::build(size_bytes, block_size, max_alloc, engine, store)
    }

    /// Build with engine options set from Rust (experiments, benches).
    pub fn with_options(
        size_bytes: u64,
        block_size: u32,
        opts: EngineOptions,
    ) -> Result<Self, MemoryError> {
        let block_size = check_block_size("memory", "bs", block_size.into())?;
        let store = Arc::new(PageStore::new());
        let engine = EngineArgs::from_options(opts);
        Self::build(size_bytes, block_size, None, engine, store)
    }

    fn build(
        size_bytes: u64,
        block_size: u32,
        max_alloc: Option<u64>,
        engine: EngineArgs,
        store: Arc<PageStore>,
    ) -> Result<Self, MemoryError> {
        check_size("memory", size_bytes, block_size)?;
        let driver = MemoryDriver {
            store,
            max_pages: max_alloc.map_or(u64::MAX, |b| b / PAGE_SIZE),
            pages: size_bytes.div_ceil(PAGE_SIZE),
        };
        let features = Features {
            discard: true,
            write_zeroes: true,
            fast_zero: true,
            knows_holes: true,
            ..Features::default()
        };
        let limits = DiskLimits::new(size_bytes, block_size, features);
        Ok(MemoryDevice {
            disk: engine.disk(driver, limits).map_err(MemoryError::Queue)?,
            block_size,
            max_alloc,
            engine,
        })
    }

    pub fn table_args(&self) -> String {
        let mut s = String::new();
        if self.block_size != 512 {
            let _ = write!(s, " bs={}", self.block_size);
        }
        if let Some(m) = self.max_alloc {
            let _ = write!(s, " max_alloc={m}");
        }
        self.engine.write_table_args(&mut s);
        s.trim_start().to_string()
    }

    /// The bound on this device's pages, in bytes: its `max_alloc=`, or
    /// the process budget's limit when that is lower or none was given.
    pub fn alloc_bound_bytes(&self) -> u64 {
        let process = self.store().budget.limit_bytes();
        self.max_alloc
            .map_or(process, |m| (m / PAGE_SIZE * PAGE_SIZE).min(process))
    }

    pub fn status(&self) -> String {
        format!(
            "bs={} allocated_bytes={} max_alloc_bytes={} {} {}",
            self.block_size,
            self.store().allocated_pages() * PAGE_SIZE,
            self.alloc_bound_bytes(),
            self.engine.describe(),
            self.disk.status()
        )
    }

    pub fn store(&self) -> &PageStore {
        &self.disk.inner_driver().store
    }

    /// The page store itself, to hand to the next table's memory target.
    pub fn shared_store(&self) -> Arc<PageStore> {
        self.disk.inner_driver().store.clone()
    }
}

/// The device is the engine's leaf [`Disk`] (submission, checks, polling).
impl Deref for MemoryDevice {
    type Target = Disk<Emulated<MemoryDriver>>;

    fn deref(&self) -> &Disk<Emulated<MemoryDriver>> {
        &self.disk
    }
}

#[cfg(test)]
mod tests;
