//! `blkstack serve`'s flags: the stack, the control socket, the memory
//! budget and dm-thin's process-wide parameter, which belong to serve
//! itself, and each export frontend's own flags, flattened in (NBD,
//! ublk, vhost-user-blk, each from its crate's `export_driver.rs`).

use blkstack_nbd::NbdArgs;
use blkstack_ublk::UblkArgs;
use blkstack_vhost_user_blk::VhostArgs;
use std::path::PathBuf;

/// `blkstack serve`: export devices over NBD, as /dev/ublkbN and to VMs,
/// until SIGINT/SIGTERM.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    blkstack serve --concise 'd0,,,rw,0 2097152 memory' --export d0 --listen nbd://127.0.0.1:10809\n  \
    blkstack serve --stack stack.txt --export data,golden:ro --listen 'nbd+unix:///?socket=/tmp/nbd.sock'\n\n\
    Clients then use e.g. nbd://127.0.0.1:10809/d0 or nbd+unix:///data?socket=/tmp/nbd.sock.\n\
    SIGINT/SIGTERM stop gracefully: no new connections, in-flight I/O answered, devices flushed.")]
pub struct ServeArgs {
    /// Create devices from a stack file (dmsetup concise text, or `NAME: <table line>` lines).
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with = "concise",
        required_unless_present = "concise"
    )]
    pub stack: Option<PathBuf>,

    /// Create devices from a dmsetup --concise string.
    #[arg(long, value_name = "STRING")]
    pub concise: Option<String>,

    #[command(flatten)]
    pub nbd: NbdArgs,

    /// Live control (blkstack-control): the control socket for `blkstack
    /// create/reload/suspend/resume/export/...` [default:
    /// $XDG_RUNTIME_DIR/blkstack/control.sock, else /run/blkstack/control.sock;
    /// if that default is taken by another server, serve runs without one].
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,

    /// Most RAM all `memory` targets of this server may hold together
    /// (bytes, or a K/M/G/T suffix); a write needing more fails with ENOSPC,
    /// as a thin pool out of space does. Default: three quarters of
    /// MemAvailable at start. Each line's `max_alloc=` bounds it further.
    #[arg(long, value_name = "SIZE", value_parser = parse_memory_limit)]
    pub memory_limit: Option<u64>,

    #[command(flatten)]
    pub ublk: UblkArgs,

    #[command(flatten)]
    pub vhost: VhostArgs,

    /// Seconds a thin pool out of data space queues I/O before it fails
    /// it (dm-thin's `no_space_timeout` module parameter); 0 queues for
    /// ever.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub thin_no_space_timeout: u64,
}

/// A `--memory-limit` value clap refuses (its message is what the user
/// sees after clap's "invalid value").
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
enum MemoryLimitError {
    #[error("{0}: at least one 4096-byte page")]
    BelowOnePage(String),
    #[error("{0:?} is not a size (bytes or a K, M, G or T suffix, e.g. 512M)")]
    NotASize(String),
}

fn parse_memory_limit(s: &str) -> Result<u64, MemoryLimitError> {
    match blkstack_mapped::targets::memory::parse_alloc_size(s) {
        Some(n) if n >= 4096 => Ok(n),
        Some(_) => Err(MemoryLimitError::BelowOnePage(s.to_string())),
        None => Err(MemoryLimitError::NotASize(s.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_limit_is_a_size_of_a_page_or_more() {
        assert_eq!(parse_memory_limit("512M"), Ok(512 << 20));
        assert!(parse_memory_limit("100")
            .unwrap_err()
            .to_string()
            .contains("4096-byte page"));
        assert!(parse_memory_limit("lots")
            .unwrap_err()
            .to_string()
            .contains("not a size"));
    }
}
