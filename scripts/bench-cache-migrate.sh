#!/bin/sh
# The cache migration benchmark (issue 39): how long an idle cache takes
# to write 256 dirty blocks back to an origin whose writes take 10 ms
# (a `delay` over memory), with `migration_threshold` one block (the
# migrations one at a time) and then the default 2048 sectors (32 at
# once, the kernel's default bound). Prints both drain times and their
# ratio. Run on a quiet machine:
#   scripts/bench-cache-migrate.sh
set -eu
cargo test --release -p blkstack-mapped --test cache_migrate -- \
  --ignored --exact cache_writeback_drain_bench --nocapture 2>&1 |
  grep -E 'migration_threshold|faster|test result|panicked'
