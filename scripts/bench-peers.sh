#!/usr/bin/env bash
# bench-peers.sh — blkstack's NBD server against the two usual peers,
# nbdkit and qemu-nbd, with the same fio nbd-engine jobs (libnbd client).
#
# Why this shape: one fio job file per row, the three servers run one
# after the other inside every repetition (interleaved, so a noisy moment
# on this shared 2-vCPU machine hits all three alike), medians over the
# repetitions, and the server's own CPU time per I/O read from
# /proc/PID/stat (utime+stime, all threads) before and after each run.
#
# Rows:
#   null 4k randread QD1, QD64 x1 job, QD64 x2 jobs (2 connections)
#   memory 4k randwrite QD16 (after an unmeasured full sequential fill)
#   delay 1 ms 4k randread QD1 and QD32 (ours: a `delay` target over `zero`;
#     nbdkit: null + --filter=delay rdelay=1ms; qemu: null-co latency-ns)
#
# Usage: scripts/bench-peers.sh            (REPS=3 RUNTIME=5 by default)
#        BLKSTACK=path/to/blkstack scripts/bench-peers.sh   (skip the build)
#        REPS=5 RUNTIME=10 scripts/bench-peers.sh
#        ROWS="null-qd1 null-qd64" scripts/bench-peers.sh
# Needs root or sudo only to install missing packages (fio, nbdkit,
# qemu-utils) with apt-get.
set -euo pipefail

REPS=${REPS:-3}
RUNTIME=${RUNTIME:-5}
ROWS=${ROWS:-"null-qd1 null-qd64 null-qd64x2 mem-randwrite-qd16 delay1ms-qd1 delay1ms-qd32"}
SIZE_BYTES=$((1 << 30))
SECTORS=$((SIZE_BYTES / 512))
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/bench-peers.XXXXXX)
SOCK="$WORK/nbd.sock"
QEMU_IMG="/dev/shm/bench-peers-$$.img"
SERVER_PID=""
CLK_TCK=$(getconf CLK_TCK)

cleanup() {
    if declare -F stop_server >/dev/null; then stop_server; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

# ---- dependencies -----------------------------------------------------------
need_pkgs=()
command -v fio >/dev/null || need_pkgs+=(fio)
command -v nbdkit >/dev/null || need_pkgs+=(nbdkit)
command -v qemu-nbd >/dev/null || need_pkgs+=(qemu-utils)
command -v python3 >/dev/null || need_pkgs+=(python3)
if ((${#need_pkgs[@]})); then
    echo "installing missing packages: ${need_pkgs[*]}" >&2
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi
if ! fio --enghelp=nbd >/dev/null 2>&1; then
    echo "this fio has no nbd engine (Debian's fio has it); cannot benchmark" >&2
    exit 1
fi

if [ -z "${BLKSTACK:-}" ]; then
    echo "building blkstack (release)..." >&2
    (cd "$ROOT" && cargo build --release -q -p blkstack)
    BLKSTACK="$ROOT/target/release/blkstack"
fi

# ---- servers ------------------------------------------------------------------
wait_socket() {
    for _ in $(seq 1 200); do
        [ -S "$SOCK" ] && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || return 1
        sleep 0.05
    done
    return 1
}

stop_server() {
    if [ -n "$SERVER_PID" ]; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 100); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 0.05
        done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=""
    fi
    rm -f "$SOCK" "$QEMU_IMG"
}

# start_server SERVER KIND: KIND is null, mem or delay. Sets SERVER_PID.
start_server() {
    local server=$1 kind=$2
    rm -f "$SOCK"
    case "$server:$kind" in
    ours:null) "$BLKSTACK" serve --concise "d,,,rw,0 $SECTORS null" --export d \
        --listen "nbd+unix:///?socket=$SOCK" >"$WORK/srv.log" 2>&1 & ;;
    ours:mem) "$BLKSTACK" serve --concise "d,,,rw,0 $SECTORS memory" --export d \
        --listen "nbd+unix:///?socket=$SOCK" >"$WORK/srv.log" 2>&1 & ;;
    ours:delay) "$BLKSTACK" serve --concise "z,,,rw,0 $SECTORS zero;d,,,rw,0 $SECTORS delay /dev/mapper/z 0 1" \
        --export d --listen "nbd+unix:///?socket=$SOCK" >"$WORK/srv.log" 2>&1 & ;;
    nbdkit:null) nbdkit -f --unix "$SOCK" null size=$SIZE_BYTES >"$WORK/srv.log" 2>&1 & ;;
    nbdkit:mem) nbdkit -f --unix "$SOCK" memory size=$SIZE_BYTES >"$WORK/srv.log" 2>&1 & ;;
    nbdkit:delay) nbdkit -f --unix "$SOCK" --filter=delay null size=$SIZE_BYTES rdelay=1ms \
        >"$WORK/srv.log" 2>&1 & ;;
    qemu:null) qemu-nbd -t --shared=8 -x d --socket="$SOCK" --image-opts \
        "driver=null-co,size=$SIZE_BYTES" >"$WORK/srv.log" 2>&1 & ;;
    qemu:mem)
        # qemu has no RAM block driver: a raw file on tmpfs is the closest.
        truncate -s $SIZE_BYTES "$QEMU_IMG"
        qemu-nbd -t --shared=8 -x d --socket="$SOCK" -f raw --cache=writeback \
            "$QEMU_IMG" >"$WORK/srv.log" 2>&1 & ;;
    qemu:delay) qemu-nbd -t --shared=8 -x d --socket="$SOCK" --image-opts \
        "driver=null-co,size=$SIZE_BYTES,latency-ns=1000000,read-zeroes=off" >"$WORK/srv.log" 2>&1 & ;;
    *) echo "unknown server/kind $server:$kind" >&2; return 1 ;;
    esac
    SERVER_PID=$!
    if ! wait_socket; then
        echo "$server ($kind) did not start:" >&2
        cat "$WORK/srv.log" >&2
        SERVER_PID=""
        return 1
    fi
}

cpu_ticks() {
    # utime + stime (fields 14, 15) of the whole process; the comm field may
    # hold spaces, so split after its closing parenthesis.
    awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$1/stat"
}

# ---- rows -----------------------------------------------------------------------
row_kind() { case $1 in null-*) echo null ;; mem-*) echo mem ;; delay*) echo delay ;; esac; }
row_fio() {
    case $1 in
    null-qd1) echo "--rw=randread --iodepth=1 --numjobs=1" ;;
    null-qd64) echo "--rw=randread --iodepth=64 --numjobs=1" ;;
    null-qd64x2) echo "--rw=randread --iodepth=64 --numjobs=2" ;;
    mem-randwrite-qd16) echo "--rw=randwrite --iodepth=16 --numjobs=1" ;;
    delay1ms-qd1) echo "--rw=randread --iodepth=1 --numjobs=1" ;;
    delay1ms-qd32) echo "--rw=randread --iodepth=32 --numjobs=1" ;;
    *) echo "unknown row $1" >&2; return 1 ;;
    esac
}

# Does our build know the delay target yet? (It is written separately.)
HAVE_DELAY=1
if [[ " $ROWS " == *" delay"* ]]; then
    if ! start_server ours delay 2>/dev/null; then
        HAVE_DELAY=0
        echo "NOTE: skipping the delay rows: blkstack could not create a 'delay' target over 'zero' (not written yet?): $(head -c 300 "$WORK/srv.log")" >&2
    fi
    stop_server
fi

RESULTS="$WORK/results.tsv"
: >"$RESULTS"
for rep in $(seq 1 "$REPS"); do
    for row in $ROWS; do
        kind=$(row_kind "$row")
        if [ "$kind" = delay ] && [ "$HAVE_DELAY" = 0 ]; then continue; fi
        for server in ours nbdkit qemu; do
            start_server "$server" "$kind"
            if [ "$kind" = mem ]; then
                # Precondition: write the whole device once, unmeasured, so
                # the row measures overwrites, not each server's first-touch
                # page allocation.
                fio --name=fill --ioengine=nbd --uri="nbd+unix:///d?socket=$SOCK" \
                    --rw=write --bs=1m --iodepth=4 >/dev/null 2>&1 || true
            fi
            t0=$(cpu_ticks "$SERVER_PID")
            # shellcheck disable=SC2046
            fio --name=bench --ioengine=nbd --uri="nbd+unix:///d?socket=$SOCK" \
                --bs=4k $(row_fio "$row") --time_based --runtime="$RUNTIME" \
                --group_reporting --output-format=json >"$WORK/fio.json" 2>"$WORK/fio.err" || {
                echo "fio failed on $server $row:" >&2
                cat "$WORK/fio.err" >&2
                stop_server
                continue
            }
            t1=$(cpu_ticks "$SERVER_PID")
            stop_server
            python3 - "$WORK/fio.json" "$rep" "$row" "$server" "$t0" "$t1" "$CLK_TCK" >>"$RESULTS" <<'EOF'
import json, sys
path, rep, row, server, t0, t1, hz = sys.argv[1:]
text = open(path).read()
# fio may print notices ("fio: connected to NBD server") before the JSON.
j = json.loads(text[text.index("{"):])["jobs"][0]
ios = j["read"]["total_ios"] + j["write"]["total_ios"]
iops = j["read"]["iops"] + j["write"]["iops"]
cpu_us = (int(t1) - int(t0)) * 1e6 / int(hz)
print(f"{rep}\t{row}\t{server}\t{iops:.0f}\t{cpu_us / max(ios, 1):.2f}")
EOF
            tail -1 "$RESULTS" | awk -F'\t' '{ printf "rep %s %-20s %-7s %10s IOPS %7s us CPU/IO\n", $1, $2, $3, $4, $5 }' >&2
        done
    done
done

python3 - "$RESULTS" "$REPS" "$RUNTIME" <<'EOF'
import sys, statistics
from collections import defaultdict
path, reps, runtime = sys.argv[1:]
iops = defaultdict(list); cpu = defaultdict(list); rows = []
for line in open(path):
    rep, row, server, i, c = line.rstrip("\n").split("\t")
    iops[row, server].append(float(i)); cpu[row, server].append(float(c))
    if row not in rows: rows.append(row)
med = lambda v: statistics.median(v) if v else float("nan")
print(f"\nmedians of {reps} interleaved repetitions, {runtime} s each, fio --ioengine=nbd 4k, Unix socket")
print(f"{'row':<20} {'ours':>9} {'nbdkit':>9} {'qemu-nbd':>9} {'/nbdkit':>8} {'/qemu':>7} {'/best':>7}   CPU us/IO: {'ours':>6} {'nbdkit':>7} {'qemu':>6}")
for row in rows:
    o, n, q = (med(iops[row, s]) for s in ("ours", "nbdkit", "qemu"))
    co, cn, cq = (med(cpu[row, s]) for s in ("ours", "nbdkit", "qemu"))
    best = max(n, q)
    print(f"{row:<20} {o:>9.0f} {n:>9.0f} {q:>9.0f} {o/n:>8.2f} {o/q:>7.2f} {o/best:>7.2f}              {co:>6.2f} {cn:>7.2f} {cq:>6.2f}")
EOF
