#!/usr/bin/env bash
# bench-crypt.sh — issue 38's crypt benchmark: `crypt aes-xts-plain64` over
# `memory`, in-process (blkstack bench) and served over NBD, against
# qemu-nbd serving a LUKS2 image through qemu's luks driver and nbdkit's
# luks filter on a LUKS1 image (both images on /dev/shm, AES-256-XTS, the
# same cipher as ours; a qemu whose luks driver cannot open LUKS2, as
# Debian 12's, serves the LUKS1 image, and the table says so); then the
# cipher crates' own single-thread throughput (cargo bench -p
# blkstack-mapped --bench crypt), the limit the in-process 1 MiB rows are
# set against.
#
# Rows (fio options; the NBD ones with fio --ioengine=nbd, libnbd):
#   randread4k-qd32, randwrite4k-qd32, read1m-qd4, write1m-qd4
# Each repetition runs every row on every stack one after the other
# (interleaved, so a noisy moment on a shared machine hits all alike);
# the table gives medians over the repetitions and ours / the best peer.
# Every device is written once in full, unmeasured, before its rows.
#
# Usage: scripts/bench-crypt.sh                  (REPS=3 RUNTIME=5 SIZE_MIB=1024)
#        BLKSTACK=target/release/blkstack scripts/bench-crypt.sh   (skip the build)
#        REPS=1 RUNTIME=1 SIZE_MIB=64 CRATES=0 scripts/bench-crypt.sh   (a smoke run)
# Needs fio (with its nbd engine), nbdkit (luks filter), qemu-nbd,
# cryptsetup; `make deps` installs them.
set -euo pipefail

REPS=${REPS:-3}
RUNTIME=${RUNTIME:-5}
SIZE_MIB=${SIZE_MIB:-1024}
CRATES=${CRATES:-1}
ROWS=${ROWS:-"randread4k-qd32 randwrite4k-qd32 read1m-qd4 write1m-qd4"}
STACKS=${STACKS:-"inproc ours qemu nbdkit"}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/bench-crypt.XXXXXX)
SHM=$(mktemp -d /dev/shm/bench-crypt.XXXXXX)
SOCK="$WORK/nbd.sock"
SERVER_PID=""
KEY=$(printf '%0128x' 0 | tr 0 7)
fio() { HOME="$WORK" command fio "$@"; }

stop_server() {
    if [ -n "$SERVER_PID" ]; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=""
    fi
    rm -f "$SOCK"
}
cleanup() { stop_server; rm -rf "$WORK" "$SHM"; }
trap cleanup EXIT

for t in fio nbdkit qemu-nbd cryptsetup python3; do
    command -v "$t" >/dev/null || [ -x "/usr/sbin/$t" ] || { echo "missing $t (make deps)" >&2; exit 1; }
done
CRYPTSETUP=$(command -v cryptsetup || echo /usr/sbin/cryptsetup)
if [ -z "${BLKSTACK:-}" ]; then
    echo "building blkstack (release)..." >&2
    (cd "$ROOT" && cargo build --release -q -p blkstack)
    BLKSTACK="$ROOT/target/release/blkstack"
fi

# The peers' images: the same data size after their LUKS headers, low KDF
# cost (opening speed is not measured).
printf 'bench' >"$WORK/pass"
IMG_MIB=$((SIZE_MIB + 16))
truncate -s ${IMG_MIB}M "$SHM/luks2.img" "$SHM/luks1.img"
"$CRYPTSETUP" luksFormat --batch-mode --type luks2 --key-file "$WORK/pass" --cipher aes-xts-plain64 \
    --key-size 512 --pbkdf pbkdf2 --pbkdf-force-iterations 1000 "$SHM/luks2.img"
"$CRYPTSETUP" luksFormat --batch-mode --type luks1 --key-file "$WORK/pass" --cipher aes-xts-plain64 \
    --key-size 512 --pbkdf-force-iterations 1000 "$SHM/luks1.img"
# qemu before 8.x has no LUKS2 in its luks driver ("LUKS version 2 is
# not supported"): it then serves the LUKS1 image, and the table says so.
QEMU_LUKS=luks2
if ! qemu-img info --object "secret,id=sec0,file=$WORK/pass" \
    --image-opts "driver=luks,key-secret=sec0,file.driver=file,file.filename=$SHM/luks2.img" >/dev/null 2>&1; then
    echo "NOTE: this qemu's luks driver cannot open LUKS2; qemu-nbd serves the LUKS1 image" >&2
    QEMU_LUKS=luks1
fi
SECTORS=$((SIZE_MIB * 2048))
printf 'm: 0 %s memory\nc: 0 %s crypt aes-xts-plain64 %s 0 m 0\n' "$SECTORS" "$SECTORS" "$KEY" >"$WORK/crypt.stack"

wait_socket() {
    for _ in $(seq 1 200); do
        [ -S "$SOCK" ] && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || return 1
        sleep 0.05
    done
    return 1
}

start_server() {
    rm -f "$SOCK"
    case $1 in
    ours) "$BLKSTACK" serve --stack "$WORK/crypt.stack" --export c \
        --listen "nbd+unix:///?socket=$SOCK" >"$WORK/srv.log" 2>&1 & ;;
    qemu) qemu-nbd -t --shared=8 -x c --socket="$SOCK" --cache=writeback \
        --object "secret,id=sec0,file=$WORK/pass" \
        --image-opts "driver=luks,key-secret=sec0,file.driver=file,file.filename=$SHM/$QEMU_LUKS.img" \
        >"$WORK/srv.log" 2>&1 & ;;
    nbdkit) nbdkit -f --unix "$SOCK" --exportname c --filter=luks file "$SHM/luks1.img" \
        passphrase=+"$WORK/pass" >"$WORK/srv.log" 2>&1 & ;;
    esac
    SERVER_PID=$!
    wait_socket || { echo "$1 did not start:" >&2; cat "$WORK/srv.log" >&2; SERVER_PID=""; return 1; }
}

row_fio() {
    case $1 in
    randread4k-qd32) echo "--rw=randread --bs=4k --iodepth=32" ;;
    randwrite4k-qd32) echo "--rw=randwrite --bs=4k --iodepth=32" ;;
    read1m-qd4) echo "--rw=read --bs=1m --iodepth=4" ;;
    write1m-qd4) echo "--rw=write --bs=1m --iodepth=4" ;;
    esac
}

RESULTS="$WORK/results.tsv"
: >"$RESULTS"
record() {
    python3 - "$@" >>"$RESULTS" <<'EOF'
import json, sys
path, rep, row, who = sys.argv[1:5]
text = open(path).read()
j = json.loads(text[text.index("{"):])["jobs"][0]
mbs = (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / 1e6
iops = j["read"]["iops"] + j["write"]["iops"]
print(f"{rep}\t{row}\t{who}\t{iops:.0f}\t{mbs:.1f}")
EOF
    tail -1 "$RESULTS" | awk -F'\t' '{ printf "rep %s %-18s %-7s %9s IOPS %8s MB/s\n", $1, $2, $3, $4, $5 }' >&2
}

for rep in $(seq 1 "$REPS"); do
    for who in $STACKS; do
        if [ "$who" = inproc ]; then
            # One process per row: the memory target starts empty, so each
            # run fills it first (unmeasured, a separate job before the row).
            for row in $ROWS; do
                # shellcheck disable=SC2046
                "$BLKSTACK" bench --stack "$WORK/crypt.stack" --filename=c \
                    --name=fill --rw=write --bs=1m --iodepth=4 --stonewall \
                    --name=bench $(row_fio "$row") --time_based --runtime="$RUNTIME" \
                    --output-format=json >"$WORK/out.json" 2>"$WORK/err" ||
                    { echo "inproc $row failed:" >&2; cat "$WORK/err" >&2; continue; }
                python3 - "$WORK/out.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1])); j["jobs"] = [j["jobs"][-1]]
json.dump(j, open(sys.argv[1], "w"))
EOF
                record "$WORK/out.json" "$rep" "$row" inproc
            done
            continue
        fi
        start_server "$who" || continue
        fio --name=fill --ioengine=nbd --uri="nbd+unix:///c?socket=$SOCK" \
            --rw=write --bs=1m --iodepth=4 >/dev/null 2>&1 || true
        for row in $ROWS; do
            # shellcheck disable=SC2046
            fio --name=bench --ioengine=nbd --uri="nbd+unix:///c?socket=$SOCK" \
                $(row_fio "$row") --time_based --runtime="$RUNTIME" \
                --output-format=json >"$WORK/out.json" 2>"$WORK/err" ||
                { echo "$who $row failed:" >&2; cat "$WORK/err" >&2; continue; }
            record "$WORK/out.json" "$rep" "$row" "$who"
        done
        stop_server
    done
done

python3 - "$RESULTS" "$REPS" "$RUNTIME" "$SIZE_MIB" "$QEMU_LUKS" <<'EOF'
import sys, statistics
from collections import defaultdict
path, reps, runtime, size, qemu_luks = sys.argv[1:]
iops = defaultdict(list); mbs = defaultdict(list); rows = []
for line in open(path):
    rep, row, who, i, m = line.rstrip("\n").split("\t")
    iops[row, who].append(float(i)); mbs[row, who].append(float(m))
    if row not in rows: rows.append(row)
med = lambda v: statistics.median(v) if v else float("nan")
print(f"\ncrypt aes-xts-plain64 (512-bit key), {size} MiB, medians of {reps} interleaved runs of {runtime} s; qemu-nbd on a {qemu_luks.upper()} image, nbdkit on LUKS1")
print(f"{'row':<18} {'in-process':>11} {'ours NBD':>9} {'qemu-nbd':>9} {'nbdkit':>9} {'NBD/best':>9} {'inproc/best':>12}   (IOPS; MB/s for 1m rows)")
for row in rows:
    v = mbs if "1m" in row else iops
    c = {w: med(v[row, w]) for w in ("inproc", "ours", "qemu", "nbdkit")}
    best = max(c["qemu"], c["nbdkit"])
    f = lambda a, b: a / b if b == b and b else float("nan")
    print(f"{row:<18} {c['inproc']:>11.0f} {c['ours']:>9.0f} {c['qemu']:>9.0f} {c['nbdkit']:>9.0f} {f(c['ours'], best):>9.2f} {f(c['inproc'], best):>12.2f}")
EOF

if [ "$CRATES" = 1 ]; then
    echo -e "\nthe cipher crates' own single-thread throughput (criterion):" >&2
    (cd "$ROOT" && cargo bench -q -p blkstack-mapped --bench crypt -- --noplot 2>&1 |
        grep -E "^aes|thrpt" || true)
fi
