//! The lab's report page as a person sees it: built by the real binary
//! from saved reports (no experiment runs, so the test is fast), then
//! rendered by a real headless browser (Debian's `chromium`), which must
//! find every experiment's section with its figures drawn and no broken
//! image. `lab compare` is run on two saved runs the same way.
//!
//! CI needs the `chromium` Debian package. Without a browser the test
//! fails and says so, unless BLKSTACK_SKIP_BROWSER=1 is set outside CI.

use std::path::{Path, PathBuf};
use std::process::Command;

const EXPERIMENTS: [&str; 5] = ["delay", "mq-run", "hybrid-poll", "sbitmap", "mpath"];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/lab-report")
}

fn blkstack(args: &[&str]) -> std::process::Output {
    let out = Command::new(env!("CARGO_BIN_EXE_blkstack"))
        .args(args)
        .output()
        .expect("run blkstack");
    assert!(
        out.status.success(),
        "blkstack {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A report directory holding every fixture, with its page built by
/// `blkstack lab report`.
fn built_page() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    for e in EXPERIMENTS {
        let name = format!("{e}.json");
        std::fs::copy(fixtures().join(&name), dir.path().join(&name)).expect("copy fixture");
    }
    let out = dir.path().to_str().expect("utf-8 temp path").to_string();
    blkstack(&["lab", "report", "--out", &out]);
    let page = dir.path().join("index.html");
    assert!(page.exists(), "lab report wrote no index.html");
    for e in EXPERIMENTS {
        let svg = std::fs::read_to_string(dir.path().join(format!("{e}.svg")))
            .unwrap_or_else(|err| panic!("lab report did not redraw {e}.svg: {err}"));
        assert!(svg.starts_with("<svg"), "{e}.svg is not an SVG");
    }
    (dir, page)
}

fn browser() -> Option<&'static str> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| {
            Command::new(b)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
}

/// Appended to a copy of the page: what the browser laid out, per
/// section, written into the DOM for `--dump-dom` to return.
const PROBE: &str = r#"<script>
const out = {sections: {}, images: [], broken: 0};
for (const s of document.querySelectorAll("section.experiment")) {
  const svgs = [...s.querySelectorAll("svg")].map(v => {
    const r = v.getBoundingClientRect();
    return {w: Math.round(r.width), h: Math.round(r.height),
            paths: v.querySelectorAll("polyline,path,rect,circle,line").length,
            texts: v.querySelectorAll("text").length};
  });
  out.sections[s.id] = {svgs, checks: s.querySelectorAll("ul.checks li").length};
}
for (const i of document.images) {
  out.images.push(i.src);
  if (!i.complete || i.naturalWidth === 0) out.broken++;
}
const pre = document.createElement("pre");
pre.id = "probe";
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"#;

fn run_browser(browser: &str, args: &[&str]) -> String {
    let out = Command::new("timeout")
        .arg("180")
        .arg(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
        ])
        .args(args)
        .output()
        .expect("run the browser");
    assert!(
        out.status.success(),
        "{browser} {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn report_page_renders_every_section_with_its_figures() {
    let (dir, page) = built_page();
    let Some(browser) = browser() else {
        if std::env::var_os("BLKSTACK_SKIP_BROWSER").is_some() {
            blkstack_test_support::skip(
                "no browser and BLKSTACK_SKIP_BROWSER set: the page was not rendered",
            );
            return;
        }
        panic!("no headless browser: install Debian's `chromium` (or set BLKSTACK_SKIP_BROWSER=1)");
    };
    let html = std::fs::read_to_string(&page).expect("read page");
    for fetch in [" src=\"http", "<link", "@import"] {
        assert!(!html.contains(fetch), "the page fetches something: {fetch}");
    }
    let probe = dir.path().join("probe.html");
    std::fs::write(&probe, html.replace("</body>", &format!("{PROBE}</body>"))).expect("write");
    let dom = run_browser(
        browser,
        &["--dump-dom", &format!("file://{}", probe.display())],
    );
    let json = dom
        .split("<pre id=\"probe\">")
        .nth(1)
        .and_then(|s| s.split("</pre>").next())
        .unwrap_or_else(|| {
            panic!(
                "the probe did not run; DOM:\n{}",
                &dom[..dom.len().min(2000)]
            )
        })
        .replace("&quot;", "\"")
        .replace("&amp;", "&");
    let v: serde_json::Value = serde_json::from_str(&json).expect("probe JSON");
    assert_eq!(v["broken"], 0, "broken images: {}", v["images"]);
    for e in EXPERIMENTS {
        let s = &v["sections"][e];
        let svgs = s["svgs"]
            .as_array()
            .unwrap_or_else(|| panic!("no section {e}: {v}"));
        assert!(!svgs.is_empty(), "{e}: no figure");
        for svg in svgs {
            let (w, h) = (
                svg["w"].as_u64().unwrap_or(0),
                svg["h"].as_u64().unwrap_or(0),
            );
            assert!(w >= 300 && h >= 200, "{e}: figure laid out at {w}x{h}");
            assert!(
                svg["paths"].as_u64().unwrap_or(0) > 20,
                "{e}: figure has no drawing: {svg}"
            );
            assert!(
                svg["texts"].as_u64().unwrap_or(0) > 10,
                "{e}: figure has no labels: {svg}"
            );
        }
        assert!(
            s["checks"].as_u64().unwrap_or(0) >= 1,
            "{e}: no checks listed"
        );
    }
    // And a screenshot, as a person would look at it: a page of that
    // size with drawn figures is far from a blank image.
    let shot = dir.path().join("page.png");
    run_browser(
        browser,
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1200,4000",
            &format!("file://{}", page.display()),
        ],
    );
    let png = std::fs::read(&shot).expect("screenshot written");
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    assert!(
        png.len() > 50_000,
        "screenshot looks blank ({} bytes)",
        png.len()
    );
}

#[test]
fn page_sections_carry_upstream_link_checks_machine_and_command() {
    let (_dir, page) = built_page();
    let html = std::fs::read_to_string(page).expect("read page");
    for e in EXPERIMENTS {
        let start = html
            .find(&format!("<section id=\"{e}\""))
            .unwrap_or_else(|| panic!("no section {e}"));
        let section = &html[start..];
        let section = &section[..section.find("</section>").expect("section closed")];
        assert!(
            section.contains(&format!("../docs/UPSTREAM.md#{e}")),
            "{e}: link"
        );
        assert!(section.contains("Upstream figures"), "{e}: upstream table");
        assert!(
            section.contains("PASS") || section.contains("FAIL"),
            "{e}: checks"
        );
        assert!(
            section.contains("Reproduce: <code>cargo run --release -- lab "),
            "{e}"
        );
        assert!(section.contains("<svg"), "{e}: figure");
    }
    assert!(html.contains("Machine: "), "machine line missing");
}

#[test]
fn compare_shows_two_runs_side_by_side_and_refuses_mixed_inputs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = fixtures().join("mq-run.json");
    let text = std::fs::read_to_string(&a).expect("fixture");
    let mut v: serde_json::Value = serde_json::from_str(&text).expect("fixture JSON");
    let first = v["rows"][0]["on_kiops"].as_f64().expect("on_kiops");
    v["rows"][0]["on_kiops"] = serde_json::json!(first * 2.0);
    let b = dir.path().join("mq-run.json");
    std::fs::write(&b, v.to_string()).expect("write");
    let out = blkstack(&["lab", "compare", a.to_str().unwrap(), b.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("== lab compare mq-run"), "{text}");
    let line = text
        .lines()
        .find(|l| l.contains("on_kiops") && l.trim_end().ends_with("+100.0%"))
        .unwrap_or_else(|| panic!("no doubled on_kiops row:\n{text}"));
    assert!(line.contains("iodepth="), "{line}");
    let bad = Command::new(env!("CARGO_BIN_EXE_blkstack"))
        .args([
            "lab",
            "compare",
            a.to_str().unwrap(),
            dir.path().to_str().unwrap(),
        ])
        .output()
        .expect("run");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("two files or two directories"));
}
