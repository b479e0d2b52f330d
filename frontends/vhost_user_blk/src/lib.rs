//! The vhost-user-blk frontend: a blkstack device as a VM's virtio disk,
//! served from this process to the VMM (qemu `-device
//! vhost-user-blk-pci`) over a unix socket, the guest's virtqueues read
//! straight from its shared memory. The vhost-user protocol and the
//! virtqueues come from rust-vmm (`vhost-user-backend`, `vhost`,
//! `virtio-queue`, `vm-memory`); here are only the virtio-blk device
//! ([`config`], [`request`]), its backend ([`backend`]), the guard that
//! keeps a VMM's shrunk memory from killing the process ([`guard`]) and
//! the socket's life ([`server`]).

pub mod backend;
pub mod cli;
pub mod config;
pub mod fuzzing;
pub mod guard;
pub mod request;
pub mod server;

pub use server::{VhostError, VhostExport};
