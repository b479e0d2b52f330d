//! Shared test helpers (cargo feature `testing`, enabled by the other
//! crates in their `[dev-dependencies]`): one completion recorder instead
//! of one per test file.

use crate::bio::{Bio, EndIo};
use crate::clock::now_ns;
use crate::status::Status;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One completion a [`CompletionRecorder`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completed {
    /// The `private` value of the frame (the cookie given to `Bio::new`:
    /// a tag, an index, an offset, whatever the test chose).
    pub cookie: u64,
    /// The bio's offset as it came back (restored to what its owner
    /// submitted).
    pub offset: u64,
    pub status: Status,
    /// When it completed, on [`now_ns`].
    pub at_ns: u64,
}

/// An [`EndIo`] owner that records every completion and lets a test wait
/// for a number of them.
#[derive(Default)]
pub struct CompletionRecorder {
    done: Mutex<Vec<Completed>>,
    cv: Condvar,
}

impl CompletionRecorder {
    pub fn new() -> Arc<CompletionRecorder> {
        Arc::new(CompletionRecorder::default())
    }

    /// Wait until at least `n` completions arrived; `None` if they did not
    /// within `timeout`.
    pub fn try_wait(&self, n: usize, timeout: Duration) -> Option<Vec<Completed>> {
        let until = Instant::now() + timeout;
        let mut g = self.done.lock();
        while g.len() < n {
            if self.cv.wait_until(&mut g, until).timed_out() && g.len() < n {
                return None;
            }
        }
        Some(g.clone())
    }

    /// Wait until at least `n` completions arrived and return all seen so
    /// far; panics, naming how many came, if they do not within `timeout`.
    pub fn wait(&self, n: usize, timeout: Duration) -> Vec<Completed> {
        match self.try_wait(n, timeout) {
            Some(v) => v,
            None => panic!(
                "only {} of {n} completions arrived within {timeout:?}",
                self.count()
            ),
        }
    }

    /// Completions so far.
    pub fn count(&self) -> usize {
        self.done.lock().len()
    }

    /// Every completion so far, in completion order.
    pub fn completions(&self) -> Vec<Completed> {
        self.done.lock().clone()
    }

    /// The statuses so far, in completion order.
    pub fn statuses(&self) -> Vec<Status> {
        self.done.lock().iter().map(|c| c.status).collect()
    }

    /// Forget what was recorded.
    pub fn clear(&self) {
        self.done.lock().clear();
    }
}

impl EndIo for CompletionRecorder {
    fn end_io(&self, bio: Bio, status: Status, cookie: u64) {
        let c = Completed {
            cookie,
            offset: bio.offset,
            status,
            at_ns: now_ns(),
        };
        drop(bio);
        self.done.lock().push(c);
        self.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bio::{IoBuf, Op};

    #[test]
    fn records_each_completion_once_and_waits_for_n() {
        let rec = CompletionRecorder::new();
        let r2 = rec.clone();
        let t = std::thread::spawn(move || {
            for i in 0..3u64 {
                let bio = Bio::new(Op::Flush, i * 4096, 0, IoBuf::empty(), r2.clone(), i);
                bio.complete(if i == 1 { Status::IoError } else { Status::Ok });
            }
        });
        let got = rec.wait(3, Duration::from_secs(10));
        t.join().expect("completer");
        assert_eq!(got.len(), 3);
        assert_eq!(
            got.iter().map(|c| (c.cookie, c.offset)).collect::<Vec<_>>(),
            [(0, 0), (1, 4096), (2, 8192)]
        );
        assert_eq!(rec.statuses(), [Status::Ok, Status::IoError, Status::Ok]);
        assert!(got.windows(2).all(|w| w[0].at_ns <= w[1].at_ns));
        assert!(rec.try_wait(4, Duration::from_millis(20)).is_none());
        rec.clear();
        assert_eq!(rec.count(), 0);
    }
}
