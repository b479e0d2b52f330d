//! Issue 39 in the kernel VM: the kernel and blkstack hand out metadata
//! blocks alike (`dm-space-map-metadata.c`, `dm-space-map-common.c`,
//! `dm-btree.c` of 6.12). Both run the same steps on fresh pools and
//! compare the used metadata blocks after each; over the same metadata,
//! the same messages must leave the same status and superblock roots;
//! a pool of more data bitmaps than the index entry cache holds has
//! its metadata device grown, with the same status and roots; and over
//! a pool blkstack filled, one write each makes a full leaf split two
//! into three and another move entries to its right sibling, with the
//! same status and roots. A module of `kernel_thin.rs`, whose helpers
//! it uses, to keep both files short.

use super::*;

/// Issue 39's steps, done by the kernel and by blkstack on fresh pools:
/// a pool, thin 1 with 16 blocks written, a snapshot, writes to both,
/// [`MANY`] blocks of the snapshot written one by one, the messages of
/// [`ORDER_MESSAGES`], the pool's status after each (`order`). Both hand out metadata blocks in
/// `dm-space-map-metadata.c`'s order, so the used counts are the same
/// and, when no commit timer fired inside a batch of writes, so is the
/// held metadata snapshot's block; but dm-thin's one-second timer commits
/// whenever its worker runs after it expired, which under the guest's
/// software emulation can fall between a block's allocation and its
/// mapping, moving the kernel's later blocks (held block 48 or 50 where
/// blkstack and an undisturbed kernel say 43). So the held block is
/// compared exactly where no timer can interfere (`held`): both open the
/// metadata blkstack left after the writes and send the same messages,
/// each committed at once (`create_thin 3`, `set_transaction_id`,
/// `reserve_metadata_snap`), and every status line, held block included,
/// must be the same.
const ORDER_GUEST: &str = r#"
fail() { echo "FAIL: $*"; exit 1; }
dev() { cat /sys/block/$(basename $(readlink /dev/disk/by-serial/$1))/dev; }
st() { dmsetup status $1 | sed 's/ *$//' | cut -d' ' -f4-; }
w() { dd if=/test/pattern of=/dev/mapper/$1 bs=$(($2 * 65536)) count=1 seek=$(($3 / $2)) oflag=direct conv=notrunc,fsync 2>/dev/null || fail "write $*"; }
modprobe dm-thin-pool || fail "modprobe dm-thin-pool"
echo "BEGIN order"
dmsetup create opool --table "0 DATA thin-pool $(dev ometa) $(dev odata) 128 0" || fail "pool"
st opool
dmsetup message opool 0 create_thin 1 || fail create_thin
st opool
dmsetup create ot1 --table "0 THIN thin /dev/mapper/opool 1" || fail "thin 1"
w ot1 16 0
st opool
dmsetup suspend ot1 && dmsetup message opool 0 create_snap 2 1 && dmsetup resume ot1 || fail create_snap
st opool
dmsetup create ot2 --table "0 THIN thin /dev/mapper/opool 2" || fail "thin 2"
w ot1 2 4
st opool
w ot2 2 20
st opool
dd if=/dev/zero of=/dev/mapper/ot2 bs=65536 count=MANY seek=100 oflag=direct conv=fsync 2>/dev/null || fail "many writes"
st opool
dmsetup remove ot1; dmsetup remove ot2 || fail "remove ot1, ot2"
MESSAGES opool
echo "END order"
dmsetup remove opool || fail "remove opool"
echo "BEGIN held"
dmsetup create hpool --table "0 DATA thin-pool $(dev hmeta) $(dev hdata) 128 0" || fail "pool over blkstack's metadata"
st hpool
MESSAGES hpool
echo "END held"
dmsetup remove hpool || fail "remove hpool"
echo "BEGIN grown"
dmsetup create gm --table "0 GSMALL linear $(dev gmeta) 0" || fail "gm"
dmsetup create gpool --table "0 GSECTORS thin-pool /dev/mapper/gm $(dev gdata) 128 0" || fail "pool of 66 bitmaps"
st gpool
dmsetup message gpool 0 create_thin 1 || fail "create_thin 1"
st gpool
dmsetup reload gm --table "0 GBIG linear $(dev gmeta) 0" && dmsetup resume gm || fail "grow gm"
dmsetup reload gpool --table "0 GSECTORS thin-pool /dev/mapper/gm $(dev gdata) 128 0" && dmsetup resume gpool || fail "reload gpool"
st gpool
dmsetup message gpool 0 create_thin 2 || fail "create_thin 2"
dmsetup message gpool 0 reserve_metadata_snap || fail "reserve"
st gpool
echo "END grown"
dmsetup remove gpool; dmsetup remove gm || fail "remove gpool"
echo "BEGIN split"
dmsetup create spool --table "0 SSECTORS thin-pool $(dev smeta) $(dev sdata) 128 0" || fail "pool over blkstack's full leaves"
st spool
dmsetup create st1 --table "0 SLEN thin /dev/mapper/spool 1" || fail "st1"
w st1 1 TWO_INTO_THREE
st spool
dmsetup create st2 --table "0 SLEN thin /dev/mapper/spool 2" || fail "st2"
w st2 1 MOVE_RIGHT
st spool
echo "END split"
dmsetup remove st1; dmsetup remove st2; dmsetup remove spool || fail "remove spool"
echo DONE
"#;

/// The grown pool's data device: one block past 65 bitmaps, so the data
/// space map's index entries (66) are more than its cache holds (64)
/// and are written into the index tree as the cache evicts them.
const GDATA_SECTORS: u64 = (65 * 16320 + 1) * 128;
/// Its metadata device, first short of the first bitmap's end, then
/// grown past it: the grown metadata space map makes a second bitmap.
const GSMALL_SECTORS: u64 = 16300 * 8;
const GBIG_SECTORS: u64 = 17000 * 8;

/// [`ORDER_GUEST`]'s `grown` steps here, on `gmeta-b` and `gdata-b`:
/// the pool's status after each.
fn grown_here(p: &dyn Fn(&str) -> std::path::PathBuf) -> String {
    let reg = Registry::new();
    let meta = p("gmeta-b");
    reg.create("gm", &format!("0 {GSMALL_SECTORS} file {}", meta.display()))
        .unwrap();
    let gdata = p("gdata-b");
    reg.create(
        "gdata",
        &format!("0 {GDATA_SECTORS} file {}", gdata.display()),
    )
    .unwrap();
    let table = format!("0 {GDATA_SECTORS} thin-pool gm gdata 128 0");
    reg.create("pool", &table).unwrap();
    let msg = |m: &str| {
        let args: Vec<&str> = m.split_whitespace().collect();
        reg.message("pool", 0, &args).unwrap();
    };
    let mut out = vec![status_args(&reg, "pool")];
    msg("create_thin 1");
    out.push(status_args(&reg, "pool"));
    reg.reload("gm", &format!("0 {GBIG_SECTORS} file {}", meta.display()))
        .unwrap();
    reg.resume("gm").unwrap();
    reg.reload("pool", &table).unwrap();
    reg.resume("pool").unwrap();
    out.push(status_args(&reg, "pool"));
    msg("create_thin 2");
    msg("reserve_metadata_snap");
    out.push(status_args(&reg, "pool"));
    reg.remove_all();
    out.join("\n")
}

/// The split pool's data device: room for both thins' mappings.
const SDATA_SECTORS: u64 = 2048 * 128;
/// Its thins' size.
const STHIN_SECTORS: u64 = 1024 * 128;
/// Thin 1's blocks written in ascending runs before the guest: three
/// leaves, the first full but for 4 entries, the second (its range
/// 248..514 with 300..330 left out, then 300..316 written) full, the
/// third but for 6.
const TWO_INTO_THREE_RUNS: &[(u64, u64)] = &[(0, 300), (330, 760), (300, 316)];
/// The block that then goes into thin 1's full middle leaf: neither
/// sibling has `SPACE_THRESHOLD` free entries, so `rebalance_or_split`
/// splits two nodes into three.
const TWO_INTO_THREE: u64 = 316;
/// Thin 2's runs: the root leaf split in two by the ascending run, then
/// the first leaf filled up from the gap left in its range.
const MOVE_RIGHT_RUNS: &[(u64, u64)] = &[(0, 100), (300, 560), (100, 226)];
/// The block that then goes into thin 2's full first leaf: it has no
/// left sibling and its right one room, so entries move right.
const MOVE_RIGHT: u64 = 226;

/// The `split` steps: blkstack maps the runs (thin 1's
/// [`TWO_INTO_THREE_RUNS`], thin 2's [`MOVE_RIGHT_RUNS`]) one block at a
/// time in ascending order, straight into the pool's metadata (the data
/// is never read, so none is written); `smeta` gets that metadata for
/// the guest. Then each side writes the one block that makes room in a
/// full leaf, each committed by its flush, so dm-thin's commit timer
/// cannot fall inside (one change per transaction): the pool's status
/// after each, here on `smeta-b`/`sdata-b`.
fn split_here(p: &dyn Fn(&str) -> std::path::PathBuf) -> String {
    use blkstack_mapped::targets::thin::metadata::PoolMetadata;
    let reg = Registry::new();
    let meta = p("smeta-b");
    reg.create("meta", &format!("0 {META_SECTORS} file {}", meta.display()))
        .unwrap();
    let arg = blkstack_mapped::DevArg {
        name: "meta".into(),
        minor: 0,
        dev: reg.get("meta").unwrap(),
    };
    let mut md = PoolMetadata::open(arg, SDATA_SECTORS / 128, 128).unwrap();
    for (dev, runs) in [(1, TWO_INTO_THREE_RUNS), (2, MOVE_RIGHT_RUNS)] {
        md.create_thin(dev).unwrap();
        for &(from, to) in runs {
            for b in from..to {
                let data = md.alloc_data_block().unwrap();
                md.insert_block(dev, b, data).unwrap();
            }
        }
    }
    md.commit().unwrap();
    drop(md);
    reg.remove_all();
    std::fs::copy(&meta, p("smeta")).unwrap();
    let pat = pattern();
    let reg = pool_reg_sized(&p("smeta-b"), &p("sdata-b"), SDATA_SECTORS);
    let mut out = vec![status_args(&reg, "pool")];
    for (dev, b) in [(1, TWO_INTO_THREE), (2, MOVE_RIGHT)] {
        let name = format!("st{dev}");
        reg.create(&name, &format!("0 {STHIN_SECTORS} thin pool {dev}"))
            .unwrap();
        let t = reg.device(&name).unwrap();
        dev_write(&*t, &pat, &[(65536, 1, b as usize)]);
        assert_eq!(submit_and_wait(&*t, Op::Flush, 0, 0, &mut []), Status::Ok);
        out.push(status_args(&reg, "pool"));
    }
    reg.remove_all();
    out.join("\n")
}

/// The superblock's roots (held metadata snapshot, data and metadata
/// space maps, mapping and details trees: bytes 56..336), which name
/// the blocks each side chose.
fn superblock_roots(meta: &Path) -> Vec<u8> {
    let b = std::fs::read(meta).unwrap();
    b[56..336].to_vec()
}

/// The steps after the writes, each a message committed at once: two
/// snapshots of thin 2 count its mapping tree's root three times (the
/// reference count tree takes it), deleting thin 2 takes it back to 2.
const ORDER_MESSAGES: &[&str] = &[
    "create_thin 3",
    "create_snap 4 2",
    "create_snap 5 2",
    "delete 2",
    "set_transaction_id 0 1",
    "reserve_metadata_snap",
];

/// Blocks of thin 2 written one after the other from block 100 after
/// the small writes: its mapping tree's leaves fill and make room as
/// dm-btree.c does (entries moved to the left sibling, then a split in
/// two), which the used metadata blocks show.
const MANY: usize = 500;

fn order_messages(pool: &str) -> String {
    ORDER_MESSAGES
        .iter()
        .map(|m| format!("dmsetup message {pool} 0 {m} || fail '{m}'\nst {pool}\n"))
        .collect()
}

/// The status after each of [`ORDER_MESSAGES`] on the pool of `reg`.
fn messages_here(reg: &Registry, out: &mut Vec<String>) {
    for m in ORDER_MESSAGES {
        let args: Vec<&str> = m.split_whitespace().collect();
        reg.message("pool", 0, &args).unwrap();
        out.push(status_args(reg, "pool"));
    }
}

/// [`ORDER_GUEST`]'s steps here: the pool's status after each (`order`
/// and `held`); `hmeta`/`hdata` get the pool as it was after the writes.
fn order_here(p: &dyn Fn(&str) -> std::path::PathBuf) -> (String, String) {
    let reg = pool_reg(&p("ometa-b"), &p("odata-b"));
    let pat = pattern();
    let msg = |m: &str| {
        let args: Vec<&str> = m.split_whitespace().collect();
        reg.message("pool", 0, &args).unwrap();
    };
    let write = |name: &str, count: usize, seek: usize| {
        let dev = reg.device(name).unwrap();
        dev_write(&*dev, &pat, &[(65536, count, seek)]);
        let st = submit_and_wait(&*dev, Op::Flush, 0, 0, &mut []);
        assert_eq!(st, Status::Ok, "flush of {name}");
    };
    let mut out = vec![status_args(&reg, "pool")];
    msg("create_thin 1");
    out.push(status_args(&reg, "pool"));
    reg.create("t1", &format!("0 {THIN_SECTORS} thin pool 1"))
        .unwrap();
    write("t1", 16, 0);
    out.push(status_args(&reg, "pool"));
    msg("create_snap 2 1");
    out.push(status_args(&reg, "pool"));
    reg.create("t2", &format!("0 {THIN_SECTORS} thin pool 2"))
        .unwrap();
    write("t1", 2, 4);
    out.push(status_args(&reg, "pool"));
    write("t2", 2, 20);
    out.push(status_args(&reg, "pool"));
    let t2 = reg.device("t2").unwrap();
    let mut zero = vec![0u8; 65536];
    for k in 0..MANY {
        let at = (100 + k) as u64 * 65536;
        let st = submit_and_wait(&*t2, Op::Write, at, 65536, &mut zero);
        assert_eq!(st, Status::Ok, "write of t2's block {}", 100 + k);
    }
    let st = submit_and_wait(&*t2, Op::Flush, 0, 0, &mut []);
    assert_eq!(st, Status::Ok, "flush of t2");
    drop(t2);
    out.push(status_args(&reg, "pool"));
    reg.remove("t1", false).unwrap();
    reg.remove("t2", false).unwrap();
    // The pool as it is now, for the guest's `held` steps and ours.
    for (from, to) in [("ometa-b", "hmeta"), ("odata-b", "hdata")] {
        std::fs::copy(p(from), p(to)).unwrap();
    }
    messages_here(&reg, &mut out);
    reg.remove_all();
    for (from, to) in [("hmeta", "hmeta-b"), ("hdata", "hdata-b")] {
        std::fs::copy(p(from), p(to)).unwrap();
    }
    let reg = pool_reg(&p("hmeta-b"), &p("hdata-b"));
    let mut held = vec![status_args(&reg, "pool")];
    messages_here(&reg, &mut held);
    reg.remove_all();
    (out.join("\n"), held.join("\n"))
}

/// The used metadata blocks and the held block of each status line.
fn used_and_held(status: &str) -> Vec<(String, String)> {
    status
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let get = |i: usize| f.get(i).copied().unwrap_or_default().to_string();
            (get(1), get(3))
        })
        .collect()
}

#[test]
fn the_kernel_and_blkstack_allocate_metadata_blocks_alike() {
    if !vm_available() {
        return;
    }
    let scratch = scratch_with_disks(&[
        ("ometa", META_SECTORS),
        ("odata", DATA_SECTORS),
        ("ometa-b", META_SECTORS),
        ("odata-b", DATA_SECTORS),
        ("gmeta", GBIG_SECTORS),
        ("gdata", GDATA_SECTORS),
        ("gmeta-b", GBIG_SECTORS),
        ("gdata-b", GDATA_SECTORS),
        ("smeta-b", META_SECTORS),
        ("sdata-b", SDATA_SECTORS),
        ("sdata", SDATA_SECTORS),
    ]);
    let p = |n: &str| scratch.path().join(n);
    let (ours, ours_held) = order_here(&p);
    let ours_grown = grown_here(&p);
    let ours_split = split_here(&p);
    thin_check(&p("ometa-b"));
    thin_check(&p("smeta-b"));
    thin_check(&p("hmeta-b"));
    thin_check(&p("gmeta-b"));
    let script = ORDER_GUEST
        .replace("DATA", &DATA_SECTORS.to_string())
        .replace("THIN", &THIN_SECTORS.to_string())
        .replace("MANY", &MANY.to_string())
        .replace("GSECTORS", &GDATA_SECTORS.to_string())
        .replace("GSMALL", &GSMALL_SECTORS.to_string())
        .replace("GBIG", &GBIG_SECTORS.to_string())
        .replace("SSECTORS", &SDATA_SECTORS.to_string())
        .replace("SLEN", &STHIN_SECTORS.to_string())
        .replace("TWO_INTO_THREE", &TWO_INTO_THREE.to_string())
        .replace("MOVE_RIGHT", &MOVE_RIGHT.to_string())
        .replace("MESSAGES opool\n", &order_messages("opool"))
        .replace("MESSAGES hpool\n", &order_messages("hpool"));
    let run = Vm::new()
        .disk("ometa", &p("ometa").display().to_string())
        .disk("odata", &p("odata").display().to_string())
        .disk("hmeta", &p("hmeta").display().to_string())
        .disk("hdata", &p("hdata").display().to_string())
        .disk("gmeta", &p("gmeta").display().to_string())
        .disk("gdata", &p("gdata").display().to_string())
        .disk("smeta", &p("smeta").display().to_string())
        .disk("sdata", &p("sdata").display().to_string())
        .file(&p("pattern"), "/test/pattern")
        .timeout(300)
        .run(&script);
    println!("{}", run.out);
    run.assert_ok("the kernel's dm-thin-pool through issue 39's steps");
    assert!(run.out.contains("DONE"), "{}", run.out);
    // Both sides' metadata, kept to compare block by block when they differ.
    if let Ok(dir) = std::env::var("KERNEL_THIN_ORDER_KEEP") {
        for n in [
            "ometa", "ometa-b", "hmeta", "hmeta-b", "gmeta", "gmeta-b", "smeta", "smeta-b",
        ] {
            std::fs::copy(p(n), Path::new(&dir).join(n)).unwrap();
        }
    }
    println!("blkstack's grown pool:\n{ours_grown}");
    let order = run.section("order").unwrap_or_default();
    let (k, o) = (used_and_held(order.trim()), used_and_held(&ours));
    println!("used and held, from scratch: kernel {k:?}\nblkstack {o:?}");
    assert_eq!(
        o.iter().map(|x| &x.0).collect::<Vec<_>>(),
        k.iter().map(|x| &x.0).collect::<Vec<_>>(),
        "used metadata blocks after each step from scratch: blkstack's (left), the kernel's (right)"
    );
    assert_eq!(
        ours_held,
        run.section("held").unwrap_or_default().trim(),
        "the pool's status after each message over the same metadata, the held metadata snapshot's block included: blkstack's (left), the kernel's (right)"
    );
    assert_eq!(
        superblock_roots(&p("hmeta-b")),
        superblock_roots(&p("hmeta")),
        "the superblocks' roots after the same messages over the same metadata: blkstack's (left), the kernel's (right)"
    );
    assert_eq!(
        ours_grown,
        run.section("grown").unwrap_or_default().trim(),
        "a pool of 66 data bitmaps, its metadata device grown past a bitmap: blkstack's status (left), the kernel's (right)"
    );
    thin_check(&p("gmeta"));
    assert_eq!(
        superblock_roots(&p("gmeta-b")),
        superblock_roots(&p("gmeta")),
        "the grown pool's superblock roots: blkstack's (left), the kernel's (right)"
    );
    assert_eq!(
        ours_split,
        run.section("split").unwrap_or_default().trim(),
        "a full middle leaf split two into three, a full first leaf's entries moved right: blkstack's status (left), the kernel's (right)"
    );
    thin_check(&p("smeta"));
    assert_eq!(
        superblock_roots(&p("smeta-b")),
        superblock_roots(&p("smeta")),
        "the split pool's superblock roots: blkstack's (left), the kernel's (right)"
    );
}
