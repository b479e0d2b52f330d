//! One device presented as `/dev/ublkbN`: adding it (or taking over the
//! one a killed server left, `UBLK_F_USER_RECOVERY`), its queue threads,
//! and its end. Follows the device life cycle of
//! drivers/block/ublk_drv.c: ADD_DEV, SET_PARAMS, queues fetching,
//! START_DEV; STOP_DEV and DEL_DEV at the end; START_USER_RECOVERY and
//! END_USER_RECOVERY for a device whose server died (the kernel keeps it
//! quiesced, its I/O queued, until a new server ends the recovery).
//!
//! A server finds "its" device after a restart by the export name it
//! wrote into the device's record ([`RUN_DIR`]/N.json, next to the
//! server's pid) and by that server being gone: a live server's device is
//! never taken.
//!
//! Taking a device over waits, bounded, until the kernel has quiesced it
//! (`UBLK_S_DEV_QUIESCED`, set by `ublk_quiesce_work_fn` once the dead
//! server's rings are gone) and then a little longer: in 6.12's
//! ublk_drv.c that work item cancels every active command *after* it
//! drops the device mutex (`ublk_cancel_dev`), so a new server whose
//! FETCH commands land in that window has them aborted and the device
//! goes live with no one fetching its requests. START_USER_RECOVERY
//! answers EBUSY while the old server's /dev/ublkcN is still open; that
//! is waited out too, and a device that never gets there is a clear
//! error rather than a start that goes on without it.
//!
//! START_DEV (and END_USER_RECOVERY) is sent only once every queue has
//! its fetches with the kernel, which is what the driver waits for: a
//! queue that cannot be set up fails the start at once, and the device
//! is stopped and deleted instead of left waiting for it.

use crate::ctrl::{cdev_path, Control, Dev};
use crate::error::{check_control, Errno, UblkError, CONTROL_PATH};
use crate::options::UblkOptions;
use crate::params::{ublk_params, Geometry};
use crate::queue::{self, QueueSpec, QueueStartError};
use crate::uapi::{self, ublksrv_ctrl_dev_info};
use blkstack_core::DeviceRef;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Where each device's record (export name, server pid) lives, as
/// `N.json` for /dev/ublkbN. A tmpfs: records do not outlive a boot, and
/// neither do the devices.
pub const RUN_DIR: &str = "/run/blkstack/ublk";
/// How long the kernel may take to answer START_DEV (or
/// END_USER_RECOVERY) once the queues are fetching: it scans partitions.
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// How long every queue may take to set itself up and fetch.
const QUEUES_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a takeover waits for the kernel to quiesce the device a
/// killed server left and to let go of that server's /dev/ublkcN.
const RECOVER_WAIT: Duration = Duration::from_secs(90);
/// How long the device must have been quiesced before it is taken: the
/// quiesce work still cancels commands just after it sets the state.
const RECOVER_SETTLE: Duration = Duration::from_millis(500);
/// Between two looks at the left-behind device.
const RECOVER_POLL: Duration = Duration::from_millis(100);
/// How long a new /dev/ublkcN may take to appear (devtmpfs, or udev).
const CDEV_WAIT: Duration = Duration::from_secs(3);
/// How long a stopped device's queues may take to end: their drain and
/// a margin for the kernel's abort.
const QUEUES_EXIT_WAIT: Duration = Duration::from_secs(queue::DRAIN_LIMIT.as_secs() + 45);
/// The per-tag buffer a device may ask of us (`UBLK_IO_BUF_BITS`: 32 MiB).
const MAX_IO_BUF_BYTES: u32 = 32 << 20;

/// A running ublk device serving one of our devices.
pub struct UblkExport {
    pub name: String,
    pub dev_id: u32,
    pub read_only: bool,
    /// Whether it was taken over from a killed server.
    pub recovered: bool,
    dev: Dev,
    /// Set before the device is stopped on purpose, so a queue ending
    /// then is not taken for a queue that died.
    stopping: Arc<AtomicBool>,
    queues: Vec<JoinHandle<()>>,
    live: bool,
}

fn kernel<'a>(name: &'a str, what: &'static str) -> impl FnOnce(Errno) -> UblkError + 'a {
    move |errno| UblkError::Kernel {
        name: name.to_string(),
        what,
        errno,
    }
}

fn invalid(name: &str, what: String) -> UblkError {
    UblkError::Invalid {
        name: name.into(),
        what,
    }
}

fn record_path(id: u32) -> PathBuf {
    Path::new(RUN_DIR).join(format!("{id}.json"))
}

/// Write device `id`'s record: written whole to a temporary file and
/// renamed, so a server killed meanwhile leaves the old record or the
/// new, never half of one.
fn write_record(name: &str, id: u32) -> std::io::Result<()> {
    std::fs::create_dir_all(RUN_DIR)?;
    let body = serde_json::json!({
        "export": name,
        "pid": std::process::id(),
        "dev_id": id,
    });
    let tmp = Path::new(RUN_DIR).join(format!(".{id}.json.{}", std::process::id()));
    std::fs::write(&tmp, body.to_string())?;
    std::fs::rename(&tmp, record_path(id)).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// The export name and server pid device `id`'s record holds, if it has
/// a readable one.
fn read_record(id: u32) -> Option<(String, i64)> {
    let text = std::fs::read_to_string(record_path(id)).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let name = v.get("export")?.as_str()?.to_string();
    let pid = v.get("pid")?.as_i64()?;
    Some((name, pid))
}

/// A device left by a dead server for export `name`, if any; an error if
/// a live server other than us holds one of that name.
fn find_left_behind(name: &str) -> Result<Option<u32>, UblkError> {
    let Ok(dir) = std::fs::read_dir("/sys/class/ublk-char") else {
        return Ok(None);
    };
    let mut ctl = Control::open().map_err(kernel(name, "opening /dev/ublk-control"))?;
    for entry in dir.flatten() {
        let file = entry.file_name();
        let Some(id) = file
            .to_str()
            .and_then(|s| s.strip_prefix("ublkc"))
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Some((export, pid)) = read_record(id) else {
            continue;
        };
        if export != name {
            continue;
        }
        let Ok(info) = ctl.dev_info(id) else {
            continue;
        };
        // A record left by a device since deleted, its id now someone
        // else's: the device names another server.
        if i64::from(info.ublksrv_pid) != pid && info.ublksrv_pid > 0 {
            continue;
        }
        if info.flags & uapi::UBLK_F_USER_RECOVERY == 0 {
            continue;
        }
        let pid = info.ublksrv_pid;
        // SAFETY: kill with signal 0 only checks for the process.
        let alive =
            pid > 0 && pid != std::process::id() as i32 && unsafe { libc::kill(pid, 0) } == 0;
        if alive && info.state == uapi::UBLK_S_DEV_LIVE {
            return Err(invalid(
                name,
                format!("/dev/ublkb{id} already serves it, from live process {pid}"),
            ));
        }
        return Ok(Some(id));
    }
    Ok(None)
}

fn state_name(state: u16) -> &'static str {
    match state {
        uapi::UBLK_S_DEV_DEAD => "DEAD",
        uapi::UBLK_S_DEV_LIVE => "LIVE",
        uapi::UBLK_S_DEV_QUIESCED => "QUIESCED",
        _ => "in an unknown state",
    }
}

/// Start the recovery of device `id` (START_USER_RECOVERY) once the
/// kernel has quiesced it and released its dead server; bounded by
/// [`RECOVER_WAIT`]. Returns the device as the kernel has it: a
/// recovered device keeps its queues, depth and buffer size.
fn take_over(ctl: &mut Control, name: &str, id: u32) -> Result<ublksrv_ctrl_dev_info, UblkError> {
    let t0 = Instant::now();
    let mut quiesced_since: Option<Instant> = None;
    let mut state = uapi::UBLK_S_DEV_LIVE;
    while t0.elapsed() < RECOVER_WAIT {
        let info = ctl.dev_info(id).map_err(kernel(name, "GET_DEV_INFO"))?;
        state = info.state;
        match state {
            uapi::UBLK_S_DEV_QUIESCED => {
                let since = *quiesced_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= RECOVER_SETTLE {
                    // EBUSY: the old /dev/ublkcN is still open.
                    match ctl.start_user_recovery(&Dev::of(&info)) {
                        Ok(()) => return Ok(info),
                        Err(Errno(libc::EBUSY)) => {}
                        Err(e) => return Err(kernel(name, "START_USER_RECOVERY")(e)),
                    }
                }
            }
            uapi::UBLK_S_DEV_DEAD => break,
            // LIVE: the kernel has not seen the old server's rings go yet.
            _ => quiesced_since = None,
        }
        std::thread::sleep(RECOVER_POLL);
    }
    Err(invalid(
        name,
        format!(
            "/dev/ublkb{id}, left by a killed server, is {} after {:?} (the kernel \
             has not released it for recovery); its queued I/O waits",
            state_name(state),
            t0.elapsed()
        ),
    ))
}

/// Open /dev/ublkcN, which may appear a little after ADD_DEV (bounded).
fn open_cdev(name: &str, id: u32) -> Result<Arc<OwnedFd>, UblkError> {
    let path = cdev_path(id);
    let t0 = Instant::now();
    loop {
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
        {
            Ok(f) => return Ok(Arc::new(OwnedFd::from(f))),
            Err(e) if t0.elapsed() >= CDEV_WAIT => {
                return Err(UblkError::Io {
                    name: name.into(),
                    what: "opening the device's /dev/ublkcN",
                    source: e,
                })
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// STOP_DEV from a thread of its own: a queue that died calls this on
/// its way out, and the kernel finishes the stop only once that queue's
/// ring is gone, which is when the queue's thread ends.
fn fail_stop(dev: Dev) {
    let _ = std::thread::Builder::new()
        .name("ublk-failstop".into())
        .spawn(move || {
            if let Err(e) = Control::open().and_then(|mut c| c.stop_dev(&dev)) {
                tracing::error!(dev_id = dev.id, "ublk: fail-stop STOP_DEV: {e}");
            }
        });
}

/// One queue's thread: serve until the device stops. A queue that ends
/// while the export is not being stopped (a ring error, a panic below)
/// would leave its requests waiting for a server that is still alive, for
/// ever (the kernel quiesces the device once the queue's ring goes and
/// waits for a recovery): the device is stopped instead, so its I/O fails
/// rather than hangs.
fn serve_queue(
    spec: QueueSpec,
    dev: Dev,
    cdev: Arc<OwnedFd>,
    target: DeviceRef,
    ready: mpsc::Sender<Result<(), QueueStartError>>,
    stopping: Arc<AtomicBool>,
) {
    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        queue::run(spec, cdev.as_raw_fd(), target, |r| {
            let _ = ready.send(r);
        })
    }))
    .unwrap_or(true);
    // The char device closes with the last queue, after its ring.
    drop(cdev);
    if served && !stopping.load(Ordering::Acquire) {
        tracing::error!(
            dev_id = dev.id,
            qid = spec.qid,
            "ublk: a queue ended while the device is live; stopping the device so its I/O fails instead of waiting"
        );
        fail_stop(dev);
    }
}

/// A thread per queue of `info`, each fetching from `cdev`; what each
/// makes of its setup comes on the returned channel.
fn spawn_queues(
    name: &str,
    info: &ublksrv_ctrl_dev_info,
    cdev: &Arc<OwnedFd>,
    target: &DeviceRef,
    stopping: &Arc<AtomicBool>,
) -> (
    Vec<JoinHandle<()>>,
    mpsc::Receiver<Result<(), QueueStartError>>,
) {
    let (tx, rx) = mpsc::channel();
    let dev = Dev::of(info);
    let mut threads = Vec::with_capacity(info.nr_hw_queues as usize);
    for qid in 0..info.nr_hw_queues {
        let spec = QueueSpec {
            dev_id: info.dev_id,
            qid,
            depth: info.queue_depth,
            io_buf_bytes: info.max_io_buf_bytes,
        };
        let (cdev, target, tx2, stopping) =
            (cdev.clone(), target.clone(), tx.clone(), stopping.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("ublk-{name}-q{qid}"))
            .spawn(move || serve_queue(spec, dev, cdev, target, tx2, stopping));
        match spawned {
            Ok(t) => threads.push(t),
            Err(e) => {
                let _ = tx.send(Err(QueueStartError::Spawn { qid, err: e }));
            }
        }
    }
    (threads, rx)
}

/// Wait (bounded) until `n` queues have said they are fetching; the
/// first that could not, or the bound, is the error.
fn queues_ready(
    rx: &mpsc::Receiver<Result<(), QueueStartError>>,
    n: u16,
) -> Result<(), QueueStartError> {
    let deadline = Instant::now() + QUEUES_READY_TIMEOUT;
    for _ in 0..n {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Ok(())) => {}
            Ok(Err(why)) => return Err(why),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                return Err(QueueStartError::Timeout(QUEUES_READY_TIMEOUT))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(QueueStartError::ThreadEnded),
        }
    }
    Ok(())
}

/// Wait for `threads` to end, bounded; those that do not are left
/// running (and said).
fn join_bounded(name: &str, threads: Vec<JoinHandle<()>>) -> bool {
    let t0 = Instant::now();
    let mut pause = Duration::from_millis(1);
    while threads.iter().any(|t| !t.is_finished()) {
        if t0.elapsed() > QUEUES_EXIT_WAIT {
            tracing::error!(
                export = name,
                "ublk: a queue did not end {QUEUES_EXIT_WAIT:?} after the stop; leaving it"
            );
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
    for t in threads {
        let _ = t.join();
    }
    true
}

/// The end of a device: STOP_DEV (its fetches are aborted, the queues
/// drain and end), then DEL_DEV and its record.
fn end_device(
    name: &str,
    ctl: &mut Control,
    dev: &Dev,
    stopping: &AtomicBool,
    threads: Vec<JoinHandle<()>>,
) {
    stopping.store(true, Ordering::Release);
    if let Err(e) = ctl.stop_dev(dev) {
        tracing::warn!(export = name, "ublk STOP_DEV: {e}");
    }
    join_bounded(name, threads);
    if let Err(e) = ctl.del_dev(dev) {
        tracing::debug!(export = name, "ublk DEL_DEV: {e}");
    }
    let _ = std::fs::remove_file(record_path(dev.id));
}

/// ADD_DEV for a new device (its parameters follow once its char
/// device is open, see [`UblkExport::serve`]).
fn add_device(
    ctl: &mut Control,
    name: &str,
    opts: &UblkOptions,
    (queues, depth): (u16, u16),
) -> Result<ublksrv_ctrl_dev_info, UblkError> {
    let want = ublksrv_ctrl_dev_info {
        nr_hw_queues: queues,
        queue_depth: depth,
        max_io_buf_bytes: opts.io_buf_bytes,
        dev_id: u32::MAX,
        ublksrv_pid: std::process::id() as i32,
        flags: opts.ctrl_flags(),
        ..Default::default()
    };
    ctl.add_dev(want).map_err(kernel(name, "ADD_DEV"))
}

/// What the kernel says of a device we are to serve, checked before it
/// sizes threads and mappings.
fn check_shape(name: &str, info: &ublksrv_ctrl_dev_info) -> Result<(), UblkError> {
    let ok = (1..=uapi::UBLK_MAX_NR_QUEUES).contains(&info.nr_hw_queues)
        && (1..=uapi::UBLK_MAX_QUEUE_DEPTH).contains(&info.queue_depth)
        && (4096..=MAX_IO_BUF_BYTES).contains(&info.max_io_buf_bytes);
    if ok {
        Ok(())
    } else {
        Err(invalid(
            name,
            format!(
                "/dev/ublkb{} has {} queue(s) of depth {} with {}-byte buffers, \
                 beyond what a ublk server can serve",
                info.dev_id, info.nr_hw_queues, info.queue_depth, info.max_io_buf_bytes
            ),
        ))
    }
}

impl UblkExport {
    /// Present `dev` as a ublk device, or take over the one a killed
    /// server left for `name`. Returns once `/dev/ublkbN` exists.
    pub fn start(
        name: &str,
        dev: DeviceRef,
        read_only: bool,
        opts: &UblkOptions,
    ) -> Result<UblkExport, UblkError> {
        let options = |what| UblkError::Options {
            name: name.into(),
            what,
        };
        opts.validate().map_err(options)?;
        let shape = opts.queues_and_depth(dev.queue_shape()).map_err(options)?;
        check_control(Path::new(CONTROL_PATH))?;
        let geo = Geometry::of(&*dev);
        let params =
            ublk_params(&geo, opts.io_buf_bytes, read_only).map_err(|what| UblkError::Params {
                name: name.into(),
                what,
            })?;
        let left = if opts.ctrl_flags() & uapi::UBLK_F_USER_RECOVERY != 0 {
            find_left_behind(name)?
        } else {
            None
        };
        let mut ctl = Control::open().map_err(kernel(name, "opening /dev/ublk-control"))?;
        let info = match left {
            Some(id) => {
                let info = take_over(&mut ctl, name, id)?;
                if (info.nr_hw_queues, info.queue_depth) != shape {
                    tracing::info!(
                        export = name,
                        "ublk: the taken-over device keeps its {} queue(s) of depth {} \
                         (the stack now offers {} of {})",
                        info.nr_hw_queues,
                        info.queue_depth,
                        shape.0,
                        shape.1
                    );
                }
                tracing::info!(
                    export = name,
                    dev_id = id,
                    "ublk: taking over the device a killed server left"
                );
                info
            }
            None => add_device(&mut ctl, name, opts, shape)?,
        };
        let d = Dev::of(&info);
        let stopping = Arc::new(AtomicBool::new(false));
        let params = left.is_none().then_some(&params);
        let started = Self::serve(name, &mut ctl, &info, params, dev, &stopping);
        let queues = match started {
            Ok(q) => q,
            Err((e, threads)) => {
                end_device(name, &mut ctl, &d, &stopping, threads);
                return Err(e);
            }
        };
        Ok(UblkExport {
            name: name.to_string(),
            dev_id: info.dev_id,
            read_only: read_only || geo.features.read_only,
            recovered: left.is_some(),
            dev: d,
            stopping,
            queues,
            live: true,
        })
    }

    /// The record, the char device, SET_PARAMS (a new device's `params`;
    /// a device taken over keeps its own), the queues, and START_DEV
    /// (END_USER_RECOVERY for a device taken over). On failure, the queue
    /// threads come back with the error for the caller to end.
    ///
    /// The char device is opened before SET_PARAMS, as libublk and
    /// ublksrv do: for an unprivileged device the driver checks that the
    /// caller may open it, which holds only once udev has given the new
    /// node to its owner, and the open waits for that (bounded).
    #[allow(clippy::type_complexity)]
    fn serve(
        name: &str,
        ctl: &mut Control,
        info: &ublksrv_ctrl_dev_info,
        params: Option<&uapi::ublk_params>,
        dev: DeviceRef,
        stopping: &Arc<AtomicBool>,
    ) -> Result<Vec<JoinHandle<()>>, (UblkError, Vec<JoinHandle<()>>)> {
        let d = Dev::of(info);
        check_shape(name, info).map_err(|e| (e, Vec::new()))?;
        // Only a restarted server reads the record back, and only with
        // recovery, which an unprivileged device has not: where the
        // directory is closed to us that costs nothing.
        if let Err(e) = write_record(name, d.id) {
            if info.flags & uapi::UBLK_F_USER_RECOVERY != 0 {
                tracing::warn!(
                    export = name,
                    "ublk: cannot record the device in {RUN_DIR} ({e}); a restarted server \
                     will not find it to take it over"
                );
            } else {
                tracing::debug!(export = name, "ublk: no record in {RUN_DIR}: {e}");
            }
        }
        let cdev = open_cdev(name, d.id).map_err(|e| (e, Vec::new()))?;
        if let Some(p) = params {
            ctl.set_params(&d, p)
                .map_err(|e| (kernel(name, "SET_PARAMS")(e), Vec::new()))?;
        }
        let (threads, ready) = spawn_queues(name, info, &cdev, &dev, stopping);
        // The queues hold the char device from here: it closes with them.
        drop(cdev);
        if let Err(what) = queues_ready(&ready, info.nr_hw_queues) {
            let e = UblkError::Queues {
                name: name.into(),
                what,
            };
            return Err((e, threads));
        }
        let r = if params.is_none() {
            ctl.end_user_recovery(&d, START_TIMEOUT)
                .map_err(kernel(name, "END_USER_RECOVERY"))
        } else {
            ctl.start_dev(&d, START_TIMEOUT)
                .map_err(kernel(name, "START_DEV"))
        };
        match r {
            Ok(()) => Ok(threads),
            Err(e) => Err((e, threads)),
        }
    }

    /// The block device the kernel made.
    pub fn block_device(&self) -> String {
        format!("/dev/ublkb{}", self.dev_id)
    }

    /// End the device: the kernel stops it (its queued and new I/O fail,
    /// openers see the disk go), our queues drain, then it is deleted.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        self.live = false;
        let threads = std::mem::take(&mut self.queues);
        match Control::open() {
            Ok(mut ctl) => end_device(&self.name, &mut ctl, &self.dev, &self.stopping, threads),
            Err(e) => {
                self.stopping.store(true, Ordering::Release);
                tracing::error!(export = %self.name, "ublk: no control node to stop the device with: {e}");
            }
        }
    }
}

impl Drop for UblkExport {
    fn drop(&mut self) {
        if self.live {
            self.stop_inner();
        }
    }
}
