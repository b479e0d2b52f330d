//! A constructed table (the kernel's `struct dm_table`, dm-table.c): the
//! lines in sector order with their built targets, and how a bio is
//! mapped onto them (split at line boundaries and at a target's
//! `max_io_len`, as `dm_split_and_process_bio` does). The table grammar
//! is `table_text.rs`; the device that holds a live and a staged table is
//! `device.rs`.

use crate::split::Split;
use crate::table_text::{render_table, TableLine};
use crate::target::{Target, TargetRef};
use blkstack_core::{Bio, Device, DeviceRef, Features, Op, QueueShape, SECTOR_SIZE};

/// One constructed table line.
pub struct TableEntry {
    /// The line as parsed, kept to print it back for `dmsetup table`.
    pub line: TableLine,
    /// The target its constructor built (kernel `dm_target`'s private state
    /// with its `target_type`).
    pub target: TargetRef,
    /// Registry names of the devices this line uses.
    pub deps: Vec<String>,
    /// Those devices.
    pub devs: Vec<DeviceRef>,
}

impl TableEntry {
    pub(crate) fn start_bytes(&self) -> u64 {
        self.line.start * SECTOR_SIZE
    }
    pub(crate) fn end_bytes(&self) -> u64 {
        (self.line.start + self.line.len) * SECTOR_SIZE
    }
}

/// A constructed table: lines in sector order, tiling `0..size`.
pub struct Table {
    /// The lines, in sector order, each with its built target (kernel
    /// `dm_table.targets`).
    pub entries: Vec<TableEntry>,
    /// Staged with `force`: it may drop data the live table holds in RAM
    /// (see `targets::memory::ram_lost`) when it goes live.
    pub drops_ram: bool,
}

impl Table {
    /// Size of the device the table makes, in bytes: where its last line ends.
    pub fn size_bytes(&self) -> u64 {
        self.entries.last().map(|e| e.end_bytes()).unwrap_or(0)
    }

    /// The target of the line starting at sector `start` with type
    /// `target`, which a reload's constructor may take over.
    pub fn target_at(&self, start: u64, target: &str) -> Option<TargetRef> {
        self.entries
            .iter()
            .find(|e| e.line.start == start && e.line.target == target)
            .map(|e| e.target.clone())
    }

    /// Index of the entry containing byte `off`.
    pub(crate) fn find(&self, off: u64) -> usize {
        self.entries.partition_point(|e| e.end_bytes() <= off)
    }

    /// Every device this table uses, without repeats.
    pub fn deps(&self) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        for e in &self.entries {
            for d in &e.deps {
                if !v.contains(d) {
                    v.push(d.clone());
                }
            }
        }
        v
    }

    /// The tag set this table's I/O lands in: each line's own (a leaf
    /// driver's) or the widest of the devices it opened, and the widest
    /// of the lines'. `None` when nothing below queues (`zero`, `error`).
    pub fn queue_shape(&self) -> Option<QueueShape> {
        self.entries.iter().fold(None, |acc, e| {
            let line = e.devs.iter().fold(e.target.queue_shape(), |s, d| {
                QueueShape::widest(s, d.queue_shape())
            });
            QueueShape::widest(acc, line)
        })
    }

    /// The largest logical block size of the lines' targets (dm's
    /// `dm_calculate_queue_limits` stacking each target's `io_hints`).
    pub fn logical_block_size(&self) -> u32 {
        self.entries
            .iter()
            .map(|e| e.target.logical_block_size())
            .max()
            .unwrap_or(512)
    }

    /// `dmsetup table` text with the targets' own argument rendering.
    pub fn table_text(&self) -> String {
        let lines: Vec<TableLine> = self
            .entries
            .iter()
            .map(|e| TableLine {
                line: e.line.line,
                start: e.line.start,
                len: e.line.len,
                target: e.line.target.clone(),
                args: crate::table_text::split_args(&e.target.table()),
            })
            .collect();
        render_table(&lines)
    }

    /// `dmsetup status` text.
    pub fn status_text(&self) -> String {
        let mut s = String::new();
        for e in &self.entries {
            s.push_str(&format!(
                "{} {} {} {}\n",
                e.line.start,
                e.line.len,
                e.line.target,
                e.target.status()
            ));
        }
        s
    }

    pub(crate) fn features(&self) -> Features {
        let mut f: Option<Features> = None;
        for e in &self.entries {
            let t = e.target.features();
            f = Some(match f {
                None => t,
                Some(a) => a.intersect(t),
            });
        }
        f.unwrap_or_default()
    }

    /// Every target sends polled bios to devices, all of which poll
    /// (kernel `dm_table_supports_poll`; see [`Target::poll_devices`]).
    pub(crate) fn polls(&self) -> bool {
        self.entries.iter().all(|e| {
            let (mut any, mut all) = (false, true);
            e.target.poll_devices(&mut |d| {
                any = true;
                all &= d.polls();
            });
            any && all
        })
    }

    /// Poll every device the targets send polled bios to (kernel
    /// `dm_poll_bio`); how many bios completed.
    pub(crate) fn poll(&self) -> usize {
        let mut n = 0;
        for e in &self.entries {
            e.target.poll_devices(&mut |d| n += d.poll());
        }
        n
    }

    /// The device a one-line table sends every polled bio to, when there
    /// is exactly one: only then may a poller sleep in it, since with
    /// several a sleep in one would hold back the completions of the
    /// others.
    pub(crate) fn sole_poll_device(&self) -> Option<&dyn Device> {
        let [one] = &self.entries[..] else {
            return None;
        };
        let (mut count, mut sole) = (0, None);
        one.target.poll_devices(&mut |d| {
            count += 1;
            sole = Some(d);
        });
        sole.filter(|_| count == 1)
    }

    /// A claim on the completions of a one-line table: its target's own
    /// ([`Target::reaper`]: `delay` hands out the bios it holds), else
    /// its sole poll device's (a `file` ring under `linear`).
    pub(crate) fn reaper(&self) -> Option<Box<dyn blkstack_core::Reaper>> {
        let [one] = &self.entries[..] else {
            return None;
        };
        one.target
            .reaper()
            .or_else(|| self.sole_poll_device()?.reaper())
    }

    /// Map device-relative bios that passed the admission check: a
    /// one-line table hands the whole batch to its target when no bio
    /// needs splitting (the common leaf device), anything else is mapped
    /// one by one.
    pub(crate) fn map_batch(&self, bios: &mut Vec<Bio>) {
        if let [e] = &self.entries[..] {
            let fits = |b: &Bio| {
                b.op == Op::Flush || {
                    let rel = b.offset - e.start_bytes();
                    b.len <= (e.end_bytes() - b.offset).min(max_len(&*e.target, b.op, rel))
                }
            };
            if bios.iter().all(fits) {
                // One line tiles the whole device, so it starts at 0 and
                // device offsets are already line-relative.
                debug_assert_eq!(e.start_bytes(), 0);
                e.target.map_batch(bios);
                return;
            }
        }
        for bio in bios.drain(..) {
            self.map(bio);
        }
    }

    /// Map a device-relative bio onto the table.
    pub(crate) fn map(&self, bio: Bio) {
        if bio.op == Op::Flush {
            if self.entries.len() == 1 {
                self.entries[0].target.map(bio);
            } else {
                let pieces = vec![(0, 0); self.entries.len()];
                Split::run(bio, &pieces, |i, child| self.entries[i].target.map(child));
            }
            return;
        }
        let i = self.find(bio.offset);
        let e = &self.entries[i];
        let rel = bio.offset - e.start_bytes();
        let room = (e.end_bytes() - bio.offset).min(max_len(&*e.target, bio.op, rel));
        if bio.len <= room {
            let mut bio = bio;
            bio.offset = rel;
            e.target.map(bio);
            return;
        }
        // Crosses a line or a target's boundary: cut it into pieces that
        // each fit one entry and its max_io_len.
        let mut pieces = Vec::new();
        let mut off = bio.offset;
        while off < bio.end() {
            let e = &self.entries[self.find(off)];
            let rel = off - e.start_bytes();
            let room = (e.end_bytes() - off)
                .min(max_len(&*e.target, bio.op, rel))
                .max(1);
            let len = room.min(bio.end() - off);
            pieces.push((off - bio.offset, len));
            off += len;
        }
        Split::run(bio, &pieces, |_, mut child| {
            let e = &self.entries[self.find(child.offset)];
            child.offset -= e.start_bytes();
            e.target.map(child);
        });
    }
}

/// The largest piece of a bio of `op` that `t` takes at `rel`.
fn max_len(t: &dyn Target, op: Op, rel: u64) -> u64 {
    if op == Op::Discard {
        t.max_discard_len(rel)
    } else {
        t.max_io_len(rel)
    }
}
