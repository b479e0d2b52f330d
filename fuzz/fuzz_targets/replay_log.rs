//! libFuzzer target `replay_log`: a dm-log-writes log read, replayed and
//! walked to its crash points as `replay-log` and `crashtest` do. The
//! checks live in `blkstack_crashtest::fuzzing::log`, shared with the
//! stable corpus replay test.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = blkstack_crashtest::fuzzing::log(data);
});
