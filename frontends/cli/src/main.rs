//! `blkstack`: the command-line front door. Each subcommand lives in its
//! frontend crate (bench, serve, lab) or in the mapped layer (dmsetup-style
//! verbs); this file only dispatches, so that each frontend stays testable
//! as a library.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "blkstack", version, about = "A userspace block I/O stack: dm-style targets, blk-mq engine, NBD server, fio-compatible bench, and the lab")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Export devices over NBD (fio --ioengine=nbd, qemu-img, nbdinfo, nbdcopy, nbd-client).
    Serve(blkstack_nbd::NbdArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Serve(a) => blkstack_nbd::run_cli(a),
    }
}
