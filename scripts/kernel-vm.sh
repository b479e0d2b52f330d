#!/usr/bin/env bash
# kernel-vm.sh: the real Linux kernel beside blkstack, as the judge of every
# claim that blkstack behaves like it.
#
# Boots Debian's own linux-image-6.12 package under qemu's software
# emulation (TCG; /dev/kvm hangs guests on the machines this project runs
# on) with a busybox initramfs, blkstack's NBD exports (or plain image
# files) as virtio disks, and qemu's user-mode network restricted so the
# guest reaches nothing but the host loopback ports it is given. It runs one
# guest shell script, prints what the script printed and exits with the
# script's exit status.
#
#   scripts/kernel-vm.sh prepare          fetch the kernel, build the initramfs
#   scripts/kernel-vm.sh run [OPTIONS] SCRIPT
#       --disk SERIAL=URI    a virtio disk with that serial; URI is an NBD URI
#                            (nbd://127.0.0.1:PORT/EXPORT,
#                            nbd+unix:///EXPORT?socket=PATH) or an image file;
#                            in the guest it is /dev/disk/by-serial/SERIAL
#       --shared-disk SERIAL=FILE  an image file two disks may share
#                            (qemu's image locking off, cache=none)
#       --vhost-user-blk SOCKET[:QUEUES]  a virtio disk served over vhost-user
#                            (blkstack serve --vhost-user-blk SOCKET:NAME), in
#                            the order given before the --disk ones (so the
#                            first is /dev/vda); the guest's RAM becomes a
#                            shared memfd, and qemu reconnects to SOCKET every
#                            second while the server is away
#       --fwd GPORT=HPORT    guest 10.0.2.100:GPORT reaches host 127.0.0.1:HPORT
#       --file HOST[:GUEST]  copy a file into the guest (default /test/NAME)
#       --bin PATH           copy an executable and the libraries ldd names
#                            into the guest's /bin (blkstack's own binary, fio)
#       --timeout SECS       kill the guest after SECS (default 300): exit 124
#   scripts/kernel-vm.sh clean            remove target/kernel-vm
#
# The guest script runs under busybox sh in /test with DM_DISABLE_UDEV=1
# (no udev: dmsetup makes its own nodes), the modules in $PRELOAD loaded and
# the rest one `modprobe` away. Its stdout and stderr come back on the
# guest's second serial port; the kernel's console (dmesg) is saved to
# target/kernel-vm/console.log (the last run's); a guest killed at its
# timeout leaves its console and qemu's view of each vCPU (`info lapic`,
# asked over QMP before the kill) in target/kernel-vm/killed-*.log, and
# prints the kernel's warnings and that state. Environment: KERNEL_VM_DIR
# (artifacts, default target/kernel-vm under the checkout), KERNEL_VM_PKG (the kernel
# package, default the pinned one below; falls back to the newest 6.12
# build the archive offers if the pinned one is gone), KERNEL_VM_SMP,
# KERNEL_VM_MEM (MiB).
#
# Exit status: the script's own; 124 on timeout; 125 when the guest ended
# without reporting one (a panic, a failed boot); 2 on bad usage.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
dir=${KERNEL_VM_DIR:-$top/target/kernel-vm}
pinned=linux-image-6.12.117+deb12-amd64-unsigned
pkg=${KERNEL_VM_PKG:-$pinned}
smp=${KERNEL_VM_SMP:-2}
mem=${KERNEL_VM_MEM:-1024}
# Bumped whenever what goes into the base initramfs changes, so a cached
# one from an older script is rebuilt.
layout=11

# Modules loaded at boot (the rest are in the initramfs for `modprobe`).
PRELOAD="virtio_blk virtio_net dm-mod"
MODULES="$PRELOAD dm-zero dm-delay dm-flakey dm-multipath dm-round-robin
  dm-queue-length dm-service-time dm-log-writes dm-thin-pool dm-snapshot dm-era dm-cache dm-cache-smq
  dm-crypt xts essiv crypto_null dm-verity nbd null_blk ublk_drv ext4 xfs loop"
TOOLS="dmsetup mkfs.ext4 mke2fs e2fsck mkfs.xfs xfs_repair xfs_db nbd-client
  blockdev"

die() { echo "kernel-vm: $*" >&2; exit 2; }
say() { echo "kernel-vm: $*" >&2; }

need_tools() {
  local t missing=""
  for t in qemu-system-x86_64 cpio depmod xz busybox socat $TOOLS; do
    command -v "$t" >/dev/null 2>&1 || [ -x "/usr/sbin/$t" ] || [ -x "/sbin/$t" ] || missing="$missing $t"
  done
  [ -e /bin/busybox ] && file -L /bin/busybox 2>/dev/null | grep -q static || \
    { [ -n "$(command -v busybox)" ] && ldd "$(command -v busybox)" 2>&1 | grep -q "not a dynamic"; } || \
    missing="$missing busybox-static"
  [ -z "$missing" ] || die "missing:$missing (make deps installs qemu-system-x86 busybox-static dmsetup e2fsprogs xfsprogs nbd-client kmod cpio socat)"
}

tool_path() {
  local t=$1
  command -v "$t" 2>/dev/null || { [ -x "/usr/sbin/$t" ] && echo "/usr/sbin/$t"; } || echo "/sbin/$t"
}

# Copies an executable and every library ldd names (and the loader) under
# $1, keeping their absolute paths.
copy_with_libs() {
  local root=$1 exe=$2 dest=${3:-} lib
  [ -n "$dest" ] || dest=$exe
  mkdir -p "$root$(dirname "$dest")"
  cp -L "$exe" "$root$dest"
  for lib in $(ldd "$exe" 2>/dev/null | grep -o '/[^ ]*'); do
    [ -e "$root$lib" ] && continue
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done
}

fetch_kernel() {
  local deb
  mkdir -p "$dir/deb"
  deb=$(ls "$dir"/deb/"$pkg"_*.deb 2>/dev/null | head -n1 || true)
  if [ -z "$deb" ]; then
    if ! (cd "$dir/deb" && apt-get download "$pkg" >/dev/null 2>&1); then
      [ "$pkg" = "$pinned" ] || die "apt-get download $pkg failed"
      # The security archive drops old builds: take the newest 6.12 one.
      pkg=$(apt-cache search --names-only '^linux-image-6\.12\.[0-9]+\+deb[0-9]+-amd64-unsigned$' \
        | awk '{print $1}' | sort -V | tail -n1)
      [ -n "$pkg" ] || die "no linux-image-6.12 package in the apt index (run apt-get update)"
      say "pinned $pinned is gone from the archive; using $pkg"
      (cd "$dir/deb" && apt-get download "$pkg" >/dev/null 2>&1) || die "apt-get download $pkg failed"
    fi
    deb=$(ls "$dir"/deb/"$pkg"_*.deb | head -n1)
  fi
  rm -rf "$dir/pkg" && mkdir -p "$dir/pkg"
  dpkg-deb -x "$deb" "$dir/pkg"
  kver=$(ls "$dir/pkg/lib/modules" | head -n1)
  cp "$dir/pkg/boot/vmlinuz-$kver" "$dir/vmlinuz"
  echo "$kver" > "$dir/kver"
}

# The modules named and everything they depend on, decompressed, with a
# fresh modules.dep that busybox's modprobe reads.
install_modules() {
  local root=$1 m f rel
  depmod -b "$dir/pkg" "$kver"
  for m in $MODULES; do
    modprobe -d "$dir/pkg" -S "$kver" --show-depends "$m" 2>/dev/null | awk '$1=="insmod"{print $2}'
  done | sort -u > "$dir/modules.list"
  [ -s "$dir/modules.list" ] || die "no modules resolved from $pkg"
  while read -r f; do
    rel=${f#"$dir/pkg"}
    mkdir -p "$root$(dirname "$rel")"
    case $f in
      *.xz) xz -dc "$f" > "$root${rel%.xz}" ;;
      *.zst) zstd -qdc "$f" > "$root${rel%.zst}" ;;
      *) cp "$f" "$root$rel" ;;
    esac
  done < "$dir/modules.list"
  cp "$dir/pkg/lib/modules/$kver/modules.order" "$dir/pkg/lib/modules/$kver/modules.builtin"* \
    "$root/lib/modules/$kver/" 2>/dev/null || true
  depmod -b "$root" "$kver"
}

write_init() {
  cat > "$1/init" <<EOF
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/sbin:/usr/sbin:/bin:/usr/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm /tmp /run /mnt /dev/disk/by-serial
mount -t tmpfs tmp /tmp
echo /bin/modprobe > /proc/sys/kernel/modprobe
for m in $PRELOAD; do modprobe \$m; done
mdev -s 2>/dev/null
for d in /sys/block/vd*; do
  [ -e "\$d/serial" ] || continue
  s=\$(cat "\$d/serial")
  [ -n "\$s" ] && ln -sf "/dev/\${d##*/}" "/dev/disk/by-serial/\$s"
done
ip link set lo up
if [ -e /sys/class/net/eth0 ]; then
  ip link set eth0 up
  ip addr add 10.0.2.15/24 dev eth0
  ip route add default via 10.0.2.2
fi
export DM_DISABLE_UDEV=1 HOME=/root
mkdir -p /root
cd /test
sh /test/script </dev/null >/dev/ttyS1 2>&1
echo "KERNEL-VM-EXIT=\$?" >/dev/ttyS1
# A sync that a dead device holds for ever must not keep the guest up.
sync & s=\$!
i=0; while kill -0 \$s 2>/dev/null && [ \$i -lt 100 ]; do usleep 100000; i=\$((i+1)); done
poweroff -f
EOF
  chmod +x "$1/init"
}

# One guest (and one prepare) at a time per artifact directory: TCG takes a
# whole host CPU per guest CPU, and two prepares would clobber each other.
lock() {
  mkdir -p "$dir"
  exec 9>"$dir/lock"
  flock 9
}

prepare() {
  need_tools
  lock
  if [ -f "$dir/base.cpio" ] && [ -f "$dir/vmlinuz" ] && [ "$(cat "$dir/stamp" 2>/dev/null)" = "$pkg $layout" ]; then
    kver=$(cat "$dir/kver")
    return
  fi
  say "preparing $pkg (kernel, modules, initramfs) in $dir"
  fetch_kernel
  local root="$dir/root" t
  rm -rf "$root" && mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,tmp,test,lib64}
  cp "$(command -v busybox)" "$root/bin/busybox"
  for t in $TOOLS; do copy_with_libs "$root" "$(tool_path "$t")" "/sbin/$t"; done
  [ -f /etc/mke2fs.conf ] && cp /etc/mke2fs.conf "$root/etc/"
  printf 'root:x:0:0:root:/root:/bin/sh\n' > "$root/etc/passwd"
  printf 'root:x:0:\n' > "$root/etc/group"
  install_modules "$root"
  write_init "$root"
  (cd "$root" && find . | cpio -o -H newc --quiet) > "$dir/base.cpio"
  echo "$pkg $layout" > "$dir/stamp"
  say "ready: kernel $kver, initramfs $(du -h "$dir/base.cpio" | cut -f1)"
}

run() {
  local script="" timeout=300 disks=() fwds=() files=() bins=() vhosts=() n=0 a
  while [ $# -gt 0 ]; do
    case $1 in
      --disk) disks+=("nbd:$2"); shift 2 ;;
      --shared-disk) disks+=("shared:$2"); shift 2 ;;
      --fwd) fwds+=("$2"); shift 2 ;;
      --vhost-user-blk) vhosts+=("$2"); shift 2 ;;
      --file) files+=("$2"); shift 2 ;;
      --bin) bins+=("$2"); shift 2 ;;
      --timeout) timeout=$2; shift 2 ;;
      -*) die "unknown option $1" ;;
      *) [ -z "$script" ] || die "one script only (got $script and $1)"; script=$1; shift ;;
    esac
  done
  [ -n "$script" ] || die "run needs a guest script"
  [ -f "$script" ] || die "no such script: $script"
  case $timeout in ''|*[!0-9]*) die "--timeout needs whole seconds, got '$timeout'" ;; esac
  prepare

  work=$(mktemp -d "${TMPDIR:-/tmp}/kernel-vm.XXXXXX")
  # Each run's console is its own (two guests may run at once); the last
  # one to end leaves it in $dir/console.log for a look afterwards.
  trap 'cp -f "${work:-}/console.log" "$dir/console.log" 2>/dev/null; rm -rf "${work:-}"' EXIT
  mkdir -p "$work/root/test" "$work/root/bin"
  cp "$script" "$work/root/test/script"
  for a in "${files[@]+"${files[@]}"}"; do
    local h=${a%%:*} g=${a#*:}
    [ "$h" != "$a" ] || g="/test/$(basename "$h")"
    [ -e "$h" ] || die "--file: no such file: $h"
    mkdir -p "$work/root$(dirname "$g")" && cp -L "$h" "$work/root$g"
  done
  for a in "${bins[@]+"${bins[@]}"}"; do
    [ -x "$a" ] || die "--bin: not an executable: $a"
    copy_with_libs "$work/root" "$a" "/bin/$(basename "$a")"
    strip "$work/root/bin/$(basename "$a")" 2>/dev/null || true
  done
  (cd "$work/root" && find . -mindepth 1 | cpio -o -H newc --quiet) > "$work/run.cpio"
  cat "$dir/base.cpio" "$work/run.cpio" > "$work/initrd"

  # no_timer_check: the kernel's check that the IO-APIC timer ticks
  # times a few emulated ticks against the TSC, and a TCG guest on a
  # loaded host fails it and panics at boot ("IO-APIC + timer doesn't
  # work"); the check has nothing to say about an emulated machine.
  local args=(-accel tcg -cpu max -smp "$smp" -m "$mem" -nodefaults -no-reboot
    -display none -monitor none -qmp "unix:$work/qmp.sock,server=on,wait=off"
    -kernel "$dir/vmlinuz" -initrd "$work/initrd"
    -append "console=ttyS0 panic=-1 quiet loglevel=4 rdinit=/init no_timer_check"
    -serial "file:$work/console.log" -chardev "file,id=out,path=$work/out"
    -device isa-serial,chardev=out)
  if [ ${#vhosts[@]} -gt 0 ]; then
    # vhost-user needs the guest's RAM in memory the server can map.
    args+=(-object "memory-backend-memfd,id=mem,size=${mem}M,share=on" -numa node,memdev=mem)
    for a in "${vhosts[@]}"; do
      local sock=${a%%:*} q=1
      [ "$sock" != "$a" ] && q=${a#*:}
      case $q in ''|*[!0-9]*) die "--vhost-user-blk wants SOCKET[:QUEUES], got '$a'" ;; esac
      args+=(-chardev "socket,id=vu$n,path=$sock,reconnect-ms=1000"
        -device "vhost-user-blk-pci,chardev=vu$n,num-queues=$q")
      n=$((n + 1))
    done
  fi
  for a in "${disks[@]+"${disks[@]}"}"; do
    local kind=${a%%:*} spec=${a#*:}
    local serial=${spec%%=*} uri=${spec#*=}
    [ "$serial" != "$spec" ] && [ -n "$serial" ] && [ -n "$uri" ] || die "--disk wants SERIAL=URI, got '$spec'"
    case $kind:$uri in
      nbd:nbd*) args+=(-drive "file=$uri,format=raw,if=none,id=d$n,cache=none,werror=report,rerror=report") ;;
      nbd:*) [ -e "$uri" ] || die "--disk: no such image: $uri"
        args+=(-drive "file=$uri,format=raw,if=none,id=d$n,cache=none,werror=report,rerror=report,aio=threads") ;;
      shared:*) [ -e "$uri" ] || die "--shared-disk: no such image: $uri"
        args+=(-drive "file=$uri,format=raw,if=none,id=d$n,cache=none,werror=report,rerror=report,file.locking=off") ;;
    esac
    local share=""; [ "$kind" = shared ] && share=",share-rw=on"
    args+=(-device "virtio-blk-pci,drive=d$n,serial=$serial$share")
    n=$((n + 1))
  done
  if [ ${#fwds[@]} -gt 0 ]; then
    local net="user,id=n0,restrict=on"
    for a in "${fwds[@]}"; do
      local gp=${a%%=*} hp=${a#*=}
      case $gp$hp in *[!0-9]*|'') die "--fwd wants GUESTPORT=HOSTPORT, got '$a'" ;; esac
      # cmd: runs one socat per guest connection (a tcp: target would be
      # one connection made at start and shared by all of them).
      # socat must say nothing: its stderr is the guest's connection too.
      net+=",guestfwd=tcp:10.0.2.100:$gp-cmd:socat -lf /dev/null STDIO TCP:127.0.0.1:$hp"
    done
    args+=(-netdev "$net" -device virtio-net-pci,netdev=n0)
  fi

  : > "$work/out"
  local rc=0 qemu t=0 marked=""
  qemu-system-x86_64 "${args[@]}" </dev/null >"$work/qemu.log" 2>&1 &
  qemu=$!
  # Once the script has reported, the guest gets 10 s to power off: a
  # shutdown can wait for ever on I/O a dead device holds (multipath's
  # queue_if_no_path), and the script's verdict is in.
  while kill -0 "$qemu" 2>/dev/null; do
    if [ -z "$marked" ] && grep -q '^KERNEL-VM-EXIT=' "$work/out" 2>/dev/null; then
      marked=$t
    fi
    if [ -n "$marked" ] && [ $((t - marked)) -ge 50 ]; then
      say "the guest reported but did not power off: stopping it"
      kill -9 "$qemu" 2>/dev/null || true
    elif [ $t -ge $((timeout * 5)) ]; then
      guest_state > "$work/state.txt" 2>&1 || true
      kill -9 "$qemu" 2>/dev/null || true; rc=124
    fi
    sleep 0.2; t=$((t + 1))
  done
  wait "$qemu" 2>/dev/null || [ "$rc" = 124 ] || rc=$?
  tr -d '\r' < "$work/out" > "$work/out.txt"
  grep -v '^KERNEL-VM-EXIT=' "$work/out.txt" || true
  local st; st=$(grep -o '^KERNEL-VM-EXIT=[0-9]*' "$work/out.txt" | tail -n1 | cut -d= -f2 || true)
  if [ -z "$st" ] && [ "$rc" = 124 ]; then
    local keep; keep="$dir/killed-$(date +%Y%m%d-%H%M%S)-$$.log"
    cat "$work/console.log" "$work/state.txt" > "$keep" 2>/dev/null || true
    say "guest killed after ${timeout}s (console and vCPU state kept in $keep)"
    say "kernel warnings:"; grep -E 'rcu:|INFO:|BUG:|hung_task|blocked for|timer' "$work/console.log" | head -n 20 >&2 || true
    say "vCPU state:"; cat "$work/state.txt" >&2 || true
    say "console tail:"; tail -n 30 "$work/console.log" >&2; exit 124
  fi
  if [ -z "$st" ]; then
    say "guest ended without an exit status (qemu rc $rc); qemu said:"; cat "$work/qemu.log" >&2
    say "console tail:"; tail -n 40 "$work/console.log" >&2; exit 125
  fi
  exit "$st"
}

# What qemu says about a guest that is about to be killed: each vCPU's
# registers' summary and local APIC (timer mode, count, pending vectors),
# so that a guest hung in boot says which vCPU stopped taking interrupts.
guest_state() {
  local q=(); local c
  q+=('{"execute":"qmp_capabilities"}' '{"execute":"human-monitor-command","arguments":{"command-line":"info cpus"}}')
  for c in $(seq 0 $((smp - 1))); do
    q+=("{\"execute\":\"human-monitor-command\",\"arguments\":{\"command-line\":\"info lapic $c\"}}")
  done
  printf '%s\n' "${q[@]}" | timeout 5 socat -t 2 - "UNIX-CONNECT:$work/qmp.sock" \
    | grep -o '"return": "[^"]*"' | sed 's/^"return": "//; s/"$//; s/\\r\\n/\n/g; s/\\n/\n/g; s/\\t/\t/g'
}

case ${1:-} in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  clean) rm -rf "$dir" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed 's/^# \{0,1\}//;$d' >&2; exit 2 ;;
esac
