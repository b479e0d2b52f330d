//! The dmsetup-style verbs of `blkstack`: each sends one (or one per
//! device) request to a running `blkstack serve` and prints what dmsetup
//! prints for the same verb. Names, flags and output follow dmsetup
//! (lvm2 tools/dmsetup.c); `export`/`unexport` are blkstack's own.
//!
//! Failures print dmsetup's `device-mapper: <ioctl> ioctl on NAME failed:
//! <strerror>` followed by blkstack's reason (the kernel leaves the reason
//! in dmesg; here it is the only place to put it) and exit non-zero.

use crate::client::{CallError, Client};
use crate::format;
use crate::server::default_socket_path;
use anyhow::{anyhow, bail, Context};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::path::PathBuf;

/// Where the server's control socket is.
#[derive(clap::Args, Debug, Clone)]
pub struct ControlOpt {
    /// Control socket of the running `blkstack serve`
    /// [default: $XDG_RUNTIME_DIR/blkstack/control.sock, else /run/blkstack/control.sock].
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
}

impl ControlOpt {
    pub fn path(&self) -> PathBuf {
        self.control.clone().unwrap_or_else(default_socket_path)
    }
}

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    blkstack create d1 --table '0 2048 linear d0 0'\n  \
    blkstack create d1 table.txt\n  \
    blkstack create --concise 'a,,,rw,0 2048 zero;b,,,rw,0 2048 linear a 0'\n\n\
    Without --table, a table file or --concise, the table is read from standard input.")]
pub struct CreateArgs {
    /// Name of the new device.
    #[arg(value_name = "NAME", required_unless_present = "concise")]
    pub name: Option<String>,
    /// A file holding the table.
    #[arg(value_name = "TABLE_FILE", conflicts_with = "table")]
    pub table_file: Option<PathBuf>,
    /// The table itself (lines `start length target args...`, separated by newlines).
    #[arg(long, value_name = "TABLE")]
    pub table: Option<String>,
    /// Create devices from a concise list (`name,uuid,minor,flags,table[,table]...;...`);
    /// without a value it is read from standard input.
    #[arg(long, value_name = "LIST", num_args = 0..=1, default_missing_value = "-",
          conflicts_with_all = ["name", "table", "table_file", "uuid", "readonly"])]
    pub concise: Option<String>,
    /// UUID of the new device.
    #[arg(short = 'u', long, value_name = "UUID")]
    pub uuid: Option<String>,
    /// Create the device read-only.
    #[arg(short = 'r', long)]
    pub readonly: bool,
    #[command(flatten)]
    pub control: ControlOpt,
}

#[derive(clap::Args, Debug)]
pub struct ReloadArgs {
    #[arg(value_name = "NAME")]
    pub name: String,
    /// A file holding the table.
    #[arg(value_name = "TABLE_FILE", conflicts_with = "table")]
    pub table_file: Option<PathBuf>,
    /// The table itself; without it or a file, read from standard input.
    #[arg(long, value_name = "TABLE")]
    pub table: Option<String>,
    /// Stage the table even if it drops data held in RAM (a written
    /// `memory` line not kept at the same start and length).
    #[arg(short = 'f', long)]
    pub force: bool,
    #[command(flatten)]
    pub control: ControlOpt,
}

#[derive(clap::Args, Debug)]
pub struct RemoveArgs {
    /// Remove even if exported (clients are disconnected once their
    /// in-flight requests are answered) or holding data in RAM (a written
    /// `memory` target; the data is discarded). A device used by another
    /// device is never removed.
    #[arg(short = 'f', long)]
    pub force: bool,
    #[arg(value_name = "NAME", required = true)]
    pub names: Vec<String>,
    #[command(flatten)]
    pub control: ControlOpt,
}

#[derive(clap::Args, Debug)]
pub struct NamesArgs {
    #[arg(value_name = "NAME", required = true)]
    pub names: Vec<String>,
    #[command(flatten)]
    pub control: ControlOpt,
}

#[derive(clap::Args, Debug)]
pub struct QueryArgs {
    /// Devices to show; all when none is given.
    #[arg(value_name = "NAME")]
    pub names: Vec<String>,
    #[command(flatten)]
    pub control: ControlOpt,
}

#[derive(clap::Args, Debug)]
pub struct TableArgs {
    /// Devices to show; all when none is given.
    #[arg(value_name = "NAME")]
    pub names: Vec<String>,
    /// Show the staged table (loaded by `reload`, live after `resume`).
    #[arg(long)]
    pub inactive: bool,
    #[command(flatten)]
    pub control: ControlOpt,
}

#[derive(clap::Args, Debug)]
pub struct LsArgs {
    /// Draw the devices as a dependency tree.
    #[arg(long)]
    pub tree: bool,
    #[command(flatten)]
    pub control: ControlOpt,
}

#[derive(clap::Args, Debug)]
pub struct MessageArgs {
    #[arg(value_name = "NAME")]
    pub name: String,
    /// A sector inside the table line whose target gets the message (0 for the first).
    #[arg(value_name = "SECTOR")]
    pub sector: u64,
    /// The message words, e.g. `fail_path 253:1`. Options such as
    /// `--control` may come before, between or after them, as with every
    /// other verb; a word that starts with `--` goes after `--`.
    #[arg(value_name = "MESSAGE", required = true, allow_negative_numbers = true)]
    pub message: Vec<String>,
    #[command(flatten)]
    pub control: ControlOpt,
}

#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    #[arg(value_name = "NAME")]
    pub name: String,
    /// Export read-only (writes, trims and zeroing fail with EPERM).
    #[arg(short = 'r', long)]
    pub readonly: bool,
    /// Export as a kernel block device, /dev/ublkbN (the server must run
    /// where /dev/ublk-control exists: `modprobe ublk_drv`), not over NBD.
    #[arg(long)]
    pub ublk: bool,
    #[command(flatten)]
    pub control: ControlOpt,
}

#[derive(clap::Args, Debug)]
pub struct UnexportArgs {
    /// Withdraw even with clients connected (they are disconnected once
    /// their in-flight requests are answered).
    #[arg(short = 'f', long)]
    pub force: bool,
    /// Withdraw the ublk export (/dev/ublkbN) of that name; needed only
    /// when the device is exported on both NBD and ublk.
    #[arg(long)]
    pub ublk: bool,
    #[arg(value_name = "NAME")]
    pub name: String,
    #[command(flatten)]
    pub control: ControlOpt,
}

/// The verbs, meant to be flattened into the `blkstack` command.
#[derive(clap::Subcommand, Debug)]
pub enum Verb {
    /// Create a device on the running server (dmsetup create).
    Create(CreateArgs),
    /// Remove devices (dmsetup remove); refused while used or exported unless -f.
    Remove(RemoveArgs),
    /// Suspend devices: hold new I/O, wait for in-flight I/O (dmsetup suspend).
    Suspend(NamesArgs),
    /// Resume devices, making a reloaded table live (dmsetup resume).
    Resume(NamesArgs),
    /// Stage a new table; the next resume makes it live (dmsetup reload/load).
    #[command(alias = "load")]
    Reload(ReloadArgs),
    /// Drop a staged table (dmsetup clear).
    Clear(NamesArgs),
    /// Print tables (dmsetup table).
    Table(TableArgs),
    /// Print target status (dmsetup status).
    Status(QueryArgs),
    /// Print device information (dmsetup info).
    Info(QueryArgs),
    /// Print the devices each device uses (dmsetup deps).
    Deps(QueryArgs),
    /// List devices, or draw them as a tree (dmsetup ls [--tree]).
    Ls(LsArgs),
    /// Send a message to a target (dmsetup message).
    Message(MessageArgs),
    /// Export a device over NBD (or with --ublk as /dev/ublkbN) on the running server.
    Export(ExportArgs),
    /// Withdraw an NBD (or ublk) export.
    Unexport(UnexportArgs),
}

/// The dm ioctl a method stands for, as dmsetup names it in errors.
fn ioctl_name(method: &str) -> &str {
    match method {
        "ls" => "list",
        other => other,
    }
}

/// Call `method` and turn a refusal into dmsetup's error line.
pub(crate) fn call(
    client: &mut Client,
    method: &str,
    subject: &str,
    params: Value,
) -> anyhow::Result<Value> {
    client.call(method, params).map_err(|e| match e {
        CallError::Io(e) => anyhow!("control socket {}: {e}", client.path().display()),
        CallError::Rpc(e) => match e.strerror() {
            Some(errno) => anyhow!(
                "device-mapper: {} ioctl on {subject} failed: {errno}: {}",
                ioctl_name(method),
                e.message
            ),
            None => anyhow!("{method} {subject}: {}", e.message),
        },
    })
}

pub(crate) fn connect(c: &ControlOpt) -> anyhow::Result<Client> {
    Ok(Client::connect(&c.path())?)
}

fn read_stdin(what: &str) -> anyhow::Result<String> {
    let mut s = String::new();
    std::io::stdin()
        .read_to_string(&mut s)
        .with_context(|| format!("reading {what} from standard input"))?;
    Ok(s)
}

fn table_text(table: &Option<String>, file: &Option<PathBuf>) -> anyhow::Result<String> {
    match (table, file) {
        (Some(t), _) => Ok(t.clone()),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("reading table file {}", f.display())),
        (None, None) => read_stdin("the table"),
    }
}

fn print(s: &str) -> anyhow::Result<()> {
    let mut so = std::io::stdout().lock();
    so.write_all(s.as_bytes())?;
    so.flush()?;
    Ok(())
}

/// Run one verb against the server.
pub fn run_cli(verb: Verb) -> anyhow::Result<()> {
    match verb {
        Verb::Create(a) => create(&a),
        Verb::Remove(a) => {
            let mut c = connect(&a.control)?;
            for n in &a.names {
                call(&mut c, "remove", n, json!({ "name": n, "force": a.force }))?;
            }
            Ok(())
        }
        Verb::Suspend(a) => each(&a, "suspend"),
        Verb::Resume(a) => each(&a, "resume"),
        Verb::Clear(a) => each(&a, "clear"),
        Verb::Reload(a) => reload(&a),
        Verb::Table(a) => {
            let mut c = connect(&a.control)?;
            let r = call(
                &mut c,
                "table",
                &subjects(&a.names),
                json!({ "names": a.names, "inactive": a.inactive }),
            )?;
            print(&format::lines(&r, "table", a.names.len() != 1))
        }
        Verb::Status(a) => {
            let mut c = connect(&a.control)?;
            let r = call(
                &mut c,
                "status",
                &subjects(&a.names),
                json!({ "names": a.names }),
            )?;
            print(&format::lines(&r, "status", a.names.len() != 1))
        }
        Verb::Info(a) => {
            let mut c = connect(&a.control)?;
            let r = call(
                &mut c,
                "info",
                &subjects(&a.names),
                json!({ "names": a.names }),
            )?;
            print(&format::info(&r))
        }
        Verb::Deps(a) => {
            let mut c = connect(&a.control)?;
            let r = call(
                &mut c,
                "deps",
                &subjects(&a.names),
                json!({ "names": a.names }),
            )?;
            print(&format::deps(&r, a.names.len() != 1))
        }
        Verb::Ls(a) => {
            let mut c = connect(&a.control)?;
            let r = call(&mut c, "ls", "all devices", json!({}))?;
            print(&if a.tree {
                format::tree(&r)
            } else {
                format::ls(&r)
            })
        }
        Verb::Message(a) => message(&a),
        Verb::Export(a) => export(&a),
        Verb::Unexport(a) => unexport(&a),
    }
}

/// `create`.
fn create(a: &CreateArgs) -> anyhow::Result<()> {
    let mut c = connect(&a.control)?;
    let (subject, params) = match (&a.concise, &a.name) {
        (Some(list), _) => {
            let list = if list == "-" {
                read_stdin("the concise device list")?
            } else {
                list.clone()
            };
            ("concise list".to_string(), json!({ "concise": list }))
        }
        (None, Some(name)) => {
            let table = table_text(&a.table, &a.table_file)?;
            (
                name.clone(),
                json!({ "name": name, "table": table, "uuid": a.uuid, "readonly": a.readonly }),
            )
        }
        (None, None) => bail!("create: give a device NAME or --concise"),
    };
    call(&mut c, "create", &subject, params)?;
    Ok(())
}

/// `message`.
fn message(a: &MessageArgs) -> anyhow::Result<()> {
    let mut c = connect(&a.control)?;
    let r = call(
        &mut c,
        "message",
        &a.name,
        json!({ "name": a.name, "sector": a.sector, "message": a.message }),
    )?;
    let reply = r.get("reply").and_then(Value::as_str).unwrap_or("");
    if reply.is_empty() {
        Ok(())
    } else if reply.ends_with('\n') {
        print(reply)
    } else {
        print(&format!("{reply}\n"))
    }
}

/// `export`.
fn export(a: &ExportArgs) -> anyhow::Result<()> {
    let mut c = connect(&a.control)?;
    let r = call(
        &mut c,
        "export",
        &a.name,
        json!({ "name": a.name, "readonly": a.readonly,
                    "frontend": if a.ublk { "ublk" } else { "nbd" } }),
    )?;
    let mut out = String::new();
    for u in r
        .get("uris")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        out.push_str(&format!(
            "exported {}{} at {}\n",
            a.name,
            if r["read_only"] == json!(true) {
                " (read-only)"
            } else {
                ""
            },
            u.as_str().unwrap_or("")
        ));
    }
    print(&out)
}

/// `unexport`.
fn unexport(a: &UnexportArgs) -> anyhow::Result<()> {
    let mut c = connect(&a.control)?;
    call(
        &mut c,
        "unexport",
        &a.name,
        if a.ublk {
            json!({ "name": a.name, "force": a.force, "frontend": "ublk" })
        } else {
            json!({ "name": a.name, "force": a.force })
        },
    )?;
    Ok(())
}

/// `reload`.
fn reload(a: &ReloadArgs) -> anyhow::Result<()> {
    let table = table_text(&a.table, &a.table_file)?;
    let mut c = connect(&a.control)?;
    call(
        &mut c,
        "reload",
        &a.name,
        json!({ "name": a.name, "table": table, "force": a.force }),
    )?;
    Ok(())
}

/// `NAME[:ro]` items of a flag (`--export`, `--ublk`): (name, read_only)
/// pairs, each name once.
pub fn parse_named_modes(flag: &str, items: &[String]) -> anyhow::Result<Vec<(String, bool)>> {
    let mut out: Vec<(String, bool)> = Vec::new();
    for e in items {
        let e = e.trim();
        let (name, ro) = match e.rsplit_once(':') {
            Some((n, "ro")) => (n, true),
            Some((n, "rw")) => (n, false),
            Some((_, other)) => bail!("{flag} {e}: unknown mode {other:?} (use NAME or NAME:ro)"),
            None => (e, false),
        };
        if name.is_empty() {
            bail!("{flag}: empty device name");
        }
        if out.iter().any(|(n, _)| n == name) {
            bail!("{flag}: {name} given twice");
        }
        out.push((name.to_string(), ro));
    }
    Ok(out)
}

fn subjects(names: &[String]) -> String {
    if names.is_empty() {
        "all devices".into()
    } else {
        names.join(", ")
    }
}

fn each(a: &NamesArgs, method: &str) -> anyhow::Result<()> {
    let mut c = connect(&a.control)?;
    for n in &a.names {
        call(&mut c, method, n, json!({ "name": n }))?;
    }
    Ok(())
}
