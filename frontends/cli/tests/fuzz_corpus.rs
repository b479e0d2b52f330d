//! Replays the fuzz targets' checked-in corpus (fuzz/corpus/<target>/,
//! seeded from real clients' traffic and the examples) and every input a
//! fuzzer ever crashed on (fuzz/regressions/<target>/) through the same
//! entry points the libFuzzer targets call, on stable Rust: a parser fix
//! that regresses fails here without nightly or cargo-fuzz.

use std::path::{Path, PathBuf};

fn inputs(target: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut files = Vec::new();
    for dir in ["corpus", "regressions"] {
        let Ok(rd) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        for e in rd {
            let p = e.expect("corpus directory entry").path();
            if p.is_file() {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

/// Run `entry` on every input of `target`; the corpus must not be empty
/// (a moved directory would otherwise make this test pass vacuously).
fn replay(target: &str, min_inputs: usize, entry: impl Fn(&[u8])) {
    let files = inputs(target);
    assert!(
        files.len() >= min_inputs,
        "fuzz/corpus/{target}: {} inputs, expected at least {min_inputs}",
        files.len()
    );
    for f in files {
        let data = std::fs::read(&f).expect("read corpus input");
        eprintln!("{target}: {}", f.display());
        entry(&data);
    }
}

#[test]
fn nbd_server_corpus() {
    replay("nbd_server", 9, |d| {
        let out = blkstack_nbd::fuzzing::handshake_and_transmission(d);
        // Every session starts with the server's greeting.
        assert!(out.starts_with(b"NBDMAGIC"), "no greeting");
    });
}

#[test]
fn nbd_server_real_session_reads_back_its_write() {
    // qemu-io's recorded session writes 64 KiB of 0x5a at offset 0, then
    // reads it back: the reply must carry that data.
    let data = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/nbd_server/qemu-io-rw"),
    )
    .expect("recorded qemu-io session");
    let out = blkstack_nbd::fuzzing::handshake_and_transmission(&data);
    let run = vec![0x5au8; 64 << 10];
    assert!(
        out.windows(run.len()).any(|w| w == run.as_slice()),
        "the READ reply does not carry the written data"
    );
}

#[test]
fn table_corpus() {
    replay("table", 15, blkstack_mapped::fuzzing::table);
}

#[test]
fn concise_corpus() {
    replay("concise", 8, blkstack_mapped::fuzzing::concise);
}

#[test]
fn fio_jobfile_corpus() {
    replay("fio_jobfile", 20, blkstack_bench::fuzzing::jobfile);
}

#[test]
fn control_json_corpus() {
    replay("control_json", 10, blkstack_control::fuzzing::request_lines);
}

#[test]
fn nbd_replies_corpus() {
    replay("nbd_replies", 12, |d| {
        let st = blkstack_drivers::nbd::fuzzing::replies(d);
        assert_eq!(st.len(), blkstack_drivers::nbd::fuzzing::REQUESTS.len());
    });
}

fn corpus_file(target: &str, name: &str) -> Vec<u8> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target)
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn thin_metadata_corpus() {
    replay("thin_metadata", 4, |d| {
        let _ = blkstack_mapped::fuzzing::thin_metadata(d);
    });
}

/// The seeds are real metadata (thin_restore's, and a blank device our
/// pool formats): each opens and takes every change the entry point
/// makes. A bad magic, past the checksum repair, is still refused.
#[test]
fn thin_metadata_seeds_open_and_corruption_is_refused() {
    for seed in [
        "blank",
        "no-devices",
        "two-devices-shared",
        "two-level-btrees",
    ] {
        let r = blkstack_mapped::fuzzing::thin_metadata(&corpus_file("thin_metadata", seed));
        assert!(r.is_ok(), "seed {seed}: {r:?}");
    }
    let mut bad = corpus_file("thin_metadata", "two-devices-shared");
    bad[32] ^= 0xff; // the superblock's magic
    let r = blkstack_mapped::fuzzing::thin_metadata(&bad);
    assert!(
        r.as_ref().is_err_and(|e| e.to_string().contains("magic")),
        "{r:?}"
    );
}

#[test]
fn replay_log_corpus() {
    replay("replay_log", 4, |d| {
        let _ = blkstack_crashtest::fuzzing::log(d);
    });
}

/// The seed log's writes land where its entries say (the later write
/// over sectors 4..8 wins), so the entry point replays, not just parses.
#[test]
fn replay_log_seed_replays_its_writes() {
    let head = blkstack_crashtest::fuzzing::log(&corpus_file("replay_log", "writes-flush-fua-512"))
        .expect("the seed log replays");
    let at = |byte: usize| head[byte];
    assert_eq!((at(0), at(511), at(512), at(1536)), (0, 0, 1, 3));
    assert_eq!((at(2048), at(3584)), (28, 31), "the later write wins");
    assert_eq!((at(4096), at(8192), at(8704), at(9216)), (56, 112, 113, 0));
}

fn vhost_user_session(input: &[u8]) -> blkstack_core::DeviceRef {
    let reg = blkstack_mapped::Registry::new();
    let dev: blkstack_core::DeviceRef = reg.create("disk", "0 2048 memory").expect("memory device");
    blkstack_vhost_user_blk::fuzzing::session(dev.clone(), input);
    dev
}

#[test]
fn vhost_user_corpus() {
    replay("vhost_user", 4, |d| {
        vhost_user_session(d);
    });
}

/// The recorded session sets up a queue and kicks a write of 4 KiB of
/// 0xa5 to sector 0: it reaches the disk through the real backend.
#[test]
fn vhost_user_seed_session_writes_the_disk() {
    let dev = vhost_user_session(&corpus_file("vhost_user", "write-read-getid-flush"));
    let mut b = vec![0u8; 4096];
    let st = blkstack_core::sync::submit_and_wait(&*dev, blkstack_core::Op::Read, 0, 4096, &mut b);
    assert_eq!(st, blkstack_core::Status::Ok);
    assert!(
        b.iter().all(|&x| x == 0xa5),
        "the guest's write did not land"
    );
}

/// Found by the `vhost_user` fuzzer: with EVENT_IDX negotiated, a guest
/// whose avail index runs more than a queue's length ahead made the
/// worker loop for ever (the ring said "more" and gave nothing), so the
/// connection never ended. The session must end, promptly.
#[test]
fn vhost_user_corrupt_avail_index_with_event_idx_ends_the_session() {
    let input = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fuzz/regressions/vhost_user/event-idx-avail-index-beyond-queue"),
    )
    .expect("the regression input");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        vhost_user_session(&input);
        let _ = tx.send(());
    });
    assert!(
        rx.recv_timeout(std::time::Duration::from_secs(30)).is_ok(),
        "the session with a corrupt avail index never ended"
    );
}

/// Found through the `vhost_user` fuzzer's two "timeouts" (both after
/// about 20,000 sessions, the descriptor limit): every connection left
/// one descriptor open (vhost-user-backend never closes an exit event's
/// read end), so a VMM that reconnects would exhaust serve's descriptors
/// and hang its acceptor. Sessions must leave none behind.
#[test]
fn vhost_user_sessions_leave_no_descriptors_open() {
    let count = || {
        std::fs::read_dir("/proc/self/fd")
            .expect("/proc/self/fd")
            .count()
    };
    for seed in ["setup-only", "write-read-getid-flush", "shrink-after-kick"] {
        let input = corpus_file("vhost_user", seed);
        vhost_user_session(&input);
        let before = count();
        for _ in 0..20 {
            vhost_user_session(&input);
        }
        // Other tests run beside this one and open descriptors too: a
        // leak of one per session shows as 20, a neighbour's as a few.
        let after = count();
        assert!(
            after < before + 10,
            "{seed}: {before} descriptors before 20 sessions, {after} after"
        );
    }
}
