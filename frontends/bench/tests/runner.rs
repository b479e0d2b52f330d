//! The runner against small in-test devices (inline and threaded
//! completion, one that corrupts and one that loses writes) and against
//! real registry stacks: verify finds what a bad device does and nothing on
//! a good one, the JSON has fio's shape, groups and clones report as fio's.

use blkstack_bench::{
    run_jobs, run_on_device, write_json, write_normal, BlockSizes, JobSpec, RunOptions, RwMode,
    SizeSpec, VerifyMode, WaitMode,
};
use blkstack_core::device::check_bio;
use blkstack_core::{Bio, Device, DeviceRef, Op, Status};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

/// How the test device misbehaves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// Every 5th write lands with one byte flipped.
    FlipByte,
    /// Every 5th write is acknowledged but never stored.
    LoseWrite,
    /// Every 5th write fails with an I/O error (and stores half its data).
    FailWrite,
}

/// A RAM disk. Completes inline, or on a worker thread when `threaded`.
struct TestDev {
    data: Mutex<Vec<u8>>,
    fault: Fault,
    writes: AtomicU64,
    worker: Option<Mutex<mpsc::Sender<Bio>>>,
}

impl TestDev {
    fn new(size: usize, fault: Fault, threaded: bool) -> Arc<TestDev> {
        if !threaded {
            return Arc::new(TestDev {
                data: Mutex::new(vec![0; size]),
                fault,
                writes: AtomicU64::new(0),
                worker: None,
            });
        }
        let (tx, rx) = mpsc::channel::<Bio>();
        let dev = Arc::new(TestDev {
            data: Mutex::new(vec![0; size]),
            fault,
            writes: AtomicU64::new(0),
            worker: Some(Mutex::new(tx)),
        });
        // The worker holds only a weak reference, so dropping the device
        // drops the sender and ends the worker.
        let weak = Arc::downgrade(&dev);
        std::thread::spawn(move || {
            while let Ok(bio) = rx.recv() {
                match weak.upgrade() {
                    Some(d) => d.execute(bio),
                    None => bio.complete(Status::IoError),
                }
            }
        });
        dev
    }

    fn execute(&self, bio: Bio) {
        if let Err(s) = check_bio(self, &bio) {
            bio.complete(s);
            return;
        }
        let (off, len) = (bio.offset as usize, bio.len as usize);
        match bio.op {
            Op::Read => bio
                .data_mut()
                .copy_from_slice(&self.data.lock()[off..off + len]),
            Op::Write => {
                let n = self.writes.fetch_add(1, Ordering::Relaxed) + 1;
                let faulty = n.is_multiple_of(5);
                match self.fault {
                    Fault::LoseWrite if faulty => {}
                    Fault::FailWrite if faulty => {
                        let half = len / 2;
                        self.data.lock()[off..off + half].copy_from_slice(&bio.data()[..half]);
                        bio.complete(Status::IoError);
                        return;
                    }
                    _ => {
                        let mut d = self.data.lock();
                        d[off..off + len].copy_from_slice(bio.data());
                        if self.fault == Fault::FlipByte && faulty {
                            d[off + len / 2] ^= 0x40;
                        }
                    }
                }
            }
            _ => {}
        }
        bio.complete(Status::Ok);
    }
}

impl Device for TestDev {
    fn submit(&self, bio: Bio) {
        match &self.worker {
            Some(tx) => {
                let r = tx.lock().send(bio);
                if let Err(mpsc::SendError(bio)) = r {
                    bio.complete(Status::IoError);
                }
            }
            None => self.execute(bio),
        }
    }

    fn size(&self) -> u64 {
        self.data.lock().len() as u64
    }
}

fn quiet() -> RunOptions {
    RunOptions::default()
}

fn verify_job(rw: RwMode) -> JobSpec {
    JobSpec {
        name: "v".into(),
        rw,
        bs: BlockSizes::single(4096),
        iodepth: 8,
        verify: VerifyMode::Crc32c,
        ..JobSpec::default()
    }
}

#[test]
fn verify_passes_on_a_good_device_inline_and_threaded() {
    for threaded in [false, true] {
        for rw in [
            RwMode::Write,
            RwMode::RandWrite,
            RwMode::RandRw,
            RwMode::ReadWrite,
        ] {
            let dev: DeviceRef = TestDev::new(2 << 20, Fault::None, threaded);
            let r = run_on_device(dev, "ram", &[verify_job(rw)], &quiet()).unwrap();
            let j = &r.jobs[0];
            assert_eq!(
                j.verify_errors, 0,
                "{rw:?} threaded={threaded}: {:?}",
                j.verify_failures
            );
            assert!(j.verify_checked > 0, "{rw:?}: nothing verified");
            assert_eq!(j.error, 0);
            assert!(!r.failed());
            assert!(j.write.total_ios > 0);
            // Size-based: exactly `size` bytes of I/O in the work phase, the
            // verify reads on top.
            assert_eq!(
                j.write.io_bytes + j.read.io_bytes - j.verify_checked * 4096,
                2 << 20,
                "{rw:?}"
            );
        }
    }
}

#[test]
fn verify_with_norandommap_overwrites_and_mixed_sizes_stays_clean() {
    let dev: DeviceRef = TestDev::new(1 << 20, Fault::None, true);
    let job = JobSpec {
        norandommap: true,
        bs: BlockSizes {
            split: vec![(4096, 50), (16384, 50)],
            range: None,
        },
        iodepth: 16,
        runtime: Some(Duration::from_millis(300)),
        time_based: true,
        ..verify_job(RwMode::RandRw)
    };
    let r = run_on_device(dev, "ram", &[job], &quiet()).unwrap();
    assert_eq!(
        r.jobs[0].verify_errors, 0,
        "{:?}",
        r.jobs[0].verify_failures
    );
    assert!(r.jobs[0].verify_checked > 0);
}

#[test]
fn verify_reports_a_corrupting_device() {
    for (fault, what) in [(Fault::FlipByte, "crc"), (Fault::LoseWrite, "")] {
        for rw in [RwMode::RandWrite, RwMode::RandRw] {
            let dev: DeviceRef = TestDev::new(1 << 20, fault, false);
            let r = run_on_device(dev, "ram", &[verify_job(rw)], &quiet()).unwrap();
            let j = &r.jobs[0];
            assert!(j.verify_errors > 0, "{rw:?}: corruption went unnoticed");
            assert_eq!(j.error, libc::EILSEQ);
            assert!(r.failed());
            assert!(!j.verify_failures.is_empty());
            assert!(
                j.verify_failures[0].contains("offset"),
                "{}",
                j.verify_failures[0]
            );
            if !what.is_empty() {
                assert!(
                    j.verify_failures[0].contains(what),
                    "{}",
                    j.verify_failures[0]
                );
            }
            let json: serde_json::Value = serde_json::from_str(&write_json(&r)).unwrap();
            assert!(json["jobs"][0]["verify_errors"].as_u64().unwrap() > 0);
        }
    }
}

#[test]
fn verify_fatal_stops_at_the_first_failure() {
    let dev: DeviceRef = TestDev::new(1 << 20, Fault::FlipByte, false);
    let job = JobSpec {
        verify_fatal: true,
        iodepth: 1,
        ..verify_job(RwMode::Write)
    };
    let r = run_on_device(dev, "ram", &[job], &quiet()).unwrap();
    assert_eq!(r.jobs[0].verify_errors, 1);
}

#[test]
fn json_has_fios_shape() {
    let dev: DeviceRef = TestDev::new(4 << 20, Fault::None, false);
    let job = JobSpec {
        name: "shape".into(),
        rw: RwMode::RandRead,
        iodepth: 4,
        runtime: Some(Duration::from_millis(200)),
        time_based: true,
        ..JobSpec::default()
    };
    let r = run_on_device(dev, "ram", &[job], &quiet()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&write_json(&r)).unwrap();
    assert!(v["fio version"].as_str().unwrap().starts_with("blkstack-"));
    let j = &v["jobs"][0];
    assert_eq!(j["jobname"], "shape");
    assert_eq!(j["groupid"], 0);
    assert_eq!(j["error"], 0);
    let read = &j["read"];
    assert!(read["iops"].as_f64().unwrap() > 0.0);
    assert!(read["io_bytes"].as_u64().unwrap() > 0);
    assert_eq!(
        read["io_kbytes"].as_u64().unwrap(),
        read["io_bytes"].as_u64().unwrap() >> 10
    );
    assert!(read["bw"].as_u64().unwrap() > 0);
    assert!(read["bw_bytes"].as_u64().unwrap() >= read["bw"].as_u64().unwrap() * 1024);
    let runtime = read["runtime"].as_u64().unwrap();
    assert!((180..=1000).contains(&runtime), "runtime {runtime} ms");
    assert_eq!(read["total_ios"], r.jobs[0].read.total_ios);
    for k in ["short_ios", "drop_ios"] {
        assert_eq!(read[k], 0);
    }
    let clat = &read["clat_ns"];
    for k in ["min", "max", "mean", "stddev", "N"] {
        assert!(clat[k].is_number(), "clat_ns.{k}");
    }
    let pct = clat["percentile"].as_object().unwrap();
    for k in [
        "1.000000",
        "50.000000",
        "99.000000",
        "99.900000",
        "99.990000",
    ] {
        assert!(pct.contains_key(k), "percentile {k}");
    }
    let p99 = pct["99.000000"].as_u64().unwrap();
    assert!(p99 >= clat["min"].as_u64().unwrap() && p99 <= clat["max"].as_u64().unwrap());
    assert!(read["lat_ns"]["N"].as_u64().unwrap() > 0);
    assert_eq!(read["slat_ns"]["N"], 0);
    for k in [
        "bw_min",
        "bw_max",
        "bw_agg",
        "bw_mean",
        "bw_dev",
        "bw_samples",
        "iops_min",
        "iops_max",
        "iops_mean",
        "iops_stddev",
        "iops_samples",
    ] {
        assert!(read[k].is_number(), "read.{k}");
    }
    assert_eq!(j["write"]["total_ios"], 0);
    for k in [
        "usr_cpu",
        "sys_cpu",
        "ctx",
        "job_runtime",
        "elapsed",
        "verify_errors",
    ] {
        assert!(j[k].is_number(), "{k}");
    }
    assert!(j["usr_cpu"].as_f64().unwrap() + j["sys_cpu"].as_f64().unwrap() > 0.0);
}

#[test]
fn normal_output_follows_fios_layout() {
    let dev: DeviceRef = TestDev::new(4 << 20, Fault::None, true);
    let job = JobSpec {
        name: "lay".into(),
        rw: RwMode::RandRw,
        iodepth: 4,
        size: Some(SizeSpec::Bytes(2 << 20)),
        ..JobSpec::default()
    };
    let r = run_on_device(dev, "ram", &[job], &quiet()).unwrap();
    let text = write_normal(&r);
    for needle in [
        "lay: (groupid=0, jobs=1): err= 0: pid=",
        "  read: IOPS=",
        "  write: IOPS=",
        "    clat (",
        "     lat (",
        "    clat percentiles (",
        "     |  1.00th=[",
        "99.99th=[",
        "  cpu          : usr=",
        "  IO depths    : ",
        "     issued rwts: total=",
        "Run status group 0 (all jobs):",
        "   READ: bw=",
        "  WRITE: bw=",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    let bw_line = text
        .lines()
        .find(|l| l.starts_with("  read: IOPS="))
        .unwrap();
    assert!(
        bw_line.contains("B/s (") && bw_line.ends_with("msec)"),
        "{bw_line}"
    );
}

#[test]
fn wait_modes_all_complete_io() {
    for wait in [WaitMode::Interrupt, WaitMode::Poll, WaitMode::Hybrid] {
        let dev: DeviceRef = TestDev::new(1 << 20, Fault::None, true);
        let job = JobSpec {
            name: wait.name().into(),
            rw: RwMode::RandRead,
            iodepth: 4,
            wait,
            io_size: Some(SizeSpec::Bytes(4 << 20)),
            ..JobSpec::default()
        };
        let r = run_on_device(dev, "ram", &[job], &quiet()).unwrap();
        assert_eq!(r.jobs[0].read.total_ios, 1024, "{wait:?}");
    }
}

/// CPU is a share of the job's runtime, which excludes the ramp: a job
/// that spins through a ramp as long as its runtime must not report more
/// than one CPU's worth (it reported about twice that when the ramp's CPU
/// was counted).
#[test]
fn cpu_share_excludes_the_ramp() {
    let dev: DeviceRef = TestDev::new(1 << 20, Fault::None, false);
    let job = JobSpec {
        name: "cpu".into(),
        rw: RwMode::RandRead,
        iodepth: 1,
        wait: WaitMode::Poll,
        ramp_time: Duration::from_millis(1000),
        runtime: Some(Duration::from_millis(1000)),
        time_based: true,
        ..JobSpec::default()
    };
    let r = run_on_device(dev, "ram", &[job], &quiet()).unwrap();
    let j = &r.jobs[0];
    let share = j.usr_cpu_pct() + j.sys_cpu_pct();
    assert!(
        share <= 103.0,
        "usr {:.1}% + sys {:.1}% over one thread's runtime",
        j.usr_cpu_pct(),
        j.sys_cpu_pct()
    );
}

#[test]
fn clones_groups_and_stonewall() {
    let dev: DeviceRef = TestDev::new(1 << 20, Fault::None, false);
    let a = JobSpec {
        name: "a".into(),
        numjobs: 3,
        ..JobSpec::default()
    };
    let r = run_on_device(dev.clone(), "ram", std::slice::from_ref(&a), &quiet()).unwrap();
    assert_eq!(r.jobs.len(), 3);
    assert_eq!(r.threads.len(), 3);
    let merged = JobSpec {
        group_reporting: true,
        ..a.clone()
    };
    let r = run_on_device(dev.clone(), "ram", &[merged], &quiet()).unwrap();
    assert_eq!(r.jobs.len(), 1);
    assert_eq!(r.jobs[0].members, 3);
    assert_eq!(r.jobs[0].read.io_bytes, 3 << 20);
    let b = JobSpec {
        name: "b".into(),
        stonewall: true,
        numjobs: 1,
        rw: RwMode::Write,
        ..JobSpec::default()
    };
    let r = run_on_device(dev, "ram", &[a, b], &quiet()).unwrap();
    assert_eq!(r.groups.len(), 2);
    assert_eq!(r.jobs.last().unwrap().groupid, 1);
    assert_eq!(r.groups[1].write.io_bytes, 1 << 20);
    assert_eq!(r.groups[0].read.io_bytes, 3 << 20);
}

#[test]
fn geometry_errors_are_clear() {
    let dev: DeviceRef = TestDev::new(1 << 20, Fault::None, false);
    let job = JobSpec {
        size: Some(SizeSpec::Bytes(2 << 20)),
        ..JobSpec::default()
    };
    let e = run_on_device(dev.clone(), "ram", &[job], &quiet()).unwrap_err();
    assert!(e.to_string().contains("past the end of ram"), "{e}");
    let job = JobSpec {
        bs: BlockSizes::single(1000),
        ..JobSpec::default()
    };
    let e = run_on_device(dev.clone(), "ram", &[job], &quiet()).unwrap_err();
    assert!(e.to_string().contains("logical block size"), "{e}");
    let job = JobSpec {
        time_based: true,
        ..JobSpec::default()
    };
    let e = run_on_device(dev, "ram", &[job], &quiet()).unwrap_err();
    assert!(e.to_string().contains("time_based needs a runtime"), "{e}");
}

#[test]
fn offset_and_percent_size_bound_the_region() {
    let dev = TestDev::new(1 << 20, Fault::None, false);
    let job = JobSpec {
        rw: RwMode::Write,
        offset: SizeSpec::Percent(50.0),
        size: Some(SizeSpec::Percent(25.0)),
        ..JobSpec::default()
    };
    let r = run_on_device(dev.clone(), "ram", &[job], &quiet()).unwrap();
    assert_eq!(r.jobs[0].write.io_bytes, 256 << 10);
    // Only the region was touched: the test device zero-initialised the
    // rest, and the job wrote zeroes nowhere (its buffers are zeroed too),
    // so check through a verify run instead of the data.
    let v = JobSpec {
        offset: SizeSpec::Bytes(4096),
        size: Some(SizeSpec::Bytes(64 << 10)),
        ..verify_job(RwMode::RandWrite)
    };
    let r = run_on_device(dev, "ram", &[v], &quiet()).unwrap();
    assert_eq!(r.jobs[0].verify_checked, 16);
}

#[test]
fn registry_stacks_verify_clean() {
    let reg = blkstack_mapped::Registry::new();
    reg.create_stack(
        "mem0: 0 8192 memory\nmem1: 0 8192 memory\nstriped0: 0 16384 striped 2 128 mem0 0 mem1 0\n\
         mem2: 0 16384 memory\nlinear0: 0 8192 linear mem2 4096\n",
    )
    .unwrap();
    for dev in ["striped0", "/dev/mapper/linear0"] {
        let job = JobSpec {
            filename: Some(dev.into()),
            iodepth: 16,
            bs: BlockSizes {
                split: vec![(4096, 70), (65536, 30)],
                range: None,
            },
            runtime: Some(Duration::from_millis(300)),
            time_based: true,
            ..verify_job(RwMode::RandRw)
        };
        let r = run_jobs(&reg, &[job], &quiet()).unwrap();
        let j = &r.jobs[0];
        assert_eq!(j.verify_errors, 0, "{dev}: {:?}", j.verify_failures);
        assert!(j.verify_checked > 0 && j.read.total_ios > 0 && j.write.total_ios > 0);
    }
    let missing = JobSpec {
        filename: Some("nosuch".into()),
        ..JobSpec::default()
    };
    let e = run_jobs(&reg, &[missing], &quiet()).unwrap_err();
    assert!(e.to_string().contains("nosuch"), "{e}");
}

#[test]
fn bandwidth_and_iops_are_sampled_every_500ms() {
    let dev: DeviceRef = TestDev::new(1 << 20, Fault::None, false);
    let job = JobSpec {
        rw: RwMode::RandRead,
        runtime: Some(Duration::from_millis(1100)),
        time_based: true,
        ..JobSpec::default()
    };
    let r = run_on_device(dev, "ram", &[job], &quiet()).unwrap();
    let d = &r.jobs[0].read;
    assert!((1..=3).contains(&d.bw_samples.len()), "{:?}", d.bw_samples);
    assert_eq!(d.bw_samples.len(), d.iops_samples.len());
    assert!(d.iops_samples.iter().all(|&s| s > 0));
    assert!(r.jobs[0].write.bw_samples.is_empty());
    assert!(write_normal(&r).contains("   iops        : min="));
}

#[test]
fn clones_with_offset_increment_verify_their_own_regions() {
    let dev: DeviceRef = TestDev::new(4 << 20, Fault::None, true);
    let job = JobSpec {
        numjobs: 4,
        size: Some(SizeSpec::Bytes(1 << 20)),
        offset_increment: SizeSpec::Bytes(1 << 20),
        group_reporting: true,
        ..verify_job(RwMode::RandRw)
    };
    let r = run_on_device(dev.clone(), "ram", std::slice::from_ref(&job), &quiet()).unwrap();
    assert_eq!(r.jobs[0].members, 4);
    assert_eq!(
        r.jobs[0].verify_errors, 0,
        "{:?}",
        r.jobs[0].verify_failures
    );
    let too_far = JobSpec { numjobs: 5, ..job };
    let e = run_on_device(dev, "ram", &[too_far], &quiet()).unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");
}

#[test]
fn io_errors_stop_the_job_or_are_counted_with_continue_on_error() {
    let dev: DeviceRef = TestDev::new(1 << 20, Fault::FailWrite, false);
    let r = run_on_device(dev, "ram", &[verify_job(RwMode::RandWrite)], &quiet()).unwrap();
    let j = &r.jobs[0];
    assert_eq!(j.error, libc::EIO);
    assert!(
        j.write.errors >= 1 && j.write.errors <= 8,
        "stops soon: {}",
        j.write.errors
    );
    assert_eq!(j.verify_checked, 0, "no verify after a fatal error");
    assert!(r.failed());

    let dev: DeviceRef = TestDev::new(1 << 20, Fault::FailWrite, false);
    let job = JobSpec {
        continue_on_error: true,
        ..verify_job(RwMode::RandWrite)
    };
    let r = run_on_device(dev, "ram", &[job], &quiet()).unwrap();
    let j = &r.jobs[0];
    assert_eq!(j.write.errors, 256 / 5, "every 5th of 256 writes failed");
    assert_eq!(
        j.verify_errors, 0,
        "failed writes are not expected back: {:?}",
        j.verify_failures
    );
    assert_eq!(j.verify_checked, 256 - 256 / 5);
    assert!(r.failed());
}

#[test]
fn ramp_time_is_run_but_not_measured() {
    let dev: DeviceRef = TestDev::new(1 << 20, Fault::None, false);
    let job = JobSpec {
        rw: RwMode::RandRead,
        ramp_time: Duration::from_millis(300),
        runtime: Some(Duration::from_millis(200)),
        time_based: true,
        ..JobSpec::default()
    };
    let r = run_on_device(dev, "ram", &[job], &quiet()).unwrap();
    let j = &r.jobs[0];
    let run_ms = j.read.runtime_ms();
    // The measured window is the runtime alone: it starts after the ramp,
    // so it is at least the runtime and at most what elapsed after the ramp
    // (a loaded machine may stretch both; it cannot put the ramp inside).
    let after_ramp_ms = (j.elapsed_ns / 1_000_000).saturating_sub(300);
    assert!(
        run_ms >= 200 && run_ms <= after_ramp_ms + 1,
        "measured {run_ms} ms of {after_ramp_ms} ms after the ramp"
    );
    assert!(
        j.elapsed_ns >= 500_000_000,
        "ramp ran: elapsed {} ns",
        j.elapsed_ns
    );
    assert_eq!(j.read.clat.samples, j.read.total_ios);
}

#[test]
fn percentile_list_changes_the_reported_percentiles() {
    let dev: DeviceRef = TestDev::new(1 << 20, Fault::None, false);
    let job = JobSpec {
        percentile_list: vec![50.0, 99.5],
        ..JobSpec::default()
    };
    let r = run_on_device(dev, "ram", &[job], &quiet()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&write_json(&r)).unwrap();
    let keys: Vec<&String> = v["jobs"][0]["read"]["clat_ns"]["percentile"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    assert_eq!(keys, ["50.000000", "99.500000"]);
    let text = write_normal(&r);
    assert!(text.contains("50.00th=[") && text.contains("99.50th=[") && !text.contains("99.99th"));
}

#[test]
fn odd_block_size_mixes_end_exactly_at_the_io_limit() {
    let dev: DeviceRef = TestDev::new(1 << 20, Fault::None, false);
    let job = JobSpec {
        rw: RwMode::RandRw,
        bs: BlockSizes {
            split: vec![(3072, 50), (4096, 50)],
            range: None,
        },
        io_size: Some(SizeSpec::Bytes(300 << 10)),
        ..JobSpec::default()
    };
    let r = run_on_device(dev, "ram", &[job], &quiet()).unwrap();
    let j = &r.jobs[0];
    assert_eq!(j.read.io_bytes + j.write.io_bytes, 300 << 10);
}

/// `null irqmode=2 iopoll=1`: with `wait=poll|hybrid` the jobs reap their
/// own completions from the device's poll list (io_uring IOPOLL); with
/// `interrupt`, and below a target that does not poll (striped), the
/// timer thread completes them. Every mode finishes its I/O, none early.
#[test]
fn iopoll_null_device_completes_in_every_wait_mode() {
    let reg = blkstack_mapped::Registry::new();
    reg.create_stack(
        "pl: 0 8192 null irqmode=2 completion_nsec=50000 iopoll=1 zero_reads=0\n\
         p0: 0 8192 null irqmode=2 completion_nsec=50000 iopoll=1 zero_reads=0\n\
         p1: 0 8192 null irqmode=2 completion_nsec=50000 iopoll=1 zero_reads=0\n\
         st: 0 16384 striped 2 8 p0 0 p1 0\n",
    )
    .unwrap();
    for dev in ["pl", "st"] {
        for wait in [WaitMode::Interrupt, WaitMode::Poll, WaitMode::Hybrid] {
            let job = JobSpec {
                name: format!("{dev}-{}", wait.name()),
                filename: Some(dev.into()),
                rw: RwMode::RandRead,
                iodepth: 8,
                numjobs: 2,
                wait,
                io_size: Some(SizeSpec::Bytes(256 << 10)),
                ..JobSpec::default()
            };
            let r = run_jobs(&reg, &[job], &quiet()).unwrap();
            for j in &r.jobs {
                assert_eq!(j.read.total_ios, 64, "{dev} {wait:?}");
                assert_eq!(j.read.errors, 0, "{dev} {wait:?}");
                assert!(j.read.clat.min() >= 50_000, "{dev} {wait:?}: early");
            }
        }
    }
    let status = reg.status_text("pl").unwrap();
    assert!(status.contains("iopoll=1"), "{status}");
}

/// fio's `verify_backlog`: written blocks are read back and checked while
/// the job runs (with `do_verify=0` there is no verify phase at all), and
/// every algorithm of `verify=` catches a device that corrupts data.
#[test]
fn verify_backlog_and_every_algorithm() {
    let mut job = verify_job(RwMode::RandWrite);
    job.apply("verify_backlog", Some("16")).unwrap();
    job.apply("do_verify", Some("0")).unwrap();
    job.apply("number_ios", Some("256")).unwrap();
    let dev: DeviceRef = TestDev::new(2 << 20, Fault::None, true);
    let r = run_on_device(dev, "ram", &[job], &quiet()).unwrap();
    let j = &r.jobs[0];
    assert_eq!(j.write.total_ios, 256);
    // Checked in batches of at least 16 once nothing is in flight; what
    // is left at the end (fewer than 16) waits for a verify phase, as in
    // fio, and do_verify=0 has none.
    let read = j.read.total_ios;
    assert!(
        (241..=256).contains(&read),
        "{read} of 256 writes read back"
    );
    assert_eq!((j.verify_checked, j.verify_errors), (read, 0));
    for algo in [
        "md5", "crc64", "sha256", "sha512", "sha1", "meta", "pattern",
    ] {
        let mut job = verify_job(RwMode::Write);
        job.apply("verify", Some(algo)).unwrap();
        job.apply("verify_pattern", Some("0xaa555aa5")).unwrap();
        let good: DeviceRef = TestDev::new(1 << 20, Fault::None, false);
        let r = run_on_device(good, "ram", &[job.clone()], &quiet()).unwrap();
        assert_eq!(r.jobs[0].verify_errors, 0, "{algo} on a good device");
        assert!(r.jobs[0].verify_checked > 0, "{algo}");
        let bad: DeviceRef = TestDev::new(1 << 20, Fault::FlipByte, false);
        let r = run_on_device(bad, "ram", &[job], &quiet()).unwrap();
        if algo != "meta" {
            assert!(r.jobs[0].verify_errors > 0, "{algo} misses a flipped bit");
        }
    }
}
