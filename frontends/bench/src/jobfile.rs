//! fio job files: INI text with a `[global]` section (options every later
//! job starts from) and one `[name]` section per job.
//!
//! Follows fio's `parse_jobs_ini`: lines starting with `#` or `;` are
//! comments (and so is the rest of a line after whitespace and `#`/`;`),
//! `key=value` or a bare `key` sets an option, a `[global]` section changes
//! the defaults for the jobs that follow it (there may be several), and
//! `${VAR}` is replaced by the environment variable. A job's `name` is its
//! section name. Errors name the line and the key.

use crate::parse::ValueError;
use crate::spec::JobSpec;
use std::fmt;

/// A job file problem, with the 1-based line it is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobFileError {
    pub line: usize,
    pub key: Option<String>,
    pub message: String,
}

impl fmt::Display for JobFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.key {
            Some(k) => write!(f, "line {}: option '{}': {}", self.line, k, self.message),
            None => write!(f, "line {}: {}", self.line, self.message),
        }
    }
}

impl std::error::Error for JobFileError {}

/// Parse job-file text. `base` is what `[global]` starts from (fio applies
/// command-line options given before the job file there).
pub fn parse_job_file(text: &str, base: &JobSpec) -> Result<Vec<JobSpec>, JobFileError> {
    let mut global = base.clone();
    let mut jobs: Vec<JobSpec> = Vec::new();
    // Which section the following keys go to.
    enum Section {
        None,
        Global,
        Job,
    }
    let mut section = Section::None;
    for (idx, raw) in text.lines().enumerate() {
        let line_no = idx + 1;
        let line = strip_comment(raw).trim();
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('[') {
            let name = rest.strip_suffix(']').ok_or_else(|| JobFileError {
                line: line_no,
                key: None,
                message: format!("section header '{line}' is missing its closing ']'"),
            })?;
            let name = name.trim();
            if name.is_empty() {
                return Err(JobFileError {
                    line: line_no,
                    key: None,
                    message: "empty section name '[]'".to_string(),
                });
            }
            if name == "global" {
                section = Section::Global;
            } else {
                let mut job = global.clone();
                job.name = name.to_string();
                jobs.push(job);
                section = Section::Job;
            }
            continue;
        }
        let expanded = expand_env(line).map_err(|e| JobFileError {
            line: line_no,
            key: None,
            message: e.into(),
        })?;
        let (key, value) = match expanded.split_once('=') {
            Some((k, v)) => (k.trim().to_string(), Some(v.trim().to_string())),
            None => (expanded.trim().to_string(), None),
        };
        if key.is_empty() {
            return Err(JobFileError {
                line: line_no,
                key: None,
                message: format!("'{line}' has no option name before '='"),
            });
        }
        let target = match section {
            Section::None => {
                return Err(JobFileError {
                    line: line_no,
                    key: Some(key),
                    message: "appears before any [section]".to_string(),
                })
            }
            Section::Global => &mut global,
            Section::Job => jobs.last_mut().expect("a job section was opened"),
        };
        target
            .apply(&key, value.as_deref())
            .map_err(|e| JobFileError {
                line: line_no,
                key: Some(e.key),
                message: e.message,
            })?;
    }
    if jobs.is_empty() {
        return Err(JobFileError {
            line: text.lines().count().max(1),
            key: None,
            message: "no job sections (only [global] or nothing)".to_string(),
        });
    }
    Ok(jobs)
}

/// Drop a comment: a whole line starting with `#`/`;`, or the tail after
/// whitespace followed by `#`/`;`.
fn strip_comment(line: &str) -> &str {
    let t = line.trim_start();
    if t.starts_with('#') || t.starts_with(';') {
        return "";
    }
    let bytes = line.as_bytes();
    for i in 1..bytes.len() {
        if (bytes[i] == b'#' || bytes[i] == b';') && bytes[i - 1].is_ascii_whitespace() {
            return &line[..i];
        }
    }
    line
}

/// fio's `${VAR}` substitution from the environment.
fn expand_env(line: &str) -> Result<String, ValueError> {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| ValueError(format!("'{line}': '${{' without a closing '}}'")))?;
        let var = &after[..end];
        let val = std::env::var(var)
            .map_err(|_| ValueError(format!("environment variable '{var}' is not set")))?;
        out.push_str(&val);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{BlockSizes, RwMode, SizeSpec, VerifyMode, WaitMode};
    use std::time::Duration;

    #[test]
    fn globals_flow_into_jobs() {
        let text = "\
# a comment
; another
[global]
bs=4k
iodepth=16
runtime=5s
time_based

[reader]
rw=randread
filename=/dev/mapper/stripe0   # trailing comment

[global]
iodepth=1

[writer]
rw=write
bssplit=4k/50:64k/50
size=50%
verify=crc32c
wait=poll
";
        let jobs = parse_job_file(text, &JobSpec::default()).unwrap();
        assert_eq!(jobs.len(), 2);
        let r = &jobs[0];
        assert_eq!(r.name, "reader");
        assert_eq!(r.rw, RwMode::RandRead);
        assert_eq!(r.iodepth, 16);
        assert_eq!(r.runtime, Some(Duration::from_secs(5)));
        assert!(r.time_based);
        assert_eq!(r.filename.as_deref(), Some("/dev/mapper/stripe0"));
        let w = &jobs[1];
        assert_eq!(w.name, "writer");
        assert_eq!(w.iodepth, 1, "the second [global] applies to later jobs");
        assert_eq!(
            w.bs,
            BlockSizes {
                split: vec![(4096, 50), (65536, 50)],
                range: None,
            }
        );
        assert_eq!(w.size, Some(SizeSpec::Percent(50.0)));
        assert_eq!(w.verify, VerifyMode::Crc32c);
        assert_eq!(w.wait, WaitMode::Poll);
        assert!(w.time_based);
    }

    #[test]
    fn errors_name_line_and_key() {
        let e = parse_job_file("[a]\nrw=read\nbs=4q\n", &JobSpec::default()).unwrap_err();
        assert_eq!(e.line, 3);
        assert_eq!(e.key.as_deref(), Some("bs"));
        assert!(e.to_string().starts_with("line 3: option 'bs'"), "{e}");

        let e = parse_job_file("[a]\nnot_an_option=1\n", &JobSpec::default()).unwrap_err();
        assert_eq!((e.line, e.key.as_deref()), (2, Some("not_an_option")));
        assert!(e.message.contains("unknown"));

        let e = parse_job_file("rw=read\n[a]\n", &JobSpec::default()).unwrap_err();
        assert_eq!(e.line, 1);
        assert!(e.message.contains("before any [section]"));

        let e = parse_job_file("[a\nrw=read\n", &JobSpec::default()).unwrap_err();
        assert!(e.message.contains("closing ']'"));

        let e = parse_job_file("[global]\nbs=4k\n", &JobSpec::default()).unwrap_err();
        assert!(e.message.contains("no job sections"));

        let e = parse_job_file(
            "[a]\nfilename=${BLKSTACK_SURELY_UNSET_VAR}\n",
            &JobSpec::default(),
        )
        .unwrap_err();
        assert!(e.message.contains("BLKSTACK_SURELY_UNSET_VAR"));
    }

    #[test]
    fn base_options_are_overridden_by_the_file() {
        let base = JobSpec {
            iodepth: 8,
            rw: RwMode::Write,
            ..JobSpec::default()
        };
        let jobs = parse_job_file("[global]\niodepth=4\n[a]\n", &base).unwrap();
        assert_eq!(jobs[0].iodepth, 4);
        assert_eq!(jobs[0].rw, RwMode::Write);
    }
}
