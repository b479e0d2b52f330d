//! The floor probe serves a real vhost-user frontend correctly: the `vhost`
//! crate's `Frontend` (what a VMM speaks) sets up guest memory over a file
//! and one virtqueue, and bursts of virtio-blk requests go through the
//! probe in both waits (epoll and io_uring): writes reach the raw file and
//! read back, null reads come back as zeros, each burst ends with a call.
//! A malformed message ends its connection only: the next VMM is served.
//! Every wait is bounded; nothing here is timed.

use crate::{serve, Args, Medium, Wait};
use clap::Parser;
use std::io::{Read as _, Write as _};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserVirtioFeatures};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Address, Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

const MEM: usize = 1 << 20;
const QUEUE: u16 = 64;
const BURST: u16 = 8;
/// The used ring, apart from the mock's avail ring (the mock's own used
/// ring starts inside the avail ring's `used_event` field).
const USED: u64 = 0x8000;
const HDR: u64 = 0x1_0000;
const STATUS: u64 = 0x1_8000;
const DATA: u64 = 0x2_0000;
const LEN: u32 = 4096;
/// How long a burst may take before the test calls it a hang.
const HANG_MS: i32 = 20_000;

/// Start a probe on a fresh socket (its thread lives as long as the test
/// process; the medium is leaked for it).
fn start(dir: &Path, argv: &[&str]) -> PathBuf {
    let sock = dir.join("floor.sock");
    let mut all = vec![
        "vhost-floor",
        "--socket",
        sock.to_str().expect("utf-8 path"),
    ];
    all.extend_from_slice(argv);
    let args = Args::try_parse_from(all).expect("arguments");
    let medium: &'static Medium = Box::leak(Box::new(Medium::open(&args).expect("medium")));
    let listener = UnixListener::bind(&sock).expect("bind");
    std::thread::spawn(move || serve(listener, medium));
    sock
}

/// A VMM's side: guest memory over a file, one queue set up and enabled.
struct Vmm {
    fe: Frontend,
    mem: GuestMemoryMmap<()>,
    kick: EventFd,
    call: EventFd,
    /// Where the rings' indexes are.
    avail_idx_at: GuestAddress,
    used_idx_at: GuestAddress,
    _file: std::fs::File,
}

fn connect(sock: &Path) -> Vmm {
    let file = tempfile::tempfile().expect("memory file");
    file.set_len(MEM as u64).expect("set_len");
    let fo = FileOffset::new(file.try_clone().expect("dup"), 0);
    let mem = GuestMemoryMmap::<()>::from_ranges_with_files([(GuestAddress(0), MEM, Some(fo))])
        .expect("map");
    let host = mem.get_host_address(GuestAddress(0)).expect("host address") as u64;
    let mut fe = Frontend::connect(sock, 1).expect("connect");
    fe.set_owner().expect("set_owner");
    let want = 1 << VIRTIO_F_VERSION_1
        | 1 << VIRTIO_RING_F_EVENT_IDX
        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    let offered = fe.get_features().expect("get_features");
    assert_eq!(offered & want, want, "features offered: {offered:#x}");
    fe.set_features(want).expect("set_features");
    let pf = fe.get_protocol_features().expect("protocol features");
    fe.set_protocol_features(
        pf & (VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ),
    )
    .expect("set_protocol_features");
    let region = VhostUserMemoryRegionInfo {
        guest_phys_addr: 0,
        memory_size: MEM as u64,
        userspace_addr: host,
        mmap_offset: 0,
        mmap_handle: file.as_raw_fd(),
    };
    fe.set_mem_table(&[region]).expect("set_mem_table");
    let q = MockSplitQueue::new(&mem, QUEUE);
    fe.set_vring_num(0, QUEUE).expect("set_vring_num");
    let ring = VringConfigData {
        queue_max_size: QUEUE,
        queue_size: QUEUE,
        flags: 0,
        desc_table_addr: host + q.desc_table_addr().0,
        used_ring_addr: host + USED,
        avail_ring_addr: host + q.avail_addr().0,
        log_addr: None,
    };
    fe.set_vring_addr(0, &ring).expect("set_vring_addr");
    fe.set_vring_base(0, 0).expect("set_vring_base");
    let (kick, call) = (
        EventFd::new(0).expect("kick"),
        EventFd::new(0).expect("call"),
    );
    fe.set_vring_call(0, &call).expect("set_vring_call");
    fe.set_vring_kick(0, &kick).expect("set_vring_kick");
    fe.set_vring_enable(0, true).expect("set_vring_enable");
    let (avail_idx_at, used_idx_at) = (q.avail_addr().unchecked_add(2), GuestAddress(USED + 2));
    Vmm {
        avail_idx_at,
        used_idx_at,
        fe,
        mem,
        kick,
        call,
        _file: file,
    }
}

impl Vmm {
    /// Queue `BURST` requests of `kind` (request k: sector 8k, its own data
    /// and status bytes; writes carry `pattern(k)`, reads start as 0xAA),
    /// kick, wait for the call; each status must be OK.
    fn burst(&self, kind: u32) {
        // The mock lays the rings out again (its avail index zeroed): put
        // the index of the bursts before back.
        let (avail_at, used_at) = (self.avail_idx_at, self.used_idx_at);
        let avail0: u16 = self.mem.read_obj(avail_at).expect("avail idx");
        let used0: u16 = self.mem.read_obj(used_at).expect("used idx");
        let q = MockSplitQueue::new(&self.mem, QUEUE);
        self.mem.write_obj(avail0, avail_at).expect("avail idx");
        // used_event (after the avail ring): call once the burst is done.
        let used_event = q.avail_addr().unchecked_add(4 + 2 * u64::from(QUEUE));
        let last = used0.wrapping_add(BURST - 1);
        self.mem.write_obj(last, used_event).expect("used_event");
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
            self.mem.write_slice(&hdr, GuestAddress(h)).expect("header");
            let fill = if kind == VIRTIO_BLK_T_OUT {
                pattern(k)
            } else {
                0xAA
            };
            self.mem
                .write_slice(&[fill; LEN as usize], GuestAddress(d))
                .expect("data");
            self.mem
                .write_obj(0xFFu8, GuestAddress(st))
                .expect("status");
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
        q.add_desc_chains(&descs, 0).expect("chains");
        self.kick.write(1).expect("kick");
        let mut p = libc::pollfd {
            fd: self.call.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: p is one live pollfd.
        let n = unsafe { libc::poll(&mut p, 1, HANG_MS) };
        assert_eq!(n, 1, "no call from the probe within {HANG_MS} ms");
        self.call.read().expect("call");
        let used: u16 = self.mem.read_obj(used_at).expect("used idx");
        assert_eq!(
            used,
            used0.wrapping_add(BURST),
            "used entries after the call"
        );
        for k in 0..BURST {
            let st: u8 = self
                .mem
                .read_obj(GuestAddress(STATUS + u64::from(k)))
                .expect("status");
            assert_eq!(st, VIRTIO_BLK_S_OK as u8, "request {k}'s status");
        }
    }

    /// Request k's data buffer.
    fn data(&self, k: u16) -> Vec<u8> {
        let mut v = vec![0u8; LEN as usize];
        let at = GuestAddress(DATA + u64::from(k) * u64::from(LEN));
        self.mem.read_slice(&mut v, at).expect("data");
        v
    }
}

/// The byte request `k` of a burst writes.
fn pattern(k: u16) -> u8 {
    0x11 + k as u8
}

fn file_round_trip(wait: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = dir.path().join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).expect("disk");
    let sock = start(
        dir.path(),
        &[
            "--kind",
            "file",
            "--path",
            disk.to_str().expect("path"),
            "--wait",
            wait,
        ],
    );
    let vmm = connect(&sock);
    vmm.burst(VIRTIO_BLK_T_OUT);
    let f = std::fs::File::open(&disk).expect("open");
    for k in 0..BURST {
        let mut b = vec![0u8; LEN as usize];
        f.read_exact_at(&mut b, u64::from(k) * 8 * 512)
            .expect("read disk");
        assert!(
            b.iter().all(|&x| x == pattern(k)),
            "disk at request {k} ({wait})"
        );
    }
    vmm.burst(VIRTIO_BLK_T_IN);
    for k in 0..BURST {
        assert!(
            vmm.data(k).iter().all(|&x| x == pattern(k)),
            "read back {k} ({wait})"
        );
    }
    drop(vmm.fe);
}

#[test]
fn file_floor_keeps_what_it_is_given_waiting_in_the_ring() {
    file_round_trip("ring");
}

#[test]
fn file_floor_keeps_what_it_is_given_waiting_in_epoll() {
    file_round_trip("epoll");
}

#[test]
fn null_floor_reads_zeros_and_survives_a_malformed_message() {
    // A medium the leg does not take is refused before any socket.
    let args = Args::parse_from(["f", "--kind", "null", "--path", "/x", "--socket", "s"]);
    let e = Medium::open(&args).err().expect("null with a path");
    assert!(e.to_string().contains("--kind null wants --size"), "{e}");
    for wait in [Wait::Ring, Wait::Epoll] {
        let dir = tempfile::tempdir().expect("tempdir");
        let w = if wait == Wait::Ring { "ring" } else { "epoll" };
        let sock = start(
            dir.path(),
            &["--kind", "null", "--size", "1048576", "--wait", w],
        );
        // A header naming no request, with a body size past the limit.
        let mut bad = UnixStream::connect(&sock).expect("connect");
        let mut msg = Vec::new();
        for v in [0xdead_u32, 1, 0x10_0000] {
            msg.extend_from_slice(&v.to_le_bytes());
        }
        bad.write_all(&msg).expect("send");
        bad.set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .expect("timeout");
        let mut b = [0u8; 64];
        assert!(
            matches!(bad.read(&mut b), Ok(0)),
            "the probe must close a malformed connection ({w})"
        );
        // The next VMM is served: writes are OK, reads fill with zeros.
        let vmm = connect(&sock);
        vmm.burst(VIRTIO_BLK_T_OUT);
        vmm.burst(VIRTIO_BLK_T_IN);
        for k in 0..BURST {
            assert!(vmm.data(k).iter().all(|&x| x == 0), "null read {k} ({w})");
        }
    }
}

/// The guest's side of [`a_tcg_guest_reads_what_it_wrote`]: zeros from the
/// null disk, random data through the file disk and back, by `dd` with
/// `O_DIRECT` (every request one 4 KiB page, as the bench's fio sends).
const GUEST: &str = r#"
set -e
cat /sys/block/vda/size /sys/block/vdb/size
dd if=/dev/vda of=/tmp/z bs=4k count=16 iflag=direct 2>/dev/null
head -c 65536 /dev/zero | cmp - /tmp/z && echo NULL-ZEROS
dd if=/dev/urandom of=/dev/vda bs=4k count=8 oflag=direct 2>/dev/null && echo NULL-WRITES
head -c 262144 /dev/urandom > /tmp/r
dd if=/tmp/r of=/dev/vdb bs=4k seek=7 oflag=direct 2>/dev/null
dd if=/dev/vdb of=/tmp/r2 bs=4k skip=7 count=64 iflag=direct 2>/dev/null
cmp /tmp/r /tmp/r2 && echo FILE-ROUND-TRIP
echo "SUM $(md5sum < /tmp/r | cut -d' ' -f1)"
"#;

/// A real guest (the kernel VM, Linux's virtio_blk under TCG) through
/// both waits: `null` in epoll as /dev/vda, `file` in the ring as
/// /dev/vdb; what it wrote is on the host's file. A guest boot of its
/// own: `make vhost-floor-vm` (not in `make test`, whose VM budget is
/// spent).
#[test]
#[ignore]
fn a_tcg_guest_reads_what_it_wrote() {
    let top = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    if std::process::Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_err()
    {
        blkstack_test_support::skip("qemu-system-x86_64 is not installed");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = dir.path().join("disk.img");
    std::fs::write(&disk, vec![0u8; 16 << 20]).expect("disk");
    let (nd, fd) = (dir.path().join("n"), dir.path().join("f"));
    std::fs::create_dir_all(&nd).expect("dir");
    std::fs::create_dir_all(&fd).expect("dir");
    let null = start(
        &nd,
        &["--kind", "null", "--size", "67108864", "--wait", "epoll"],
    );
    let path = disk.to_str().expect("path");
    let file = start(&fd, &["--kind", "file", "--path", path, "--wait", "ring"]);
    let script = dir.path().join("guest.sh");
    std::fs::write(&script, GUEST).expect("script");
    let mut cmd = std::process::Command::new(top.join("scripts/kernel-vm.sh"));
    cmd.arg("run")
        .arg("--vhost-user-blk")
        .arg(&null)
        .arg("--vhost-user-blk")
        .arg(&file)
        .arg(&script);
    let out = blkstack_test_support::run(&mut cmd, std::time::Duration::from_secs(400));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the guest failed:\n{text}");
    for want in [
        "131072",
        "32768",
        "NULL-ZEROS",
        "NULL-WRITES",
        "FILE-ROUND-TRIP",
    ] {
        assert!(text.contains(want), "no {want} from the guest:\n{text}");
    }
    let sum = text
        .lines()
        .find_map(|l| l.strip_prefix("SUM "))
        .expect("the guest's checksum");
    let f = std::fs::File::open(&disk).expect("open");
    let mut b = vec![0u8; 262_144];
    f.read_exact_at(&mut b, 7 * 4096).expect("read disk");
    let md5 = std::process::Command::new("md5sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().expect("stdin").write_all(&b)?;
            c.wait_with_output()
        })
        .expect("md5sum");
    let host = String::from_utf8_lossy(&md5.stdout);
    assert!(
        host.starts_with(sum.trim()),
        "host file {host} vs guest {sum}"
    );
}
