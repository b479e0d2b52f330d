//! `blkstack`: the command-line front door. Each subcommand lives in its
//! frontend crate (bench, serve, lab) or in the mapped layer (dmsetup-style
//! verbs); this file only dispatches, so that each frontend stays testable
//! as a library.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "blkstack",
    version,
    about = "A userspace block I/O stack: dm-style targets, blk-mq engine, NBD server, fio-compatible bench, and the lab"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Export devices over NBD (fio --ioengine=nbd, qemu-img, nbdinfo, nbdcopy, nbd-client).
    Serve(blkstack_nbd::NbdArgs),
    /// Rerun five upstream block-layer experiments, old vs new mechanism, into one report page (`lab all --quick`; `lab compare A B`).
    Lab(blkstack_lab::LabArgs),
    /// dmsetup-style verbs against a running `blkstack serve` (create, remove, suspend, ...).
    #[command(flatten)]
    Control(blkstack_control::Verb),
    /// fio-compatible benchmark runner: job files and fio options against blkstack devices.
    Bench(blkstack_bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Serve(a) => blkstack_nbd::run_cli(a),
        Cmd::Lab(a) => blkstack_lab::run_cli(a),
        Cmd::Control(v) => blkstack_control::run_cli(v),
        Cmd::Bench(a) => blkstack_bench::run_cli(a),
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
