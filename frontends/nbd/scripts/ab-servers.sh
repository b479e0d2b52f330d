#!/usr/bin/env bash
# ab-servers.sh — the same fio nbd-engine row against several server
# variants, interleaved, one line per run (IOPS, server CPU µs per I/O,
# mean completion latency, 1-minute load average).
#
# Why: scripts/bench-peers.sh compares blkstack with nbdkit and qemu-nbd;
# this compares builds or settings of blkstack with each other (and, for
# reference, the peers) under the same load, to decide whether a change
# pays. Variants run one after the other inside every repetition so a
# noisy moment on the shared machine hits all of them alike.
#
# Usage: ab-servers.sh ROW REPS SECONDS VARIANT...
#   ROW: null-qd1 null-qd64 null-qd64x2 mem-qd16 mem-read64k-qd8 delay-qd1 delay-qd32
#   VARIANT: "nbdkit", "qemu", or a command that runs blkstack, e.g. a
#   wrapper script `exec /path/to/blkstack "$@" --poll-us 0` (it must
#   exec, so that its PID is the server's for the CPU reading).
# Each line names its repetition, row and variant; compare the medians
# per (row, variant), as docs/BENCHMARKS.md section 4 does.
set -u
row=$1 reps=$2 rt=$3
shift 3
WORK=$(mktemp -d /tmp/ab-servers.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
SOCK=$WORK/nbd.sock
SECTORS=$((1 << 21))
SIZE=$((1 << 30))
case $row in
null-qd1) kind=null f="--rw=randread --iodepth=1 --numjobs=1" ;;
null-qd64) kind=null f="--rw=randread --iodepth=64 --numjobs=1" ;;
null-qd64x2) kind=null f="--rw=randread --iodepth=64 --numjobs=2" ;;
mem-qd16) kind=mem f="--rw=randwrite --iodepth=16 --numjobs=1" ;;
mem-read64k-qd8) kind=mem f="--rw=read --bs=64k --iodepth=8 --numjobs=1" ;;
delay-qd1) kind=delay f="--rw=randread --iodepth=1 --numjobs=1" ;;
delay-qd32) kind=delay f="--rw=randread --iodepth=32 --numjobs=1" ;;
*) echo "unknown row $row" >&2; exit 2 ;;
esac
ticks() { awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$1/stat"; }
for rep in $(seq 1 "$reps"); do
    for v in "$@"; do
        rm -f "$SOCK"
        case $v:$kind in
        nbdkit:null) nbdkit -f --unix "$SOCK" null size=$SIZE & ;;
        nbdkit:mem) nbdkit -f --unix "$SOCK" memory size=$SIZE & ;;
        nbdkit:delay) nbdkit -f --unix "$SOCK" --filter=delay null size=$SIZE rdelay=1ms & ;;
        qemu:null) qemu-nbd -t --shared=8 -x d --socket="$SOCK" --image-opts "driver=null-co,size=$SIZE" & ;;
        qemu:delay) qemu-nbd -t --shared=8 -x d --socket="$SOCK" --image-opts \
            "driver=null-co,size=$SIZE,latency-ns=1000000,read-zeroes=off" & ;;
        qemu:mem) echo "qemu has no RAM device here; use bench-peers.sh" >&2; continue ;;
        *)
            case $kind in
            null) t="d,,,rw,0 $SECTORS null" ;;
            mem) t="d,,,rw,0 $SECTORS memory" ;;
            delay) t="z,,,rw,0 $SECTORS zero;d,,,rw,0 $SECTORS delay /dev/mapper/z 0 1" ;;
            esac
            $v serve --concise "$t" --export d --listen "nbd+unix:///?socket=$SOCK" \
                --control "$WORK/control.sock" >/dev/null 2>&1 &
            ;;
        esac
        pid=$!
        for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.05; done
        if [ "$kind" = mem ]; then
            fio --name=fill --ioengine=nbd --uri="nbd+unix:///d?socket=$SOCK" --rw=write \
                --bs=1m --iodepth=4 >/dev/null 2>&1
        fi
        t0=$(ticks $pid)
        # shellcheck disable=SC2086
        fio --name=b --ioengine=nbd --uri="nbd+unix:///d?socket=$SOCK" --bs=4k $f \
            --time_based --runtime="$rt" --group_reporting --output-format=json \
            >"$WORK/fio.json" 2>/dev/null
        t1=$(ticks $pid)
        kill -TERM $pid
        wait $pid 2>/dev/null
        python3 - "$WORK/fio.json" "$rep" "$row" "$(basename "${v%% *}")" "$t0" "$t1" "$(getconf CLK_TCK)" <<'PY'
import json, sys
path, rep, row, name, t0, t1, hz = sys.argv[1:]
text = open(path).read()
j = json.loads(text[text.index("{"):])["jobs"][0]
ios = j["read"]["total_ios"] + j["write"]["total_ios"]
iops = j["read"]["iops"] + j["write"]["iops"]
side = "read" if j["read"]["total_ios"] else "write"
clat = j[side]["clat_ns"]["mean"] / 1000
cpu = (int(t1) - int(t0)) * 1e6 / int(hz) / max(ios, 1)
load = open("/proc/loadavg").read().split()[0]
print(f"{rep} {row} {name:<16} {iops:8.0f} IOPS {cpu:6.2f} us/IO clat {clat:7.1f} us load {load}")
PY
    done
done
