# Shell functions of the powercut guest tests (frontends/cli/tests/kernel_powercut.rs),
# run by busybox sh in the kernel VM; blkstack serves the powercut devices
# on ublk inside the guest, so the script itself cuts the power
# (`blkstack message NAME 0 cut ...`) and brings it back (`power_on`).
fail() { echo "FAIL: $*"; exit 1; }
modprobe ublk_drv || fail "modprobe ublk_drv"
modprobe ext4; modprobe xfs
C=/tmp/c.sock
start_serve() {
  out=$1; shift
  blkstack serve "$@" > $out 2>&1 &
  spid=$!
  i=0; while ! grep -q '^ready' $out 2>/dev/null; do
    kill -0 $spid 2>/dev/null || { cat $out; fail "serve $* exited"; }
    [ $i -lt 900 ] || { cat $out; fail "serve $* not ready"; }
    usleep 100000; i=$((i+1))
  done
}
dev_of() { sed -n "s/^serving $1 .* at \(\/dev\/ublkb[0-9]*\)\$/\1/p" $2; }
# The power fails (`cut MODE...`) and comes back, through the control socket.
# The cut's reply (what it kept of the cache) is left in $CUTMSG.
pc_cut() {
  pn=$1; shift
  CUTMSG=$(blkstack message --control $C $pn 0 cut "$@" 2>&1) || fail "cut $pn $*: $CUTMSG"
}
pc_on() { blkstack message --control $C $1 0 power_on || fail "power_on $1"; }
now() { cut -d' ' -f1 /proc/uptime; }
# say WHAT: a step's guest time since the round began, when TRACE is set.
say() { [ -z "$TRACE" ] || echo "  $(now) $*"; }
pc_status() { blkstack status --control $C $1 | tr '\n' ' '; }
mnt() {
  case $1 in
    ext4) mount -t ext4 -o data=ordered${3:+,$3} $2 /mnt ;;
    xfs) mount -t xfs ${3:+-o $3} $2 /mnt ;;
  esac || fail "mount $1 $2"
}
fsck_fs() {
  case $1 in ext4) e2fsck -fn $2 ;; xfs) xfs_repair -n $2 ;; esac > /tmp/fsck.out 2>&1 && return 0
  cat /tmp/fsck.out; return 1
}
# waitdead PID WHAT: what ran on the device ends once every I/O fails.
waitdead() {
  wk=0; while kill -0 $1 2>/dev/null && [ $wk -lt 600 ]; do usleep 50000; wk=$((wk+1)); done
  kill -0 $1 2>/dev/null && { ps; fail "$2 still runs 30 s after the cut"; }
  wait $1 2>/dev/null
}
# after_cut FS NAME DEV: the dead mount goes (the cut left every I/O
# failing, so ext4 has aborted its journal and xfs has shut down), the
# block device's page cache with it, and the power comes back; then the
# kernel mounts the device again (journal replay) for the checks.
after_cut() {
  umount /mnt || { grep /mnt /proc/mounts; fail "umount of the dead $1"; }
  say "dead $1 unmounted"
  echo 3 > /proc/sys/vm/drop_caches
  pc_on $2
  say "power on"
  mnt $1 $3
}
# checked_remount FS DEV: umount, fsck must be clean, mount again.
checked_remount() {
  umount /mnt || fail "umount $1"
  say unmounted
  fsck_fs $1 $2 || fail "fsck of $1 after the cut"
  say "fsck clean"
  mnt $1 $2
}
# files_round FS NAME DEV ROUND MODE...: pcwork writes and fsyncs files
# ($FILES fsynced ones in the round), then goes on writing files it never
# flushes; the cut comes while it does, so the cache always holds writes.
# Every file it logged as fsynced, in this round and the ones before,
# must be intact after power-on, and fsck clean.
FILES=4
files_round() {
  fs=$1 n=$2 d=$3 r=$4; shift 4
  t0=$(now); log=/tmp/$fs.log; touch $log
  mkdir /mnt/r$r || fail "mkdir r$r"
  # Emptied here, not by the background job's redirection: the loop below
  # must never read the last round's "unflushed".
  : > /tmp/w.out
  pcwork files /mnt/r$r $log $r $FILES >> /tmp/w.out 2>&1 &
  w=$!
  i=0; while ! grep -q unflushed /tmp/w.out && kill -0 $w 2>/dev/null && [ $i -lt 1200 ]; do usleep 50000; i=$((i+1)); done
  grep -q unflushed /tmp/w.out || {
    kill -0 $w 2>/dev/null || { wait $w; echo "pcwork exited $?"; }
    cat /tmp/w.out; ls -l /mnt/r$r | tail -n 3; dmesg | tail -n 5
    fail "$fs round $r: pcwork did not reach its unflushed phase"
  }
  usleep 200000
  say "$(wc -l < $log) files fsynced"
  # What the cache holds just before the cut (costs a blkstack run: only
  # when tracing).
  st=; [ -z "$TRACE" ] || st=$(pc_status $n)
  pc_cut $n "$@"
  say cut
  # Unflushed writes do not fail at once (they end in the page cache).
  kill -9 $w 2>/dev/null
  waitdead $w "pcwork on $fs"
  say "pcwork ended"
  after_cut $fs $n $d
  say "mounted after power-on"
  res=$(pcwork check $log | tail -n 20 | tr '\n' ' ')
  say checked
  checked_remount $fs $d
  say "fsck clean, mounted"
  echo "CUT fs=$fs mode=$(echo $* | tr " " _) round=$r t=$(echo "$(now) $t0" | awk '{print int($1-$2)}') durable=$(wc -l < $log) $res fsck=clean | $CUTMSG | before: $st | $(head -n1 /tmp/w.out)"
}
# bug_round FS NAME DEV: the planted bug. A file replaced with rename and
# no fsync, and a new file made so, after the last flush; a file replaced
# the correct way (fsync, rename, fsync of the directory) just before.
# The journal's commit interval is stretched so that nothing but the
# program's own fsyncs flushes in the window before the cut.
bug_round() {
  fs=$1 n=$2 d=$3
  mount -o remount,commit=600 /mnt || fail "remount commit=600"
  mkdir /mnt/bug || fail "mkdir bug"
  pcwork update /mnt/bug good 1 fsync && pcwork update /mnt/bug bad 1 fsync && sync || fail "first versions"
  pcwork update /mnt/bug good 2 fsync || fail "the correct update"
  pcwork update /mnt/bug bad 2 || fail "the buggy update"
  pcwork update /mnt/bug new 2 || fail "the buggy create"
  echo "BUG before the cut: good=$(pcwork verify /mnt/bug/good 2) bad=$(pcwork verify /mnt/bug/bad 2) new=$(pcwork verify /mnt/bug/new 2)"
  pc_cut $n drop
  after_cut $fs $n $d
  echo "BUG after the cut: good=$(pcwork verify /mnt/bug/good 2) bad=$(pcwork verify /mnt/bug/bad 2) new=$(pcwork verify /mnt/bug/new 2) | $CUTMSG"
  checked_remount $fs $d
}
# sql_round SYNC ROUND MODE...: one sqlite3 process commits a row per
# transaction (WAL journal, PRAGMA synchronous=SYNC), and after each
# COMMIT returns, records its number in a log database on the tmpfs;
# the cut comes once $COMMITS are recorded. With FULL every recorded
# commit must be there after power-on, and integrity_check ok. With OFF
# the kernel's periodic writeback is off for the round, so that nothing
# but the cut decides what of the unsynced commits reaches the disk, and
# the count is taken just before the cut: a commit after it proves
# nothing. Beside it pcwork writes files it never flushes, so that the
# cut finds the cache loaded and SQLite's flushes have work to do.
COMMITS=6
sqlast() { sqlite3 -cmd ".timeout 5000" /tmp/sq$1.db "SELECT coalesce(max(i), 0) FROM c;" 2>/dev/null || echo 0; }
sql_round() {
  sync=$1 r=$2 fs=ext4 n=$SQL_NAME d=$SQL_DEV; shift 2
  db=/mnt/sq$r/db
  mkdir /mnt/sq$r || fail "mkdir sq$r"
  t0=$(now)
  sqlite3 $db "PRAGMA journal_mode=WAL; CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT);" > /dev/null || fail "create $db"
  # The log in WAL mode: the test's readers never block the writer.
  sqlite3 /tmp/sq$r.db "PRAGMA journal_mode=WAL; CREATE TABLE c(i INTEGER);" > /dev/null || fail "create the commit log"
  sync
  [ $sync = OFF ] && echo 0 > /proc/sys/vm/dirty_writeback_centisecs
  mkdir /mnt/sqbg$r || fail "mkdir sqbg$r"
  pcwork files /mnt/sqbg$r /tmp/bg.log $r 0 > /tmp/bg.out 2>&1 &
  bg=$!
  ( echo "PRAGMA main.synchronous=$sync; ATTACH '/tmp/sq$r.db' AS log; PRAGMA log.synchronous=OFF;"
    i=1
    while echo "INSERT INTO t VALUES($i, 'row-$i-' || hex(zeroblob(1500))); INSERT INTO log.c VALUES($i);"; do
      i=$((i+1))
    done ) | sqlite3 -bail -cmd ".timeout 5000" $db > /tmp/sq.out 2>&1 &
  w=$!
  say "sqlite3 started"
  # Each look is a sqlite3 run: not too often, it takes the writer's CPU.
  i=0; while [ $(sqlast $r) -lt $COMMITS ] && [ $i -lt 200 ]; do usleep 300000; i=$((i+1)); done
  [ $(sqlast $r) -ge $COMMITS ] || { cat /tmp/sq.out; fail "sqlite round $r made no progress"; }
  say "$COMMITS commits"
  before=$(sqlast $r)
  pc_cut $n "$@"
  say cut
  kill -9 $w $bg 2>/dev/null
  waitdead $w sqlite3
  waitdead $bg pcwork
  echo 500 > /proc/sys/vm/dirty_writeback_centisecs
  if [ $sync = OFF ]; then last=$before; else last=$(sqlast $r); fi
  after_cut $fs $n $d
  say "mounted after power-on"
  present=$(sqlite3 $db "SELECT count(*) FROM t WHERE id <= $last AND v = 'row-' || id || '-' || hex(zeroblob(1500));" 2>&1 | tr '\n' ' ')
  ic=$(sqlite3 $db "PRAGMA integrity_check;" 2>&1 | head -n 3 | tr '\n' ' ')
  say checked
  checked_remount $fs $d
  say "fsck clean, mounted"
  echo "SQL sync=$sync mode=$(echo $* | tr " " _) round=$r t=$(echo "$(now) $t0" | awk '{print int($1-$2)}') committed=$last present=$present integrity=$ic fsck=clean | $CUTMSG"
}
