#!/usr/bin/env bash
# thin-overwrite-cost.sh: CPU instructions per 4 KiB overwrite of an
# already provisioned thin block against the raw `memory` device, counted
# by callgrind (docs/BENCHMARKS.md, "Thin provisioning"): a count that a
# loaded machine cannot change, where IOPS need a quiet one.
#
# examples/thin-memory.stack with its metadata from thin_restore of
# examples/thin-bench.xml, as the timed benchmark, but over the first
# SIZE of each device (default 64m: 1024 blocks of 64 KiB) so that after
# the first pass every write overwrites a block whose page is allocated
# and whose mapping is cached. Each device runs twice, N1 and N2 I/Os; the
# difference of the two totals over N2 - N1 is the steady-state cost of
# one I/O (start-up, the metadata load and the first pass cancel out).
# The metadata file is read with `engine=psync`: valgrind does not follow
# io_uring's completions.
#
#   scripts/thin-overwrite-cost.sh
#
# Environment: BLKSTACK_BIN (default target/release/blkstack), SIZE,
# N1 (default 20000), N2 (default 60000), OUT (default a temporary
# directory, kept). Prints `IR_PER_IO <device> <instructions>` per
# device and `RATIO raw/provisioned <r>`.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BLKSTACK_BIN:-target/release/blkstack}
SIZE=${SIZE:-64m}
N1=${N1:-20000}
N2=${N2:-60000}
OUT=${OUT:-$(mktemp -d /tmp/thin-overwrite-cost.XXXXXX)}
mkdir -p "$OUT"
for tool in valgrind callgrind_annotate thin_restore; do
    command -v "$tool" >/dev/null || { echo "missing $tool" >&2; exit 1; }
done
[ -x "$BIN" ] || { echo "no $BIN: cargo build --release -p blkstack" >&2; exit 1; }

stack=$OUT/thin-memory.stack
sed "s#/tmp/thin-meta.img#$OUT/meta.img engine=psync#" examples/thin-memory.stack >"$stack"

# Total instructions of one run of `dev` with `n` I/Os.
run() {
    local dev=$1 n=$2 cg=$OUT/callgrind.$1.$2
    rm -f "$OUT/meta.img"
    truncate -s 128M "$OUT/meta.img"
    thin_restore -i examples/thin-bench.xml -o "$OUT/meta.img" >/dev/null
    valgrind --tool=callgrind --fair-sched=yes --callgrind-out-file="$cg" \
        "$BIN" bench --stack "$stack" --name="$dev" --filename="$dev" \
        --rw=randwrite --bs=4k --ba=64k --iodepth=16 --size="$SIZE" \
        --norandommap --io_size=$((n * 4096)) --eta=never \
        --output-format=json >"$OUT/bench.$dev.$n.json" 2>"$OUT/valgrind.$dev.$n.log"
    awk '/^totals:/ {print $2}' "$cg"
}

declare -A per
for dev in raw provisioned; do
    a=$(run "$dev" "$N1")
    b=$(run "$dev" "$N2")
    per[$dev]=$(( (b - a) / (N2 - N1) ))
    echo "IR_PER_IO $dev ${per[$dev]}"
done
awk -v r="${per[raw]}" -v p="${per[provisioned]}" \
    'BEGIN { printf "RATIO raw/provisioned %.3f\n", r / p }'
echo "callgrind files in $OUT (callgrind_annotate --inclusive=yes FILE)"
