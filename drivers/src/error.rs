//! The drivers crate's typed errors.
//!
//! A leaf driver fails in two places: its table line (the `key=value`
//! knobs every driver parses through [`crate::args::KvArgs`], and the
//! device length), and its construction (opening a backing file, starting
//! its threads, the engine refusing its options). Each error names the
//! driver and the offending key, value, path or step, as the kernel's
//! device-mapper constructors set `ti->error` ("Invalid device length",
//! "Device lookup failed"), so that a bad table line is reported precisely
//! and changes nothing. I/O errors keep the `std::io::Error` as their
//! `#[source]`.

use std::io;
use std::path::PathBuf;
use thiserror::Error;

/// A leaf driver's table arguments are wrong (shared by every driver).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ArgError {
    /// A word that should be `key=value` has no `=` (so no value).
    #[error("{driver}: argument '{arg}' is not of the form key=value")]
    MissingValue { driver: &'static str, arg: String },
    #[error("{driver}: argument '{arg}' has an empty key")]
    EmptyKey { driver: &'static str, arg: String },
    #[error("{driver}: argument '{key}' given twice")]
    Duplicate { driver: &'static str, key: String },
    /// A key no accessor asked for.
    #[error("{driver}: unknown argument '{key}'")]
    UnknownKey { driver: &'static str, key: String },
    /// A value of the wrong shape; `expected` says what would do.
    #[error("{driver}: {key}='{value}' is not {expected}")]
    BadValue {
        driver: &'static str,
        key: String,
        value: String,
        expected: String,
    },
    #[error("{driver}: {key}={value} is out of range {min}..={max}")]
    OutOfRange {
        driver: &'static str,
        key: String,
        value: u64,
        min: u64,
        max: u64,
    },
    /// A logical block size that is not a power of two in 512..=4096.
    #[error("{driver}: {key}={value} is not a power of two in 512..=4096")]
    BadBlockSize {
        driver: &'static str,
        key: String,
        value: u64,
    },
    /// Values that are fine one by one but not together (the engine's
    /// option validation, a flag that needs another).
    #[error("{driver}: {reason}")]
    Conflict {
        driver: &'static str,
        reason: String,
    },
    #[error("{driver}: device size is zero")]
    ZeroSize { driver: &'static str },
    #[error("{driver}: size {size_bytes} bytes is not a multiple of the block size {block_size}")]
    SizeNotBlockMultiple {
        driver: &'static str,
        size_bytes: u64,
        block_size: u32,
    },
}

/// Why an emulated-completion queue (`null`'s and `memory`'s) could not
/// be built.
#[derive(Debug, thiserror::Error)]
pub enum EmulatedQueueError {
    #[error(transparent)]
    Engine(#[from] blkstack_mq::QueueError),
    #[error("cannot start completion thread: {0}")]
    Thread(#[source] std::io::Error),
    /// A completion thread ended before it was set up.
    #[error("a completion thread ended while starting")]
    ThreadDied,
    /// The engine never handed the driver its completer.
    #[error("the engine attached no completer")]
    NoCompleter,
}

/// The `memory` driver could not be built.
#[derive(Debug, Error)]
pub enum MemoryError {
    #[error(transparent)]
    Args(#[from] ArgError),
    /// The blk-mq engine (or the emulated completion it runs under)
    /// refused to start the queue.
    #[error("memory: cannot start its queue")]
    Queue(#[source] EmulatedQueueError),
}

/// The `file` driver's table line is wrong or its backing file unusable.
#[derive(Debug, Error)]
pub enum FileError {
    #[error(transparent)]
    Args(#[from] ArgError),
    #[error("file: missing PATH (syntax: file PATH [direct] [iopoll|hybrid_iopoll] [create] [queue_depth=N] [engine=uring|psync])")]
    MissingPath,
    #[error("file: first argument must be the PATH of the backing file, got '{0}'")]
    BadPath(String),
    #[error("file: unknown flag '{0}' (flags: direct, iopoll, hybrid_iopoll, create; options: queue_depth=N, engine=uring|psync)")]
    UnknownFlag(String),
    #[error("file: '{0}' given twice")]
    FlagTwice(&'static str),
    #[error("file: '{given}' conflicts with '{previous}': give one polling mode")]
    PollConflict {
        given: &'static str,
        previous: &'static str,
    },
    #[error("file: '{0}' needs 'direct' (the kernel polls only O_DIRECT I/O)")]
    PollNeedsDirect(&'static str),
    #[error("file: '{0}' needs engine=uring (polling is an io_uring ring mode)")]
    PollNeedsUring(&'static str),
    #[error("file: {} does not exist (add 'create' to create it)", path.display())]
    NotFound { path: PathBuf },
    #[error("file: {} is neither a regular file nor a block device", path.display())]
    NotFileOrBlockDevice { path: PathBuf },
    #[error(
        "file: {} holds {current} bytes, less than the table line's {size} bytes{}",
        path.display(),
        if *block_device { "" } else { " (add 'create' to extend it)" }
    )]
    TooSmall {
        path: PathBuf,
        current: u64,
        size: u64,
        block_device: bool,
    },
    #[error("file: {}: the filesystem refuses O_DIRECT (EINVAL); drop 'direct'", path.display())]
    DirectRefused {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A step of opening the backing file failed (`what`: "cannot open",
    /// "cannot stat", ...).
    #[error("file: {what} {}: {source}", path.display())]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    /// The driver's completion or I/O threads could not be started.
    #[error("file: cannot start {what}: {source}")]
    Thread {
        what: &'static str,
        #[source]
        source: io::Error,
    },
}

impl FileError {
    pub(crate) fn io(path: &std::path::Path, what: &'static str, source: io::Error) -> FileError {
        FileError::Io {
            path: path.to_path_buf(),
            what,
            source,
        }
    }
}
