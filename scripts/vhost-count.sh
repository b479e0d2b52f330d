#!/usr/bin/env bash
# vhost-count.sh: instructions and syscalls per request of blkstack's
# vhost-user-blk server and of the floor probe (issue 40), counted rather
# than timed, so a loaded machine gives the same answer as a quiet one.
#
# No guest: the host-side driver (frontends/vhost_user_blk/examples/
# vhost-drive) plays the VMM and Linux's virtio ring driver. Each server
# runs under `valgrind --tool=callgrind` (instructions) or is attached by
# `strace -c -f` (syscalls); the driver runs N1 then N2 requests on two
# connections, and the counts per request are (count(N2) - count(N1)) /
# (N2 - N1), so connection setup cancels out.
#
# Legs (the issue's three): null randread qd1, null randread qd32, file
# randwrite qd32 (O_DIRECT over a file in TMPDIR; TMPDIR must not be a
# tmpfs).
#
# Env: BLKSTACK (default target/release/blkstack), FLOOR (default
# target/release/examples/vhost-floor), DRIVE (default
# target/release/examples/vhost-drive; all built if missing), TOOLS
# ("callgrind strace"), SERVERS ("ours floor"), FLOOR_WAIT (epoll, the
# default, or ring), N1 (2000), N2 (12000), SETTLE_US (the guest's think
# time after each call, default 300 under strace and 3000 under valgrind:
# longer than the server's round, so every batch finds it asleep and
# the counts do not depend on the machine's speed or load), ANNOTATE (1: keep each
# server's top functions per request in OUT), LEGS (default
# "null:read:1 null:read:32 file:write:32", MEDIUM:RW:QD), OUT (where the callgrind
# files and annotations go, default a temporary directory, removed).
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
die() { echo "vhost-count: $*" >&2; exit 1; }
bin=${BLKSTACK:-$top/target/release/blkstack}
floor=${FLOOR:-$top/target/release/examples/vhost-floor}
drive=${DRIVE:-$top/target/release/examples/vhost-drive}
tools=${TOOLS:-callgrind strace}
servers=${SERVERS:-ours floor}
floor_wait=${FLOOR_WAIT:-epoll}
n1=${N1:-2000}
n2=${N2:-12000}
[ "$n2" -gt "$n1" ] || die "N2 ($n2) must be larger than N1 ($n1)"
for t in $tools; do
  case $t in
    callgrind) command -v valgrind > /dev/null || die "valgrind is not installed" ;;
    strace) command -v strace > /dev/null || die "strace is not installed" ;;
    *) die "TOOLS: callgrind or strace, not $t" ;;
  esac
done
if [ ! -x "$bin" ]; then
  (cd "$top" && cargo build --release -p blkstack --bin blkstack >&2)
fi
if [ ! -x "$floor" ] || [ ! -x "$drive" ]; then
  (cd "$top" && cargo build --release -p blkstack-vhost-user-blk --example vhost-floor --example vhost-drive >&2)
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/vhost-count.XXXXXX")
out=${OUT:-$work}
mkdir -p "$out"
pid=
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2> /dev/null || true; wait "$pid" 2> /dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
dd if=/dev/zero of="$work/disk.img" bs=1M count=64 conv=fsync status=none
sectors=$((64 * 2048))

# Start server $1 (ours|floor) for medium $2 (null|file) under tool $3;
# sets pid and sock.
start() {
  local who=$1 medium=$2 tool=$3 pre=()
  sock=$work/$who-$medium.sock
  rm -f "$sock" "$work/ctl.sock"
  if [ "$tool" = callgrind ]; then
    pre=(valgrind --tool=callgrind --callgrind-out-file="$out/cg.$who.$medium.%p" --dump-instr=no --compress-strings=no --compress-pos=no)
  fi
  if [ "$who" = ours ]; then
    local table="d,,,rw,0 $sectors null"
    [ "$medium" = file ] && table="d,,,rw,0 $sectors file $work/disk.img direct"
    "${pre[@]}" "$bin" serve --concise "$table" --vhost-user-blk "$sock:d" \
      --control "$work/ctl.sock" > "$work/serve.out" 2>&1 &
  else
    local m=(--kind null --size $((sectors * 512)))
    [ "$medium" = file ] && m=(--kind file --path "$work/disk.img")
    "${pre[@]}" "$floor" "${m[@]}" --socket "$sock" --wait "$floor_wait" > "$work/serve.out" 2>&1 &
  fi
  pid=$!
  for _ in $(seq 600); do
    [ -S "$sock" ] && break
    kill -0 "$pid" 2> /dev/null || { cat "$work/serve.out" >&2; die "$who did not start"; }
    sleep 0.1
  done
  [ -S "$sock" ] || die "$who: no socket after 60 s"
  # valgrind's start is slow: the socket comes before the loop runs.
  sleep 1
}

stop() {
  kill "$pid" 2> /dev/null || true
  wait "$pid" 2> /dev/null || true
  pid=
}

# The driver on a fresh connection: $1 requests, $2 qd, $3 rw, $4 think
# time (µs).
drive() {
  "$drive" --socket "$sock" --requests "$1" --qd "$2" --rw "$3" --span "$sectors" \
    --settle-us "$4" > /dev/null
}

# Instructions in the last callgrind dump of the server.
last_ir() {
  local f
  f=$(ls -t "$out"/cg."$1"."$2".* | head -1)
  awk '/^(totals|summary):/ {print $2; exit}' "$f"
}

# Each function's own instructions (not its callees') in callgrind file
# $1, per request ($2 requests), most first. (callgrind_annotate 3.19
# shows inclusive costs only for these files.)
self_cost() {
  awk -v n="$2" '
    /^fn=/ { f = substr($0, 4); next }
    /^calls=/ { skip = 1; next }
    /^[0-9+*-]/ { if (skip) { skip = 0; next } c[f] += $2 }
    END { for (f in c) printf "%10.1f %s\n", c[f] / n, f }' "$1" | sort -rn
}

cg_leg() {
  local who=$1 medium=$2 qd=$3 rw=$4 a b t=${SETTLE_US:-3000}
  if [ "$who" = ours ] && [ "$medium" = file ]; then
    # The file device's completion thread sleeps in io_uring_enter, which
    # valgrind does not treat as a blocking call: its one-thread-at-a-time
    # lock is never released and the server hangs. Syscalls only.
    echo "COUNT $who $medium $rw qd$qd instructions_per_io n/a (valgrind cannot run io_uring waits)"
    return
  fi
  start "$who" "$medium" callgrind
  drive 200 "$qd" "$rw" "$t"
  callgrind_control -z "$pid" > /dev/null 2>&1
  drive "$n1" "$qd" "$rw" "$t"
  callgrind_control -d "n1" "$pid" > /dev/null 2>&1
  a=$(last_ir "$who" "$medium")
  callgrind_control -z "$pid" > /dev/null 2>&1
  drive "$n2" "$qd" "$rw" "$t"
  callgrind_control -d "n2" "$pid" > /dev/null 2>&1
  b=$(last_ir "$who" "$medium")
  if [ "${ANNOTATE:-0}" = 1 ]; then
    self_cost "$(ls -t "$out"/cg."$who"."$medium".* | head -1)" "$n2" |
      head -40 > "$out/top.$who.$medium.$rw.qd$qd.txt"
  fi
  stop
  echo "COUNT $who $medium $rw qd$qd instructions_per_io $(((b - a) / (n2 - n1)))"
}

st_leg() {
  local who=$1 medium=$2 qd=$3 rw=$4 a b s t=${SETTLE_US:-300}
  start "$who" "$medium" strace
  drive 200 "$qd" "$rw" "$t"
  for n in "$n1" "$n2"; do
    strace -c -f -p "$pid" -o "$work/st.$n" 2> /dev/null &
    s=$!
    sleep 1
    drive "$n" "$qd" "$rw" "$t"
    kill -INT "$s"
    wait "$s" 2> /dev/null || true
  done
  a=$(awk '/ total$/ {print $4}' "$work/st.$n1")
  b=$(awk '/ total$/ {print $4}' "$work/st.$n2")
  [ "${ANNOTATE:-0}" = 1 ] && cp "$work/st.$n2" "$out/strace.$who.$medium.$rw.qd$qd.txt"
  stop
  echo "COUNT $who $medium $rw qd$qd syscalls_per_io $(awk -v a="$a" -v b="$b" -v n=$((n2 - n1)) 'BEGIN {printf "%.2f", (b - a) / n}')"
}

legs=${LEGS:-null:read:1 null:read:32 file:write:32}
for tool in $tools; do
  for who in $servers; do
    for leg in $legs; do
      leg=${leg//:/ }
      set -- $leg
      if [ "$tool" = callgrind ]; then cg_leg "$who" "$1" "$3" "$2"; else st_leg "$who" "$1" "$3" "$2"; fi
    done
  done
done
