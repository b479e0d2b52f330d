//! The mapping cache against the btrees it caches: random inserts,
//! discards, snapshots and deletions, each lookup answered by the cached metadata
//! compared with a model and, after a commit, with metadata reopened from
//! the device (whose cache starts empty, so the btrees answer).

use super::*;
use crate::target::DevArg;
use proptest::prelude::*;

fn metadata_dev() -> DevArg {
    let reg = crate::Registry::new();
    reg.create("meta", "0 65536 memory")
        .expect("a memory device");
    DevArg {
        name: "meta".into(),
        minor: 0,
        dev: reg.get("meta").expect("the device"),
    }
}

#[derive(Clone, Debug)]
enum Step {
    Insert { dev: u64, vblock: u64 },
    Lookup { dev: u64, vblock: u64 },
    Snap { dev: u64, origin: u64 },
    Delete { dev: u64 },
    Discard { dev: u64, begin: u64, len: u64 },
    Commit,
}

fn step() -> impl Strategy<Value = Step> {
    // Few devices and a few pages of blocks, so steps meet each other.
    let dev = 0u64..4;
    let vblock = prop_oneof![0u64..1200, 1_000_000u64..1_000_600];
    prop_oneof![
        6 => (dev.clone(), vblock.clone()).prop_map(|(dev, vblock)| Step::Insert { dev, vblock }),
        6 => (dev.clone(), vblock).prop_map(|(dev, vblock)| Step::Lookup { dev, vblock }),
        1 => (dev.clone(), dev.clone()).prop_map(|(dev, origin)| Step::Snap { dev, origin }),
        1 => dev.clone().prop_map(|dev| Step::Delete { dev }),
        2 => (dev, 0u64..1200, 1u64..700).prop_map(|(dev, begin, len)| Step::Discard { dev, begin, len }),
        1 => Just(Step::Commit),
    ]
}

type Model = BTreeMap<u64, BTreeMap<u64, u64>>;

fn check_all(md: &mut PoolMetadata, model: &Model) {
    for (&dev, blocks) in model {
        for vblock in (0..1200).chain(1_000_000..1_000_600) {
            let got = md.find_block(dev, vblock).expect("lookup");
            assert_eq!(
                got.map(|l| l.data_block),
                blocks.get(&vblock).copied(),
                "dev {dev} block {vblock}"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn cached_lookups_match_the_btrees(steps in proptest::collection::vec(step(), 1..400)) {
        let dev = metadata_dev();
        let mut md = PoolMetadata::open(dev.clone(), 1 << 20, 128).expect("format");
        let mut model = Model::new();
        for dev_id in 0..2 {
            md.create_thin(dev_id).expect("create");
            model.insert(dev_id, BTreeMap::new());
        }
        for s in steps {
            match s {
                Step::Insert { dev, vblock } => {
                    let Some(map) = model.get_mut(&dev) else { continue };
                    let b = md.alloc_data_block().expect("space");
                    md.insert_block(dev, vblock, b).expect("insert");
                    map.insert(vblock, b);
                }
                Step::Lookup { dev, vblock } => {
                    let got = md.find_block(dev, vblock);
                    match model.get(&dev) {
                        Some(map) => prop_assert_eq!(
                            got.expect("lookup").map(|l| l.data_block),
                            map.get(&vblock).copied()
                        ),
                        None => prop_assert!(got.is_err()),
                    }
                }
                Step::Snap { dev, origin } => {
                    if model.contains_key(&dev) || !model.contains_key(&origin) {
                        continue;
                    }
                    md.create_snap(dev, origin).expect("snap");
                    let copy = model[&origin].clone();
                    model.insert(dev, copy);
                }
                Step::Delete { dev } => {
                    if model.remove(&dev).is_some() {
                        md.delete(dev).expect("delete");
                    }
                }
                Step::Discard { dev, begin, len } => {
                    let Some(map) = model.get_mut(&dev) else { continue };
                    md.remove_range(dev, begin, begin + len).expect("discard");
                    map.retain(|&k, _| !(begin..begin + len).contains(&k));
                }
                Step::Commit => md.commit().expect("commit"),
            }
        }
        check_all(&mut md, &model);
        md.commit().expect("commit");
        let mut reopened = PoolMetadata::open(dev, 1 << 20, 128).expect("reopen");
        check_all(&mut reopened, &model);
    }
}
