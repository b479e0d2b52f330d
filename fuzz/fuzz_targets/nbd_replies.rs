//! libFuzzer target `nbd_replies`: a server's reply stream through the `nbd` leaf's reply reader.
//! The checks live in `blkstack_drivers::nbd::fuzzing`, shared with the stable corpus replay test.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = blkstack_drivers::nbd::fuzzing::replies(data);
});
