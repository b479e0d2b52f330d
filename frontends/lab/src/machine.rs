//! The machine a lab run happened on, recorded in every report: the CPUs
//! this process may use, the kernel, the CPU model, and the 1-minute load
//! average before and after the experiment (a load above the CPU count
//! means other processes competed with the run, which a reader of the
//! figures must know).

use crate::report::Machine;
use std::time::{SystemTime, UNIX_EPOCH};

/// The 1-minute load average (`/proc/loadavg`), 0 where unknown.
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

fn kernel() -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string());
    match (
        read("/proc/sys/kernel/ostype"),
        read("/proc/sys/kernel/osrelease"),
    ) {
        (Ok(t), Ok(r)) => format!("{t} {r}"),
        _ => std::env::consts::OS.to_string(),
    }
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// UTC date and time of `secs` since the epoch, RFC 3339 (days to civil
/// date as in Howard Hinnant's `civil_from_days`).
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// This machine now, with the load average taken before the run.
pub fn describe(load_before: f64) -> Machine {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Machine {
        cpus: blkstack_core::affinity::allowed_cpus().len(),
        kernel: kernel(),
        cpu_model: cpu_model(),
        load_before,
        load_after: load_average(),
        finished: rfc3339(now),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_and_this_machine() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
        let m = describe(0.5);
        assert!(m.cpus >= 1);
        assert!(m.kernel.starts_with("Linux"), "{}", m.kernel);
        assert_eq!(m.load_before, 0.5);
    }
}
