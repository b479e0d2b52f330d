# The two commands a newcomer needs are in README.md; this file holds the
# test recipe that `.ci/run` also uses.

SYSTEM_TOOLS := fio nbdkit nbdinfo nbdcopy qemu-img qemu-io qemu-nbd chromium ip openssl thin_check thin_dump veritysetup cryptsetup

.PHONY: test deps check lab loom fuzz thin-crash era-crash cache-crash crashtest vhost-floor-vm

# Install the real peers the interop tests start (and the headless browser
# that renders the lab's report page, and iproute2 for the multi-host
# tests' network namespaces, and thin_check/thin_dump that judge the
# thin-pool's metadata), if any is missing; then the kernel VM's parts
# (scripts/kernel-vm.sh): qemu-system-x86 and what the guest's initramfs
# carries (sqlite3 for the powercut tests' guests). On Debian 12 the
# machine's qemu-utils comes from bookworm-backports, and Debian 12's own
# qemu-system-x86 breaks it, so qemu-system-x86 comes from the same
# backports suite.
VM_TOOLS := qemu-system-x86_64 busybox dmsetup mkfs.ext4 mkfs.xfs nbd-client depmod cpio xz socat sqlite3
VM_PACKAGES := busybox-static dmsetup e2fsprogs xfsprogs nbd-client kmod cpio xz-utils socat sqlite3
deps:
	@SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; export DEBIAN_FRONTEND=noninteractive; \
	missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system tools (missing:$$missing)"; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq fio nbdkit libnbd-bin qemu-utils chromium iproute2 openssl thin-provisioning-tools cryptsetup-bin >/dev/null; \
	fi; \
	missing=""; for t in $(VM_TOOLS); do command -v $$t >/dev/null 2>&1 || [ -x /usr/sbin/$$t ] || [ -x /sbin/$$t ] || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing the kernel VM's tools (missing:$$missing)"; \
	  qemu_suite=""; \
	  if dpkg-query -W -f '$${Version}' qemu-utils 2>/dev/null | grep -q bpo12; then \
	    echo "deb http://deb.debian.org/debian bookworm-backports main" | $$SUDO tee /etc/apt/sources.list.d/blkstack-bookworm-backports.list >/dev/null; \
	    qemu_suite="-t bookworm-backports"; \
	  fi; \
	  $$SUDO apt-get update -qq && \
	  $$SUDO apt-get install -y -qq --no-install-recommends $$qemu_suite qemu-system-x86 >/dev/null && \
	  $$SUDO apt-get install -y -qq --no-install-recommends $(VM_PACKAGES) >/dev/null || \
	  echo "warning: the kernel VM's tools could not be installed: the kernel VM tests will be skipped"; \
	fi; \
	if ! command -v cc >/dev/null 2>&1 || [ ! -e /usr/include/linux/fs.h ]; then \
	  echo "installing a C compiler and the Linux UAPI headers (xfstests' replay-log for the interop tests)"; \
	  { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends gcc libc6-dev linux-libc-dev >/dev/null; } || \
	  echo "warning: no C compiler: the xfstests replay-log interop tests will be skipped"; \
	fi

# Every test: unit, integration, doc tests, loom models, interop with the
# real clients, the kernel VM. scripts/test.sh builds the test binaries
# once and runs the kernel VM tests beside the rest; it ends with one
# `N passed, N failed` line. Under CI (CI set) a test that cannot run
# (a missing tool, no kernel VM) fails instead of skipping.
test: deps
	scripts/test.sh

# Every loom model: the tag allocator's (the long one; its time is in
# docs/BENCHMARKS.md, "Loom models") and the queue-run state's.
loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p blkstack-mq --profile loom --test loom_sbitmap
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p blkstack-mq --profile loom --test loom_runstate

# The vhost-user-blk floor probe (bench-vhost-peers.sh's third server)
# under a real guest: one kernel VM boot, dd through both of its waits
# (its host-side tests run in `make test`).
vhost-floor-vm:
	cargo test -p blkstack-vhost-user-blk --example vhost-floor -- --ignored --nocapture

# The long crash-consistency runs in the kernel VM: ext4 and xfs, each
# checked with fsck at 100 or more FLUSH/FUA points (times in
# docs/BENCHMARKS.md, "Crash-consistency runs"), the same with reorder and torn states
# after each flush point, ext4, xfs and SQLite on the `powercut` target
# cut POWERCUT_CUTS times per mode (default 20), and the block workloads
# at length.
crashtest:
	cargo test -p blkstack --test kernel_crashtest -- --ignored --nocapture --test-threads 1
	cargo test -p blkstack --test kernel_powercut -- --ignored --nocapture --test-threads 1
	cargo run -p blkstack -- crashtest --workload verify --ops 1000
	cargo run -p blkstack -- crashtest --workload journal --ops 400
	cargo run -p blkstack -- crashtest --workload verify --ops 100 --reorder 8 --torn
	cargo run -p blkstack -- crashtest --workload journal --ops 100 --reorder 8 --torn

check:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

lab:
	cargo run --release -- lab all --quick

# The thin pool's kill -9 crash test for longer than `make test` runs it:
# THIN_CRASH_ROUNDS restarts of `blkstack serve`, thin_check after each.
THIN_CRASH_ROUNDS ?= 50
thin-crash:
	BLKSTACK_THIN_CRASH_ROUNDS=$(THIN_CRASH_ROUNDS) cargo test -p blkstack --release --test thin_crash -- --nocapture

# ERA_CRASH_ROUNDS restarts of `blkstack serve` over an era device,
# era_check and era_invalidate after each.
ERA_CRASH_ROUNDS ?= 50
era-crash:
	BLKSTACK_ERA_CRASH_ROUNDS=$(ERA_CRASH_ROUNDS) cargo test -p blkstack --release --test era_crash kill_9 -- --nocapture

# CACHE_CRASH_ROUNDS kill -9s of `blkstack serve` over a cache device
# per metadata format, in turn inside a commit (a metadata write held, a
# metadata flush held) and at a random time; cache_check and a read-back
# of every flushed write after each.
CACHE_CRASH_ROUNDS ?= 50
cache-crash:
	BLKSTACK_CACHE_CRASH_ROUNDS=$(CACHE_CRASH_ROUNDS) cargo test -p blkstack --release --test cache_crash -- --nocapture

# Each cargo-fuzz target (fuzz/fuzz_targets/) for FUZZ_SECS seconds, one
# after another, on nightly. New inputs go to fuzz/work/TARGET (ignored by
# git), seeded from the checked-in fuzz/corpus/TARGET; a crash stops the
# run and leaves its input in fuzz/artifacts/TARGET: copy it to
# fuzz/regressions/TARGET so `cargo test` replays it from then on.
FUZZ_SECS ?= 60
FUZZ_MAX_LEN ?= 131072
FUZZ_TARGETS ?= nbd_server nbd_replies table concise fio_jobfile control_json \
  thin_metadata replay_log vhost_user luks_header
fuzz:
	@command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz
	cd fuzz && cargo +nightly fuzz build -O
	cd fuzz && for t in $(FUZZ_TARGETS); do \
	  mkdir -p work/$$t && \
	  echo "== $$t: $(FUZZ_SECS) s" && \
	  cargo +nightly fuzz run -O $$t work/$$t corpus/$$t -- \
	    -max_total_time=$(FUZZ_SECS) -max_len=$(FUZZ_MAX_LEN) -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 || exit 1; \
	done
