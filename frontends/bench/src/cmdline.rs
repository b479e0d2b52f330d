//! fio's command line: `--key=value` (or `--key value`) for any job option,
//! job files as plain arguments, and `--name=X` starting a new job.
//!
//! As in fio (`parse_cmd_line`), options before the first `--name` are the
//! defaults every job starts from (job files included: their `[global]`
//! builds on them), and each `--name` opens a job that the options after it
//! change. Boolean options may stand alone (`--time_based`). Job options
//! given after a job file (and before any `--name`) override that file's
//! settings for every job it defines, so `--filename`, `--runtime` or
//! `--size` can retarget a job file without editing it. blkstack adds
//! `--stack FILE` / `--concise STRING` (devices to create first) and
//! `--wait=interrupt|poll|hybrid`.

use crate::jobfile::parse_job_file;
use crate::spec::JobSpec;
use anyhow::{bail, Context};
use std::path::PathBuf;

/// The report formats, fio's `--output-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    Normal,
    Json,
    /// JSON with fio's latency bins.
    JsonPlus,
    /// fio's semicolon-separated lines (`--terse-version`, default 3).
    Terse,
}

/// Whether to show the progress bar (fio's `--eta`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EtaMode {
    /// When stderr is a terminal.
    #[default]
    Auto,
    Always,
    Never,
}

/// Everything `blkstack bench ARGS...` said.
#[derive(Clone, Debug)]
pub struct CommandLine {
    pub stack_files: Vec<PathBuf>,
    pub concise: Vec<String>,
    pub job_files: Vec<PathBuf>,
    /// Options given before the first `--name`.
    pub defaults: JobSpec,
    /// Jobs opened with `--name`.
    pub named_jobs: Vec<JobSpec>,
    /// Job options given after a job file, before any `--name`: applied
    /// over each job of the files, in order.
    pub overrides: Vec<(String, Option<String>)>,
    pub output_formats: Vec<OutputFormat>,
    pub output: Option<PathBuf>,
    pub eta: EtaMode,
    /// fio's `--status-interval`.
    pub status_interval: Option<std::time::Duration>,
    /// fio's `--terse-version` (3, 4 or 5).
    pub terse_version: u32,
}

/// Parse the arguments after `blkstack bench`.
pub fn parse_command_line(args: &[String]) -> anyhow::Result<CommandLine> {
    let mut cl = CommandLine {
        stack_files: Vec::new(),
        concise: Vec::new(),
        job_files: Vec::new(),
        defaults: JobSpec::default(),
        named_jobs: Vec::new(),
        overrides: Vec::new(),
        output_formats: vec![OutputFormat::Normal],
        output: None,
        eta: EtaMode::Auto,
        status_interval: None,
        terse_version: 3,
    };
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        let Some(opt) = arg.strip_prefix("--") else {
            if arg.starts_with('-') && arg.len() > 1 {
                bail!("'{arg}': options are written --key=value, as in fio");
            }
            cl.job_files.push(PathBuf::from(arg));
            continue;
        };
        let (key, inline_value) = match opt.split_once('=') {
            Some((k, v)) => (k.to_string(), Some(v.to_string())),
            None => (opt.to_string(), None),
        };
        if key.is_empty() {
            bail!("'{arg}': missing option name");
        }
        let is_bool = crate::options::BOOL_KEYS.contains(&key.as_str()) || key == "minimal";
        // Non-boolean options take the next argument when not written with '='.
        let value = match inline_value {
            Some(v) => Some(v),
            None if is_bool => None,
            None => {
                let v = args
                    .get(i)
                    .with_context(|| format!("option --{key} needs a value"))?;
                i += 1;
                Some(v.clone())
            }
        };
        cl.apply_option(key, value)?;
    }
    Ok(cl)
}

/// `--output-format`'s comma-separated list.
fn parse_output_formats(text: &str) -> anyhow::Result<Vec<OutputFormat>> {
    text.split(',')
        .map(str::trim)
        .map(|f| {
            Ok(match f {
                "normal" => OutputFormat::Normal,
                "json" => OutputFormat::Json,
                "json+" => OutputFormat::JsonPlus,
                "terse" => OutputFormat::Terse,
                other => bail!(
                    "--output-format: '{other}' is not supported (use normal, terse, json, json+, or a comma-separated list)"
                ),
            })
        })
        .collect()
}

impl CommandLine {
    /// One `--key[=value]` option: the command line's own, or a job
    /// option for the last `--name` job (the defaults before any), or an
    /// override of the job files' jobs.
    fn apply_option(&mut self, key: String, value: Option<String>) -> anyhow::Result<()> {
        match key.as_str() {
            "stack" => self
                .stack_files
                .push(PathBuf::from(value.unwrap_or_default())),
            "concise" => self.concise.push(value.unwrap_or_default()),
            "output" => self.output = Some(PathBuf::from(value.unwrap_or_default())),
            "output-format" | "output_format" => {
                self.output_formats = parse_output_formats(&value.unwrap_or_default())?
            }
            "terse-version" | "terse_version" => {
                let v = value.unwrap_or_default();
                self.terse_version = match v.trim() {
                    "3" => 3,
                    "4" => 4,
                    "5" => 5,
                    o => bail!("--terse-version: '{o}' is not one of 3, 4, 5"),
                };
            }
            "minimal" => self.output_formats = vec![OutputFormat::Terse],
            "status-interval" | "status_interval" => {
                let v = value.unwrap_or_default();
                let d = crate::parse::parse_time(&v, crate::parse::TimeUnit::Seconds)
                    .map_err(|m| anyhow::anyhow!("--status-interval: {m}"))?;
                if d.is_zero() {
                    bail!("--status-interval: must be more than 0");
                }
                self.status_interval = Some(d);
            }
            "eta" => {
                self.eta = match value.as_deref().unwrap_or("") {
                    "auto" => EtaMode::Auto,
                    "always" => EtaMode::Always,
                    "never" => EtaMode::Never,
                    other => bail!("--eta: '{other}' is not one of auto, always, never"),
                }
            }
            "name" => {
                let mut job = self.defaults.clone();
                job.name = value.unwrap_or_default();
                if job.name.is_empty() {
                    bail!("--name needs a non-empty value");
                }
                self.named_jobs.push(job);
            }
            _ => {
                let override_files = self.named_jobs.is_empty() && !self.job_files.is_empty();
                let target = self.named_jobs.last_mut().unwrap_or(&mut self.defaults);
                if override_files {
                    // Checked now on a scratch job so a bad value is
                    // reported here, naming the option.
                    let mut probe = target.clone();
                    probe
                        .apply(&key, value.as_deref())
                        .map_err(|e| anyhow::anyhow!("--{}: {}", e.key, e.message))?;
                    self.overrides.push((key, value));
                    return Ok(());
                }
                target
                    .apply(&key, value.as_deref())
                    .map_err(|e| anyhow::anyhow!("--{}: {}", e.key, e.message))?;
            }
        }
        Ok(())
    }

    /// All jobs, in fio's order: the job files' jobs, then the `--name` jobs.
    pub fn jobs(&self) -> anyhow::Result<Vec<JobSpec>> {
        let mut jobs = Vec::new();
        for path in &self.job_files {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading job file {}", path.display()))?;
            let mut parsed = parse_job_file(&text, &self.defaults)
                .with_context(|| format!("job file {}", path.display()))?;
            for job in &mut parsed {
                for (k, v) in &self.overrides {
                    job.apply(k, v.as_deref())
                        .map_err(|e| anyhow::anyhow!("--{}: {}", e.key, e.message))?;
                }
            }
            jobs.extend(parsed);
        }
        jobs.extend(self.named_jobs.iter().cloned());
        if jobs.is_empty() {
            bail!(
                "no jobs: give a job file or --name=NAME with options (see blkstack bench --help)"
            );
        }
        Ok(jobs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{BlockSizes, RwMode, VerifyMode, WaitMode};
    use std::time::Duration;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn fio_style_options() {
        let cl = parse_command_line(&args(
            "--stack ex.stack --name=x --filename=/dev/mapper/s0 --rw=randrw --bs 4k --iodepth=64 \
             --numjobs=2 --runtime=5s --time_based --size=1g --offset=1m --ramp_time=1 \
             --rwmixread=70 --norandommap --randrepeat=0 --verify=crc32c --output-format=json \
             --group_reporting --wait=hybrid",
        ))
        .unwrap();
        assert_eq!(cl.stack_files, vec![PathBuf::from("ex.stack")]);
        assert_eq!(cl.output_formats, vec![OutputFormat::Json]);
        let jobs = cl.jobs().unwrap();
        assert_eq!(jobs.len(), 1);
        let j = &jobs[0];
        assert_eq!(j.name, "x");
        assert_eq!(j.filename.as_deref(), Some("/dev/mapper/s0"));
        assert_eq!(j.rw, RwMode::RandRw);
        assert_eq!(j.bs, BlockSizes::single(4096));
        assert_eq!((j.iodepth, j.numjobs, j.rwmixread), (64, 2, 70));
        assert_eq!(j.runtime, Some(Duration::from_secs(5)));
        assert_eq!(j.ramp_time, Duration::from_secs(1));
        assert!(j.time_based && j.norandommap && !j.randrepeat && j.group_reporting);
        assert_eq!(j.verify, VerifyMode::Crc32c);
        assert_eq!(j.wait, WaitMode::Hybrid);
    }

    #[test]
    fn several_names_start_several_jobs_from_the_defaults() {
        let cl = parse_command_line(&args(
            "--bs=8k --iodepth=4 --name=a --rw=read --name=b --rw=write --iodepth=2",
        ))
        .unwrap();
        let jobs = cl.jobs().unwrap();
        assert_eq!(jobs.len(), 2);
        assert_eq!(
            (jobs[0].name.as_str(), jobs[0].rw, jobs[0].iodepth),
            ("a", RwMode::Read, 4)
        );
        assert_eq!(
            (jobs[1].name.as_str(), jobs[1].rw, jobs[1].iodepth),
            ("b", RwMode::Write, 2)
        );
        assert_eq!(jobs[1].bs, BlockSizes::single(8192));
    }

    #[test]
    fn bad_options_are_named() {
        let e = parse_command_line(&args("--name=a --iodepth=lots")).unwrap_err();
        assert!(e.to_string().contains("--iodepth"), "{e}");
        let e = parse_command_line(&args("--name=a --bogus=1")).unwrap_err();
        assert!(e.to_string().contains("--bogus: unknown option"), "{e}");
        let e = parse_command_line(&args("--name=a --rw")).unwrap_err();
        assert!(e.to_string().contains("--rw needs a value"), "{e}");
        let e = parse_command_line(&args("--output-format=xml")).unwrap_err();
        assert!(e.to_string().contains("xml"), "{e}");
        let e = parse_command_line(&args("-x")).unwrap_err();
        assert!(e.to_string().contains("--key=value"), "{e}");
        let cl = parse_command_line(&args("--bs=4k")).unwrap();
        assert!(cl.jobs().unwrap_err().to_string().contains("no jobs"));
    }

    #[test]
    fn job_files_build_on_leading_options() {
        let dir = std::env::temp_dir().join(format!("blkstack-bench-cl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("j.fio");
        std::fs::write(&path, "[global]\nbs=16k\n[one]\nrw=randread\n").unwrap();
        let mut a = args("--iodepth=8");
        a.push(path.display().to_string());
        a.extend(args("--output-format=normal,json"));
        let cl = parse_command_line(&a).unwrap();
        let jobs = cl.jobs().unwrap();
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs[0].iodepth, 8);
        assert_eq!(jobs[0].bs, BlockSizes::single(16384));
        assert_eq!(
            cl.output_formats,
            vec![OutputFormat::Normal, OutputFormat::Json]
        );
        // Options after the file override it.
        let mut b = args("--iodepth=8");
        b.push(path.display().to_string());
        b.extend(args("--bs=64k --filename=/dev/m0"));
        let over = parse_command_line(&b).unwrap().jobs().unwrap();
        assert_eq!(over[0].bs, BlockSizes::single(65536));
        assert_eq!(over[0].filename.as_deref(), Some("/dev/m0"));
        std::fs::write(&path, "[one]\nrw=upwards\n").unwrap();
        let e = cl.jobs().unwrap_err();
        let text = format!("{e:#}");
        assert!(text.contains("j.fio") && text.contains("line 2"), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
