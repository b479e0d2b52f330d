//! One block I/O request, as the kernel's `struct bio`.
//!
//! A bio is moved, never shared: submitting hands it to a device, and
//! [`Bio::complete`] hands it back up the stack. Because `complete` consumes
//! the bio, a request cannot be completed twice, and a bio dropped while it
//! still has completion frames is a lost I/O, which debug builds catch.
//!
//! Completion follows dm's clone/end_io model without allocating a clone:
//! every layer that wants to see the completion (the owner that created the
//! bio, a mapped device counting in-flight I/O, multipath retrying on another
//! path) pushes an [`EndIo`] frame; completion pops the top frame and calls
//! it. A layer that only remaps (linear) changes `offset` and passes the same
//! bio down, so stacking costs nothing per I/O. A frame also records the
//! offset the bio had when it was pushed and restores it on completion
//! (dm's `dm_bio_record`/`dm_bio_restore`), so every layer sees the bio as
//! it submitted it and can resubmit it unchanged.
//!
//! The data buffer is an [`IoBuf`]: a pointer and length into memory the
//! submitter owns until completion, like a `bio_vec`. Splitting a bio (at a
//! table boundary or a stripe chunk) is then just a sub-range, no copy.

use crate::status::Status;
use smallvec::SmallVec;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

/// The operation, kernel `REQ_OP_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Op {
    /// Read `len` bytes at `offset` into the buffer (`REQ_OP_READ`).
    Read,
    /// Write the buffer's `len` bytes at `offset` (`REQ_OP_WRITE`).
    Write,
    /// An empty flush: make earlier completed writes durable.
    Flush,
    /// Discard (trim): the range may read back as anything afterwards.
    Discard,
    /// Write zeroes: the range reads back as zeroes afterwards.
    WriteZeroes,
}

impl Op {
    /// Does this op change the device's contents?
    pub fn is_write(self) -> bool {
        !matches!(self, Op::Read)
    }

    /// Does this op move data through the buffer?
    pub fn has_data(self) -> bool {
        matches!(self, Op::Read | Op::Write)
    }

    /// The op's lower-case name, as fio and the stats reports spell it.
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Discard => "discard",
            Op::WriteZeroes => "write_zeroes",
        }
    }
}

/// Request flags, kernel `REQ_*` modifiers. A small hand-written bitset:
/// four bits do not justify a dependency.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct BioFlags(u8);

impl BioFlags {
    /// No flag set: a plain request.
    pub const NONE: BioFlags = BioFlags(0);
    /// Forced unit access: this write is durable when it completes.
    pub const FUA: BioFlags = BioFlags(1);
    /// Flush the device's cache before this request (kernel `REQ_PREFLUSH`).
    pub const PREFLUSH: BioFlags = BioFlags(2);
    /// Write-zeroes must not deallocate (NBD `NO_HOLE`, kernel `REQ_NOUNMAP`).
    pub const NOUNMAP: BioFlags = BioFlags(4);
    /// Write-zeroes must fail with `Again` unless it is fast (NBD `FAST_ZERO`).
    pub const FAST_ZERO: BioFlags = BioFlags(8);
    /// Do not retry below this layer (kernel `REQ_FAILFAST_TRANSPORT`).
    pub const FAILFAST: BioFlags = BioFlags(16);
    /// The submitter polls for this bio's completion (kernel `REQ_POLLED`):
    /// it calls [`crate::Device::poll`] on the device it submitted to until
    /// the bio completes, so a device that supports polling
    /// ([`crate::Device::polls`]) may leave the completion to that call, on
    /// the submitter's thread, instead of waking it from another. Devices
    /// that do not poll ignore it (the stacked layer clears it, as the
    /// kernel's `bio_clear_polled`).
    pub const POLLED: BioFlags = BioFlags(32);

    /// Whether every bit of `other` is set; false for an empty `other`,
    /// so `contains(NONE)` never reads as a flag being present.
    pub fn contains(self, other: BioFlags) -> bool {
        self.0 & other.0 == other.0 && other.0 != 0
    }
    /// Set the bits of `other` (kernel `bio->bi_opf |= ...`).
    pub fn insert(&mut self, other: BioFlags) {
        self.0 |= other.0;
    }
    /// Clear the bits of `other`, as a layer does before passing a bio to
    /// a device that does not honour them (kernel `bio_clear_polled`).
    pub fn remove(&mut self, other: BioFlags) {
        self.0 &= !other.0;
    }
    /// The raw bits, for encoding a request in a trace or on the wire.
    pub fn bits(self) -> u8 {
        self.0
    }
}

impl std::ops::BitOr for BioFlags {
    type Output = BioFlags;
    fn bitor(self, rhs: BioFlags) -> BioFlags {
        BioFlags(self.0 | rhs.0)
    }
}

impl fmt::Debug for BioFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = Vec::new();
        for (flag, name) in [
            (BioFlags::FUA, "FUA"),
            (BioFlags::PREFLUSH, "PREFLUSH"),
            (BioFlags::NOUNMAP, "NOUNMAP"),
            (BioFlags::FAST_ZERO, "FAST_ZERO"),
            (BioFlags::FAILFAST, "FAILFAST"),
        ] {
            if self.contains(flag) {
                names.push(name);
            }
        }
        write!(f, "{}", names.join("|"))
    }
}

/// A data buffer borrowed from the submitter for the life of one request.
///
/// Creating one is `unsafe` (the submitter promises the memory outlives the
/// request and is not touched until completion); using one is safe. This is
/// the same contract the kernel's `bio_vec` pages carry.
#[derive(Clone, Copy)]
pub struct IoBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is owned by exactly one in-flight request at a time by
// the construction contract; moving that ownership between threads is the
// point of submitting a request.
unsafe impl Send for IoBuf {}
// SAFETY: shared access only reads the pointer and length; the bytes are
// touched by the one request that owns them, as for Send.
unsafe impl Sync for IoBuf {}

impl IoBuf {
    /// A buffer of no bytes, for flushes and discards.
    pub const fn empty() -> IoBuf {
        IoBuf {
            ptr: NonNull::dangling().as_ptr(),
            len: 0,
        }
    }

    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes, and not accessed by
    /// anything but the request carrying it, until that request completes.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> IoBuf {
        IoBuf { ptr, len }
    }

    /// # Safety
    /// As [`IoBuf::from_raw`]: the slice must outlive the request and stay
    /// untouched until it completes.
    pub unsafe fn from_slice(s: &mut [u8]) -> IoBuf {
        IoBuf {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes (flushes, discards).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the lent memory, for handing to a syscall (`pread`, an io_uring SQE).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// A sub-range of this buffer (used to split a request).
    ///
    /// # Panics
    /// If `off + len` exceeds the buffer.
    pub fn slice(&self, off: usize, len: usize) -> IoBuf {
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len),
            "IoBuf::slice {off}+{len} out of {}",
            self.len
        );
        IoBuf {
            // SAFETY: in bounds by the assert above.
            ptr: unsafe { self.ptr.add(off) },
            len,
        }
    }

    /// The lent memory as bytes: what a write carries.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: validity is the construction contract.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The lent memory as mutable bytes: where a read lands. Sound because
    /// the one request holding the buffer is its only user (the
    /// construction contract), as a driver fills a `bio_vec` page.
    #[allow(clippy::mut_from_ref)]
    pub fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: exclusive use by the one request holding this buffer is the
        // construction contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IoBuf({:p}, {})", self.ptr, self.len)
    }
}

/// Page-aligned, zeroed, owned memory that submitters lend to requests
/// (O_DIRECT needs the alignment).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: plain owned memory.
unsafe impl Send for AlignedBuf {}
// SAFETY: plain owned memory; `&self` methods only read it or lend it
// out under `io_buf`'s own contract.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Alignment in bytes: a page, enough for O_DIRECT on any device.
    pub const ALIGN: usize = 4096;

    /// A zeroed buffer of `len` bytes; aborts on allocation failure, as the
    /// global allocator does.
    pub fn new(len: usize) -> AlignedBuf {
        let layout = Layout::from_size_align(len.max(1), Self::ALIGN).expect("buffer layout");
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len, layout }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole buffer, to check what a read brought back.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: owned allocation of `len` bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The whole buffer, mutably, to fill a write pattern before lending it.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: owned allocation of `len` bytes, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Lend `off..off+len` of this buffer to a request.
    ///
    /// # Safety
    /// The caller must keep this `AlignedBuf` alive and not touch that range
    /// until the request completes.
    pub unsafe fn io_buf(&self, off: usize, len: usize) -> IoBuf {
        assert!(off + len <= self.len, "AlignedBuf::io_buf out of range");
        // SAFETY: `off + len` is inside the allocation (checked above), and
        // the caller keeps it alive and untouched while the request runs.
        unsafe { IoBuf::from_raw(self.ptr.as_ptr().add(off), len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Something that wants to know when a bio completes: the bio's owner, or a
/// layer between the owner and the leaf (kernel `bi_end_io` / dm `end_io`).
///
/// `private` is the value the layer stored when it pushed its frame (dm's
/// per-bio data, in one word). The implementation takes the bio by value:
/// it either completes it further up (`bio.complete(status)`), resubmits it
/// (multipath retry), or, as the owner, keeps it for reuse.
pub trait EndIo: Send + Sync {
    /// Called once per completion of a bio this sink pushed a frame for,
    /// with the frame's `private` word; it now owns the bio.
    fn end_io(&self, bio: Bio, status: Status, private: u64);
}

struct EndFrame {
    sink: Arc<dyn EndIo>,
    private: u64,
    offset: u64,
}

/// Completion frames kept inside the bio; a deeper stack spills them to
/// the heap once. Two cover the common owner + one mapped device, and
/// keep the bio at 128 bytes: a bio is moved by value at every hand-off
/// (about ten per I/O through bench -> mapped -> mq), and up to 128 bytes
/// the compiler moves it with inline vector stores instead of a `memcpy`
/// call (which was a fifth of the in-process null benchmark's time at 192
/// bytes with four frames). A bio that is re-armed keeps a spilled stack's
/// allocation, so deep stacks driven by a reusing owner stay allocation-free.
pub const INLINE_FRAMES: usize = 2;

/// One block I/O request. See the module documentation for the model.
pub struct Bio {
    /// What the request does.
    pub op: Op,
    /// Modifiers (FUA, PREFLUSH, POLLED, ...), kernel `bi_opf`'s flag bits.
    pub flags: BioFlags,
    /// Byte offset on the device the bio is currently submitted to.
    pub offset: u64,
    /// Length in bytes. For reads and writes it equals `buf.len()`.
    pub len: u64,
    /// The data: where a read lands and what a write carries (empty for
    /// flush and discard), kernel `bi_io_vec`.
    pub buf: IoBuf,
    /// When the owner issued it, in [`crate::clock::now_ns`] nanoseconds.
    pub start_ns: u64,
    /// Free for the owner to identify the request (a slot index, an NBD
    /// handle). Layers below never touch it.
    pub cookie: u64,
    frames: SmallVec<[EndFrame; INLINE_FRAMES]>,
}

impl Bio {
    /// A new bio owned by `owner`, which gets it back through
    /// [`EndIo::end_io`] with `private == cookie`.
    pub fn new(
        op: Op,
        offset: u64,
        len: u64,
        buf: IoBuf,
        owner: Arc<dyn EndIo>,
        cookie: u64,
    ) -> Bio {
        let mut frames = SmallVec::new();
        frames.push(EndFrame {
            sink: owner,
            private: cookie,
            offset,
        });
        Bio {
            op,
            flags: BioFlags::NONE,
            offset,
            len,
            buf,
            start_ns: crate::clock::now_ns(),
            cookie,
            frames,
        }
    }

    /// The same bio with `flags` set, for building one in a single expression.
    pub fn with_flags(mut self, flags: BioFlags) -> Bio {
        self.flags = flags;
        self
    }

    /// Re-arm a bio the owner got back, for reuse without reallocation.
    pub fn rearm(&mut self, owner: Arc<dyn EndIo>, op: Op, offset: u64, len: u64, buf: IoBuf) {
        self.rearm_at(owner, op, offset, len, buf, crate::clock::now_ns());
    }

    /// [`Bio::rearm`] with an issue time the owner already read (a
    /// benchmark stamping from [`crate::clock::CycleClock`]).
    pub fn rearm_at(
        &mut self,
        owner: Arc<dyn EndIo>,
        op: Op,
        offset: u64,
        len: u64,
        buf: IoBuf,
        start_ns: u64,
    ) {
        debug_assert!(self.frames.is_empty(), "rearming an in-flight bio");
        self.frames.clear();
        self.frames.push(EndFrame {
            sink: owner,
            private: self.cookie,
            offset,
        });
        self.op = op;
        self.flags = BioFlags::NONE;
        self.offset = offset;
        self.len = len;
        self.buf = buf;
        self.start_ns = start_ns;
    }

    /// Ask to see this bio's completion before the layers above do. The
    /// current offset is recorded and restored when this frame is popped.
    pub fn push_end(&mut self, sink: Arc<dyn EndIo>, private: u64) {
        let offset = self.offset;
        self.frames.push(EndFrame {
            sink,
            private,
            offset,
        });
    }

    /// How many layers are waiting for this bio's completion.
    pub fn depth(&self) -> usize {
        self.frames.len()
    }

    /// End this bio with `status`: the most recent frame sees it first.
    pub fn complete(mut self, status: Status) {
        match self.frames.pop() {
            Some(frame) => {
                self.offset = frame.offset;
                frame.sink.end_io(self, status, frame.private)
            }
            None => debug_assert!(false, "bio completed twice (no completion frame left)"),
        }
    }

    /// Byte range end (exclusive).
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }

    /// The data, for reads and writes.
    pub fn data(&self) -> &[u8] {
        self.buf.as_slice()
    }

    /// The data, mutably: where a driver puts what a read returns.
    #[allow(clippy::mut_from_ref)]
    pub fn data_mut(&self) -> &mut [u8] {
        self.buf.as_mut_slice()
    }

    /// A child request for `off..off+len` (relative to this bio), owned by
    /// `owner`: used to split a bio at a boundary. The child shares this
    /// bio's buffer range, op and flags.
    pub fn child(&self, off: u64, len: u64, owner: Arc<dyn EndIo>, cookie: u64) -> Bio {
        let buf = if self.op.has_data() {
            self.buf.slice(off as usize, len as usize)
        } else {
            IoBuf::empty()
        };
        let mut b = Bio::new(self.op, self.offset + off, len, buf, owner, cookie);
        b.flags = self.flags;
        b.start_ns = self.start_ns;
        b
    }
}

impl Drop for Bio {
    fn drop(&mut self) {
        if !self.frames.is_empty() && !std::thread::panicking() {
            debug_assert!(
                false,
                "bio {:?} {}+{} dropped without completion ({} waiting layers)",
                self.op,
                self.offset,
                self.len,
                self.frames.len()
            );
        }
    }
}

impl fmt::Debug for Bio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bio")
            .field("op", &self.op)
            .field("flags", &self.flags)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("depth", &self.frames.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;

    #[derive(Default)]
    struct Seen(Mutex<Vec<(u64, Status, u64)>>);
    impl EndIo for Seen {
        fn end_io(&self, bio: Bio, status: Status, private: u64) {
            self.0.lock().push((bio.offset, status, private));
            if bio.depth() > 0 {
                bio.complete(status);
            }
        }
    }

    #[test]
    fn frames_pop_in_order_and_restore_offsets() {
        let owner = Arc::new(Seen::default());
        let mid = Arc::new(Seen::default());
        let mut bio = Bio::new(Op::Flush, 4096, 0, IoBuf::empty(), owner.clone(), 7);
        bio.offset = 8192; // a layer remaps
        bio.push_end(mid.clone(), 3);
        bio.offset = 1 << 20; // a lower layer remaps again
        bio.complete(Status::IoError);
        assert_eq!(*mid.0.lock(), vec![(8192, Status::IoError, 3)]);
        assert_eq!(*owner.0.lock(), vec![(4096, Status::IoError, 7)]);
    }

    #[test]
    fn bio_fits_the_inline_move_size() {
        // See INLINE_FRAMES: above 128 bytes every hand-off becomes a
        // memcpy call.
        assert!(
            std::mem::size_of::<Bio>() <= 128,
            "{}",
            std::mem::size_of::<Bio>()
        );
    }

    #[test]
    fn frames_beyond_the_inline_ones_spill_to_the_heap() {
        let owner = Arc::new(Seen::default());
        let mid = Arc::new(Seen::default());
        let owner_dyn: Arc<dyn EndIo> = owner.clone();
        let mut bio = Bio::new(Op::Flush, 0, 0, IoBuf::empty(), owner_dyn.clone(), 1);
        for i in 0..(INLINE_FRAMES as u64 + 2) {
            bio.offset = 512 * (i + 1);
            bio.push_end(mid.clone(), i);
        }
        assert_eq!(bio.depth(), INLINE_FRAMES + 3);
        bio.complete(Status::Ok);
        let seen: Vec<u64> = mid.0.lock().iter().map(|s| s.2).collect();
        assert_eq!(seen, vec![3, 2, 1, 0]);
        assert_eq!(owner.0.lock().len(), 1);
    }

    #[test]
    fn child_shares_parent_buffer_range() {
        let owner = Arc::new(Seen::default());
        let mut mem = vec![0u8; 8192];
        // SAFETY: `mem` outlives both bios, completed below.
        let buf = unsafe { IoBuf::from_slice(&mut mem) };
        let parent = Bio::new(Op::Write, 0, 8192, buf, owner.clone(), 1);
        let child = parent.child(4096, 4096, owner.clone(), 2);
        assert_eq!(child.offset, 4096);
        // SAFETY: 4096 is inside `mem`'s 8192 bytes.
        assert_eq!(child.buf.as_ptr(), unsafe { mem.as_mut_ptr().add(4096) });
        child.complete(Status::Ok);
        parent.complete(Status::Ok);
        assert_eq!(owner.0.lock().len(), 2);
    }
}
