//! The queue thread reaps the `file` device's io_uring itself
//! ([`BlkBackend::attach_reaper`], [`blkstack_core::Reaper`]): a virtqueue
//! over a real `file` table (the ring, the kernel's io_uring, a temporary
//! file), driven the way the queue's worker drives it: a kick event, then
//! wait for the ring's descriptor and the reap event. A burst of writes
//! and the reads that check them back complete through it, the data on
//! the disk file too; a connection that ends with requests in flight
//! hands them to the device's own completion thread, which finishes
//! them. Only waits with a bound; nothing here is timed.

use blkstack_core::DeviceRef;
use blkstack_mapped::Registry;
use blkstack_vhost_user_blk::backend::BlkBackend;
use blkstack_vhost_user_blk::vring::BlkVring;
use std::os::fd::RawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vhost_user_backend::{VhostUserBackend, VringT};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap,
};
use vmm_sys_util::epoll::EventSet;

const MEM: usize = 1 << 20;
const QUEUE: u16 = 64;
/// Requests per burst (several in flight in the ring at once).
const BURST: u16 = 8;
const HDR: u64 = 0x1_0000;
const STATUS: u64 = 0x1_8000;
const DATA: u64 = 0x2_0000;
const LEN: u32 = 4096;
/// How long any one wait may take before the test calls it a hang.
const HANG: Duration = Duration::from_secs(20);

struct Rig {
    _dir: tempfile::TempDir,
    disk: std::fs::File,
    mem: GuestMemoryAtomic<GuestMemoryMmap<()>>,
    vring: BlkVring,
    backend: Arc<BlkBackend>,
    _reg: Arc<Registry>,
}

/// The byte request `k` of a burst writes.
fn pattern(k: u16) -> u8 {
    0x11 + k as u8
}

fn rig() -> Rig {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("disk");
    let disk = std::fs::File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("disk file");
    disk.set_len(1 << 20).expect("set_len");
    let reg = Registry::new();
    let dev = reg
        .create(
            "d",
            &format!("0 2048 file {} reap_backstop_ms=60000", path.display()),
        )
        .expect("a file table");
    let dev: DeviceRef = dev;
    let backend = BlkBackend::new("d", dev, false, 1).expect("backend");
    // Guest memory over a file, as a VMM shares it.
    let f = tempfile::tempfile().expect("memory file");
    f.set_len(MEM as u64).expect("set_len");
    let fo = FileOffset::new(f, 0);
    let table = GuestMemoryMmap::<()>::from_ranges_with_files([(GuestAddress(0), MEM, Some(fo))])
        .expect("map");
    let mem = GuestMemoryAtomic::new(table);
    backend.update_memory(mem.clone()).expect("memory table");
    let vring = BlkVring::new(mem.clone(), QUEUE).expect("vring");
    Rig {
        _dir: dir,
        disk,
        mem,
        vring,
        backend,
        _reg: reg,
    }
}

/// Put `BURST` requests of `kind` on the queue (request k: sector 8k,
/// its own data and status bytes), writes carrying `pattern(k)`.
fn add_burst(q: &MockSplitQueue<'_, GuestMemoryMmap<()>>, m: &GuestMemoryMmap<()>, kind: u32) {
    let (next, w) = (VRING_DESC_F_NEXT as u16, VRING_DESC_F_WRITE as u16);
    let mut descs = Vec::new();
    for k in 0..BURST {
        let (h, d, st) = (
            HDR + u64::from(k) * 16,
            DATA + u64::from(k) * u64::from(LEN),
            STATUS + u64::from(k),
        );
        let mut hdr = [0u8; 16];
        hdr[0..4].copy_from_slice(&kind.to_le_bytes());
        hdr[8..16].copy_from_slice(&(8 * u64::from(k)).to_le_bytes());
        m.write_slice(&hdr, GuestAddress(h)).unwrap();
        let fill = if kind == VIRTIO_BLK_T_OUT {
            pattern(k)
        } else {
            0
        };
        m.write_slice(&vec![fill; LEN as usize], GuestAddress(d))
            .unwrap();
        m.write_obj(0xFFu8, GuestAddress(st)).unwrap();
        let data_flags = if kind == VIRTIO_BLK_T_OUT { 0 } else { w };
        descs.push(RawDescriptor::from(SplitDescriptor::new(
            h,
            16,
            next,
            3 * k + 1,
        )));
        descs.push(RawDescriptor::from(SplitDescriptor::new(
            d,
            LEN,
            data_flags | next,
            3 * k + 2,
        )));
        descs.push(RawDescriptor::from(SplitDescriptor::new(st, 1, w, 0)));
    }
    q.add_desc_chains(&descs, 0).unwrap();
}

fn used_idx(m: &GuestMemoryMmap<()>, q: &MockSplitQueue<'_, GuestMemoryMmap<()>>) -> u16 {
    m.read_obj(GuestAddress(q.used_addr().0 + 2)).unwrap()
}

/// Wait a little for the descriptor to poll readable (the device's own
/// thread may have reaped what was there: the caller checks again).
fn readable(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, the length given.
    let n = unsafe { libc::poll(&mut p, 1, 10) };
    n == 1 && p.revents & libc::POLLIN != 0
}

/// Run a kick and then, as the queue's thread does, reap on each reap
/// event until `want` requests are on the used ring. Returns how many of
/// them the reap events completed on this thread.
fn kick_and_reap(
    r: &Rig,
    q: &MockSplitQueue<'_, GuestMemoryMmap<()>>,
    fd: RawFd,
    want: u16,
) -> u16 {
    let m = r.mem.memory();
    let vrings = [r.vring.clone()];
    r.backend.handle_event(0, EventSet::IN, &vrings, 0).unwrap();
    let ev = r.backend.reap_event();
    let mut here = 0;
    let deadline = Instant::now() + HANG;
    while used_idx(&m, q) != want {
        assert!(Instant::now() < deadline, "requests never completed");
        if !readable(fd) {
            continue;
        }
        let before = used_idx(&m, q);
        r.backend
            .handle_event(ev, EventSet::IN, &vrings, 0)
            .unwrap();
        here += used_idx(&m, q).wrapping_sub(before);
    }
    here
}

fn statuses_ok(m: &GuestMemoryMmap<()>) {
    for k in 0..BURST {
        let s: u8 = m.read_obj(GuestAddress(STATUS + u64::from(k))).unwrap();
        assert_eq!(s, VIRTIO_BLK_S_OK as u8, "request {k}'s status");
    }
}

#[test]
fn a_queue_thread_reaps_the_file_ring_itself_and_hands_back_at_a_stop() {
    let r = rig();
    let m = r.mem.memory();
    let q = MockSplitQueue::create(&*m, GuestAddress(0x8000), QUEUE);
    r.vring.set_queue_size(QUEUE);
    r.vring
        .set_queue_info(q.desc_table_addr().0, q.avail_addr().0, q.used_addr().0)
        .unwrap();
    r.vring.set_queue_ready(true);
    r.vring.set_enabled(true);
    let fd = r
        .backend
        .attach_reaper()
        .expect("a file table offers its ring's completions");

    // A burst of writes, then the reads that check them, each with all
    // its requests in the ring at once.
    add_burst(&q, &m, VIRTIO_BLK_T_OUT);
    let mut here = kick_and_reap(&r, &q, fd, BURST);
    statuses_ok(&m);
    for k in 0..BURST {
        let mut back = vec![0u8; LEN as usize];
        r.disk
            .read_exact_at(&mut back, 8 * 512 * u64::from(k))
            .unwrap();
        assert!(back.iter().all(|&b| b == pattern(k)), "disk block {k}");
    }
    add_burst(&q, &m, VIRTIO_BLK_T_IN);
    here += kick_and_reap(&r, &q, fd, 2 * BURST);
    statuses_ok(&m);
    for k in 0..BURST {
        let mut back = vec![0u8; LEN as usize];
        m.read_slice(
            &mut back,
            GuestAddress(DATA + u64::from(k) * u64::from(LEN)),
        )
        .unwrap();
        assert!(back.iter().all(|&b| b == pattern(k)), "read back {k}");
    }
    // The device's own thread reaps only what waits a whole backstop
    // tick (a minute here) unreaped, so this thread completed them all.
    assert_eq!(here, 2 * BURST, "requests the queue's thread completed");

    // The connection ends with a burst in flight: nobody reaps on this
    // thread any more, and every request still completes.
    add_burst(&q, &m, VIRTIO_BLK_T_IN);
    let vrings = [r.vring.clone()];
    r.backend.handle_event(0, EventSet::IN, &vrings, 0).unwrap();
    r.backend.end_connection();
    let deadline = Instant::now() + HANG;
    while used_idx(&m, &q) != 3 * BURST {
        assert!(
            Instant::now() < deadline,
            "in-flight requests were lost at the stop"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    statuses_ok(&m);
    for k in 0..BURST {
        let mut back = vec![0u8; LEN as usize];
        m.read_slice(
            &mut back,
            GuestAddress(DATA + u64::from(k) * u64::from(LEN)),
        )
        .unwrap();
        assert!(
            back.iter().all(|&b| b == pattern(k)),
            "read after the stop {k}"
        );
    }
}
