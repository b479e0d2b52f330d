//! The single-thread throughput of the cipher crates themselves (`aes` +
//! `xts-mode`, AES-256-XTS over 512-byte and 4 KiB data units, in place),
//! next to blkstack's crypt sector loop over the same buffer: the
//! physical limit the in-process crypt benchmark row is set against
//! (scripts/bench-crypt.sh runs this). `cargo bench -p blkstack-mapped
//! --bench crypt`.

use aes::cipher::KeyInit;
use aes::Aes256;
use blkstack_mapped::targets::crypt::cipher::{parse, Keyed};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use xts_mode::{get_tweak_default, Xts128};

const LEN: usize = 1 << 20;

fn bench(c: &mut Criterion) {
    let key = [7u8; 64];
    let mut g = c.benchmark_group("aes-256-xts 1 MiB");
    g.throughput(Throughput::Bytes(LEN as u64));
    let mut buf = vec![0x5au8; LEN];
    for unit in [512usize, 4096] {
        let xts = Xts128::new(
            Aes256::new_from_slice(&key[..32]).unwrap(),
            Aes256::new_from_slice(&key[32..]).unwrap(),
        );
        g.bench_function(format!("xts-mode crate, {unit}-byte units"), |b| {
            b.iter(|| xts.encrypt_area(&mut buf, unit, 0, get_tweak_default))
        });
        let k = Keyed::new(&parse("aes-xts-plain64").unwrap(), &key).unwrap();
        g.bench_function(format!("blkstack crypt, {unit}-byte sectors"), |b| {
            b.iter(|| k.encrypt(&mut buf, unit, 0, (unit / 512) as u64))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
