//! What a btree's values are (`persistent-data/dm-btree.h` `struct
//! dm_btree_value_type`): their size on disk, how they pack, and the
//! references they hold. A copy of a shared leaf holds every value once
//! more (`inc`); a value overwritten or deleted with the last node
//! holding it lets go of what it referred to (`dec`); `equal` tells an
//! insert that overwrites a value whether it changed.
//!
//! The kernel passes a `context` pointer to its hooks; here the value
//! type itself is the context (a type whose values are data blocks holds
//! the data space map it counts them in), and the hooks get the
//! transaction manager for references to metadata blocks.

use super::btree;
use super::tm::Tm;
use super::{le32, le64, PdError};

/// Values of one btree (kernel `struct dm_btree_value_type`).
pub trait ValueType {
    /// A value, unpacked.
    type Value: Copy + PartialEq + std::fmt::Debug;
    /// Bytes of a packed value (the kernel's `size`).
    const SIZE: usize;
    /// The value packed in the first [`Self::SIZE`] bytes of `b`.
    fn unpack(b: &[u8]) -> Self::Value;
    /// Pack `v` into the first [`Self::SIZE`] bytes of `out`.
    fn pack(v: &Self::Value, out: &mut [u8]);
    /// One more copy of `v` exists (a shared leaf was copied): take the
    /// reference it holds.
    fn inc(&mut self, _tm: &mut Tm, _v: &Self::Value) -> Result<(), PdError> {
        Ok(())
    }
    /// A copy of `v` is gone: drop the reference it held.
    fn dec(&mut self, _tm: &mut Tm, _v: &Self::Value) -> Result<(), PdError> {
        Ok(())
    }
    /// Whether `a` and `b` hold the same references, so overwriting one
    /// with the other drops nothing.
    fn equal(&self, a: &Self::Value, b: &Self::Value) -> bool {
        a == b
    }
}

/// The largest value size a btree of this module holds: packed values
/// pass through a stack buffer this big, so an insert allocates nothing.
pub const MAX_VALUE_SIZE: usize = 64;

/// Little-endian 64-bit values that refer to nothing.
pub struct Le64;

impl ValueType for Le64 {
    type Value = u64;
    const SIZE: usize = 8;
    fn unpack(b: &[u8]) -> u64 {
        le64(b, 0)
    }
    fn pack(v: &u64, out: &mut [u8]) {
        out[..8].copy_from_slice(&v.to_le_bytes());
    }
}

/// Little-endian 32-bit values that refer to nothing (a space map's
/// reference count tree).
pub struct Le32;

impl ValueType for Le32 {
    type Value = u32;
    const SIZE: usize = 4;
    fn unpack(b: &[u8]) -> u32 {
        le32(b, 0)
    }
    fn pack(v: &u32, out: &mut [u8]) {
        out[..4].copy_from_slice(&v.to_le_bytes());
    }
}

/// Values that are the roots of other btrees in the same metadata, whose
/// values are `V` (the kernel's multi-level trees, `dm_btree_info`
/// `levels` > 1, and its `subtree_inc`/`subtree_dec`): a copy takes a
/// reference to the subtree's root, and dropping the last one deletes
/// the subtree.
pub struct Subtrees<V>(pub V);

impl<V: ValueType> ValueType for Subtrees<V> {
    type Value = u64;
    const SIZE: usize = 8;
    fn unpack(b: &[u8]) -> u64 {
        le64(b, 0)
    }
    fn pack(v: &u64, out: &mut [u8]) {
        out[..8].copy_from_slice(&v.to_le_bytes());
    }
    fn inc(&mut self, tm: &mut Tm, root: &u64) -> Result<(), PdError> {
        tm.inc(*root)
    }
    fn dec(&mut self, tm: &mut Tm, root: &u64) -> Result<(), PdError> {
        btree::del(tm, *root, &mut self.0)
    }
}
