#!/usr/bin/env bash
# test.sh: every test of the workspace, as `make test` runs it (after
# `make deps`) and CI runs it through `.ci/run`.
#
# The test binaries are built once (`cargo test --no-run`), then run in two
# lanes at the same time:
#   vm    the kernel VM tests (kernel_*.rs): TCG guests that spend most of
#         their time waiting on one emulated vCPU, longest first;
#   rest  every other test binary, then the doc tests, then the loom
#         models (their own `--cfg loom` build under target/loom), then
#         the kernel VM tests the vm lane has not reached, shortest
#         first (two guests at once from there on).
# Each binary runs as `cargo test` would run it (from its package's
# directory), bounded by TEST_BINARY_TIMEOUT seconds, its output kept in
# target/test-logs/NAME.log and printed whole at the end when it failed
# (so the two lanes' outputs never interleave). The run ends
# with one line, `N passed, N failed`, counting tests (a binary with its
# own `main`, `harness = false`, counts as one), and exits non-zero when
# anything failed.
#
# Environment: TEST_LANES=1 runs the two lanes one after the other (for a
# machine too small for a guest beside the rest); TEST_FILTER=REGEX runs
# only the binaries whose name matches; TEST_BINARY_TIMEOUT (default 900).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
logs=target/test-logs
rm -rf "$logs" && mkdir -p "$logs"
limit=${TEST_BINARY_TIMEOUT:-900}
filter=${TEST_FILTER:-.}

echo "== building the test binaries"
t0=$(date +%s)
cargo test --workspace --no-run --message-format=json-render-diagnostics >"$logs/build.json"
echo "   built in $(($(date +%s) - t0)) s"

# One line per test binary: NAME EXECUTABLE PACKAGE_DIR. The JSON holds no
# quotes inside paths, so sed reads it without jq or python.
sed -n 's/.*"manifest_path":"\([^"]*\)\/Cargo.toml".*"profile":{[^}]*"test":true}.*"executable":"\([^"]*\)".*/\2 \1/p' \
  "$logs/build.json" | sort -u | while read -r exe dir; do
  name=$(basename "$exe" | sed 's/-[0-9a-f]*$//')
  # Two packages may have test files of one name (no_alloc.rs).
  grep -q "^$name " "$logs/binaries" 2>/dev/null && name="$name.$(basename "$dir")"
  echo "$name $exe $dir" >>"$logs/binaries"
done
[ -s "$logs/binaries" ] || { echo "no test binaries found in the build's output" >&2; exit 1; }

# run_binary NAME EXE DIR: run one binary, record "NAME passed failed secs".
run_binary() {
  local name=$1 exe=$2 dir=$3 log="$logs/$1.log" t s=0 passed failed
  t=$(date +%s)
  (cd "$dir" && timeout -k 10 "$limit" "$exe") >"$log" 2>&1 || s=$?
  t=$(($(date +%s) - t))
  passed=$(sed -n 's/^test result: .* \([0-9]*\) passed; \([0-9]*\) failed.*/\1/p' "$log" | awk '{n+=$1} END {print n+0}')
  failed=$(sed -n 's/^test result: .* \([0-9]*\) passed; \([0-9]*\) failed.*/\2/p' "$log" | awk '{n+=$1} END {print n+0}')
  if ! grep -q '^test result: ' "$log"; then
    # harness = false, or a binary that died before its summary.
    if [ "$s" = 0 ]; then passed=1; else failed=1; fi
  elif [ "$s" != 0 ] && [ "$failed" = 0 ]; then
    failed=1
  fi
  [ "$s" = 124 ] && echo "   $name: timed out after $limit s" >>"$log"
  echo "$name $passed $failed $t" >>"$logs/results"
  if [ "$s" = 0 ]; then
    echo "ok    $name: $passed passed ($t s)"
  else
    echo "FAIL  $name: $passed passed, $failed failed, exit $s ($t s)"
  fi
}

# The kernel VM tests in the order the vm lane takes them, longest first
# (so its tail is short); the rest lane, once its own work is done, takes
# them from the other end. A test is claimed with an atomic mkdir, so
# each runs once whichever lane reaches it first.
vm_queue() {
  local order="kernel_crashtest kernel_parity kernel_nbd kernel_thin kernel_fs kernel_ublk
    kernel_snapshot kernel_vhost_user_blk kernel_mpath kernel_era kernel_powercut kernel_crypt
    kernel_cache kernel_log_writes kernel_verity"
  local n
  for n in $order $(awk '$1 ~ /^kernel_/ {print $1}' "$logs/binaries"); do
    grep -q "^$n " "$logs/binaries" || continue
    [[ $n =~ $filter ]] || continue
    grep -qx "$n" "$logs/vm-queue" 2>/dev/null || echo "$n" >>"$logs/vm-queue"
  done
  touch "$logs/vm-queue"
}

# run_vm_tests ORDER: run every unclaimed kernel VM test, ORDER `first`
# (longest first) or `last` (shortest first).
run_vm_tests() {
  local n list
  if [ "$1" = first ]; then list=$(cat "$logs/vm-queue"); else list=$(tac "$logs/vm-queue"); fi
  for n in $list; do
    mkdir "$logs/claims/$n" 2>/dev/null || continue
    run_binary $(grep "^$n " "$logs/binaries")
  done
}

lane_vm() {
  run_vm_tests first
}

lane_rest() {
  local name exe dir
  while read -r name exe dir; do
    [[ $name == kernel_* ]] && continue
    [[ $name =~ $filter ]] || continue
    run_binary "$name" "$exe" "$dir"
  done <"$logs/binaries"
  if [ "$filter" = . ]; then
    local t s=0
    t=$(date +%s)
    cargo test --workspace --doc >"$logs/doctests.log" 2>&1 || s=$?
    record_cargo doctests "$s" "$t"
    t=$(date +%s); s=0
    # Both models built in one go, then each run (the first filtered to
    # its smallest model; `make loom` runs them all).
    ( export RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom
      cargo test -p blkstack-mq --profile loom --test loom_sbitmap --test loom_runstate --no-run &&
      cargo test -p blkstack-mq --profile loom --test loom_sbitmap -- counter_two_threads_depth1 &&
      cargo test -p blkstack-mq --profile loom --test loom_runstate ) >"$logs/loom.log" 2>&1 || s=$?
    record_cargo loom "$s" "$t"
  fi
  # The guests left: two at once from here on, the rest lane's CPU being
  # free.
  run_vm_tests last
}

# record_cargo NAME STATUS START: the result of a whole `cargo test` run.
record_cargo() {
  local name=$1 s=$2 t=$(($(date +%s) - $3)) log="$logs/$1.log" passed failed
  passed=$(sed -n 's/^test result: .* \([0-9]*\) passed; .*/\1/p' "$log" | awk '{n+=$1} END {print n+0}')
  failed=$(sed -n 's/^test result: .* \([0-9]*\) failed;.*/\1/p' "$log" | awk '{n+=$1} END {print n+0}')
  [ "$s" != 0 ] && [ "$failed" = 0 ] && failed=1
  echo "$name $passed $failed $t" >>"$logs/results"
  if [ "$s" = 0 ]; then
    echo "ok    $name: $passed passed ($t s)"
  else
    echo "FAIL  $name: exit $s ($t s)"
  fi
}

t0=$(date +%s)
mkdir -p "$logs/claims"
vm_queue
if [ "${TEST_LANES:-2}" = 1 ]; then
  lane_vm
  lane_rest
else
  lane_vm &
  vm=$!
  lane_rest
  wait "$vm"
fi
for name in $(awk '$3 > 0 {print $1}' "$logs/results"); do
  echo "== output of failed $name"
  cat "$logs/$name.log"
done
passed=$(awk '{n+=$2} END {print n+0}' "$logs/results")
failed=$(awk '{n+=$3} END {print n+0}' "$logs/results")
echo "== tests ran in $(($(date +%s) - t0)) s; slowest binaries:"
sort -k4 -n -r "$logs/results" | head -n 8 | awk '{printf "   %-28s %4d s\n", $1, $4}'
awk '$3 > 0 {print "   failed: " $1}' "$logs/results"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
