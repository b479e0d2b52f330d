//! Live control of a running `blkstack serve`, after device-mapper's
//! control interface (`/dev/mapper/control` and `dmsetup`).
//!
//! The server side ([`ControlServer`], [`Control`]) listens on a private
//! unix socket and speaks JSON-RPC 2.0, one request per line
//! ([`proto`]; docs/CONTROL.md describes every method). It drives the
//! registry of mapped devices with the kernel's semantics (staged tables
//! swapped in by resume, suspend that drains and holds, remove that
//! refuses a busy device, all-or-nothing changes) and, through the
//! [`ExportHost`] trait, the exports of serve's frontends (NBD, ublk,
//! vhost-user-blk), which also implement [`ExportDriver`], the way serve
//! starts them; neither side knows the other beyond those traits.
//!
//! The client side ([`Client`], [`cli`]) is the dmsetup-style verbs of the
//! `blkstack` command, printing dmsetup's text ([`format`]).

pub mod cli;
pub mod client;
pub mod export_driver;
pub mod format;
/// Entry points of the cargo-fuzz targets in fuzz/ (and their corpus replay tests).
#[doc(hidden)]
pub mod fuzzing;
pub mod luks_cli;
pub mod methods;
pub mod proto;
pub mod server;

pub use cli::{run_cli, Verb};
pub use client::{CallError, Client};
pub use export_driver::ExportDriver;
pub use methods::{not_exported, Control, ExportHost, ExportInfo};
pub use proto::RpcError;
pub use server::{default_socket_path, remove_stale_socket, ControlServer, ServerLimits};
