//! The single-thread throughput of the cipher crates themselves, next to
//! blkstack's crypt sector loop over the same buffer (AES-256, 1 MiB in
//! place): the physical limit the in-process crypt benchmark row is set
//! against (scripts/bench-crypt.sh runs this). Rows: `aes`'s batched
//! block API alone (ECB, the ceiling of any mode over it); the
//! `xts-mode` crate (one block per cipher call); blkstack's XTS
//! (targets/crypt/xts.rs, batched) through the target's sector loop,
//! encrypting and decrypting; CBC decryption (batched by `cbc`) and
//! encryption (serial by nature). `cargo bench -p blkstack-mapped
//! --bench crypt`.

use aes::cipher::consts::U16;
use aes::cipher::inout::InOutBuf;
use aes::cipher::{BlockEncrypt, KeyInit};
use aes::Aes256;
use blkstack_mapped::targets::crypt::cipher::{parse, Keyed};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use xts_mode::{get_tweak_default, Xts128};

const LEN: usize = 1 << 20;

fn bench(c: &mut Criterion) {
    let key = [7u8; 64];
    let mut g = c.benchmark_group("aes-256 1 MiB");
    g.throughput(Throughput::Bytes(LEN as u64));
    let mut buf = vec![0x5au8; LEN];
    let aes = Aes256::new_from_slice(&key[..32]).unwrap();
    g.bench_function("aes crate encrypt_blocks (ECB ceiling)", |b| {
        b.iter(|| {
            let (mut blocks, _) = InOutBuf::from(&mut buf[..]).into_chunks::<U16>();
            aes.encrypt_blocks(blocks.get_out())
        })
    });
    let xts = Keyed::new(&parse("aes-xts-plain64").unwrap(), &key).unwrap();
    for unit in [512usize, 4096] {
        let theirs = Xts128::new(
            Aes256::new_from_slice(&key[..32]).unwrap(),
            Aes256::new_from_slice(&key[32..]).unwrap(),
        );
        let step = (unit / 512) as u64;
        g.bench_function(format!("xts-mode crate, {unit}-byte units"), |b| {
            b.iter(|| theirs.encrypt_area(&mut buf, unit, 0, get_tweak_default))
        });
        g.bench_function(format!("blkstack xts encrypt, {unit}-byte sectors"), |b| {
            b.iter(|| xts.encrypt(&mut buf, unit, 0, step))
        });
        g.bench_function(format!("blkstack xts decrypt, {unit}-byte sectors"), |b| {
            b.iter(|| xts.decrypt(&mut buf, unit, 0, step))
        });
    }
    let cbc = Keyed::new(&parse("aes-cbc-essiv:sha256").unwrap(), &key[..32]).unwrap();
    g.bench_function("blkstack cbc-essiv decrypt, 512-byte sectors", |b| {
        b.iter(|| cbc.decrypt(&mut buf, 512, 0, 1))
    });
    g.bench_function("blkstack cbc-essiv encrypt, 512-byte sectors", |b| {
        b.iter(|| cbc.encrypt(&mut buf, 512, 0, 1))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
