//! `snapshot <origin> <COW device> N <chunksize>`: a copy-on-write overlay
//! over a read-only origin (kernel `drivers/md/dm-snap.c` with the
//! transient exception store of `dm-snap-transient.c`), so that a
//! crash-consistency checker can mount, replay a journal and fsck a
//! replayed image without changing it, and the next replay point starts
//! from the same origin with a fresh, empty overlay (a reload) instead of a
//! copy of the whole device.
//!
//! Writes to a chunk the overlay does not hold yet first copy the origin's
//! chunk to the next free chunk of the COW device (skipped when the write
//! covers the whole chunk, as the kernel's `start_full_bio`), then go to
//! the COW device; reads of such chunks come from there, the rest from the
//! origin. Bios are split at chunk boundaries (the kernel's `max_io_len`
//! of one chunk). A flush goes to the COW device (the origin is never
//! written). When the COW device is full, the snapshot becomes invalid and
//! every later I/O fails, as the kernel's transient store does (`status`
//! prints `Invalid`).
//!
//! Only the transient store (`N`) is built:
//! its exceptions live in memory and start empty at every construction,
//! which is what replay wants. The persistent store (`P`, `PO`: the
//! on-disk exception areas of `dm-snap-persistent.c`) is refused with a
//! clear error; see docs/KERNEL-PARITY.md. `status` is the kernel's
//! `<allocated sectors>/<COW sectors> <metadata sectors>` (metadata is
//! always 0 for a transient store); `table` is `<origin> <cow> N <chunk>`.
//! Writes straight to the origin are not tracked (there is no
//! `snapshot-origin` target): replay resets the overlay before changing
//! its origin.

use crate::error::TargetError;
use crate::target::{CtrContext, DevArg, Target, TargetRef, TargetType};
use blkstack_core::sync::submit_and_wait;
use blkstack_core::{AlignedBuf, Bio, BioFlags, Features, Op, Status, SECTOR_SIZE};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

pub const TYPE: TargetType = TargetType {
    name: "snapshot",
    version: [1, 16, 0],
    ctr,
};

pub struct SnapshotTarget {
    origin: DevArg,
    cow: DevArg,
    /// Chunk size in sectors (a power of two).
    chunk_sectors: u64,
    /// The origin's bytes this line covers.
    len_bytes: u64,
    state: Mutex<Exceptions>,
}

/// The transient exception store: origin chunk -> COW chunk, and the
/// next free COW sector (kernel `transient_c.next_free`).
struct Exceptions {
    map: HashMap<u64, u64>,
    next_free: u64,
    valid: bool,
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    if args.len() < 4 {
        return Err(TargetError::invalid("requires 4 or more arguments"));
    }
    // Feature arguments (discard_zeroes_cow, discard_passdown_origin) are
    // not offered: a trailing count other than 0 is refused.
    if args.len() > 4 && !(args.len() == 5 && args[4] == "0") {
        return Err(TargetError::invalid(format!(
            "snapshot feature arguments are not supported: '{}'",
            args[4..].join(" ")
        )));
    }
    let origin = ctx
        .get_device(args[0], 0, ctx.len)
        .map_err(|e| in_context("Cannot get origin device", e))?;
    let cow = ctx
        .get_device(args[1], 0, 0)
        .map_err(|e| in_context("Cannot get COW device", e))?;
    if origin.name == cow.name {
        return Err(TargetError::invalid(
            "COW device cannot be the same as origin device",
        ));
    }
    // dm_exception_store_create: the first letter names the store ("PO"
    // is persistent with overflow, and "N..." is transient whatever
    // follows); its errors are logged as "Couldn't create exception store".
    match args[2].chars().next().map(|c| c.to_ascii_uppercase()) {
        Some('N') => {}
        Some('P') => {
            return Err(TargetError::invalid(format!(
                "Couldn't create exception store: the persistent store '{}' is not built \
                 (only the transient store N is; see docs/KERNEL-PARITY.md)",
                args[2]
            )))
        }
        _ => {
            return Err(TargetError::invalid(format!(
                "Couldn't create exception store: Exception store type is not P or N: '{}'",
                args[2]
            )))
        }
    }
    let chunk_sectors = chunk_size(args[3], &origin, &cow)?;
    Ok(Arc::new(SnapshotTarget {
        origin,
        cow,
        chunk_sectors,
        len_bytes: ctx.len_bytes(),
        state: Mutex::new(Exceptions {
            map: HashMap::new(),
            next_free: 0,
            valid: true,
        }),
    }))
}

/// Kernel `set_chunk_size` / `dm_exception_store_set_chunk_size`, with
/// snapshot_ctr's "Chunk size not set" for 0 (a transient store has no
/// header to read one from).
fn chunk_size(arg: &str, origin: &DevArg, cow: &DevArg) -> Result<u64, TargetError> {
    let store = |why: &str| TargetError::invalid(format!("Couldn't create exception store: {why}"));
    // kstrtouint: decimal digits (an optional leading '+'), fitting u32.
    let digits = arg.strip_prefix('+').unwrap_or(arg);
    let c: u32 = Some(digits)
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|d| d.parse().ok())
        .ok_or_else(|| store("Invalid chunk size"))?;
    if c == 0 {
        return Err(TargetError::invalid("Chunk size not set"));
    }
    if !c.is_power_of_two() {
        return Err(store("Chunk size is not a power of 2"));
    }
    let c = c as u64;
    for d in [cow, origin] {
        let lbs = (d.dev.logical_block_size() as u64 / SECTOR_SIZE).max(1);
        if !c.is_multiple_of(lbs) {
            return Err(store("Chunk size is not a multiple of device blocksize"));
        }
    }
    if c > (i32::MAX as u64) >> 9 {
        return Err(store("Chunk size is too high"));
    }
    Ok(c)
}

fn in_context(context: &str, source: TargetError) -> TargetError {
    TargetError::In {
        context: context.to_string(),
        source: Box::new(source),
    }
}

impl SnapshotTarget {
    fn chunk_bytes(&self) -> u64 {
        self.chunk_sectors * SECTOR_SIZE
    }

    /// The COW chunk that holds origin chunk `chunk` for a write, copying
    /// the origin's data there first unless the write covers it all.
    /// `None` when the snapshot is (or just became) invalid.
    fn chunk_for_write(&self, chunk: u64, whole: bool) -> Option<u64> {
        let mut st = self.state.lock();
        if !st.valid {
            return None;
        }
        if let Some(&c) = st.map.get(&chunk) {
            return Some(c);
        }
        let cb = self.chunk_bytes();
        if st.next_free + self.chunk_sectors > self.cow.dev.size() / SECTOR_SIZE {
            tracing::error!("snapshot: COW device full: invalidating the snapshot");
            st.valid = false;
            return None;
        }
        let new = st.next_free / self.chunk_sectors;
        if !whole {
            // The copy-out runs under the lock, so a second write to the
            // same chunk waits for it instead of racing it (the kernel's
            // pending exception).
            let len = cb.min(self.len_bytes - chunk * cb);
            // Aligned: a file leaf below may do direct I/O.
            let mut buf = AlignedBuf::new(len as usize);
            let b = buf.as_mut_slice();
            let r = submit_and_wait(&*self.origin.dev, Op::Read, chunk * cb, len, b);
            let w = if r.is_ok() {
                submit_and_wait(&*self.cow.dev, Op::Write, new * cb, len, b)
            } else {
                r
            };
            if !w.is_ok() {
                tracing::error!(?w, "snapshot: copying a chunk out failed: invalidating");
                st.valid = false;
                return None;
            }
        }
        st.next_free += self.chunk_sectors;
        st.map.insert(chunk, new);
        Some(new)
    }
}

impl Target for SnapshotTarget {
    fn map(&self, mut bio: Bio) {
        if bio.op == Op::Flush || (bio.len == 0 && bio.flags.contains(BioFlags::PREFLUSH)) {
            self.cow.dev.submit(bio);
            return;
        }
        let cb = self.chunk_bytes();
        let chunk = bio.offset / cb;
        let within = bio.offset % cb;
        match bio.op {
            Op::Read => {
                let st = self.state.lock();
                if !st.valid {
                    drop(st);
                    bio.complete(Status::IoError);
                    return;
                }
                match st.map.get(&chunk) {
                    Some(&c) => {
                        drop(st);
                        bio.offset = c * cb + within;
                        self.cow.dev.submit(bio);
                    }
                    None => {
                        drop(st);
                        self.origin.dev.submit(bio);
                    }
                }
            }
            Op::Write | Op::WriteZeroes => {
                let whole = within == 0 && bio.len == cb;
                match self.chunk_for_write(chunk, whole) {
                    Some(c) => {
                        bio.offset = c * cb + within;
                        self.cow.dev.submit(bio);
                    }
                    None => bio.complete(Status::IoError),
                }
            }
            _ => bio.complete(Status::NotSupported),
        }
    }

    fn status(&self) -> String {
        let st = self.state.lock();
        if !st.valid {
            return "Invalid".into();
        }
        format!("{}/{} 0", st.next_free, self.cow.dev.size() / SECTOR_SIZE)
    }

    fn table(&self) -> String {
        format!("{} {} N {}", self.origin, self.cow, self.chunk_sectors)
    }

    fn max_io_len(&self, offset: u64) -> u64 {
        let cb = self.chunk_bytes();
        cb - offset % cb
    }

    fn features(&self) -> Features {
        let cow = self.cow.dev.features();
        Features {
            discard: false,
            write_zeroes: false,
            fast_zero: false,
            knows_holes: false,
            read_only: false,
            ..cow
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::Registry;
    use blkstack_core::sync::submit_and_wait;
    use blkstack_core::{Op, Status};

    fn write(reg: &Registry, dev: &str, off: u64, byte: u8, len: usize) {
        let d = reg.device(dev).unwrap();
        let mut b = vec![byte; len];
        assert_eq!(
            submit_and_wait(&*d, Op::Write, off, len as u64, &mut b),
            Status::Ok
        );
    }

    fn read(reg: &Registry, dev: &str, off: u64, len: usize) -> Vec<u8> {
        let d = reg.device(dev).unwrap();
        let mut b = vec![0u8; len];
        assert_eq!(
            submit_and_wait(&*d, Op::Read, off, len as u64, &mut b),
            Status::Ok
        );
        b
    }

    fn setup(cow_sectors: u64) -> std::sync::Arc<Registry> {
        let reg = Registry::new();
        reg.create("o", "0 2048 memory").unwrap();
        reg.create("c", &format!("0 {cow_sectors} memory")).unwrap();
        write(&reg, "o", 0, b'o', 1 << 20);
        reg.create("s", "0 2048 snapshot o c N 8").unwrap();
        reg
    }

    #[test]
    fn writes_land_in_the_overlay_and_the_origin_stays() {
        let reg = setup(1024);
        // A partial write copies the rest of its chunk from the origin.
        write(&reg, "s", 4096 + 512, b'x', 512);
        let got = read(&reg, "s", 4096, 4096);
        assert!(got[..512].iter().all(|&b| b == b'o'));
        assert!(got[512..1024].iter().all(|&b| b == b'x'));
        assert!(got[1024..].iter().all(|&b| b == b'o'));
        // A write across chunks is split; the origin never changes.
        write(&reg, "s", 8192 - 1024, b'y', 2048);
        assert!(read(&reg, "o", 0, 1 << 20).iter().all(|&b| b == b'o'));
        let got = read(&reg, "s", 8192 - 1024, 2048);
        assert!(got.iter().all(|&b| b == b'y'));
        // Chunks 1 and 2 (8 sectors each) are held.
        assert_eq!(reg.status_text("s").unwrap(), "0 2048 snapshot 16/1024 0\n");
        assert!(reg.table_text("s").unwrap().ends_with(" N 8\n"));
    }

    /// Threads writing different sectors of the same chunks at once: each
    /// chunk is copied out once, before any write lands in it, so every
    /// write survives and every sector nobody wrote keeps the origin's.
    #[test]
    fn concurrent_partial_writes_to_one_chunk_all_survive() {
        let reg = setup(2048);
        let d = reg.device("s").unwrap();
        std::thread::scope(|sc| {
            for t in 0..4u8 {
                let d = d.clone();
                sc.spawn(move || {
                    for chunk in 0..32u64 {
                        let mut b = vec![b'a' + t; 512];
                        let off = chunk * 4096 + t as u64 * 1024;
                        assert_eq!(
                            submit_and_wait(&*d, Op::Write, off, 512, &mut b),
                            Status::Ok
                        );
                    }
                });
            }
        });
        for chunk in 0..32u64 {
            let got = read(&reg, "s", chunk * 4096, 4096);
            for (i, sector) in got.chunks(512).enumerate() {
                let want = if i % 2 == 0 && i / 2 < 4 {
                    b'a' + (i / 2) as u8
                } else {
                    b'o'
                };
                assert!(
                    sector.iter().all(|&x| x == want),
                    "chunk {chunk} sector {i}"
                );
            }
        }
        assert_eq!(
            reg.status_text("s").unwrap(),
            "0 2048 snapshot 256/2048 0\n"
        );
    }

    #[test]
    fn a_reload_drops_the_overlay() {
        let reg = setup(1024);
        write(&reg, "s", 0, b'z', 4096);
        let table = "0 2048 snapshot o c N 8";
        reg.reload("s", table).unwrap();
        reg.resume("s").unwrap();
        assert!(read(&reg, "s", 0, 4096).iter().all(|&b| b == b'o'));
        assert_eq!(reg.status_text("s").unwrap(), "0 2048 snapshot 0/1024 0\n");
    }

    #[test]
    fn a_full_overlay_invalidates_the_snapshot() {
        let reg = setup(16);
        write(&reg, "s", 0, b'a', 4096);
        write(&reg, "s", 4096, b'a', 4096);
        let d = reg.device("s").unwrap();
        let mut b = vec![0u8; 4096];
        assert_eq!(
            submit_and_wait(&*d, Op::Write, 8192, 4096, &mut b),
            Status::IoError
        );
        assert_eq!(
            submit_and_wait(&*d, Op::Read, 0, 4096, &mut b),
            Status::IoError
        );
        assert_eq!(reg.status_text("s").unwrap(), "0 2048 snapshot Invalid\n");
    }

    #[test]
    fn bad_tables_are_refused_naming_the_problem() {
        let reg = setup(1024);
        for (table, want) in [
            ("0 2048 snapshot o c N", "requires 4 or more arguments"),
            ("0 2048 snapshot o c N 6", "not a power of 2"),
            ("0 2048 snapshot o c N 0", "Chunk size not set"),
            ("0 2048 snapshot o c N x", "Invalid chunk size"),
            (
                "0 2048 snapshot o c Q 8",
                "Exception store type is not P or N",
            ),
            (
                "0 2048 snapshot o c transient 8",
                "Exception store type is not P or N",
            ),
            (
                "0 2048 snapshot o c P 8",
                "persistent store 'P' is not built",
            ),
            ("0 2048 snapshot o o N 8", "cannot be the same"),
            ("0 4096 snapshot o c N 8", "too small"),
            ("0 2048 snapshot nope c N 8", "Cannot get origin device"),
        ] {
            let Err(e) = reg.create("bad", table) else {
                panic!("{table} was taken");
            };
            let mut text = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                text.push_str(&format!(": {s}"));
                src = s.source();
            }
            assert!(text.contains(want), "{table}: {text} (want {want})");
            assert!(reg.get("bad").is_none());
        }
    }
}
