//! vhost-user-blk as one of `serve`'s export frontends (blkstack-control's
//! [`ExportDriver`] and [`ExportHost`], qemu's `BlockExportDriver` as
//! `block/export/export.c` drives it, here for what qemu's
//! `block/export/vhost-user-blk-server.c` serves; the same file in nbd
//! and ublk does the same for those): serve's `--vhost-user-blk` flags,
//! starting each socket once the stack exists, and the disks as the
//! control socket sees them.

use crate::server::VhostExport;
use anyhow::{bail, Context};
use blkstack_control::{ExportDriver, ExportHost, ExportInfo, RpcError};
use blkstack_mapped::{MappedDevice, Registry};
use parking_lot::Mutex;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

/// `serve`'s vhost-user-blk flags.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct VhostArgs {
    /// Serve device NAME to a VMM as a virtio-blk disk over the vhost-user
    /// socket SOCKET (qemu: -chardev socket,path=SOCKET,reconnect=1
    /// -device vhost-user-blk-pci,chardev=...; the guest's RAM must be a
    /// shared memory backend). Repeatable; `SOCKET:NAME:ro` read-only.
    #[arg(long, value_name = "SOCKET:NAME[:ro]")]
    pub vhost_user_blk: Vec<String>,

    /// Virtqueues per vhost-user-blk disk, each one hardware queue of ours
    /// with its own thread (the guest uses up to this many).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub vhost_queues: u16,

    /// Let each virtqueue's thread poll its ring for new requests up to
    /// US microseconds (at most 1000) after a round of requests before it
    /// sleeps, adaptively as qemu's poll-max-ns: fewer guest kicks and
    /// thread wake-ups for a busy guest, CPU spent spinning otherwise.
    /// 0 (the default): never poll.
    #[arg(long, value_name = "US", default_value_t = 0)]
    pub vhost_poll_us: u64,
}

impl VhostArgs {
    fn parse(&self) -> anyhow::Result<Vec<(PathBuf, String, bool)>> {
        let mut out = Vec::new();
        for s in &self.vhost_user_blk {
            let (rest, ro) = match s.strip_suffix(":ro") {
                Some(r) => (r, true),
                None => (s.as_str(), false),
            };
            let Some((sock, name)) = rest.rsplit_once(':') else {
                bail!("--vhost-user-blk {s}: want SOCKET:NAME");
            };
            if sock.is_empty() || name.is_empty() {
                bail!("--vhost-user-blk {s}: want SOCKET:NAME");
            }
            out.push((PathBuf::from(sock), name.to_string(), ro));
        }
        Ok(out)
    }
}

impl ExportDriver for VhostArgs {
    fn frontend(&self) -> &'static str {
        "vhost-user-blk"
    }

    fn requested(&self) -> bool {
        !self.vhost_user_blk.is_empty()
    }

    fn usage(&self) -> &'static str {
        "--vhost-user-blk SOCKET:NAME"
    }

    /// Start every --vhost-user-blk socket (all or none).
    fn start(&self, reg: &Arc<Registry>) -> anyhow::Result<Arc<dyn ExportHost>> {
        let host = Arc::new(VhostHost::default());
        for (sock, name, ro) in self.parse()? {
            let dev = reg
                .get(&name)
                .ok_or_else(|| blkstack_mapped::DmError::NoSuchDevice(name.clone()))
                .with_context(|| format!("--vhost-user-blk {}", sock.display()));
            let r = dev.and_then(|d| {
                let tuning = (
                    self.vhost_queues,
                    std::time::Duration::from_micros(self.vhost_poll_us),
                );
                let e = VhostExport::start(&sock, &name, d.clone(), ro, tuning)?;
                Ok((e, d))
            });
            match r {
                Ok((e, d)) => {
                    d.open();
                    writeln!(
                        std::io::stdout().lock(),
                        "serving {name} to a VMM at vhost-user socket {}",
                        sock.display()
                    )?;
                    host.held.lock().push((e, d, ro));
                }
                Err(e) => {
                    host.shutdown();
                    return Err(e);
                }
            }
        }
        Ok(host)
    }
}

/// serve's vhost-user-blk disks, for the control socket's `exports` and
/// serve's stop (runtime export over vhost-user is not offered: the VMM
/// is configured with the socket at its start).
#[derive(Default)]
pub struct VhostHost {
    held: Mutex<Vec<(VhostExport, Arc<MappedDevice>, bool)>>,
}

impl ExportHost for VhostHost {
    fn export(
        &self,
        name: &str,
        _dev: Arc<MappedDevice>,
        _ro: bool,
    ) -> Result<ExportInfo, RpcError> {
        Err(RpcError::new(
            blkstack_control::proto::ENOTSUP,
            format!("{name}: vhost-user-blk disks are given at serve's start (--vhost-user-blk)"),
        ))
    }

    fn unexport(&self, name: &str, _force: bool) -> Result<(), RpcError> {
        let mut held = self.held.lock();
        let Some(i) = held.iter().position(|(e, _, _)| e.name == name) else {
            return Err(blkstack_control::not_exported(name));
        };
        let (e, d, _) = held.remove(i);
        e.stop();
        d.close();
        Ok(())
    }

    fn exports(&self) -> Vec<ExportInfo> {
        self.held
            .lock()
            .iter()
            .map(|(e, d, ro)| ExportInfo {
                name: e.name.clone(),
                read_only: *ro,
                connections: 0,
                uris: vec![format!("vhost-user:{}", e.socket.display())],
                device: d.name.clone(),
            })
            .collect()
    }

    fn frontend(&self) -> &'static str {
        "vhost-user-blk"
    }

    fn shutdown(&self) {
        for (e, d, _) in self.held.lock().drain(..) {
            e.stop();
            d.close();
        }
    }
}
