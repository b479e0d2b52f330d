#!/usr/bin/env bash
# Several NBD hosts on one machine, for multipath over real TCP paths.
#
# `up` makes network namespaces joined by veth pairs on a bridge (the
# bridge itself lives in a "switch" namespace, every address on
# 10.77.0.0/24 stays inside the namespaces), a "client" namespace to run
# blkstack in, and HOSTS hosts (default 4) that all export the same
# backing file, a shared LUN as a SAN gives multipath:
#   h0  blkstack serve: a delay target (0.1 ms) over a file target
#   h1  blkstack serve: a delay target (0.2 ms) over a file target
#   h2  qemu-nbd -f raw --shared=8 -t
#   h3  nbdkit --filter=delay file (1 ms)
#   h4+ blkstack serve again, with growing delays
# It then prints a multipath table over `nbd` leaves, one per host, that
# can be pasted into a stack file. There is no netem qdisc in every
# kernel, so the paths' service times come from the servers (delay
# targets, nbdkit's delay filter).
#
#   scripts/multihost.sh up [HOSTS]   build it (tears down a previous one first)
#   scripts/multihost.sh table        print the stack file again
#   scripts/multihost.sh kill HOST    kill -9 a host's server
#   scripts/multihost.sh start HOST   (re)start a host's server
#   scripts/multihost.sh link HOST up|down   restore or cut a host's link
#   scripts/multihost.sh demo         up, the multipath served from the client,
#                                     a verify run through it with a server
#                                     killed and a link cut, the checker's
#                                     counts, down
#   scripts/multihost.sh down         remove everything (idempotent)
#
# Needs root and iproute2 (and qemu-nbd, nbdkit for h2, h3). Environment:
# MULTIHOST_NAME (namespace prefix, default bkmh), MULTIHOST_DIR (state,
# default /tmp/blkstack-multihost), BLKSTACK (the binary; default
# target/release/blkstack, built if missing), SIZE_MB (LUN size, 256).
set -euo pipefail

NAME=${MULTIHOST_NAME:-bkmh}
DIR=${MULTIHOST_DIR:-/tmp/blkstack-multihost}
SIZE_MB=${SIZE_MB:-256}
SECTORS=$((SIZE_MB * 2048))
PORT=10809
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BLKSTACK=${BLKSTACK:-$ROOT/target/release/blkstack}

die() { echo "multihost: $*" >&2; exit 1; }
addr() { echo "10.77.0.$((11 + $1))"; }
ns() { echo "$NAME-$1"; }
in_ns() { local n=$1; shift; ip netns exec "$(ns "$n")" "$@"; }

need_root() {
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
  command -v ip >/dev/null || die "needs iproute2 (ip)"
}

hosts() { cat "$DIR/hosts" 2>/dev/null || echo 0; }

# The kind of server host $1 runs, and its path's delay in ms.
kind() {
  case $1 in
    2) echo qemu-nbd ;;
    3) echo nbdkit ;;
    *) echo blkstack ;;
  esac
}
delay_ms() {
  case $1 in
    0) echo 0.1 ;; 1) echo 0.2 ;; 2) echo 0 ;; 3) echo 1 ;;
    *) echo "0.$(( $1 * 2 ))" ;;
  esac
}

attach() { # attach MEMBER ADDR: a veth from the switch's bridge into MEMBER
  local m=$1 a=$2
  ip netns add "$(ns "$m")"
  ip -n "$(ns sw)" link add "$m" type veth peer name eth0 netns "$(ns "$m")"
  ip -n "$(ns sw)" link set "$m" master br0 up
  ip -n "$(ns "$m")" addr add "$a/24" dev eth0
  ip -n "$(ns "$m")" link set eth0 up
  ip -n "$(ns "$m")" link set lo up
}

start() { # start HOST: the host's NBD server, in the background
  local h=$1 a log n
  a=$(addr "$h")
  n=$(ns "h$h")
  log="$DIR/h$h.log"
  case $(kind "$h") in
    blkstack)
      printf 'f: 0 %s file %s\nlun: 0 %s delay f 0 %s\n' \
        "$SECTORS" "$DIR/lun.img" "$SECTORS" "$(delay_ms "$h")" >"$DIR/h$h.stack"
      ip netns exec "$n" "$BLKSTACK" serve --stack "$DIR/h$h.stack" --export lun \
        --listen "nbd://$a:$PORT" --control "$DIR/h$h.control" >"$log" 2>&1 &
      ;;
    qemu-nbd)
      ip netns exec "$n" qemu-nbd -f raw --shared=8 -t -b "$a" -p "$PORT" -x lun \
        "$DIR/lun.img" >"$log" 2>&1 &
      ;;
    nbdkit)
      # nbdkit in the foreground (-f) quits once the shell that started
      # it exits, so it daemonizes itself and writes its own pid file;
      # it returns once it listens.
      ip netns exec "$n" nbdkit -P "$DIR/h$h.pid" -i "$a" -p "$PORT" -e lun \
        --filter=delay file "$DIR/lun.img" rdelay=1ms wdelay=1ms >"$log" 2>&1 ||
        die "host h$h's nbdkit did not start (see $log)"
      ;;
  esac
  if [ "$(kind "$h")" != nbdkit ]; then
    # `ip netns exec` execs the server: $! is the server's pid. Disowned,
    # so that killing it later does not make the shell report the job.
    echo $! >"$DIR/h$h.pid"
    disown $!
  fi
  for _ in $(seq 100); do
    if in_ns client bash -c "exec 3<>/dev/tcp/$a/$PORT" 2>/dev/null; then
      return 0
    fi
    sleep 0.1
  done
  die "host h$h's $(kind "$h") did not listen on $a:$PORT (see $log)"
}

kill_host() {
  local pidfile="$DIR/h$1.pid"
  if [ -f "$pidfile" ]; then
    kill -9 "$(cat "$pidfile")" 2>/dev/null || true
    rm -f "$pidfile"
  fi
}

table() {
  local n i paths=""
  n=$(hosts)
  [ "$n" -gt 0 ] || die "not up (run: $0 up)"
  echo "# a stack file for blkstack in namespace $(ns client):"
  echo "#   ip netns exec $(ns client) $BLKSTACK bench --stack $DIR/client.stack --filename mp ..."
  for i in $(seq 0 $((n - 1))); do
    echo "p$i: 0 $SECTORS nbd nbd://$(addr "$i"):$PORT/lun timeout_ms=2000 dead_timeout_ms=1000"
    paths="$paths p$i"
  done
  echo "mp: 0 $SECTORS multipath 3 queue_if_no_path checker_interval 500 0 1 1 service-time 0 $n 0$paths"
}

up() {
  local n=${1:-4} i
  [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 100 ] || die "HOSTS must be 1..100, not '$n'"
  need_root
  down
  [ -x "$BLKSTACK" ] || (cd "$ROOT" && cargo build --release -q)
  mkdir -p "$DIR"
  truncate -s "${SIZE_MB}M" "$DIR/lun.img"
  ip netns add "$(ns sw)"
  ip -n "$(ns sw)" link add br0 type bridge
  ip -n "$(ns sw)" link set br0 up
  attach client 10.77.0.2
  echo "$n" >"$DIR/hosts"
  for i in $(seq 0 $((n - 1))); do
    attach "h$i" "$(addr "$i")"
    start "$i"
    echo "h$i: $(kind "$i") on nbd://$(addr "$i"):$PORT/lun (delay $(delay_ms "$i") ms)"
  done
  table | tee "$DIR/client.stack"
}

down() {
  local n i
  n=$(hosts)
  for i in $(seq 0 $((n - 1))); do kill_host "$i"; done
  [ -f "$DIR/client.pid" ] && kill -9 "$(cat "$DIR/client.pid")" 2>/dev/null || true
  for n in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$NAME-" || true); do
    for p in $(ip netns pids "$n" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$n" 2>/dev/null || true
  done
  rm -rf "$DIR"
}

# The multipath in the client namespace, exported on a unix socket (which
# any namespace can reach) with a control socket for status and messages.
serve_client() {
  ip netns exec "$(ns client)" "$BLKSTACK" serve --stack "$DIR/client.stack" \
    --export mp --listen "nbd+unix:///?socket=$DIR/mp.sock" \
    --control "$DIR/client.control" >"$DIR/client.log" 2>&1 &
  echo $! >"$DIR/client.pid"
  disown $!
  for _ in $(seq 100); do
    [ -S "$DIR/client.control" ] && [ -S "$DIR/mp.sock" ] && return 0
    sleep 0.1
  done
  die "the client's blkstack serve did not start (see $DIR/client.log)"
}

ctl() { "$BLKSTACK" "$1" --control "$DIR/client.control" "${@:2}"; }

demo() {
  up 4
  serve_client
  printf 'v: 0 %s nbd nbd+unix:///mp?socket=%s\n' "$SECTORS" "$DIR/mp.sock" >"$DIR/demo.stack"
  echo "== randwrite+verify QD32 through the client's multipath; h0's server is"
  echo "   killed and restarted, h1's link is cut and restored during the run"
  "$BLKSTACK" bench --stack "$DIR/demo.stack" --name=failover --filename=v \
    --rw=randwrite --bs=4k --iodepth=32 --runtime=12s --time_based \
    --verify=crc32c --verify_backlog=256 --do_verify=1 &
  local bench=$! rc=0
  sleep 2; echo "-- kill -9 h0"; kill_host 0
  sleep 2; echo "-- restart h0"; start 0
  sleep 1; echo "-- cut h1's link"; ip -n "$(ns sw)" link set h1 down
  sleep 3; echo "-- paths now:"; ctl status mp
  echo "-- restore h1's link"; ip -n "$(ns sw)" link set h1 up
  wait "$bench" || rc=$?
  echo "== after the run: paths (A: active, F: failed) and the checker's counts"
  ctl status mp
  ctl message mp 0 checker
  down
  return "$rc"
}

case ${1:-} in
  up) shift; up "$@" ;;
  down) need_root; down ;;
  table) table ;;
  kill) need_root; kill_host "${2:?HOST number}" ;;
  start) need_root; start "${2:?HOST number}" ;;
  link)
    need_root
    [[ ${3:-} =~ ^(up|down)$ ]] || die "link HOST up|down"
    ip -n "$(ns sw)" link set "h${2:?HOST number}" "$3"
    ;;
  demo) need_root; demo ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
esac
