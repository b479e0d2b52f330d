//! libFuzzer target `control_json`: control socket JSON-RPC lines, parsed and dispatched.
//! The checks live in `blkstack_control::fuzzing`, shared with the stable corpus replay test.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    blkstack_control::fuzzing::request_lines(data);
});
