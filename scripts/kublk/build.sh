#!/usr/bin/env bash
# build.sh: a static kublk, the kernel selftests' own ublk server
# (tools/testing/selftests/ublk/), that runs on the kernel VM's 6.12
# ublk_drv, for scripts/bench-ublk-peers.sh (issue 40). README.md says
# where the sources come from and what the patch changes.
#
#   scripts/kublk/build.sh [OUT]        (default target/kublk/kublk)
#
# Needs
#   - the upstream kublk.c, kublk.h and null.c in KUBLK_SRC (default
#     target/kublk/src), checked against SHA256SUMS so that
#     kublk-6.12.patch applies to the text it was written for;
#   - cc and liburing's static library and header (Debian: liburing-dev);
#   - a 6.12 <linux/ublk_cmd.h> under KUBLK_UAPI (default
#     target/kublk/uapi), taken once from Debian's linux-libc-dev 6.12
#     (bookworm-backports) with `apt-get download` when absent.
# Prints OUT and exits 0 when built (or already up to date), exits 3 with
# one line naming the missing prerequisite, 1 when the build fails.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
src=${KUBLK_SRC:-$top/target/kublk/src}
uapi=${KUBLK_UAPI:-$top/target/kublk/uapi}
out=${1:-$top/target/kublk/kublk}
cc=${CC:-cc}

missing() { echo "kublk: $*" >&2; exit 3; }

command -v "$cc" >/dev/null || missing "no C compiler ($cc)"
for f in kublk.c kublk.h null.c; do
  [ -f "$src/$f" ] || missing "no $src/$f (the kernel's tools/testing/selftests/ublk/$f; see scripts/kublk/README.md)"
done
(cd "$src" && sha256sum --quiet -c "$here/SHA256SUMS" >/dev/null 2>&1) ||
  missing "$src holds other versions of kublk.c/kublk.h/null.c than scripts/kublk/SHA256SUMS names"
lib=$("$cc" -print-file-name=liburing.a)
[ "$lib" != liburing.a ] && [ -f "$lib" ] && echo '#include <liburing.h>' | "$cc" -E - >/dev/null 2>&1 ||
  missing "no static liburing (apt-get install liburing-dev)"

if [ ! -f "$uapi/linux/ublk_cmd.h" ]; then
  dl=$(mktemp -d "${TMPDIR:-/tmp}/kublk-uapi.XXXXXX")
  trap 'rm -rf "$dl"' EXIT
  (cd "$dl" && apt-get download linux-libc-dev/bookworm-backports >/dev/null 2>&1) ||
    missing "no 6.12 <linux/ublk_cmd.h>: apt-get download linux-libc-dev/bookworm-backports failed (or set KUBLK_UAPI)"
  dpkg-deb -x "$dl"/linux-libc-dev_*.deb "$dl/x"
  mkdir -p "$uapi/linux"
  cp "$dl/x/usr/include/linux/ublk_cmd.h" "$uapi/linux/"
fi
grep -q 'UBLK_U_CMD_GET_FEATURES' "$uapi/linux/ublk_cmd.h" ||
  missing "$uapi/linux/ublk_cmd.h predates the ioctl-encoded commands kublk sends"

inputs=("$src"/kublk.c "$src"/kublk.h "$src"/null.c "$here"/kublk-6.12.patch "$here"/ublk_dep.h
  "$uapi"/linux/ublk_cmd.h "$0")
fresh=1
for f in "${inputs[@]}"; do [ -f "$out" ] && [ "$out" -nt "$f" ] || fresh=0; done
if [ $fresh = 0 ]; then
  b=$(mktemp -d "${TMPDIR:-/tmp}/kublk-build.XXXXXX")
  cp "$src"/kublk.c "$src"/kublk.h "$src"/null.c "$here"/ublk_dep.h "$b/"
  patch -s -d "$b" -p1 < "$here/kublk-6.12.patch"
  mkdir -p "$(dirname "$out")"
  # -O3 as the selftests Makefile builds it; -I "$uapi" first: the 6.12
  # ublk_cmd.h, every other header the host's.
  "$cc" -static -O3 -D_GNU_SOURCE -Wall -I "$uapi" -I "$b" -o "$out.tmp" \
    "$b"/kublk.c "$b"/null.c -luring -lpthread || { rm -rf "$b"; exit 1; }
  mv "$out.tmp" "$out"
  rm -rf "$b"
fi
echo "$out"
