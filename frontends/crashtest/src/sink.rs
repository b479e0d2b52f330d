//! Where replayed entries land: an image file or block device (as
//! xfstests' `replay-log` writes with `pwrite`), or a blkstack device
//! (a device of a stack file built in this process, a device of a running
//! `blkstack serve` reached through its NBD export, or the origin of a
//! crashtest's overlay), written with bios. Discards become BLKDISCARD
//! (or a discard bio) where the device takes them, written zeroes
//! otherwise, up to 128 MiB each as replay-log does.
//!
//! Nothing is written or discarded past the end of what is replayed onto
//! (an image file's size when it is opened, a device's size): replay-log
//! would grow an image file to wherever a log points, and a log can point
//! anywhere; an entry past the end is an error naming its bytes, and that
//! bound also bounds the work a discard can ask for.

use blkstack_core::{submit_and_wait, AlignedBuf, DeviceRef, Op, Status};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("cannot open the replay device {path}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("writing the replay device at byte {at}")]
    Write { at: u64, source: std::io::Error },
    #[error("writing the replay device at byte {at}: {status:?}")]
    Bio { at: u64, status: Status },
    #[error(
        "an entry {what} bytes {at}..{end} of the replay device, which has {size}: \
         past its end (give it the logged device's size)",
        end = .at.saturating_add(*.len)
    )]
    PastEnd {
        what: &'static str,
        at: u64,
        len: u64,
        size: u64,
    },
}

enum Kind {
    File { file: File, block_device: bool },
    Device(DeviceRef),
}

/// The device or file entries are replayed onto.
pub struct Sink {
    kind: Kind,
    /// Its size in bytes: nothing lands past it.
    size: u64,
    discard_unsupported: bool,
}

const MAX_ZERO: u64 = 128 << 20;
const ZERO_CHUNK: usize = 1 << 20;

impl Sink {
    pub fn open_path(path: &Path) -> Result<Sink, SinkError> {
        let file = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|source| SinkError::Open {
                path: path.display().to_string(),
                source,
            })?;
        let block_device = file
            .metadata()
            .map(|m| m.file_type().is_block_device())
            .unwrap_or(false);
        let size = crate::log::device_size(&file).map_err(|source| SinkError::Open {
            path: path.display().to_string(),
            source,
        })?;
        Ok(Sink {
            kind: Kind::File { file, block_device },
            size,
            discard_unsupported: !block_device,
        })
    }

    pub fn device(dev: DeviceRef) -> Sink {
        let discard_unsupported = !dev.features().discard;
        let size = dev.size();
        Sink {
            kind: Kind::Device(dev),
            size,
            discard_unsupported,
        }
    }

    fn within(&self, what: &'static str, at: u64, len: u64) -> Result<(), SinkError> {
        match at.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(SinkError::PastEnd {
                what,
                at,
                len,
                size: self.size,
            }),
        }
    }

    pub fn write(&self, at: u64, data: &[u8]) -> Result<(), SinkError> {
        self.within("writes", at, data.len() as u64)?;
        match &self.kind {
            Kind::File { file, .. } => file
                .write_all_at(data, at)
                .map_err(|source| SinkError::Write { at, source }),
            Kind::Device(dev) => {
                // An aligned copy: a file leaf below may use O_DIRECT.
                let mut buf = AlignedBuf::new(data.len());
                buf.as_mut_slice().copy_from_slice(data);
                let st =
                    submit_and_wait(&**dev, Op::Write, at, data.len() as u64, buf.as_mut_slice());
                if st.is_ok() {
                    Ok(())
                } else {
                    Err(SinkError::Bio { at, status: st })
                }
            }
        }
    }

    pub fn discard(&mut self, mut at: u64, mut len: u64) -> Result<(), SinkError> {
        const MAX_CHUNK: u64 = 1 << 30;
        self.within("discards", at, len)?;
        while len > 0 {
            let n = len.min(MAX_CHUNK);
            if !self.discard_unsupported && !self.try_discard(at, n) {
                tracing::info!("the replay device does not discard: writing zeroes instead");
                self.discard_unsupported = true;
            }
            if self.discard_unsupported && n <= MAX_ZERO {
                let zeros = vec![0u8; ZERO_CHUNK.min(n as usize)];
                let mut off = 0;
                while off < n {
                    let k = (n - off).min(zeros.len() as u64) as usize;
                    self.write(at + off, &zeros[..k])?;
                    off += k as u64;
                }
            }
            at += n;
            len -= n;
        }
        Ok(())
    }

    fn try_discard(&self, at: u64, len: u64) -> bool {
        match &self.kind {
            Kind::File { file, block_device } => {
                let range = [at, len];
                // SAFETY: BLKDISCARD reads two u64 through the pointer.
                let r = unsafe {
                    libc::ioctl(
                        std::os::fd::AsRawFd::as_raw_fd(file),
                        BLKDISCARD,
                        range.as_ptr(),
                    )
                };
                *block_device && r == 0
            }
            Kind::Device(dev) => submit_and_wait(&**dev, Op::Discard, at, len, &mut []).is_ok(),
        }
    }

    /// Make what was written durable (fsync, or a flush bio).
    pub fn sync(&self) {
        match &self.kind {
            Kind::File { file, .. } => {
                let _ = file.sync_all();
            }
            Kind::Device(dev) => {
                let _ = submit_and_wait(&**dev, Op::Flush, 0, 0, &mut []);
            }
        }
    }
}

/// `_IO(0x12, 119)`.
const BLKDISCARD: libc::c_ulong = 0x1277;
