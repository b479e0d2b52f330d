//! dmsetup's output text, built from the control socket's JSON answers,
//! so that a script written against `dmsetup info`/`ls`/`table`/`status`
//! reads blkstack's output unchanged.
//!
//! Formats follow lvm2's tools/dmsetup.c: `info` is the long form
//! (`_display_info_long`), `ls` prints `name\t(major:minor)`, `table` and
//! `status` prefix each line with `name: ` when they show several
//! devices, and `ls --tree` draws the dependency tree as dmsetup's
//! pstree-derived drawing does with UTF-8 line characters and the
//! `device` option (the default): roots are devices no other device uses,
//! children are a device's dependencies, each node `name (253:N)`.

use serde_json::Value;

/// dmsetup's answer when there is nothing to list.
pub const NO_DEVICES: &str = "No devices found\n";

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("")
}

fn n(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

fn b(v: &Value, k: &str) -> bool {
    v.get(k).and_then(Value::as_bool).unwrap_or(false)
}

fn devices(result: &Value) -> &[Value] {
    result
        .get("devices")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

/// `dmsetup info` (long form) for each device of an `info` result.
pub fn info(result: &Value) -> String {
    let devs = devices(result);
    if devs.is_empty() {
        return NO_DEVICES.into();
    }
    let mut out = String::new();
    for d in devs {
        let live = b(d, "live_table");
        let inactive = b(d, "inactive_table");
        out.push_str(&format!("Name:              {}\n", s(d, "name")));
        out.push_str(&format!(
            "State:             {}{}\n",
            if b(d, "suspended") {
                "SUSPENDED"
            } else {
                "ACTIVE"
            },
            if b(d, "read_only") {
                " (READ-ONLY)"
            } else {
                ""
            }
        ));
        out.push_str(&format!("Read Ahead:        {}\n", n(d, "read_ahead")));
        if !live && !inactive {
            out.push_str("Tables present:    None\n");
        } else {
            out.push_str(&format!(
                "Tables present:    {}{}{}\n",
                if live { "LIVE" } else { "" },
                if live && inactive { " & " } else { "" },
                if inactive { "INACTIVE" } else { "" }
            ));
        }
        out.push_str(&format!("Open count:        {}\n", n(d, "open_count")));
        out.push_str(&format!("Event number:      {}\n", n(d, "event_nr")));
        out.push_str(&format!(
            "Major, minor:      {}, {}\n",
            n(d, "major"),
            n(d, "minor")
        ));
        out.push_str(&format!("Number of targets: {}\n", n(d, "target_count")));
        if let Some(u) = d
            .get("uuid")
            .and_then(Value::as_str)
            .filter(|u| !u.is_empty())
        {
            out.push_str(&format!("UUID: {u}\n"));
        }
        out.push('\n');
    }
    out
}

/// `dmsetup table`/`status`: each device's lines under `key`, prefixed
/// with `name: ` when `prefix` (several devices shown). A device without
/// the text (no inactive table) prints nothing, as dmsetup does.
pub fn lines(result: &Value, key: &str, prefix: bool) -> String {
    let devs = devices(result);
    if devs.is_empty() {
        return NO_DEVICES.into();
    }
    let mut out = String::new();
    for d in devs {
        let Some(text) = d.get(key).and_then(Value::as_str) else {
            continue;
        };
        for line in text.lines() {
            if prefix {
                out.push_str(s(d, "name"));
                out.push_str(": ");
            }
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// `dmsetup deps`: `N dependencies\t: (MAJOR, MINOR)...`, prefixed with
/// `name: ` when several devices are shown.
pub fn deps(result: &Value, prefix: bool) -> String {
    let devs = devices(result);
    if devs.is_empty() {
        return NO_DEVICES.into();
    }
    let mut out = String::new();
    for d in devs {
        if prefix {
            out.push_str(s(d, "name"));
            out.push_str(": ");
        }
        let list = d
            .get("deps")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        out.push_str(&format!("{} dependencies\t:", list.len()));
        for x in list {
            out.push_str(&format!(" ({}, {})", n(x, "major"), n(x, "minor")));
        }
        out.push('\n');
    }
    out
}

/// `dmsetup ls`.
pub fn ls(result: &Value) -> String {
    let devs = devices(result);
    if devs.is_empty() {
        return NO_DEVICES.into();
    }
    devs.iter()
        .map(|d| format!("{}\t({}:{})\n", s(d, "name"), n(d, "major"), n(d, "minor")))
        .collect()
}

const BRANCH: &str = "├─";
const LAST: &str = "└─";
const VERT: &str = "│ ";
const EMPTY: &str = "  ";
/// dmsetup's MAX_DEPTH: deeper nodes are not drawn (the registry refuses
/// cycles, so this only bounds a pathological stack).
const MAX_DEPTH: usize = 100;

/// One device of an `ls` result: its number and its dependencies' names.
struct TreeNode {
    major: u64,
    minor: u64,
    deps: Vec<String>,
}

/// Draws the tree; `more[d]` says whether the node last drawn at depth
/// `d` has later siblings, which decides `├─` against `└─` and whether a
/// `│` continues below it (dmsetup's `_tree_more`).
struct TreeDrawer<'a> {
    nodes: &'a std::collections::BTreeMap<String, TreeNode>,
    more: Vec<bool>,
    out: String,
}

impl TreeDrawer<'_> {
    fn node(&mut self, name: &str, depth: usize, last: bool) {
        if depth >= MAX_DEPTH {
            return;
        }
        // A dependency removed between listing and drawing is skipped.
        let Some(me) = self.nodes.get(name) else {
            return;
        };
        self.more[depth] = !last;
        for d in 0..depth {
            self.out.push(' ');
            self.out.push_str(if d == depth - 1 {
                if self.more[depth] {
                    BRANCH
                } else {
                    LAST
                }
            } else if self.more[d + 1] {
                VERT
            } else {
                EMPTY
            });
        }
        self.out
            .push_str(&format!("{name} ({}:{})\n", me.major, me.minor));
        let count = me.deps.len();
        for (i, child) in me.deps.iter().enumerate() {
            self.node(child, depth + 1, i + 1 == count);
        }
    }
}

/// `dmsetup ls --tree`.
pub fn tree(result: &Value) -> String {
    let devs = devices(result);
    if devs.is_empty() {
        return NO_DEVICES.into();
    }
    let mut nodes = std::collections::BTreeMap::new();
    for d in devs {
        let deps = d
            .get("deps")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(|x| s(x, "name").to_string()).collect())
            .unwrap_or_default();
        nodes.insert(
            s(d, "name").to_string(),
            TreeNode {
                major: n(d, "major"),
                minor: n(d, "minor"),
                deps,
            },
        );
    }
    let roots: Vec<&String> = nodes
        .keys()
        .filter(|k| !nodes.values().any(|x| x.deps.contains(k)))
        .collect();
    let mut drawer = TreeDrawer {
        nodes: &nodes,
        more: vec![false; MAX_DEPTH + 1],
        out: String::new(),
    };
    let count = roots.len();
    for (i, r) in roots.iter().enumerate() {
        drawer.node(r, 0, i + 1 == count);
    }
    drawer.out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn dev(name: &str, minor: u64, deps: &[(&str, u64)]) -> Value {
        json!({
            "name": name, "major": 253, "minor": minor,
            "deps": deps.iter().map(|(n, m)| json!({"name": n, "major": 253, "minor": m})).collect::<Vec<_>>(),
        })
    }

    #[test]
    fn info_matches_dmsetup_long_form() {
        let r = json!({"devices": [{
            "name": "d0", "uuid": "U-1", "major": 253, "minor": 2, "suspended": true,
            "read_only": true, "live_table": true, "inactive_table": true, "open_count": 1,
            "event_nr": 3, "target_count": 2, "read_ahead": 256,
        }]});
        assert_eq!(
            info(&r),
            "Name:              d0\n\
             State:             SUSPENDED (READ-ONLY)\n\
             Read Ahead:        256\n\
             Tables present:    LIVE & INACTIVE\n\
             Open count:        1\n\
             Event number:      3\n\
             Major, minor:      253, 2\n\
             Number of targets: 2\n\
             UUID: U-1\n\n"
        );
        let r = json!({"devices": [{"name": "x", "major": 253, "minor": 0, "live_table": true,
            "read_ahead": 256, "uuid": null, "target_count": 1}]});
        let t = info(&r);
        assert!(t.contains("State:             ACTIVE\n"), "{t}");
        assert!(t.contains("Tables present:    LIVE\n"), "{t}");
        assert!(!t.contains("UUID"), "{t}");
        assert_eq!(info(&json!({"devices": []})), NO_DEVICES);
    }

    #[test]
    fn table_prefixes_every_line_when_several_devices() {
        let r = json!({"devices": [
            {"name": "a", "table": "0 8 zero\n8 8 error\n"},
            {"name": "b", "table": null},
        ]});
        assert_eq!(lines(&r, "table", true), "a: 0 8 zero\na: 8 8 error\n");
        assert_eq!(lines(&r, "table", false), "0 8 zero\n8 8 error\n");
    }

    #[test]
    fn deps_lists_major_minor_pairs() {
        let r = json!({"devices": [dev("a", 0, &[]), dev("b", 1, &[("a", 0), ("c", 2)])]});
        assert_eq!(
            deps(&r, true),
            "a: 0 dependencies\t:\nb: 2 dependencies\t: (253, 0) (253, 2)\n"
        );
    }

    #[test]
    fn ls_is_name_tab_major_minor() {
        let r = json!({"devices": [dev("a", 0, &[]), dev("b", 1, &[("a", 0)])]});
        assert_eq!(ls(&r), "a\t(253:0)\nb\t(253:1)\n");
    }

    #[test]
    fn tree_draws_like_dmsetup() {
        // top uses mid and m2; mid uses base; m2 uses base too.
        let r = json!({"devices": [
            dev("base", 0, &[]),
            dev("m2", 3, &[("base", 0)]),
            dev("mid", 1, &[("base", 0)]),
            dev("solo", 4, &[]),
            dev("top", 2, &[("mid", 1), ("m2", 3)]),
        ]});
        assert_eq!(
            tree(&r),
            "solo (253:4)\n\
             top (253:2)\n \
             ├─mid (253:1)\n \
             │  └─base (253:0)\n \
             └─m2 (253:3)\n    \
             └─base (253:0)\n"
        );
    }
}
