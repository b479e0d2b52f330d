//! The vhost-user-blk frontend: a blkstack device as a VM's virtio disk,
//! served from this process to the VMM (qemu `-device
//! vhost-user-blk-pci`) over a unix socket, the guest's virtqueues read
//! straight from its shared memory. The vhost-user protocol and the
//! virtqueues come from rust-vmm (`vhost-user-backend`, `vhost`,
//! `virtio-queue`, `vm-memory`); here are only the virtio-blk device
//! ([`config`], [`request`]), its backend ([`backend`]) and the bounded
//! polling of its rings between kicks ([`poll`]), the guard that
//! keeps a VMM's shrunk memory from killing the process ([`guard`]), the
//! socket's life ([`server`]), and the disk as one of `serve`'s export
//! frontends ([`export_driver`]).

pub mod backend;
pub mod config;
pub mod export_driver;
pub mod fuzzing;
pub mod guard;
pub mod poll;
pub mod request;
pub mod server;
pub mod vring;

pub use export_driver::{VhostArgs, VhostHost};
pub use server::{VhostError, VhostExport};
