//! `striped <#stripes> <chunk_size> [<dev> <offset>]...`: RAID-0 across
//! devices (kernel dm-stripe.c): its argument checks, its chunk mapping
//! (`stripe_map_sector`), a flush sent to every stripe, `max_io_len` equal
//! to the chunk so no bio crosses a chunk, and per-stripe error counts
//! shown as `A`/`D` in status.
//!
//! Polled bios pass through only when every stripe's device polls (dm's
//! `dm_table_supports_poll` asks each device), and `poll` reaps on all of
//! them, since a bio split across chunks may wait on any stripe.

use crate::error::TargetError;
use crate::split::Split;
use crate::target::{parse_arg, parse_sscanf, CtrContext, DevArg, Target, TargetRef, TargetType};
use blkstack_core::{Bio, Device, EndIo, Features, Op, Status, SECTOR_SIZE};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub const TYPE: TargetType = TargetType {
    name: "striped",
    version: [1, 6, 0],
    ctr,
};

struct Stripe {
    dev: DevArg,
    /// Start on the device, in sectors.
    physical_start: u64,
    errors: AtomicU64,
}

struct Stripes {
    stripes: Vec<Stripe>,
    /// Chunk size in sectors.
    chunk: u64,
}

pub struct StripedTarget {
    inner: Arc<Stripes>,
}

fn ctr(ctx: &mut CtrContext<'_>, args: &[&str]) -> Result<TargetRef, TargetError> {
    if args.len() < 2 {
        return Err(TargetError::invalid(
            "not enough arguments: '<#stripes> <chunk_size> [<dev> <offset>]...'",
        ));
    }
    // kstrtouint, as the kernel: a 32-bit count, a leading '+' allowed.
    let n: u64 = parse_arg::<u32>("stripe count", args[0])?.into();
    if n == 0 {
        return Err(TargetError::invalid("invalid stripe count 0"));
    }
    let chunk: u64 = parse_arg::<u32>("chunk size", args[1])?.into();
    if chunk == 0 {
        return Err(TargetError::invalid("invalid chunk size 0"));
    }
    if !ctx.len.is_multiple_of(n) {
        return Err(TargetError::invalid(format!(
            "target length {} is not divisible by the number of stripes {n}",
            ctx.len
        )));
    }
    let width = ctx.len / n;
    if !width.is_multiple_of(chunk) {
        return Err(TargetError::invalid(format!(
            "target length {} is not divisible by chunk size {chunk} times {n} stripes",
            ctx.len
        )));
    }
    if args.len() as u64 != 2 + 2 * n {
        return Err(TargetError::invalid(format!(
            "{n} stripes need {} device arguments ('<dev> <offset>' each), got {}",
            2 * n,
            args.len() - 2
        )));
    }
    let mut stripes = Vec::with_capacity(n as usize);
    for i in 0..n as usize {
        let start: u64 = parse_sscanf(&format!("offset of stripe {i}"), args[3 + 2 * i])?;
        let dev = ctx
            .get_device(args[2 + 2 * i], start, width)
            .map_err(|e| e.within(format!("stripe {i}")))?;
        stripes.push(Stripe {
            dev,
            physical_start: start,
            errors: AtomicU64::new(0),
        });
    }
    Ok(Arc::new(StripedTarget {
        inner: Arc::new(Stripes { stripes, chunk }),
    }))
}

impl Stripes {
    /// Kernel `stripe_map_sector`: (stripe index, sector on that stripe).
    fn map_sector(&self, sector: u64) -> (usize, u64) {
        let n = self.stripes.len() as u64;
        let chunk = sector / self.chunk;
        let chunk_offset = sector % self.chunk;
        let stripe = (chunk % n) as usize;
        let chunk_on_stripe = chunk / n;
        (stripe, chunk_on_stripe * self.chunk + chunk_offset)
    }

    fn submit_to(self: &Arc<Self>, stripe: usize, mut bio: Bio, sector_on_stripe: u64) {
        let s = &self.stripes[stripe];
        bio.push_end(self.clone(), stripe as u64);
        bio.offset = (s.physical_start + sector_on_stripe) * SECTOR_SIZE;
        s.dev.dev.submit(bio);
    }
}

impl EndIo for Stripes {
    fn end_io(&self, bio: Bio, status: Status, stripe: u64) {
        if !status.is_ok() && status != Status::NotSupported {
            if let Some(s) = self.stripes.get(stripe as usize) {
                s.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        bio.complete(status);
    }
}

impl Target for StripedTarget {
    fn map(&self, bio: Bio) {
        let inner = &self.inner;
        if bio.op == Op::Flush {
            let pieces = vec![(0, 0); inner.stripes.len()];
            Split::run(bio, &pieces, |i, child| inner.submit_to(i, child, 0));
            return;
        }
        let (stripe, sector) = inner.map_sector(bio.offset / SECTOR_SIZE);
        let within = bio.offset % SECTOR_SIZE;
        debug_assert_eq!(within, 0);
        inner.submit_to(stripe, bio, sector);
    }

    fn max_io_len(&self, offset: u64) -> u64 {
        let chunk_bytes = self.inner.chunk * SECTOR_SIZE;
        chunk_bytes - offset % chunk_bytes
    }

    fn table(&self) -> String {
        let mut s = format!("{} {}", self.inner.stripes.len(), self.inner.chunk);
        for st in &self.inner.stripes {
            s.push_str(&format!(" {} {}", st.dev, st.physical_start));
        }
        s
    }

    /// dm-stripe: `<#stripes> <dev>... 1 <A|D per stripe>`.
    fn status(&self) -> String {
        let mut s = format!("{} ", self.inner.stripes.len());
        for st in &self.inner.stripes {
            s.push_str(&format!("{} ", st.dev));
        }
        s.push_str("1 ");
        for st in &self.inner.stripes {
            s.push(if st.errors.load(Ordering::Relaxed) > 0 {
                'D'
            } else {
                'A'
            });
        }
        s
    }

    fn poll_devices<'a>(&'a self, f: &mut dyn FnMut(&'a dyn Device)) {
        for s in self.inner.stripes.iter() {
            f(&*s.dev.dev);
        }
    }

    fn features(&self) -> Features {
        let mut it = self.inner.stripes.iter().map(|s| s.dev.dev.features());
        let first = it.next().unwrap_or_default();
        let mut f = it.fold(first, Features::intersect);
        // Holes would need per-chunk translation; not advertised.
        f.knows_holes = false;
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stripes(n: usize, chunk: u64) -> Stripes {
        let reg = crate::Registry::new();
        reg.create("z", "0 1000000 zero").unwrap();
        let dev = reg.get("z").unwrap();
        Stripes {
            stripes: (0..n)
                .map(|_| Stripe {
                    dev: DevArg {
                        name: "z".into(),
                        minor: 0,
                        dev: dev.clone(),
                    },
                    physical_start: 0,
                    errors: AtomicU64::new(0),
                })
                .collect(),
            chunk,
        }
    }

    #[test]
    fn map_sector_follows_dm_stripe() {
        let s = stripes(3, 8);
        assert_eq!(s.map_sector(0), (0, 0));
        assert_eq!(s.map_sector(7), (0, 7));
        assert_eq!(s.map_sector(8), (1, 0));
        assert_eq!(s.map_sector(16), (2, 0));
        assert_eq!(s.map_sector(24), (0, 8));
        assert_eq!(s.map_sector(24 + 5), (0, 13));
    }
}
