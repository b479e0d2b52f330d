#!/usr/bin/env bash
# bench-vhost-peers.sh: blkstack's vhost-user-blk server against the one a
# user would run instead, qemu-storage-daemon's vhost-user-blk export
# (qemu's block/export/vhost-user-blk-server.c), serving the same devices
# to the same TCG guest (issue 40).
#
#   scripts/bench-vhost-peers.sh
#
# Six vhost-user-blk disks in one guest (scripts/kernel-vm.sh, the guest's
# RAM a shared memfd as vhost-user needs), in this order:
#   /dev/vda  qsd-null  qemu-storage-daemon, null-co (read-zeroes=on), 1 GiB
#   /dev/vdb  bs-null   blkstack serve, `null` (zeroed reads), 1 GiB
#   /dev/vdc  qsd-file  qemu-storage-daemon, a raw file, O_DIRECT, io_uring
#   /dev/vdd  bs-file   blkstack serve, `file PATH direct` (io_uring), a
#                       second file of the same size, filled the same way
#   /dev/vde  fl-null   vhost-floor (frontends/vhost_user_blk/examples/
#                       vhost-floor), the least a server can spend: zeroed
#                       reads, 1 GiB
#   /dev/vdf  fl-file   vhost-floor over a third file, O_DIRECT, io_uring
# One virtqueue each, one server process per program. In the guest, fio
# (copied in with its libraries: libaio, O_DIRECT) runs 4 KiB random reads
# and writes at QD1 and QD32 on each disk in turn, interleaved (for each
# rw and QD, every disk), REPS times. Around each point the guest sends a
# mark over the guest's forwarded port to a listener here, which reads
# the server processes' utime+stime from /proc/PID/stat: a server's CPU
# over that window divided by the I/Os fio completed is its CPU per I/O
# (both servers are idle outside their own disk's points, so the window's
# CPU is that disk's). The host runs the servers at full speed whatever
# the emulated guest does: the guest's IOPS are bounded by TCG, the CPU
# per I/O is the server's own cost.
#
# Prints `RESULT <leg> <rw> <qd> <iops> <ios> <cpu_us_per_io>` per point,
# then per (rw, qd, medium) the medians and `RATIO` lines: blkstack's IOPS
# over qsd's (goal >= 1.0) and its CPU per I/O over qsd's (goal <= 0.7).
# With the floor's legs, `FLOOR <medium> <rw> qd<N> floor_us <f> ours/floor
# <x> goal_us <0.7 x qsd> <verdict>`: met (ours <= 0.7x qsd's CPU per I/O),
# missed, or BELOW FLOOR (0.7x qsd's is below what the floor itself spends:
# no server can meet the goal on the machine it runs on).
#
# With SYSCALLS=1, the work each server does per I/O, which load on the
# host cannot change: around each point `perf stat` counts the leg's
# server's system calls (raw_syscalls:sys_enter) and context switches, all
# threads, and `SYSCALLS <leg> <rw> <qd> <syscalls_per_io> <cs_per_io>`
# medians follow the RATIO lines (perf's tracepoint costs the servers a
# little CPU: take CPU figures from a run without it). With STRACE=1 each
# point's `strace -c -f` summary of the leg's server (which syscalls) is
# printed instead, prefixed `STRACE <leg> <rw> <qd> <rep>` (strace stops
# the server at each call: its IOPS and CPU figures mean nothing then).
#
# Environment: BLKSTACK_BIN (default target/release/blkstack, built if
# missing), QSD_BIN (qemu-storage-daemon), BENCH_RUNTIME seconds per point
# (default 10), REPS (default 3), FILE_MB (default 256), KERNEL_VM_MEM,
# SYSCALLS, STRACE, BS_POLL_US (blkstack's `--vhost-poll-us`, default 0:
# no polling, as qsd's main loop), and to run fewer points LEGS (default "qsd-null
# bs-null qsd-file bs-file"), RWS (default "randread randwrite"), QDS
# (default "1 32"), FLOOR (the vhost-floor binary, default
# target/release/examples/vhost-floor, built if missing), FLOOR_WAIT (where
# the floor waits: ring, the default, or epoll). LEGS without fl-null and
# fl-file leaves the floor out.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
bin=${BLKSTACK_BIN:-$top/target/release/blkstack}
qsd=${QSD_BIN:-$(command -v qemu-storage-daemon || true)}
fio_bin=$(command -v fio || true)
rt=${BENCH_RUNTIME:-10}
reps=${REPS:-3}
file_mb=${FILE_MB:-256}
legs=${LEGS:-qsd-null bs-null fl-null qsd-file bs-file fl-file}
floor=${FLOOR:-$top/target/release/examples/vhost-floor}
floor_wait=${FLOOR_WAIT:-ring}
rws=${RWS:-randread randwrite}
qds=${QDS:-1 32}
syscalls=${SYSCALLS:-0}
strace_on=${STRACE:-0}
poll_us=${BS_POLL_US:-0}

die() { echo "bench-vhost-peers: $*" >&2; exit 2; }
[ -n "$fio_bin" ] || die "fio is not installed (make deps)"
[ -n "$qsd" ] && [ -x "$qsd" ] || die "qemu-storage-daemon is not installed (qemu-utils)"
command -v socat >/dev/null || die "socat is not installed (make deps)"
case $rt$reps$file_mb$poll_us in *[!0-9]*) die "BENCH_RUNTIME, REPS, FILE_MB, BS_POLL_US want whole numbers" ;; esac
for l in $legs; do
  case $l in qsd-null | bs-null | qsd-file | bs-file | fl-null | fl-file) ;; *) die "LEGS: unknown leg $l" ;; esac
done
case $floor_wait in ring | epoll) ;; *) die "FLOOR_WAIT: ring or epoll, not $floor_wait" ;; esac
with_floor=0
case " $legs " in *" fl-"*) with_floor=1 ;; esac
for r in $rws; do case $r in randread | randwrite) ;; *) die "RWS: unknown $r" ;; esac; done
for q in $qds; do case $q in *[!0-9]*) die "QDS want whole numbers" ;; esac; done
if [ "$syscalls" = 1 ]; then
  command -v perf >/dev/null || die "SYSCALLS=1 needs perf"
fi
if [ "$strace_on" = 1 ]; then
  command -v strace >/dev/null || die "STRACE=1 needs strace"
fi
if [ ! -x "$bin" ]; then
  (cd "$top" && cargo build --release -p blkstack >&2)
fi
if [ "$with_floor" = 1 ] && [ ! -x "$floor" ]; then
  (cd "$top" && cargo build --release -p blkstack-vhost-user-blk --example vhost-floor >&2)
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/bench-vhost-peers.XXXXXX")
pids=()
cleanup() {
  local p
  for p in "${pids[@]+"${pids[@]}"}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]+"${pids[@]}"}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# The same bytes in both files, on the same filesystem, written through
# (not sparse: a hole would read without touching the disk).
for f in qsd bs fl; do
  dd if=/dev/zero of="$work/$f.img" bs=1M count="$file_mb" conv=fsync status=none
done

"$qsd" \
  --blockdev "driver=null-co,node-name=qn,size=1073741824,read-zeroes=on" \
  --blockdev "driver=file,node-name=qf,filename=$work/qsd.img,cache.direct=on,aio=io_uring" \
  --export "type=vhost-user-blk,id=eqn,node-name=qn,addr.type=unix,addr.path=$work/qsd-null.sock,writable=on,num-queues=1" \
  --export "type=vhost-user-blk,id=eqf,node-name=qf,addr.type=unix,addr.path=$work/qsd-file.sock,writable=on,num-queues=1" \
  > "$work/qsd.out" 2>&1 &
qsd_pid=$!; pids+=("$qsd_pid")
sectors=$((file_mb * 2048))
poll_args=()
[ "$poll_us" = 0 ] || poll_args=(--vhost-poll-us "$poll_us")
"$bin" serve --concise "nul,,,rw,0 2097152 null;fil,,,rw,0 $sectors file $work/bs.img direct" \
  --vhost-user-blk "$work/bs-null.sock:nul" --vhost-user-blk "$work/bs-file.sock:fil" \
  ${poll_args[@]+"${poll_args[@]}"} --control "$work/control.sock" > "$work/serve.out" 2>&1 &
bs_pid=$!; pids+=("$bs_pid")
for _ in $(seq 600); do
  [ -S "$work/qsd-null.sock" ] && [ -S "$work/qsd-file.sock" ] && grep -q '^ready' "$work/serve.out" && break
  kill -0 "$qsd_pid" 2>/dev/null || { cat "$work/qsd.out" >&2; die "qemu-storage-daemon did not start"; }
  kill -0 "$bs_pid" 2>/dev/null || { cat "$work/serve.out" >&2; die "blkstack serve did not start"; }
  sleep 0.1
done
grep -q '^ready' "$work/serve.out" || die "blkstack serve is not ready after 60 s"
fn_pid=0; ff_pid=0; floor_disks=()
if [ "$with_floor" = 1 ]; then
  "$floor" --kind null --size 1073741824 --socket "$work/fl-null.sock" --wait "$floor_wait" > "$work/fl-null.out" 2>&1 &
  fn_pid=$!; pids+=("$fn_pid")
  "$floor" --kind file --path "$work/fl.img" --socket "$work/fl-file.sock" --wait "$floor_wait" > "$work/fl-file.out" 2>&1 &
  ff_pid=$!; pids+=("$ff_pid")
  for _ in $(seq 100); do
    [ -S "$work/fl-null.sock" ] && [ -S "$work/fl-file.sock" ] && break
    kill -0 "$fn_pid" 2>/dev/null && kill -0 "$ff_pid" 2>/dev/null || { cat "$work"/fl-*.out >&2; die "vhost-floor did not start"; }
    sleep 0.1
  done
  floor_disks=(--vhost-user-blk "$work/fl-null.sock" --vhost-user-blk "$work/fl-file.sock")
fi

# The mark listener: one line per connection, "begin|end LEG RW QD REP",
# recorded with the servers' CPU ticks (utime + stime, fields 14 and 15
# of /proc/PID/stat; the name in field 2 has no spaces here): qsd's,
# blkstack's, the null floor's and the file floor's (0 without the floor).
# With SYSCALLS or STRACE, a begin mark also starts perf stat (or
# strace) on the leg's server and the end mark stops it (SIGINT: both
# print their summary then) before the CPU ticks are read.
cat > "$work/mark.sh" <<EOF
#!/bin/sh
read -r line || exit 0
set -- \$line
key="\$2.\$3.\$4.\$5"
case \$2 in qsd-*) pid=$qsd_pid ;; fl-null) pid=$fn_pid ;; fl-file) pid=$ff_pid ;; *) pid=$bs_pid ;; esac
if [ "\$1" = end ] && [ -f "$work/trace.\$key.pid" ]; then
  t=\$(cat "$work/trace.\$key.pid")
  kill -INT "\$t" 2>/dev/null
  i=0; while kill -0 "\$t" 2>/dev/null && [ \$i -lt 100 ]; do sleep 0.05; i=\$((i + 1)); done
fi
q=\$(awk '{print \$14 + \$15}' /proc/$qsd_pid/stat)
b=\$(awk '{print \$14 + \$15}' /proc/$bs_pid/stat)
fn=0; ff=0
if [ $fn_pid != 0 ]; then
  fn=\$(awk '{print \$14 + \$15}' /proc/$fn_pid/stat)
  ff=\$(awk '{print \$14 + \$15}' /proc/$ff_pid/stat)
fi
echo "\$line \$q \$b \$fn \$ff" >> "$work/marks"
if [ "\$1" = begin ]; then
  if [ "$syscalls" = 1 ]; then
    setsid perf stat -x, -e raw_syscalls:sys_enter,context-switches -p "\$pid" \\
      -o "$work/trace.\$key" </dev/null >/dev/null 2>&1 &
    echo \$! > "$work/trace.\$key.pid"
  elif [ "$strace_on" = 1 ]; then
    setsid strace -c -f -p "\$pid" -o "$work/trace.\$key" </dev/null >/dev/null 2>&1 &
    echo \$! > "$work/trace.\$key.pid"
  fi
  # Attached before the guest starts its fio.
  if [ -f "$work/trace.\$key.pid" ]; then sleep 0.5; fi
fi
exit 0
EOF
chmod +x "$work/mark.sh"
: > "$work/marks"
socat -u TCP-LISTEN:0,bind=127.0.0.1,reuseaddr,fork SYSTEM:"$work/mark.sh" > "$work/socat.out" 2>&1 &
pids+=("$!")
port=""
for _ in $(seq 100); do
  port=$(ss -ltnpH 2>/dev/null | awk -v p="pid=${pids[-1]}," '$0 ~ p { n = split($4, a, ":"); print a[n]; exit }')
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || die "the mark listener did not start"

cat > "$work/guest.sh" <<EOS
set -e
mark() { echo "\$*" | nc 10.0.2.100 7000; }
fiorun() { fio --name=b --filename=\$1 --rw=\$2 --bs=4k --direct=1 --ioengine=libaio \
  --iodepth=\$3 --runtime=$rt --time_based --thread --output-format=terse --terse-version=3 \
  | awk -F';' -v rw=\$2 '{ if (rw == "randread") print \$8, int(\$6 / 4); else print \$49, int(\$47 / 4) }'; }
for rep in \$(seq $reps); do
  for rw in $rws; do
    for qd in $qds; do
      for ld in qsd-null:vda bs-null:vdb qsd-file:vdc bs-file:vdd fl-null:vde fl-file:vdf; do
        leg=\${ld%:*}; dev=/dev/\${ld#*:}
        case " $legs " in *" \$leg "*) ;; *) continue ;; esac
        mark begin \$leg \$rw \$qd \$rep
        r=\$(fiorun \$dev \$rw \$qd)
        mark end \$leg \$rw \$qd \$rep
        echo "POINT \$leg \$rw \$qd \$rep \$r"
      done
    done
  done
done
EOS

KERNEL_VM_MEM=${KERNEL_VM_MEM:-1024} "$top/scripts/kernel-vm.sh" run \
  --vhost-user-blk "$work/qsd-null.sock" --vhost-user-blk "$work/bs-null.sock" \
  --vhost-user-blk "$work/qsd-file.sock" --vhost-user-blk "$work/bs-file.sock" \
  ${floor_disks[@]+"${floor_disks[@]}"} \
  --fwd "7000=$port" --bin "$fio_bin" --timeout $((reps * 24 * (rt + 15) + 300)) \
  "$work/guest.sh" > "$work/guest.out" || { cat "$work/guest.out" >&2; die "the guest failed"; }

# The last point's end mark may still be stopping its perf: wait (a
# bounded time) until every point has its end mark.
npoints=$(grep -c '^POINT' "$work/guest.out" || true)
for _ in $(seq 100); do
  [ "$(grep -c '^end' "$work/marks" || true)" -ge "$npoints" ] && break
  sleep 0.1
done
tck=$(getconf CLK_TCK)
# Join the guest's points with the host's marks: CPU µs per I/O of the
# leg's own server over its window (its ticks' field in the marks).
awk -v tck="$tck" '
  function field(leg) { return leg ~ /^qsd/ ? 6 : leg == "fl-null" ? 8 : leg == "fl-file" ? 9 : 7 }
  FNR == NR { key = $2" "$3" "$4" "$5; f = field($2); if ($1 == "begin") t0[key] = $f; else t1[key] = $f; next }
  $1 == "POINT" {
    key = $2" "$3" "$4" "$5; iops = $6; ios = $7
    us = (ios > 0 && (key in t0) && (key in t1)) ? (t1[key] - t0[key]) * 1e6 / tck / ios : -1
    printf "RESULT %s %s %s %.0f %d %.2f\n", $2, $3, $4, iops, ios, us
  }' "$work/marks" "$work/guest.out" | tee "$work/results"

# Medians over the repetitions, then blkstack against qsd per medium.
awk '
  function median(s,   a, n, i, j, t) {
    n = split(s, a, " ")
    for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] + 0 > a[j] + 0; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  { k = $2" "$3" "$4; iops[k] = iops[k]" "$5; cpu[k] = cpu[k]" "$7; seen[$3" "$4] = 1 }
  END {
    for (p in seen) for (m = 1; m <= 2; m++) {
      med = m == 1 ? "null" : "file"
      split(p, pq, " "); q = "qsd-"med" "p; b = "bs-"med" "p
      if (!(q in iops) || !(b in iops)) continue
      qi = median(iops[q]); bi = median(iops[b]); qc = median(cpu[q]); bc = median(cpu[b])
      printf "MEDIAN %s %s qd%s: qsd %.0f IOPS %.2f us/IO, blkstack %.0f IOPS %.2f us/IO\n", med, pq[1], pq[2], qi, qc, bi, bc
      printf "RATIO %s %s qd%s iops %.2f cpu_per_io %.2f\n", med, pq[1], pq[2], (qi > 0 ? bi / qi : 0), (qc > 0 ? bc / qc : 0)
      f = "fl-"med" "p
      if (!(f in iops)) continue
      # The goal against the floor: met, missed, or below what the floor
      # itself spends (then no server meets it here).
      fc = median(cpu[f]); goal = 0.7 * qc
      verdict = bc <= goal ? "met" : fc > goal ? "BELOW FLOOR" : "missed"
      printf "FLOOR %s %s qd%s floor_iops %.0f floor_us %.2f ours/floor %.2f goal_us %.2f %s\n", med, pq[1], pq[2], median(iops[f]), fc, (fc > 0 ? bc / fc : 0), goal, verdict
    }
  }' "$work/results" | sort

# The system calls and context switches of each point's server per I/O
# (perf stat -x, lines: value,unit,event,...), medians per leg and point.
if [ "$syscalls" = 1 ]; then
  while read -r _ leg rw qd rep _ ios; do
    f="$work/trace.$leg.$rw.$qd.$rep"
    [ -s "$f" ] && [ "$ios" -gt 0 ] || continue
    awk -F, -v leg="$leg" -v rw="$rw" -v qd="$qd" -v ios="$ios" '
      $3 ~ /raw_syscalls:sys_enter/ { s = $1 } $3 ~ /context-switches/ { c = $1 }
      END { printf "SCPOINT %s %s %s %.2f %.2f\n", leg, rw, qd, s / ios, c / ios }' "$f"
  done < <(grep '^POINT' "$work/guest.out") | awk '
    function median(s,   a, n, i, j, t) {
      n = split(s, a, " ")
      for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] + 0 > a[j] + 0; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
      return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    { k = $2" "$3" "$4; s[k] = s[k]" "$5; c[k] = c[k]" "$6 }
    END { for (k in s) printf "SYSCALLS %s %.2f %.2f\n", k, median(s[k]), median(c[k]) }' | sort
fi
# Which system calls: each point's strace summary, its table rows.
if [ "$strace_on" = 1 ]; then
  while read -r _ leg rw qd rep _ ios; do
    f="$work/trace.$leg.$rw.$qd.$rep"
    [ -s "$f" ] || continue
    echo "STRACE $leg $rw $qd $rep ios=$ios"
    sed -n '/^------/,$p' "$f" | grep -v '^------' | sed "s/^/STRACE $leg $rw $qd $rep /"
  done < <(grep '^POINT' "$work/guest.out")
fi
