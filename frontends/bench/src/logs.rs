//! fio's per-job log files: `write_bw_log`, `write_iops_log`,
//! `write_lat_log` with `log_avg_msec` and `log_offset`.
//!
//! The files are named and laid out as fio's (`iolog.c` `flush_samples`):
//! `PREFIX_bw.N.log`, `PREFIX_iops.N.log`, `PREFIX_lat.N.log`,
//! `PREFIX_clat.N.log` and `PREFIX_slat.N.log` (N the job's thread
//! number), one line per sample: `time (ms), value, direction (0 read,
//! 1 write, 2 trim), block size, [offset,] priority`, so fio2gnuplot and
//! fiologparser read them. Bandwidth (KiB/s) and IOPS are averaged over
//! `log_avg_msec` windows (fio's 500 ms `bw_avg_time` when unset, with the
//! block size column 0 as fio writes for averaged samples); latencies are
//! logged per I/O, or as the window's mean with `log_avg_msec`. In process
//! the submission latency is not separated, so the slat log holds zeroes
//! and the clat and lat logs agree.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;

/// fio's default averaging window for bandwidth and IOPS samples.
const DEFAULT_AVG_MS: u64 = 500;

/// The log options of one job.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogSpec {
    pub bw: Option<String>,
    pub iops: Option<String>,
    pub lat: Option<String>,
    pub avg_msec: u64,
    pub offset: bool,
}

impl LogSpec {
    pub fn any(&self) -> bool {
        self.bw.is_some() || self.iops.is_some() || self.lat.is_some()
    }
}

/// Per-direction counters of the current window.
#[derive(Default, Clone, Copy)]
struct Window {
    bytes: u64,
    ios: u64,
    lat_sum: u64,
}

/// Collects one job thread's samples; [`JobLogs::write`] writes the files.
pub(crate) struct JobLogs {
    spec: LogSpec,
    thread_number: u32,
    start_ns: u64,
    avg_ms: u64,
    lat_avg: bool,
    window_end_ms: u64,
    win: [Window; 3],
    bw: String,
    iops: String,
    lat: String,
    slat: String,
}

impl JobLogs {
    pub fn new(spec: &LogSpec, thread_number: u32, start_ns: u64) -> Option<JobLogs> {
        if !spec.any() {
            return None;
        }
        let avg_ms = if spec.avg_msec > 0 {
            spec.avg_msec
        } else {
            DEFAULT_AVG_MS
        };
        Some(JobLogs {
            spec: spec.clone(),
            thread_number,
            start_ns,
            avg_ms,
            lat_avg: spec.avg_msec > 0,
            window_end_ms: avg_ms,
            win: [Window::default(); 3],
            bw: String::new(),
            iops: String::new(),
            lat: String::new(),
            slat: String::new(),
        })
    }

    /// Start the clock over (after the ramp).
    pub fn restart(&mut self, now_ns: u64) {
        self.start_ns = now_ns;
        self.window_end_ms = self.avg_ms;
        self.win = [Window::default(); 3];
    }

    fn tail(&self, bs: u64, offset: u64) -> String {
        if self.spec.offset {
            format!("{bs}, {offset}, 0")
        } else {
            format!("{bs}, 0")
        }
    }

    /// One completed I/O.
    pub fn completed(&mut self, done_ns: u64, dir: usize, bs: u64, offset: u64, lat_ns: u64) {
        let t_ms = done_ns.saturating_sub(self.start_ns) / 1_000_000;
        while t_ms >= self.window_end_ms {
            self.close_window();
        }
        let w = &mut self.win[dir];
        w.bytes += bs;
        w.ios += 1;
        w.lat_sum += lat_ns;
        if self.spec.lat.is_some() && !self.lat_avg {
            let tail = self.tail(bs, offset);
            let _ = writeln!(self.lat, "{t_ms}, {lat_ns}, {dir}, {tail}");
            let _ = writeln!(self.slat, "{t_ms}, 0, {dir}, {tail}");
        }
    }

    fn close_window(&mut self) {
        let t = self.window_end_ms;
        let tail = self.tail(0, 0);
        for dir in 0..3 {
            let w = self.win[dir];
            if w.ios == 0 {
                continue;
            }
            let bw_kib = w.bytes * 1000 / self.avg_ms / 1024;
            let iops = w.ios * 1000 / self.avg_ms;
            let _ = writeln!(self.bw, "{t}, {bw_kib}, {dir}, {tail}");
            let _ = writeln!(self.iops, "{t}, {iops}, {dir}, {tail}");
            if self.lat_avg {
                let mean = w.lat_sum / w.ios;
                let _ = writeln!(self.lat, "{t}, {mean}, {dir}, {tail}");
                let _ = writeln!(self.slat, "{t}, 0, {dir}, {tail}");
            }
        }
        self.win = [Window::default(); 3];
        self.window_end_ms += self.avg_ms;
    }

    /// Close the last window and write the files; returns their paths.
    pub fn write(mut self, end_ns: u64, job_name: &str) -> std::io::Result<Vec<PathBuf>> {
        let t_ms = end_ns.saturating_sub(self.start_ns) / 1_000_000;
        if self.win.iter().any(|w| w.ios > 0)
            && t_ms >= self.window_end_ms.saturating_sub(self.avg_ms)
        {
            self.close_window();
        }
        let n = self.thread_number;
        let prefix = |p: &str| {
            if p.is_empty() {
                job_name.to_string()
            } else {
                p.to_string()
            }
        };
        let mut files = Vec::new();
        let mut put = |name: String, text: &str| -> std::io::Result<()> {
            let path = PathBuf::from(name);
            std::fs::File::create(&path)?.write_all(text.as_bytes())?;
            files.push(path);
            Ok(())
        };
        if let Some(p) = &self.spec.bw {
            put(format!("{}_bw.{n}.log", prefix(p)), &self.bw)?;
        }
        if let Some(p) = &self.spec.iops {
            put(format!("{}_iops.{n}.log", prefix(p)), &self.iops)?;
        }
        if let Some(p) = &self.spec.lat {
            put(format!("{}_lat.{n}.log", prefix(p)), &self.lat)?;
            put(format!("{}_clat.{n}.log", prefix(p)), &self.lat)?;
            put(format!("{}_slat.{n}.log", prefix(p)), &self.slat)?;
        }
        Ok(files)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn averaged_windows_in_fio_format() {
        let spec = LogSpec {
            bw: Some(String::new()),
            lat: Some(String::new()),
            avg_msec: 100,
            ..LogSpec::default()
        };
        let mut l = JobLogs::new(&spec, 1, 0).unwrap();
        for i in 0..20u64 {
            // 10 I/Os of 4 KiB per 100 ms window, latency 1 ms.
            l.completed(i * 10_000_000 + 1, 0, 4096, 0, 1_000_000);
        }
        l.close_window();
        assert_eq!(l.bw.lines().next(), Some("100, 400, 0, 0, 0"));
        assert_eq!(l.lat.lines().next(), Some("100, 1000000, 0, 0, 0"));
        assert_eq!(l.bw.lines().count(), 2);
    }
}
