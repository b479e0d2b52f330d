#!/bin/sh
# Seeds fuzz/corpus/luks_header from images the real `cryptsetup
# luksFormat` makes (LUKS1 and LUKS2; PBKDF2, argon2i, argon2id; tiny KDF
# costs so the fuzz target's unlock path runs). Each seed is the fuzz
# input format of blkstack_mapped::luks::fuzz: a flag byte (0), the
# image size as 8 little-endian bytes, then the image's first bytes:
# the headers, and for the `-unlocks` seeds the first keyslot's material
# too, so the seed opens with the passphrase "correct horse".
# Usage: fuzz/seed-luks-header.sh [OUT_DIR] (default fuzz/corpus/luks_header).
set -eu
out=${1:-$(dirname "$0")/corpus/luks_header}
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf 'correct horse' >"$tmp/key"
size=$((24 << 20))

# seed NAME BYTES luksFormat-args...
seed() {
    name=$1 bytes=$2
    shift 2
    rm -f "$tmp/img"
    truncate -s $size "$tmp/img"
    cryptsetup luksFormat --batch-mode --key-file "$tmp/key" "$@" "$tmp/img"
    python3 - "$tmp/img" "$out/$name" "$bytes" $size <<'PY'
import sys, struct
img, dst, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with open(img, "rb") as f:
    head = f.read(n)
with open(dst, "wb") as f:
    f.write(b"\0" + struct.pack("<Q", size) + head)
PY
}

seed luks1-xts512-sha256 4096 --type luks1 --cipher aes-xts-plain64 --key-size 512 \
    --hash sha256 --pbkdf-force-iterations 1000
seed luks1-cbc-essiv-sha1-unlocks $((4096 + 64000)) --type luks1 \
    --cipher aes-cbc-essiv:sha256 --key-size 128 --hash sha1 --pbkdf-force-iterations 1000
seed luks2-argon2id 32768 --type luks2 --pbkdf argon2id --pbkdf-memory 32 \
    --pbkdf-force-iterations 4 --pbkdf-parallel 1
seed luks2-argon2i-label-4k 32768 --type luks2 --pbkdf argon2i --pbkdf-memory 32 \
    --pbkdf-force-iterations 4 --pbkdf-parallel 2 --sector-size 4096 \
    --label fuzz --subsystem seed
seed luks2-pbkdf2-cbc-unlocks $((32768 + 64000)) --type luks2 --pbkdf pbkdf2 \
    --pbkdf-force-iterations 1000 --cipher aes-cbc-essiv:sha256 --key-size 128
seed luks2-pbkdf2-xts256-meta32k 65536 --type luks2 --pbkdf pbkdf2 \
    --pbkdf-force-iterations 1000 --cipher aes-xts-plain64 --key-size 256 \
    --luks2-metadata-size 32k
ls -l "$out"
