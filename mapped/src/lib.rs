//! The mapped-device layer, after Linux device-mapper: a `dmsetup`-style
//! table language, targets (one file each, one shape), mapped devices with
//! suspend/resume/reload, and a registry of named devices.
//!
//! Leaf drivers (null, memory, file) appear here as table targets too, so
//! one table language describes a whole stack.

#![warn(missing_docs)]

pub mod device;
pub mod error;
/// Entry points of the cargo-fuzz targets in fuzz/ (and their corpus replay tests).
#[doc(hidden)]
pub mod fuzzing;
pub mod persistent_data;
pub mod registry;
pub mod selectors;
pub(crate) mod split;
pub mod table;
pub mod table_text;
pub mod table_type;
pub mod target;
pub mod targets;

pub use device::MappedDevice;
pub use error::DmError;
pub use registry::{DeviceInfo, Registry};
pub use target::{CtrContext, DevArg, Events, Target, TargetRef, TargetType};
