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

use crate::error::{check_control, UblkError, CONTROL_PATH};
use crate::options::UblkOptions;
use crate::params::{ublk_params, Geometry};
use crate::queue;
use blkstack_core::DeviceRef;
use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::{sys, UblkFlags};
use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// The key under libublk's `target_data` naming the export.
const NAME_KEY: &str = "blkstack_export";
/// libublk's target type in the device json.
const TARGET_TYPE: &str = "blkstack";
/// How long starting a device may take (the kernel waits for every
/// queue's fetch commands; a recovery waits up to 30 s for the driver to
/// notice the old server's death).
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// A running ublk device serving one of our devices.
pub struct UblkExport {
    pub name: String,
    pub dev_id: u32,
    pub read_only: bool,
    /// Whether it was taken over from a killed server.
    pub recovered: bool,
    ctrl: Arc<UblkCtrl>,
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
        let (id, dev_flags) = match left {
            Some(id) => {
                let c = UblkCtrl::new_simple(id as i32)
                    .map_err(kernel(name, "opening the left-behind device"))?;
                c.start_user_recover()
                    .map_err(kernel(name, "START_USER_RECOVERY"))?;
                tracing::info!(
                    export = name,
                    dev_id = id,
                    "ublk: taking over the device a killed server left"
                );
                (id as i32, UblkFlags::UBLK_DEV_F_RECOVER_DEV)
            }
            None => (-1, UblkFlags::UBLK_DEV_F_ADD_DEV),
        };
        let ctrl = UblkCtrlBuilder::default()
            .name(TARGET_TYPE)
            .id(id)
            .nr_queues(opts.queues)
            .depth(opts.depth)
            .io_buf_bytes(opts.io_buf_bytes)
            .ctrl_flags(opts.ctrl_flags())
            .dev_flags(dev_flags)
            .build()
            .map_err(kernel(name, "ADD_DEV"))?;
        let ctrl = Arc::new(ctrl);
        let (tx, rx) = mpsc::channel::<Result<u32, libublk::UblkError>>();
        let server = {
            let ctrl = ctrl.clone();
            let export = name.to_string();
            let tx_fail = tx.clone();
            std::thread::Builder::new()
                .name(format!("ublk-{name}"))
                .spawn(move || {
                    if let Err(e) = ensure_ctrl_ring() {
                        let _ = tx_fail.send(Err(e));
                        return;
                    }
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
                            move |qid, d| queue::run(qid, d, dev.clone()),
                            move |c| {
                                let _ = tx.send(Ok(c.dev_info().dev_id));
                            },
                        )
                    });
                    match std::panic::catch_unwind(run) {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => {
                            let _ = tx_fail.send(Err(e));
                        }
                        Err(_) => {
                            let _ = tx_fail.send(Err(libublk::UblkError::OtherError(-libc::EIO)));
                        }
                    }
                })
                .map_err(|source| UblkError::Io {
                    name: name.into(),
                    what: "spawning the device's thread",
                    source,
                })?
        };
        let dev_id = match rx.recv_timeout(START_TIMEOUT) {
            Ok(Ok(id)) => id,
            Ok(Err(e)) => {
                let _ = server.join();
                return Err(kernel(name, "START_DEV")(e));
            }
            Err(_) => {
                let _ = ensure_ctrl_ring();
                let _ = ctrl.kill_dev();
                return Err(UblkError::Invalid {
                    name: name.into(),
                    what: format!("the device did not start within {START_TIMEOUT:?}"),
                });
            }
        };
        Ok(UblkExport {
            name: name.to_string(),
            dev_id,
            read_only: read_only || geo.features.read_only,
            recovered: left.is_some(),
            ctrl,
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
