//! libFuzzer target `fio_jobfile`: fio job files and option values into JobSpecs (nothing runs).
//! The checks live in `blkstack_bench::fuzzing`, shared with the stable corpus replay test.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    blkstack_bench::fuzzing::jobfile(data);
});
