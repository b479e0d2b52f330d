//! The build needs Rust and a C compiler, nothing else (the design notes'
//! "Building on a fresh machine"): no crate in the workspace's build
//! graph may run bindgen, which needs libclang at build time (issue 34:
//! the ublk frontend's former libublk did, through libublk-rs-sys). This
//! asks cargo for the graph the lock file describes, offline.
//!
//! The graph is followed along normal, build and dev edges alike: bindgen
//! is a build dependency of a crate that is itself a normal dependency,
//! so `-e build` alone would never reach it.

use std::process::Command;

/// Crates whose presence means a build needs libclang.
const NEEDS_LIBCLANG: [&str; 2] = ["bindgen", "clang-sys"];

#[test]
fn no_crate_in_the_build_graph_needs_libclang() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("the workspace root, two levels above frontends/cli");
    let out = Command::new(env!("CARGO"))
        .current_dir(root)
        .args([
            "tree",
            "--workspace",
            "--offline",
            "--locked",
            "-e",
            "normal,build,dev",
            "--prefix",
            "none",
        ])
        .output()
        .expect("running cargo tree");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "cargo tree failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Sanity: the graph is there (a crate of ours and a build dependency).
    assert!(
        stdout.lines().any(|l| l.starts_with("blkstack-ublk ")),
        "{stdout}"
    );
    let bad: Vec<&str> = stdout
        .lines()
        .filter(|l| {
            NEEDS_LIBCLANG
                .iter()
                .any(|c| l.starts_with(&format!("{c} ")))
        })
        .collect();
    assert!(
        bad.is_empty(),
        "crates that need libclang to build are back in the build graph:\n{}",
        bad.join("\n")
    );
}
