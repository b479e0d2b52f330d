#!/usr/bin/env bash
# bench-peers.sh — blkstack's NBD server against the two usual peers,
# nbdkit and qemu-nbd, with the same fio nbd-engine jobs (libnbd client),
# and against the floor: nbd-floor (frontends/nbd/examples/nbd-floor), a
# one-thread server that does only what each row physically requires
# (read the requests a poll reports, answer the batch with one writev;
# null from static zeros, memory straight into a Vec, delay on one
# timerfd, TLS with rustls). Its CPU per I/O is what the machine charges
# for serving the row at all: a goal of 0.5x the best peer below it is
# below what the host can do.
#
# Why this shape: one fio job file per row, the three servers run one
# after the other inside every repetition (interleaved, so a noisy moment
# on a shared host hits all three alike), medians over the
# repetitions, and the server's own CPU time per I/O: utime+stime of all
# its threads from /proc/PID/stat, over fio's measured window only.
#
# CPU per I/O, exactly over the measured window: fio runs with a ramp
# (RAMP seconds, unmeasured: connection set-up, TLS handshake, first
# touches) and writes an IOPS log with Unix timestamps
# (--write_iops_log --log_unix_epoch, one entry per LOG_MS); a sampler
# reads the server's /proc/PID/stat every SAMPLE_MS with its own Unix
# timestamps. Both give a cumulative curve (I/Os completed, CPU ticks),
# piecewise linear between samples; the window is the span every job's
# log covers, and both curves are read at its two ends. So the CPU and
# the I/Os are counted over the same interval, with no ramp, no
# connect and no shutdown in either.
#
# Server rows (fio --ioengine=nbd, i.e. libnbd, against each server):
#   null 4k randread QD1, QD64 x1 job, QD64 x2 jobs (2 connections)
#   memory 4k randwrite QD16 (after an unmeasured full sequential fill),
#     x1 job and x2 jobs (fio forks each job: two client processes, one
#     connection each, so that the server, not one client thread, is the
#     bound)
#   delay 1 ms 4k randread QD1 and QD32 (ours: a `delay` target over `zero`;
#     nbdkit: null + --filter=delay rdelay=1ms; qemu: null-co latency-ns).
#     Ours runs with DELAY_OPTS (default `spin_us=0`): the peers sleep on
#     a timer and wake when the host wakes them, never spinning; spin_us=0
#     is that mechanism in our target (a timerfd armed for the deadline, 1 ns
#     timer slack, every bio due on a wake sent in one pass). DELAY_OPTS=
#     (empty) benches the target's default, `hybrid`, which also spins to
#     each deadline for precision and pays for it in CPU.
#   memory 64 KiB sequential reads QD8 (after the fill), for throughput
#   any row with -tls appended: the same over TLS (x509 certificates made
#     here with openssl; every server with TLS required, the client with
#     nbds+unix:// and tls-certificates=), to set beside the plain row
# Client rows (one server, blkstack serve on null; two clients):
#   leaf-qd1, leaf-qd64: 4k randread through blkstack's `nbd` client leaf
#     (blkstack bench over a `0 LEN nbd URI connections=1` table) against
#     fio's own nbd engine (libnbd), one connection each; IOPS and the
#     client's CPU per I/O (utime+stime of the client process); `leaf` is
#     the default (a reader thread per connection reads the replies),
#     `leafpq` poll_queues=1 (the bench thread reads its own replies from
#     a poll-queue connection; the default connection stays idle), and,
#     `leafpqpoll` poll_queues=1 poll_us=50 (the bench thread polls its
#     own poll-queue socket for up to 50 us, adaptively, before it sleeps
#     in the read: one thread and no wake-up per I/O while replies come
#     back fast), and, when CLIENTS names it, `leafpoll` poll_us=50 (the
#     reader thread busy-polls its socket)
#
# Usage: scripts/bench-peers.sh            (REPS=3 RUNTIME=5 RAMP=1 by default)
#        BLKSTACK=path/to/blkstack scripts/bench-peers.sh   (skip the build)
#        REPS=5 RUNTIME=10 scripts/bench-peers.sh
#        ROWS="null-qd1 null-qd64" scripts/bench-peers.sh
#        ROWS="null-qd1 null-qd1-tls mem-read64k-qd8 mem-read64k-qd8-tls" scripts/bench-peers.sh
#        ROWS="leaf-qd1 leaf-qd64" scripts/bench-peers.sh
#        OURS_OPTS="--poll-us 50" scripts/bench-peers.sh   (extra `serve` flags)
#        OURS_OPTS="--poll-us auto" scripts/bench-peers.sh  (adaptive poll window)
#        DELAY_OPTS= ROWS="delay1ms-qd1 delay1ms-qd32" scripts/bench-peers.sh
#        FLOOR=path/to/nbd-floor scripts/bench-peers.sh   (skip its build)
#        SERVERS="ours floor" scripts/bench-peers.sh      (default: all four)
#        COUNT=1 RAMP=0 ROWS=... scripts/bench-peers.sh   (also count, with
#          perf stat on the server over each fio run, its system calls and
#          context switches per I/O: counts that other work barely moves)
# Needs root or sudo only to install missing packages (fio, nbdkit,
# qemu-utils) with apt-get.
set -euo pipefail

REPS=${REPS:-3}
RUNTIME=${RUNTIME:-5}
RAMP=${RAMP:-1}
LOG_MS=${LOG_MS:-100}
SAMPLE_MS=${SAMPLE_MS:-10}
ROWS=${ROWS:-"null-qd1 null-qd64 null-qd64x2 mem-randwrite-qd16 mem-randwrite-qd16x2 delay1ms-qd1 delay1ms-qd32 null-qd1-tls null-qd64-tls mem-read64k-qd8 mem-read64k-qd8-tls leaf-qd1 leaf-qd64"}
OURS_OPTS=${OURS_OPTS:-}
DELAY_OPTS=${DELAY_OPTS-spin_us=0}
SERVERS=${SERVERS:-"ours nbdkit qemu floor"}
SIZE_BYTES=$((1 << 30))
SECTORS=$((SIZE_BYTES / 512))
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/bench-peers.XXXXXX)
SOCK="$WORK/nbd.sock"
QEMU_IMG="/dev/shm/bench-peers-$$.img"
SERVER_PID=""
CLK_TCK=$(getconf CLK_TCK)
fio() { HOME="$WORK/home" command fio "$@"; }

SAMPLER_PID=""
cleanup() {
    [ -z "$SAMPLER_PID" ] || kill "$SAMPLER_PID" 2>/dev/null || true
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
command -v openssl >/dev/null || need_pkgs+=(openssl)
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
if [[ " $SERVERS " == *" floor "* ]] && [ -z "${FLOOR:-}" ]; then
    echo "building the floor probe (release)..." >&2
    (cd "$ROOT" && cargo build --release -q -p blkstack-nbd --example nbd-floor)
    FLOOR="$ROOT/target/release/examples/nbd-floor"
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

# TLS: a CA and a server certificate for localhost, in the layout qemu,
# nbdkit, libnbd and blkstack share (ca-cert.pem, server-cert.pem,
# server-key.pem). Made once, only when a -tls row runs. fio's nbd engine
# cannot pass libnbd a tls-certificates= query (libnbd refuses local file
# access from a URI unless the program allows it, and fio does not), so the
# certificates sit where libnbd looks by default, $HOME/.pki/libnbd, and
# every fio here runs with HOME=$WORK/home.
CERTS="$WORK/home/.pki/libnbd"
make_certs() {
    [ -f "$CERTS/server-cert.pem" ] && return 0
    mkdir -p "$CERTS"
    (
        cd "$CERTS"
        openssl req -x509 -newkey rsa:2048 -nodes -keyout ca-key.pem -out ca-cert.pem \
            -days 2 -subj "/CN=bench-peers CA" 2>/dev/null
        openssl req -newkey rsa:2048 -nodes -keyout server-key.pem -out server.csr \
            -subj "/CN=localhost" 2>/dev/null
        printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' >server.ext
        openssl x509 -req -in server.csr -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial \
            -out server-cert.pem -days 2 -extfile server.ext 2>/dev/null
    )
}

# The client's URI for export d, plain or over TLS.
client_uri() {
    if [ "$1" = 1 ]; then
        echo "nbds+unix:///d?socket=$SOCK"
    else
        echo "nbd+unix:///d?socket=$SOCK"
    fi
}

# start_server SERVER KIND [TLS]: KIND is null, mem or delay; TLS 1 makes
# the server require TLS. Sets SERVER_PID.
start_server() {
    local server=$1 kind=$2 tls=${3:-0}
    local ours_tls=() kit_tls=() qemu_tls=() floor_tls=()
    if [ "$tls" = 1 ]; then
        make_certs
        floor_tls=(--tls-certificates="$CERTS")
        ours_tls=(--tls=require --tls-certificates="$CERTS")
        kit_tls=(--tls=require --tls-certificates="$CERTS")
        qemu_tls=(--object "tls-creds-x509,id=tls0,endpoint=server,dir=$CERTS,verify-peer=off" --tls-creds=tls0)
    fi
    rm -f "$SOCK"
    case "$server:$kind" in
    # shellcheck disable=SC2086
    ours:null) "$BLKSTACK" serve --concise "d,,,rw,0 $SECTORS null" --export d "${ours_tls[@]}" \
        --listen "nbd+unix:///?socket=$SOCK" $OURS_OPTS >"$WORK/srv.log" 2>&1 & ;;
    # shellcheck disable=SC2086
    ours:mem) "$BLKSTACK" serve --concise "d,,,rw,0 $SECTORS memory" --export d "${ours_tls[@]}" \
        --listen "nbd+unix:///?socket=$SOCK" $OURS_OPTS >"$WORK/srv.log" 2>&1 & ;;
    # shellcheck disable=SC2086
    ours:delay) "$BLKSTACK" serve --concise "z,,,rw,0 $SECTORS zero;d,,,rw,0 $SECTORS delay /dev/mapper/z 0 1 $DELAY_OPTS" \
        --export d "${ours_tls[@]}" --listen "nbd+unix:///?socket=$SOCK" $OURS_OPTS >"$WORK/srv.log" 2>&1 & ;;
    nbdkit:null) nbdkit -f "${kit_tls[@]}" --unix "$SOCK" null size=$SIZE_BYTES >"$WORK/srv.log" 2>&1 & ;;
    nbdkit:mem) nbdkit -f "${kit_tls[@]}" --unix "$SOCK" memory size=$SIZE_BYTES >"$WORK/srv.log" 2>&1 & ;;
    nbdkit:delay) nbdkit -f "${kit_tls[@]}" --unix "$SOCK" --filter=delay null size=$SIZE_BYTES rdelay=1ms \
        >"$WORK/srv.log" 2>&1 & ;;
    qemu:null) qemu-nbd -t --shared=8 -x d --socket="$SOCK" "${qemu_tls[@]}" --image-opts \
        "driver=null-co,size=$SIZE_BYTES" >"$WORK/srv.log" 2>&1 & ;;
    qemu:mem)
        # qemu has no RAM block driver: a raw file on tmpfs is the closest.
        truncate -s $SIZE_BYTES "$QEMU_IMG"
        qemu-nbd -t --shared=8 -x d --socket="$SOCK" "${qemu_tls[@]}" -f raw --cache=writeback \
            "$QEMU_IMG" >"$WORK/srv.log" 2>&1 & ;;
    qemu:delay) qemu-nbd -t --shared=8 -x d --socket="$SOCK" "${qemu_tls[@]}" --image-opts \
        "driver=null-co,size=$SIZE_BYTES,latency-ns=1000000,read-zeroes=off" >"$WORK/srv.log" 2>&1 & ;;
    floor:null | floor:delay) "$FLOOR" --kind "$kind" --size $SIZE_BYTES --socket "$SOCK" "${floor_tls[@]}" \
        >"$WORK/srv.log" 2>&1 & ;;
    floor:mem) "$FLOOR" --kind memory --size $SIZE_BYTES --socket "$SOCK" "${floor_tls[@]}" \
        >"$WORK/srv.log" 2>&1 & ;;
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
row_kind() { case $1 in null-*) echo null ;; mem-*) echo mem ;; delay*) echo delay ;; leaf-*) echo leaf ;; esac; }
row_tls() { case $1 in *-tls) echo 1 ;; *) echo 0 ;; esac; }
row_fio() {
    case ${1%-tls} in
    null-qd1 | leaf-qd1) echo "--rw=randread --bs=4k --iodepth=1 --numjobs=1" ;;
    null-qd64 | leaf-qd64) echo "--rw=randread --bs=4k --iodepth=64 --numjobs=1" ;;
    null-qd64x2) echo "--rw=randread --bs=4k --iodepth=64 --numjobs=2" ;;
    mem-read64k-qd8) echo "--rw=read --bs=64k --iodepth=8 --numjobs=1" ;;
    mem-randwrite-qd16) echo "--rw=randwrite --bs=4k --iodepth=16 --numjobs=1" ;;
    mem-randwrite-qd16x2) echo "--rw=randwrite --bs=4k --iodepth=16 --numjobs=2" ;;
    delay1ms-qd1) echo "--rw=randread --bs=4k --iodepth=1 --numjobs=1" ;;
    delay1ms-qd32) echo "--rw=randread --bs=4k --iodepth=32 --numjobs=1" ;;
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

# fio's (or blkstack bench's) JSON to one TSV line: rep, row, who, IOPS,
# CPU us per I/O from the CPU seconds given.
record() {
    python3 - "$@" >>"$RESULTS" <<'EOF'
import json, sys
path, rep, row, who, cpu_s = sys.argv[1:6]
text = open(path).read()
# fio may print notices ("fio: connected to NBD server") before the JSON.
j = json.loads(text[text.index("{"):])["jobs"][0]
ios = j["read"]["total_ios"] + j["write"]["total_ios"]
iops = j["read"]["iops"] + j["write"]["iops"]
print(f"{rep}\t{row}\t{who}\t{iops:.0f}\t{float(cpu_s) * 1e6 / max(ios, 1):.2f}")
EOF
    tail -1 "$RESULTS" | awk -F'\t' '{ printf "rep %s %-20s %-7s %10s IOPS %7s us CPU/IO\n", $1, $2, $3, $4, $5 }' >&2
}

# The server's CPU ticks every SAMPLE_MS, as "unix_ms ticks" lines, until
# it is killed (started before fio, stopped after).
start_sampler() {
    python3 - "$1" "$SAMPLE_MS" >"$WORK/cpu.log" <<'EOF' &
import sys, time
pid, every = sys.argv[1], float(sys.argv[2]) / 1000
while True:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        break
    # utime, stime: fields 14, 15 of stat(5), 12 and 13 after the comm.
    print(int(time.time() * 1000), int(fields[11]) + int(fields[12]), flush=True)
    time.sleep(every)
EOF
    SAMPLER_PID=$!
}

# COUNT=1: perf stat (software tracepoints, no hardware counters) on the
# server for the whole fio run; per I/O over fio's total_ios, so run with
# RAMP=0 (ramp I/Os are not in total_ios).
start_counter() {
    perf stat -x, -e raw_syscalls:sys_enter,context-switches -p "$1" \
        -o "$WORK/perf.txt" 2>/dev/null &
    COUNTER_PID=$!
}
stop_counter() {
    kill -INT "$COUNTER_PID" 2>/dev/null || true
    wait "$COUNTER_PID" 2>/dev/null || true
    python3 - "$WORK/fio.json" "$WORK/perf.txt" "$@" <<'EOF' >&2
import json, sys
path, perf, rep, row, who = sys.argv[1:6]
text = open(path).read()
j = json.loads(text[text.index("{"):])["jobs"][0]
ios = max(j["read"]["total_ios"] + j["write"]["total_ios"], 1)
counts = {}
for line in open(perf):
    f = line.strip().split(",")
    if len(f) > 2 and f[0].replace(".", "").isdigit():
        counts[f[2]] = float(f[0])
sc = counts.get("raw_syscalls:sys_enter", 0) / ios
cs = counts.get("context-switches", 0) / ios
print(f"rep {rep} {row:<20} {who:<7} counts: {ios} I/Os, {sc:.3f} syscalls/IO, {cs:.3f} context-switches/IO")
EOF
}

# fio's JSON, its IOPS logs and the sampler's log to one TSV line: rep,
# row, who, IOPS (fio's, over its measured window), CPU us per I/O (over
# the span every job's IOPS log covers, see the header).
record_window() {
    python3 - "$WORK/fio.json" "$WORK/cpu.log" "$CLK_TCK" "$@" >>"$RESULTS" <<'EOF'
import bisect, glob, json, sys
path, cpu_log, hz, rep, row, who, logs = sys.argv[1:8]
text = open(path).read()
# fio may print notices ("fio: connected to NBD server") before the JSON.
j = json.loads(text[text.index("{"):])["jobs"][0]
iops = j["read"]["iops"] + j["write"]["iops"]

def curve(points):
    """Cumulative (t, value) points -> the value at any t they span."""
    ts = [t for t, _ in points]
    def at(t):
        i = bisect.bisect_left(ts, t)
        if i == len(ts) or (i == 0 and ts[0] != t):
            raise SystemExit(f"{who} {row}: time {t} outside the samples {ts[0]}..{ts[-1]}")
        if ts[i] == t:
            return points[i][1]
        (t0, v0), (t1, v1) = points[i - 1], points[i]
        return v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return at

# One IOPS log per job; entry i holds the mean rate since entry i-1.
jobs = []
for f in sorted(glob.glob(logs + "_iops.*.log")):
    merged = {}
    for line in open(f):
        if line.strip():
            t, v = line.split(",")[:2]
            # Reads and writes log apart at one time: add them.
            merged[int(t)] = merged.get(int(t), 0.0) + float(v)
    e = sorted(merged.items())
    pts, n = [], 0.0
    for k, (t, v) in enumerate(e):
        if k:
            n += v * (t - e[k - 1][0]) / 1000
        pts.append((t, n))
    jobs.append(pts)
if not jobs or any(len(p) < 3 for p in jobs):
    raise SystemExit(f"{who} {row}: no usable IOPS log")
a = max(p[0][0] for p in jobs)
b = min(p[-1][0] for p in jobs)
ios = sum(curve(p)(b) - curve(p)(a) for p in jobs)
ticks = curve([tuple(map(int, l.split())) for l in open(cpu_log) if l.strip()])
cpu_s = (ticks(b) - ticks(a)) / int(hz)
print(f"{rep}\t{row}\t{who}\t{iops:.0f}\t{cpu_s * 1e6 / max(ios, 1):.2f}")
EOF
    tail -1 "$RESULTS" | awk -F'\t' '{ printf "rep %s %-20s %-7s %10s IOPS %7s us CPU/IO\n", $1, $2, $3, $4, $5 }' >&2
}

# One server row: each server in turn, fio's nbd engine as the client; CPU
# is the server's, over fio's measured window (see the header).
server_row() {
    local rep=$1 row=$2 kind tls uri ok
    kind=$(row_kind "$row")
    tls=$(row_tls "$row")
    uri=$(client_uri "$tls")
    for server in $SERVERS; do
        start_server "$server" "$kind" "$tls" || continue
        if [ "$kind" = mem ]; then
            # Precondition: write the whole device once, unmeasured, so
            # the row measures overwrites, not each server's first-touch
            # page allocation.
            fio --name=fill --ioengine=nbd --uri="$uri" \
                --rw=write --bs=1m --iodepth=4 >/dev/null 2>&1 || true
        fi
        rm -f "$WORK"/iops_iops.*.log
        start_sampler "$SERVER_PID"
        [ "${COUNT:-0}" = 1 ] && start_counter "$SERVER_PID"
        ok=1
        # shellcheck disable=SC2046
        fio --name=bench --ioengine=nbd --uri="$uri" \
            $(row_fio "$row") --time_based --runtime="$RUNTIME" --ramp_time="$RAMP" \
            --write_iops_log="$WORK/iops" --log_avg_msec="$LOG_MS" --log_unix_epoch=1 \
            --group_reporting --output-format=json >"$WORK/fio.json" 2>"$WORK/fio.err" || ok=0
        kill "$SAMPLER_PID" 2>/dev/null || true
        wait "$SAMPLER_PID" 2>/dev/null || true
        [ "${COUNT:-0}" = 1 ] && stop_counter "$rep" "$row" "$server"
        stop_server
        if [ "$ok" = 0 ]; then
            echo "fio failed on $server $row:" >&2
            cat "$WORK/fio.err" >&2
            continue
        fi
        record_window "$rep" "$row" "$server" "$WORK/iops" || true
    done
}

# One client row: blkstack serve on null, then fio's nbd engine (libnbd)
# and blkstack bench over the `nbd` leaf as clients, one connection each;
# CPU is the client process's (utime + stime, from /usr/bin/time).
client_row() {
    local rep=$1 row=$2 client
    printf 'r: 0 %s nbd nbd+unix:///d?socket=%s connections=1\n' "$SECTORS" "$SOCK" >"$WORK/leaf.stack"
    printf 'r: 0 %s nbd nbd+unix:///d?socket=%s connections=1 poll_queues=1\n' "$SECTORS" "$SOCK" >"$WORK/leafpq.stack"
    printf 'r: 0 %s nbd nbd+unix:///d?socket=%s connections=1 poll_us=50\n' "$SECTORS" "$SOCK" >"$WORK/leafpoll.stack"
    printf 'r: 0 %s nbd nbd+unix:///d?socket=%s connections=1 poll_queues=1 poll_us=50\n' "$SECTORS" "$SOCK" >"$WORK/leafpqpoll.stack"
    for client in $CLIENTS; do
        start_server ours null 0 || return 0
        # shellcheck disable=SC2046
        case $client in
        libnbd) /usr/bin/time -f "%U %S" -o "$WORK/time.txt" \
            fio --name=bench --ioengine=nbd --uri="$(client_uri 0)" $(row_fio "$row") \
            --time_based --runtime="$RUNTIME" --group_reporting --output-format=json \
            >"$WORK/fio.json" 2>"$WORK/fio.err" ;;
        leaf*) /usr/bin/time -f "%U %S" -o "$WORK/time.txt" \
            "$BLKSTACK" bench --stack "$WORK/$client.stack" --name=bench --filename=r $(row_fio "$row") \
            --time_based --runtime="$RUNTIME" --output-format=json \
            >"$WORK/fio.json" 2>"$WORK/fio.err" ;;
        esac || {
            echo "$client failed on $row:" >&2
            cat "$WORK/fio.err" >&2
            stop_server
            continue
        }
        stop_server
        record "$WORK/fio.json" "$rep" "$row" "$client" "$(awk '{ print $1 + $2 }' "$WORK/time.txt")"
    done
}

CLIENTS=${CLIENTS:-"libnbd leaf leafpq leafpqpoll"}
RESULTS="$WORK/results.tsv"
: >"$RESULTS"
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
for rep in $(seq 1 "$REPS"); do
    for row in $ROWS; do
        kind=$(row_kind "$row")
        if [ "$kind" = delay ] && [ "$HAVE_DELAY" = 0 ]; then continue; fi
        if [ "$kind" = leaf ]; then
            client_row "$rep" "$row"
        else
            server_row "$rep" "$row"
        fi
    done
done

echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) (at the start: $LOAD_START)"
echo "ours: serve flags '${OURS_OPTS}', delay target options '${DELAY_OPTS}'"
python3 - "$RESULTS" "$REPS" "$RUNTIME" "$RAMP" <<'EOF'
import sys, statistics
from collections import defaultdict
path, reps, runtime, ramp = sys.argv[1:]
iops = defaultdict(list); cpu = defaultdict(list); rows = []
for line in open(path):
    rep, row, who, i, c = line.rstrip("\n").split("\t")
    iops[row, who].append(float(i)); cpu[row, who].append(float(c))
    if row not in rows: rows.append(row)
med = lambda v: statistics.median(v) if v else float("nan")
div = lambda a, b: a / b if b else float("nan")
servers = [r for r in rows if not r.startswith("leaf-")]
clients = [r for r in rows if r.startswith("leaf-")]
if servers:
    print(f"\nmedians of {reps} interleaved repetitions, {runtime} s each after a {ramp} s ramp, fio --ioengine=nbd, Unix socket;"
          " CPU is the server's (user+system, all threads) over fio's measured window; best = the peer with the most IOPS / the least CPU per I/O;"
          " floor = nbd-floor, the least a server can spend on the row here")
    print(f"{'row':<20} {'IOPS: ours':>10} {'nbdkit':>9} {'qemu-nbd':>9} {'floor':>9} {'ours/best':>9}   {'CPU us/IO: ours':>15} {'nbdkit':>7} {'qemu':>7} {'floor':>7} {'ours/best':>9} {'ours/floor':>10}   goal 0.5x best")
    for row in servers:
        o, n, q, f = (med(iops[row, s]) for s in ("ours", "nbdkit", "qemu", "floor"))
        co, cn, cq, cf = (med(cpu[row, s]) for s in ("ours", "nbdkit", "qemu", "floor"))
        best = max((v for v in (n, q) if v == v), default=float("nan"))
        cbest = min((v for v in (cn, cq) if v == v), default=float("nan"))
        goal = 0.5 * cbest
        # Below the floor: not even the floor server reaches the goal.
        verdict = ("met" if co <= goal else "BELOW FLOOR" if cf > goal else "missed") if goal == goal and co == co else "-"
        if verdict == "BELOW FLOOR":
            verdict += f" ({goal:.2f} < {cf:.2f})"
        print(f"{row:<20} {o:>10.0f} {n:>9.0f} {q:>9.0f} {f:>9.0f} {div(o, best):>9.2f}   {co:>15.2f} {cn:>7.2f} {cq:>7.2f} {cf:>7.2f} {div(co, cbest):>9.2f} {div(co, cf):>10.2f}   {verdict}")
    tls = [r for r in servers if r.endswith("-tls") and r[:-4] in servers]
    if tls:
        print("\nTLS against plain, same server: IOPS TLS/plain (CPU us/IO plain -> TLS)")
        for row in tls:
            plain = row[:-4]
            cells = [f"{s} {div(med(iops[row, s]), med(iops[plain, s])):.2f} ({med(cpu[plain, s]):.2f} -> {med(cpu[row, s]):.2f})"
                     for s in ("ours", "nbdkit", "qemu", "floor")]
            print(f"{row:<20} " + "   ".join(cells))
if clients:
    who = [c for c in ("libnbd", "leaf", "leafpq", "leafpqpoll", "leafpoll") if any((r, c) in iops for r in clients)]
    print(f"\nclients against blkstack serve (null), {runtime} s each, one connection carrying the I/O; CPU is the client's")
    print(f"{'row':<20} " + " ".join(f"{c:>9}" for c in who) + "   IOPS / libnbd: " + " ".join(f"{c:>8}" for c in who[1:])
          + "   CPU us/IO: " + " ".join(f"{c:>8}" for c in who))
    for row in clients:
        i = {c: med(iops[row, c]) for c in who}
        u = {c: med(cpu[row, c]) for c in who}
        print(f"{row:<20} " + " ".join(f"{i[c]:>9.0f}" for c in who) + "                  "
              + " ".join(f"{div(i[c], i.get('libnbd', 0)):>8.2f}" for c in who[1:])
              + "              " + " ".join(f"{u[c]:>8.2f}" for c in who))
EOF
