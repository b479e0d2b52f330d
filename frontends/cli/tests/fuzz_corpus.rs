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
