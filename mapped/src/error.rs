//! Errors of the mapped layer. Every one names what is wrong (the device,
//! the table line, the argument) because a dmsetup user reads them.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum DmError {
    /// A table line is wrong: its number and why.
    #[error("{}line {line}: {msg}", device.as_ref().map(|d| format!("device {d}: ")).unwrap_or_default())]
    Line {
        device: Option<String>,
        line: usize,
        msg: String,
    },
    #[error("device {0} not found")]
    NoSuchDevice(String),
    #[error("device {0} already exists")]
    Exists(String),
    #[error("device {name} is busy: {why}")]
    Busy { name: String, why: String },
    #[error("{0}")]
    Invalid(String),
}

impl DmError {
    pub fn line(line: usize, msg: String) -> DmError {
        DmError::Line {
            device: None,
            line,
            msg,
        }
    }

    /// Attach the device name to a line error (for multi-device input).
    pub fn in_device(self, name: &str) -> DmError {
        match self {
            DmError::Line {
                device: None,
                line,
                msg,
            } => DmError::Line {
                device: Some(name.to_string()),
                line,
                msg,
            },
            DmError::Invalid(msg) if !msg.contains(name) => {
                DmError::Invalid(format!("device {name}: {msg}"))
            }
            e => e,
        }
    }
}
