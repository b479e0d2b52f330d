#!/usr/bin/env bash
# bench-thin-snap.sh: what a snapshot's first write to a shared block
# costs, the kernel's dm-thin against blkstack's thin, measured the same
# way on both sides inside the kernel VM (docs/BENCHMARKS.md, "Thin
# provisioning"; docs/TARGETS.md, thin: "Breaking sharing").
#
# Each side: a pool (64 KiB blocks, block zeroing on) over RAM (the
# kernel's over two memory-backed null_blk devices, blkstack's over two
# `memory` devices, served by `blkstack serve` in the guest on
# /dev/ublkbN), a thin device of THIN_MB written whole, then per queue
# depth a snapshot of it and two fio passes over the snapshot, 4 KiB
# writes at the start of every 64 KiB block in turn (`rw=write:60k`:
# fio's random map is off with `blockalign`, so a random pass would
# write some blocks twice):
#   shared    every write is the first to a block it shares with the
#             origin (allocate, copy the 64 KiB block, then the write)
#   unshared  the same writes again: the blocks are the snapshot's own
# and the side's ratio is shared / unshared IOPS. The two sides' ratios
# are compared, not their IOPS: blkstack's device is reached through
# ublk, the kernel's directly, and under TCG only ratios within one run
# mean anything. The sides alternate, REPS times; the summary gives
# the medians.
#
#   scripts/bench-thin-snap.sh
#
# Environment: BLKSTACK_BIN (default target/release/blkstack, built if
# missing), THIN_MB (default 128), QDS (default "1 16"), REPS (default 3),
# KERNEL_VM_MEM (default 2048). Prints `RESULT <side> <qd> <shared>
# <unshared>` per pass pair, then `RATIO` lines per side and depth and
# `OURS/KERNEL` per depth.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
bin=${BLKSTACK_BIN:-$top/target/release/blkstack}
thin_mb=${THIN_MB:-128}
qds=${QDS:-1 16}
reps=${REPS:-3}
fio_bin=$(command -v fio || true)
[ -n "$fio_bin" ] || { echo "bench-thin-snap: fio is not installed (make deps)" >&2; exit 2; }
if [ ! -x "$bin" ]; then
  (cd "$top" && cargo build --release -p blkstack >&2)
fi

# Data: the origin and one snapshot per depth, each broken whole, and
# room to spare; metadata: 64 MiB.
nq=$(echo $qds | wc -w)
data_mb=$((thin_mb * (nq + 2)))
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cat > "$work/guest.sh" <<EOS
set -e
fail() { echo "FAIL: \$*"; exit 1; }
TS=$((thin_mb * 2048)); DS=$((data_mb * 2048)); MS=131072
BLOCKS=$((thin_mb * 16))
# fiorun DEV QD: write IOPS of 4 KiB at the start of each 64 KiB block.
fiorun() { fio --name=b --filename=\$1 --rw=write:60k --bs=4k --io_size=\$((BLOCKS * 4))k \
  --direct=1 --ioengine=libaio --iodepth=\$2 --thread --output-format=terse --terse-version=3 \
  | cut -d';' -f49; }
fill() { dd if=/dev/zero of=\$1 bs=1M count=$thin_mb oflag=direct 2>/dev/null || fail "fill \$1"; }
modprobe dm-thin-pool || fail "modprobe dm-thin-pool"
modprobe ublk_drv || fail "modprobe ublk_drv"

kernel_side() {
  modprobe null_blk nr_devices=2 gb=$(((data_mb + 1023) / 1024)) memory_backed=1 irqmode=0 \
    queue_mode=2 hw_queue_depth=64 || fail "modprobe null_blk"
  dmsetup create kpool --table "0 \$DS thin-pool /dev/nullb0 /dev/nullb1 128 0" || fail kpool
  dmsetup message kpool 0 create_thin 1 && dmsetup create kt1 --table "0 \$TS thin /dev/mapper/kpool 1" || fail kt1
  fill /dev/mapper/kt1
  id=2
  for qd in $qds; do
    dmsetup suspend kt1 && dmsetup message kpool 0 create_snap \$id 1 && dmsetup resume kt1 || fail "snap \$id"
    dmsetup create ks\$id --table "0 \$TS thin /dev/mapper/kpool \$id" || fail "ks\$id"
    s=\$(fiorun /dev/mapper/ks\$id \$qd); u=\$(fiorun /dev/mapper/ks\$id \$qd)
    echo "RESULT kernel \$qd \$s \$u"
    dmsetup remove ks\$id; id=\$((id + 1))
  done
  dmsetup remove kt1; dmsetup remove kpool || fail "remove kpool"
  rmmod null_blk
}

blkstack_side() {
  C=/tmp/thin.sock
  printf 'meta: 0 %s memory\ndata: 0 %s memory\npool: 0 %s thin-pool meta data 128 0\n' \$MS \$DS \$DS > /tmp/thin.stack
  blkstack serve --stack /tmp/thin.stack --ublk-enable --control \$C > /tmp/serve.out 2>&1 &
  S=\$!
  i=0; while ! grep -q '^ready' /tmp/serve.out; do
    kill -0 \$S || { cat /tmp/serve.out; fail "serve exited"; }
    [ \$i -lt 900 ] || fail "serve not ready"; usleep 100000; i=\$((i+1)); done
  at() { blkstack export --ublk --control \$C \$1 | sed -n 's/.* at \(\/dev\/ublkb[0-9]*\)\$/\1/p'; }
  blkstack message --control \$C pool 0 create_thin 1 >/dev/null || fail create_thin
  blkstack create --control \$C t1 --table "0 \$TS thin pool 1" || fail t1
  fill \$(at t1)
  id=2
  for qd in $qds; do
    blkstack suspend --control \$C t1 && blkstack message --control \$C pool 0 create_snap \$id 1 >/dev/null \
      && blkstack resume --control \$C t1 || fail "snap \$id"
    blkstack create --control \$C s\$id --table "0 \$TS thin pool \$id" || fail "s\$id"
    d=\$(at s\$id); [ -b "\$d" ] || fail "export s\$id"
    s=\$(fiorun \$d \$qd); u=\$(fiorun \$d \$qd)
    echo "RESULT blkstack \$qd \$s \$u"
    blkstack unexport --ublk --control \$C s\$id; blkstack remove --control \$C s\$id
    id=\$((id + 1))
  done
  kill -TERM \$S; wait \$S || true
}

r=0
while [ \$r -lt $reps ]; do
  kernel_side
  blkstack_side
  r=\$((r + 1))
done
echo DONE
EOS

summary() {
  awk '/^RESULT/ && $5 > 0 { k = $2" "$3; n[k]++; r[k, n[k]] = $4 / $5; sides[$2] = 1; qd[$3] = 1;
         s[k, n[k]] = $4; u[k, n[k]] = $5 }
    function median(k, a,   i, j, t, m, v) {
      m = n[k]; for (i = 1; i <= m; i++) v[i] = a[k, i]
      for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
      return m % 2 ? v[(m + 1) / 2] : (v[m / 2] + v[m / 2 + 1]) / 2
    }
    END {
      for (q in qd) {
        for (d in sides) { k = d" "q; if (n[k])
          printf "RATIO qd%s %s shared/unshared = %.3f (median of %d; IOPS %.0f / %.0f)\n",
            q, d, median(k, r), n[k], median(k, s), median(k, u) }
        if (n["blkstack "q] && n["kernel "q])
          printf "OURS/KERNEL qd%s = %.2f\n", q, median("blkstack "q, r) / median("kernel "q, r)
      }
    }'
}

st=0
KERNEL_VM_MEM=${KERNEL_VM_MEM:-2048} "$top/scripts/kernel-vm.sh" run --bin "$bin" --bin "$fio_bin" \
  --timeout $((reps * 600 + 300)) "$work/guest.sh" > "$work/vm.out" || st=$?
cat "$work/vm.out"
summary < "$work/vm.out"
exit $st
