//! Property: what `table` prints parses back into the same table. Tables
//! are generated over every basic target with random geometry; each is
//! created, printed, created again from the printed text and printed again.
//! Multipath lines carry a random set of dm's and blkstack's features (the
//! path checker's among them), which must print back as they parse.

use blkstack_mapped::Registry;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Line {
    Zero,
    Error,
    Null(Vec<String>),
    Memory,
    Linear {
        dev: usize,
        off: u64,
    },
    Striped {
        n: u64,
        chunk: u64,
        devs: Vec<(usize, u64)>,
    },
    Multipath {
        features: Vec<&'static str>,
        devs: Vec<usize>,
    },
}

/// Multipath features that may appear together in one table.
const MPATH_FEATURES: [&str; 6] = [
    "queue_if_no_path",
    "pg_init_retries 3",
    "start_time jiffies:250",
    "checker_interval 60000",
    "checker_timeout 30000",
    "no_path_retry queue",
];

fn line_strategy() -> impl Strategy<Value = (u64, Line)> {
    prop_oneof![
        (1u64..5000).prop_map(|len| (len, Line::Zero)),
        (1u64..5000).prop_map(|len| (len, Line::Error)),
        (
            1u64..5000,
            proptest::sample::subsequence(vec!["bs=512", "bs=4096"], 0..=1)
        )
            .prop_map(|(len, a)| (
                len * 8,
                Line::Null(a.into_iter().map(String::from).collect())
            )),
        (1u64..5000).prop_map(|len| (len, Line::Memory)),
        (1u64..2000, 0usize..3, 0u64..2000)
            .prop_map(|(len, dev, off)| (len, Line::Linear { dev, off })),
        (
            1u64..4,
            0u32..5,
            1u64..20,
            proptest::collection::vec((0usize..3, 0u64..1000), 4)
        )
            .prop_map(|(n, cshift, chunks, devs)| {
                let chunk = 8u64 << cshift;
                let len = n * chunk * chunks;
                (
                    len,
                    Line::Striped {
                        n,
                        chunk,
                        devs: devs.into_iter().take(n as usize).collect(),
                    },
                )
            }),
        (
            1u64..2000,
            proptest::sample::subsequence(MPATH_FEATURES.to_vec(), 0..=MPATH_FEATURES.len()),
            proptest::collection::vec(0usize..3, 1..=3)
        )
            .prop_map(|(len, features, devs)| (len, Line::Multipath { features, devs })),
    ]
}

fn render(lines: &[(u64, Line)], names: &[&str]) -> String {
    let mut start = 0;
    let mut s = String::new();
    for (len, l) in lines {
        let args = match l {
            Line::Zero => "zero".to_string(),
            Line::Error => "error".to_string(),
            Line::Null(a) => format!("null {}", a.join(" ")),
            Line::Memory => "memory".to_string(),
            Line::Linear { dev, off } => format!("linear {} {off}", names[*dev]),
            Line::Striped { n, chunk, devs } => {
                let mut s = format!("striped {n} {chunk}");
                for (d, o) in devs {
                    s.push_str(&format!(" /dev/mapper/{} {o}", names[*d]));
                }
                s
            }
            Line::Multipath { features, devs } => {
                let words: usize = features.iter().map(|f| f.split(' ').count()).sum();
                let mut s = format!("multipath {words}");
                for f in features {
                    s.push_str(&format!(" {f}"));
                }
                s.push_str(&format!(" 0 1 1 round-robin 0 {} 0", devs.len()));
                for d in devs {
                    s.push_str(&format!(" {}", names[*d]));
                }
                s
            }
        };
        s.push_str(&format!("{start} {len} {args}\n"));
        start += len;
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn table_output_round_trips(lines in proptest::collection::vec(line_strategy(), 1..6)) {
        let reg = Registry::new();
        let names = ["base0", "base1", "base2"];
        for n in names {
            reg.create(n, "0 100000 memory").unwrap();
        }
        // Multipath is a singleton target (dm-table.c): alone in a table.
        let lines: Vec<(u64, Line)> = if lines.len() > 1 {
            lines
                .into_iter()
                .map(|(len, l)| match l {
                    Line::Multipath { .. } => (len, Line::Zero),
                    l => (len, l),
                })
                .collect()
        } else {
            lines
        };
        let text = render(&lines, &names);
        reg.create("t", &text).unwrap();
        let printed = reg.table_text("t").unwrap();
        reg.create("t2", &printed).unwrap();
        let printed2 = reg.table_text("t2").unwrap();
        prop_assert_eq!(&printed, &printed2);
        // And the printed table describes the same geometry.
        prop_assert_eq!(printed.lines().count(), lines.len());
        let info = reg.info("t").unwrap();
        prop_assert_eq!(info.size_bytes, lines.iter().map(|(l, _)| l * 512).sum::<u64>());
    }
}
