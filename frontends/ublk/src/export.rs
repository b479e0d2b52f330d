//! One device presented as `/dev/ublkbN`: adding it (or taking over the
//! one a killed server left, `UBLK_F_USER_RECOVERY`), its queue threads,
//! and its end. Follows the device life cycle of
//! drivers/block/ublk_drv.c: ADD_DEV, SET_PARAMS, queues fetching,
//! START_DEV; STOP_DEV and DEL_DEV at the end; START_USER_RECOVERY and
//! END_USER_RECOVERY for a device whose server died (the kernel keeps it
//! quiesced, its I/O queued, until a new server ends the recovery).
//!
//! A server finds "its" device after a restart by the export name it
//! wrote into the device's libublk json (/run/ublksrvd/N.json) and by the
//! device's server pid being gone: a live server's device is never
//! taken.
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
//! error rather than a start that goes on without it. A queue that
//! cannot be set up fails the start at once instead of leaving the
//! kernel waiting for its fetches.

use crate::error::{check_control, UblkError, CONTROL_PATH};
use crate::options::UblkOptions;
use crate::params::{ublk_params, Geometry};
use crate::queue;
use blkstack_core::DeviceRef;
use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::{sys, UblkFlags};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The key under libublk's `target_data` naming the export.
const NAME_KEY: &str = "blkstack_export";
/// libublk's target type in the device json.
const TARGET_TYPE: &str = "blkstack";
/// How long starting a device may take once its queues are set up (the
/// kernel waits for every queue's fetch commands).
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// How long a takeover waits for the kernel to quiesce the device a
/// killed server left and to let go of that server's /dev/ublkcN.
const RECOVER_WAIT: Duration = Duration::from_secs(90);
/// How long the device must have been quiesced before it is taken: the
/// quiesce work still cancels commands just after it sets the state.
const RECOVER_SETTLE: Duration = Duration::from_millis(500);
/// Between two looks at the left-behind device.
const RECOVER_POLL: Duration = Duration::from_millis(100);

/// What the device's thread reports to the starter.
enum Started {
    /// The device is live (or taken over) as /dev/ublkbN.
    Live(u32),
    /// A queue could not be set up: the kernel would wait for its fetches
    /// for ever.
    QueueFailed(String),
    /// libublk's start failed.
    Failed(libublk::UblkError),
}

/// A running ublk device serving one of our devices.
pub struct UblkExport {
    pub name: String,
    pub dev_id: u32,
    pub read_only: bool,
    /// Whether it was taken over from a killed server.
    pub recovered: bool,
    ctrl: Arc<UblkCtrl>,
    /// Set before the device is stopped on purpose, so a queue ending
    /// then is not taken for a queue that died.
    stopping: Arc<AtomicBool>,
    server: Option<JoinHandle<()>>,
}

fn kernel<'a>(
    name: &'a str,
    what: &'static str,
) -> impl FnOnce(libublk::UblkError) -> UblkError + 'a {
    move |source| UblkError::Kernel {
        name: name.to_string(),
        what,
        source,
    }
}

/// libublk keeps its control ring per thread: every thread that sends
/// control commands (start, stop, delete, and the drop that deletes)
/// makes its own first.
fn ensure_ctrl_ring() -> Result<(), libublk::UblkError> {
    libublk::ublk_init_ctrl_task_ring(|ring| {
        if ring.is_none() {
            *ring = Some(
                io_uring::IoUring::<io_uring::squeue::Entry128>::builder()
                    .build(16)
                    .map_err(libublk::UblkError::IOError)?,
            );
        }
        Ok(())
    })
}

/// A device left by a dead server for export `name`, if any; an error if
/// a live server other than us holds one of that name.
fn find_left_behind(name: &str) -> Result<Option<u32>, UblkError> {
    let Ok(dir) = std::fs::read_dir("/sys/class/ublk-char") else {
        return Ok(None);
    };
    for entry in dir.flatten() {
        let file = entry.file_name();
        let Some(id) = file
            .to_str()
            .and_then(|s| s.strip_prefix("ublkc"))
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(c) = UblkCtrl::new_simple(id as i32) else {
            continue;
        };
        let ours = c
            .get_target_data_from_json()
            .and_then(|v| v.get(NAME_KEY).and_then(|n| n.as_str().map(|s| s == name)))
            .unwrap_or(false);
        if !ours {
            continue;
        }
        let info = c.dev_info();
        let pid = info.ublksrv_pid;
        // SAFETY: kill with signal 0 only checks for the process.
        let alive =
            pid > 0 && pid != std::process::id() as i32 && unsafe { libc::kill(pid, 0) } == 0;
        if info.flags & sys::UBLK_F_USER_RECOVERY as u64 == 0 {
            continue;
        }
        if alive && info.state == sys::UBLK_S_DEV_LIVE as u16 {
            return Err(UblkError::Invalid {
                name: name.into(),
                what: format!("/dev/ublkb{id} already serves it, from live process {pid}"),
            });
        }
        return Ok(Some(id));
    }
    Ok(None)
}

fn state_name(state: u16) -> &'static str {
    match state as u32 {
        sys::UBLK_S_DEV_DEAD => "DEAD",
        sys::UBLK_S_DEV_LIVE => "LIVE",
        sys::UBLK_S_DEV_QUIESCED => "QUIESCED",
        _ => "in an unknown state",
    }
}

/// Start the recovery of device `id` (START_USER_RECOVERY) once the
/// kernel has quiesced it and released its dead server; bounded by
/// [`RECOVER_WAIT`]. Returns the device's queues and depth, which a
/// recovered device keeps.
fn take_over(name: &str, id: u32) -> Result<(u16, u16), UblkError> {
    let t0 = Instant::now();
    let mut quiesced_since: Option<Instant> = None;
    let mut state = sys::UBLK_S_DEV_LIVE as u16;
    while t0.elapsed() < RECOVER_WAIT {
        let c = UblkCtrl::new_simple(id as i32).map_err(kernel(name, "GET_DEV_INFO"))?;
        let info = c.dev_info();
        state = info.state;
        match state as u32 {
            sys::UBLK_S_DEV_QUIESCED => {
                let since = *quiesced_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= RECOVER_SETTLE {
                    // libublk retries EBUSY (the old /dev/ublkcN still
                    // open) for a while and then answers it as a value.
                    match c.start_user_recover() {
                        Ok(r) if r >= 0 => return Ok((info.nr_hw_queues, info.queue_depth)),
                        Ok(r) if r == -libc::EBUSY => {}
                        Ok(r) => {
                            return Err(kernel(name, "START_USER_RECOVERY")(
                                libublk::UblkError::UringIOError(r),
                            ))
                        }
                        Err(e) => return Err(kernel(name, "START_USER_RECOVERY")(e)),
                    }
                }
            }
            sys::UBLK_S_DEV_DEAD => break,
            // LIVE: the kernel has not seen the old server's rings go yet.
            _ => quiesced_since = None,
        }
        std::thread::sleep(RECOVER_POLL);
    }
    Err(UblkError::Invalid {
        name: name.into(),
        what: format!(
            "/dev/ublkb{id}, left by a killed server, is {} after {:?} (the kernel \
             has not released it for recovery); its queued I/O waits",
            state_name(state),
            t0.elapsed()
        ),
    })
}

/// One queue's thread, as libublk's `run_target` calls it: serve until the
/// device stops. A queue that ends while the export is not being stopped
/// (a ring error, a panic below) would leave its requests waiting for a
/// server that is still alive, for ever (the kernel quiesces the device
/// once the queue's ring goes and waits for a recovery): the device is
/// stopped instead, so its I/O fails rather than hangs. The stop is sent
/// from another thread: the kernel finishes it only once this queue's
/// ring is gone, which is when this thread ends.
fn serve_queue(
    qid: u16,
    d: &libublk::io::UblkDev,
    dev: DeviceRef,
    tx: &mpsc::Sender<Started>,
    ctrl: &Arc<UblkCtrl>,
    stopping: &Arc<AtomicBool>,
) {
    let failed = tx.clone();
    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        queue::run(qid, d, dev, move |why| {
            let _ = failed.send(Started::QueueFailed(why));
        })
    }))
    .unwrap_or(true);
    if served && !stopping.load(Ordering::Acquire) {
        tracing::error!(
            dev_id = d.dev_info.dev_id,
            qid,
            "ublk: a queue ended while the device is live; stopping the device so its I/O fails instead of waiting"
        );
        let ctrl = ctrl.clone();
        let _ = std::thread::Builder::new()
            .name("ublk-failstop".into())
            .spawn(move || {
                if ensure_ctrl_ring().is_ok() {
                    let _ = ctrl.kill_dev();
                }
            });
    }
}

/// The device's thread: libublk's `run_target` (queues, START_DEV or
/// END_USER_RECOVERY) with our queues; what happens goes to `tx`.
fn spawn_server(
    name: &str,
    ctrl: &Arc<UblkCtrl>,
    dev: DeviceRef,
    geo: Geometry,
    params: sys::ublk_params,
    tx: mpsc::Sender<Started>,
    stopping: &Arc<AtomicBool>,
) -> Result<JoinHandle<()>, UblkError> {
    let ctrl = ctrl.clone();
    let stopping_q = stopping.clone();
    let export = name.to_string();
    let tx_fail = tx.clone();
    std::thread::Builder::new()
        .name(format!("ublk-{name}"))
        .spawn(move || {
            if let Err(e) = ensure_ctrl_ring() {
                let _ = tx_fail.send(Started::Failed(e));
                return;
            }
            let tx_queue = tx_fail.clone();
            let queue_ctrl = ctrl.clone();
            let depth = ctrl.dev_info().queue_depth;
            let run = std::panic::AssertUnwindSafe(|| {
                ctrl.run_target(
                    move |d| {
                        d.tgt.dev_size = geo.size;
                        d.tgt.params = params;
                        // One more slot per ring: the completion poll.
                        d.tgt.extra_ios = 1;
                        d.tgt.sq_depth = depth + 1;
                        d.tgt.cq_depth = depth + 1;
                        d.set_target_json(serde_json::json!({ NAME_KEY: export }));
                        Ok(())
                    },
                    move |qid, d| {
                        serve_queue(qid, d, dev.clone(), &tx_queue, &queue_ctrl, &stopping_q)
                    },
                    move |c| {
                        let _ = tx.send(Started::Live(c.dev_info().dev_id));
                    },
                )
            });
            match std::panic::catch_unwind(run) {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    let _ = tx_fail.send(Started::Failed(e));
                }
                Err(_) => {
                    let _ =
                        tx_fail.send(Started::Failed(libublk::UblkError::OtherError(-libc::EIO)));
                }
            }
        })
        .map_err(|source| UblkError::Io {
            name: name.into(),
            what: "spawning the device's thread",
            source,
        })
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
        opts.validate().map_err(|what| UblkError::Invalid {
            name: name.into(),
            what,
        })?;
        let (queues, depth) =
            opts.queues_and_depth(dev.queue_shape())
                .map_err(|what| UblkError::Invalid {
                    name: name.into(),
                    what,
                })?;
        check_control(Path::new(CONTROL_PATH))?;
        let geo = Geometry::of(&*dev);
        let params =
            ublk_params(&geo, opts.io_buf_bytes, read_only).map_err(|what| UblkError::Invalid {
                name: name.into(),
                what,
            })?;
        let left = if opts.ctrl_flags() & sys::UBLK_F_USER_RECOVERY as u64 != 0 {
            find_left_behind(name)?
        } else {
            None
        };
        let (id, dev_flags, queues, depth) = match left {
            Some(id) => {
                let (q, d) = take_over(name, id)?;
                if (q, d) != (queues, depth) {
                    tracing::info!(
                        export = name,
                        "ublk: the taken-over device keeps its {q} queue(s) of depth {d} \
                         (the stack now offers {queues} of {depth})"
                    );
                }
                tracing::info!(
                    export = name,
                    dev_id = id,
                    "ublk: taking over the device a killed server left"
                );
                (id as i32, UblkFlags::UBLK_DEV_F_RECOVER_DEV, q, d)
            }
            None => (-1, UblkFlags::UBLK_DEV_F_ADD_DEV, queues, depth),
        };
        let ctrl = UblkCtrlBuilder::default()
            .name(TARGET_TYPE)
            .id(id)
            .nr_queues(queues)
            .depth(depth)
            .io_buf_bytes(opts.io_buf_bytes)
            .ctrl_flags(opts.ctrl_flags())
            .dev_flags(dev_flags)
            .build()
            .map_err(kernel(name, "ADD_DEV"))?;
        let ctrl = Arc::new(ctrl);
        let (tx, rx) = mpsc::channel::<Started>();
        let stopping = Arc::new(AtomicBool::new(false));
        let server = spawn_server(name, &ctrl, dev, geo, params, tx, &stopping)?;
        let fail = |what: String| {
            // The device's thread may be blocked in the kernel (waiting for
            // fetches that will not come): stopping the device ends that
            // wait, and its I/O fails instead of waiting for a server.
            let _ = ensure_ctrl_ring();
            let _ = ctrl.kill_dev();
            UblkError::Invalid {
                name: name.into(),
                what,
            }
        };
        let dev_id = match rx.recv_timeout(START_TIMEOUT) {
            Ok(Started::Live(id)) => id,
            Ok(Started::Failed(e)) => {
                let _ = server.join();
                return Err(kernel(name, "START_DEV")(e));
            }
            Ok(Started::QueueFailed(why)) => return Err(fail(why)),
            Err(_) => {
                return Err(fail(format!(
                    "the device did not start within {START_TIMEOUT:?}"
                )))
            }
        };
        Ok(UblkExport {
            name: name.to_string(),
            dev_id,
            read_only: read_only || geo.features.read_only,
            recovered: left.is_some(),
            ctrl,
            stopping,
            server: Some(server),
        })
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
        self.stopping.store(true, Ordering::Release);
        if let Err(e) = ensure_ctrl_ring() {
            tracing::error!(export = %self.name, "ublk: no control ring to stop the device with: {e}");
            return;
        }
        if let Err(e) = self.ctrl.kill_dev() {
            tracing::warn!(export = %self.name, "ublk STOP_DEV: {e}");
        }
        if let Some(t) = self.server.take() {
            let _ = t.join();
        }
        if let Err(e) = self.ctrl.del_dev() {
            tracing::debug!(export = %self.name, "ublk DEL_DEV: {e}");
        }
    }
}

impl Drop for UblkExport {
    fn drop(&mut self) {
        if self.server.is_some() {
            self.stop_inner();
        }
    }
}
