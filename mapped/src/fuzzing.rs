//! Fuzzing entry points (cargo-fuzz's `table` and `concise` targets, and
//! the stable regression test that replays their corpora): the table
//! language and dmsetup's concise/stack formats, then every target's
//! constructor through a create on a throwaway [`Registry`].
//!
//! As with dmsetup's `create`, parsing is all or nothing and a table the
//! kernel's `dm_table_add_target` would refuse must come back as an error,
//! never a panic. Three limits keep a fuzzing run harmless: tables naming
//! the `file` target are only parsed (its constructor opens and creates
//! files), stack files with `--luks` lines are skipped (they open LUKS
//! images), and tables longer than [`MAX_SECTORS`] are only parsed, so no
//! input makes the fuzzer allocate much or touch the filesystem.

pub use crate::luks::fuzz::luks_header;
use crate::persistent_data::PdError;
use crate::registry::Registry;
use crate::table_text::{parse_line, parse_stack, parse_table, TableLine};
use blkstack_core::Device;
use std::sync::Arc;

/// Longest device (in 512-byte sectors) a fuzzed table may build: 1 GiB.
pub const MAX_SECTORS: u64 = 1 << 21;

/// Devices every fuzzed table may name as its underlying devices.
const BASE_DEVICES: &str = "base,,,rw,0 16384 memory;slow,,,rw,0 8192 zero";

/// One table text (the text of `dmsetup create NAME --table`): parse it,
/// check each line prints back to itself, and, when harmless, build it as
/// device `fz` and check its size is the sum of its lines.
pub fn table(input: &[u8]) {
    let Ok(text) = std::str::from_utf8(input) else {
        return;
    };
    let Ok(lines) = parse_table(text) else {
        return;
    };
    for l in &lines {
        check_round_trip(l);
    }
    if !harmless(&lines) {
        return;
    }
    let reg = base_registry();
    if let Ok(dev) = reg.create("fz", text) {
        let sectors: u64 = lines.iter().map(|l| l.len).sum();
        assert_eq!(dev.size(), sectors * 512, "device size of {text:?}");
        let _ = reg.table_text("fz");
        let _ = reg.status_text("fz");
        let _ = reg.info("fz");
    }
    reg.remove_all();
}

/// One stack file or concise list (`blkstack serve --stack`/`--concise`):
/// parse it and, when every table is harmless, create all of its devices.
pub fn concise(input: &[u8]) {
    let Ok(text) = std::str::from_utf8(input) else {
        return;
    };
    // A `NAME: --luks IMAGE KEY_FILE` line reads files and runs a KDF
    // while the stack is parsed: not harmless.
    if text.contains("--luks") {
        return;
    }
    let Ok(specs) = parse_stack(text) else {
        return;
    };
    let all_harmless = specs
        .iter()
        .all(|s| parse_table(&s.table).is_ok_and(|l| harmless(&l)));
    if !all_harmless {
        return;
    }
    let reg = base_registry();
    if let Ok(names) = reg.create_specs(&specs) {
        for n in &names {
            let table = reg.table_text(n).expect("a created device has a table");
            assert!(
                parse_table(&table).is_ok(),
                "table of {n} as printed does not parse: {table:?}"
            );
        }
    }
    reg.remove_all();
}

/// A registry holding the devices fuzzed tables may stack on.
fn base_registry() -> Arc<Registry> {
    let reg = Registry::new();
    reg.create_concise(BASE_DEVICES)
        .expect("the fuzzing base devices");
    reg
}

/// Whether building `lines` is safe in a fuzzing run (see the module
/// documentation).
fn harmless(lines: &[TableLine]) -> bool {
    let total = lines.iter().try_fold(0u64, |acc, l| acc.checked_add(l.len));
    lines.iter().all(|l| l.target != "file") && total.is_some_and(|t| t <= MAX_SECTORS)
}

/// A parsed line, printed as `table` prints it, parses to the same line.
fn check_round_trip(l: &TableLine) {
    let text = l.to_text();
    let again = parse_line(&text, l.line)
        .unwrap_or_else(|e| panic!("{text:?}, printed from {l:?}, does not parse: {e}"));
    assert_eq!(
        &again, l,
        "{text:?} does not parse back to the line it came from"
    );
}

/// Why [`thin_metadata`] did not take its input through every change.
#[derive(Debug, thiserror::Error)]
pub enum ThinFuzzError {
    /// The memory device for the metadata could not be made or written.
    #[error("no metadata device")]
    NoDevice,
    /// The metadata was refused, or a change to it failed.
    #[error(transparent)]
    Metadata(#[from] crate::targets::thin::metadata::MetadataError),
    /// Checksums kept failing after every block was repaired.
    #[error("gave up repairing checksums")]
    GaveUp,
}

/// Metadata device size for [`thin_metadata`]: 1 MiB, 256 blocks.
const THIN_META_SECTORS: u64 = 2048;
/// Data blocks and data block size the fuzzed pool is opened for.
const THIN_DATA_BLOCKS: u64 = 1024;
const THIN_DATA_BLOCK_SIZE: u32 = 128;

/// A thin pool's metadata from bytes (cargo-fuzz's `thin_metadata`):
/// `input` is the metadata device's first blocks (the rest reads as
/// zeroes), opened as a pool opens it (superblock, both space maps,
/// the device details and mapping btrees), then read and changed as a
/// pool does: every lookup, a new thin and a snapshot, inserts, a delete,
/// a commit and a reopen. Corrupt metadata must be refused by name,
/// never panic, hang or allocate without bound.
///
/// Random bytes almost never carry valid checksums, which would stop
/// every input at the first block read. So a checksum (or self-location)
/// error on a block of the input is repaired in the input and the whole
/// open tried again, a bounded number of times: the checksum gate itself
/// is tested apart, and past it the fuzzer reaches the btrees and space
/// maps the gate protects. The same repair runs on stable in the corpus
/// replay, so a fuzzer's finding replays there as it failed.
///
/// `Ok` when the metadata opened and took every change; otherwise why not.
pub fn thin_metadata(input: &[u8]) -> Result<(), ThinFuzzError> {
    use crate::targets::thin::format::FormatError;
    use crate::targets::thin::metadata::MetadataError;
    const BLOCK: usize = crate::targets::thin::format::BLOCK_SIZE;
    let max = (THIN_META_SECTORS * 512) as usize;
    let mut image = input[..input.len().min(max)].to_vec();
    let blocks = image.len().div_ceil(BLOCK);
    image.resize(blocks * BLOCK, 0);
    for _ in 0..=2 * blocks {
        let reg = Registry::new();
        let Ok(md) = open_thin_metadata(&reg, &image) else {
            reg.remove_all();
            return Err(ThinFuzzError::NoDevice);
        };
        let result = md.and_then(exercise_thin_metadata);
        reg.remove_all();
        let repair = match &result {
            Err(MetadataError::Pd(PdError::Format(FormatError::Checksum {
                block, want, ..
            }))) => Some((*block, 0, u64::from(*want), 4)),
            Err(MetadataError::Pd(PdError::Format(FormatError::Location { block, .. }))) => {
                Some((*block, 8, *block, 8))
            }
            _ => None,
        };
        let start = repair.and_then(|(block, ..)| usize::try_from(block).ok()?.checked_mul(BLOCK));
        let (Some((_, at, value, len)), Some(start)) = (repair, start) else {
            return result.map_err(ThinFuzzError::Metadata);
        };
        if start >= image.len() {
            return result.map_err(ThinFuzzError::Metadata);
        }
        image[start + at..start + at + len].copy_from_slice(&value.to_le_bytes()[..len]);
    }
    Err(ThinFuzzError::GaveUp)
}

/// A metadata device holding `image`, and the pool metadata opened on
/// it (the outer error: the device could not be made).
fn open_thin_metadata(
    reg: &Registry,
    image: &[u8],
) -> Result<
    Result<
        crate::targets::thin::metadata::PoolMetadata,
        crate::targets::thin::metadata::MetadataError,
    >,
    (),
> {
    use blkstack_core::sync::submit_and_wait;
    use blkstack_core::{Op, Status};
    let dev = reg
        .create("meta", &format!("0 {THIN_META_SECTORS} memory"))
        .map_err(|_| ())?;
    let mut buf = image.to_vec();
    if !buf.is_empty()
        && submit_and_wait(&*dev, Op::Write, 0, buf.len() as u64, &mut buf) != Status::Ok
    {
        return Err(());
    }
    let arg = crate::target::DevArg {
        name: "meta".into(),
        minor: 0,
        dev,
    };
    Ok(crate::targets::thin::metadata::PoolMetadata::open(
        arg,
        THIN_DATA_BLOCKS,
        THIN_DATA_BLOCK_SIZE,
    ))
}

/// Read and change opened metadata as a pool would; the first error
/// ends it (the pool would fail the I/O or go read-only).
fn exercise_thin_metadata(
    mut md: crate::targets::thin::metadata::PoolMetadata,
) -> Result<(), crate::targets::thin::metadata::MetadataError> {
    let devs: Vec<u64> = (0..8).filter(|&d| md.exists(d)).collect();
    for &d in &devs {
        let _ = md.mapped_blocks(d);
        let high = md.highest_mapped(d)?.unwrap_or(0);
        for vblock in (0..64).chain([high, high.saturating_add(1)]) {
            if let Some(l) = md.find_block(d, vblock)? {
                let _ = md.data_ref_count(l.data_block);
            }
        }
    }
    let (_free, _total) = (md.data_free(), md.data_blocks());
    let _ = md.metadata_free();
    let new = 100;
    md.create_thin(new)?;
    if let Some(&origin) = devs.first() {
        md.create_snap(new + 1, origin)?;
    }
    for vblock in 0..4 {
        if let Some(b) = md.alloc_data_block() {
            md.insert_block(new, vblock, b)?;
        }
    }
    md.commit()?;
    if let Some(&d) = devs.last() {
        md.delete(d)?;
    }
    md.reserve_metadata_snap()?;
    md.commit()?;
    md.release_metadata_snap()?;
    md.commit()
}
