//! libFuzzer target `concise`: dmsetup --concise lists and stack files, created as devices.
//! The checks live in `blkstack_mapped::fuzzing`, shared with the stable corpus replay test.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    blkstack_mapped::fuzzing::concise(data);
});
