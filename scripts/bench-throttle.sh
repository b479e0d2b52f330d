#!/usr/bin/env bash
# bench-throttle.sh: how close the `throttle` target holds its caps, with
# the real fio (its nbd engine) against `blkstack serve`: a throttle over
# a null device (zero_reads=0, so a read costs no copy), one cap at a
# time changed with `blkstack message ... set`, fio's random reads for
# each, and a table of cap, achieved and their ratio. The unthrottled
# ceiling of this host is measured first and printed: a cap above it
# cannot be met here, whatever the throttle does.
#
#   scripts/bench-throttle.sh                 the sweep: 100, 1k, 10k, 50k
#                                             IOPS; 1, 10, 100, 1024 MiB/s
#   scripts/bench-throttle.sh iops:2000 bps:64M   chosen points only
#
# Environment: BLKSTACK_BIN (default target/release/blkstack, built if
# missing), BENCH_RUNTIME seconds per point (default 5; fio's first
# second is a ramp, not counted, so the bucket's tenth-of-a-second slack
# is not either), BENCH_QD (default: one request in flight per 100 a
# second of the point's request rate, 1 to 32; enough to keep the cap
# busy, and few, because fio counts the time to drain what is in flight
# at the end, which at a low cap is that many requests' worth).
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
bin=${BLKSTACK_BIN:-$top/target/release/blkstack}
rt=${BENCH_RUNTIME:-5}
command -v fio >/dev/null || { echo "bench-throttle: fio is not installed (make deps)" >&2; exit 2; }
if [ ! -x "$bin" ]; then
  (cd "$top" && cargo build --release -p blkstack >&2)
fi

points=("$@")
if [ ${#points[@]} -eq 0 ]; then
  points=(iops:100 iops:1000 iops:10000 iops:50000 bps:1M bps:10M bps:100M bps:1G)
fi

dir=$(mktemp -d /tmp/bench-throttle.XXXXXX)
ctl=$dir/control.sock
sock=$dir/nbd.sock
"$bin" serve --concise "n,,,rw,0 2097152 null zero_reads=0;t,,,rw,0 2097152 throttle n 0" \
  --export t --listen "nbd+unix:///?socket=$sock" --control "$ctl" > "$dir/serve.out" 2>&1 &
spid=$!
cleanup() { kill "$spid" 2>/dev/null || true; wait "$spid" 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
i=0
until grep -q '^ready' "$dir/serve.out" 2>/dev/null; do
  kill -0 "$spid" 2>/dev/null || { cat "$dir/serve.out" >&2; exit 1; }
  [ $i -lt 600 ] || { echo "bench-throttle: serve not ready" >&2; exit 1; }
  sleep 0.1; i=$((i+1))
done

msg() { "$bin" message --control "$ctl" t 0 set "$@" >/dev/null; }

# qd_for RATE: the queue depth for RATE requests a second.
qd_for() {
  local q=$(( $1 / 100 ))
  [ $q -ge 1 ] || q=1
  [ $q -le 32 ] || q=32
  echo "${BENCH_QD:-$q}"
}

# fiorun BS QD: random reads for $rt s after a 1 s ramp; prints "IOPS
# KiB/s" (terse v3 fields 8 and 7).
fiorun() {
  fio --name=b --ioengine=nbd --uri="nbd+unix:///t?socket=$sock" --rw=randread \
    --bs="$1" --iodepth="$2" --size=1g --ramp_time=1 --runtime="$rt" --time_based \
    --output-format=terse --terse-version=3 | awk -F';' '/^3;/ {print $8, $7}'
}

# bytes SIZE: a K/M/G suffixed size in bytes.
bytes() {
  local n=${1%[KMG]}
  case $1 in
    *K) echo $((n << 10)) ;; *M) echo $((n << 20)) ;; *G) echo $((n << 30)) ;; *) echo "$1" ;;
  esac
}

# The request size for a bandwidth cap: a few hundred to a thousand
# requests a second, so that the cap, not the request rate, is measured.
bs_for() {
  local b; b=$(bytes "$1")
  if [ "$b" -le $((4 << 20)) ]; then echo 4k
  elif [ "$b" -le $((64 << 20)) ]; then echo 64k
  elif [ "$b" -le $((256 << 20)) ]; then echo 128k
  else echo 1m; fi
}

# The ceiling at the queue depths the top points use: 32 for 4 KiB, 10
# for 1 MiB (deeper is slower there: 32 MiB in flight on one socket).
read -r ceil_iops _ < <(fiorun 4k 32)
read -r _ ceil_kib < <(fiorun 1m 10)
printf 'unthrottled ceiling here: %s IOPS (4k, QD 32), %s MiB/s (1m, QD 10)\n' \
  "$ceil_iops" "$(awk -v k="$ceil_kib" 'BEGIN{printf "%.0f", k/1024}')"
printf '%-10s %-6s %4s %14s %14s %8s\n' kind bs qd cap achieved ratio
for p in "${points[@]}"; do
  kind=${p%%:*}; cap=${p#*:}
  msg riops 0; msg rbps 0
  case $kind in
    iops)
      msg riops "$cap"
      q=$(qd_for "$cap")
      read -r got _ < <(fiorun 4k "$q")
      printf '%-10s %-6s %4s %14s %14s %8s\n' IOPS 4k "$q" "$cap" "$got" \
        "$(awk -v g="$got" -v c="$cap" 'BEGIN{printf "%.3f", g/c}')" ;;
    bps)
      bs=$(bs_for "$cap")
      msg rbps "$cap"
      capb=$(bytes "$cap")
      q=$(qd_for $((capb / $(bytes "${bs^^}"))))
      read -r _ kib < <(fiorun "$bs" "$q")
      printf '%-10s %-6s %4s %14s %14s %8s\n' "MiB/s" "$bs" "$q" \
        "$(awk -v c="$capb" 'BEGIN{printf "%.1f", c/1048576}')" \
        "$(awk -v k="$kib" 'BEGIN{printf "%.1f", k/1024}')" \
        "$(awk -v k="$kib" -v c="$capb" 'BEGIN{printf "%.3f", k*1024/c}')" ;;
    *) echo "bench-throttle: unknown point '$p' (iops:N or bps:SIZE)" >&2; exit 2 ;;
  esac
done
