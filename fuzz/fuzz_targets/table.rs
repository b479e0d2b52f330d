//! libFuzzer target `table`: the dm table language and every target's constructor.
//! The checks live in `blkstack_mapped::fuzzing`, shared with the stable corpus replay test.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    blkstack_mapped::fuzzing::table(data);
});
