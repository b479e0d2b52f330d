//! `blkstack bench ARGS...`: parse fio's command line, create the devices
//! named by `--stack`/`--concise`, run the jobs, print the report.
//!
//! The arguments are parsed here rather than by clap because fio's grammar
//! is order dependent (each `--name` opens a job that the following options
//! change); clap only collects them. The exit status is non-zero when any
//! job hit an I/O error or a verify failure, as fio's is.

use crate::cmdline::{parse_command_line, EtaMode, OutputFormat};
use crate::output::{write_normal, write_normal_header};
use crate::output_json::{write_json, write_json_plus};
use crate::run::{run_jobs, RunOptions};
use anyhow::{bail, Context};
use blkstack_mapped::Registry;
use std::io::{IsTerminal, Write};

const LONG_ABOUT: &str = "\
Run fio job files and fio-style options against blkstack devices, in process.

Devices: --stack FILE (a stack file: dmsetup concise text or `NAME: <table>` lines)
and/or --concise 'NAME,,,rw,0 2048 memory;...'. A job's `filename` names a device
(NAME or /dev/mapper/NAME); without one, the device named like the job, else the
last device created.

Job options (job file keys or --key=value): fio's, as its HOWTO defines them;
docs/FIO.md lists which are implemented, accepted as not applicable in process,
or refused. blkstack adds wait(interrupt poll hybrid), hybrid_sleep_pct,
hybrid_estimator. Sizes take k/m/g/t (x1024) and %; times take us/ms/s/m/h.
Options before the first --name apply to every job (and to job files); options
after a job file override its settings; each --name starts a new job. A job's
filename /dev/NAME is the stack's device NAME.

Report options: --output-format=normal|terse|json|json+ (comma-separated), --terse-version=3|4|5  --output=FILE
--status-interval=TIME (progress so far, on stdout)
--eta=auto|always|never (progress bar on stderr).

Example: blkstack bench --stack examples/striped-memory.stack --name=x --rw=randrw
  --bs=4k --iodepth=16 --runtime=5s --time_based --verify=crc32c";

/// `blkstack bench`: fio-compatible benchmark runner.
#[derive(clap::Args, Debug)]
#[command(
    about = "fio-compatible benchmark runner (job files, fio options, fio-shaped output)",
    after_help = LONG_ABOUT
)]
pub struct BenchArgs {
    /// Job files and fio-style options (--name=x --rw=randread ...), in fio's order.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        num_args = 0..,
        value_name = "JOBFILE|--OPTION"
    )]
    pub args: Vec<String>,
}

/// First Ctrl-C: stop the jobs and report (as fio does); the handler then
/// restores the default so a second Ctrl-C ends the process.
extern "C" fn on_sigint(_sig: libc::c_int) {
    crate::completion::request_stop();
    // SAFETY: signal() is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_DFL);
    }
}

/// Run `blkstack bench`.
pub fn run_cli(args: BenchArgs) -> anyhow::Result<()> {
    let cl = parse_command_line(&args.args)?;
    let registry = Registry::new();
    let mut created: Vec<String> = Vec::new();
    for path in &cl.stack_files {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading stack file {}", path.display()))?;
        let names = registry
            .create_stack(&text)
            .with_context(|| format!("stack file {}", path.display()))?;
        created.extend(names);
    }
    for c in &cl.concise {
        let names = registry
            .create_concise(c)
            .with_context(|| format!("--concise '{c}'"))?;
        created.extend(names);
    }
    let jobs = cl.jobs()?;
    if created.is_empty() {
        bail!("no devices: give --stack FILE or --concise STRING");
    }
    let progress = match cl.eta {
        EtaMode::Always => true,
        EtaMode::Never => false,
        EtaMode::Auto => std::io::stderr().is_terminal(),
    };
    let opts = RunOptions {
        progress,
        default_filename: created.last().cloned(),
        status: cl
            .status_interval
            .map(|interval| crate::status::StatusSink {
                interval,
                sink: std::sync::Arc::new(|text: &str| {
                    let mut out = std::io::stdout().lock();
                    let _ = out.write_all(text.as_bytes());
                    let _ = out.flush();
                }),
            }),
    };

    let mut sink: Box<dyn Write> = match &cl.output {
        Some(p) => {
            Box::new(std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?)
        }
        None => Box::new(std::io::stdout()),
    };
    let normal = cl.output_formats.contains(&OutputFormat::Normal);
    if normal {
        sink.write_all(write_normal_header(&jobs).as_bytes())?;
        sink.flush()?;
    }
    // SAFETY: installing a handler that only does async-signal-safe work.
    unsafe {
        libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
    }
    let result = run_jobs(&registry, &jobs, &opts);
    // SAFETY: as above; back to the default once the jobs are done.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_DFL);
    }
    registry.remove_all();
    let report = result?;
    for t in &report.threads {
        for f in &t.verify_failures {
            eprintln!("{}: {f}", t.name);
        }
    }
    for f in &cl.output_formats {
        match f {
            OutputFormat::Normal => {
                sink.write_all(b"\n")?;
                sink.write_all(write_normal(&report).as_bytes())?;
            }
            OutputFormat::Json => sink.write_all(write_json(&report).as_bytes())?,
            OutputFormat::JsonPlus => sink.write_all(write_json_plus(&report).as_bytes())?,
            OutputFormat::Terse => sink.write_all(
                crate::output_terse::write_terse(&report, cl.terse_version).as_bytes(),
            )?,
        }
    }
    sink.flush()?;
    if report.failed() {
        let verify = report.verify_errors();
        let io_errors: u64 = report
            .threads
            .iter()
            .map(|t| t.read.errors + t.write.errors)
            .sum();
        bail!("bench failed: {verify} verify error(s), {io_errors} I/O error(s)");
    }
    Ok(())
}
