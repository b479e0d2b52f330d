#!/bin/sh
# The verity benchmark (issue 38; docs/BENCHMARKS.md): sequential reads
# through blkstack's `verity` target with check_at_most_once, beside the
# same reads of the raw data device, in process (`blkstack bench`). Both
# devices are `file` targets over images in /dev/shm, so the raw row is
# the page cache's speed and the verity row adds only what verity costs.
# The tree is built by `blkstack verity format`. Rows are interleaved,
# ROUNDS of each; the medians and their ratio are printed (goal: verity
# with check_at_most_once at least 0.8 of raw). A third row, verity
# without check_at_most_once, shows the cost of hashing every read.
#   scripts/bench-verity.sh [ROUNDS] [SIZE_MIB] [SECONDS] [BLKSTACK]
set -eu
ROUNDS=${1:-3}
SIZE=${2:-256}
SECS=${3:-10}
BIN=${4:-target/release/blkstack}
D=$(mktemp -d /dev/shm/blkstack-verity.XXXXXX)
trap 'rm -rf "$D"' EXIT
dd if=/dev/urandom of="$D/data" bs=1M count="$SIZE" status=none
"$BIN" verity format --salt 5eed "$D/data" "$D/hash" >"$D/fmt"
ROOT=$(awk '/^Root hash:/ {print $3}' "$D/fmt")
SECT=$((SIZE * 2048))
HSECT=$(($(stat -c %s "$D/hash") / 512))
BLOCKS=$((SIZE * 256))
cat >"$D/stack" <<EOF
data: 0 $SECT file $D/data
hash: 0 $HSECT file $D/hash
v: 0 $SECT verity 1 data hash 4096 4096 $BLOCKS 1 sha256 $ROOT 5eed 1 check_at_most_once
vall: 0 $SECT verity 1 data hash 4096 4096 $BLOCKS 1 sha256 $ROOT 5eed
EOF
mibs() { # DEVICE: sequential read MiB/s
  "$BIN" bench --stack "$D/stack" --name=seq --filename="$1" --rw=read --bs=128k \
    --iodepth=8 --runtime="${SECS}s" --time_based --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; t=sys.stdin.read(); print(round(json.loads(t[t.index("{"):])["jobs"][0]["read"]["bw"]/1024, 1))'
}
: >"$D/raw"; : >"$D/v"; : >"$D/vall"
for r in $(seq "$ROUNDS"); do
  raw=$(mibs data); v=$(mibs v); vall=$(mibs vall)
  echo "$raw" >>"$D/raw"; echo "$v" >>"$D/v"; echo "$vall" >>"$D/vall"
  echo "round $r: raw=${raw} MiB/s verity+check_at_most_once=${v} MiB/s verity=${vall} MiB/s"
done
med() { sort -n "$1" | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
RAW=$(med "$D/raw"); V=$(med "$D/v"); VALL=$(med "$D/vall")
echo "median: raw=$RAW verity+check_at_most_once=$V ($(python3 -c "print(round($V/$RAW,3))") of raw) verity=$VALL ($(python3 -c "print(round($VALL/$RAW,3))") of raw) MiB/s"
