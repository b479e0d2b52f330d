//! One virtio-blk request (virtio 1.2 section 5.2.6: a 16-byte header,
//! the data, a one-byte status the device writes last), from the
//! descriptor chain to a bio and back; the guest's side is
//! drivers/block/virtio_blk.c (`virtblk_setup_cmd`, `virtblk_done`).
//!
//! A bio wants one buffer; a chain is a scatter list in guest memory.
//! When the data is one range of guest memory (the guest driver's usual
//! request: one page-aligned segment per page, so every 4 KiB request),
//! the bio does its I/O straight into the guest's pages, as
//! cloud-hypervisor's block crate does: no copy, no buffer of ours. The
//! range is bounds-checked against the mapped region it lies in
//! (vm-memory's `get_slice`), and the chain, which holds the mapping,
//! lives in the request until the bio completes. Data scattered over
//! several ranges goes through a bounce buffer instead: a write's data
//! is copied in before submission, a read's copied out at completion,
//! on whichever thread completes the bio. Either way the request then
//! goes on the used ring and the guest is notified if it asked to be
//! (event index).
//!
//! The usual request (Linux's for every 4 KiB read or write: a 16-byte
//! header, one data descriptor, a one-byte status) takes a short path
//! ([`start_simple`]): its three descriptors are read once from the
//! chain, the header and status by their guest addresses, the data by
//! one bounds-checked slice. The general path walks the chain with
//! virtio-queue's reader and writer (a queue of descriptors allocated
//! per walk, three walks per request); anything unusual goes there.
//!
//! One notification per batch, not per request: a thread that completes
//! several requests in a row (the queue's own thread answering a kick's
//! requests inline, a driver's completion thread reaping a ring) has a
//! [`blkstack_core::comp_batch::CompletionBatch`] open, and the call to
//! the guest (an eventfd write, an interrupt) is put off to the batch's
//! end, where the event index decides once for every request it added
//! (virtio 1.2 section 2.7.10; the kernel's `virtqueue_kick_prepare` and
//! qemu's `virtio_notify` after a batch of `virtqueue_fill`s do the same).

use crate::guard::Regions;
use blkstack_core::comp_batch::{self, Unplug};
use blkstack_core::{AlignedBuf, Bio, BioFlags, DeviceRef, EndIo, IoBuf, Op, Status};
use std::io::{Read, Write};
use std::sync::Arc;
use vhost_user_backend::{VringRwLock, VringT};
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_ring::VRING_AVAIL_F_NO_INTERRUPT;
use virtio_queue::DescriptorChain;
use virtio_queue::QueueT;
use vm_memory::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

pub type Mem = Arc<GuestMemoryMmap<()>>;
pub type Chain = DescriptorChain<Mem>;

/// The serial number GET_ID answers (20 bytes, NUL-padded).
pub const ID_LEN: usize = 20;

/// Where a request's data is while the device works on it.
enum Data {
    /// No data (flush, discard, write-zeroes, an empty request).
    None,
    /// Our own copy: the guest's data is scattered over several ranges.
    Bounce(AlignedBuf),
    /// The guest's own memory, this many bytes in one mapped range.
    Guest(usize),
}

/// What a completion has put in the chain's device-writable part.
enum Filled<'a> {
    Nothing,
    /// Bytes to copy there now (a bounce buffer, the GET_ID serial).
    Copy(&'a [u8]),
    /// Bytes the device wrote there itself.
    InPlace(usize),
}

/// A request between its submission and its completion.
pub struct Request {
    chain: Chain,
    vring: VringRwLock,
    data: Data,
    read: bool,
    /// The guard over the guest memory the data may live in: a request
    /// whose memory vanished while the device worked on it is failed.
    regions: Option<Arc<Regions>>,
    /// Where the status byte goes, for a request taken by the short path
    /// ([`start_simple`]); None: the general path's chain walk finds it.
    status_at: Option<GuestAddress>,
}

fn status_of(s: Status) -> u8 {
    match s {
        Status::Ok => VIRTIO_BLK_S_OK as u8,
        Status::NotSupported => VIRTIO_BLK_S_UNSUPP as u8,
        _ => VIRTIO_BLK_S_IOERR as u8,
    }
}

/// Write the status byte (and a read's data) back, put the chain on the
/// used ring, and notify the guest if it wants to be.
fn finish(chain: &Chain, vring: &VringRwLock, data: Filled<'_>, status: u8) {
    let mem = chain.memory();
    let mut used = 0u32;
    match chain.clone().writer(mem) {
        Ok(mut w) => {
            let n = w.available_bytes();
            if n == 0 {
                tracing::warn!("vhost-user-blk: a request with no status byte");
            } else if let Ok(mut tail) = w.split_at(n - 1) {
                match data {
                    Filled::Nothing => {}
                    Filled::Copy(d) => {
                        let k = d.len().min(n - 1);
                        if w.write_all(&d[..k]).is_ok() {
                            used += k as u32;
                        }
                    }
                    Filled::InPlace(k) => used += k.min(n - 1) as u32,
                }
                if tail.write_all(&[status]).is_ok() {
                    used += 1;
                }
            }
        }
        Err(e) => tracing::warn!("vhost-user-blk: bad descriptor chain: {e}"),
    }
    complete(chain, vring, used);
}

/// Put the chain on the used ring with `used` bytes written and notify
/// the guest if it wants to be.
fn complete(chain: &Chain, vring: &VringRwLock, used: u32) {
    // One lock for the used ring and the queue's name: the completing
    // thread and the queue's own thread take this lock in turn.
    let key = {
        let mut state = vring.get_mut();
        // With the chain's memory: VringState's own `add_used` would load
        // the connection's memory table again.
        let q = state.get_queue_mut();
        if let Err(e) = q.add_used(chain.memory(), chain.head_index(), used) {
            tracing::warn!("vhost-user-blk: add_used: {e}");
            return;
        }
        // The queue's state is one allocation for the queue's life: its
        // address names the queue among the batch's sinks.
        &*state as *const _ as usize
    };
    notify(vring, chain, key);
}

/// A queue whose used requests the guest has yet to hear about, until
/// the completion batch that put them there ends (with a chain of its,
/// for the guest memory its avail ring is in).
struct Notify(VringRwLock, Chain);

impl Unplug for Notify {
    fn unplug(&self) {
        signal(&self.0, self.1.memory());
    }
}

/// Tell the guest about the requests just put on the used ring: at the
/// end of the completion batch open on this thread, or now without one.
fn notify(vring: &VringRwLock, chain: &Chain, key: usize) {
    if !comp_batch::defer(key, || Some(Arc::new(Notify(vring.clone(), chain.clone())))) {
        signal(vring, chain.memory());
    }
}

/// Call the guest if it wants to be called: with the event index, if
/// the requests added to the used ring since the last check cross the
/// index it asked to be called at (all of them count: virtio-queue
/// keeps how many were added since); without it, unless its avail ring
/// says VRING_AVAIL_F_NO_INTERRUPT (virtio 1.2 section 2.7.7, which
/// virtio-queue leaves to the device).
fn signal(vring: &VringRwLock, mem: &GuestMemoryMmap<()>) {
    let mut v = vring.get_mut();
    if !v.get_queue_mut().needs_notification(mem).unwrap_or(true) {
        return;
    }
    if !v.get_queue().event_idx_enabled() {
        let avail = v.get_queue().avail_ring();
        // The used ring's index is written (needs_notification fenced
        // it): the flag read now is the one the guest meant for it.
        let flags: u16 = mem
            .load(GuestAddress(avail), std::sync::atomic::Ordering::Acquire)
            .unwrap_or(0);
        if u32::from(u16::from_le(flags)) & VRING_AVAIL_F_NO_INTERRUPT != 0 {
            return;
        }
    }
    let _ = v.signal_used_queue();
}

impl EndIo for Request {
    fn end_io(&self, bio: Bio, status: Status, _private: u64) {
        drop(bio);
        if !status.is_ok() {
            tracing::debug!(?status, "vhost-user-blk request failed");
        }
        let mut st = status_of(status);
        if status.is_ok() && self.regions.as_deref().is_some_and(Regions::poisoned) {
            // The guest memory went while the device read or wrote it:
            // what it read may be the guard's zeroes; fail the request.
            st = VIRTIO_BLK_S_IOERR as u8;
        }
        if let Some(at) = self.status_at {
            // The short path: the data went in place, the status has its
            // own descriptor.
            let mut used = 0;
            if self.read && st == VIRTIO_BLK_S_OK as u8 {
                if let Data::Guest(n) = self.data {
                    used += n as u32;
                }
            }
            // One region lookup (`get_slice`), not vm-memory's general
            // walk over regions that `write_obj` on the memory takes.
            let wrote = self.chain.memory().get_slice(at, 1);
            if wrote.is_ok_and(|b| b.write_obj(st, 0).is_ok()) {
                used += 1;
            }
            return complete(&self.chain, &self.vring, used);
        }
        let data = match &self.data {
            _ if !self.read || st != VIRTIO_BLK_S_OK as u8 => Filled::Nothing,
            Data::Bounce(b) => Filled::Copy(b.as_slice()),
            Data::Guest(n) => Filled::InPlace(*n),
            Data::None => Filled::Nothing,
        };
        finish(&self.chain, &self.vring, data, st);
    }
}

/// The limits a request is held to.
pub struct Limits {
    pub max_bytes: u64,
    pub read_only: bool,
    pub id: [u8; ID_LEN],
}

/// Start the request in `chain`: submit its bio, or answer it at once
/// (GET_ID, a refused or malformed request).
/// `regions`, when given, are the guest memory's guard: a write whose
/// data was read from vanished memory is failed, never submitted.
pub fn start(
    chain: Chain,
    vring: &VringRwLock,
    dev: &DeviceRef,
    lim: &Limits,
    regions: Option<&Arc<Regions>>,
) {
    let Some(chain) = start_simple(chain, vring, dev, lim, regions) else {
        return;
    };
    let mem = chain.memory();
    let mut r = match chain.clone().reader(mem) {
        Ok(r) => r,
        Err(_) => return finish(&chain, vring, Filled::Nothing, VIRTIO_BLK_S_IOERR as u8),
    };
    let mut hdr = [0u8; 16];
    if r.read_exact(&mut hdr).is_err() {
        return finish(&chain, vring, Filled::Nothing, VIRTIO_BLK_S_IOERR as u8);
    }
    let kind = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap_or([0; 8]));
    let writable_len = chain
        .clone()
        .writer(mem)
        .map(|w| w.available_bytes())
        .unwrap_or(0);
    let (op, len, flags) = match kind {
        VIRTIO_BLK_T_IN => (
            Op::Read,
            writable_len.saturating_sub(1) as u64,
            BioFlags::NONE,
        ),
        VIRTIO_BLK_T_OUT => (Op::Write, r.available_bytes() as u64, BioFlags::NONE),
        VIRTIO_BLK_T_FLUSH => (Op::Flush, 0, BioFlags::NONE),
        VIRTIO_BLK_T_GET_ID => {
            return finish(&chain, vring, Filled::Copy(&lim.id), VIRTIO_BLK_S_OK as u8)
        }
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            // One segment (we offer max_discard_seg = 1): sector, count, flags.
            let mut seg = [0u8; 16];
            if r.read_exact(&mut seg).is_err() {
                return finish(&chain, vring, Filled::Nothing, VIRTIO_BLK_S_IOERR as u8);
            }
            let s = u64::from_le_bytes(seg[0..8].try_into().unwrap_or([0; 8]));
            let n = u32::from_le_bytes(seg[8..12].try_into().unwrap_or([0; 4])) as u64;
            let unmap = u32::from_le_bytes(seg[12..16].try_into().unwrap_or([0; 4])) & 1 != 0;
            let (op, mut f) = if kind == VIRTIO_BLK_T_DISCARD {
                (Op::Discard, BioFlags::NONE)
            } else {
                (Op::WriteZeroes, BioFlags::NONE)
            };
            if op == Op::WriteZeroes && !unmap {
                f.insert(BioFlags::NOUNMAP);
            }
            return submit(chain, vring, dev, (op, s, n << 9, f), lim, regions);
        }
        _ => return finish(&chain, vring, Filled::Nothing, VIRTIO_BLK_S_UNSUPP as u8),
    };
    submit(chain, vring, dev, (op, sector, len, flags), lim, regions)
}

fn submit(
    chain: Chain,
    vring: &VringRwLock,
    dev: &DeviceRef,
    (op, sector, len, flags): (Op, u64, u64, BioFlags),
    lim: &Limits,
    regions: Option<&Arc<Regions>>,
) {
    if op.is_write() && lim.read_only {
        return finish(&chain, vring, Filled::Nothing, VIRTIO_BLK_S_IOERR as u8);
    }
    if len > lim.max_bytes && op.has_data() {
        return finish(&chain, vring, Filled::Nothing, VIRTIO_BLK_S_IOERR as u8);
    }
    let Some(offset) = sector.checked_mul(512) else {
        return finish(&chain, vring, Filled::Nothing, VIRTIO_BLK_S_IOERR as u8);
    };
    // A read's data is the device-writable bytes before the status; a
    // write's, the device-readable bytes after the header.
    let (in_place, skip) = (op == Op::Read, if op == Op::Read { 0 } else { 16 });
    let direct = if op.has_data() && len > 0 {
        guest_range(&chain, in_place, skip, len)
    } else {
        None
    };
    let mut data = match direct {
        Some(_) => Data::Guest(len as usize),
        None if op.has_data() && len > 0 => Data::Bounce(AlignedBuf::new(len as usize)),
        None => Data::None,
    };
    if op == Op::Write {
        let ok = match &mut data {
            Data::Bounce(b) => copy_in(&chain, b),
            _ => true,
        };
        if !ok || regions.is_some_and(|r| r.poisoned()) {
            return finish(&chain, vring, Filled::Nothing, VIRTIO_BLK_S_IOERR as u8);
        }
    }
    let io = match (&mut data, direct) {
        // SAFETY: `p` is `len` bytes of one mapped guest memory region
        // (bounds-checked by `guest_range`), and the mapping stays alive
        // while the request holds the chain, which holds the memory,
        // until the bio completes. Like any DMA device's buffer, the guest
        // may race its own request's bytes; the device treats them as
        // plain bytes, so a racing guest only changes what it reads or
        // writes. A page taken away meanwhile is the guard's to catch.
        (Data::Guest(n), Some(p)) => unsafe { IoBuf::from_raw(p, *n) },
        // SAFETY: the buffer lives in the request, which the bio's frame
        // keeps until the bio completes; nothing else touches it meanwhile.
        (Data::Bounce(b), _) => unsafe { IoBuf::from_slice(b.as_mut_slice()) },
        _ => IoBuf::empty(),
    };
    let req = Arc::new(Request {
        chain,
        vring: vring.clone(),
        data,
        read: op == Op::Read,
        regions: regions.cloned(),
        status_at: None,
    });
    let bio = Bio::new(
        op,
        if op == Op::Flush { 0 } else { offset },
        if op == Op::Flush { 0 } else { len },
        io,
        req,
        0,
    )
    .with_flags(if op == Op::Flush {
        BioFlags::NONE
    } else {
        flags
    });
    dev.submit(bio);
}

/// The short path for the usual request: exactly three descriptors, a
/// 16-byte device-readable header naming a read or a write, one data
/// descriptor the right way round, a one-byte device-writable status,
/// within the limits. Submits it and gives None; gives the chain back
/// for the general path otherwise (which also answers every refusal).
/// Every guest address is bounds-checked (`read_obj`, `get_slice`,
/// `write_obj` at completion).
fn start_simple(
    chain: Chain,
    vring: &VringRwLock,
    dev: &DeviceRef,
    lim: &Limits,
    regions: Option<&Arc<Regions>>,
) -> Option<Chain> {
    let mut it = chain.clone();
    let (Some(h), Some(d), Some(st), None) = (it.next(), it.next(), it.next(), it.next()) else {
        return Some(chain);
    };
    if h.is_write_only() || h.len() != 16 || !st.is_write_only() || st.len() != 1 {
        return Some(chain);
    }
    let mem = chain.memory();
    let mut hdr = [0u8; 16];
    match mem.get_slice(h.addr(), 16) {
        Ok(b) if b.copy_to(&mut hdr[..]) == 16 => {}
        _ => return Some(chain),
    }
    let kind = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap_or([0; 8]));
    let op = match (kind, d.is_write_only()) {
        (VIRTIO_BLK_T_IN, true) => Op::Read,
        (VIRTIO_BLK_T_OUT, false) if !lim.read_only => Op::Write,
        _ => return Some(chain),
    };
    let len = u64::from(d.len());
    let Some(offset) = sector.checked_mul(512) else {
        return Some(chain);
    };
    if len == 0 || len > lim.max_bytes || (op == Op::Write && regions.is_some_and(|r| r.poisoned()))
    {
        return Some(chain);
    }
    let Ok(slice) = mem.get_slice(d.addr(), len as usize) else {
        return Some(chain);
    };
    let p = slice.ptr_guard_mut().as_ptr();
    // SAFETY: `p` is `len` bytes of one mapped guest memory region
    // (bounds-checked by `get_slice`), kept mapped by the chain the
    // request holds until the bio completes; see `submit` for the guest
    // racing its own bytes and the guard.
    let io = unsafe { IoBuf::from_raw(p, len as usize) };
    let req = Arc::new(Request {
        chain,
        vring: vring.clone(),
        data: Data::Guest(len as usize),
        read: op == Op::Read,
        regions: regions.cloned(),
        status_at: Some(st.addr()),
    });
    dev.submit(Bio::new(op, offset, len, io, req, 0));
    None
}

/// Copy a write's data (the device-readable bytes after the header)
/// into the bounce buffer.
fn copy_in(chain: &Chain, buf: &mut AlignedBuf) -> bool {
    chain.clone().reader(chain.memory()).is_ok_and(|mut r| {
        let mut hdr = [0u8; 16];
        r.read_exact(&mut hdr).is_ok() && r.read_exact(buf.as_mut_slice()).is_ok()
    })
}

/// The data's bytes as one host range when the guest gave them as one:
/// the `len` bytes after the first `skip` of the chain's device-writable
/// (`writable`) or device-readable descriptors, when their guest
/// addresses follow each other. Bounds-checked: `get_slice` refuses a
/// range that is not wholly inside one mapped region. None when the
/// data is scattered, or not where the guest said: the request then
/// goes through a bounce buffer (whose copy fails a bad address).
fn guest_range(chain: &Chain, writable: bool, mut skip: u64, len: u64) -> Option<*mut u8> {
    let descs = if writable {
        chain.clone().writable()
    } else {
        chain.clone().readable()
    };
    let (mut start, mut end, mut need) = (None, 0u64, len);
    for d in descs {
        let dlen = u64::from(d.len());
        let k = skip.min(dlen);
        skip -= k;
        if dlen == k {
            continue;
        }
        let addr = d.addr().0.checked_add(k)?;
        match start {
            None => start = Some(addr),
            Some(_) if addr != end => return None,
            Some(_) => {}
        }
        let take = (dlen - k).min(need);
        end = addr.checked_add(take)?;
        need -= take;
        if need == 0 {
            break;
        }
    }
    if need != 0 {
        return None;
    }
    let count = usize::try_from(len).ok()?;
    let slice = chain.memory().get_slice(GuestAddress(start?), count).ok()?;
    Some(slice.ptr_guard_mut().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkstack_core::Device;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::QueueT;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic};

    /// A device that answers at once: reads return 0xAB, writes are kept.
    struct Fill(parking_lot::Mutex<Vec<(u64, Vec<u8>)>>);
    impl Device for Fill {
        fn submit(&self, bio: Bio) {
            if bio.op == Op::Read {
                bio.data_mut().fill(0xAB);
            } else if bio.op == Op::Write {
                self.0.lock().push((bio.offset, bio.data().to_vec()));
            }
            bio.complete(Status::Ok);
        }
        fn size(&self) -> u64 {
            1 << 20
        }
    }

    const HDR: u64 = 0x1_0000;
    const DATA: u64 = 0x2_0000;
    const STATUS: u64 = 0x3_0000;

    /// Put one request (header, `data` bytes of data, status) on a fresh
    /// queue, run it, and return the status byte and the used length.
    fn run(
        kind: u32,
        sector: u64,
        data: u32,
        write_data: bool,
        read_only: bool,
    ) -> (u8, u32, Arc<GuestMemoryMmap<()>>, Arc<Fill>) {
        run_segs(kind, sector, &[(DATA, data)], write_data, read_only)
    }

    /// As [`run`], the data in the descriptors `segs` (address, length).
    fn run_segs(
        kind: u32,
        sector: u64,
        segs: &[(u64, u32)],
        write_data: bool,
        read_only: bool,
    ) -> (u8, u32, Arc<GuestMemoryMmap<()>>, Arc<Fill>) {
        let mem =
            Arc::new(GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap());
        let q = MockSplitQueue::create(&*mem, GuestAddress(0x8000), 16);
        let vring = VringRwLock::new(GuestMemoryAtomic::from(mem.clone()), 16).unwrap();
        vring.set_queue_size(16);
        vring
            .set_queue_info(q.desc_table_addr().0, q.avail_addr().0, q.used_addr().0)
            .unwrap();
        vring.set_queue_ready(true);
        vring.set_enabled(true);
        let mut hdr = [0u8; 16];
        hdr[0..4].copy_from_slice(&kind.to_le_bytes());
        hdr[8..16].copy_from_slice(&sector.to_le_bytes());
        mem.write_slice(&hdr, GuestAddress(HDR)).unwrap();
        for &(addr, len) in segs {
            if addr + u64::from(len) <= 0x10_0000 {
                mem.write_slice(&vec![0x5Au8; len as usize], GuestAddress(addr))
                    .unwrap();
            }
        }
        let next = VRING_DESC_F_NEXT as u16;
        let data_flags = if write_data {
            0
        } else {
            VRING_DESC_F_WRITE as u16
        };
        let mut descs = vec![RawDescriptor::from(SplitDescriptor::new(HDR, 16, next, 1))];
        for (i, &(addr, len)) in segs.iter().enumerate() {
            let n = i as u16 + 2;
            descs.push(RawDescriptor::from(SplitDescriptor::new(
                addr,
                len,
                data_flags | next,
                n,
            )));
        }
        descs.push(RawDescriptor::from(SplitDescriptor::new(
            STATUS,
            1,
            VRING_DESC_F_WRITE as u16,
            0,
        )));
        q.add_desc_chains(&descs, 0).unwrap();
        let dev = Arc::new(Fill(parking_lot::Mutex::new(Vec::new())));
        let dref: DeviceRef = dev.clone();
        let mut id = [0u8; ID_LEN];
        id[..10].copy_from_slice(b"blkstack-x");
        let lim = Limits {
            max_bytes: 64 << 10,
            read_only,
            id,
        };
        let chain = vring
            .get_mut()
            .get_queue_mut()
            .pop_descriptor_chain(mem.clone())
            .unwrap();
        start(chain, &vring, &dref, &lim, None);
        let status: u8 = mem.read_obj(GuestAddress(STATUS)).unwrap();
        // used ring: flags u16, idx u16, then {id u32, len u32}.
        let used_len: u32 = mem.read_obj(GuestAddress(q.used_addr().0 + 8)).unwrap();
        let used_idx: u16 = mem.read_obj(GuestAddress(q.used_addr().0 + 2)).unwrap();
        assert_eq!(used_idx, 1, "the request went on the used ring once");
        (status, used_len, mem, dev)
    }

    #[test]
    fn a_read_fills_guest_memory_and_reports_its_length() {
        let (status, used, mem, _) = run(VIRTIO_BLK_T_IN, 8, 4096, false, false);
        assert_eq!(status, VIRTIO_BLK_S_OK as u8);
        assert_eq!(used, 4097);
        let mut back = vec![0u8; 4096];
        mem.read_slice(&mut back, GuestAddress(DATA)).unwrap();
        assert!(back.iter().all(|&b| b == 0xAB));
    }

    #[test]
    fn a_write_carries_the_guest_data_to_its_sector() {
        let (status, used, _, dev) = run(VIRTIO_BLK_T_OUT, 16, 8192, true, false);
        assert_eq!((status, used), (VIRTIO_BLK_S_OK as u8, 1));
        let w = dev.0.lock();
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].0, 16 * 512);
        assert!(w[0].1.len() == 8192 && w[0].1.iter().all(|&b| b == 0x5A));
    }

    #[test]
    fn refusals_answer_with_a_status_and_touch_nothing() {
        // A write to a read-only disk, an op we do not know, a read past
        // the largest request.
        let (s, _, _, dev) = run(VIRTIO_BLK_T_OUT, 0, 4096, true, true);
        assert_eq!(s, VIRTIO_BLK_S_IOERR as u8);
        assert!(dev.0.lock().is_empty());
        let (s, _, _, _) = run(99, 0, 512, false, false);
        assert_eq!(s, VIRTIO_BLK_S_UNSUPP as u8);
        let (s, used, _, _) = run(VIRTIO_BLK_T_IN, 0, 128 << 10, false, false);
        assert_eq!((s, used), (VIRTIO_BLK_S_IOERR as u8, 1));
    }

    #[test]
    fn data_in_scattered_or_adjacent_segments_reaches_the_device_whole() {
        // Two separate ranges (the bounce buffer), then two that follow
        // each other (one range in place).
        for segs in [
            [(DATA, 4096), (DATA + 0x8000, 4096)],
            [(DATA, 4096), (DATA + 4096, 4096)],
        ] {
            let (s, used, mem, _) = run_segs(VIRTIO_BLK_T_IN, 8, &segs, false, false);
            assert_eq!((s, used), (VIRTIO_BLK_S_OK as u8, 8193));
            for (addr, len) in segs {
                let mut back = vec![0u8; len as usize];
                mem.read_slice(&mut back, GuestAddress(addr)).unwrap();
                assert!(back.iter().all(|&b| b == 0xAB), "{segs:x?}");
            }
            let (s, used, _, dev) = run_segs(VIRTIO_BLK_T_OUT, 8, &segs, true, false);
            assert_eq!((s, used), (VIRTIO_BLK_S_OK as u8, 1));
            let w = dev.0.lock();
            assert!(w[0].1.len() == 8192 && w[0].1.iter().all(|&b| b == 0x5A));
        }
    }

    #[test]
    fn data_outside_guest_memory_is_never_touched() {
        // A range that starts inside the memory and runs past its end,
        // and one wholly outside it.
        for seg in [(0x10_0000 - 2048, 4096), (0x20_0000, 4096)] {
            let (s, used, _, dev) = run_segs(VIRTIO_BLK_T_OUT, 0, &[seg], true, false);
            assert_eq!((s, used), (VIRTIO_BLK_S_IOERR as u8, 1), "{seg:x?}");
            assert!(dev.0.lock().is_empty());
            // A read's chain cannot even take its status: it goes back
            // with nothing written, the part inside memory untouched.
            let (_, used, mem, _) = run_segs(VIRTIO_BLK_T_IN, 0, &[seg], false, false);
            assert_eq!(used, 0, "{seg:x?}");
            let mut back = [1u8; 2048];
            mem.read_slice(&mut back, GuestAddress(0x10_0000 - 2048))
                .unwrap();
            assert!(back.iter().all(|&b| b == 0), "{seg:x?}");
        }
    }

    #[test]
    fn get_id_answers_the_serial() {
        let (s, used, mem, _) = run(VIRTIO_BLK_T_GET_ID, 0, ID_LEN as u32, false, false);
        assert_eq!((s, used), (VIRTIO_BLK_S_OK as u8, ID_LEN as u32 + 1));
        let mut id = [0u8; 10];
        mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
        assert_eq!(&id, b"blkstack-x");
    }

    /// The eventfd the queue calls the guest through (what a VMM hands
    /// over with SET_VRING_CALL).
    fn call_fd(vring: &VringRwLock) -> std::fs::File {
        use std::os::fd::FromRawFd;
        // SAFETY: creates a new eventfd that nothing else owns.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        assert!(fd >= 0, "eventfd");
        // SAFETY: `fd` was just created and is ours alone.
        let f = unsafe { std::fs::File::from_raw_fd(fd) };
        vring.set_call(Some(f.try_clone().unwrap()));
        f
    }

    /// How many calls the eventfd counted since it was last read.
    fn calls(f: &std::fs::File) -> u64 {
        let mut b = [0u8; 8];
        match (&*f).read(&mut b) {
            Ok(8) => u64::from_ne_bytes(b),
            _ => 0,
        }
    }

    #[test]
    fn completions_in_one_batch_call_the_guest_once() {
        const N: u16 = 4;
        let mem =
            Arc::new(GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap());
        let q = MockSplitQueue::create(&*mem, GuestAddress(0x8000), 32);
        let vring = VringRwLock::new(GuestMemoryAtomic::from(mem.clone()), 32).unwrap();
        vring.set_queue_size(32);
        vring
            .set_queue_info(q.desc_table_addr().0, q.avail_addr().0, q.used_addr().0)
            .unwrap();
        vring.set_queue_ready(true);
        vring.set_enabled(true);
        let call = call_fd(&vring);
        let mut hdr = [0u8; 16];
        hdr[0..4].copy_from_slice(&VIRTIO_BLK_T_GET_ID.to_le_bytes());
        mem.write_slice(&hdr, GuestAddress(HDR)).unwrap();
        // 2N + 2 GET_ID requests: header, the serial's room, status.
        let (next, w) = (VRING_DESC_F_NEXT as u16, VRING_DESC_F_WRITE as u16);
        let mut descs = Vec::new();
        for k in 0..2 * N + 2 {
            let (d, st) = (DATA + u64::from(k) * 64, STATUS + u64::from(k));
            descs.push(RawDescriptor::from(SplitDescriptor::new(
                HDR,
                16,
                next,
                3 * k + 1,
            )));
            descs.push(RawDescriptor::from(SplitDescriptor::new(
                d,
                ID_LEN as u32,
                w | next,
                3 * k + 2,
            )));
            descs.push(RawDescriptor::from(SplitDescriptor::new(st, 1, w, 0)));
        }
        q.add_desc_chains(&descs, 0).unwrap();
        let dev: DeviceRef = Arc::new(Fill(parking_lot::Mutex::new(Vec::new())));
        let lim = Limits {
            max_bytes: 64 << 10,
            read_only: false,
            id: [b'x'; ID_LEN],
        };
        let pop = || {
            vring
                .get_mut()
                .get_queue_mut()
                .pop_descriptor_chain(mem.clone())
                .unwrap()
        };
        // Without a batch, each request calls (no event index: every
        // completion wants a call).
        for _ in 0..N {
            start(pop(), &vring, &dev, &lim, None);
        }
        assert_eq!(calls(&call), u64::from(N));
        // In a batch, the requests go on the used ring at once and the
        // call waits for the batch's end.
        let batch = comp_batch::CompletionBatch::start();
        for _ in 0..N {
            start(pop(), &vring, &dev, &lim, None);
        }
        let used_idx: u16 = mem.read_obj(GuestAddress(q.used_addr().0 + 2)).unwrap();
        assert_eq!(used_idx, 2 * N, "every request is on the used ring");
        assert_eq!(calls(&call), 0, "no call before the batch ends");
        drop(batch);
        assert_eq!(calls(&call), 1, "one call for the batch");
        // A guest that says VRING_AVAIL_F_NO_INTERRUPT is not called.
        mem.write_obj(1u16.to_le(), q.avail_addr()).unwrap();
        start(pop(), &vring, &dev, &lim, None);
        assert_eq!(calls(&call), 0, "called despite NO_INTERRUPT");
        mem.write_obj(0u16, q.avail_addr()).unwrap();
        start(pop(), &vring, &dev, &lim, None);
        assert_eq!(calls(&call), 1);
    }
}
