//! The era superblock's bytes where `struct superblock_disk` has them,
//! and the era array a digest leaves against a model of the writes.

use super::*;

fn memory_dev() -> DeviceRef {
    let reg = crate::Registry::new();
    reg.create("meta", "0 8192 memory")
        .expect("a memory device")
}

#[test]
fn the_superblock_is_laid_out_as_the_kernels() {
    let sb = Superblock {
        metadata_sm: SmRoot {
            nr_blocks: 1024,
            nr_allocated: 9,
            bitmap_root: 3,
            ref_count_root: 4,
        },
        data_block_size: 128,
        nr_blocks: 256,
        current_era: 7,
        current_writeset: Writeset {
            nr_bits: 256,
            root: 12,
        },
        writeset_tree_root: 13,
        era_array_root: 14,
        metadata_snap: 0,
    };
    let b = sb.encode(0);
    assert_eq!(le64(&b, 32), 2126579579);
    assert_eq!(le32(&b, 40), 1);
    assert_eq!(le64(&b, 44), 1024);
    assert_eq!(
        (le32(&b, 172), le32(&b, 176), le32(&b, 180), le32(&b, 184)),
        (128, 8, 256, 7)
    );
    assert_eq!((le32(&b, 188), le64(&b, 192)), (256, 12));
    assert_eq!((le64(&b, 200), le64(&b, 208), le64(&b, 216)), (13, 14, 0));
    assert_eq!(le32(&b, 0), !crc32c::crc32c(&b[4..]) ^ 146538381);
    assert_eq!(Superblock::decode(&b, 0), Ok(sb));
    assert!(matches!(
        Superblock::decode(&b, 1),
        Err(FormatError::Location { .. })
    ));
    let mut bad = b.clone();
    bad[300] = 1;
    assert!(matches!(
        Superblock::decode(&bad, 0),
        Err(FormatError::Checksum { .. })
    ));
}

#[test]
fn digesting_fills_the_era_array_with_each_blocks_last_era() {
    let dev = memory_dev();
    let mut md = EraMetadata::open(dev.clone(), 8).expect("format");
    md.resize(3000).expect("resize");
    md.rollover().expect("era 1");
    let eras: [&[u64]; 3] = [&[0, 1, 2999], &[1, 1500], &[2]];
    for blocks in eras {
        for &b in blocks {
            md.mark(b).expect("mark");
        }
        md.commit().expect("commit");
        md.rollover().expect("next era");
    }
    while md.digest_step().expect("digest") {}
    md.commit().expect("commit");
    let mut want = vec![0u32; 3000];
    for (i, blocks) in eras.iter().enumerate() {
        for &b in *blocks {
            want[b as usize] = i as u32 + 1;
        }
    }
    let mut got = Vec::new();
    let root = md.era_array_root;
    array::walk::<Le32>(&mut md.tm, root, 3000, &mut |_, v| got.push(v)).expect("walk");
    assert_eq!(got, want);
    assert_eq!(
        btree::first_key_from(&mut md.tm, md.writeset_tree_root, 0).expect("tree"),
        None,
        "every archived writeset digested"
    );
    let era = md.current_era();
    drop(md);
    let md = EraMetadata::open(dev, 8).expect("reopen");
    assert_eq!((md.current_era(), md.nr_blocks()), (era, 3000));
    assert!(EraMetadata::open(memory_dev(), 8).is_ok());
}
