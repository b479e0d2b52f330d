#!/usr/bin/env bash
# work-per-io.sh — what one I/O costs an NBD server, counted as work
# (system calls, context switches, instructions), not as time.
#
# Why: CPU time per I/O on a shared machine moves with its load
# (wake-up latency, preemption, cache), so a change that saves 10 % cannot
# be seen in it. The counts here barely move with load: the system calls
# and voluntary context switches (sleeps) the server makes per request,
# from `perf stat` on software events over the whole process, or `strace
# -c -f` (slower, names every call), and the instructions it executes per
# request, from callgrind (all threads; a poll or spin loop executes more
# while it waits longer, so compare callgrind figures of rows that do not
# spin, or read them with that in mind). Same rows and servers as
# ab-servers.sh; the I/O count is fio's.
#
# Usage: work-per-io.sh MODE ROW SECONDS VARIANT...
#   MODE: perf (syscalls by name, context switches, CPU: default choice),
#         strace (syscalls by name, strace -c -f; it slows every call
#         by microseconds, so a polling server's counts are not its own),
#         callgrind (instructions per I/O; SECONDS of fio against a server
#         50x slower: keep it to 3-5)
#   ROW: null-qd1 null-qd64 null-qd64x2 mem-qd16 mem-read64k-qd8 delay-qd1 delay-qd32
#   DELAY_OPTS: options of our delay target (e.g. spin_us=0), as in
#   bench-peers.sh (here empty by default: the target's defaults).
#   VARIANT: "nbdkit", "qemu", "floor" (the floor probe,
#   frontends/nbd/examples/nbd-floor: $FLOOR, default
#   target/release/examples/nbd-floor, built with `cargo build --release
#   -p blkstack-nbd --example nbd-floor`), or a command that runs blkstack
#   (as in ab-servers.sh: a binary path, or a wrapper that execs it with
#   extra flags, e.g. `exec /path/blkstack "$@" --poll-us 0`).
# Every mode also prints the server's context switches per I/O from
# /proc/PID/task/*/status (voluntary: it slept; involuntary: preempted),
# summed over its threads 0.5 s into fio's run and 0.5 s before its end
# (a connection's threads are gone once it closes, and their counts with
# them), divided by the I/Os of that span at fio's mean rate; under
# strace they include strace's stops, under callgrind valgrind's.
set -u
mode=$1 row=$2 rt=$3
shift 3
WORK=$(mktemp -d /tmp/work-per-io.XXXXXX)
SOCK=$WORK/nbd.sock
SECTORS=$((1 << 21))
SIZE=$((1 << 30))
pid=""
FLOOR=${FLOOR:-$(cd "$(dirname "$0")/../../.." && pwd)/target/release/examples/nbd-floor}
cleanup() {
    [ -z "$pid" ] || kill -TERM "$pid" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT
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

# start VARIANT: the server, its PID in $pid (callgrind: under valgrind).
start() {
    local v=$1 pre=()
    rm -f "$SOCK"
    [ "$mode" = callgrind ] && pre=(valgrind --tool=callgrind --trace-children=yes --callgrind-out-file="$WORK/cg.%p" -q)
    case $v:$kind in
    nbdkit:null) "${pre[@]}" nbdkit -f --unix "$SOCK" null size=$SIZE & ;;
    nbdkit:mem) "${pre[@]}" nbdkit -f --unix "$SOCK" memory size=$SIZE & ;;
    nbdkit:delay) "${pre[@]}" nbdkit -f --unix "$SOCK" --filter=delay null size=$SIZE rdelay=1ms & ;;
    qemu:null) "${pre[@]}" qemu-nbd -t --shared=8 -x d --socket="$SOCK" --image-opts "driver=null-co,size=$SIZE" & ;;
    qemu:delay) "${pre[@]}" qemu-nbd -t --shared=8 -x d --socket="$SOCK" --image-opts \
        "driver=null-co,size=$SIZE,latency-ns=1000000,read-zeroes=off" & ;;
    qemu:mem) echo "qemu has no RAM device here; use bench-peers.sh" >&2; return 1 ;;
    floor:mem) "${pre[@]}" "$FLOOR" --kind memory --size $SIZE --socket "$SOCK" 2>/dev/null & ;;
    floor:*) "${pre[@]}" "$FLOOR" --kind $kind --size $SIZE --socket "$SOCK" 2>/dev/null & ;;
    *)
        local t
        case $kind in
        null) t="d,,,rw,0 $SECTORS null" ;;
        mem) t="d,,,rw,0 $SECTORS memory" ;;
        delay) t="z,,,rw,0 $SECTORS zero;d,,,rw,0 $SECTORS delay /dev/mapper/z 0 1 ${DELAY_OPTS:-}" ;;
        esac
        # shellcheck disable=SC2086
        "${pre[@]}" $v serve --concise "$t" --export d --listen "nbd+unix:///?socket=$SOCK" \
            --control "$WORK/control.sock" >/dev/null 2>&1 &
        ;;
    esac
    pid=$!
    for _ in $(seq 600); do [ -S "$SOCK" ] && return 0; sleep 0.05; done
    echo "$v did not start" >&2
    return 1
}

runfio() {
    # shellcheck disable=SC2086
    fio --name=b --ioengine=nbd --uri="nbd+unix:///d?socket=$SOCK" --bs=4k $f \
        --time_based --runtime="$1" --group_reporting --output-format=json \
        >"$WORK/fio.json" 2>/dev/null
}

ios() {
    python3 - "$WORK/fio.json" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
j = json.loads(text[text.index("{"):])["jobs"][0]
print(j["read"]["total_ios"] + j["write"]["total_ios"])
PY
}

# Voluntary and involuntary context switches of every thread of $pid.
switches() {
    cat /proc/"$pid"/task/*/status 2>/dev/null |
        awk '/^voluntary_ctxt_switches/ { v += $2 } /^nonvoluntary_ctxt_switches/ { n += $2 } END { print v + 0, n + 0 }'
}
# fio for $1 seconds, the server's switches sampled inside its run.
runfio_sw() {
    runfio "$1" &
    local f=$!
    sleep 0.5
    sw0=$(switches)
    sleep "$(echo "$1" | awk '{ print $1 - 1 }')"
    sw1=$(switches)
    wait $f
}
# The switches between the two samples, per I/O of that span ($1 I/Os in
# $2 seconds of fio).
switches_per_io() {
    echo "$sw0 $sw1" | awk -v n="$1" -v rt="$2" -v row="$row" -v name="$name" '
        { ios = n * (rt - 1) / rt
          printf "%s %-12s /proc status: voluntary switches/IO %.3f  involuntary/IO %.3f\n", row, name, ($3 - $1) / ios, ($4 - $2) / ios }'
}

for v in "$@"; do
    start "$v" || continue
    name=$(basename "${v%% *}")
    [ "$kind" = mem ] && fio --name=fill --ioengine=nbd --uri="nbd+unix:///d?socket=$SOCK" \
        --rw=write --bs=1m --iodepth=4 >/dev/null 2>&1
    case $mode in
    perf)
        perf stat -x, -o "$WORK/perf.txt" -e 'syscalls:sys_enter_*,context-switches,cpu-clock' \
            -p "$pid" &
        spid=$!
        sleep 0.5
        runfio_sw "$rt"
        kill -INT $spid
        wait $spid 2>/dev/null
        n=$(ios)
        switches_per_io "$n" "$rt"
        # perf -x, lines: value,unit,event,...; sched_switch counts every
        # switch away, voluntary (sleep) or not.
        awk -F, -v n="$n" -v row="$row" -v name="$name" '
            $3 ~ /syscalls:sys_enter_/ && $1 + 0 > 0 {
                s = $3; sub(/syscalls:sys_enter_/, "", s); tot += $1; by[s] = $1 }
            $3 == "context-switches" { cs = $1 }
            $3 == "cpu-clock" { cpu = $1 }
            END {
                printf "%s %-12s ios %d  syscalls/IO %.3f  switches/IO %.3f  cpu us/IO %.2f\n",
                    row, name, n, tot / n, cs / n, cpu * 1000 / n
                for (s in by) if (by[s] / n >= 0.005) printf "    %-20s %.3f\n", s, by[s] / n
            }' "$WORK/perf.txt"
        ;;
    strace)
        strace -c -f -o "$WORK/strace.txt" -p "$pid" 2>/dev/null &
        spid=$!
        sleep 1
        runfio_sw "$rt"
        kill -INT $spid
        wait $spid 2>/dev/null
        n=$(ios)
        switches_per_io "$n" "$rt"
        awk -v n="$n" -v row="$row" -v name="$name" '
            $1 ~ /^[0-9.]+$/ && NF >= 5 { c = $4; s = $NF; if (s != "total") { tot += c; by[s] = c } }
            END {
                printf "%s %-12s ios %d  syscalls/IO %.3f (strace)\n", row, name, n, tot / n
                for (s in by) if (by[s] / n >= 0.005) printf "    %-20s %.3f\n", s, by[s] / n
            }' "$WORK/strace.txt"
        ;;
    callgrind)
        # Two runs on one server: the first pays the warm-up (first touches,
        # thread starts); counters are dumped and zeroed after it, and the
        # second run's dump, minus its own handshake, is the figure.
        runfio 1
        callgrind_control -d "$pid" >/dev/null 2>&1
        runfio_sw "$rt"
        n=$(ios)
        switches_per_io "$n" "$rt"
        callgrind_control -d "$pid" >/dev/null 2>&1
        sleep 1
        last=$(ls -t "$WORK"/cg.* | head -1)
        ir=$(callgrind_annotate "$last" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(/,/, "", $1); print $1; exit }')
        echo "$row $name ios $n  instructions/IO $((ir / n))"
        [ -z "${KEEP_CG:-}" ] || cp "$last" "$KEEP_CG.$name"
        ;;
    esac
    kill -TERM "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    pid=""
done
