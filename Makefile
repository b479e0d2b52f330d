# The two commands a newcomer needs are in README.md; this file holds the
# test recipe that `.ci/run` also uses.

SYSTEM_TOOLS := fio nbdkit nbdinfo nbdcopy qemu-img qemu-io qemu-nbd chromium ip openssl

.PHONY: test deps check lab loom fuzz

# Install the real peers the interop tests start (and the headless browser
# that renders the lab's report page, and iproute2 for the multi-host
# tests' network namespaces), if any is missing.
deps:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system tools (missing:$$missing)"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq fio nbdkit libnbd-bin qemu-utils chromium iproute2 openssl >/dev/null; \
	fi

# Every test: unit, integration, loom models, interop with the real clients.
test: deps
	cargo test --workspace
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p blkstack-mq --release --test loom_sbitmap -- counter_two_threads_depth1
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p blkstack-mq --release --test loom_runstate

# Every loom model: the tag allocator's (about 12 minutes on 2 vCPUs) and
# the queue-run state's (seconds).
loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p blkstack-mq --release --test loom_sbitmap
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p blkstack-mq --release --test loom_runstate

check:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

lab:
	cargo run --release -- lab all --quick

# Each cargo-fuzz target (fuzz/fuzz_targets/) for FUZZ_SECS seconds, one
# after another, on nightly. New inputs go to fuzz/work/TARGET (ignored by
# git), seeded from the checked-in fuzz/corpus/TARGET; a crash stops the
# run and leaves its input in fuzz/artifacts/TARGET: copy it to
# fuzz/regressions/TARGET so `cargo test` replays it from then on.
FUZZ_SECS ?= 60
FUZZ_TARGETS := nbd_server nbd_replies table concise fio_jobfile control_json
fuzz:
	@command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz
	cd fuzz && cargo +nightly fuzz build -O
	cd fuzz && for t in $(FUZZ_TARGETS); do \
	  mkdir -p work/$$t && \
	  echo "== $$t: $(FUZZ_SECS) s" && \
	  cargo +nightly fuzz run -O $$t work/$$t corpus/$$t -- \
	    -max_total_time=$(FUZZ_SECS) -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 || exit 1; \
	done
