//! The `examples/mpath*.stack` files build, and their multipath device
//! carries data: a user who copies one gets a working stack.

use blkstack_core::sync::submit_and_wait;
use blkstack_core::{Op, Status};
use blkstack_mapped::Registry;

#[test]
fn example_stacks_build_and_do_io() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if !(name.starts_with("mpath") && name.ends_with(".stack")) {
            continue;
        }
        seen += 1;
        let text = std::fs::read_to_string(&path).unwrap();
        let reg = Registry::new();
        let names = reg
            .create_stack(&text)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(names.iter().any(|n| n == "mpath0"), "{name}: no mpath0");
        let dev = reg.device("mpath0").unwrap();
        let mut w = vec![0x5au8; 4096];
        assert_eq!(
            submit_and_wait(&*dev, Op::Write, 8192, 4096, &mut w),
            Status::Ok,
            "{name}"
        );
        let mut r = vec![0u8; 4096];
        assert_eq!(
            submit_and_wait(&*dev, Op::Read, 8192, 4096, &mut r),
            Status::Ok,
            "{name}"
        );
        if text.contains(" memory") {
            assert_eq!(r, w, "{name}: data did not read back");
        }
        // The table it prints builds the same device again.
        let table = reg.table_text("mpath0").unwrap();
        reg.create("again", &table)
            .unwrap_or_else(|e| panic!("{name}: {table}: {e}"));
        assert_eq!(reg.table_text("again").unwrap(), table);
    }
    assert!(seen >= 2, "found {seen} mpath examples");
}
