//! libFuzzer target `luks_header`: LUKS1 and LUKS2 headers (binary
//! headers, JSON metadata, keyslot, digest and segment checks, luksDump,
//! and an unlock when the KDF costs are tiny). The input format and the
//! checks live in `blkstack_mapped::fuzzing::luks_header`, shared with the
//! stable replay test mapped/tests/luks_header.rs.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    blkstack_mapped::fuzzing::luks_header(data);
});
