//! What a job's writes carry when it does not verify: fio's buffer options
//! (`buffer_pattern`, `zero_buffers`, `refill_buffers`, `scramble_buffers`,
//! `buffer_compress_percentage`, `dedupe_percentage`, `dedupe_mode`).
//!
//! As in fio (`io_u.c` `fill_io_buffer`), buffers are filled once when the
//! job starts (random bytes unless a pattern or zeroes are asked for) and
//! refilled before every write only with `refill_buffers` or a dedupe
//! percentage; `scramble_buffers` (fio's default) stamps each write's first
//! bytes with its offset so a deduplicating device cannot fold them. A
//! deduplicated write reuses the seed of an earlier buffer (from a working
//! set of `dedupe_working_set_percentage` of the region with
//! `dedupe_mode=working_set`, else the previous one), so its bytes are
//! identical; the compressible percentage of each chunk is zeroes.

use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

/// How deduplicated buffers are chosen (fio `dedupe_mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DedupeMode {
    #[default]
    Repeat,
    WorkingSet,
}

/// The buffer options of one job.
#[derive(Clone, Debug, PartialEq)]
pub struct BufferSpec {
    pub pattern: Vec<u8>,
    pub zero: bool,
    pub refill: bool,
    pub scramble: bool,
    pub compress_pct: u32,
    /// Chunk the compress percentage applies to (0: the whole buffer).
    pub compress_chunk: u64,
    pub dedupe_pct: u32,
    pub dedupe_mode: DedupeMode,
    pub dedupe_working_set_pct: u32,
}

impl Default for BufferSpec {
    fn default() -> Self {
        BufferSpec {
            pattern: Vec::new(),
            zero: false,
            refill: false,
            scramble: true,
            compress_pct: 0,
            compress_chunk: 0,
            dedupe_pct: 0,
            dedupe_mode: DedupeMode::Repeat,
            dedupe_working_set_pct: 5,
        }
    }
}

/// Per-thread buffer filler.
pub(crate) struct BufferFiller {
    spec: BufferSpec,
    rng: SmallRng,
    last_seed: u64,
    working_set: Vec<u64>,
}

impl BufferFiller {
    pub fn new(spec: &BufferSpec, seed: u64, region_blocks: u64) -> BufferFiller {
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x6275_6666);
        let ws = if spec.dedupe_mode == DedupeMode::WorkingSet {
            let n = (region_blocks * spec.dedupe_working_set_pct as u64 / 100).clamp(1, 4096);
            (0..n).map(|_| rng.next_u64()).collect()
        } else {
            Vec::new()
        };
        BufferFiller {
            spec: spec.clone(),
            last_seed: rng.next_u64(),
            rng,
            working_set: ws,
        }
    }

    /// Must every write get fresh contents?
    pub fn per_write(&self) -> bool {
        self.spec.refill || self.spec.dedupe_pct > 0
    }

    /// Fill a buffer (at start, and before each write when `per_write`).
    pub fn fill(&mut self, buf: &mut [u8]) {
        if !self.spec.pattern.is_empty() {
            let p = &self.spec.pattern;
            for (i, b) in buf.iter_mut().enumerate() {
                *b = p[i % p.len()];
            }
            return;
        }
        if self.spec.zero {
            buf.fill(0);
            return;
        }
        let dedupe = self.spec.dedupe_pct > 0 && self.rng.gen_range(0..100) < self.spec.dedupe_pct;
        let seed = match (dedupe, self.working_set.is_empty()) {
            (true, false) => self.working_set[self.rng.gen_range(0..self.working_set.len())],
            (true, true) => self.last_seed,
            (false, _) => self.rng.next_u64(),
        };
        self.last_seed = seed;
        SmallRng::seed_from_u64(seed).fill_bytes(buf);
        if self.spec.compress_pct > 0 {
            let chunk = match self.spec.compress_chunk {
                0 => buf.len(),
                c => c as usize,
            };
            for c in buf.chunks_mut(chunk.max(1)) {
                let zeros = c.len() * self.spec.compress_pct.min(100) as usize / 100;
                c[..zeros].fill(0);
            }
        }
    }

    /// fio's `scramble_buffers`: make a reused buffer unique per write.
    pub fn scramble(&self, buf: &mut [u8], offset: u64) {
        if self.spec.scramble && self.spec.pattern.is_empty() && !self.spec.zero && buf.len() >= 8 {
            buf[..8].copy_from_slice(&offset.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_zeroes_compression_and_dedupe() {
        let mut b = vec![0u8; 4096];
        let spec = BufferSpec {
            pattern: vec![0xde, 0xad],
            ..BufferSpec::default()
        };
        BufferFiller::new(&spec, 1, 100).fill(&mut b);
        assert!(b.chunks(2).all(|c| c == [0xde, 0xad]));
        let spec = BufferSpec {
            compress_pct: 50,
            ..BufferSpec::default()
        };
        BufferFiller::new(&spec, 1, 100).fill(&mut b);
        assert!(b[..2048].iter().all(|&x| x == 0));
        assert!(b[2048..].iter().any(|&x| x != 0));
        let spec = BufferSpec {
            dedupe_pct: 100,
            ..BufferSpec::default()
        };
        let mut f = BufferFiller::new(&spec, 1, 100);
        let mut a = vec![0u8; 512];
        f.fill(&mut a);
        f.fill(&mut b[..512]);
        assert_eq!(a, b[..512], "100% dedupe repeats the buffer");
    }
}
