//! `serve`'s ublk flags, and starting serve's ublk exports once its stack
//! exists.

use crate::host::UblkHost;
use crate::options::{self, UblkOptions};
use anyhow::Context;
use blkstack_control::ExportHost;
use blkstack_mapped::Registry;
use std::io::Write;
use std::sync::Arc;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct UblkArgs {
    /// Also present these devices as kernel block devices, /dev/ublkbN
    /// (comma-separated or repeated; `NAME:ro` read-only). Needs root (or
    /// --ublk-unprivileged) and the ublk_drv module. A device a killed
    /// serve left (same name) is taken over and its queued I/O goes on.
    #[arg(long, value_name = "NAME[:ro][,NAME[:ro]...]", value_delimiter = ',')]
    pub ublk: Vec<String>,

    /// Accept `export --ublk` on the control socket even when --ublk names
    /// no device at start.
    #[arg(long)]
    pub ublk_enable: bool,

    /// ublk queues per device. Default: one per hardware queue of the
    /// stack's tag set (e.g. a `memory submit_queues=N` leaf's N), each
    /// with its own thread; fewer may be asked for, more are refused.
    #[arg(long, value_name = "N")]
    pub ublk_queues: Option<u16>,

    /// Requests in flight per ublk queue. Default: the stack's tags per
    /// hardware queue (`hw_queue_depth`, a file's `queue_depth`); a
    /// shallower queue may be asked for, a deeper one is refused.
    #[arg(long, value_name = "N")]
    pub ublk_depth: Option<u16>,

    /// Largest request the kernel sends, in bytes (a buffer of this size
    /// is reserved per tag); the device's own limit applies too.
    #[arg(long, value_name = "BYTES", default_value_t = options::DEFAULT_IO_BUF_BYTES)]
    pub ublk_max_io: u32,

    /// Without recovery: a killed serve's devices fail their I/O and go,
    /// instead of waiting for a restarted serve to take them over.
    #[arg(long)]
    pub ublk_no_recovery: bool,

    /// Add devices as UBLK_F_UNPRIVILEGED_DEV (a non-root user where
    /// /dev/ublk-control is open to them; the kernel allows no recovery
    /// for such devices).
    #[arg(long)]
    pub ublk_unprivileged: bool,
}

impl UblkArgs {
    pub fn options(&self) -> UblkOptions {
        UblkOptions {
            queues: self.ublk_queues,
            depth: self.ublk_depth,
            io_buf_bytes: self.ublk_max_io,
            recovery: !self.ublk_no_recovery,
            unprivileged: self.ublk_unprivileged,
        }
    }

    /// Whether serve runs a ublk frontend at all.
    pub fn enabled(&self) -> bool {
        self.ublk_enable || !self.ublk.is_empty()
    }

    /// `(name, read_only)` for each --ublk entry.
    pub fn names(&self) -> anyhow::Result<Vec<(String, bool)>> {
        blkstack_control::cli::parse_named_modes("--ublk", &self.ublk)
    }

    /// Export the --ublk devices of `reg` (all or none) and return the
    /// host the control socket drives; prints one `serving` line each.
    pub fn start(&self, reg: &Arc<Registry>) -> anyhow::Result<Arc<dyn ExportHost>> {
        let opts = self.options();
        opts.validate().map_err(anyhow::Error::msg)?;
        let names = self.names()?;
        let host = Arc::new(UblkHost::new(opts));
        for (name, ro) in names {
            let r = reg
                .get(&name)
                .ok_or_else(|| blkstack_mapped::DmError::NoSuchDevice(name.clone()).into())
                .and_then(|dev| host.add(&name, dev, ro).map_err(anyhow::Error::from));
            let info = match r {
                Ok(i) => i,
                Err(e) => {
                    host.stop_all();
                    return Err(e).with_context(|| format!("--ublk {name}"));
                }
            };
            let mut so = std::io::stdout().lock();
            writeln!(
                so,
                "serving {name} ({} bytes{}) at {}",
                reg.get(&name)
                    .map(|d| blkstack_core::Device::size(&*d))
                    .unwrap_or(0),
                if info.read_only { ", read-only" } else { "" },
                info.uris.join(" ")
            )?;
        }
        Ok(host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_like_export() {
        let a = UblkArgs {
            ublk: vec!["a".into(), "b:ro".into()],
            ..UblkArgs::default()
        };
        assert_eq!(
            a.names().unwrap(),
            vec![("a".into(), false), ("b".into(), true)]
        );
        let a = UblkArgs {
            ublk: vec!["a".into(), "a".into()],
            ..UblkArgs::default()
        };
        assert!(a.names().unwrap_err().to_string().contains("twice"));
        let a = UblkArgs {
            ublk: vec!["a:rx".into()],
            ..UblkArgs::default()
        };
        assert!(a.names().unwrap_err().to_string().contains("unknown mode"));
    }
}
