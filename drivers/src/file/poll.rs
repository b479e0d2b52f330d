//! Polled completions for the `file` device: a second io_uring created
//! with `IORING_SETUP_IOPOLL`, or `IORING_SETUP_HYBRID_IOPOLL` (the upstream
//! change "io_uring: add support for hybrid IOPOLL", Linux 6.13, posted as
//! "io_uring: releasing CPU resources when polling": the first I/O never
//! sleeps, later ones sleep about half the shortest completion time seen,
//! then poll).
//!
//! Only aligned O_DIRECT reads and writes go to the polled ring. The
//! kernel may refuse polling at setup (an old kernel: EINVAL; hybrid then
//! falls back to plain IOPOLL, then to interrupts) or per I/O (a device
//! without poll queues, such as virtio-blk: the ring is created but each
//! CQE carries -EOPNOTSUPP). Both are logged once and shown by `status`; a
//! refused I/O is resubmitted on the interrupt-driven ring, so the caller
//! never sees the refusal, and a one-block probe read at construction finds
//! the per-I/O refusal before the device is used.

use super::options::PollMode;
use super::refusal::PollRefusal;
use super::ring::{setup_ring, RingShared};
use super::{Backend, FileDevice};
use blkstack_core::{AlignedBuf, Bio, Device, Op};
use io_uring::IoUring;
use std::path::Path;
use std::sync::atomic::Ordering;

/// The kernel's `IORING_SETUP_IOPOLL` / `IORING_SETUP_HYBRID_IOPOLL`
/// (include/uapi/linux/io_uring.h).
const SETUP_IOPOLL: u32 = 1 << 0;
const SETUP_HYBRID_IOPOLL: u32 = 1 << 17;

fn poll_flags(mode: PollMode) -> u32 {
    match mode {
        PollMode::Interrupt => 0,
        PollMode::Iopoll => SETUP_IOPOLL,
        PollMode::Hybrid => SETUP_IOPOLL | SETUP_HYBRID_IOPOLL,
    }
}

/// Why the kernel refused polled I/O: it has no poll queues for the
/// backing device.
const REFUSED_PER_IO: &str =
    "the kernel returned EOPNOTSUPP for a polled read/write: the device has no poll queues";

/// The polled ring the kernel agreed to, and why it differs from the one
/// asked for, if it does.
pub(super) struct PolledSetup {
    pub(super) ring: Option<(PollMode, IoUring)>,
    pub(super) fallback: Option<String>,
}

/// Set up a polled ring of `entries` in mode `want`, trying plain IOPOLL
/// when the kernel refuses hybrid polling.
pub(super) fn setup_polled_ring(want: PollMode, entries: u32, path: &Path) -> PolledSetup {
    let mut tries = vec![want];
    if want == PollMode::Hybrid {
        tries.push(PollMode::Iopoll);
    }
    let mut ring = None;
    let mut reasons = Vec::new();
    for mode in tries {
        match setup_ring(entries, poll_flags(mode)) {
            Ok(r) => {
                ring = Some((mode, r));
                break;
            }
            Err(e) => reasons.push(format!("{} ring setup failed: {e}", mode.name())),
        }
    }
    let fallback = (!reasons.is_empty()).then(|| reasons.join("; "));
    if let Some(why) = &fallback {
        let using = ring
            .as_ref()
            .map(|(mode, _)| mode.name())
            .unwrap_or("interrupt-driven completions");
        tracing::warn!(path = %path.display(), reason = %why, using, "file: polled ring refused");
    }
    PolledSetup { ring, fallback }
}

impl RingShared {
    /// The device cannot poll: redo this bio (taken from slot `idx`) on
    /// the interrupt ring, and send later ones there.
    pub(super) fn resubmit_refused(
        &self,
        idx: u32,
        bio: Bio,
        normal: &RingShared,
        refusal: &PollRefusal,
    ) {
        refusal.refuse(REFUSED_PER_IO, &self.files.path);
        self.files
            .stats
            .poll_refused
            .fetch_add(1, Ordering::Relaxed);
        self.release(idx);
        normal.submit(bio);
    }
}

impl FileDevice {
    /// Read one block through the polled ring, so that a device without
    /// poll queues is found (and logged) before anyone relies on it. The
    /// probe counts as one read in `status`.
    pub(super) fn probe_polling(&self) {
        let Backend::Uring {
            polled: Some(_), ..
        } = &self.backend
        else {
            return;
        };
        let size = self.size();
        let len = self.files.off_align.max(512).min(size);
        // Reading a hole completes without reaching the disk (and so
        // without being refused): probe the first block that holds data.
        // An all-hole file cannot be probed without writing; its first
        // real I/O finds the refusal instead.
        let Some(at) = self
            .extents(0, size)
            .and_then(|v| v.into_iter().find(|e| !e.hole))
            .map(|e| e.offset - e.offset % len)
        else {
            return;
        };
        if at + len > size {
            return;
        }
        let mut buf = AlignedBuf::new(len as usize);
        let st = blkstack_core::submit_and_wait(self, Op::Read, at, len, buf.as_mut_slice());
        if !st.is_ok() {
            tracing::warn!(
                path = %self.files.path.display(),
                status = %st,
                "file: polling probe read failed"
            );
        }
    }
}
