//! The backing file of a `file` device: its buffered and O_DIRECT
//! descriptors, the O_DIRECT alignment the filesystem asks for (statx
//! `STATX_DIOALIGN`), which route each read/write takes (direct, bounce
//! buffer, or buffered), how write-zeroes and discard map to `fallocate`,
//! and the data/hole map from `SEEK_DATA`/`SEEK_HOLE`, as the kernel's loop
//! driver maps a bio to its backing file (`lo_rw_aio`, `lo_fallocate`).

use super::options::FileOptions;
use crate::error::FileError;
use blkstack_core::device::Extent;
use blkstack_core::{AlignedBuf, Bio, BioFlags, Op, Status};
use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Per-device counters shown by `status`.
#[derive(Default)]
pub(super) struct Stats {
    pub(super) reads: AtomicU64,
    pub(super) writes: AtomicU64,
    pub(super) flushes: AtomicU64,
    pub(super) discards: AtomicU64,
    pub(super) zeroes: AtomicU64,
    pub(super) errors: AtomicU64,
    /// Direct I/O whose memory was misaligned and went through a bounce buffer.
    pub(super) bounced: AtomicU64,
    /// Direct I/O whose offset/length was misaligned and went buffered.
    pub(super) buffered: AtomicU64,
    /// I/O completed on a polled ring.
    pub(super) polled: AtomicU64,
    /// I/O the polled ring refused and the interrupt ring redid.
    pub(super) poll_refused: AtomicU64,
    /// Write-zeroes done by writing zeroes (no ZERO_RANGE).
    pub(super) zeroes_written: AtomicU64,
}

impl Stats {
    pub(super) fn count(&self, bio: &Bio) {
        let c = match bio.op {
            Op::Read => &self.reads,
            Op::Write => &self.writes,
            Op::Flush => &self.flushes,
            Op::Discard => &self.discards,
            Op::WriteZeroes => &self.zeroes,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// The backing file, opened once buffered and (with `direct`) once more
/// with O_DIRECT.
pub(super) struct Files {
    pub(super) path: PathBuf,
    pub(super) buffered: File,
    pub(super) direct: Option<File>,
    /// O_DIRECT memory alignment (statx `stx_dio_mem_align`).
    pub(super) mem_align: usize,
    /// O_DIRECT file offset/length alignment (`stx_dio_offset_align`).
    pub(super) off_align: u64,
    pub(super) punch_hole: bool,
    /// Cleared when the filesystem refuses FALLOC_FL_ZERO_RANGE once.
    pub(super) zero_range: AtomicBool,
    pub(super) stats: Stats,
}

/// Where one read/write goes and through which memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Route {
    /// O_DIRECT with the bio's own memory.
    Direct,
    /// O_DIRECT through the slot's bounce buffer.
    Bounce,
    /// The buffered descriptor.
    Buffered,
}

impl Files {
    /// Open the backing file as the table line asks: a missing or shorter
    /// file is refused unless `create` (then created or extended sparsely,
    /// never shortened), and `direct` opens it a second time with O_DIRECT.
    pub(super) fn open(opts: &FileOptions, size: u64) -> Result<Files, FileError> {
        let path = &opts.path;
        if !path.exists() && !opts.create {
            return Err(FileError::NotFound { path: path.clone() });
        }
        if let Ok(m) = std::fs::metadata(path) {
            check_kind(path, m.file_type())?;
        }
        let buffered = OpenOptions::new()
            .read(true)
            .write(true)
            .create(opts.create)
            .open(path)
            .map_err(|e| FileError::io(path, "cannot open", e))?;
        let (current, is_blockdev) = current_len(path, &buffered)?;
        if current < size {
            if opts.create && !is_blockdev {
                buffered
                    .set_len(size)
                    .map_err(|e| FileError::io(path, "cannot extend", e))?;
            } else {
                return Err(FileError::TooSmall {
                    path: path.clone(),
                    current,
                    size,
                    block_device: is_blockdev,
                });
            }
        }
        let direct = if opts.direct {
            Some(open_direct(path)?)
        } else {
            None
        };
        let (mem_align, off_align) = dio_alignment(direct.as_ref().unwrap_or(&buffered));
        let punch_hole = probe_punch_hole(&buffered, current.max(size));
        Ok(Files {
            path: path.clone(),
            buffered,
            direct,
            mem_align,
            off_align,
            punch_hole,
            zero_range: AtomicBool::new(true),
            stats: Stats::default(),
        })
    }
}

fn check_kind(path: &Path, ft: std::fs::FileType) -> Result<(), FileError> {
    if !ft.is_file() && !ft.is_block_device() {
        return Err(FileError::NotFileOrBlockDevice {
            path: path.to_path_buf(),
        });
    }
    Ok(())
}

/// The bytes the open file holds (a block device's size from lseek), and
/// whether it is a block device.
fn current_len(path: &Path, f: &File) -> Result<(u64, bool), FileError> {
    let meta = f
        .metadata()
        .map_err(|e| FileError::io(path, "cannot stat", e))?;
    let ft = meta.file_type();
    check_kind(path, ft)?;
    if !ft.is_block_device() {
        return Ok((meta.len(), false));
    }
    // SAFETY: lseek on an open descriptor.
    let end = unsafe { libc::lseek(f.as_raw_fd(), 0, libc::SEEK_END) };
    if end < 0 {
        return Err(FileError::io(
            path,
            "cannot size",
            std::io::Error::last_os_error(),
        ));
    }
    Ok((end as u64, true))
}

/// The O_DIRECT descriptor; a filesystem that refuses O_DIRECT (EINVAL,
/// e.g. tmpfs on older kernels) gets an error saying to drop `direct`.
fn open_direct(path: &Path) -> Result<File, FileError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::EINVAL) {
                FileError::DirectRefused {
                    path: path.to_path_buf(),
                    source: e,
                }
            } else {
                FileError::io(path, "cannot open (O_DIRECT)", e)
            }
        })
}

impl Files {
    pub(super) fn route(&self, bio: &Bio) -> Route {
        if self.direct.is_none() {
            return Route::Buffered;
        }
        if !bio.offset.is_multiple_of(self.off_align) || !bio.len.is_multiple_of(self.off_align) {
            return Route::Buffered;
        }
        if !(bio.buf.as_ptr() as usize).is_multiple_of(self.mem_align) {
            return Route::Bounce;
        }
        Route::Direct
    }

    pub(super) fn fd_for(&self, route: Route) -> RawFd {
        match (route, &self.direct) {
            (Route::Direct | Route::Bounce, Some(d)) => d.as_raw_fd(),
            _ => self.buffered.as_raw_fd(),
        }
    }

    pub(super) fn zero_mode(&self, flags: BioFlags) -> i32 {
        if flags.contains(BioFlags::NOUNMAP) || !self.punch_hole {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        }
    }

    /// Write-zeroes without fallocate: write zero pages through the
    /// buffered descriptor. Slow, so a FAST_ZERO request is refused.
    pub(super) fn write_zeroes_by_writing(&self, bio: &Bio) -> Status {
        if bio.flags.contains(BioFlags::FAST_ZERO) {
            return Status::Again;
        }
        static ZEROES: [u8; 64 << 10] = [0; 64 << 10];
        self.stats.zeroes_written.fetch_add(1, Ordering::Relaxed);
        let fd = self.buffered.as_raw_fd();
        let mut off = bio.offset;
        let end = bio.offset + bio.len;
        while off < end {
            let n = (end - off).min(ZEROES.len() as u64) as usize;
            // SAFETY: ZEROES is a valid buffer of at least n bytes.
            let r = unsafe { libc::pwrite(fd, ZEROES.as_ptr().cast(), n, off as libc::off_t) };
            if r < 0 {
                let e = errno();
                if e == libc::EINTR {
                    continue;
                }
                return Status::from_errno(e);
            }
            off += r as u64;
        }
        if bio.flags.contains(BioFlags::FUA) {
            // SAFETY: plain syscall on an open descriptor.
            if unsafe { libc::fdatasync(fd) } < 0 {
                return Status::from_errno(errno());
            }
        }
        Status::Ok
    }

    /// What a fallocate result means for the bio: a write-zeroes the
    /// filesystem cannot do with fallocate is done by writing zeroes.
    pub(super) fn after_fallocate(&self, bio: &Bio, st: Status) -> Status {
        if bio.op == Op::WriteZeroes && st == Status::NotSupported {
            self.zero_range.store(false, Ordering::Relaxed);
            return self.write_zeroes_by_writing(bio);
        }
        if st.is_ok() && bio.op == Op::WriteZeroes && bio.flags.contains(BioFlags::FUA) {
            // SAFETY: plain syscall on an open descriptor.
            if unsafe { libc::fdatasync(self.buffered.as_raw_fd()) } < 0 {
                return Status::from_errno(errno());
            }
        }
        st
    }

    pub(super) fn count_route(&self, route: Route) {
        match route {
            Route::Bounce => self.stats.bounced.fetch_add(1, Ordering::Relaxed),
            Route::Buffered if self.direct.is_some() => {
                self.stats.buffered.fetch_add(1, Ordering::Relaxed)
            }
            _ => 0,
        };
    }

    /// Data and holes of `offset..end` from SEEK_DATA/SEEK_HOLE.
    pub(super) fn extents(&self, offset: u64, end: u64) -> Option<Vec<Extent>> {
        let fd = self.buffered.as_raw_fd();
        let mut out: Vec<Extent> = Vec::new();
        let mut push = |off: u64, l: u64, hole: bool| {
            if l == 0 {
                return;
            }
            match out.last_mut() {
                Some(last) if last.hole == hole && last.offset + last.len == off => last.len += l,
                _ => out.push(Extent {
                    offset: off,
                    len: l,
                    hole,
                }),
            }
        };
        let mut pos = offset;
        while pos < end {
            // SAFETY: lseek on an open descriptor; I/O never uses the file
            // position, so moving it is harmless.
            let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
            if data < 0 {
                if errno() == libc::ENXIO {
                    push(pos, end - pos, true);
                    break;
                }
                return None;
            }
            let data = (data as u64).min(end);
            if data > pos {
                push(pos, data - pos, true);
                pos = data;
                continue;
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_HOLE) };
            if hole < 0 {
                return None;
            }
            let hole = (hole as u64).min(end).max(pos + 1);
            push(pos, hole - pos, false);
            pos = hole;
        }
        Some(out)
    }
}

pub(super) fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// A bounce buffer of at least `len` bytes, reusing the one kept.
pub(super) fn ensure_bounce(bounce: &mut Option<AlignedBuf>, len: usize) -> &mut AlignedBuf {
    if bounce.as_ref().is_none_or(|b| b.len() < len) {
        *bounce = Some(AlignedBuf::new(len));
    }
    bounce.as_mut().expect("bounce buffer just ensured")
}

/// O_DIRECT alignment of memory and of file offsets (statx
/// STATX_DIOALIGN, Linux 6.1); 4096 for both when the kernel does not say.
fn dio_alignment(f: &File) -> (usize, u64) {
    // SAFETY: a zeroed statx is a valid out-parameter.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let empty = c"";
    // SAFETY: valid fd, empty path with AT_EMPTY_PATH, valid out pointer.
    let r = unsafe {
        libc::statx(
            f.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if r == 0
        && stx.stx_mask & libc::STATX_DIOALIGN != 0
        && stx.stx_dio_mem_align != 0
        && stx.stx_dio_offset_align != 0
    {
        (
            stx.stx_dio_mem_align as usize,
            stx.stx_dio_offset_align as u64,
        )
    } else {
        (4096, 4096)
    }
}

/// Can this filesystem punch holes? Punching past the end of the file
/// with KEEP_SIZE changes nothing, and fails with EOPNOTSUPP where
/// unsupported.
fn probe_punch_hole(f: &File, end: u64) -> bool {
    let at = end.next_multiple_of(4096);
    // SAFETY: plain syscall on an open descriptor.
    let r = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            at as libc::off_t,
            4096,
        )
    };
    r == 0 || errno() != libc::EOPNOTSUPP
}
