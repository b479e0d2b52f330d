//! Kicks are waited for edge-triggered and never read ([`blkstack_vhost_user_blk::vring`]):
//! none may be lost. A VMM on the host (the `vhost-drive` example's
//! driver, which plays Linux's virtio ring driver) keeps requests in
//! flight against the real server ([`VhostExport`]) with no think time,
//! so kicks land while the queue's thread is mid-round, many rounds of
//! them: at queue depth 1 and 32, with the event index and without, over
//! a `memory` disk (inline completions) and a `file` disk (the queue
//! thread reaps the io_uring itself), with and without the polling
//! window. Every request must be answered OK and every read must return
//! what its slot wrote; a lost kick hangs the driver, which fails after
//! its bounded wait. Nothing here is timed.

#[path = "../examples/vhost-drive/driver.rs"]
#[allow(dead_code)]
mod driver;

use blkstack_core::DeviceRef;
use blkstack_mapped::Registry;
use blkstack_vhost_user_blk::server::VhostExport;
use driver::{Mode, Vmm};
use std::sync::Arc;
use std::time::Duration;

/// Sectors of each disk (each slot of the driver owns blocks of it).
const SECTORS: u64 = 8192;

fn export(table: &str, poll: Duration) -> (tempfile::TempDir, VhostExport, Arc<Registry>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let line = table.replace("DIR", dir.path().to_str().expect("utf-8 path"));
    if line.contains(" file ") {
        let f = std::fs::File::create(dir.path().join("disk")).expect("disk file");
        f.set_len(SECTORS * 512).expect("set_len");
    }
    let reg = Registry::new();
    let dev: DeviceRef = reg.create("d", &line).expect("table");
    let sock = dir.path().join("vhost.sock");
    let e = VhostExport::start(&sock, "d", dev, false, (1, poll)).expect("export");
    (dir, e, reg)
}

/// Many rounds at queue depth 1 and 32 on fresh connections (a VMM that
/// reconnects), each request checked.
fn rounds(e: &VhostExport, event_idx: bool) {
    for (qd, n) in [(1usize, 1000u64), (32, 6000)] {
        let mut vmm = Vmm::connect(&e.socket, event_idx).expect("connect");
        vmm.run(Mode::Verify, qd, n, SECTORS)
            .unwrap_or_else(|err| panic!("qd {qd}, event index {event_idx}: {err}"));
        assert!(vmm.kicks > 0 && vmm.calls > 0, "qd {qd}: no kick or call");
        vmm.close();
    }
}

#[test]
fn no_kick_is_lost_on_a_memory_disk() {
    let (_d, e, _r) = export("0 8192 memory", Duration::ZERO);
    rounds(&e, true);
    rounds(&e, false);
    e.stop();
}

#[test]
fn no_kick_is_lost_when_the_queue_thread_reaps_a_file() {
    let (_d, e, _r) = export("0 8192 file DIR/disk", Duration::ZERO);
    rounds(&e, true);
    rounds(&e, false);
    e.stop();
}

#[test]
fn no_kick_is_lost_with_the_polling_window() {
    let (_d, e, _r) = export("0 8192 memory", Duration::from_micros(50));
    rounds(&e, true);
    e.stop();
}
