#!/bin/sh
# The cache hit-path benchmark (issue 39; docs/BENCHMARKS.md): 4 KiB
# random reads of a hot set through blkstack's `cache` target (smq,
# writeback) whose cache device is a `memory` device and whose origin is
# a `delay` (1 ms reads) over another, beside the same reads of the raw
# cache device, in process (`blkstack bench`). The cache run warms for
# WARM seconds first (`--ramp_time`, not counted): misses cost the 1 ms
# origin read, and smq promotes the hot blocks as they climb its hotspot
# queue; what is measured is the warm hit path. Rows are interleaved,
# ROUNDS of each; the medians and their ratio are printed (goal: the
# cache at least 0.9 of raw). A third row reads the same hot set through
# a `linear` over the raw device, filled the same way: what one mapped
# layer costs by itself, the floor of any target stacked there.
#   scripts/bench-cache.sh [ROUNDS] [SECONDS] [WARM] [BLKSTACK]
set -eu
ROUNDS=${1:-3}
SECS=${2:-10}
WARM=${3:-30}
BIN=${4:-target/release/blkstack}
D=$(mktemp -d /tmp/blkstack-cache.XXXXXX)
trap 'rm -rf "$D"' EXIT
# Origin 1 GiB, cache device 256 MiB (4096 blocks of 64 KiB), hot set the
# first 128 MiB of the origin (fits the cache twice over).
ORIGIN=2097152
CACHE=524288
HOT=128m
cat >"$D/stack" <<EOF2
meta: 0 16384 memory
cdev: 0 $CACHE memory
slowmem: 0 $ORIGIN memory
slow: 0 $ORIGIN delay slowmem 0 1
c: 0 $ORIGIN cache meta cdev slow 128 1 writeback smq 0
lin: 0 $CACHE linear cdev 0
EOF2
iops() { # DEVICE RAMP [FILL...]: 4 KiB randread IOPS over the hot set
  dev=$1 ramp=$2; shift 2
  "$BIN" bench --stack "$D/stack" --filename="$dev" "$@" --name=hot --stonewall \
    --rw=randread --bs=4k --iodepth=32 --size=$HOT --ramp_time="$ramp" \
    --runtime="${SECS}s" --time_based --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; t=sys.stdin.read(); print(round(json.loads(t[t.index("{"):])["jobs"][-1]["read"]["iops"]))'
}
# The raw device's hot set is written first: a memory device reads an
# unwritten page as a memset of zeroes, far cheaper than the copy of a
# stored page that every cache hit reads (promotion wrote it), so an
# unfilled raw run measures a different thing.
FILL="--name=fill --rw=write --bs=1m --size=$HOT"
: >"$D/raw"; : >"$D/c"; : >"$D/lin"
for r in $(seq "$ROUNDS"); do
  # shellcheck disable=SC2086
  raw=$(iops cdev 0 $FILL); c=$(iops c "$WARM"); lin=$(iops lin 0 $FILL)
  echo "$raw" >>"$D/raw"; echo "$c" >>"$D/c"; echo "$lin" >>"$D/lin"
  echo "round $r: raw cache device=${raw} IOPS cache (warm)=${c} IOPS linear over it=${lin} IOPS"
done
med() { sort -n "$1" | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
RAW=$(med "$D/raw"); C=$(med "$D/c"); LIN=$(med "$D/lin")
echo "median: raw=$RAW cache=$C ($(python3 -c "print(round($C/$RAW,3))") of raw) linear=$LIN ($(python3 -c "print(round($LIN/$RAW,3))") of raw) IOPS"
