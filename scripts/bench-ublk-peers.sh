#!/usr/bin/env bash
# bench-ublk-peers.sh: blkstack's ublk server against the kernel's own null
# devices, in the kernel VM (issue 40): the same 4 KiB random reads and
# writes at QD1 and QD32 on
#   null_blk  the kernel's null_blk (drivers/block/null_blk/: irqmode=0,
#             queue_mode=2, one submit queue of 64 tags), no server at all
#   blkstack  blkstack serve's `null` (zero_reads=0: read buffers left
#             untouched, as null_blk and kublk's null leave them; one
#             hardware queue of 64) as /dev/ublkbN through ublk_drv
#   kublk     the kernel selftests' own ublk server (tools/testing/
#             selftests/ublk/kublk, `add -t null -q 1 -d 64`), built static
#             for the 6.12 guest by scripts/kublk/build.sh
#
#   scripts/bench-ublk-peers.sh
#
# fio is copied into the guest with its libraries (libaio, O_DIRECT), kublk
# as a static binary; fio covers the first GiB of each device (kublk's
# null is 250 GiB, the others 1 GiB) so that all see the same offsets.
# Each repetition runs every device for each (rw, QD) before the next,
# REPS times. Prints `RESULT <dev> <rw> <qd> <iops>` per point, then the
# medians and `RATIO` lines: blkstack's IOPS over null_blk's and over
# kublk's. These are TCG figures: only the ratios within one run say
# anything.
#
# kublk is not in the 6.12 tree (the ublk selftests arrived in 6.15) and
# needs liburing: scripts/kublk/build.sh builds it from the upstream files
# in target/kublk/src against Debian's liburing-dev (liburing.a), patched
# to run on 6.12 (scripts/kublk/README.md). KUBLK=PATH takes a static
# kublk built elsewhere instead. When it cannot be built (no sources, no
# liburing) the script says why in one line and leaves the kublk column out.
#
# COUNTS=1 measures what each server spends instead of IOPS: every
# (device, rw, QD) point once, and for the two servers the server
# process's CPU (utime+stime of /proc/PID/stat, all threads, and each
# apart: user is the server's own code, system the kernel's side of the
# exchange, ublk_drv's copies included) per I/O,
# its voluntary and involuntary context switches per I/O (summed over
# /proc/PID/task/*/status), and each thread's CPU per I/O (`THREAD`
# lines: which threads an I/O involves). With strace on the host it is
# copied into the guest and each point runs a second time under
# `strace -c -f` (slower: only its counts mean anything): system calls
# per I/O, io_uring_enter among them. The I/Os are fio's own totals.
# Lines: `COUNTS <dev> <rw> <qd> ios=N cpu_us_per_io=.. (usr .. sys ..)
# vcsw_per_io=.. ivcsw_per_io=..`, `THREAD <dev> <rw> <qd> <comm> cpu_us_per_io=..`,
# `SYSCALLS <dev> <rw> <qd> <syscall> per_io=..`, and the guest's
# clocksource at the end (`CLOCKSOURCE`: one without a vDSO read turns
# every clock_gettime into a system call). Both servers run under
# the same TCG, so their ratio is fair even where the absolute µs are not.
#
# Environment: BLKSTACK_BIN (default target/release/blkstack, built if
# missing), KUBLK (a static kublk; default: scripts/kublk/build.sh's, which
# reads KUBLK_SRC and KUBLK_UAPI), BENCH_RUNTIME seconds per point
# (default 10), REPS (default 3), COUNTS, KERNEL_VM_MEM.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
bin=${BLKSTACK_BIN:-$top/target/release/blkstack}
fio_bin=$(command -v fio || true)
rt=${BENCH_RUNTIME:-10}
reps=${REPS:-3}
kublk=${KUBLK:-}
counts=${COUNTS:-0}

die() { echo "bench-ublk-peers: $*" >&2; exit 2; }
[ -n "$fio_bin" ] || die "fio is not installed (make deps)"
case $rt$reps in *[!0-9]*) die "BENCH_RUNTIME and REPS want whole numbers" ;; esac
case $counts in 0|1) ;; *) die "COUNTS wants 0 or 1" ;; esac
strace_bin=""
[ "$counts" = 0 ] || strace_bin=$(command -v strace || true)
if [ -z "$kublk" ]; then
  # build.sh prints the binary's path last; exit 3 is one line naming a
  # missing prerequisite
  kst=0; kout=$("$top/scripts/kublk/build.sh" 2>&1) || kst=$?
  case $kst in
    0) kublk=$(printf '%s\n' "$kout" | tail -n1) ;;
    3) echo "bench-ublk-peers: no kublk column: ${kout#kublk: }" >&2 ;;
    *) printf '%s\n' "$kout" >&2; die "scripts/kublk/build.sh failed" ;;
  esac
fi
if [ -n "$kublk" ]; then
  [ -x "$kublk" ] || die "KUBLK=$kublk is not an executable"
  { ldd "$kublk" 2>&1 || true; } | grep -q "not a dynamic" || die "KUBLK=$kublk must be linked statically (the guest has no liburing)"
fi
if [ ! -x "$bin" ]; then
  (cd "$top" && cargo build --release -p blkstack >&2)
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/bench-ublk-peers.XXXXXX")
trap 'rm -rf "$work"' EXIT
kublk_args=()
[ -z "$kublk" ] || kublk_args=(--file "$kublk:/bin/kublk")
[ -z "$strace_bin" ] || kublk_args+=(--bin "$strace_bin")

cat > "$work/guest.sh" <<EOS
set -e
R=$reps
fiorun() { fio --name=b --filename=\$1 --size=1g --rw=\$2 --bs=4k --direct=1 --ioengine=libaio \
  --iodepth=\$3 --runtime=$rt --time_based --thread --output-format=terse --terse-version=3 \
  | awk -F';' -v rw=\$2 '{ print rw == "randread" ? \$8 : \$49 }'; }
# counters PID: the process's user and system CPU ticks (all threads,
# the exited ones too), then its voluntary and involuntary switches (the
# live threads')
counters() {
  echo "\$(sed 's/.*) //' /proc/\$1/stat | awk '{ print \$12, \$13 }')" \
    "\$(cat /proc/\$1/task/*/status | awk '/^voluntary_ctxt/ { v += \$2 } /^nonvoluntary_ctxt/ { n += \$2 } END { print v, n }')"
}
# threads PID: one line per live thread, its name and CPU ticks
threads() {
  for t in /proc/\$1/task/*; do
    echo "\$(tr ' ' _ < \$t/comm) \$(sed 's/.*) //' \$t/stat | awk '{ print \$12 + \$13 }')"
  done
}
# fioios DEV RW QD: the I/Os fio completed (4 KiB each)
fioios() {
  fio --name=b --filename=\$1 --size=1g --rw=\$2 --bs=4k --direct=1 --ioengine=libaio \
    --iodepth=\$3 --runtime=$rt --time_based --thread --output-format=terse --terse-version=3 \
    | awk -F';' -v rw=\$2 '{ print int((rw == "randread" ? \$6 : \$47) / 4) }'
}
# countrun NAME DEV RW QD PID: COUNTS and THREAD lines of one point
countrun() {
  threads \$5 > /tmp/th0; c0=\$(counters \$5)
  n=\$(fioios \$2 \$3 \$4)
  c1=\$(counters \$5); threads \$5 > /tmp/th1
  echo "\$c0 \$c1" | awk -v p="\$1 \$3 \$4" -v n=\$n '{ d = n > 0 ? n : 1
    printf "COUNTS %s ios=%d cpu_us_per_io=%.1f (usr %.1f sys %.1f) vcsw_per_io=%.3f ivcsw_per_io=%.3f\\n",
      p, n, (\$5 + \$6 - \$1 - \$2) * 10000 / d, (\$5 - \$1) * 10000 / d, (\$6 - \$2) * 10000 / d,
      (\$7 - \$3) / d, (\$8 - \$4) / d }'
  awk -v p="\$1 \$3 \$4" -v n=\$n 'NR == FNR { t0[\$1] += \$2; next } { t1[\$1] += \$2 }
    END { for (c in t1) { u = (t1[c] - t0[c]) * 10000 / (n > 0 ? n : 1)
      if (u >= 0.05) printf "THREAD %s %s cpu_us_per_io=%.1f\\n", p, c, u } }' /tmp/th0 /tmp/th1
  if [ -x /bin/strace ]; then
    strace -c -f -q -o /tmp/strace.out -p \$5 & T=\$!
    sleep 1
    n=\$(fioios \$2 \$3 \$4)
    kill -INT \$T; wait \$T 2>/dev/null || true
    awk -v p="\$1 \$3 \$4" -v n=\$n '\$NF ~ /^[a-z_0-9]+\$/ && \$(NF - 1) ~ /^[0-9]+\$/ && \$NF != "total" {
      c = \$(NF - 1); if (NF == 6) c = \$4
      printf "SYSCALLS %s %s per_io=%.3f\\n", p, \$NF, c / (n > 0 ? n : 1) }' /tmp/strace.out
  fi
}
modprobe null_blk nr_devices=1 gb=1 irqmode=0 queue_mode=2 hw_queue_depth=64 submit_queues=1
modprobe ublk_drv
devs="null_blk:/dev/nullb0"
blkstack serve --concise 'nul,,,rw,0 2097152 null zero_reads=0 hw_queue_depth=64' --ublk nul \
  --control /tmp/bench-ublk.sock > /tmp/serve.out 2>&1 &
S=\$!
i=0; while ! grep -q '^ready' /tmp/serve.out; do
  kill -0 \$S 2>/dev/null || { cat /tmp/serve.out; exit 1; }
  [ \$i -lt 600 ] || { echo "blkstack serve not ready"; exit 1; }; sleep 0.1; i=\$((i+1)); done
U=\$(sed -n 's/^serving nul .* at \(\/dev\/ublkb[0-9]*\)\$/\1/p' /tmp/serve.out)
[ -b "\$U" ] || { echo "no ublk device: \$(cat /tmp/serve.out)"; exit 1; }
devs="\$devs blkstack:\$U"
KID=""
if [ -x /bin/kublk ]; then
  kublk add -t null -q 1 -d 64 > /tmp/kublk.out 2>&1 || { cat /tmp/kublk.out; exit 1; }
  KID=\$(sed -n 's/^dev id \([0-9]*\):.*/\1/p' /tmp/kublk.out)
  K=/dev/ublkb\$KID
  i=0; while [ ! -b "\$K" ] && [ \$i -lt 100 ]; do sleep 0.1; i=\$((i+1)); done
  [ -n "\$KID" ] && [ -b "\$K" ] || { echo "kublk made no device: \$(cat /tmp/kublk.out)"; exit 1; }
  devs="\$devs kublk:\$K"
fi
if [ $counts = 1 ]; then
  KP=\$(pidof kublk || true)
  for rw in randread randwrite; do
    for qd in 1 32; do
      countrun blkstack \$U \$rw \$qd \$S
      [ -z "\$KID" ] || countrun kublk \$K \$rw \$qd \$KP
    done
  done
  # a clocksource without a vDSO read makes every clock_gettime a
  # system call: say which one this boot ended with
  echo "CLOCKSOURCE \$(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null || echo unknown)"
  R=0
fi
for rep in \$(seq \$R); do
  for rw in randread randwrite; do
    for qd in 1 32; do
      for nd in \$devs; do
        echo "RESULT \${nd%%:*} \$rw \$qd \$(fiorun \${nd#*:} \$rw \$qd)"
      done
    done
  done
done
[ -z "\$KID" ] || kublk del -n \$KID >/dev/null 2>&1 || true
kill \$S; wait \$S || true
EOS

# counts: 8 points, each twice (the second under strace)
timeout=$((reps * 12 * (rt + 10) + 300))
[ "$counts" = 0 ] || timeout=$((16 * (rt + 15) + 300))
KERNEL_VM_MEM=${KERNEL_VM_MEM:-1024} "$top/scripts/kernel-vm.sh" run --bin "$bin" --bin "$fio_bin" \
  "${kublk_args[@]+"${kublk_args[@]}"}" --timeout $timeout \
  "$work/guest.sh" > "$work/guest.out" || { cat "$work/guest.out" >&2; die "the guest failed"; }
if [ "$counts" = 1 ]; then
  [ -n "$strace_bin" ] || echo "bench-ublk-peers: no strace on the host: no SYSCALLS lines" >&2
  grep -E '^(COUNTS|THREAD|SYSCALLS|CLOCKSOURCE) ' "$work/guest.out"
  exit 0
fi
grep '^RESULT' "$work/guest.out" | tee "$work/results"

awk '
  function median(s,   a, n, i, j, t) {
    n = split(s, a, " ")
    for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] + 0 > a[j] + 0; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  { k = $2" "$3" "$4; iops[k] = iops[k]" "$5; seen[$3" "$4] = 1 }
  END {
    for (p in seen) {
      split(p, pq, " "); b = median(iops["blkstack "p])
      line = sprintf("MEDIAN %s qd%s: blkstack %.0f", pq[1], pq[2], b)
      for (m = 1; m <= 2; m++) {
        peer = m == 1 ? "null_blk" : "kublk"
        if (!((peer" "p) in iops)) continue
        v = median(iops[peer" "p]); line = line sprintf(", %s %.0f", peer, v)
        ratio[m] = sprintf("RATIO %s qd%s blkstack/%s %.2f", pq[1], pq[2], peer, v > 0 ? b / v : 0)
      }
      print line
      for (m = 1; m <= 2; m++) if (m in ratio) { print ratio[m]; delete ratio[m] }
    }
  }' "$work/results" | sort
