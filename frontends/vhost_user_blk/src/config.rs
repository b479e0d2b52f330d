//! The virtio-blk configuration space (`struct virtio_blk_config`, virtio
//! 1.2 section 5.2.4; the guest's reader is drivers/block/virtio_blk.c
//! `virtblk_probe` / `virtblk_update_capacity`) and the feature bits, from
//! the stack's geometry: capacity, block sizes, segment and size limits,
//! discard and write-zeroes limits, flush, read-only, queues.
//! Written by hand: the layout is a fixed little-endian record, and
//! virtio-bindings gives the feature numbers, not a serialiser.

use virtio_bindings::virtio_blk::*;

/// Size of the config record we fill (up to `write_zeroes_may_unmap` and
/// its padding; the secure-erase and zoned fields after it are not
/// offered).
pub const CONFIG_LEN: usize = 60;
/// Most segments per request the guest may send (its `max_segments`).
pub const SEG_MAX: u32 = 128;

/// What the config and the features are made from.
#[derive(Clone, Copy, Debug)]
pub struct BlkGeometry {
    pub size: u64,
    pub logical_block_size: u32,
    pub physical_block_size: u32,
    /// Largest request in bytes.
    pub max_io_bytes: u64,
    pub features: blkstack_core::Features,
    pub read_only: bool,
    pub num_queues: u16,
}

impl BlkGeometry {
    pub fn of(dev: &dyn blkstack_core::Device, read_only: bool, num_queues: u16) -> BlkGeometry {
        BlkGeometry {
            size: dev.size(),
            logical_block_size: dev.logical_block_size(),
            physical_block_size: dev.physical_block_size().max(dev.logical_block_size()),
            max_io_bytes: dev.max_io_bytes(),
            features: dev.features(),
            read_only: read_only || dev.features().read_only,
            num_queues,
        }
    }

    /// Discard alignment: the device's granularity (a thin device's
    /// pool block), else its physical block.
    fn discard_granularity(&self) -> u32 {
        match self.features.discard_granularity {
            0 => self.physical_block_size,
            g => g,
        }
    }

    fn writable(&self) -> bool {
        !self.read_only
    }

    /// The virtio-blk feature bits offered (device part only).
    pub fn device_features(&self) -> u64 {
        let mut f = 1u64 << VIRTIO_BLK_F_SIZE_MAX
            | 1 << VIRTIO_BLK_F_SEG_MAX
            | 1 << VIRTIO_BLK_F_BLK_SIZE
            | 1 << VIRTIO_BLK_F_TOPOLOGY
            | 1 << VIRTIO_BLK_F_MQ;
        if self.features.flush {
            f |= 1 << VIRTIO_BLK_F_FLUSH;
        }
        if self.read_only {
            f |= 1 << VIRTIO_BLK_F_RO;
        }
        if self.writable() && self.features.discard {
            f |= 1 << VIRTIO_BLK_F_DISCARD;
        }
        if self.writable() && self.features.write_zeroes {
            f |= 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
        f
    }

    /// Largest request, in whole logical blocks, in 512-byte sectors.
    pub fn max_sectors(&self) -> u32 {
        let lbs = self.logical_block_size.max(512) as u64;
        let m = self.max_io_bytes.min(u32::MAX as u64 & !(lbs - 1));
        ((m - m % lbs) >> 9) as u32
    }

    /// The config record, little-endian.
    pub fn config(&self) -> [u8; CONFIG_LEN] {
        let mut c = [0u8; CONFIG_LEN];
        let put = |c: &mut [u8; CONFIG_LEN], off: usize, v: &[u8]| {
            c[off..off + v.len()].copy_from_slice(v)
        };
        put(&mut c, 0, &(self.size >> 9).to_le_bytes());
        // size_max bounds one segment; the request bound is seg_max of them.
        put(
            &mut c,
            8,
            &(self.max_sectors().saturating_mul(512).min(1 << 20)).to_le_bytes(),
        );
        put(&mut c, 12, &SEG_MAX.to_le_bytes());
        put(&mut c, 20, &self.logical_block_size.to_le_bytes());
        let exp = (self.physical_block_size / self.logical_block_size.max(1))
            .max(1)
            .trailing_zeros() as u8;
        c[24] = exp;
        put(
            &mut c,
            26,
            &((self.physical_block_size / self.logical_block_size.max(1)) as u16).to_le_bytes(),
        );
        put(&mut c, 28, &0u32.to_le_bytes());
        c[32] = u8::from(self.features.flush);
        put(&mut c, 34, &self.num_queues.to_le_bytes());
        let sectors = self.max_sectors();
        if self.writable() && self.features.discard {
            put(&mut c, 36, &sectors.to_le_bytes());
            put(&mut c, 40, &1u32.to_le_bytes());
            put(
                &mut c,
                44,
                &(self.discard_granularity() >> 9).max(1).to_le_bytes(),
            );
        }
        if self.writable() && self.features.write_zeroes {
            put(&mut c, 48, &sectors.to_le_bytes());
            put(&mut c, 52, &1u32.to_le_bytes());
            c[56] = u8::from(self.features.discard);
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkstack_core::Features;

    fn geo(read_only: bool) -> BlkGeometry {
        BlkGeometry {
            size: 64 << 20,
            logical_block_size: 512,
            physical_block_size: 4096,
            max_io_bytes: 1 << 20,
            features: Features {
                discard: true,
                write_zeroes: true,
                ..Features::default()
            },
            read_only,
            num_queues: 2,
        }
    }

    fn u32_at(c: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(c[off..off + 4].try_into().unwrap())
    }

    #[test]
    fn config_holds_the_stack_geometry() {
        let c = geo(false).config();
        assert_eq!(
            u64::from_le_bytes(c[0..8].try_into().unwrap()),
            (64 << 20) >> 9
        );
        assert_eq!(u32_at(&c, 12), SEG_MAX);
        assert_eq!(u32_at(&c, 20), 512);
        assert_eq!(
            c[24], 3,
            "4096-byte physical blocks over 512-byte logical ones"
        );
        assert_eq!(c[32], 1, "writeback cache");
        assert_eq!(u16::from_le_bytes([c[34], c[35]]), 2);
        assert_eq!(u32_at(&c, 36), 2048, "max discard sectors: 1 MiB");
        assert_eq!(u32_at(&c, 48), 2048, "max write-zeroes sectors");
        assert_eq!(u32_at(&c, 44), 8, "discard alignment: a physical block");
        let mut thin = geo(false);
        thin.features.discard_granularity = 65536;
        assert_eq!(u32_at(&thin.config(), 44), 128, "a thin pool's block");
        let f = geo(false).device_features();
        for bit in [
            VIRTIO_BLK_F_FLUSH,
            VIRTIO_BLK_F_DISCARD,
            VIRTIO_BLK_F_WRITE_ZEROES,
            VIRTIO_BLK_F_MQ,
        ] {
            assert_ne!(f & (1 << bit), 0, "feature {bit}");
        }
        assert_eq!(f & (1 << VIRTIO_BLK_F_RO), 0);
    }

    #[test]
    fn read_only_devices_offer_no_discard() {
        let g = geo(true);
        let f = g.device_features();
        assert_ne!(f & (1 << VIRTIO_BLK_F_RO), 0);
        assert_eq!(f & (1 << VIRTIO_BLK_F_DISCARD), 0);
        assert_eq!(f & (1 << VIRTIO_BLK_F_WRITE_ZEROES), 0);
        assert_eq!(u32_at(&g.config(), 36), 0);
    }
}
