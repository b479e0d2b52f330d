//! fio's `--status-interval`: while jobs run, print each job thread's
//! progress so far every interval, in the shape of the first lines of
//! fio's normal report (`jobname: (groupid=N, jobs=1): err= 0: ...` and a
//! `read:`/`write:` line with IOPS, bandwidth and I/O done), read from the
//! counters the job loops publish.

use crate::completion::JobProgress;
use crate::output::{num2str, Unit};
use blkstack_core::clock::now_ns;
use std::fmt::{self, Write as _};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Where and how often status reports go.
#[derive(Clone)]
pub struct StatusSink {
    pub interval: Duration,
    pub sink: Arc<dyn Fn(&str) + Send + Sync>,
}

impl fmt::Debug for StatusSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StatusSink({:?})", self.interval)
    }
}

/// One job thread's counters and labels.
pub(crate) struct Watched {
    pub name: String,
    pub groupid: u32,
    pub progress: Arc<JobProgress>,
}

/// Report every `s.interval` until every thread is done.
pub(crate) fn report_status(threads: &[Watched], s: &StatusSink) {
    let t0 = now_ns();
    let interval = (s.interval.as_nanos() as u64).max(1_000_000);
    let mut next = t0 + interval;
    while !threads
        .iter()
        .all(|t| t.progress.done.load(Ordering::Acquire))
    {
        std::thread::sleep(Duration::from_millis(20));
        let now = now_ns();
        if now >= next {
            next += interval;
            (s.sink)(&status_text(threads, (now - t0) / 1_000_000));
        }
    }
}

/// The status block at `ms` into the run.
pub(crate) fn status_text(threads: &[Watched], ms: u64) -> String {
    let mut out = String::new();
    let pid = std::process::id();
    let ms = ms.max(1);
    for t in threads {
        let _ = writeln!(
            out,
            "{}: (groupid={}, jobs=1): err= 0: pid={pid}",
            t.name, t.groupid
        );
        let p = &t.progress;
        for (label, ios, bytes) in [
            ("read", &p.read_ios, &p.read_bytes),
            ("write", &p.write_ios, &p.write_bytes),
        ] {
            let (ios, bytes) = (ios.load(Ordering::Relaxed), bytes.load(Ordering::Relaxed));
            if ios == 0 {
                continue;
            }
            let bw = bytes * 1000 / ms;
            let _ = writeln!(
                out,
                "  {label}: IOPS={}, BW={} ({})({}/{ms}msec)",
                num2str(ios * 1000 / ms, 4, 1, false, Unit::None),
                num2str(bw, 4, 1, true, Unit::BytePerSec),
                num2str(bw, 4, 1, false, Unit::BytePerSec),
                num2str(bytes, 4, 1, true, Unit::Byte),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_have_fios_shape() {
        let p = Arc::new(JobProgress::default());
        p.read_ios.store(1000, Ordering::Relaxed);
        p.read_bytes.store(4096 * 1000, Ordering::Relaxed);
        let w = [Watched {
            name: "j".into(),
            groupid: 0,
            progress: p,
        }];
        let t = status_text(&w, 1000);
        assert!(t.starts_with("j: (groupid=0, jobs=1): err= 0: pid="), "{t}");
        assert!(
            t.contains("  read: IOPS=1000, BW=4000KiB/s (4096kB/s)(4000KiB/1000msec)"),
            "{t}"
        );
        assert!(!t.contains("write:"));
    }
}
