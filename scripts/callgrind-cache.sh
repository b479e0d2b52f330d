#!/bin/sh
# Instructions per I/O of the cache hit path and of a `linear` over the
# same device (issue 39), counted by callgrind: a count the machine's
# load cannot change, unlike bench-cache.sh's IOPS. The stack is
# bench-cache.sh's with a 16 MiB hot set (valgrind runs threads one at a
# time, so the warm-up must stay short): the cache row warms for WARM
# seconds, then the counters are zeroed (callgrind_control -z) and what
# follows is all warm hits; the linear row and the raw cache device's
# (`cdev`) read a filled hot set. Per
# row, over the I/Os completed to the bench after the zeroing: the
# instructions of the bench's submissions to the device, inclusive (the
# whole stack down to the memory device and every completion back up
# to the bench), and of the cache target's own sources among them
# (mapped/src/targets/cache/). The process's total is not used: the
# bench's polling between completions grows with the machine's load.
#   scripts/callgrind-cache.sh [BLKSTACK] [WARM] [SECONDS]
set -eu
BIN=${1:-target/release/blkstack}
WARM=${2:-40}
SECS=${3:-30}
D=$(mktemp -d /tmp/blkstack-cg.XXXXXX)
trap 'rm -rf "$D"' EXIT
cat >"$D/stack" <<EOF2
meta: 0 16384 memory
cdev: 0 524288 memory
slowmem: 0 2097152 memory
slow: 0 2097152 delay slowmem 0 1
c: 0 2097152 cache meta cdev slow 128 1 writeback smq 0
lin: 0 524288 linear cdev 0
EOF2
row() { # DEVICE RAMP [FILL...]
  dev=$1 ramp=$2; shift 2
  valgrind --tool=callgrind --callgrind-out-file="$D/$dev.out" "$BIN" bench \
    --stack "$D/stack" --filename="$dev" "$@" --name=hot --stonewall --rw=randread \
    --bs=4k --iodepth=32 --size=16m --ramp_time="$ramp" --runtime="${SECS}s" \
    --time_based --output-format=json >/dev/null 2>"$D/$dev.err" &
  p=$!
  sleep $((ramp + 5))
  callgrind_control -z "$p" >/dev/null
  wait "$p"
  python3 - "$D/$dev.out" "$dev" <<'EOF3'
import re, sys
# Callgrind's format: fn=/cfn= name functions, fl=/fi=/fe= source files
# (each "(id) name" once, then "(id)"); a cost line after calls= is the
# call's inclusive cost, any other the current function's own, in the
# current file (inlined code keeps its own file).
ids = {"fn": {}, "fl": {}}
def name(kind, tok):
    m = re.match(r"\((\d+)\)(?: (.*))?", tok)
    if not m:
        return tok
    if m.group(2):
        ids[kind][m.group(1)] = m.group(2)
    return ids[kind].get(m.group(1), "")
fn, cfn, path, ios, stack, own, call, into = "", "", "", 0, 0, 0, False, False
for line in open(sys.argv[1]):
    key, _, rest = line.rstrip("\n").partition("=")
    if key in ("fl", "fi", "fe"):
        path = name("fl", rest)
    elif key == "cfn":
        cfn = name("fn", rest)
    elif key == "fn":
        fn = name("fn", rest)
    elif key == "calls":
        call = True
        into = "blkstack_bench" in fn and "Device>::submit_batch" in cfn
        if "CompletionQueue as blkstack_core::bio::EndIo>::end_io" in cfn:
            ios += int(rest.split()[0])
    elif line[:1].isdigit() or line[:1] in "+-*":
        parts = line.split()
        if call:
            call = False
            if into and len(parts) >= 2:
                stack += int(parts[1])
        elif len(parts) >= 2 and "/targets/cache/" in path:
            own += int(parts[1])
print(f"{sys.argv[2]}: {ios} I/Os, {stack / max(ios, 1):.0f} instructions per I/O "
      f"through the stack, {own / max(ios, 1):.0f} of them in mapped/src/targets/cache/")
EOF3
}
row c "$WARM"
row lin 0 --name=fill --rw=write --bs=1m --size=16m
row cdev 0 --name=fill --rw=write --bs=1m --size=16m
