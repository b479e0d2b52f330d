//! The kernel half of the kernel parity suite: one guest shell script
//! that runs every corpus case through Linux 6.12's device-mapper with
//! `dmsetup` (create, table, status, message as dm-ioctl.c answers them;
//! `create -r` for verity tables, which dm-verity requires)
//! and busybox `dd` with O_DIRECT over the legs attached as virtio disks,
//! and the parser that turns what it printed into a transcript. All cases
//! share one boot: a TCG boot costs about ten seconds.

use super::{
    normalise, pattern_skip, subst, BadCase, CrossCase, GoodCase, Step, Transcript, HELD_SNAP_SECS,
    LEGS,
};
use std::collections::BTreeMap;

/// Shell-quotes one word.
fn q(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// What the guest calls a placeholder's device.
fn dev_path(p: &str) -> String {
    match p.strip_prefix("d:") {
        Some(aux) => format!("/dev/mapper/a_{aux}"),
        None if p == "none" => "/dev/none".to_string(),
        None => format!("/dev/disk/by-serial/{p}"),
    }
}

/// Shell helpers. Under TCG every exec costs tens of milliseconds, so
/// they use the shell's own `read`/`case` rather than sed and grep.
const PRELUDE: &str = r#"
prefix() { while IFS= read -r l; do echo "$1: $l"; done; }
snap() { dmsetup table --showkeys "$1" | prefix table; dmsetup status "$1" | prefix status; }
stat() { dmsetup status "$1" | prefix status; }
legs() {
  printf 'legs:'
  for s in "$@"; do
    set -- $(dd if=/dev/disk/by-serial/$s bs=64k iflag=direct 2>/dev/null | md5sum)
    printf ' %s=%s' "$s" "$1"
  done
  echo
}
mkdev() { n=$1; shift; printf '%s\n' "$@" | dmsetup create "$n" 2>/dev/null; }
mkro() { n=$1; shift; printf '%s\n' "$@" | dmsetup create -r "$n" 2>/dev/null; }
mapdev() { echo "map $1 $(dmsetup info -c --noheadings -o major,minor "$1")"; }
klog() {
  dmesg -c > /tmp/klog
  while IFS= read -r l; do
    case $l in
      *'error adding target to table'*|*'unable to determine table type'*|*' loaded'*) ;;
      *'verity: '*' using '*) ;;
      *device-mapper:*) echo "log: device-mapper:${l#*device-mapper:}"; break ;;
    esac
  done < /tmp/klog
}
result() { if [ "$1" = 0 ]; then echo "step $2: ok$3"; else echo "step $2: error"; fi; }
# refused: dmsetup's first line ends in the errno text after "failed: "
nl='
'
refused() { e=${1%%"$nl"*}; echo "result: refused: ${e##*failed: }"; }
md5() { set -- $(md5sum < "$1"); echo " $1"; }
for s in LEGS; do
  d=$(readlink /dev/disk/by-serial/$s)
  echo "map $s $(cat /sys/block/${d##*/}/dev)"
done
# dm-crypt's ciphers: the crypto API's request_module needs them loaded;
# dm-cache's policies likewise.
for m in dm-crypt xts essiv crypto_null dm-cache dm-cache-smq; do modprobe $m 2>/dev/null; done
dmesg -c >/dev/null
"#;

fn table_words(lines: &[String]) -> String {
    lines
        .iter()
        .map(|l| q(&subst(l, &dev_path)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Whether a table must be loaded read-only: dm-verity refuses any
/// other ("Device must be readonly"), which case `verity-rw` shows.
fn read_only(id: &str, lines: &[String]) -> bool {
    id != "verity-rw"
        && lines
            .iter()
            .any(|l| l.split_whitespace().nth(2) == Some("verity"))
}

fn bad(c: &BadCase, s: &mut String) {
    let ro = if read_only(&c.id, &c.lines) {
        " -r"
    } else {
        ""
    };
    s.push_str(&format!(
        "echo {}\nif e=$(printf '%s\\n' {} | dmsetup create{ro} b 2>&1); then echo 'result: accepted'; dmsetup table --showkeys b | prefix table; dmsetup remove b; else refused \"$e\"; fi\nklog\n",
        q(&format!("== {}", c.id)),
        table_words(&c.lines)
    ));
}

fn dd_write(skip: u64, sector: u64, count: u64) -> String {
    format!(
        "dd if=/test/pattern of=/dev/mapper/t bs={} count=1 iflag=skip_bytes skip={skip} oflag=seek_bytes,direct seek={} 2>/dev/null",
        count * 512,
        sector * 512
    )
}

fn dd_read(sector: u64, count: u64) -> String {
    format!(
        "rm -f /tmp/r; dd if=/dev/mapper/t of=/tmp/r bs={} count=1 iflag=skip_bytes,direct skip={} 2>/dev/null",
        count * 512,
        sector * 512
    )
}

fn step(st: &Step, legs: &str, writes: &mut u64, s: &mut String) {
    let label = q(&st.label());
    match st {
        Step::Msg { sector, words } => {
            let w: Vec<String> = words.iter().map(|w| q(&subst(w, &dev_path))).collect();
            s.push_str(&format!(
                "dmsetup message t {sector} {} 2>/dev/null; result $? {label}\n",
                w.join(" ")
            ));
        }
        Step::Write { sector, count } => {
            let skip = pattern_skip(*writes, *count) * 512;
            *writes += 1;
            s.push_str(&format!(
                "{}; result $? {label}; legs {legs}\n",
                dd_write(skip, *sector, *count)
            ));
        }
        Step::Reload { lines } => {
            s.push_str(&format!(
                "printf '%s\\n' {} | dmsetup reload t 2>/dev/null && dmsetup resume t; result $? {label}\n",
                table_words(lines)
            ));
        }
        Step::Read { sector, count } => {
            s.push_str(&format!(
                "{}; r=$?; result $r {label} \"$(md5 /tmp/r)\"\n",
                dd_read(*sector, *count)
            ));
        }
        Step::Held {
            write,
            sector,
            count,
        } => {
            // The I/O in the background, a snapshot while it is held.
            let dd = if *write {
                let skip = pattern_skip(*writes, *count) * 512;
                *writes += 1;
                dd_write(skip, *sector, *count)
            } else {
                dd_read(*sector, *count)
            };
            let after = if *write {
                format!("result $r {label}; legs {legs}")
            } else {
                format!("result $r {label} \"$(md5 /tmp/r)\"")
            };
            s.push_str(&format!(
                "{dd} & pid=$!; sleep {HELD_SNAP_SECS}; stat t; wait $pid; r=$?; {after}\n"
            ));
        }
    }
    s.push_str(if st.changes_table() {
        "snap t\n"
    } else {
        "stat t\n"
    });
}

fn good(c: &GoodCase, writes: &mut u64, s: &mut String) {
    s.push_str(&format!("echo {}\n", q(&format!("== {}", c.id))));
    for (name, table) in &c.devs {
        s.push_str(&format!(
            "mkdev a_{name} {} || echo 'helper {name} refused'; mapdev a_{name}\n",
            q(&subst(table, &dev_path))
        ));
    }
    let mk = if read_only(&c.id, &c.lines) {
        "mkro"
    } else {
        "mkdev"
    };
    s.push_str(&format!(
        "if {mk} t {}; then echo 'create: ok'; snap t\n",
        table_words(&c.lines)
    ));
    let legs = c.legs_used().join(" ");
    for st in &c.steps {
        step(st, &legs, writes, s);
    }
    s.push_str("dmsetup remove t; else echo 'create: refused'; fi\n");
    for (name, _) in c.devs.iter().rev() {
        s.push_str(&format!("dmsetup remove a_{name}\n"));
    }
    s.push_str("dmesg -c >/dev/null\n");
}

/// A cross case in the guest: read half 0 (written by blkstack before the
/// boot), write half 1 (read by blkstack after it).
fn cross(c: &CrossCase, k: u64, s: &mut String) {
    let (r_sector, r_count) = c.half(0);
    let (w_sector, w_count) = c.half(1);
    let skip = c.pattern_skip(k, 1) * 512;
    s.push_str(&format!(
        "echo {}\nmkdev x {} || echo 'create: refused'\nrm -f /tmp/r; dd if=/dev/mapper/x of=/tmp/r bs={} count=1 iflag=skip_bytes,direct skip={} 2>/dev/null; r=$?\nif [ $r = 0 ]; then echo \"kernel-read: ok$(md5 /tmp/r)\"; else echo 'kernel-read: error'; fi\ndd if=/test/pattern of=/dev/mapper/x bs={} count=1 iflag=skip_bytes skip={skip} oflag=seek_bytes,direct seek={} 2>/dev/null || echo 'kernel-write: error'\ndmsetup remove x\n",
        q(&format!("== {}", c.id)),
        q(&subst(&c.line, &dev_path)),
        r_count * 512,
        r_sector * 512,
        w_count * 512,
        w_sector * 512
    ));
}

/// The guest script for the whole corpus; the cross cases last, over leg
/// sectors no other case writes.
pub fn script(bad_cases: &[BadCase], good_cases: &[GoodCase], cross_cases: &[CrossCase]) -> String {
    let legs: Vec<&str> = LEGS.iter().map(|(n, _)| *n).collect();
    let mut s = PRELUDE.replace("LEGS", &legs.join(" "));
    for c in bad_cases {
        bad(c, &mut s);
    }
    let mut writes = 0;
    for c in good_cases {
        good(c, &mut writes, &mut s);
    }
    for (k, c) in cross_cases.iter().enumerate() {
        cross(c, k as u64, &mut s);
    }
    s.push_str("echo '== end'\n");
    s
}

/// The guest's output as a transcript: `map` lines give device numbers
/// their names, every other line after a `== ID` belongs to that case.
pub fn parse(out: &str) -> Transcript {
    let mut nums: BTreeMap<String, String> = BTreeMap::new();
    let mut t = Transcript::new();
    let mut cur: Option<String> = None;
    for l in out.lines() {
        if let Some(rest) = l.strip_prefix("map ") {
            if let Some((name, num)) = rest.split_once(' ') {
                nums.insert(num.trim().to_string(), name.to_string());
            }
        } else if let Some(id) = l.strip_prefix("== ") {
            cur = (id != "end").then(|| id.to_string());
            if let Some(id) = &cur {
                t.entry(id.clone()).or_default();
            }
        } else if let Some(id) = &cur {
            t.entry(id.clone()).or_default().push(normalise(l, &nums));
        }
    }
    t
}
