//! What blkstack's integration tests share, as cloud-hypervisor's
//! `test_infra` is shared by its tests: the one `blkstack serve` harness
//! ([`Serve`]), bounded child processes and the tools they run
//! ([`tool`], [`thin_check`]), test data ([`pattern`], [`Scratch`]), and
//! skipping.
//!
//! [`skip`] is the one way a test gives up because something outside the
//! project is missing (a tool, the kernel VM, network namespaces): a run
//! that skipped must never read as a run that passed. Under CI (the `CI`
//! variable set, as CI services and `.ci/run` set it) the test fails,
//! naming what is missing; elsewhere it prints one line saying what was
//! skipped and why.

pub mod data;
pub mod pdata;
pub mod process;
pub mod serve;

pub use data::{pattern, pattern_file, pattern_file_with_holes, Scratch};
pub use pdata::{era_invalidated, era_written_since, pdata_tool_ok};
pub use process::{
    rss_kib, run, run_bounded, run_ok, status_kib, thin_check, thin_dump, tool, wait_bounded, Out,
};
pub use serve::{blkstack_bin, Control, Serve, VERB_DEADLINE};

use std::ffi::OsStr;

/// Whether a `CI` variable with this value means a CI run: set, and not
/// empty, `0` or `false`.
fn is_ci(value: Option<&OsStr>) -> bool {
    value.is_some_and(|v| !v.is_empty() && v != "0" && v != "false")
}

/// Whether this run is CI's: every test must run there.
pub fn under_ci() -> bool {
    is_ci(std::env::var_os("CI").as_deref())
}

fn skip_as(ci: bool, test: &str, why: &str) {
    if ci {
        panic!("{test} cannot run, and CI runs every test: {why}");
    }
    eprintln!("SKIP {test}: {why}");
}

/// Give up on the running test because of `why`: a panic (the test
/// fails) under CI, one `SKIP` line on stderr otherwise. Returns only
/// when not under CI, so the caller returns right after. The test is
/// named by its thread, which the test harness names after it.
pub fn skip(why: &str) {
    let thread = std::thread::current();
    skip_as(under_ci(), thread.name().unwrap_or("this test"), why)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_counts_as_ci() {
        assert!(!is_ci(None));
        for off in ["", "0", "false"] {
            assert!(!is_ci(Some(OsStr::new(off))), "{off:?}");
        }
        for on in ["true", "1", "yes"] {
            assert!(is_ci(Some(OsStr::new(on))), "{on:?}");
        }
    }

    #[test]
    fn a_skip_under_ci_fails_naming_what_is_missing() {
        let r = std::panic::catch_unwind(|| skip_as(true, "kernel_nbd", "no qemu-system-x86_64"));
        let msg = r.expect_err("a skip under CI must fail the test");
        let text = msg.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(
            text.contains("kernel_nbd") && text.contains("no qemu-system-x86_64"),
            "{text}"
        );
        // Elsewhere it returns, and the caller returns.
        skip_as(false, "kernel_nbd", "no qemu-system-x86_64");
    }
}
