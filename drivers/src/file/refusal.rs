//! Whether the kernel refused polled completions for a `file` device, and
//! why: shared by the device, its polled ring (which refuses per I/O when
//! a CQE carries -EOPNOTSUPP) and `status`. Apart from `poll.rs` so that
//! the rings can name it without depending on the polling code.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// Why and whether polling was turned off, shared by the device and its
/// polled ring.
#[derive(Default)]
pub(super) struct PollRefusal {
    refused: AtomicBool,
    reason: OnceLock<&'static str>,
}

impl PollRefusal {
    pub(super) fn refuse(&self, reason: &'static str, path: &Path) {
        if self.reason.set(reason).is_ok() {
            tracing::warn!(
                path = %path.display(),
                reason,
                "file: polled completions refused; falling back to interrupt-driven completions"
            );
        }
        self.refused.store(true, Ordering::Release);
    }

    pub(super) fn is_refused(&self) -> bool {
        self.refused.load(Ordering::Acquire)
    }

    pub(super) fn reason(&self) -> Option<&'static str> {
        self.reason.get().copied()
    }
}
