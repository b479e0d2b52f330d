//! libFuzzer target `nbd_server`: a client byte stream through the NBD server's handshake and transmission state machine.
//! The checks live in `blkstack_nbd::fuzzing`, shared with the stable corpus replay test.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = blkstack_nbd::fuzzing::handshake_and_transmission(data);
});
