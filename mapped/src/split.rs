//! Fan-out of one bio into several children and fan-in of their
//! completions: used where a bio crosses a table line or a stripe chunk,
//! and where a flush must reach every underlying device (dm's
//! `num_flush_bios`). The parent completes once, when the last child does,
//! with the first error any child saw (dm's `dec_pending` semantics).
//!
//! This is the only per-I/O allocation in the mapped layer, and only for
//! bios that actually split.

use blkstack_core::{Bio, EndIo, Status};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

pub struct Split {
    parent: Mutex<Option<Bio>>,
    remaining: AtomicUsize,
    status: AtomicU8,
}

impl Split {
    /// Split `parent` into `pieces` (parent-relative `(offset, len)` byte
    /// ranges); `submit` is called for each child, in order. For a flush,
    /// pass `(0, 0)` once per device to reach.
    pub fn run(parent: Bio, pieces: &[(u64, u64)], mut submit: impl FnMut(usize, Bio)) {
        if pieces.is_empty() {
            parent.complete(Status::Ok);
            return;
        }
        let split = Arc::new(Split {
            parent: Mutex::new(None),
            remaining: AtomicUsize::new(pieces.len()),
            status: AtomicU8::new(Status::Ok.as_u8()),
        });
        let children: Vec<Bio> = pieces
            .iter()
            .enumerate()
            .map(|(i, &(off, len))| parent.child(off, len, split.clone(), i as u64))
            .collect();
        *split.parent.lock() = Some(parent);
        for (i, c) in children.into_iter().enumerate() {
            submit(i, c);
        }
    }
}

impl EndIo for Split {
    fn end_io(&self, _child: Bio, status: Status, _private: u64) {
        if !status.is_ok() {
            let _ = self.status.compare_exchange(
                Status::Ok.as_u8(),
                status.as_u8(),
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let parent = self.parent.lock().take();
            if let Some(p) = parent {
                p.complete(Status::from_u8(self.status.load(Ordering::Acquire)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkstack_core::testing::CompletionRecorder;
    use blkstack_core::{IoBuf, Op};

    #[test]
    fn parent_completes_once_with_first_error() {
        let owner = CompletionRecorder::new();
        let mut mem = vec![0u8; 4096];
        // SAFETY: `mem` outlives the bio and its children, all completed
        // below.
        let buf = unsafe { IoBuf::from_slice(&mut mem) };
        let parent = Bio::new(Op::Write, 0, 4096, buf, owner.clone(), 0);
        let mut kids = Vec::new();
        Split::run(parent, &[(0, 1024), (1024, 1024), (2048, 2048)], |_, c| {
            kids.push(c)
        });
        assert_eq!(kids[2].len, 2048);
        let mut it = kids.into_iter();
        it.next().unwrap().complete(Status::Ok);
        assert_eq!(owner.count(), 0);
        it.next().unwrap().complete(Status::Medium);
        it.next().unwrap().complete(Status::IoError);
        assert_eq!(owner.statuses(), vec![Status::Medium]);
    }
}
