//! The host-side driver for counting a vhost-user-blk server's work per
//! request (issue 40): a VMM and a guest driver in one process
//! ([`driver`]), no TCG guest, so that `valgrind --tool=callgrind` or
//! `strace -c -f` on the server gives its instructions and syscalls per
//! request, the same on a loaded machine as on a quiet one
//! (`scripts/vhost-count.sh` runs it against `blkstack serve` and the
//! floor probe). Not a benchmark: its own time is meaningless.
//!
//! Run: `cargo run --release -p blkstack-vhost-user-blk --example
//! vhost-drive -- --socket /tmp/s.sock --qd 32 --requests 20000`.

mod driver;

use anyhow::Context as _;
use clap::Parser;
use driver::{Mode, Vmm};
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Rw {
    Read,
    Write,
    Verify,
}

#[derive(Debug, Parser)]
#[command(about = "Drive a vhost-user-blk server from the host")]
struct Args {
    /// The server's vhost-user socket.
    #[arg(long)]
    socket: PathBuf,
    /// Requests in flight.
    #[arg(long, default_value_t = 1)]
    qd: usize,
    /// Requests in all.
    #[arg(long, default_value_t = 10_000)]
    requests: u64,
    #[arg(long, value_enum, default_value = "read")]
    rw: Rw,
    /// Sectors of the disk to use (from 0).
    #[arg(long, default_value_t = 1 << 21)]
    span: u64,
    /// The guest's think time after each call, in µs (see `Vmm::settle`).
    #[arg(long, default_value_t = 0)]
    settle_us: u64,
    /// Do not negotiate VIRTIO_RING_F_EVENT_IDX.
    #[arg(long)]
    no_event_idx: bool,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let mode = match a.rw {
        Rw::Read => Mode::Read,
        Rw::Write => Mode::Write,
        Rw::Verify => Mode::Verify,
    };
    let mut vmm = Vmm::connect(&a.socket, !a.no_event_idx)
        .with_context(|| format!("connecting to {}", a.socket.display()))?;
    vmm.settle = std::time::Duration::from_micros(a.settle_us);
    vmm.run(mode, a.qd, a.requests, a.span)?;
    println!(
        "requests {} qd {} kicks {} calls {}",
        a.requests, a.qd, vmm.kicks, vmm.calls
    );
    vmm.close();
    Ok(())
}
