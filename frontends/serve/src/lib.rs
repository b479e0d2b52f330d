//! `blkstack serve`: one process that builds a stack of mapped devices
//! and exports them until SIGINT/SIGTERM, after qemu's block export
//! layer (`block/export/export.c`): serve owns what every export shares
//! (the registry of devices, the memory budget of `memory` targets, the
//! control socket, the signals) and runs NBD, ublk and vhost-user-blk as
//! peers behind one trait, blkstack-control's [`ExportDriver`] (qemu's
//! `BlockExportDriver`), each implemented in its frontend's
//! `src/export_driver.rs`. No frontend knows another, and none knows
//! serve.
//!
//! - [`args`]: the flags (serve's own, each frontend's flattened in).
//! - [`signals`]: SIGINT and SIGTERM as the stop.
//! - here: the run, start to stop, in steps: the stack, the frontends
//!   (all or none), the control socket, `ready`, the wait, the stop.

pub mod args;
pub mod signals;

pub use args::ServeArgs;
pub use signals::StopSignals;

use anyhow::Context;
use blkstack_control::{Control, ControlServer, ExportDriver, ExportHost};
use blkstack_mapped::Registry;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

/// `blkstack serve`: build the stack, export it, serve until SIGINT or
/// SIGTERM, then stop gracefully.
pub fn run_cli(args: ServeArgs) -> anyhow::Result<()> {
    // The export drivers in the order they start (and stop), as
    // export.c's `blk_exp_drivers[]`.
    let drivers: [&dyn ExportDriver; 3] = [&args.nbd, &args.ublk, &args.vhost];
    if !drivers.iter().any(|d| d.requested()) {
        anyhow::bail!("serve needs devices to export: {}", usage_of_all(&drivers));
    }
    let reg = build_registry(&args)?;
    // From here an error return drops `running`, which ends what started.
    let mut running = Running {
        hosts: start_frontends(&drivers, &reg)?,
        control: None,
    };
    let control = Arc::new(Control::with_hosts(reg, running.hosts.clone()));
    running.control = start_control(args.control.as_deref(), control)?;
    let signals = StopSignals::install()?;
    announce_ready(running.control.as_ref())?;
    signals.wait();
    let served = running.stop();
    // Deliberately user-facing (the counterpart of "ready" on stdout).
    eprintln!("blkstack serve: stopped after {served} connection(s); devices flushed");
    Ok(())
}

/// A started serve: its frontends and its control socket. Stopping it
/// (or dropping it, on an error after the start) closes the control
/// socket first, so no request changes the exports while they end, then
/// shuts every frontend down in the order they started.
struct Running {
    hosts: Vec<Arc<dyn ExportHost>>,
    control: Option<ControlServer>,
}

impl Running {
    /// Stop; the client connections the frontends served.
    fn stop(mut self) -> u64 {
        let hosts = self.end();
        hosts.iter().map(|h| h.connections_served()).sum()
    }

    /// Close the control socket and shut the frontends down, once.
    fn end(&mut self) -> Vec<Arc<dyn ExportHost>> {
        self.control = None;
        let hosts = std::mem::take(&mut self.hosts);
        shutdown(&hosts);
        hosts
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.end();
    }
}

/// `--export NAME (NBD), --ublk NAME (/dev/ublkbN) or ...`.
fn usage_of_all(drivers: &[&dyn ExportDriver]) -> String {
    let all: Vec<&str> = drivers.iter().map(|d| d.usage()).collect();
    match all.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => all.concat(),
    }
}

/// The process-wide parameters (memory budget, thin's no-space timeout)
/// first, then the devices of `--stack` and `--concise`.
fn build_registry(args: &ServeArgs) -> anyhow::Result<Arc<Registry>> {
    if let Some(limit) = args.memory_limit {
        blkstack_mapped::targets::memory::process_budget().set_limit_bytes(limit);
    }
    blkstack_mapped::targets::thin::set_no_space_timeout_secs(args.thin_no_space_timeout);
    let reg = Registry::new();
    if let Some(path) = &args.stack {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading stack file {}", path.display()))?;
        reg.create_stack(&text)
            .with_context(|| format!("stack file {}", path.display()))?;
    }
    if let Some(c) = &args.concise {
        reg.create_concise(c).context("--concise")?;
    }
    Ok(reg)
}

/// Start every enabled frontend, in order; all or none: when one fails,
/// those already started are shut down.
fn start_frontends(
    drivers: &[&dyn ExportDriver],
    reg: &Arc<Registry>,
) -> anyhow::Result<Vec<Arc<dyn ExportHost>>> {
    let mut hosts = Vec::new();
    for d in drivers.iter().filter(|d| d.enabled()) {
        match d.start(reg) {
            Ok(h) => hosts.push(h),
            Err(e) => {
                shutdown(&hosts);
                return Err(e);
            }
        }
    }
    Ok(hosts)
}

/// The control socket at `path`, or at the default path; a default that
/// cannot be had (another server holds it) only costs the control
/// socket, with a warning.
fn start_control(
    path: Option<&Path>,
    control: Arc<Control>,
) -> anyhow::Result<Option<ControlServer>> {
    if let Some(p) = path {
        return Ok(Some(ControlServer::start(p, control, false)?));
    }
    let p = blkstack_control::default_socket_path();
    match ControlServer::start(&p, control, true) {
        Ok(c) => Ok(Some(c)),
        Err(e) => {
            tracing::warn!(error = %e, "serve: no control socket");
            Ok(None)
        }
    }
}

/// The control socket's line and `ready`, after every `serving` line.
fn announce_ready(control: Option<&ControlServer>) -> std::io::Result<()> {
    let mut so = std::io::stdout().lock();
    if let Some(c) = control {
        writeln!(so, "control socket at {}", c.path().display())?;
    }
    writeln!(so, "ready")?;
    so.flush()
}

/// End every frontend's exports, in the order they started.
fn shutdown(hosts: &[Arc<dyn ExportHost>]) {
    for h in hosts {
        h.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> ServeArgs {
        let mut all = vec!["serve", "--concise", "d0,,,rw,0 8 zero"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all).unwrap().serve
    }

    #[test]
    fn without_an_export_serve_refuses_naming_every_frontend() {
        // `--listen` alone asks for nothing to export.
        let e = run_cli(parse(&["--listen", "nbd://127.0.0.1:0"])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "serve needs devices to export: --export NAME (NBD), \
             --ublk NAME (/dev/ublkbN) or --vhost-user-blk SOCKET:NAME"
        );
    }

    #[test]
    fn listen_alone_starts_nbd_only_beside_another_frontend() {
        let a = parse(&["--listen", "nbd://127.0.0.1:0"]);
        assert!(!a.nbd.requested() && a.nbd.enabled());
        let a = parse(&["--export", "d0"]);
        assert!(a.nbd.requested() && !a.ublk.enabled() && !a.vhost.enabled());
        let a = parse(&["--ublk-enable"]);
        assert!(a.ublk.requested() && !a.nbd.enabled());
    }

    #[test]
    fn a_failed_frontend_leaves_nothing_started() {
        // NBD starts, then vhost-user-blk names a device that is not
        // there: the error names the flag, and NBD is shut down.
        let a = parse(&[
            "--export",
            "d0",
            "--listen",
            "nbd://127.0.0.1:0",
            "--vhost-user-blk",
            "/nonexistent/x.sock:nope",
        ]);
        let reg = build_registry(&a).unwrap();
        let drivers: [&dyn ExportDriver; 3] = [&a.nbd, &a.ublk, &a.vhost];
        let e = start_frontends(&drivers, &reg).err().unwrap();
        assert!(format!("{e:#}").contains("--vhost-user-blk"), "{e:#}");
        assert_eq!(reg.get("d0").unwrap().open_count(), 0);
    }
}
