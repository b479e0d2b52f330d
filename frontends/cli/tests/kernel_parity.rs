//! The kernel parity suite: blkstack's targets beside Linux 6.12's own
//! device-mapper (dm-linear.c, dm-stripe.c, dm-zero.c, dm-target.c,
//! dm-delay.c, dm-flakey.c, dm-mpath.c and dm-ps-*.c, dm-snap.c
//! (snapshot, snapshot-origin), dm-exception-store.c and
//! dm-snap-persistent.c (refusals), dm-verity-target.c, dm-table.c), case by
//! case: the same tables refused, the same `table`/`status` text after
//! messages and I/O, the same data on the legs.
//!
//! `kernel_transcript_is_the_kernels` boots the kernel VM (skipped, saying
//! so, where qemu-system-x86_64 is missing), runs every case in one boot
//! and checks the recorded kernel transcript against it, and the corpus's
//! `ti->error` annotations against the kernel's log.
//! `blkstack_matches_the_kernel` runs every case through blkstack and
//! compares with the recorded kernel transcript; every difference must be
//! listed as deliberate, and docs/KERNEL-PARITY.md must be what the
//! comparison generates. `BLKSTACK_UPDATE_PARITY=1` rewrites the
//! transcript (VM test) and the page (blkstack test) instead.
//! `blkstack_create_refuses_what_the_kernel_refuses` sends every refused
//! table through the real `blkstack serve` and `blkstack create`, as a
//! user would, and checks dmsetup's errno text on stderr.

mod kernel_parity_support;
mod kernel_vm_support;

use kernel_parity_support::*;
use std::collections::BTreeMap;

fn recorded() -> Transcript {
    let p = transcript_path();
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| {
        panic!(
            "{}: {e}: record it with BLKSTACK_UPDATE_PARITY=1 cargo test -p blkstack --test kernel_parity kernel_transcript",
            p.display()
        )
    });
    parse_transcript(&text)
}

fn unique_ids(bad: &[BadCase], good: &[GoodCase]) {
    let mut seen = std::collections::BTreeSet::new();
    for id in bad.iter().map(|c| &c.id).chain(good.iter().map(|c| &c.id)) {
        assert!(seen.insert(id), "case id {id} used twice");
    }
}

/// The kernel's log must show the `ti->error` the corpus names for each
/// table it refuses (and a table marked accepted must be).
fn check_annotations(bad: &[BadCase], kernel: &Transcript) {
    let mut wrong = Vec::new();
    for c in bad {
        let lines = kernel.get(&c.id).cloned().unwrap_or_default();
        let accepted = lines.iter().any(|l| l == "result: accepted");
        let ok = if c.error.starts_with('(') {
            accepted
        } else {
            !accepted
                && lines
                    .iter()
                    .any(|l| l.starts_with("log: ") && l.contains(&c.error))
        };
        if !ok {
            wrong.push(format!(
                "{} ({}): want '{}': {lines:?}",
                c.id, c.file, c.error
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "the kernel's answers do not match bad-tables.txt:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn kernel_transcript_is_the_kernels() {
    let (bad, good, cross) = (bad_cases(), good_cases(), cross_cases());
    unique_ids(&bad, &good);
    let script = kernel_side::script(&bad, &good, &cross);
    // For a person debugging the guest side: the script as it runs.
    if let Some(p) = std::env::var_os("BLKSTACK_PARITY_SCRIPT") {
        std::fs::write(p, &script).expect("write the guest script");
    }
    if !kernel_vm_support::vm_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    make_images(dir.path());
    // blkstack writes the first half of each cross table before the boot.
    blkstack_side::cross(dir.path(), &cross, 0);
    let mut vm = kernel_vm_support::Vm::new().timeout(300);
    for (name, _) in LEGS {
        vm = vm.disk(
            name,
            &dir.path().join(format!("{name}.img")).display().to_string(),
        );
    }
    let run = vm
        .file(&dir.path().join("pattern"), "/test/pattern")
        .run(&script);
    run.assert_ok("kernel parity guest script");
    eprintln!(
        "kernel VM: {} cases in {:?}",
        bad.len() + good.len(),
        run.elapsed
    );
    let mut live = kernel_side::parse(&run.out);
    // ... and reads the second half, which the kernel wrote, after it.
    for (c, line) in cross
        .iter()
        .zip(blkstack_side::cross(dir.path(), &cross, 1))
    {
        live.entry(c.id.clone()).or_default().push(line);
    }
    check_annotations(&bad, &live);
    let crossed = cross_outcomes(&cross, &live);
    assert!(
        crossed.values().all(|ok| *ok),
        "data written through one stack does not read back through the other: {crossed:?}\n{:?}",
        cross.iter().map(|c| live.get(&c.id)).collect::<Vec<_>>()
    );
    if updating() {
        std::fs::write(transcript_path(), render_transcript(&live)).expect("write transcript");
        return;
    }
    let rec = recorded();
    for (id, lines) in &live {
        assert_eq!(
            rec.get(id).map(|l| compared(l)),
            Some(compared(lines)),
            "{id}: the recorded kernel transcript is stale (BLKSTACK_UPDATE_PARITY=1 rewrites it)"
        );
    }
    assert_eq!(rec.len(), live.len(), "recorded transcript has other cases");
}

#[test]
fn blkstack_matches_the_kernel() {
    let (bad, good, cross) = (bad_cases(), good_cases(), cross_cases());
    unique_ids(&bad, &good);
    let kernel = recorded();
    check_annotations(&bad, &kernel);
    let crossed = cross_outcomes(&cross, &kernel);
    let dir = tempfile::tempdir().expect("tempdir");
    let ours = blkstack_side::run(dir.path(), &bad, &good, &cross);
    let deliberate = notes("deliberate.txt");
    let fixed = notes("fixed.txt");
    let mut same = BTreeMap::new();
    let mut unexpected = Vec::new();
    let ids = bad.iter().map(|c| &c.id).chain(good.iter().map(|c| &c.id));
    let cases = kernel.len() - crossed.len();
    assert_eq!(
        cases,
        ids.clone().count(),
        "the recorded transcript has other cases: re-record it"
    );
    // In corpus order: the legs carry data from case to case.
    for id in ids {
        let k = kernel
            .get(id)
            .unwrap_or_else(|| panic!("{id}: no recorded kernel answer: re-record it"));
        let b = &ours[id];
        let equal = compared(k) == compared(b);
        same.insert(id.clone(), equal);
        let listed = deliberate.iter().any(|n| &n.id == id);
        if equal == listed {
            unexpected.push(format!(
                "{id}: {}\n  kernel:   {:?}\n  blkstack: {:?}",
                if listed {
                    "listed as deliberately different but the same"
                } else {
                    "differs"
                },
                compared(k),
                compared(b)
            ));
        }
    }
    for (id, _) in crossed.iter().filter(|(_, ok)| !**ok) {
        unexpected.push(format!(
            "{id}: the recorded cross reads are not the patterns written"
        ));
    }
    for n in fixed.iter().filter(|n| same.get(&n.id) != Some(&true)) {
        unexpected.push(format!("fixed.txt: {} is not the same", n.id));
    }
    let page = page::render(
        &bad,
        &good,
        &page::Outcomes {
            same: &same,
            fixed: &fixed,
            deliberate: &deliberate,
            cross: &cross,
            crossed: &crossed,
        },
    );
    if updating() {
        std::fs::write(page_path(), &page).expect("write page");
    }
    assert!(
        unexpected.is_empty(),
        "blkstack and the kernel differ (the legs carry data from case to case, so the first case whose legs differ is the one to look at):\n{}",
        unexpected.join("\n")
    );
    let committed = std::fs::read_to_string(page_path()).unwrap_or_default();
    assert!(
        committed == page,
        "docs/KERNEL-PARITY.md is not what the comparison generates (BLKSTACK_UPDATE_PARITY=1 rewrites it)"
    );
}

#[test]
fn blkstack_create_refuses_what_the_kernel_refuses() {
    let (bad, kernel) = (bad_cases(), recorded());
    let deliberate = notes("deliberate.txt");
    let dir = tempfile::tempdir().expect("tempdir");
    make_images(dir.path());
    let concise: Vec<String> = LEGS
        .iter()
        .map(|(n, s)| {
            let img = dir.path().join(format!("{n}.img"));
            format!("{n},,,rw,0 {s} file {}", img.display())
        })
        .collect();
    let srv = blkstack_test_support::Serve::start(&concise.join(";"), "l0");
    let mut wrong = Vec::new();
    for c in bad
        .iter()
        .filter(|c| !deliberate.iter().any(|n| n.id == c.id))
    {
        let lines = kernel.get(&c.id).cloned().unwrap_or_default();
        let Some(errno) = lines
            .iter()
            .find_map(|l| l.strip_prefix("result: refused: "))
        else {
            wrong.push(format!("{}: the kernel accepted it", c.id));
            continue;
        };
        let table: Vec<String> = c
            .lines
            .iter()
            .map(|l| subst(l, &|p| p.to_string()))
            .collect();
        let out = srv.run_stdin("create", &["b"], Some(&table.join("\n")));
        // dmsetup: "device-mapper: reload ioctl on b ... failed: <errno text>"
        let said = out.stderr.contains(&format!("failed: {errno}"));
        if out.status.code() != Some(1) || !said {
            wrong.push(format!(
                "{}: want '{errno}', got {:?}: {}",
                c.id,
                out.status,
                out.stderr.trim()
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "blkstack create answers otherwise:\n{}",
        wrong.join("\n")
    );
}
