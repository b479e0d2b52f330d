//! Fuzzing entry point (cargo-fuzz's `control_json` target, and the stable
//! regression test that replays its corpus): JSON-RPC request lines, as
//! the control socket reads them, parsed and dispatched against a
//! throwaway registry, as dmsetup's ioctl interface must refuse any
//! malformed request and leave the device table as it was.
//!
//! Lines naming the `file` target or carrying numbers of more than seven
//! digits are skipped: the first would create files, the second could
//! build devices large enough to matter (both are tested elsewhere).

use crate::methods::Control;
use crate::server::handle_line;
use blkstack_mapped::Registry;
use serde_json::Value;

/// Devices a fuzzed request may name.
const BASE_DEVICES: &str = "base,,,rw,0 16384 memory;z0,,,ro,0 8192 zero";

/// Run each line of `input` as one request, in order, on one registry;
/// every answer must be one JSON-RPC 2.0 response object.
pub fn request_lines(input: &[u8]) {
    let reg = Registry::new();
    reg.create_concise(BASE_DEVICES)
        .expect("the fuzzing base devices");
    let control = Control::new(reg.clone(), None);
    for line in input.split(|&b| b == b'\n') {
        if !harmless(line) {
            continue;
        }
        let Some(answer) = handle_line(&control, line) else {
            continue;
        };
        let v: Value = serde_json::from_str(&answer)
            .unwrap_or_else(|e| panic!("answer {answer:?} is not JSON: {e}"));
        assert_eq!(v["jsonrpc"], "2.0", "answer {answer:?}");
        assert!(
            v.get("result").is_some() != v.get("error").is_some(),
            "answer {answer:?} has not exactly one of result and error"
        );
    }
    reg.remove_all();
}

/// See the module documentation.
fn harmless(line: &[u8]) -> bool {
    let mut digits = 0;
    for &b in line {
        digits = if b.is_ascii_digit() { digits + 1 } else { 0 };
        if digits > 7 {
            return false;
        }
    }
    !line.windows(4).any(|w| w.eq_ignore_ascii_case(b"file"))
}
