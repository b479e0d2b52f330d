//! `blkstack`: the command-line front door. Each subcommand lives in its
//! frontend crate (serve, bench, lab, crashtest) or in control (the
//! dmsetup-style verbs); this file only dispatches, so that each frontend stays testable
//! as a library (verity.rs holds `blkstack verity`'s command line over the
//! mapped crate's tree builder). It also installs the `tracing` subscriber the libraries
//! log through (warnings such as a driver's fallback go to stderr).

mod verity;

use clap::{Parser, Subcommand};
use std::io::IsTerminal;
use std::process::ExitCode;
use tracing_subscriber::filter::{EnvFilter, LevelFilter};

#[derive(Parser)]
#[command(
    name = "blkstack",
    version,
    about = "A userspace block I/O stack: dm-style targets, blk-mq engine, NBD server, fio-compatible bench, and the lab"
)]
struct Cli {
    /// Log more on stderr: -v info, -vv debug, -vvv trace (default: warnings
    /// only). RUST_LOG directives (e.g. RUST_LOG=blkstack_drivers=debug)
    /// are honoured too.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,

    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Export devices over NBD (fio --ioengine=nbd, qemu-img, nbdinfo, nbdcopy, nbd-client) as /dev/ublkbN (--ublk) and to VMs over vhost-user-blk.
    Serve(blkstack_serve::ServeArgs),
    /// Rerun five upstream block-layer experiments, old vs new mechanism, into one report page (`lab all --quick`; `lab compare A B`).
    Lab(blkstack_lab::LabArgs),
    /// dmsetup-style verbs against a running `blkstack serve` (create, remove, suspend, ...).
    #[command(flatten)]
    Control(blkstack_control::Verb),
    /// fio-compatible benchmark runner: job files and fio options against blkstack devices.
    Bench(blkstack_bench::BenchArgs),
    /// Replay a dm-log-writes log onto a device or image to any point a crash could expose (xfstests' replay-log).
    ReplayLog(blkstack_crashtest::ReplayLogArgs),
    /// Record a workload through log-writes, replay to every crash point through a CoW overlay and check each (fsck in the kernel VM for ext4/xfs).
    Crashtest(blkstack_crashtest::CrashtestArgs),
    /// Build, check and dump dm-verity hash trees (veritysetup format/verify/dump) for `verity` tables.
    Verity(verity::VerityArgs),
}

/// Log to stderr at the level `-v` asks for, with RUST_LOG's directives
/// (RUST_LOG alone sets the level when no `-v` is given).
fn init_tracing(verbose: u8) {
    let level = match verbose {
        0 => LevelFilter::WARN,
        1 => LevelFilter::INFO,
        2 => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    };
    let mut filter = EnvFilter::builder()
        .with_default_directive(level.into())
        .from_env_lossy();
    if verbose > 0 {
        filter = filter.add_directive(level.into());
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.verbose);
    let result = match cli.cmd {
        Cmd::Serve(a) => blkstack_serve::run_cli(a),
        Cmd::Lab(a) => blkstack_lab::run_cli(a),
        Cmd::Control(v) => blkstack_control::run_cli(v),
        Cmd::Bench(a) => blkstack_bench::run_cli(a),
        Cmd::ReplayLog(a) => blkstack_crashtest::run_replay_log(a, cli.verbose),
        Cmd::Crashtest(a) => blkstack_crashtest::run_crashtest(a),
        Cmd::Verity(a) => verity::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` prints the context chain on one line; no backtrace
            // even when RUST_BACKTRACE is set, as users read this.
            eprintln!("blkstack: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
