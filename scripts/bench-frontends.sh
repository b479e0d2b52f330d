#!/usr/bin/env bash
# bench-frontends.sh: what blkstack's kernel-facing frontends cost, as
# ratios measured in one run (absolute figures under qemu's TCG mean
# nothing; on real hardware run `host` below).
#
#   scripts/bench-frontends.sh [guest]   inside the kernel VM: 4k random
#       reads at QD1 and QD32 (fio, libaio, O_DIRECT) on the kernel's own
#       null_blk, on blkstack's null device as /dev/ublkb0, and on the
#       same device over NBD on loopback through the kernel's nbd client
#   scripts/bench-frontends.sh vm        one guest with two disks served by
#       one blkstack serve on the host, the same null device: as a
#       vhost-user-blk disk and through qemu's NBD driver
#   scripts/bench-frontends.sh host      the guest comparison run on this
#       machine's own kernel (root, Linux 6.x with ublk_drv, null_blk, nbd)
#
# Environment: BLKSTACK_BIN (default target/release/blkstack, built if
# missing), BENCH_RUNTIME seconds per point (default 10), KERNEL_VM_MEM.
# Prints one line per point, `RESULT <device> <qd> <iops>`, then ratios.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
bin=${BLKSTACK_BIN:-$top/target/release/blkstack}
rt=${BENCH_RUNTIME:-10}
fio_bin=$(command -v fio || true)

need() {
  [ -n "$fio_bin" ] || { echo "bench-frontends: fio is not installed (make deps)" >&2; exit 2; }
  if [ ! -x "$bin" ]; then
    (cd "$top" && cargo build --release -p blkstack >&2)
  fi
}

# The comparison itself, for a shell on the machine under test (the guest,
# or a host with root). $1: the blkstack binary.
points() {
  cat <<EOS
set -e
B=$1; RT=$rt
fiorun() { fio --name=b --filename=\$1 --rw=randread --bs=4k --direct=1 --ioengine=libaio \
  --iodepth=\$2 --runtime=\$RT --time_based --thread --output-format=terse --terse-version=3 \
  | cut -d';' -f8; }
modprobe null_blk nr_devices=1 gb=1 irqmode=0 queue_mode=2 hw_queue_depth=64
modprobe ublk_drv; modprobe nbd
\$B serve --concise 'nul,,,rw,0 2097152 null' --ublk nul --export nul \
  --listen nbd://127.0.0.1:10899 --control /tmp/bench-frontends.sock > /tmp/bench-serve.out 2>&1 &
S=\$!
i=0; while ! grep -q '^ready' /tmp/bench-serve.out; do
  kill -0 \$S || { cat /tmp/bench-serve.out; exit 1; }
  [ \$i -lt 600 ] || exit 1; sleep 0.1; i=\$((i+1)); done
U=\$(sed -n 's/^serving nul .* at \(\/dev\/ublkb[0-9]*\)\$/\1/p' /tmp/bench-serve.out)
nbd-client 127.0.0.1 10899 /dev/nbd0 -N nul -b 4096 >/dev/null 2>&1
for qd in 1 32; do
  for d in /dev/nullb0 \$U /dev/nbd0; do
    echo "RESULT \$d \$qd \$(fiorun \$d \$qd)"
  done
done
nbd-client -d /dev/nbd0 >/dev/null 2>&1 || true
kill \$S; wait \$S || true
rmmod null_blk || true
EOS
}

ratios() {
  awk '/^RESULT/ { iops[$2" "$3] = $4; dev[$2] = 1; qd[$3] = 1 }
    END {
      for (q in qd) {
        base = ""; for (d in dev) if (d ~ /nullb|vdb|by-serial/) base = d
        if (base == "" || iops[base" "q] == 0) continue
        for (d in dev) if (d != base)
          printf "RATIO qd%s %s / %s = %.2f\n", q, d, base, iops[d" "q] / iops[base" "q]
      }
    }'
}

case ${1:-guest} in
  guest)
    need
    points /bin/blkstack > "${TMPDIR:-/tmp}/bench-frontends.sh.guest"
    KERNEL_VM_MEM=${KERNEL_VM_MEM:-2048} "$top/scripts/kernel-vm.sh" run --bin "$bin" --bin "$fio_bin" \
      --timeout $((rt * 8 + 200)) "${TMPDIR:-/tmp}/bench-frontends.sh.guest" | tee /dev/stderr | ratios
    ;;
  vm)
    need
    work=$(mktemp -d); trap 'kill $S 2>/dev/null; rm -rf "$work"' EXIT
    "$bin" serve --concise 'nul,,,rw,0 2097152 null' --vhost-user-blk "$work/vu.sock:nul" \
      --export nul --listen nbd://127.0.0.1:0 --control "$work/c.sock" > "$work/serve.out" 2>&1 &
    S=$!
    for _ in $(seq 600); do grep -q '^ready' "$work/serve.out" && break; sleep 0.1; done
    port=$(sed -n 's|.*nbd://127.0.0.1:\([0-9]*\)/nul.*|\1|p' "$work/serve.out" | head -n1)
    cat > "$work/guest.sh" <<EOS
fiorun() { fio --name=b --filename=\$1 --rw=randread --bs=4k --direct=1 --ioengine=libaio \
  --iodepth=\$2 --runtime=$rt --time_based --thread --output-format=terse --terse-version=3 | cut -d';' -f8; }
for qd in 1 32; do
  for d in /dev/vda /dev/disk/by-serial/nbdnul; do echo "RESULT \$d \$qd \$(fiorun \$d \$qd)"; done
done
EOS
    KERNEL_VM_MEM=${KERNEL_VM_MEM:-2048} "$top/scripts/kernel-vm.sh" run --vhost-user-blk "$work/vu.sock:1" \
      --disk "nbdnul=nbd://127.0.0.1:$port/nul" --bin "$fio_bin" --timeout $((rt * 4 + 200)) \
      "$work/guest.sh" | tee /dev/stderr | ratios
    ;;
  host)
    need
    [ "$(id -u)" = 0 ] || { echo "bench-frontends host: run as root (modprobe, /dev/ublk-control)" >&2; exit 2; }
    points "$bin" > "${TMPDIR:-/tmp}/bench-frontends.sh.host"
    sh "${TMPDIR:-/tmp}/bench-frontends.sh.host" | tee /dev/stderr | ratios
    ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed 's/^# \{0,1\}//;$d' >&2; exit 2 ;;
esac
