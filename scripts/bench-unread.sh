#!/bin/sh
# The per-connection budget benchmark (docs/BENCHMARKS.md): fio's
# throughput on one connection of `blkstack serve`, alone and while
# another client sends 1 GiB of 64 KiB READ requests and reads no reply
# (scripts/unread-reads.py), and the server's resident memory meanwhile.
#   scripts/bench-unread.sh [ROUNDS] [BLKSTACK]
set -eu
ROUNDS=${1:-3}
BIN=${2:-target/release/blkstack}
D=$(mktemp -d)
trap 'kill $SRV 2>/dev/null; rm -rf "$D"' EXIT
"$BIN" serve --concise "big,,,rw,0 2097152 null" --export big \
  --listen "nbd+unix:///?socket=$D/s" --control "$D/c" >"$D/out" 2>"$D/err" &
SRV=$!
while ! grep -q ready "$D/out"; do sleep 0.1; done
rss() { awk '/VmRSS/ {print $2}' /proc/$SRV/status; }
fio_iops() {
  fio --name=o --ioengine=nbd --uri="nbd+unix:///big?socket=$D/s" --rw=randread \
    --bs=4k --iodepth=16 --runtime=8 --time_based --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; t=sys.stdin.read(); print(int(json.loads(t[t.index("{"):])["jobs"][0]["read"]["iops"]))'
}
for r in $(seq "$ROUNDS"); do
  alone=$(fio_iops)
  base=$(rss)
  python3 scripts/unread-reads.py "$D/s" big $((1 << 30)) 65536 12 >"$D/h" &
  H=$!
  sleep 1
  peak=$base
  ( while kill -0 $H 2>/dev/null; do rss >>"$D/rss"; sleep 0.2; done ) &
  M=$!
  during=$(fio_iops)
  wait $H
  kill $M 2>/dev/null || true
  peak=$(sort -n "$D/rss" | tail -1); : >"$D/rss"
  echo "round $r: alone=$alone during=$during ratio=$(python3 -c "print(round($during/$alone,3))") rss_base_kib=$base rss_peak_kib=$peak grown_kib=$((peak - base)) $(cat "$D/h")"
done
