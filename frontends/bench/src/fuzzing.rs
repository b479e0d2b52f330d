//! Fuzzing entry point (cargo-fuzz's `fio_jobfile` target, and the stable
//! regression test that replays its corpus): fio's job-file grammar and
//! every option's value parser, into [`JobSpec`]s, without running them.
//!
//! fio itself fuzzes its option parser the same way (its `t/fuzz`
//! harnesses feed `parse_jobs_ini` from memory): a job file is input a
//! user hands over, so any text must give jobs or a line-numbered error.

use crate::jobfile::parse_job_file;
use crate::spec::JobSpec;

/// Parse `input` as a job file with fio's defaults as `[global]`'s base,
/// and check what every parsed job reports about itself is coherent.
pub fn jobfile(input: &[u8]) {
    let Ok(text) = std::str::from_utf8(input) else {
        return;
    };
    let Ok(jobs) = parse_job_file(text, &JobSpec::default()) else {
        return;
    };
    for job in &jobs {
        let (min, max) = job.bs_bounds();
        assert!(min <= max, "block size bounds {min} > {max} from {text:?}");
        for bs in job.bs.sizes() {
            assert!(
                (min..=max).contains(&bs),
                "block size {bs} outside its bounds from {text:?}"
            );
        }
        // What a run computes first from the job and a device's size.
        let _ = job.io_limit(1 << 30, 1 << 30);
        if let Some(size) = job.size {
            let _ = size.resolve(1 << 30);
        }
    }
}
