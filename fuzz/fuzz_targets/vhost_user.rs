//! libFuzzer target `vhost_user`: one VMM connection's vhost-user
//! messages (with the file descriptors a VMM attaches) and guest memory,
//! against the real vhost-user-blk backend over a unix socket. The
//! harness is `blkstack_vhost_user_blk::fuzzing::session`, shared with
//! the stable corpus replay test.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let reg = blkstack_mapped::Registry::new();
    if let Ok(dev) = reg.create("disk", "0 2048 memory") {
        blkstack_vhost_user_blk::fuzzing::session(dev, data);
    }
    reg.remove_all();
});
