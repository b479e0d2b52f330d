//! libFuzzer target `thin_metadata`: a thin pool's metadata (superblock,
//! space maps, device details and mapping btrees) opened from bytes and
//! changed as a pool does. The checks live in
//! `blkstack_mapped::fuzzing::thin_metadata`, shared with the stable
//! corpus replay test.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = blkstack_mapped::fuzzing::thin_metadata(data);
});
