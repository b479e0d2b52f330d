//! `replay-log --replay NAME` where NAME is a blkstack device, not a path:
//! a device of a stack file (built here, in this process, so its file
//! leaves get the replayed data), or a device of a running `blkstack
//! serve` (found through its control socket, written through its NBD
//! export with the userspace `nbd` leaf, so the serve keeps serving it
//! while it changes). xfstests' replay-log takes only paths; these are the
//! names a blkstack user has instead of /dev/mapper paths.

use crate::replay::ReplayDev;
use anyhow::{bail, Context};
use blkstack_mapped::Registry;
use serde_json::json;
use std::path::Path;
use std::sync::Arc;

/// What `--replay` names, and the registry that must outlive the replay
/// (for a device built here).
pub fn resolve(
    replay: &str,
    stack: Option<&Path>,
    control: Option<&Path>,
) -> anyhow::Result<(ReplayDev, Option<Arc<Registry>>)> {
    if let Some(file) = stack {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("reading stack file {}", file.display()))?;
        let reg = Registry::new();
        reg.create_stack(&text)
            .with_context(|| format!("stack file {}", file.display()))?;
        let dev = reg
            .device(replay)
            .with_context(|| format!("--replay {replay}: not in {}", file.display()))?;
        return Ok((
            ReplayDev::Device {
                name: replay.to_string(),
                dev,
            },
            Some(reg),
        ));
    }
    if let Some(sock) = control {
        return from_serve(replay, sock);
    }
    let p = Path::new(replay);
    if p.exists() {
        return Ok((ReplayDev::Path(p.to_path_buf()), None));
    }
    bail!(
        "--replay {replay}: no such file or device (a blkstack device name needs --stack FILE \
         or --control SOCK)"
    )
}

/// The device NAME of the serve behind `sock`, through an NBD export of it.
fn from_serve(name: &str, sock: &Path) -> anyhow::Result<(ReplayDev, Option<Arc<Registry>>)> {
    let mut c = blkstack_control::Client::connect(sock)?;
    let info = c
        .call("info", json!({ "names": [name] }))
        .with_context(|| format!("--replay {name}"))?;
    let size = info
        .pointer("/devices/0/size_bytes")
        .and_then(|v| v.as_u64())
        .with_context(|| format!("--replay {name}: the serve did not say its size"))?;
    let exports = c.call("exports", json!({}))?;
    let uri = exports
        .get("exports")
        .and_then(|e| e.as_array())
        .into_iter()
        .flatten()
        .filter(|e| e.get("device").and_then(|d| d.as_str()) == Some(name))
        .filter(|e| e.get("read_only").and_then(|r| r.as_bool()) != Some(true))
        .filter_map(|e| e.get("uris").and_then(|u| u.as_array()))
        .flatten()
        .filter_map(|u| u.as_str())
        // A unix socket first: it needs no port and no TLS.
        .min_by_key(|u| !u.starts_with("nbd+unix"))
        .map(str::to_string)
        .with_context(|| {
            format!(
                "--replay {name}: the serve at {} does not export it writable \
                 (blkstack export {name} --control {})",
                sock.display(),
                sock.display()
            )
        })?;
    let reg = Registry::new();
    reg.create(name, &format!("0 {} nbd {uri}", size / 512))
        .with_context(|| format!("--replay {name}: connecting to {uri}"))?;
    let dev = reg.device(name)?;
    Ok((
        ReplayDev::Device {
            name: name.to_string(),
            dev,
        },
        Some(reg),
    ))
}
